"""The status page (``/status`` on the metrics port): the owner notes it reads, what it shows
and escapes (pure), and what a real server's metrics port answers. The page in a browser, with
real workers holding keys, is in tests/celery/test_operator_tools.py."""

from __future__ import annotations

import re
import shutil
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from celery_dflock import Client
from dflockd_server import conditions
from dflockd_server.ownernotes import readable_note
from dflockd_server.status_page import HolderNote, holder_of, render
from dflockd_server.testing import ServerThread
from tests.support.processes import kill_group
from tests.support.services import unavailable
from tests.support.waiting import wait_until

ServerFactory = Callable[..., ServerThread]


def test_owner_notes_as_celery_dflock_writes_them_and_others() -> None:
    full = "4f1c/celery%40w1/4242/proj.tasks.report"
    assert holder_of(full) == HolderNote("4f1c", "celery@w1", 4242, "proj.tasks.report")
    assert holder_of("4f1c/celery%40w1") == HolderNote("4f1c", "celery@w1")  # an older run's
    assert holder_of("4f1c") == HolderNote("4f1c")  # a publish-time hold, its message queued
    assert holder_of("beat:77/host-b") == HolderNote(None, "host-b", 77, "celery beat")
    assert holder_of("a/b/notapid/c%2Fd") == HolderNote("a", "b", None, "c/d")
    # Digits, but no decimal ones (a superscript two; a fullwidth one): no pid either.
    assert holder_of("a/b/%C2%B2/c") == HolderNote("a", "b", None, "c")
    assert holder_of("a/b/%EF%BC%91/c") == HolderNote("a", "b", None, "c")
    assert holder_of("beat:%C2%B2/host-b") == HolderNote(None, "host-b", None, "celery beat")
    for nothing in (None, "", "_", 5):
        assert holder_of(nothing) == HolderNote()


def test_the_log_shows_a_note_s_parts_decoded_but_never_a_line_break() -> None:
    assert readable_note("4f1c/ops1%40vm/4242/proj.tasks.report") == (
        "4f1c/ops1@vm/4242/proj.tasks.report"
    )
    assert readable_note("dflock-cli/alice@ops1") == "dflock-cli/alice@ops1"  # as given
    assert readable_note("a%0Aforged%20line/h") == "a%0Aforged%20line/h"
    assert readable_note("_") == readable_note(None) == "no note"


def test_the_page_shows_each_lock_and_escapes_what_clients_sent() -> None:
    stats = {
        "connections": 3,
        "locks": [
            {
                "key": "report:<i>1</i>",
                "lease_expires_in_s": 12.5,
                "waiters": 2,
                "owner": "4f1c/celery%40w1/4242/proj.tasks.%3Cscript%3E",
                "detached": False,
                "restored": True,
                "fence": 99,
                "held_s": 3725.0,
            }
        ],
        "semaphores": [{"key": "pool&co", "limit": 3, "holders": 2, "waiters": 0}],
        "degraded": [conditions.grace(4.0, "", 4.0).as_json()],
    }
    page = render('dflockd-server on "x"', stats, 2, 0.0)
    assert '<meta http-equiv="refresh" content="2">' in page
    assert "report:&lt;i&gt;1&lt;/i&gt;" in page and "<i>" not in page
    assert "proj.tasks.&lt;script&gt;" in page and "<script>" not in page
    assert "pool&amp;co" in page and "dflockd-server on &quot;x&quot;" in page
    shown_all = ("celery@w1", "4242", "1 h 02 min", "12.5 s", "restored", "Restart grace")
    for shown in (*shown_all, "4.0 s left (until 00:00:04 UTC)"):
        assert shown in page, shown
    assert "refresh" not in render("t", {"locks": []}, 0, 0.0)  # ?refresh=0: never
    assert "No lock is held." in render("t", {}, 0, 0.0)


def test_a_key_cannot_turn_the_page_s_text_around_or_hide_in_it() -> None:
    """A bidi override or an invisible character in a key is shown as its escape."""
    key = "report:\u202egnp.exe\u200b"
    page = render("t", {"locks": [{"key": key, "lease_expires_in_s": 5.0}]}, 0, 0.0)
    assert "report:\\u202egnp.exe\\u200b" in page
    assert "\u202e" not in page and "\u200b" not in page


def test_the_page_says_each_degraded_state_in_a_banner_the_errors_first() -> None:
    read_only = conditions.read_only(
        "No space left on device", "/var/lib/dflockd", "Free <it>.", renewals=True
    )
    moving = conditions.cluster_conditions(False, None, {"moving_out": 3, "serving": 5})
    stats = {
        "locks": [],
        "degraded": [c.as_json() for c in (conditions.grace(4.0, "why", 0.0), *moving, read_only)],
    }
    page = render("t", stats, 2, 0.0)
    banners = re.findall(r'<p class="banner (\w+)" role="alert" data-condition="(\w+)">', page)
    assert banners == [
        ("error", "journal_read_only"),
        ("warning", "restart_grace"),
        ("warning", "shards_moving"),
    ]
    assert "<strong>Read-only</strong>: the lease journal under /var/lib/dflockd cannot" in page
    assert "(No space left on device)" in page and "Free &lt;it&gt;." in page
    assert "3 shard(s) moving out" in page and "Healthy" not in page
    healthy = render("t", {"locks": [], "degraded": []}, 2, 0.0)
    assert 'data-condition="healthy"' in healthy and 'role="alert"' not in healthy
    fenced = conditions.cluster_conditions(True, "etcd lease lost", {"unavailable": 8192})
    assert [(f.name, f.severity) for f in fenced] == [("fenced", conditions.ERROR)]
    assert "etcd lease lost" in fenced[0].message


def test_each_cell_names_its_column_for_the_narrow_screen_s_cards() -> None:
    stats = {"locks": [{"key": "k", "owner": "id/h/1/t", "fence": 5, "waiters": 0}]}
    page = render("t", stats, 2, 0.0)
    labels = re.findall(r'<td[^>]* data-label="([^"]+)"', page)
    assert labels == [
        "Key", "Task", "Task id", "Worker", "PID", "Held for", "Lease left", "Waiters", "Fence",
        "State",
    ]  # fmt: skip
    assert "@media (max-width: 760px)" in page and "content: attr(data-label)" in page


def _get(url: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_the_metrics_port_serves_the_page_beside_the_metrics(
    dflock_server_factory: ServerFactory,
) -> None:
    server = dflock_server_factory(metrics_port=0, metrics_host="127.0.0.1")
    metrics = server.server.metrics_address
    assert metrics is not None
    base = f"http://{metrics[0]}:{metrics[1]}"
    status, headers, empty = _get(f"{base}/status")
    assert status == 200 and headers["Content-Type"] == "text/html; charset=utf-8"
    assert b"No lock is held." in empty
    with Client([server.address]) as client, client.lock("page:a-longer-key-than-before"):
        # Each answer's length is its own (a list of headers shared between answers once
        # carried the first one's Content-Length: the browser then waited for the rest).
        status, headers, body = _get(f"{base}/status?refresh=5")
        assert status == 200 and int(headers["Content-Length"]) == len(body) != len(empty)
        assert b"page:a-longer-key-than-before" in body and b'content="5"' in body
    assert b"dflockd_grants_total" in _get(f"{base}/metrics")[2]
    assert b"dflockd_grants_total" in _get(f"{base}/")[2]  # any other path: the metrics
    request = urllib.request.Request(f"{base}/status", data=b"x", method="POST")
    try:
        urllib.request.urlopen(request, timeout=10)
        raise AssertionError("a POST was answered")
    except urllib.error.HTTPError as exc:
        assert exc.code == 405


def test_the_page_in_a_browser_loads_itself_again(
    dflock_server_factory: ServerFactory, tmp_path: Path
) -> None:
    """It refreshes itself (issue 73): headless Chromium left on ``/status?refresh=1`` asks
    the server for new snapshots, one per reload, with nothing but the page's own tag."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        unavailable(
            "no headless Chromium (apt-get install chromium)",
            because="CI installs Debian's chromium package (.ci/run)",
        )
    server = dflock_server_factory(metrics_port=0, metrics_host="127.0.0.1")
    metrics, snapshots = server.server.metrics_address, server.server.snapshots
    assert metrics is not None and snapshots is not None
    before = snapshots.taken
    browser = subprocess.Popen(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--remote-debugging-port=0",  # stays open on the page (no --dump-dom, no exit)
            f"--user-data-dir={tmp_path / 'chromium'}",
            f"http://{metrics[0]}:{metrics[1]}/status?refresh=1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its renderers with it: kill_group ends them all
    )
    try:
        wait_until(
            lambda: snapshots.taken - before >= 3,
            timeout=60,
            what="the page loaded, then loaded itself again twice",
        )
    finally:
        kill_group(browser)
