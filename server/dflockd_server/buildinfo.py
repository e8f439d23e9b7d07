"""Which build of the server runs (``compiled`` by mypyc, server/hatch_build.py, or ``pure``), and
on which event loop: what ``dflockd --version``, the start-up log, ``hello`` and ``stats`` say."""

from __future__ import annotations

import importlib.util
from importlib.machinery import EXTENSION_SUFFIXES

from dflockd_server import dispatch

__all__ = ["BUILD", "auto_loop_name", "describe"]

COMPILED = "compiled"
PURE = "pure"
# dispatch's file is a C extension's when compiled
BUILD = COMPILED if (dispatch.__file__ or "").endswith(tuple(EXTENSION_SUFFIXES)) else PURE


def auto_loop_name() -> str:
    """The loop ``--event-loop auto`` runs here."""
    return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"


def describe(loop: str) -> str:
    """``compiled, uvloop`` / ``pure Python, asyncio``."""
    return f"{'compiled' if BUILD == COMPILED else 'pure Python'}, {loop}"
