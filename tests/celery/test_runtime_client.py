"""The app's Client: one per app and process, built from the dflock_* settings; a pool child
gets a fresh one (and pool) from the runtime's reset after fork."""

from __future__ import annotations

import os

from celery import Celery

from celery_dflock._runtime import get_runtime, reset_runtime_after_fork
from celery_dflock.config import get_config, reset_config
from dflockd_server.testing import ServerThread


def _app(server: ServerThread) -> Celery:
    app = Celery("runtime-client", broker="memory://", set_as_current=False)
    app.conf.dflock_servers = f"{server.host}:{server.port}"
    app.conf.dflock_renew_ratio = 0.25
    return app


def test_one_client_per_app_and_process_from_the_settings(dflock_server: ServerThread) -> None:
    app = _app(dflock_server)
    runtime = get_runtime(app)
    client = runtime.client(get_config(app))
    assert runtime.client(get_config(app)) is client
    assert client.servers == (dflock_server.address,)
    assert client.settings.renew_ratio == 0.25
    lock = client.lock("runtime:one")
    assert lock.acquire()
    assert runtime.client(get_config(app)).release("runtime:one", str(lock.token), limit=None)
    assert lock.release() is False  # released by token already
    reset_config(app)
    assert runtime.client(get_config(app)) is not client  # settings read again: a new client
    runtime.close()


def test_a_pool_child_gets_a_fresh_client_and_pool(dflock_server: ServerThread) -> None:
    app = _app(dflock_server)
    parent = get_runtime(app).client(get_config(app))
    with parent.lock("runtime:parent"):
        pid = os.fork()
        if pid == 0:  # the child: never back into pytest
            code = 1
            try:
                runtime = reset_runtime_after_fork(app, in_pool_child=True)
                child = runtime.client(get_config(app))
                lock = child.lock("runtime:child", acquire_timeout_s=5)
                if child is not parent and child.pool is not parent.pool and lock.acquire():
                    code = 0 if lock.release() else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    get_runtime(app).close()
