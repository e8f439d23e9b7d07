"""Sentences of the README and the docs about what a user sees, tried against what runs."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

from dflockd_server import Config
from dflockd_server.testing import ServerThread
from tests.docs.docs_blocks import DOCS, README
from tests.support.waiting import wait_until
from tests.support.wire import Wire, stats

BUILDS = {"pure": "pure Python", "compiled": "compiled"}


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def test_the_readme_and_the_home_page_name_the_loop_and_build_the_demo_server_runs() -> None:
    # Started as celery_dflock/demo/runner.py starts it.
    with ServerThread(Config(host="127.0.0.1", port=0)) as server:
        info = stats((server.host, server.port))
    said = f"in-process, {BUILDS[str(info['build'])]}, on {info['loop']}"
    for page in (README, DOCS / "index.md"):
        assert said in _flat(page.read_text()), f"{page.name} should say the demo runs {said}"


def _hello(address: tuple[str, int]) -> dict[str, object]:
    with Wire(address) as wire:
        reply = wire.req("hello")
    assert reply.startswith("ok "), reply
    return json.loads(reply[3:])


def test_hello_answers_as_the_protocol_page_shows_and_a_journal_adds_the_features_it_names(
    tmp_path: Path,
) -> None:
    page = (DOCS / "protocol.md").read_text()
    example = re.search(r'^ok (\{"server".*\})$', page, re.M)
    assert example is not None, "docs/protocol.md shows no hello reply"
    shown = json.loads(example[1])
    with ServerThread(Config(host="127.0.0.1", port=0)) as plain:
        answered = _hello((plain.host, plain.port))
    assert list(answered) == list(shown)
    for field in ("server", "version", "features", "max_lease_ttl_s", "default_lease_ttl_s"):
        assert answered[field] == shown[field], field
    assert f"ok {json.dumps(shown, separators=(',', ':'))}" in page  # the server's own format
    config = Config(host="127.0.0.1", port=0, state_dir=str(tmp_path / "state"))
    with ServerThread(config) as durable:
        features = _hello((durable.host, durable.port))["features"]
    assert isinstance(features, list)
    added = sorted(set(features) - set(shown["features"]))
    assert added == ["durable", "read_only"]
    assert "lists two more features: `durable`" in _flat(page)
    assert "and `read_only`" in _flat(page)


def test_server_thread_stop_is_what_the_testing_page_says() -> None:
    # A drain would wait up to this for the release that never comes (and stop() give up).
    config = Config(host="127.0.0.1", port=0, shutdown_timeout_s=600.0)
    killed = ServerThread(config).start()
    with Wire(killed.address) as holder:
        holder.lock("held:through-stop", lease=60)
        killed.stop()  # returns with the lock still held: every connection closed at once
        killed.stop()  # idempotent
        assert holder.closed_by_server()
    drained = ServerThread(config).start()
    with Wire(drained.address) as holder:
        token = holder.lock("held:through-drain", lease=60)
        stopping = threading.Thread(target=drained.stop, kwargs={"drain": True})
        stopping.start()
        wait_until(lambda: drained.server.draining, what="the drain started")
        assert holder.req("n", "held:through-drain", token).startswith("ok ")  # still served
        assert holder.req("r", "held:through-drain", token) == "ok"
        stopping.join(30)
        assert not stopping.is_alive()
    page = _flat((DOCS / "testing.md").read_text())
    assert "`stop()` closes every connection at once, as a killed server goes" in page
    assert "`stop(drain=True)` stops as SIGTERM does, a graceful drain" in page
