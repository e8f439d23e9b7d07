"""Disks that fail, for the journal's tests (root only: the tests are skipped elsewhere): a small
tmpfs that fills up, with the file that fills it to the last byte; and an ext4 file system of
its own, on a loop device, that ``fsfreeze`` stalls (every write to it waits until it thaws,
as on a disk that stops answering or while a snapshot tool holds it frozen), or that a disk
error turns read-only (ext4's own error path, ``errors=remount-ro``), repaired then as an
operator repairs it (``repaired``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``where`` (made here) for the ``with`` block (the test
    is skipped where none can be mounted)."""
    with small_tmpfs_or_none(where, size) as disk:
        if disk is None:
            pytest.skip("mounting a small tmpfs (a disk that fills up) needs root and mount")
        yield disk


@contextlib.contextmanager
def small_tmpfs_or_none(where: Path, size: str) -> Iterator[Path | None]:
    """`small_tmpfs`, or None where none can be mounted (not root): for a fixture that many
    tests share, of which only the full-disk one skips without it."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        yield None
        return
    where.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        yield None
        return
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(disk: Path) -> Path:
    """Fill ``disk`` to the last byte (big writes, then smaller ones, then single bytes); the
    file that fills it (remove it to give the space back)."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for chunk in (b"\0" * 65536, b"\0" * 512, b"\0"):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, chunk)
    finally:
        os.close(fd)
    return filler


@contextlib.contextmanager
def own_ext4(where: Path, image: Path, size: str, *, options: str = "") -> Iterator[Path]:
    """An ext4 file system of ``size`` in the file ``image``, mounted at ``where`` (made here)
    through a loop device for the ``with`` block, with the mount ``options`` (``-o``): one that
    ``frozen`` can stall alone, or ``turn_read_only`` fail."""
    tools = ("mount", "mkfs.ext4", "fsfreeze", "truncate")
    if os.geteuid() != 0 or any(shutil.which(tool) is None for tool in tools):
        pytest.skip(f"a file system of its own to freeze needs root and {', '.join(tools)}")
    subprocess.run(["truncate", "-s", size, str(image)], check=True)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True, check=False)
    if made.returncode != 0:
        pytest.skip(f"cannot make an ext4 file system: {made.stderr.decode(errors='replace')}")
    where.mkdir()
    done = _mount(image, where, options)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a loop device here: {done.stderr.decode(errors='replace')}")
    try:
        yield where
    finally:
        subprocess.run(["fsfreeze", "-u", str(where)], capture_output=True, check=False)
        subprocess.run(["umount", "-l", str(where)], check=False)


@contextlib.contextmanager
def frozen(mount: Path) -> Iterator[None]:
    """``mount`` frozen (``fsfreeze -f``) for the ``with`` block: every write to it, and every
    fsync, waits until it thaws. The caller must not touch it meanwhile: it would wait too."""
    subprocess.run(["fsfreeze", "-f", str(mount)], check=True)
    try:
        yield
    finally:
        subprocess.run(["fsfreeze", "-u", str(mount)], check=True)


def _mount(image: Path, where: Path, options: str) -> subprocess.CompletedProcess[bytes]:
    loop = ",".join(["loop", options]) if options else "loop"
    return subprocess.run(
        ["mount", "-o", loop, str(image), str(where)], capture_output=True, check=False
    )


def turn_read_only(mount: Path) -> None:
    """A disk error under ``mount`` (an ``own_ext4`` mounted ``errors=remount-ro``, as Debian
    mounts its root): ext4's own error path, through its ``trigger_fs_error`` in sysfs. The
    file system's journal is aborted and it is remounted read-only: every write and fsync
    fails (``EROFS``) from then on, and what was written but not yet on the disk is lost when
    it is unmounted. Skips where the kernel has no such file."""
    source = subprocess.run(
        ["findmnt", "-n", "-o", "SOURCE", str(mount)], capture_output=True, text=True, check=True
    ).stdout.strip()
    trigger = Path("/sys/fs/ext4") / Path(source).name / "trigger_fs_error"
    if not trigger.exists():
        pytest.skip(f"this kernel cannot fail an ext4 file system on purpose (no {trigger})")
    trigger.write_text("a disk error, injected by the test\n")


def repaired(mount: Path, image: Path, options: str = "") -> None:
    """What an operator does with a file system a disk error turned read-only (the server
    stopped first: nothing may hold it open): unmount it, ``e2fsck -fy`` it, mount it again
    at ``mount`` with the same ``options``."""
    remounted(mount, image, options, fsck=True)


def remounted(mount: Path, image: Path, options: str = "", *, fsck: bool = False) -> None:
    """Unmount ``mount`` (an ``own_ext4``; nothing may hold it open) and mount it again: the
    same file system, a new mount, a cold page cache; ``fsck``: ``e2fsck -fy`` it between."""
    subprocess.run(["umount", str(mount)], check=True)
    if fsck:
        checked = subprocess.run(["e2fsck", "-fy", str(image)], capture_output=True, check=False)
        assert checked.returncode < 4, checked.stdout.decode(errors="replace")  # 4: uncorrected
    done = _mount(image, mount, options)
    assert done.returncode == 0, done.stderr.decode(errors="replace")


@contextlib.contextmanager
def bound(source: Path, where: Path) -> Iterator[Path]:
    """``source`` bind-mounted at ``where`` (made if missing) for the ``with`` block: another
    mount of a file system that stays mounted, as a container runtime gives a container its
    volume anew at each start."""
    where.mkdir(exist_ok=True)
    subprocess.run(["mount", "--bind", str(source), str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)
