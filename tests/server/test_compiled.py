"""The compiled wheel of the lock server (server/hatch_build.py), built as the README's install
builds it (`uv build --all-packages`: the `built_dist` fixture, which tests/test_packaging.py
installs in fresh venvs), then the server's own tests of what it compiles run against it; and
the container image's build stage (server/Dockerfile, whose command docs/server.md gives).

mypyc compiles the request path's pure modules (parser, dispatch, the lock table). Compiled
code enforces its annotations at run time and cannot be patched, so the same tests must pass on
both builds: the pure-Python one (the rest of the suite, on the editable install) and this one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path
from typing import Final

import pytest

from tests.support.venvs import BUILD_TIMEOUT_S, ROOT

MODE: Final = "DFLOCKD_SERVER_BUILD"
DOCKERFILE: Final = ROOT / "server" / "Dockerfile"
IMAGE_BUILD: Final = f"{MODE}=compiled pip wheel --no-deps --wheel-dir dist ."
"""The build stage's command, run in server/ (docs/server.md: ``cd server && ...``)."""
SUFFIX: Final = str(sysconfig.get_config_var("EXT_SUFFIX"))
TESTS_OF_THE_COMPILED: Final = (
    "tests/server/test_protocol_parser.py",
    "tests/server/test_dispatch.py",
    "tests/server/test_table.py",
    "tests/server/test_table_model.py",
    "tests/server/test_fences.py",
    "tests/server/test_journal.py",
    "tests/server/test_recorded.py",
    "tests/server/test_holds.py",
    "tests/server/test_basic.py",
    "tests/server/test_bad_input.py",
    "tests/server/test_auth_tls.py",
    "tests/server/test_slow_senders.py",
    "tests/server/test_shutdown.py",
    "tests/server/test_loops.py",
)
"""Sans-I/O tests of each compiled module (the hypothesis model of the table included), then
real servers on real sockets with the compiled request path and connections: TLS and auth,
slow senders and back-pressure, shut-down; and the server's asyncio loop turn, against
asyncio's own."""
PYTEST_OPTIONS: Final = ("-q", "-n", "0", "-p", "no:cacheprovider")

pytestmark = pytest.mark.timeout(BUILD_TIMEOUT_S + 600)  # built_dist's C build, then the tests


def _compiled_modules() -> tuple[str, ...]:
    """`COMPILED` of server/hatch_build.py (the build hook, loaded from its file)."""
    spec = importlib.util.spec_from_file_location("hatch_build", ROOT / "server" / "hatch_build.py")
    assert spec is not None and spec.loader is not None
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    compiled: tuple[str, ...] = hook.COMPILED
    return compiled


def _build_stage() -> tuple[list[tuple[list[str], str]], str]:
    """server/Dockerfile's build stage: its COPY lines (sources, destination) and its last
    RUN line (the wheel's build)."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    copies: list[tuple[list[str], str]] = []
    run = ""
    in_stage = False
    for line in text.splitlines():
        if line.startswith("FROM "):
            in_stage = line.endswith(" AS build")
        elif in_stage and line.startswith("COPY "):
            *sources, destination = line.split()[1:]
            copies.append((sources, destination))
        elif in_stage and line.startswith("RUN "):
            run = line.removeprefix("RUN ").strip()
    return copies, run


def test_the_image_builds_the_wheel_with_the_command_the_docs_give() -> None:
    _, run = _build_stage()
    assert run == IMAGE_BUILD
    assert f"cd server && {IMAGE_BUILD}" in (ROOT / "docs" / "server.md").read_text()


@pytest.fixture(scope="module")
def wheel(built_dist: Path) -> Path:
    """The server's wheel as the README's install builds it (compiled: this machine has a C
    compiler and the Python headers)."""
    (built,) = built_dist.glob("dflockd_server-*.whl")
    return built


def test_the_image_build_stage_builds_the_compiled_wheel_or_fails(tmp_path: Path) -> None:
    """The build stage's COPY lines into a scratch folder, then its command there, with the pip
    of a fresh venv of the CPython that runs these tests, and no C compiler: it gets as far as
    compiling and refuses to make the pure-Python wheel (``DFLOCKD_SERVER_BUILD=compiled``).
    With a compiler it makes the wheel that `wheel` is (the same hook, the same files); that
    C build is left to `built_dist`, once per test run."""
    src = tmp_path / "src"
    src.mkdir()
    copies, run = _build_stage()
    for sources, destination in copies:
        for source in sources:
            origin = ROOT / "server" / source
            target = src / destination / source if destination.endswith("/") else src / destination
            if origin.is_dir():
                shutil.copytree(origin, target)
            else:
                shutil.copy2(origin, target)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
    env = {k: v for k, v in os.environ.items() if k not in (MODE, "VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["CC"] = "/nonexistent/cc"
    done = subprocess.run(
        ["bash", "-c", run], cwd=src, env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode != 0, (done.stdout + done.stderr)[-4000:]
    assert f"{MODE}=compiled, but there is no C compiler" in done.stdout + done.stderr
    assert not list(src.glob("dist/*.whl"))


def test_the_compiled_wheel_carries_each_module_compiled_beside_its_source(wheel: Path) -> None:
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    assert f"-{tag}-{tag}-" in wheel.name and "none-any" not in wheel.name, wheel.name
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in _compiled_modules():
        if (ROOT / "server" / "dflockd_server" / f"{module}.py").exists():
            assert f"dflockd_server/{module}{SUFFIX}" in names, module
            assert f"dflockd_server/{module}.py" in names, module
    assert not any(n.startswith("build/") for n in names)
    assert "dflockd_server/net.py" in names and f"dflockd_server/net{SUFFIX}" not in names


def _build_the_server_wheel(out: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`uv build` of the server's wheel alone, with ``env`` over this environment's."""
    command = ["uv", "build", "--package", "dflockd-server", "--wheel", "--out-dir", str(out)]
    base = {k: v for k, v in os.environ.items() if k not in (MODE, "CC")}
    return subprocess.run(
        command, cwd=ROOT, env={**base, **env}, capture_output=True, text=True, check=False
    )


def test_without_a_c_compiler_the_build_warns_and_makes_the_pure_wheel(tmp_path: Path) -> None:
    """Where the compiled wheel cannot be built (here: no compiler), the default build still
    installs: it says why, and makes the wheel for every platform."""
    done = _build_the_server_wheel(tmp_path, {"CC": "/nonexistent/cc"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "building the pure-Python wheel, not the compiled one: there is no C compiler" in (
        done.stderr
    )
    assert f"{MODE}=compiled" in done.stderr  # what to do about it
    (built,) = tmp_path.glob("dflockd_server-*.whl")
    assert built.name.endswith("-py3-none-any.whl")
    assert not [n for n in zipfile.ZipFile(built).namelist() if n.endswith(".so")]


def test_a_compiled_build_without_a_compiler_fails(tmp_path: Path) -> None:
    """``DFLOCKD_SERVER_BUILD=compiled`` (the image, cibuildwheel) never ships pure Python."""
    done = _build_the_server_wheel(tmp_path, {"CC": "/nonexistent/cc", MODE: "compiled"})
    assert done.returncode != 0
    assert f"{MODE}=compiled, but there is no C compiler" in done.stderr, done.stderr[-3000:]
    assert not list(tmp_path.glob("*.whl"))


def test_the_servers_tests_pass_on_the_compiled_modules(wheel: Path, tmp_path: Path) -> None:
    unpacked = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(unpacked)
    env = {**os.environ, "PYTHONPATH": str(unpacked)}
    probe = subprocess.run(
        [sys.executable, "-c", "import dflockd_server.dispatch as d; print(d.__file__)"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert probe.stdout.strip().endswith(SUFFIX), "the tests would run the pure modules"
    dflockd = Path(sys.executable).parent / "dflockd"
    version = subprocess.run(
        [str(dflockd), "--version"], env=env, capture_output=True, text=True, check=True
    )
    assert version.stdout.strip().endswith("(compiled, uvloop)"), version.stdout
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *TESTS_OF_THE_COMPILED, *PYTEST_OPTIONS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-6000:]
    assert " passed" in done.stdout and " failed" not in done.stdout


def test_only_a_compiled_wheel_build_fetches_mypy() -> None:
    """What the build backend asks the front-end to install (PEP 517/660): mypy and
    setuptools for a wheel, nothing of them for an editable install (``uv sync``, the README's
    first command) or a pure build."""
    code = (
        "import json, hatchling.build as b\n"
        "print(json.dumps([b.get_requires_for_build_wheel(),"
        " b.get_requires_for_build_editable()]))"
    )

    def requires(mode: str | None) -> list[list[str]]:
        env = {k: v for k, v in os.environ.items() if k != MODE}
        if mode is not None:
            env[MODE] = mode
        done = subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT / "server",
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        return json.loads(done.stdout)

    wheel, editable = requires(None)
    assert any(r.startswith("mypy==") for r in wheel), wheel
    assert not any(r.startswith(("mypy", "setuptools")) for r in editable), editable
    pure_wheel, _ = requires("pure")
    assert not any(r.startswith(("mypy", "setuptools")) for r in pure_wheel), pure_wheel
