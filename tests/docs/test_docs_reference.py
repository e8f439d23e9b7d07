"""The generated reference pages are current, the tables they come from agree with the code
that reads the settings, and the protocol page's `hello` example is what the server answers."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys

import celery_dflock
from celery_dflock import beat
from celery_dflock._settings import APP_SETTINGS, BEAT_SETTINGS
from celery_dflock.config import option_table, setting_table
from dflockd_server import buildinfo
from dflockd_server.settings import SETTINGS
from dflockd_server.testing import ServerThread
from tests.docs.docs_blocks import DOCS, ROOT


def test_the_generated_reference_pages_are_current() -> None:
    done = subprocess.run(
        [sys.executable, str(DOCS / "gen_reference.py"), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


def test_every_setting_and_flag_is_in_the_reference_with_a_meaning() -> None:
    settings = (DOCS / "reference" / "settings.md").read_text()
    for name, setting, _, meaning in option_table():
        assert meaning and f"`{name}`" in settings
        if setting:
            assert f"`{setting}`" in settings
    for doc in [*setting_table("app"), *setting_table("beat")]:
        assert doc.meaning and f"`{doc.name}`" in settings
    assert [d.name for d in setting_table("app")] == list(APP_SETTINGS)
    assert [d.name for d in setting_table("beat")] == list(BEAT_SETTINGS)
    flags = (DOCS / "reference" / "server-flags.md").read_text()
    for setting in SETTINGS:
        assert setting.help and setting.flag.removeprefix("--") in flags
        for env in setting.env:
            assert f"`{env}`" in flags


def test_the_beat_defaults_shown_are_the_ones_beat_uses() -> None:
    shown = {doc.name: doc.default for doc in setting_table("beat")}
    assert shown["dflock_beat_lease_ttl"] == str(beat.DEFAULT_BEAT_LEASE_TTL_S)
    assert shown["dflock_beat_lock_key"] == f"'{beat.DEFAULT_BEAT_KEY_PREFIX}<app.main>'"
    assert shown["dflock_beat_nonoverlap"] == "False"


def test_the_hello_reply_on_the_protocol_page_is_the_servers(
    dflock_server: ServerThread,
) -> None:
    page = (DOCS / "protocol.md").read_text()
    shown = re.search(r"^ok (\{\"server\".*\})$", page, flags=re.M)
    assert shown is not None
    with socket.create_connection(dflock_server.address, timeout=5) as sock:
        sock.sendall(b"hello\n_\n_\n")
        reply = sock.makefile("r", encoding="utf-8").readline()
    status, _, body = reply.rstrip("\n").partition(" ")
    assert status == "ok"
    expected = json.loads(shown.group(1))
    expected["version"] = celery_dflock.__version__  # the page shows the current release
    # the page shows what an install runs (compiled, uvloop); this server is the editable
    # install's in a ServerThread (pure Python, on the loop dflockd runs by default)
    assert (expected["build"], expected["loop"]) == ("compiled", "uvloop")
    expected["build"], expected["loop"] = buildinfo.BUILD, buildinfo.auto_loop_name()
    got = json.loads(body)
    assert len(expected["run"]) == len(got["run"]) == 16  # random at each start of a server
    expected["run"] = got["run"]
    assert got == expected


def test_no_name_in_a_reference_table_can_break_mid_word() -> None:
    """Every name in the first columns of the generated tables renders as a code span that
    does not wrap (issue 29: the settings table showed `lock_timeou t` at 1280 px), rendered
    with the markdown extensions mkdocs.yml turns on."""
    import markdown

    for page in ("settings.md", "server-flags.md"):
        text = (DOCS / "reference" / page).read_text()
        html = markdown.markdown(text, extensions=["attr_list", "tables"])
        rows = re.findall(r"<tr>\s*(.*?)</tr>", html, flags=re.S)
        body_rows = [row for row in rows if row.lstrip().startswith("<td>")]
        assert body_rows, page
        for row in body_rows:
            cells = re.findall(r"<td>(.*?)</td>", row, flags=re.S)
            for cell in cells[:-2]:  # the name columns (not the default, not the meaning)
                for code in re.findall(r"<code[^>]*>", cell):
                    assert code == '<code style="white-space: nowrap">', (page, cell)


def test_the_settings_reference_names_each_old_setting_name() -> None:
    from celery_dflock.config import RENAMED_SETTINGS

    settings = (DOCS / "reference" / "settings.md").read_text()
    for old in RENAMED_SETTINGS:
        assert f"Formerly `{old}`" in settings
