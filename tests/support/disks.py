"""Disks that fail, for the journal's tests (root only: the tests are skipped elsewhere): a small
tmpfs that fills up, with the file that fills it to the last byte; and an ext4 file system of
its own, on a loop device, that ``fsfreeze`` stalls (every write to it waits until it thaws,
as on a disk that stops answering or while a snapshot tool holds it frozen)."""

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
    """A tmpfs of ``size`` mounted at ``where`` (made here) for the ``with`` block."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs (a disk that fills up) needs root")
    where.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace')}")
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
def own_ext4(where: Path, image: Path, size: str) -> Iterator[Path]:
    """An ext4 file system of ``size`` in the file ``image``, mounted at ``where`` (made here)
    through a loop device for the ``with`` block: one that ``frozen`` can stall alone."""
    tools = ("mount", "mkfs.ext4", "fsfreeze", "truncate")
    if os.geteuid() != 0 or any(shutil.which(tool) is None for tool in tools):
        pytest.skip(f"a file system of its own to freeze needs root and {', '.join(tools)}")
    subprocess.run(["truncate", "-s", size, str(image)], check=True)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True, check=False)
    if made.returncode != 0:
        pytest.skip(f"cannot make an ext4 file system: {made.stderr.decode(errors='replace')}")
    where.mkdir()
    done = subprocess.run(
        ["mount", "-o", "loop", str(image), str(where)], capture_output=True, check=False
    )
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
