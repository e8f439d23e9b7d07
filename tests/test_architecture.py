"""The layers hold: a walk over every module's imports (read with ``ast``, nothing imported).

- no import circle among the modules of ``celery_dflock`` or ``dflockd_server``, counting every
  import statement: module-level ones, and those inside functions and ``if TYPE_CHECKING:``
  (a function-level import hides a circle, it does not break it);
- nothing outside the client layer imports a private module of the client;
- the client layer imports nothing of Celery or of the Celery layer, and importing the blocking
  or the asyncio client does not import Celery (checked in a fresh interpreter);
- the server imports nothing of Celery or of the plugin;
- the Celery layer's private modules are the few ARCHITECTURE.md names (issue 53);
- one option's way down, from ``app.conf`` to the request's bytes, is the path ARCHITECTURE.md
  gives (a traced run of a locked task on an in-process server: the one test that imports).

ARCHITECTURE.md names the layers; this test is where they are enforced.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Final

import pytest

ROOT: Final = Path(__file__).resolve().parent.parent
PACKAGES: Final = {
    "celery_dflock": ROOT / "celery_dflock",
    "dflockd_server": ROOT / "server" / "dflockd_server",
}

CLIENT: Final = "celery_dflock.client"
"""The client layer's folder: everything that talks to lock servers."""
SERVER_ALLOWED: Final = frozenset({"celery_dflock.demo.runner", "celery_dflock.pytest_plugin"})
"""The plugin's modules that start a lock server in-process (the `server` extra)."""


def in_client_layer(module: str) -> bool:
    return module == CLIENT or module.startswith(CLIENT + ".")


def is_client_private(module: str) -> bool:
    """A module of the client whose name (or a folder's on its path) starts with ``_``."""
    if not module.startswith(CLIENT + "."):
        return False
    return any(part.startswith("_") for part in module[len(CLIENT) + 1 :].split("."))


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


def every_import(module: Module) -> set[str]:
    """The modules ``module`` imports anywhere: at module level, in a function, or for type
    checking only."""
    return module.anywhere


def find_cycle(
    modules: dict[str, Module], edges: Callable[[Module], set[str]] = every_import
) -> list[str] | None:
    """A circle of imports (``[a, b, a]``) among ``modules``, following ``edges``; None."""
    done: set[str] = set()
    stack: list[str] = []
    on_stack: set[str] = set()

    def visit(name: str) -> list[str] | None:
        stack.append(name)
        on_stack.add(name)
        for dep in sorted(edges(modules[name]) & modules.keys()):
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
    assert "celery_dflock.client._sync.lock" in MODULES and "dflockd_server.net" in MODULES
    assert "celery_dflock.client._core" in MODULES["celery_dflock.client._async.lock"].top_level
    assert find_cycle({"a": Module("a", ROOT, anywhere={"b"}), "b": Module("b", ROOT)}) is None
    # a function-level import (or one for type checking only) closes a circle too
    circle = {"a": Module("a", ROOT, anywhere={"b"}), "b": Module("b", ROOT, anywhere={"a"})}
    assert find_cycle(circle) == ["a", "b", "a"]
    assert "celery_dflock.task" in MODULES["celery_dflock.signals"].anywhere


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_import_circle(package: str) -> None:
    """No circle among a package's modules, counting every import statement: module-level
    ones, function-level ones and ``if TYPE_CHECKING:`` ones."""
    own = {name: module for name, module in MODULES.items() if name.split(".")[0] == package}
    assert find_cycle(own) is None


MAX_MODULE_LINES: Final = 900
"""Issue 53: the rule is one concept per file (the old 600-line cap, which split classes across
files, is retired); a module past this is doing two things."""
GENERATED: Final = ROOT / "celery_dflock" / "client" / "_sync"
"""Written by scripts/unasync.py from ``_async/``, whose modules are counted."""


def test_no_module_is_over_900_lines() -> None:
    long = sorted(
        f"{module.name}: {lines} lines"
        for module in MODULES.values()
        if not module.path.is_relative_to(GENERATED)
        and (lines := len(module.path.read_text().splitlines())) > MAX_MODULE_LINES
    )
    assert long == []
    assert any(m.path.is_relative_to(GENERATED) for m in MODULES.values())


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
    "module", ["celery_dflock.client", "celery_dflock.client.aio", "celery_dflock.client.pool"]
)
def test_importing_the_client_does_not_import_celery(module: str) -> None:
    code = (
        f"import sys, {module}\n"
        "loaded = sorted(m for m in sys.modules if m == 'celery' or m.startswith('celery.'))\n"
        "print(loaded)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_the_plugin_imports_no_server_code_but_where_it_starts_a_server() -> None:
    """The client and the Celery layer speak the wire protocol with constants of their own
    (`celery_dflock.client.wire`); only the demo and the pytest fixtures start a server."""
    offenders = sorted(
        f"{module.name} imports {dep}"
        for module in MODULES.values()
        if module.name.startswith("celery_dflock") and module.name not in SERVER_ALLOWED
        for dep in module.anywhere
        if dep.split(".")[0] == "dflockd_server"
    )
    assert offenders == []
    assert "dflockd_server.testing" in MODULES["celery_dflock.demo.runner"].anywhere


def test_importing_the_plugin_loads_no_server_module() -> None:
    """`import celery_dflock` and every public name, the Celery layer's modules included."""
    code = (
        "import sys, celery_dflock\n"
        "import celery_dflock.beat, celery_dflock.cli, celery_dflock.config\n"
        "import celery_dflock.signals, celery_dflock.task\n"
        "for name in celery_dflock.__all__:\n"
        "    getattr(celery_dflock, name)\n"
        "assert 'celery' in sys.modules\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'dflockd_server'))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_importing_the_plugin_loads_its_names_on_first_use() -> None:
    """`import celery_dflock` (and `celery_dflock.client`) loads neither lock face, nor Celery:
    a public name is imported when first used (it loaded both faces at once, 10x the time)."""
    code = (
        "import sys, celery_dflock, celery_dflock.client\n"
        "faces = ('celery_dflock.client._sync.lock', 'celery_dflock.client._async.lock',"
        " 'celery')\n"
        "print(sorted(m for m in faces if m in sys.modules))\n"
        "celery_dflock.DistributedLock\n"
        "print('celery_dflock.client._sync.lock' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split("\n")[:2] == ["[]", "True"]


def test_the_lazily_served_names_are_spelled_out_for_static_readers() -> None:
    """`celery_dflock/__init__.py` imports its public names for the type checker and the docs'
    reference (which read the file, not the running module) under ``TYPE_CHECKING``, one by
    one: a wildcard there left `mkdocs build` unable to find ``celery_dflock.Client``."""
    import celery_dflock

    tree = ast.parse(Path(celery_dflock.__file__).read_text(encoding="utf-8"))
    spelled: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for statement in node.body:
                assert isinstance(statement, ast.ImportFrom), ast.unparse(statement)
                assert all(alias.name != "*" for alias in statement.names), statement.module
                spelled.update(alias.asname or alias.name for alias in statement.names)
    assert spelled == set(celery_dflock.__all__) - {"__version__"}
    assert set(celery_dflock.__all__) == {*celery_dflock._WHERE, "__version__"}  # pyright: ignore[reportPrivateUsage]


CELERY_PRIVATE: Final = frozenset(
    {
        "_celery",  # Celery's untyped names, typed Any in one place
        "_settings",  # every option and setting: its check, default, meaning (the one table)
        "_runtime",  # per process: the Client, each task's plan, the held-lock records
        "_request",  # what a run reads and writes on Celery's request and message
        "_run",  # one locked run: plan, acquire, body under the guard, release
        "_outage",  # an unreachable lock server as a busy key
        "_queue_once",  # the publish-time hold, its hand-offs, the follower
        "_worker_hooks",  # the worker's hooks: dead children's locks, dflock_task_locks
    }
)
"""Issue 53: the Celery layer's private modules, few enough to hold in mind (eighteen were
split so that a run called back and forth between six of them). A new one is a decision:
name it here and in ARCHITECTURE.md's Celery-layer table."""


def test_the_celery_layer_keeps_its_few_private_modules() -> None:
    found = {
        path.stem
        for path in PACKAGES["celery_dflock"].glob("_*.py")
        if path.stem not in {"__init__", "__main__"}
    }
    assert found == CELERY_PRIVATE
    architecture = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    celery_section = architecture.split("## The Celery layer", 1)[1].split("\n## ", 1)[0]
    assert all(f"`{name}`" in celery_section for name in CELERY_PRIVATE)


def test_no_class_of_the_celery_layer_extends_a_lone_class_of_another_module() -> None:
    """Compose rather than inherit across files: in the Celery layer (``celery_dflock``'s own
    modules: not the client, the fences or the demo), no class has for base a class of another
    of those modules that nothing else subclasses (one class cut in two across files)."""
    layer = {
        name: ast.parse(module.path.read_text())
        for name, module in MODULES.items()
        if name.startswith("celery_dflock.") and name.count(".") == 1
    }
    subclasses: dict[str, list[str]] = {}  # "module.Class" -> "module.Class" of each subclass
    for name, tree in layer.items():
        known = {
            alias.asname or alias.name: f"{node.module}.{alias.name}"
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module
            for alias in node.names
        }
        known.update(
            {
                node.name: f"{name}.{node.name}"
                for node in tree.body
                if isinstance(node, ast.ClassDef)
            }
        )
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for base in node.bases:
                    if isinstance(base, ast.Name) and base.id in known:
                        subclasses.setdefault(known[base.id], []).append(f"{name}.{node.name}")
    lone = sorted(
        f"{only[0]} extends {base}"
        for base, only in subclasses.items()
        if base.rsplit(".", 1)[0] in layer
        and len(only) == 1
        and only[0].rsplit(".", 1)[0] != base.rsplit(".", 1)[0]
    )
    assert lone == []


WAY_DOWN_LEASE: Final = 17
"""The ``dflock_lock_ttl`` of the traced run (no default is 17)."""


def documented_way_down() -> list[tuple[str, set[str]]]:
    """ARCHITECTURE.md's "one value's way down": (file, the functions it names) per item."""
    text = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    section = text.split("### One value's way down", 1)[1].split("\n### ", 1)[0]
    return [
        (path, set(re.findall(r"`([\w.]+)`", functions)))
        for path, functions in re.findall(r"(?m)^\d+\. `([^`]+)` \(([^)]*)\)", section)
    ]


@dataclass
class WayDown:
    """What a traced run did with one lease: the functions of the package that held it
    (as an argument, a local or their result, or in the typed record that carries it, as
    their result) or handed it on, by file in the order the run first entered each."""

    is_it: Callable[[object], bool]
    carries: Callable[[object], bool]
    stack: list[tuple[FrameType, int, list[bool]]] = field(default_factory=lambda: [])
    entered: int = 0
    files: dict[str, tuple[int, set[str]]] = field(default_factory=lambda: {})
    leases: list[object] = field(default_factory=lambda: [])
    sent: list[bytes] = field(default_factory=lambda: [])

    def holds(self, values: Iterator[object]) -> bool:
        found = [value for value in values if self.is_it(value)]
        self.leases += found
        return bool(found)

    def profile(self, frame: FrameType, event: str, arg: object) -> None:
        code = frame.f_code
        if event not in {"call", "return"} or not code.co_filename.startswith(str(ROOT)):
            return
        path = Path(code.co_filename).relative_to(ROOT).as_posix()
        if not path.startswith("celery_dflock/"):
            return
        locals_: dict[str, Any] = frame.f_locals
        if event == "call":
            self.entered += 1
            held = self.holds(iter(locals_.values()))
            if held and self.stack and self.stack[-1][0] is frame.f_back:
                self.stack[-1][2][0] = True  # the caller handed it on
            self.stack.append((frame, self.entered, [held]))
            return
        _, entered, held = self.stack.pop()
        if not (held[0] or self.holds(iter([arg, *locals_.values()])) or self.carries(arg)):
            return
        if path.endswith("/_requests.py") and isinstance(arg, bytes):
            self.sent.append(arg)
        first, functions = self.files.setdefault(path, (entered, set()))
        functions.add(code.co_qualname.split(".<locals>", 1)[0])
        self.files[path] = (min(first, entered), functions)

    def path(self) -> list[tuple[str, set[str]]]:
        return [
            (path, functions)
            for path, (_, functions) in sorted(self.files.items(), key=lambda item: item[1][0])
        ]


def traced_way_down() -> dict[str, Any]:
    """A locked task run (eagerly, on a real in-process server) with ``dflock_lock_ttl`` set,
    traced: what `WayDown` saw, as JSON (run in a process of its own by the test below)."""
    from celery_dflock import LockedTask
    from celery_dflock._settings import GivenOptions
    from celery_dflock.client.clients import Lease
    from celery_dflock.config import DflockConfig, LockOptions
    from dflockd_server import Config
    from dflockd_server.testing import ServerThread
    from tests.support.apps import make_app

    def is_it(value: object) -> bool:
        return type(value) is Lease and value == WAY_DOWN_LEASE

    def carries(value: object) -> bool:
        if isinstance(value, DflockConfig):
            value = value.defaults
        return isinstance(value, GivenOptions | LockOptions) and is_it(value.ttl)

    way = WayDown(is_it, carries)
    with ServerThread(Config(host="127.0.0.1", port=0, default_lease_ttl_s=30)) as server:
        app = make_app("waydown", eager=True, servers=server, dflock_lock_ttl=WAY_DOWN_LEASE)

        @app.task(shared=False, base=LockedTask, lock_key="way:down")
        def way_down() -> str:
            return "ran"

        job: Any = way_down
        sys.setprofile(way.profile)
        try:
            result = job.apply()
        finally:
            sys.setprofile(None)
        ran = result.get()
    return {
        "ran": ran,
        "path": [[path, sorted(functions)] for path, functions in way.path()],
        "one_lease": bool(way.leases) and all(lease is way.leases[0] for lease in way.leases),
        "name": getattr(way.leases[0], "name", None) if way.leases else None,
        "sent": [sent.decode() for sent in way.sent],
    }


def test_one_values_way_down_is_the_path_architecture_md_gives() -> None:
    """Issue 71, acceptance 3: ARCHITECTURE.md's "one value's way down" is what a run does.
    A locked task runs (eagerly, on a real in-process server) with ``dflock_lock_ttl`` set,
    traced: the value passes through the files the section lists, in its order, and through
    the very functions it names in each; it is one `Lease` object from the check to the
    request's bytes (checked once); and the client layer names no Celery option for it.
    The traced run is a process of its own: under ``sys.setprofile`` in a worker that had run
    other tests it hung once in a while where pytest-timeout could not end it."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json, tests.test_architecture as t; print(json.dumps(t.traced_way_down()))",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    way = json.loads(done.stdout.splitlines()[-1])
    assert way["ran"] == "ran"
    documented = [[path, sorted(functions)] for path, functions in documented_way_down()]
    assert way["path"] == documented
    assert way["one_lease"]
    assert way["name"] == "app.conf.dflock_lock_ttl"
    assert any(f" {WAY_DOWN_LEASE} " in sent for sent in way["sent"]), way["sent"]
    client = PACKAGES["celery_dflock"] / "client"
    assert not [path for path in client.rglob("*.py") if "lock_ttl" in path.read_text()]


MAX_FORWARDERS: Final = 5
"""Issue 71, acceptance 2: methods that only pass their arguments on to a part they own."""


def _self_part(node: ast.expr) -> str | None:
    """``self.<part>.<name>`` as ``"<part>.<name>"``; None for anything else."""
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and isinstance(node.value.value, ast.Name)
        and node.value.value.id == "self"
    ):
        return f"{node.value.attr}.{node.attr}"
    return None


def _passes_through(function: ast.FunctionDef | ast.AsyncFunctionDef, call: ast.Call) -> bool:
    """Whether ``call`` passes every parameter of ``function`` but ``self``, in order, as it
    came (``x``, ``x=x``, ``*args``, ``**kwargs``), and nothing else."""
    params = function.args
    expected = [p.arg for p in [*params.posonlyargs, *params.args][1:]]
    expected += [f"*{params.vararg.arg}"] if params.vararg else []
    expected += [p.arg for p in params.kwonlyargs]
    expected += [f"**{params.kwarg.arg}"] if params.kwarg else []
    passed: list[str] = []
    for arg in call.args:
        if isinstance(arg, ast.Name):
            passed.append(arg.id)
        elif isinstance(arg, ast.Starred) and isinstance(arg.value, ast.Name):
            passed.append(f"*{arg.value.id}")
        else:
            return False
    for keyword in call.keywords:
        if not isinstance(keyword.value, ast.Name):
            return False
        if keyword.arg is None:
            passed.append(f"**{keyword.value.id}")
        elif keyword.value.id == keyword.arg:
            passed.append(keyword.arg)
        else:
            return False
    return passed == expected


def _body(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.stmt]:
    """``function``'s statements, its docstring aside."""
    body = function.body
    first = body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        return body[1:]
    return body


def forwarders(tree: ast.Module) -> Iterator[tuple[int, str, bool]]:
    """``(line, what, counted)`` for each method of a class in ``tree`` that only forwards.

    Counted: a method (not a property) whose one statement, its docstring aside, is
    ``[return] [await] self.<part>.<method>(<its own parameters, in order, as they came>)``,
    and an attribute that ``__init__`` binds to a part's (``self.x = self.<part>.x``, or
    ``part.x`` of a local that is ``self.<part>``) and that no other method sets: two names
    for one thing. Listed, not
    counted: a property that only reads ``self.<part>.<name>`` (or calls it with nothing):
    a read-only view with no arguments to forward, as most of the lock's documented
    attributes are."""
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        changed = {  # set outside __init__: a state of its own that starts as the part's
            target.attr
            for function in cls.body
            if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef)
            and function.name != "__init__"
            for node in ast.walk(function)
            if isinstance(node, ast.Assign)
            for target in node.targets
            if isinstance(target, ast.Attribute)
        }
        for function in cls.body:
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            where = f"{cls.name}.{function.name}"
            body = _body(function)
            if function.name == "__init__":
                parts: set[str] = set()
                for statement in ast.walk(function):
                    if not isinstance(statement, ast.Assign) or len(statement.targets) != 1:
                        continue
                    target, value = statement.targets[0], statement.value
                    if isinstance(target, ast.Name) and _self_part(ast.Attribute(value, "_")):
                        parts.add(target.id)  # grants = self.grants
                    elif (
                        isinstance(target, ast.Attribute)
                        and isinstance(target.value, ast.Name)
                        and target.value.id == "self"
                        and target.attr not in changed
                        and isinstance(value, ast.Attribute)
                        and (
                            _self_part(value)
                            or (isinstance(value.value, ast.Name) and value.value.id in parts)
                        )
                    ):
                        yield (
                            statement.lineno,
                            f"{cls.name}.{target.attr} = {ast.unparse(value)}",
                            True,
                        )
            if len(body) != 1 or not isinstance(body[0], ast.Return | ast.Expr):
                continue
            value = body[0].value
            if isinstance(value, ast.Await):
                value = value.value
            is_property = any(ast.unparse(d) == "property" for d in function.decorator_list)
            if isinstance(value, ast.Call) and (part := _self_part(value.func)):
                if _passes_through(function, value):
                    yield function.lineno, f"{where} -> self.{part}()", not is_property
            elif is_property and value is not None and (part := _self_part(value)):
                yield function.lineno, f"{where} -> self.{part}", False


def test_few_methods_only_forward_to_a_part() -> None:
    """Issue 71, acceptance 2: at most ``MAX_FORWARDERS`` methods of the product
    (``celery_dflock`` and the server; not the generated blocking client) only pass their
    arguments on to ``self.<part>.<method>``: a caller calls the part, or the method lives
    where its state does. The list is printed (``-s``), the read-only property views with it."""
    counted: list[str] = []
    for module in sorted(MODULES.values(), key=lambda m: m.name):
        if module.path.is_relative_to(GENERATED):
            continue
        for line, what, is_counted in forwarders(ast.parse(module.path.read_text())):
            entry = f"{module.path.relative_to(ROOT)}:{line} {what}"
            print(entry if is_counted else f"  (property, not counted) {entry}")
            if is_counted:
                counted.append(entry)
    assert len(counted) <= MAX_FORWARDERS, "\n".join(counted)


def test_the_forwarder_check_sees_one() -> None:
    """The check itself finds what it names, and leaves a method that does more alone."""
    tree = ast.parse(
        "class A:\n"
        "    def __init__(self, b):\n"
        "        self.b = b\n"
        "        part = self.b\n"
        "        self.keys = part.keys\n"
        "    def f(self, x, *, y):\n"
        "        '''doc'''\n"
        "        return self.b.f(x, y=y)\n"
        "    async def g(self, *args):\n"
        "        await self.b.g(*args)\n"
        "    def h(self, x):\n"
        "        return self.b.h(x, 1)\n"
        "    def i(self, x, y):\n"
        "        return self.b.i(y, x)\n"
        "    @property\n"
        "    def j(self):\n"
        "        return self.b.j\n"
        "    def k(self):\n"
        "        self.port = self.b.port\n"
        "class B:\n"
        "    def __init__(self, c):\n"
        "        self.port = self.c.port\n"
        "    def started(self):\n"
        "        self.port = 1\n"
    )
    found = [(what, counted) for _, what, counted in forwarders(tree)]
    assert found == [
        ("A.keys = part.keys", True),
        ("A.f -> self.b.f()", True),
        ("A.g -> self.b.g()", True),
        ("A.j -> self.b.j", False),
    ]
