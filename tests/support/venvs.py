"""Fresh virtual environments for tests that install the project as a user would: the built
distributions, other interpreters on this machine, and uv to drive both."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


BUILD_TIMEOUT_S = 600
"""For a test whose fixtures build the distributions: the server's wheel is a C build (mypyc,
about a minute on 2 idle cores, longer on a loaded machine)."""


def uv(*args: str, cwd: Path = ROOT, env: dict[str, str] | None = None) -> str:
    """Run uv (the one running this session under `uv run`, else the one on PATH), with
    ``env`` added to this process's environment."""
    command = os.environ.get("UV") or shutil.which("uv")  # `uv run` names itself in $UV
    assert command, "these tests need uv (`uv run pytest`, or uv on PATH)"
    done = subprocess.run(
        [command, *args],
        check=False,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        env={**os.environ, **(env or {})},
    )
    if done.returncode != 0:
        raise AssertionError(f"uv {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def find_python(version: str) -> str | None:
    """A working interpreter of ``version`` ("3.12") on this machine: on PATH, or under pyenv's
    root (whose shims answer only for the version pyenv has selected)."""
    candidates: list[str] = [f"python{version}"]
    if shutil.which("pyenv"):
        root = subprocess.run(["pyenv", "root"], capture_output=True, text=True, check=False)
        if root.returncode == 0:
            versions = Path(root.stdout.strip()) / "versions"
            candidates += [
                str(p) for p in sorted(versions.glob(f"{version}.*/bin/python{version}"))
            ]
    for candidate in candidates:
        try:
            probe = subprocess.run(
                [candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                capture_output=True,
                text=True,
                check=False,
                timeout=30,
            )
        except OSError:
            continue
        if probe.returncode == 0 and probe.stdout.strip() == version:
            return candidate
    return None


def build_dist(out: Path) -> Path:
    """Both distributions of this checkout, wheels and sdists, built into ``out``."""
    uv("build", "--all-packages", "--out-dir", str(out))
    return out


PREBUILT_DIST_ENV = "CELERY_DFLOCK_TEST_DIST"
"""Names a folder where `build_dist` already built this checkout's distributions (CI builds
them beside its lint phases, where a core is idle, instead of in the suite)."""


def build_dist_once(basetemp: Path) -> Path:
    """`build_dist` once for the pytest session of ``basetemp``: the first of its pytest-xdist
    workers to ask builds, under a lock, and the others take the same folder; or the folder
    that ``CELERY_DFLOCK_TEST_DIST`` names, built already."""
    prebuilt = os.environ.get(PREBUILT_DIST_ENV)
    if prebuilt:
        out = Path(prebuilt)
        built = sorted(p.name for p in out.glob("*") if p.suffix in (".whl", ".gz"))
        assert len(built) == 4, (
            f"{PREBUILT_DIST_ENV}={prebuilt}: not both wheels and sdists: {built}"
        )
        return out
    shared = basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp
    out = shared / "dist-shared"
    with (shared / "dist-shared.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = shared / "dist-shared.done"
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)
            build_dist(out)
            done.touch()
    return out


def make_venv(
    folder: Path,
    python: str,
    *requirements: str,
    find_links: Path,
    env: dict[str, str] | None = None,
) -> Path:
    """A fresh venv in ``folder`` with ``requirements`` installed by name (the project's own
    distributions from ``find_links``, the rest from the package index); its python. ``env``:
    for uv (and the builds it runs)."""
    uv("venv", "--quiet", "--python", python, str(folder), cwd=folder.parent)
    venv_python = folder / "bin" / "python"
    install(venv_python, *requirements, find_links=find_links, env=env)
    return venv_python


def install(
    venv_python: Path, *requirements: str, find_links: Path, env: dict[str, str] | None = None
) -> None:
    """Install ``requirements`` by name into the venv of ``venv_python``, as `make_venv` does."""
    uv(
        "pip",
        "install",
        "--quiet",
        "--python",
        str(venv_python),
        "--find-links",
        str(find_links),
        *requirements,
        cwd=venv_python.parent.parent.parent,
        env=env,
    )
