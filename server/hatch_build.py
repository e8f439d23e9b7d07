"""Compiled wheels of the lock server: the request path's pure modules built by mypyc.

Off by default: ``uv build --package dflockd-server`` makes the pure-Python wheel (any
platform, no compiler). With the hook enabled, the wheel carries a C extension for each module
of `COMPILED` beside its ``.py`` (Python imports the extension first), and is tagged for this
platform and CPython::

    cd server && HATCH_BUILD_HOOK_ENABLE_CUSTOM=1 pip wheel --no-deps --wheel-dir dist .

(the container image's build stage, server/Dockerfile; ``uv build --package dflockd-server``
with the same variable builds the same wheel)

The build needs a C compiler and the Python headers; mypy (which brings mypyc) and setuptools
are installed into the build environment only when the hook is enabled. The compiled modules
need nothing at run time: the server keeps no required dependency. Where no compiled wheel
fits (another platform or CPython), pip takes the pure-Python wheel or the sdist.
"""

from __future__ import annotations

import os
import shutil
import sys
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
    "tablecore",
    "holds",
    "table",
    "journal",
    "dispatch",
    "stream",
    "connection",
    "turn",
    "transport",
)
"""The request path's modules: parse, route, the lock table, the journal's records, reply
bytes, and the connection's side of it (``stream``: reading, the batched replies, and
``connection``: a request's way from the bytes to the table): compiling those two took a
further 18% off the server's instructions per round-trip pair (95.8k to 78.8k under
callgrind). On asyncio's own loop, its turn (``turn``) and the accepted connections' socket
transport (``transport``: 69.5k to 62.0k per pair at one connection, and 15% less CPU per pair
at 10 and 50 connections). The rest of the network side (the listener, TLS, start-up and
shut-down) stays Python. `tokens` issues a fencing token per grant: left in Python it was the
one interpreted call of a compiled grant, about 6,500 of a pipelined pair's 42,200
instructions. `fence` (the ceiling's stores) stays Python: its error class derives from
`OSError`, which a compiled class cannot without a run-time dependency (mypy_extensions).
`transport_handle` stays Python: CPython 3.13's ``asyncio.Server`` holds it weakly, and a
compiled class cannot be referred to weakly."""

MYPY_OPTIONS = (
    "--disable-error-code",
    "func-returns-value",
    "--follow-imports=silent",
    "--ignore-missing-imports",
)
"""`dispatch` returns the value of calls typed ``-> None`` (a reply sent later is ``None``);
the modules not compiled are read for their types only (pyright checks them, strict), and the
optional ``prometheus_client`` need not be installed to build."""


class CompileHook(BuildHookInterface[Any]):
    """Compile `COMPILED` with mypyc in a scratch copy and add the extensions to the wheel."""

    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel" or version == "editable":
            return
        from mypyc.build import mypycify  # only in a build with this hook enabled
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
        for path in built:
            build_data["force_include"][str(path)] = str(path.relative_to(self._work))
        build_data["pure_python"] = False
        build_data["infer_tag"] = True

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        work: Path | None = getattr(self, "_work", None)
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)


def _suffix() -> str:
    import sysconfig

    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    return str(suffix) if suffix else f".cpython-{sys.version_info[0]}{sys.version_info[1]}.so"
