"""docs/getting-started.md, "Your own project", followed as a new user follows it: the built
wheels installed by the page's command in a fresh venv, the files the page shows saved under
their names, the commands typed in order from that venv (the lock server with the page's
command, a real prefork worker, ``python send.py``) against a real Redis.

Two things differ from a user's machine, both addresses: the lock server's port (a free one,
given as ``DFLOCKD_PORT``, which the server reads as ``--port``; the command line is the page's)
and the Redis database (this test's own on the test Redis). ``send.py`` waits for its result
with the page's own ``result.get(timeout=15)``, and it is started together with the worker: the
first result must come back within 15 s of the worker's start, as the page says."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from tests.docs.docs_blocks import DOCS, blocks, shell_commands
from tests.support.ports import free_port
from tests.support.processes import kill_group
from tests.support.services import redis_url
from tests.support.venvs import BUILD_TIMEOUT_S, make_venv

PAGE = DOCS / "getting-started.md"
STARTUP_S = 60.0  # generous: the machine may be loaded

pytestmark = [pytest.mark.slow, pytest.mark.redis]


def _page_files() -> dict[str, str]:
    """The python blocks whose first line is ``# <name>.py``: the files the page has a user save."""
    files: dict[str, str] = {}
    for block in blocks(PAGE):
        first = block.code.splitlines()[0] if block.code.strip() else ""
        match = re.fullmatch(r"# (\w+\.py)", first)
        if block.lang == "python" and match:
            files[match.group(1)] = block.code
    return files


def _page_commands() -> list[str]:
    return [c for b in blocks(PAGE) if b.lang == "bash" for c in shell_commands(b)]


def _wait_for_text(path: Path, text: str, proc: subprocess.Popen[bytes], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        content = path.read_text(errors="replace") if path.exists() else ""
        if text in content:
            return content
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    content = path.read_text(errors="replace") if path.exists() else ""
    raise AssertionError(f"{text!r} never appeared in {path.name}:\n{content[-4000:]}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            kill_group(proc)


@pytest.mark.timeout(BUILD_TIMEOUT_S + 120)  # built_dist: a C build
def test_your_own_project_runs_as_written_from_the_built_wheels(
    built_dist: Path, tmp_path: Path, redis_required: None
) -> None:
    commands = _page_commands()
    install = "pip install --find-links dist 'celery-dflock[redis,server]'"
    server_command = "dflockd --host 127.0.0.1"
    worker_command = "celery -A proj worker --loglevel=info"
    send_command = "python send.py"
    for command in ("uv build --all-packages --out-dir dist", install, server_command):
        assert command in commands, f"the page no longer says {command!r}"
    assert commands.index(server_command) < commands.index(worker_command)
    assert commands.index(worker_command) < commands.index(send_command)
    files = _page_files()
    assert set(files) == {"proj.py", "send.py"}, sorted(files)

    # The install command, by name, the two distributions from the built folder (`built_dist`
    # is what `uv build --all-packages --out-dir dist` writes).
    venv_python = make_venv(
        tmp_path / "venv", sys.executable, "celery-dflock[redis,server]", find_links=built_dist
    )
    bin_dir = venv_python.parent

    port = free_port()
    url = redis_url("getting_started")
    redis.Redis.from_url(url).flushdb()
    project = tmp_path / "project"
    project.mkdir()
    for name, code in files.items():
        assert "127.0.0.1:6388" in code or name != "proj.py", "the page's server address moved"
        saved = code.replace("redis://127.0.0.1:6379/0", url)
        (project / name).write_text(saved.replace("127.0.0.1:6388", f"127.0.0.1:{port}"))

    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"VIRTUAL_ENV", "PYTHONPATH"} and not k.startswith(("DFLOCKD_", "CELERY_"))
    }
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    logs = tmp_path / "logs"
    logs.mkdir()
    started: list[subprocess.Popen[bytes]] = []

    def start(argv: list[str], log: str, extra: dict[str, str] | None = None) -> Path:
        path = logs / log
        with path.open("wb") as out:
            started.append(
                subprocess.Popen(
                    argv,
                    cwd=project,
                    env={**env, **(extra or {})},
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        return path

    try:
        server_log = start(
            [str(bin_dir / "dflockd"), *server_command.split()[1:]],
            "dflockd.log",
            {"DFLOCKD_PORT": str(port)},
        )
        text = _wait_for_text(server_log, f"listening on 127.0.0.1:{port}", started[0], STARTUP_S)
        assert "restart grace: none (first start" in text, text  # the page: it grants at once

        worker_log = start([str(bin_dir / "celery"), *worker_command.split()[1:]], "worker.log")
        # Typed right after the worker's command: the page's send.py waits 15 s at most.
        sent = subprocess.run(
            [str(bin_dir / "python"), "send.py"],
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
            timeout=STARTUP_S,
            check=False,
        )
        worker_text = worker_log.read_text(errors="replace")
        assert sent.returncode == 0, sent.stdout + sent.stderr + worker_text[-4000:]
        assert sent.stdout == "report 7.pdf\n"
        worker_text = _wait_for_text(worker_log, "succeeded", started[1], STARTUP_S)
        assert re.search(r"Task proj\.build_report\[[\w-]+\] succeeded", worker_text), worker_text

        status = subprocess.run(
            [str(bin_dir / "celery"), "-A", "proj", "dflock", "status"],
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
            timeout=STARTUP_S,
            check=False,
        )
        assert status.returncode == 0, status.stdout + status.stderr
        assert f"127.0.0.1:{port}" in status.stdout, status.stdout
    finally:
        for proc in reversed(started):
            _stop(proc)
