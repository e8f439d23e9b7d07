"""Queue-once at scale, as the docs tell it (issue 50): the server sized as docs/queue-once.md
("Sizing the server") and the sidecar manifests say, started with those flags; 2,000 distinct
queue-once sends all go through it (the default --max-locks refused the 1,025th); and the
"after" code of docs/migration.md, whose ``lock_pending_ttl=600`` is above the default
--max-lease-ttl, sent with ``.delay()`` to a real worker, runs on the server started with the
``dflockd`` command the page shows above it (issue 73: the page said how to start it only below
the code, after the failure)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from celery_dflock import Client, LockedTask, MaxLocksError
from tests.docs.docs_blocks import DOCS, ROOT, Block, blocks, shell_commands
from tests.support.apps import make_app
from tests.support.processes import python_path
from tests.support.servers import dflockd_subprocess
from tests.support.services import redis_url, require_redis
from tests.support.workers import (
    CELERY_APPS_DIR,
    EventLog,
    WorkerFactory,
    close_app,
    filesystem_settings,
    redis_cleanup,
    redis_settings,
)

QUEUE_ONCE = DOCS / "queue-once.md"
MIGRATION = DOCS / "migration.md"
SIZING = re.compile(r"dflockd --max-locks (?P<locks>\d+) --max-lease-ttl (?P<lease>\d+)")
SENDS = 2000


def documented_sizing() -> tuple[int, int]:
    """``(--max-locks, --max-lease-ttl)`` of the command in queue-once.md's sizing section."""
    found = [
        SIZING.fullmatch(command)
        for block in blocks(QUEUE_ONCE)
        if block.lang == "bash"
        for command in shell_commands(block)
    ]
    matches = [m for m in found if m is not None]
    assert len(matches) == 1, "docs/queue-once.md shows no `dflockd --max-locks N ...` command"
    return int(matches[0]["locks"]), int(matches[0]["lease"])


def _compose_env(name: str) -> list[dict[str, str]]:
    services = yaml.safe_load((ROOT / name).read_text())["services"]
    anchors = [s.get("environment", {}) for s in services.values()]
    return [
        {k: str(v) for k, v in env.items()}
        for env in anchors
        if isinstance(env, dict) and "DFLOCKD_PORT" in env
    ]


def _kubernetes_env() -> dict[str, str]:
    docs = yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "dflockd.yaml").read_text())
    stateful = next(d for d in docs if d and d["kind"] == "StatefulSet")
    container = stateful["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_the_sidecar_manifests_size_the_server_as_the_docs_say() -> None:
    locks, lease = documented_sizing()
    assert locks >= SENDS
    assert lease >= 600  # the migration page's lock_pending_ttl
    envs = [*_compose_env("docker-compose.yml"), *_compose_env("docker-compose.cluster.yml")]
    envs.append(_kubernetes_env())
    assert len(envs) >= 5  # dflockd; three cluster members; the StatefulSet
    for env in envs:
        assert env.get("DFLOCKD_MAX_LOCKS") == str(locks), env
        assert env.get("DFLOCKD_MAX_LEASE_TTL_S") == str(lease), env


@pytest.fixture
def sized_server(tmp_path: Path) -> Iterator[tuple[str, int]]:
    """``dflockd`` started with the documented flags, as a user starts it (one per test: the
    holds of one test's sends are not the next test's)."""
    locks, lease = documented_sizing()
    log = tmp_path / "dflockd.log"
    args = ["--max-locks", str(locks), "--max-lease-ttl", str(lease)]
    with dflockd_subprocess(log, *args) as (_, address):
        yield address


def _queue_once_app(settings: dict[str, Any]) -> tuple[Any, Any]:
    app = make_app("sizing-client", settings)

    @app.task(
        shared=False,
        base=LockedTask,
        name="sizing.refresh",
        lock_key="refresh:{account_id}",
        lock_from="publish",
        lock_pending_ttl=600,
    )
    def refresh(account_id: int) -> int:
        return account_id

    return app, refresh


def test_thousands_of_distinct_queue_once_sends_go_through_the_sized_server(
    sized_server: tuple[str, int], tmp_path: Path
) -> None:
    host, port = sized_server
    settings = {**filesystem_settings(tmp_path, "sizing"), "dflock_servers": f"{host}:{port}"}
    app, refresh = _queue_once_app(settings)
    try:
        sent = [refresh.delay(n) for n in range(SENDS)]
        assert len({r.id for r in sent}) == SENDS  # one message each, none a duplicate
        assert refresh.delay(7).id == sent[7].id  # and a duplicate is still refused
        with Client(servers=[(host, port)]) as client:
            (status,) = client.stats()
        assert status.stats is not None, status.error
        held = {lock["key"] for lock in status.stats["locks"]}
        assert {f"refresh:{n}" for n in range(SENDS)} <= held
    finally:
        close_app(app)


def test_the_default_max_locks_refuses_a_queue_once_backlog(
    tmp_path: Path, dflock_server: Any
) -> None:
    """What the sizing is for: a server on its defaults refuses the 1,025th distinct key."""
    settings = {
        **filesystem_settings(tmp_path, "unsized"),
        "dflock_servers": f"{dflock_server.host}:{dflock_server.port}",
    }
    app, refresh = _queue_once_app({**settings})
    refresh.lock_pending_ttl = 60  # within the default --max-lease-ttl
    try:
        with pytest.raises(MaxLocksError, match=r"--max-locks \(DFLOCKD_MAX_LOCKS\)"):
            for n in range(SENDS):
                refresh.delay(n)
    finally:
        close_app(app)


def _after_blocks() -> list[Block]:
    """The migration page's "after" blocks that hold a key from the send (queue-once)."""
    return [
        b
        for b in blocks(MIGRATION)
        if b.lang == "python" and not b.not_run and 'lock_from="publish"' in b.code
    ]


def _server_flags_for(block: Block) -> list[str]:
    """The flags of the ``dflockd`` command the migration page shows above ``block``, in its
    section (a reader pasting the section from the top starts that server first)."""
    lines = MIGRATION.read_text(encoding="utf-8").splitlines()
    section = max(n for n, line in enumerate(lines[: block.line], 1) if line.startswith("## "))
    commands = [
        command
        for b in blocks(MIGRATION)
        if b.lang == "bash" and section < b.line < block.line
        for command in shell_commands(b)
        if command.split()[0] == "dflockd"
    ]
    assert commands, f"{block.where}: no `dflockd ...` command above this block in its section"
    return shlex.split(commands[-1])[1:]


def _module_of(block: Block, server: tuple[str, int], name: str, directory: Path) -> str:
    """The block as written, pointed at the test's lock server and Redis, then the worker
    settings of the test (its queue) added, as a module ``name`` in ``directory``."""
    code = block.code.replace('"127.0.0.1:6388"', f'"{server[0]}:{server[1]}"')
    code = code.replace("redis://127.0.0.1:6379/0", redis_url("workers"))
    harness = textwrap.dedent(
        """
        # The test's worker settings (its queue), as every test app reads them, and the
        # readiness signal the test's worker rig waits for.
        import json as _json
        import os as _os

        import apps.common  # noqa: F401

        app.conf.update(_json.loads(_os.environ["DFLOCK_TEST_SETTINGS"]))
        """
    )
    (directory / f"{name}.py").write_text(code + harness)
    return name


SEND = """
import importlib, sys
module = importlib.import_module(sys.argv[1])
task = getattr(module, sys.argv[2])
print(task.delay(int(sys.argv[3])).get(timeout=120))
"""


def test_the_migration_after_code_sent_with_delay_runs_in_a_worker(tmp_path: Path) -> None:
    require_redis()
    after = _after_blocks()
    assert len(after) == 2, "the celery_once and celery-singleton 'after' blocks"
    expected = {"refresh_account": ("7", "refreshed 7"), "export_report": ("3", "exported 3.pdf")}
    log = EventLog(tmp_path)
    for n, block in enumerate(after):
        task = next(name for name in expected if f"def {name}(" in block.code)
        argument, result = expected[task]
        queue = f"dflock-migration-{n}-{tmp_path.name[-8:]}"
        flags = _server_flags_for(block)
        with dflockd_subprocess(tmp_path / f"dflockd-{n}.log", *flags) as (_, server):
            settings = {**redis_settings(queue), "dflock_servers": "{}:{}".format(*server)}
            module = _module_of(block, server, f"migration_after_{n}", tmp_path)
            env = {"PYTHONPATH": python_path(tmp_path, CELERY_APPS_DIR, ROOT)}
            try:
                _send_with_delay(log, tmp_path, settings, module, (task, argument, result), env)
            finally:
                redis_cleanup(queue)
    log.close()


def _send_with_delay(
    log: EventLog,
    directory: Path,
    settings: dict[str, Any],
    module: str,
    call: tuple[str, str, str],
    env: dict[str, str],
) -> None:
    """Start a prefork worker of ``module``, send ``task.delay(argument)`` from another process
    as a user's code would, and check the result it gets."""
    task, argument, result = call
    factory = WorkerFactory(log=log, directory=directory, settings=settings)
    try:
        factory.start(app=module, pool="prefork", concurrency=1, env=env)
        sent = subprocess.run(
            [sys.executable, "-W", "error", "-c", SEND, module, task, argument],
            env={**os.environ, **env, "DFLOCK_TEST_SETTINGS": json.dumps(settings)},
            capture_output=True,
            text=True,
            check=False,
            timeout=180,
        )
        assert sent.returncode == 0, module + sent.stdout + sent.stderr
        assert sent.stdout.strip() == result, sent.stdout
    finally:
        factory.close()
