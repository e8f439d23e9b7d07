"""The server package imports nothing outside the standard library but uvloop (a dependency where it
exists; the server runs without it)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import dflockd_server

PACKAGE_DIR = Path(dflockd_server.__file__).parent
ALLOWED = set(sys.stdlib_module_names) | {"dflockd_server", "uvloop"}
# The optional metrics extra: imported only by the metrics module, only when metrics are on.
OPTIONAL = {"metrics.py": {"prometheus_client"}}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, top-level module) of every import statement, including ``importlib`` strings."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name.split(".")[0]) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: inside the package
                continue
            assert node.module is not None
            found.append((node.lineno, node.module.split(".")[0]))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value.split(".")[0]))
    return found


def test_server_imports_only_the_standard_library() -> None:
    files = sorted(PACKAGE_DIR.glob("*.py"))
    assert len(files) >= 8, files  # the walk really sees the package
    offenders = [
        f"{path.name}:{line}: {module}"
        for path in files
        for line, module in imported_modules(path)
        if module not in ALLOWED | OPTIONAL.get(path.name, set())
    ]
    assert offenders == []


def test_the_server_runs_without_the_metrics_extra() -> None:
    """Blocking prometheus_client's import, the server package still imports and serves."""
    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"
        "from dflockd_server import Config\n"
        "from dflockd_server.testing import ServerThread\n"
        "with ServerThread(Config(host='127.0.0.1', port=0)) as s:\n"
        "    import socket\n"
        "    c = socket.create_connection(s.address)\n"
        "    c.sendall(b'ping\\n_\\n_\\n')\n"
        "    print(c.recv(16))\n"
        "    c.close()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "b'ok\\n'"


def test_the_check_catches_a_third_party_import(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import json\n"
        "from celery import Celery\n"
        "import importlib\n"
        "importlib.import_module('redis')\n"
    )
    modules = [m for _, m in imported_modules(sample)]
    assert [m for m in modules if m not in ALLOWED] == ["celery", "redis"]


def test_server_pyproject_depends_on_uvloop_only() -> None:
    """uvloop, where it exists (issue 52: the default install runs on it); the server runs
    without it on asyncio's own loop."""
    import tomllib

    pyproject = tomllib.loads((PACKAGE_DIR.parent / "pyproject.toml").read_text())
    assert pyproject["project"]["dependencies"] == ["uvloop>=0.19; sys_platform != 'win32'"]
