"""tests/ is one package: every module in it has one name, so none is loaded twice (two copies
of a module hold two copies of its classes and constants, and ``isinstance`` and module state
then disagree between the two). Run with the whole suite, this also covers every test module
and conftest the session collected."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path

import tests
import tests.support

TESTS = Path(tests.__file__).resolve().parent


def _names_by_file() -> dict[Path, list[str]]:
    """The names under which each file below tests/ is in ``sys.modules``."""
    found: dict[Path, list[str]] = {}
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if not isinstance(file, str):
            continue
        path = Path(file).resolve()
        if TESTS in path.parents:
            found.setdefault(path, []).append(name)
    return found


def _inside_tests(entry: str) -> bool:
    path = Path(entry).resolve()
    return path == TESTS or TESTS in path.parents


def test_every_test_module_is_loaded_under_one_name() -> None:
    for info in pkgutil.iter_modules(tests.support.__path__, "tests.support."):
        importlib.import_module(info.name)
    loaded = _names_by_file()
    assert TESTS / "support" / "workers.py" in loaded
    twice = {str(path): names for path, names in loaded.items() if len(names) > 1}
    assert twice == {}
    # What made two names possible: a test folder on sys.path beside the checkout.
    assert [entry for entry in sys.path if entry and _inside_tests(entry)] == []
