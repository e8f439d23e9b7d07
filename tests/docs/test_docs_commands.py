"""The shell commands the docs and the README show a reader. Each one is either run here (the
cheap ones) or registered with the test that runs it (and a string that test must contain, so
the registry cannot silently point at a test that stopped running the command), or marked as
not run with the reason. A command shown in the docs that is in none of these fails."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import celery_dflock
from dflockd_server import buildinfo
from dflockd_server.constants import PROTOCOL_DOCS_URL
from tests.docs.docs_blocks import README, ROOT, blocks, pages, shell_commands

BIN = Path(sys.executable).parent

# command (regex, whole line) -> (test file that runs it, a string that file contains)
COVERED: dict[str, tuple[str, str]] = {
    r"uv run celery-dflock demo": ("tests/demo/test_demo_command.py", '"demo"'),
    r"uv run --no-sync python -m tests\.sim( --cluster)?( --(seeds|first|hours|seed) \d+"
    r"| --mutation [a-z-]+)*( --trace)?": (
        "tests/sim/test_simulation.py",
        '"tests.sim"',
    ),
    r"uv run celery-dflock demo --broker redis://127\.0\.0\.1:6379/0": (
        "tests/demo/test_demo_command.py",
        '"--broker"',
    ),
    r"uv run --all-groups pytest": (".ci/run", "uv run --all-groups pytest"),
    r"cd server && DFLOCKD_SERVER_BUILD=compiled pip wheel --no-deps --wheel-dir dist \.": (
        "tests/server/test_compiled.py",
        "pip wheel --no-deps --wheel-dir dist .",
    ),
    r"uv sync --all-packages --all-groups": (
        ".ci/run",
        "uv sync --all-packages --all-groups --locked",
    ),
    r"uv run (--all-groups )?pytest -m faults": ("tests/faults/conftest.py", "faults"),
    r"uv run (--all-groups )?python -m benchmarks\.run_all": (
        "tests/benchmarks/test_benchmarks_smoke.py",
        "run_all",
    ),
    r"uv build --all-packages --out-dir dist": ("tests/support/venvs.py", '"--all-packages"'),
    r"pip install --find-links dist 'celery-dflock\[redis\]'": (
        "tests/test_packaging.py",
        '"celery-dflock[redis]"',
    ),
    r"pip install --find-links dist 'celery-dflock\[redis,server\]'": (
        "tests/docs/test_getting_started.py",
        '"celery-dflock[redis,server]"',
    ),
    r"dflockd( --host 127\.0\.0\.1)?": ("tests/server/test_settings.py", "run_dflockd"),
    r"dflockd --host 127\.0\.0\.1 --state-dir \S+ --journal-fsync (always|everysec|no)": (
        "tests/docs/test_docs_state_dir.py",
        '"--journal-fsync"',
    ),
    r"dflockd --max-locks \d+ --max-lease-ttl \d+": (
        "tests/docs/test_queue_once_sizing.py",
        '"--max-lease-ttl"',
    ),
    r"DFLOCKD_PORT=7000 dflockd --max-locks 4096": (
        "tests/server/test_settings.py",
        "DFLOCKD_MAX_LOCKS",
    ),
    r"python send\.py": ("tests/docs/test_getting_started.py", '"send.py"'),
    r"celery -A proj worker --loglevel=info": ("tests/examples/test_examples.py", '"worker"'),
    r"celery -A proj beat -S celery_dflock\.beat:SingletonScheduler": (
        "tests/support/beats.py",
        "celery_dflock.beat:SingletonScheduler",
    ),
    r"celery -A proj dflock (status|locks|ping --json)": (
        "tests/examples/test_examples.py",
        '"dflock"',
    ),
    r"uv run ruff check \. && uv run ruff format --check \. && uv run pyright": (
        ".ci/run",
        "ruff format --check",
    ),
    r"bash \.ci/run": (".ci/run", "uv sync"),
    r"dflockd --cluster etcd://\S+ --advertise \S+": ("tests/faults/cluster_run.py", '"--cluster"'),
    r"dflockd --cluster etcds://\S+ --advertise \S+ --cluster-ca-file \S+ --cluster-user \S+ "
    r"--cluster-password-file \S+": ("tests/cluster/test_etcd_ha.py", '"--cluster-password-file"'),
    r"dflockd rebalance --cluster etcd://\S+( --dry-run)?": (
        "tests/cluster/test_ops.py",
        '"rebalance"',
    ),
    r"dflockd (pin|unpin) --cluster etcd://\S+ \d+( \S+)?": ("tests/cluster/test_ops.py", '"pin"'),
    r"dflockd shards --cluster etcd://\S+": ("tests/cluster/test_ops.py", "run_dflockd"),
    r"celery -A proj dflock shards": ("tests/celery/test_cluster_workers.py", '"shards"'),
    r"celery -A proj dflock status --workers": ("tests/celery/test_outage.py", '"--workers"'),
    r"celery -A proj dflock release (report:42|--all --prefix report:)": (
        "tests/celery/test_operator_tools.py",
        '"release", "--all", "--prefix"',
    ),
}
# Run here, by test_the_cheap_commands_work.
RUN_HERE = (
    r"(uv run )?celery-dflock --version",
    r"(uv run )?dflockd --version",
    r"(uv run )?dflockd --help",
    r"(uv run )?dflockd --help-all",
)
NOT_RUN: dict[str, str] = {
    r"celery -A proj beat -S redbeat\.RedBeatScheduler": (
        "RedBeat's command, the 'before' of docs/migration.md (redbeat is not installed here)"
    ),
    r"docker compose up --build": (
        "no Docker engine on CI; tests/test_compose.py validates docker-compose.yml against the "
        "compose specification"
    ),
    r"docker compose -f docker-compose\.cluster\.yml up --build": (
        "no Docker engine on CI; tests/test_compose.py runs this topology as processes and "
        "validates the file against the compose specification"
    ),
    r"docker build -t dflockd-server:0\.2\.0 server/": (
        "no Docker engine on CI; tests/server/test_compiled.py runs the Dockerfile's build stage "
        "(its COPY lines and its wheel's build) outside Docker"
    ),
    r"docker build -t celery-dflock-example:0\.2\.0 -f examples/Dockerfile \.": (
        "no Docker engine on CI; tests/test_compose.py validates docker-compose.yml, which "
        "builds the same image"
    ),
    r"kubectl create secret generic dflockd-auth --from-literal=token=.*": "no cluster on CI",
    r"kubectl create secret generic celery-broker --from-literal=url=\S+": "no cluster on CI",
    r"kubectl apply -f deploy/kubernetes/": (
        "no cluster on CI; tests/test_deploy.py validates the manifests against the Kubernetes "
        "schemas"
    ),
    r"pip install --find-links dist 'dflockd-server\[metrics\]'": (
        "the extra's own package (prometheus-client) is in the dev environment, where the "
        "server tests use it; this install line is not tried in a fresh venv"
    ),
}


def _shown_commands() -> list[tuple[str, str]]:
    shown: list[tuple[str, str]] = []
    for page in [*pages(), README]:
        for block in blocks(page):
            if block.lang in ("bash", "sh", "console"):
                shown += [(block.where, command) for command in shell_commands(block)]
    return shown


def test_every_command_shown_is_run_by_a_test_or_says_why_not() -> None:
    patterns = [*COVERED, *RUN_HERE, *NOT_RUN]
    unknown = [
        f"{where}: {command}"
        for where, command in _shown_commands()
        if not any(re.fullmatch(p, command) for p in patterns)
    ]
    assert unknown == [], "register these commands in tests/docs/test_docs_commands.py"
    assert len(_shown_commands()) >= 10


@pytest.mark.parametrize("pattern", sorted(COVERED))
def test_the_registered_test_still_runs_the_command(pattern: str) -> None:
    path, needle = COVERED[pattern]
    assert needle in (ROOT / path).read_text(), f"{path} no longer contains {needle!r}"


def _run(*args: str) -> str:
    executable = BIN / args[0]
    command = [str(executable) if executable.exists() else shutil.which(args[0]) or args[0]]
    done = subprocess.run(
        [*command, *args[1:]], capture_output=True, text=True, check=False, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_the_cheap_commands_work() -> None:
    version = celery_dflock.__version__
    assert _run("celery-dflock", "--version").split() == ["celery-dflock", version]
    running = buildinfo.describe(buildinfo.auto_loop_name())  # this venv's: an editable install
    assert _run("dflockd", "--version").strip() == f"dflockd {version} ({running})"
    for flag in ("--help", "--help-all"):
        help_text = _run("dflockd", flag)
        assert PROTOCOL_DOCS_URL in help_text  # points at the protocol page, unwrapped
        assert "PROTOCOL.md" not in help_text
