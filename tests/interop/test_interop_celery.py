"""LockedTask over TLS against the real dflockd 0.5.0 server (issue 13, point 11): a prefork
worker's locked runs share one pooled TLS connection instead of one (plus auth) per task, and
``request.dflock_fence`` is None there (its tokens are no fences)."""

from __future__ import annotations

import uuid
from pathlib import Path

from celery import Celery

from tests.interop.interop_helpers import ForeignServer, TlsFront
from tests.support.waiting import wait_until
from tests.support.workers import EventLog, WorkerFactory, filesystem_settings


def test_locked_tasks_over_tls_share_one_connection_to_the_foreign_server(
    dflockd_050: ForeignServer, tls_files: tuple[str, str], tmp_path: Path
) -> None:
    cert, key = tls_files
    log = EventLog(tmp_path)
    client = Celery("interop-client", set_as_current=False)
    with TlsFront(dflockd_050.address, cert, key) as front:
        settings = {
            **filesystem_settings(tmp_path, f"dflock-interop-{uuid.uuid4().hex[:8]}"),
            "dflock_servers": f"{front.address[0]}:{front.address[1]}",
            "dflock_ssl": True,  # verified with the default CAs: SSL_CERT_FILE names ours
        }
        workers = WorkerFactory(log, tmp_path, settings)
        try:
            worker = workers.start(pool="prefork", concurrency=1, env={"SSL_CERT_FILE": cert})
            # The worker's start-up check of its lock servers connects too: count after it,
            # once the server has logged the check's connections closed (its log may lag the
            # worker's line: CI counted one of them after `before`).
            assert worker.wait_output("dflock: lock servers reached:", timeout=30)
            # Both of them: its hello is refused (that connection closes), then it connects
            # again without one. Between the two the counts are equal too: a loaded CI run
            # counted `before` there, and the second connection after it.
            wait_until(
                lambda: (
                    dflockd_050.connections_accepted() >= 2
                    and dflockd_050.connections_closed() == dflockd_050.connections_accepted()
                ),
                timeout=30,
                what="the start-up check's two connections closed",
            )
            before = dflockd_050.connections_accepted()
            client.conf.update(settings)
            for n in range(5):
                result = client.send_task("apps.tasks.exclusive_skip", (n, 0))
                assert result.get(timeout=60) == n
        finally:
            workers.close()
            client.close()
            log.close()
    runs = log.entries("run")
    assert sorted(run["n"] for run in runs) == [0, 1, 2, 3, 4]
    # the child's pool asked hello once (refused: a connection closed at once), then reused one
    accepted = dflockd_050.connections_accepted() - before
    assert accepted == 2, dflockd_050.log.read_text()[-3000:]
    assert all(run["fence"] is None for run in runs), runs
