"""Which build of the server runs, and on which event loop: what ``dflockd --version``, the
start-up log, ``hello`` and ``stats`` say.

The build is ``compiled`` when the request path was built by mypyc (the wheel a ``pip
install`` gives where a compiled one fits, or where a C compiler built it; server/hatch_build.py),
``pure`` for the pure-Python one (an editable install, or a wheel built without a compiler).
A compiled module is a C extension: its ``__file__`` ends with an extension suffix, not ``.py``.
"""

from __future__ import annotations

import importlib.util
from importlib.machinery import EXTENSION_SUFFIXES

from dflockd_server import dispatch

__all__ = ["BUILD", "auto_loop_name", "describe"]

COMPILED = "compiled"
PURE = "pure"


def _build() -> str:
    path = dispatch.__file__ or ""  # compiled with the rest of the request path, or not
    return COMPILED if path.endswith(tuple(EXTENSION_SUFFIXES)) else PURE


BUILD = _build()
"""``compiled`` or ``pure``: this process's server package."""


def auto_loop_name() -> str:
    """The loop ``--event-loop auto`` (the default) runs here: ``uvloop`` when it is
    installed, else ``asyncio``."""
    return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"


def describe(loop: str) -> str:
    """``compiled, uvloop`` / ``pure Python, asyncio``: the build and ``loop``, for people."""
    return f"{'compiled' if BUILD == COMPILED else 'pure Python'}, {loop}"
