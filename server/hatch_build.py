"""Compiled wheels of the lock server: the request path's pure modules built by mypyc.

A wheel build compiles them by default: ``uv build --all-packages`` (the README's install) and
``pip install`` from the sdist make a wheel that carries a C extension for each module of
`COMPILED` beside its ``.py`` (Python imports the extension first), tagged for this platform
and CPython. It needs a C compiler and the Python headers; mypy (which brings mypyc) and
setuptools are installed into the build environment. Where the compiler or the headers are
missing, or the compilation fails, the build warns and makes the pure-Python wheel (any
platform), which runs the same server with more CPU per request. ``DFLOCKD_SERVER_BUILD``
chooses:

- ``auto`` (or unset): compiled where it can be, else the pure wheel with a warning;
- ``compiled``: compiled or the build fails (the container image, cibuildwheel's wheels);
- ``pure``: the pure-Python wheel, without mypy in the build environment.

Editable installs (``uv sync``, ``pip install -e``) are never compiled, and their build
environment gets no mypy: the editable one is pure Python, so that the workspace runs the
sources as they are edited. The compiled modules need nothing at run time. The image's
build stage (server/Dockerfile, run in server/)::

    DFLOCKD_SERVER_BUILD=compiled pip wheel --no-deps --wheel-dir dist .
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

COMPILED = (
    "constants",
    "keys",
    "leases",
    "tokens",
    "protocol",
    "grants",
    "table",
    "journal",
    "recorded",
    "replay",
    "dispatch",
    "stream",
    "connection",
)
"""The request path's modules: parse, route, the lock table, the journal's records, reply
bytes, and the connection's side of it (``stream``: reading, the batched replies, and
``connection``: a request's way from the bytes to the table): compiling those two took a
further 18% off the server's instructions per round-trip pair (95.8k to 78.8k under
callgrind). The rest of the network side (the listener, TLS, start-up and shut-down) stays
Python (issue 52 removed the compiled turn and socket transport of asyncio's loop: the default
install runs uvloop). `tokens` issues a fencing token per grant: left in Python it was the
one interpreted call of a compiled grant, about 6,500 of a pipelined pair's 42,200
instructions. `fence` (the ceiling's stores) stays Python: its error class derives from
`OSError`, which a compiled class cannot without a run-time dependency (mypy_extensions)."""

MYPY_OPTIONS = (
    "--disable-error-code",
    "func-returns-value",
    "--follow-imports=silent",
    "--ignore-missing-imports",
)
"""`dispatch` returns the value of calls typed ``-> None`` (a reply sent later is ``None``);
the modules not compiled are read for their types only (pyright checks them, strict), and the
optional ``prometheus_client`` need not be installed to build."""


MODE_VARIABLE = "DFLOCKD_SERVER_BUILD"
MODES = ("auto", "compiled", "pure")
BUILD_DEPENDENCIES = ["mypy==2.4.1", "setuptools>=70"]
"""What the compilation imports, installed into the build environment of a wheel build."""


class CompileHook(BuildHookInterface[Any]):
    """Compile `COMPILED` with mypyc in a scratch copy and add the extensions to the wheel
    (see the module's doc for when)."""

    PLUGIN_NAME = "custom"

    def dependencies(self) -> list[str]:
        """mypy and setuptools, but for a pure build or an editable install (see
        `_asked_for_an_editable`)."""
        if _mode() == "pure" or _asked_for_an_editable():
            return []
        return list(BUILD_DEPENDENCIES)

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        mode = _mode()
        if self.target_name != "wheel" or version == "editable" or mode == "pure":
            return
        missing = _missing_toolchain()
        if missing is not None:
            if mode == "compiled":
                raise RuntimeError(f"{MODE_VARIABLE}=compiled, but there is {missing}")
            self._fall_back(f"there is {missing}")
            return
        try:
            built = self._compile()
        except (Exception, SystemExit) as exc:  # mypyc exits on a type error
            if mode == "compiled":
                raise
            self._fall_back(f"the compilation failed: {exc!r}")
            return
        for path in built:
            build_data["force_include"][str(path)] = str(path.relative_to(self._work))
        build_data["pure_python"] = False
        build_data["infer_tag"] = True

    def _fall_back(self, why: str) -> None:
        self.app.display_warning(
            f"dflockd-server: building the pure-Python wheel, not the compiled one: {why}. "
            "It runs the same server with up to twice the CPU per request of the compiled "
            "one (docs/server.md, Compiled wheels). Install a C "
            f"compiler and the Python headers (Debian: gcc python3-dev), or set "
            f"{MODE_VARIABLE}=compiled to make this an error, or =pure to silence it."
        )

    def _compile(self) -> list[Path]:
        """mypyc on `COMPILED` in a scratch copy of the package; the extensions it built."""
        from mypyc.build import mypycify  # in the build environment (`dependencies`)
        from setuptools import Distribution
        from setuptools.command.build_ext import build_ext

        package = Path(self.root) / "dflockd_server"
        modules = [m for m in COMPILED if (package / f"{m}.py").exists()]
        self._work = Path(tempfile.mkdtemp(prefix="dflockd-mypyc-"))
        shutil.copytree(package, self._work / "dflockd_server")
        here = os.getcwd()
        os.chdir(self._work)  # mypyc writes its build files beside what it compiles
        try:
            extensions = mypycify(
                [*MYPY_OPTIONS, *(f"dflockd_server/{m}.py" for m in modules)], opt_level="3"
            )
            dist = Distribution({"name": "dflockd-server", "ext_modules": extensions})
            command = build_ext(dist)
            command.inplace = True
            command.ensure_finalized()
            command.run()
        finally:
            os.chdir(here)
        built = sorted(  # in place: beside the sources (build_ext keeps copies under build/)
            p
            for p in self._work.rglob(f"*{_suffix()}")
            if p.relative_to(self._work).parts[0] != "build"
        )
        compiled = {p.name.split(".", 1)[0] for p in built if p.parent.name == "dflockd_server"}
        if compiled != set(modules):
            raise RuntimeError(f"mypyc built {sorted(compiled)}, expected {modules}")
        return built

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        work: Path | None = getattr(self, "_work", None)
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)


def _mode() -> str:
    mode = os.environ.get(MODE_VARIABLE, "").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{MODE_VARIABLE}={mode!r}: expected one of {', '.join(MODES)}")
    return mode


def _asked_for_an_editable() -> bool:
    """True while the build backend answers ``get_requires_for_build_editable`` (PEP 660).

    hatchling asks a hook for its dependencies without saying for which build, and an
    editable install compiles nothing (`initialize`), so mypy there would be a download and an
    install for nothing: on ``uv run celery-dflock demo`` in a fresh clone, the README's first
    command. Where a front-end calls the backend otherwise, this answers False and the
    editable build only gets mypy for nothing."""
    frame = sys._getframe(1)  # pyright: ignore[reportPrivateUsage]
    while frame is not None:
        if frame.f_code.co_name == "get_requires_for_build_editable":
            return True
        frame = frame.f_back
    return False


def _missing_toolchain() -> str | None:
    """Why this machine cannot compile the extensions (no C compiler, no Python headers), or
    None."""
    compiler = os.environ.get("CC") or str(sysconfig.get_config_var("CC") or "cc")
    program = (shlex.split(compiler) or ["cc"])[0]
    if shutil.which(program) is None:
        return f"no C compiler ({program!r} is not on PATH; CC names another)"
    include = Path(sysconfig.get_path("include"))
    if not (include / "Python.h").is_file():
        return f"no Python headers (no Python.h in {include})"
    return None


def _suffix() -> str:
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    return str(suffix) if suffix else f".cpython-{sys.version_info[0]}{sys.version_info[1]}.so"
