"""Every python block of the docs pages and the README runs, as written, against a real lock
server (in eager mode: see run_doc_page.py for the small preamble). Blocks that cannot run alone
are marked ``<!-- not-run: reason -->`` and must name the test that runs them instead."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from dflockd_server.testing import ServerThread
from tests.docs.docs_blocks import README, ROOT, blocks, pages

RUNNER = Path(__file__).with_name("run_doc_page.py")
PAGES_WITH_PYTHON = [p for p in [*pages(), README] if any(b.lang == "python" for b in blocks(p))]


def _id(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES_WITH_PYTHON, ids=_id)
def test_the_python_blocks_of_a_page_run(page: Path, dflock_server: ServerThread) -> None:
    runnable = [b for b in blocks(page) if b.lang == "python" and not b.not_run]
    done = subprocess.run(
        [
            sys.executable,
            "-W",
            "error",
            str(RUNNER),
            str(page),
            f"{dflock_server.host}:{dflock_server.port}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"ran {len(runnable)} block(s)" in done.stdout


def test_every_block_not_run_names_the_test_that_runs_it() -> None:
    for page in [*pages(), README]:
        for block in blocks(page):
            if block.not_run is None:
                continue
            named = re.findall(r"tests/[\w/]+\.py", block.not_run)
            assert named, f"{block.where}: a not-run block must name the test that runs it"
            for path in named:
                assert (ROOT / path).is_file(), f"{block.where}: {path} does not exist"


def test_the_docs_have_runnable_examples() -> None:
    """Guards the extraction itself: a broken fence regex would make every test above pass."""
    names = {p.name for p in PAGES_WITH_PYTHON}
    assert {"README.md", "locked-tasks.md", "client.md", "getting-started.md"} <= names
