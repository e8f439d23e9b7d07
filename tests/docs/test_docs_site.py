"""The built docs site as a reader's browser shows it: ``mkdocs build --strict``, then every page
with diagrams opened in headless Chromium (Debian's ``chromium``), which runs the page's scripts
(mermaid, put into the built site by docs/hooks/mermaid.py); each diagram must be drawn, an SVG
inside its block, not mermaid's "Syntax error" picture. The pages' pictures are the files they
name."""

from __future__ import annotations

import filecmp
import json
import os
import re
import shutil
import subprocess
import sys
from html import unescape as html_unescape
from pathlib import Path

import pytest

from tests.docs.docs_blocks import DOCS, ROOT, blocks, pages
from tests.support.services import unavailable

pytestmark = pytest.mark.slow

# Page (relative to docs/) -> how many diagrams it has, at least: the pictures issue 29 asks for.
EXPECTED_DIAGRAMS = {
    "deployment.md": 3,  # single server, static list, cluster on etcd
    "locked-tasks.md": 1,  # a locked run: acquire, renew, lose, release
    "queue-once.md": 1,  # queue-once: publish, duplicate, take over, retry or release
    "getting-started.md": 1,  # the demo's timeline
}
_DIAGRAM = re.compile(r'<div class="diagram"[^>]*>(.*?)</div>', re.S)


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    unavailable(
        "no headless Chromium (apt-get install chromium)",
        because="CI installs Debian's chromium package (.ci/run)",
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    return out


def _mermaid_blocks(page: Path) -> int:
    return sum(1 for b in blocks(page) if b.lang == "mermaid")


def test_the_pages_have_their_diagrams() -> None:
    found = {str(p.relative_to(DOCS)): _mermaid_blocks(p) for p in pages()}
    for page, least in EXPECTED_DIAGRAMS.items():
        assert found.get(page, 0) >= least, f"{page}: {found.get(page, 0)} diagram(s)"


@pytest.mark.parametrize("page", sorted(EXPECTED_DIAGRAMS))
def test_each_diagram_is_drawn_in_a_browser(site: Path, page: str) -> None:
    chromium = _chromium()
    html = site / page.removesuffix(".md") / "index.html"
    assert html.is_file(), html
    shown = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--virtual-time-budget=30000",
            "--dump-dom",
            html.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    dom = shown.stdout
    drawn = _DIAGRAM.findall(dom)
    assert len(drawn) == _mermaid_blocks(DOCS / page), f"{page}: {len(drawn)} diagram blocks"
    for n, inner in enumerate(drawn, 1):
        assert inner.lstrip().startswith("<svg"), f"{page}, diagram {n} not drawn: {inner[:300]}"
        assert "Syntax error" not in inner, f"{page}, diagram {n}: mermaid could not parse it"
        assert "<g" in inner, f"{page}, diagram {n}: an empty picture"


def test_the_site_loads_nothing_from_elsewhere(site: Path) -> None:
    """The diagrams' mermaid is part of the built site: no page names a script on another host."""
    for html in site.rglob("*.html"):
        scripts = re.findall(r'<script[^>]+src="([^"]+)"', html.read_text())
        remote = [s for s in scripts if re.match(r"(https?:)?//", s)]
        assert not remote, f"{html.relative_to(site)}: {remote}"


def test_the_evidence_pages_plot_is_the_benchmarks_own() -> None:
    evidence = (DOCS / "evidence.md").read_text()
    assert "](assets/images/throughput.png)" in evidence
    assert filecmp.cmp(
        DOCS / "assets" / "images" / "throughput.png",
        ROOT / "benchmarks" / "throughput.png",
        shallow=False,
    ), "docs/assets/images/throughput.png differs from benchmarks/throughput.png: copy it again"


_MEASURE = """<!doctype html><html><body><pre id="out">pending</pre>
<iframe id="page" src="{page}" style="width:{width}px;height:600px"></iframe>
<script>
document.getElementById("page").addEventListener("load", () => {{
  const doc = document.getElementById("page").contentDocument;
  const cut = [...doc.querySelectorAll("pre > code")]
    .filter((code) => code.scrollWidth > code.clientWidth + 1)
    .map((code) => code.textContent.split("\\n")[0].slice(0, 60));
  const blocks = doc.querySelectorAll("pre > code").length;
  document.getElementById("out").textContent = JSON.stringify({{blocks, cut}});
}});
</script></body></html>"""


@pytest.mark.parametrize("page", ["migration.md", "deployment.md", "server.md"])
def test_no_code_block_is_cut_off_on_a_narrow_screen(site: Path, page: str, tmp_path: Path) -> None:
    """Long code lines used to be cut at the block's edge, with a scrollbar the theme shows
    only under the pointer (issue 50): on a 400-pixel wide page every block wraps instead."""
    chromium = _chromium()
    html = site / page.removesuffix(".md") / "index.html"
    probe = site / f"measure-{tmp_path.name}.html"
    probe.write_text(_MEASURE.format(page=html.relative_to(site).as_posix(), width=400))
    try:
        shown = subprocess.run(
            [
                chromium,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--allow-file-access-from-files",
                "--virtual-time-budget=30000",
                "--dump-dom",
                probe.as_uri(),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        probe.unlink()
    assert shown.returncode == 0, shown.stderr[-2000:]
    found = re.search(r'<pre id="out">(.*?)</pre>', shown.stdout, re.S)
    assert found, shown.stdout[-2000:]
    measured = json.loads(html_unescape(found.group(1)))
    assert measured["blocks"] >= 1, measured
    assert measured["cut"] == [], f"{page}: code blocks cut off: {measured['cut']}"
