"""The layers hold: a walk over every module's imports (read with ``ast``, nothing imported).

- no import circle among the module-level imports of ``celery_dflock`` or ``dflockd_server``;
- nothing outside the client layer imports a private module of the client;
- the client layer imports nothing of Celery or of the Celery layer, and importing the blocking
  or the asyncio client does not import Celery (checked in a fresh interpreter);
- the server imports nothing of Celery or of the plugin.

ARCHITECTURE.md names the layers; this test is where they are enforced.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import pytest

ROOT: Final = Path(__file__).resolve().parent.parent
PACKAGES: Final = {
    "celery_dflock": ROOT / "celery_dflock",
    "dflockd_server": ROOT / "server" / "dflockd_server",
}

CLIENT_PUBLIC: Final = frozenset(
    {
        "celery_dflock.client",
        "celery_dflock.aio",
        "celery_dflock.pool",
        "celery_dflock.protocol",
        "celery_dflock.sharding",
        "celery_dflock.cluster",
        "celery_dflock.errors",
        "celery_dflock.clients",
    }
)
"""The client layer's public modules (anyone may import them)."""
CLIENT_PRIVATE_PREFIXES: Final = (
    "celery_dflock._core",
    "celery_dflock._connection",
    "celery_dflock._renewal",
    "celery_dflock._watch",
    "celery_dflock._pooling",
    "celery_dflock._aio_backend",
    "celery_dflock._sync_backend",
    "celery_dflock._async",
    "celery_dflock._sync",
)
"""The client layer's private modules: only the client layer imports them."""
SHARED: Final = frozenset({"celery_dflock._threads"})
"""Small helpers below both layers (threads that leave signals to the main thread)."""


def is_client_private(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in CLIENT_PRIVATE_PREFIXES)


def in_client_layer(module: str) -> bool:
    return module in CLIENT_PUBLIC or is_client_private(module) or module in SHARED


@dataclass
class Module:
    name: str
    path: Path
    top_level: set[str] = field(default_factory=set)  # imported when this module is imported
    anywhere: set[str] = field(default_factory=set)  # also inside functions and TYPE_CHECKING


def module_name(package: str, root: Path, path: Path) -> str:
    parts = [package, *path.relative_to(root).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve(current: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = current.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(tree: ast.Module, name: str, is_package: bool) -> tuple[set[str], set[str]]:
    top: set[str] = set()
    anywhere: set[str] = set()

    def names(node: ast.Import | ast.ImportFrom) -> Iterator[str]:
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
            return
        base = resolve(name, is_package, node)
        yield base
        for alias in node.names:  # `from pkg import module` imports pkg.module
            yield f"{base}.{alias.name}"

    def walk(nodes: list[ast.stmt], module_level: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.Import | ast.ImportFrom):
                found = set(names(node))
                anywhere.update(found)
                if module_level:
                    top.update(found)
            elif isinstance(node, ast.If) and _is_type_checking(node):
                walk(node.body, False)
                walk(node.orelse, module_level)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                walk(node.body, False)
            elif isinstance(node, ast.ClassDef):
                walk(node.body, module_level)
            elif isinstance(node, ast.If | ast.Try | ast.With | ast.For | ast.While):
                for block in ("body", "orelse", "finalbody", "handlers"):
                    children = getattr(node, block, [])
                    for child in children:
                        if isinstance(child, ast.ExceptHandler):
                            walk(child.body, module_level)
                    walk([c for c in children if isinstance(c, ast.stmt)], module_level)

    walk(tree.body, True)
    return top, anywhere


def load() -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for package, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            name = module_name(package, root, path)
            tree = ast.parse(path.read_text(), str(path))
            top, anywhere = imports(tree, name, path.name == "__init__.py")
            modules[name] = Module(name, path, top, anywhere)
    for module in modules.values():  # `from x import name` adds x.name: keep the modules
        module.top_level = {m for m in module.top_level if m in modules and m != module.name}
        module.anywhere = {own_module(m, modules) for m in module.anywhere} - {module.name}
    return modules


def own_module(name: str, modules: dict[str, Module]) -> str:
    """Our module that ``name`` is or is in (``a.b.Name`` -> ``a.b``); others unchanged."""
    if name.split(".", maxsplit=1)[0] not in PACKAGES:
        return name
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


MODULES: Final = load()


def find_cycle(modules: dict[str, Module]) -> list[str] | None:
    done: set[str] = set()
    stack: list[str] = []
    on_stack: set[str] = set()

    def visit(name: str) -> list[str] | None:
        stack.append(name)
        on_stack.add(name)
        for dep in sorted(modules[name].top_level):
            # importing a.b first imports its package a: a package's __init__ is no circle of a.b
            if name.startswith(dep + "."):
                continue
            if dep in on_stack:
                return [*stack[stack.index(dep) :], dep]
            if dep not in done and (found := visit(dep)):
                return found
        stack.pop()
        on_stack.discard(name)
        done.add(name)
        return None

    for name in sorted(modules):
        if name not in done and (found := visit(name)):
            return found
    return None


def test_the_walk_sees_the_layers() -> None:
    """The walk itself is not empty: it finds the modules and imports it reasons about."""
    assert "celery_dflock._sync.lock" in MODULES and "dflockd_server.net" in MODULES
    assert "celery_dflock._core" in MODULES["celery_dflock._async.lock"].top_level
    assert find_cycle({"a": Module("a", ROOT, {"b"}), "b": Module("b", ROOT, {"a"})}) == [
        "a",
        "b",
        "a",
    ]


def test_no_import_circle() -> None:
    assert find_cycle(MODULES) is None


def test_nothing_outside_the_client_imports_its_private_modules() -> None:
    offenders = sorted(
        f"{module.name} imports {dep}"
        for module in MODULES.values()
        if module.name.startswith("celery_dflock") and not in_client_layer(module.name)
        for dep in module.anywhere
        if is_client_private(dep)
    )
    assert offenders == []


def test_the_client_layer_imports_nothing_of_celery() -> None:
    offenders = sorted(
        f"{module.name} imports {dep}"
        for module in MODULES.values()
        if in_client_layer(module.name)
        for dep in module.anywhere
        if dep == "celery"
        or dep.startswith("celery.")
        or (dep.startswith("celery_dflock") and not in_client_layer(dep) and dep != "celery_dflock")
    )
    assert offenders == []


def test_the_server_imports_nothing_of_celery_or_the_plugin() -> None:
    offenders = sorted(
        f"{module.name} imports {dep}"
        for module in MODULES.values()
        if module.name.startswith("dflockd_server")
        for dep in module.anywhere
        if dep.split(".")[0] in {"celery", "celery_dflock", "kombu"}
    )
    assert offenders == []


@pytest.mark.parametrize(
    "module", ["celery_dflock.client", "celery_dflock.aio", "celery_dflock.pool"]
)
def test_importing_the_client_does_not_import_celery(module: str) -> None:
    code = (
        f"import sys, {module}\n"
        "loaded = sorted(m for m in sys.modules if m == 'celery' or m.startswith('celery.'))\n"
        "print(loaded)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
