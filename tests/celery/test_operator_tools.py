"""An operator's tools on real workers (issue 50, part B): ``celery dflock release KEY`` frees a
key a running task holds, and the metrics port's status page names the task holding each key.

One ``dflockd`` started as a user starts it (``--metrics-port``, a state directory), one
prefork worker of ``apps.tasks`` on the filesystem broker, the CLI run as a user runs it, and
the page opened in headless Chromium.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import struct
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import uuid
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from benchmarks.cli import HELD_NOTE, environment, project, run_once
from celery_dflock import Client, DistributedLock, LockNotAcquired, ServerReadOnly
from celery_dflock.client.sharding import stable_hash_shard
from dflockd_server import Config
from dflockd_server.testing import ServerThread
from tests.support.disks import fill, small_tmpfs_or_none
from tests.support.ports import free_port
from tests.support.processes import python_path
from tests.support.rigs import Rig, open_rig
from tests.support.servers import dflockd_subprocess
from tests.support.services import RABBITMQ_URL, require_rabbitmq, unavailable
from tests.support.waiting import wait_until
from tests.support.wire import holders_and_waiters
from tests.support.workers import CELERY_APPS_DIR, REPO, filesystem_settings

TOLD_WITHIN_S = 2 * 0.5 + 5.0
"""The lost_flag task's renewal interval (half its 2 s lease), plus a generous slack."""


@dataclass
class OpsRig:
    rig: Rig
    address: tuple[str, int]
    metrics: tuple[str, int]
    server_log: Path
    disk: Path | None
    """The small tmpfs the state dir is on (None: not root, the full-disk test skips)."""

    def cli(self, *args: str, **settings: object) -> subprocess.CompletedProcess[str]:
        """``celery -A apps.tasks dflock ARGS`` on the workers' settings (and ``settings``), as
        a user runs it."""
        env = {
            **os.environ,
            "DFLOCK_TEST_SETTINGS": json.dumps({**self.rig.settings, **settings}),
            "PYTHONPATH": python_path(CELERY_APPS_DIR, REPO),
        }
        return subprocess.run(
            [sys.executable, "-m", "celery", "-A", "apps.tasks", "dflock", *args],
            cwd=self.rig.tmp,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    def page_url(self) -> str:
        return f"http://{self.metrics[0]}:{self.metrics[1]}/status?refresh=0"


@pytest.fixture(scope="module")
def ops(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpsRig]:
    tmp = tmp_path_factory.mktemp("ops")
    metrics_port = free_port()
    log = tmp / "dflockd.log"
    with (
        small_tmpfs_or_none(tmp / "disk", "2m") as disk,
        dflockd_subprocess(
            log,
            "--metrics-port",
            str(metrics_port),
            "--metrics-host",
            "127.0.0.1",
            "--state-dir",
            str((disk or tmp) / "state"),
        ) as (_, address),
        open_rig(
            tmp,
            "apps.tasks",
            filesystem_settings(tmp, f"dflock-ops-{uuid.uuid4().hex[:8]}"),
            server=address,
            main="ops-client",
        ) as rig,
    ):
        rig.start_worker(pool="prefork", concurrency=3)
        yield OpsRig(rig, address, ("127.0.0.1", metrics_port), log, disk)


# ------------------------------------------------------------------------------ release
@pytest.mark.parametrize("task", ["lost_flag", "lost_flag_kept"])
def test_release_frees_a_running_task_s_key_for_the_next_waiter_and_the_task_learns_it_lost(
    ops: OpsRig, task: str
) -> None:
    """``lost_flag`` renews its 2 s lease itself; ``lost_flag_kept``'s lease is the server's
    default, kept by its session's keep-alives: it is told by the close of its connection."""
    rig = ops.rig
    name = uuid.uuid4().hex[:8]
    key = f"lost:{name}"
    result = rig.send(task, name)
    started = rig.log.wait_event("started", 60, name=name)
    waiter = DistributedLock(key, acquire_timeout_s=120, servers=[ops.address])
    got: list[bool] = []
    thread = threading.Thread(target=lambda: got.append(waiter.acquire()))
    thread.start()
    try:
        wait_until(lambda: holders_and_waiters(ops.address, key) == (1, 1), timeout=30)
        released = ops.cli("release", key)
        assert released.returncode == 0, released.stdout + released.stderr
        assert f"{key}: released (1 grant(s) freed)" in released.stdout
        thread.join(30)
        assert got == [True], "the waiter was not granted the key"
        assert waiter.fence is not None and waiter.fence > started["fence"]
        lost = rig.log.wait_event("lock_lost", TOLD_WITHIN_S, task_id=started["task_id"])
        assert lost["key"] == key and lost["fence"] == started["fence"]
        flagged = rig.log.wait_event("flagged", TOLD_WITHIN_S, name=name)
        assert flagged["lost"] is True and flagged["event_set"] is True
        assert result.get(timeout=60) == {"lost": True}
        logged = ops.server_log.read_text()
        assert re.search(
            rf"force release of '{key}' by 127\.0\.0\.1:\d+ \(dflock-cli/[^)]+\): 1 grant\(s\) "
            rf"freed, held by {started['task_id']}/{re.escape(rig.worker.name)}/",
            logged,
        ), logged[-2000:]
    finally:
        thread.join(30)
        waiter.release()


def test_release_refuses_bad_input_and_says_when_nothing_held_the_key(ops: OpsRig) -> None:
    none = ops.cli("release")
    assert none.returncode == 2 and "give a KEY, or --all --prefix PREFIX" in none.stderr
    spaced = ops.cli("release", "a key")
    assert spaced.returncode == 2 and "contains whitespace" in spaced.stderr
    purge = ops.cli("release", "--all")
    assert purge.returncode == 2 and "--all needs --prefix" in purge.stderr
    unnamed = ops.cli("release", "k", "--note", "")  # not the default note in its place
    assert unnamed.returncode == 2 and "the operator's note must be 1 to 200" in unnamed.stderr
    free = ops.cli("release", f"free:{uuid.uuid4().hex[:8]}")
    assert free.returncode == 0 and "nothing held it" in free.stdout


def test_release_all_with_a_prefix_frees_every_matching_key(ops: OpsRig) -> None:
    prefix = f"purge-{uuid.uuid4().hex[:6]}:"
    with Client([ops.address]) as client:
        locks = [client.lock(f"{prefix}{n}") for n in range(3)]
        for lock in locks:
            assert lock.acquire()
        other = client.lock(f"keep-{prefix}")
        assert other.acquire()
        purged = ops.cli("release", "--all", "--prefix", prefix, "--json")
        assert purged.returncode == 0, purged.stdout + purged.stderr
        report = json.loads(purged.stdout)
        assert report["released"] == {f"{prefix}{n}": 1 for n in range(3)}
        assert report["failed"] == {} and report["unlisted_servers"] == {}
        assert other.renew() and other.release()
        for lock in locks:
            assert not lock.renew()
            lock.release()


def test_release_frees_each_key_on_the_server_that_lists_it(ops: OpsRig) -> None:
    """Keys held on a server the app's list would not route them to (the list grew while they
    were held): ``release KEY`` and ``--all`` free them where ``stats`` listed them, not where
    routing points."""
    prefix = f"moved-{uuid.uuid4().hex[:6]}:"
    keys = [k for k in (f"{prefix}{n}" for n in range(40)) if stable_hash_shard(k, 2) == 0][:3]
    with ServerThread(Config(host="127.0.0.1", port=0)) as other, Client([ops.address]) as client:
        locks = [client.lock(key) for key in keys]
        for lock in locks:
            assert lock.acquire()
        servers = (
            f"{other.host}:{other.port},{ops.address[0]}:{ops.address[1]}"  # keys route to other
        )
        one = ops.cli("release", keys[0], dflock_servers=servers)
        assert one.returncode == 0, one.stdout + one.stderr
        assert f"{keys[0]}: released (1 grant(s) freed)" in one.stdout, one.stdout
        purged = ops.cli("release", "--all", "--prefix", prefix, "--json", dflock_servers=servers)
        assert purged.returncode == 0, purged.stdout + purged.stderr
        assert json.loads(purged.stdout)["released"] == dict.fromkeys(keys[1:], 1), purged.stdout
        for lock in locks:
            assert not lock.renew()
            lock.release()


def test_release_all_with_a_server_it_cannot_list_does_not_say_no_key_is_held(
    ops: OpsRig,
) -> None:
    down = f"127.0.0.1:{free_port()}"
    servers = f"{ops.address[0]}:{ops.address[1]},{down}"
    purged = ops.cli("release", "--all", "--prefix", "nothing-here:", dflock_servers=servers)
    assert purged.returncode == 1, purged.stdout + purged.stderr
    assert "no held key starts with 'nothing-here:' on the servers listed" in purged.stdout
    assert f"{down}: its keys could not be listed" in purged.stdout


# ------------------------------------------------------------------------------ the page
def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    unavailable(
        "no headless Chromium (apt-get install chromium)",
        because="CI installs Debian's chromium package (.ci/run)",
    )


def _chromium_run(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    profile = tmp / f"chromium-{uuid.uuid4().hex[:6]}"
    return subprocess.run(
        [
            _chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            f"--user-data-dir={profile}",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    width, height = struct.unpack(">II", head[16:24])
    return width, height


def _png_rows(path: Path) -> tuple[int, list[bytes]]:
    """An 8-bit, non-interlaced RGB or RGBA PNG (what Chromium writes) as (bytes per pixel,
    its rows of raw pixel bytes): the chunks' image data inflated and unfiltered."""
    data = path.read_bytes()
    width, height, depth, color = struct.unpack(">IIBB", data[16:26])
    assert depth == 8 and color in (2, 6), (depth, color)
    size = 3 if color == 2 else 4
    chunks: list[bytes] = []
    at = 8
    while at < len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        if data[at + 4 : at + 8] == b"IDAT":
            chunks.append(data[at + 8 : at + 8 + length])
        at += 12 + length
    raw = zlib.decompress(b"".join(chunks))
    stride = width * size
    rows: list[bytes] = []
    previous = bytes(stride)
    for y in range(height):
        start = y * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1 : start + 1 + stride])
        for x in range(stride):
            left = line[x - size] if x >= size else 0
            up = previous[x]
            corner = previous[x - size] if x >= size else 0
            if kind == 1:
                line[x] = (line[x] + left) & 0xFF
            elif kind == 2:
                line[x] = (line[x] + up) & 0xFF
            elif kind == 3:
                line[x] = (line[x] + (left + up) // 2) & 0xFF
            elif kind == 4:
                guess = left + up - corner
                near = min(
                    (abs(guess - left), 0, left),
                    (abs(guess - up), 1, up),
                    (abs(guess - corner), 2, corner),
                )[2]
                line[x] = (line[x] + near) & 0xFF
        previous = bytes(line)
        rows.append(previous)
    return size, rows


def _right_margin_blank(path: Path) -> bool:
    """Whether the screenshot's right margin (its last 16 columns) is white over the whole
    height: the table (whose header row is shaded) fits the window."""
    size, rows = _png_rows(path)
    for row in rows:
        margin = row[-16 * size :]
        for x in range(0, len(margin), size):
            if margin[x : x + 3] != b"\xff\xff\xff":
                return False
    return True


def _cells(dom: str, key: str) -> list[str]:
    """The text of each cell of the locks table's row of ``key``."""
    for row in re.findall(r"<tr>(.*?)</tr>", dom, re.S):
        cells = [re.sub(r"<[^>]+>", "", cell) for cell in re.findall(r"<td[^>]*>(.*?)</td>", row)]
        if cells and cells[0] == key:
            return cells
    raise AssertionError(f"no row for {key!r} in the page:\n{dom[-3000:]}")


def test_the_status_page_names_the_task_id_and_worker_of_each_held_key(
    ops: OpsRig, tmp_path: Path
) -> None:
    rig = ops.rig
    names = [uuid.uuid4().hex[:8] for _ in range(2)]
    # The rows come from `slow_body` (a 60 s lease): under a 1 s lease (`long_runner`'s) a
    # renewal starved while headless Chromium loads the machine's cores let the lease run
    # out, and its row was gone from the page.
    sent = [rig.send("slow_body", name, 30.0) for name in names]
    started = [rig.log.wait_event("body", 60, name=name) for name in names]
    hostile = '<script>alert("x")</script>&amp;'
    with Client([ops.address]) as client:
        client.hold("ops:<b>bold</b>", note=hostile, lease_ttl=60)
        try:
            shown = _chromium_run(tmp_path, "--dump-dom", ops.page_url())
            assert shown.returncode == 0, shown.stderr[-2000:]
            dom = shown.stdout
            for name, result, event in zip(names, sent, started, strict=True):
                cells = _cells(dom, f"slow:{name}")
                task, task_id, worker, pid = cells[1:5]
                assert task == "apps.tasks.slow_body"
                assert task_id == result.id
                assert worker == rig.worker.name
                assert pid == str(event["pid"])
                assert cells[9] == "held" and int(cells[8]) == event["fence"]
            # What a client sent is text, never markup.
            assert "<script>" not in dom and "<b>" not in dom
            assert "&lt;script&gt;" in dom and "ops:&lt;b&gt;bold&lt;/b&gt;" in dom
            shot = tmp_path / "status.png"
            drawn = _chromium_run(
                tmp_path,
                "--window-size=1280,900",
                "--hide-scrollbars",
                f"--screenshot={shot}",
                ops.page_url(),
            )
            assert drawn.returncode == 0 and shot.is_file(), drawn.stderr[-2000:]
            assert _png_size(shot) == (1280, 900)
            assert _right_margin_blank(shot), "the page is wider than 1280 px"
            keep = os.environ.get("DFLOCK_TEST_KEEP_SCREENSHOT")
            if keep:
                shutil.copy(shot, keep)
            # A phone on call (issue 73): 390 px wide, one card per lock, each cell captioned
            # with its column, nothing wider than the screen (no sideways scrolling).
            for name in names:
                row = re.search(rf"<tr>(<td[^>]*>slow:{name}</td>.*?)</tr>", dom, re.S)
                assert row is not None, dom[-3000:]
                captions = re.findall(r'data-label="([^"]+)"', row.group(1))
                assert captions == [
                    "Key", "Task", "Task id", "Worker", "PID", "Held for", "Lease left",
                    "Waiters", "Fence", "State",
                ]  # fmt: skip
            phone = tmp_path / "status-390.png"
            drawn = _chromium_run(
                tmp_path,
                "--window-size=390,2400",
                "--hide-scrollbars",
                f"--screenshot={phone}",
                ops.page_url(),
            )
            assert drawn.returncode == 0 and phone.is_file(), drawn.stderr[-2000:]
            assert _png_size(phone) == (390, 2400)
            assert _right_margin_blank(phone), "the page is wider than 390 px"
            if keep:
                shutil.copy(phone, Path(keep).with_name("status-390.png"))
        finally:
            client.force_release("ops:<b>bold</b>")


def test_a_note_whose_pid_is_no_number_breaks_neither_the_page_nor_locks_nor_a_run(
    ops: OpsRig,
) -> None:
    """A holder's note is whatever its client sent (printable ASCII): one whose pid part
    decodes to a digit that is no decimal one (``%C2%B2``, a superscript two) once made the
    page answer 500, ``dflock locks`` end in a traceback, and a run meeting the key busy fail
    with ValueError instead of its ``on_locked``, for as long as the hold lasted."""
    group = uuid.uuid4().hex[:8]
    key, beat = f"shared:{group}", f"beat-note:{group}"
    with Client([ops.address]) as client:
        client.hold(key, note="4f1c/celery%40w1/%C2%B2/proj.tasks.report", lease_ttl=60)
        client.hold(beat, note="beat:%C2%B2/host-b", lease_ttl=60)
        try:
            status, body = _page(ops.page_url())
            assert status == 200, body[-2000:]
            assert key in body and beat in body and "proj.tasks.report" in body
            run = ops.rig.send("shared_key_raise", 1, group, None)
            with pytest.raises(LockNotAcquired, match="is held by task 4f1c"):
                run.get(timeout=60)
            shown = ops.cli("locks")
            assert shown.returncode == 0, shown.stderr[-2000:]
            (row,) = [line for line in shown.stdout.splitlines() if key in line]
            assert "4f1c" in row and "celery@w1" in row
            assert any(beat in line for line in shown.stdout.splitlines())
        finally:
            client.force_release(key)
            client.force_release(beat)


def _page(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_locks_and_release_show_a_key_s_control_characters_escaped_never_raw(
    ops: OpsRig,
) -> None:
    """A key may hold any character but space, tab, CR and LF, and a note's parts are
    percent-decoded: backspaces or an escape sequence (a key built from a task's arguments)
    reached the operator's terminal as they were, so ``report:42<BS><BS>17`` read as another
    key and ``ESC[1A ESC[2K`` erased the row above it. Shown escaped, as Python writes them
    (bash's ``$'...'`` reads them back); ``--json`` has them exactly."""
    name = uuid.uuid4().hex[:8]
    key = f"ctl:{name}:42\b\b17\x1b[1A\x1b[2K\u202e"
    with Client([ops.address]) as client:
        client.hold(key, note="t1/evil%08%08host/1/n", lease_ttl=60)
        try:
            shown = ops.cli("locks")
            assert shown.returncode == 0, shown.stderr[-2000:]
            raw = [ch for ch in shown.stdout if ch != "\n" and not ch.isprintable()]
            assert not raw, shown.stdout
            (row,) = [line for line in shown.stdout.splitlines() if f"ctl:{name}" in line]
            assert f"ctl:{name}:42\\x08\\x0817\\x1b[1A\\x1b[2K\\u202e" in row
            assert "evil\\x08\\x08host" in row
            exact = json.loads(ops.cli("locks", "--json").stdout)
            assert key in [lock["key"] for lock in exact[0]["stats"]["locks"]]
            released = ops.cli("release", "--all", "--prefix", f"ctl:{name}")
            assert released.returncode == 0, released.stderr[-2000:]
            assert not [ch for ch in released.stdout if ch != "\n" and not ch.isprintable()]
            assert "\\x08\\x0817\\x1b[1A" in released.stdout and "released (1" in released.stdout
        finally:
            client.force_release(key)


def test_status_shows_a_server_s_own_words_escaped_never_raw(ops: OpsRig, tmp_path: Path) -> None:
    """``status`` printed what a server says of itself (its journal's path, a write failure, a
    degraded state's message) as it came: a state dir named with an escape sequence reached
    the terminal raw and recoloured or erased the rows around it. Each line is now escaped
    as a key is; ``--json`` has the text exactly."""
    state_dir = tmp_path / "state\x1b[2K\u202e"
    with dflockd_subprocess(tmp_path / "dflockd.log", "--state-dir", str(state_dir)) as (
        _,
        address,
    ):
        host, port = address
        shown = ops.cli("status", dflock_servers=f"{host}:{port}")
        assert shown.returncode == 0, shown.stdout + shown.stderr
        raw = [ch for ch in shown.stdout if ch != "\n" and not ch.isprintable()]
        assert not raw, shown.stdout
        assert "state dir " + str(tmp_path / "state\\x1b[2K\\u202e") in shown.stdout
        exact = json.loads(ops.cli("status", "--json", dflock_servers=f"{host}:{port}").stdout)
        assert exact[0]["stats"]["journal"]["state_dir"] == str(state_dir)


# ------------------------------------------------------------------------------ answer time
def test_dflock_locks_answers_in_under_a_second_of_its_own_time(
    ops: OpsRig, tmp_path: Path
) -> None:
    """Issue 73, acceptance 4, a time bound (asserted, the median of 5): ``celery -A proj
    dflock locks`` with one lock held, run as benchmarks/cli.py runs it (a project of one
    module, a new process each time, Python writing bytecode as it does by default: CI unsets
    PYTHONDONTWRITEBYTECODE too). The bound is on the process's CPU time: on CI's 2 cores,
    shared by 4 test processes, the wall time is that stretched by the load; the benchmark
    reports both (wall 0.93 s, CPU 0.67 s on the 2-core machine at load 8)."""
    key = f"speed:{uuid.uuid4().hex[:8]}"
    project(tmp_path, f"{ops.address[0]}:{ops.address[1]}")
    env = environment("cached", tmp_path)
    with Client([ops.address]) as client:
        held = client.lock(key, lease_ttl_s=120, note=HELD_NOTE)
        assert held.acquire()
        run_once(("dflock", "locks"), tmp_path, env)  # writes the .pyc a user's second run reads
        cpus: list[float] = []
        for _ in range(5):
            _, cpu, shown = run_once(("dflock", "locks"), tmp_path, env)
            (row,) = [line for line in shown.splitlines() if key in line]
            assert "proj.tasks.report" in row, shown  # the task's name, beside its id
            cpus.append(cpu)
        assert held.release()
    assert statistics.median(cpus) < 1.0, cpus


# ------------------------------------------------------------------------------ a full disk
def _degraded(address: tuple[str, int]) -> list[str]:
    with Client([address]) as client:
        (status,) = client.stats()
    assert status.stats is not None, status.error
    return [item["name"] for item in status.stats.get("degraded", [])]


def test_a_full_state_disk_shows_on_the_page_in_status_and_in_the_worker_s_log(
    ops: OpsRig, tmp_path: Path
) -> None:
    """Issue 73, acceptance 1: with its state dir full, the server kept its locks and refused
    new grants, yet the page looked healthy, ``status`` and ``ping`` said ok (exit 0) and the
    worker said the server "is unreachable". Each now says it is read-only and why, and all
    come back to healthy by themselves once space is back."""
    if ops.disk is None:
        pytest.skip("filling the state dir's disk needs root (a small tmpfs)")
    rig = ops.rig
    name = uuid.uuid4().hex[:8]
    with Client([ops.address]) as client:
        held = client.lock(f"disk:held-{name}", lease_ttl_s=60)
        assert held.acquire()
        filler = fill(ops.disk)
        try:
            # Writes go on into the journal's last page, then fail (each grant writes).
            for i in range(10_000):
                probe = client.lock(f"disk:probe-{name}-{i}")
                try:
                    probe.acquire()
                except ServerReadOnly:
                    break
                probe.release()
            assert _degraded(ops.address) == ["journal_read_only"]

            shown = _chromium_run(tmp_path, "--dump-dom", ops.page_url())
            assert shown.returncode == 0, shown.stderr[-2000:]
            assert 'data-condition="journal_read_only"' in shown.stdout, shown.stdout[-3000:]
            assert "No space left on device" in shown.stdout
            assert 'data-condition="healthy"' not in shown.stdout

            status = ops.cli("status")
            assert status.returncode == 1, status.stdout + status.stderr
            assert "READ-ONLY" in status.stdout and "No space left on device" in status.stdout
            ping = ops.cli("ping")
            assert ping.returncode == 1, ping.stdout + ping.stderr
            assert "grants nothing new" in ping.stdout and "READ-ONLY" in ping.stdout

            result = rig.send("slow_body", name, 0.0)
            assert rig.worker.wait_output("is read-only: its disk is full", 60), (
                rig.worker.output()[-3000:]
            )
            assert f"the lock server at {ops.address[0]}:{ops.address[1]} is unreachable" not in (
                rig.worker.output()
            )
            assert held.renew(), "a held lock was let go while the disk was full"
        finally:
            filler.unlink()
        wait_until(lambda: _degraded(ops.address) == [], timeout=30, what="healthy again")
        status = ops.cli("status")
        assert status.returncode == 0, status.stdout + status.stderr
        assert "READ-ONLY" not in status.stdout
        shown = _chromium_run(tmp_path, "--dump-dom", ops.page_url())
        assert 'data-condition="healthy"' in shown.stdout, shown.stdout[-3000:]
        assert result.get(timeout=120) == name  # its outage retry ran once space was back
        assert held.release()


@pytest.mark.parametrize("refusal", ["nobody listens", "wrong password"])
def test_status_with_workers_says_when_the_broker_cannot_be_reached(
    tmp_path: Path, dflock_server: ServerThread, refusal: str
) -> None:
    """``--workers`` asks through the broker: one that refuses gets a line saying so, not a
    traceback (kombu's OperationalError, then amqp's AccessRefused, went up to the user)."""
    broker = f"amqp://guest:guest@127.0.0.1:{free_port()}//"
    if refusal == "wrong password":
        require_rabbitmq()
        known = urlsplit(RABBITMQ_URL)
        wrong = f"{known.username}:not-{known.password}@{known.hostname}:{known.port or 5672}"
        broker = known._replace(netloc=wrong).geturl()
    host, port = dflock_server.address
    (tmp_path / "proj.py").write_text(
        "from celery import Celery\n"
        f'app = Celery("proj", broker="{broker}")\n'
        f'app.conf.dflock_servers = ["{host}:{port}"]\n'
    )
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "proj", "dflock", "status", "--workers"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": python_path(tmp_path, REPO)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert "--workers asks the workers through the broker, which this command cannot" in (
        done.stderr
    )
    assert "without --workers for the lock servers alone" in done.stderr
