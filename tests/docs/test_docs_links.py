"""Links: every relative link in docs/ resolves to a page (and its anchor) or a file in the
repository; every link in the README is absolute (it is also the package index's page) and,
when it points into this repository, to a file that exists."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from tests.docs.docs_blocks import DOCS, README, ROOT, pages

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$")


def _repository_url() -> str:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["urls"]["Repository"].rstrip("/")


def _prose(path: Path) -> str:
    """The file without its fenced code blocks (links in code are not links)."""
    return re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)


def _slug(heading: str) -> str:
    """The anchor MkDocs' toc extension gives a heading."""
    text = re.sub(r"`|\*|\[|\]\([^)]*\)", "", heading).lower()
    text = re.sub(r"[^\w\s-]", "", text)
    return re.sub(r"[\s]+", "-", text.strip())


def _anchors(path: Path) -> set[str]:
    return {
        _slug(m.group(1))
        for line in _prose(path).splitlines()
        if (m := _HEADING.match(line)) is not None
    }


def test_every_relative_link_in_the_docs_resolves() -> None:
    broken: list[str] = []
    for page in pages():
        for target in _LINK.findall(_prose(page)):
            if re.match(r"[a-z]+:", target):
                continue
            file_part, _, anchor = target.partition("#")
            resolved = (page.parent / file_part).resolve() if file_part else page
            where = f"{page.relative_to(ROOT)}: {target}"
            if not resolved.is_relative_to(DOCS) or not resolved.is_file():
                broken.append(f"{where} (no such page in docs/)")
            elif anchor and anchor not in _anchors(resolved):
                broken.append(f"{where} (no heading with that anchor)")
    assert broken == []


def test_the_slug_rule_matches_mkdocs() -> None:
    assert _slug("A cluster: not yet") == "a-cluster-not-yet"
    assert _slug("Direct calls and eager mode") == "direct-calls-and-eager-mode"
    assert _slug("`hello`") == "hello"


def test_every_readme_link_is_absolute_and_points_at_a_file_that_exists() -> None:
    repository = _repository_url()
    links = _LINK.findall(_prose(README))
    assert len(links) >= 8, "the README links to the docs pages"
    for target in links:
        assert re.match(r"https?://", target), f"README link {target!r} is not absolute"
        if target.startswith(f"{repository}/blob/main/"):
            path = target.removeprefix(f"{repository}/blob/main/").partition("#")[0]
            assert (ROOT / path).is_file(), f"README link {target!r}: {path} does not exist"


def test_the_docs_urls_of_the_code_point_at_files_that_exist() -> None:
    from dflockd_server.constants import DOCS_URL, FLAGS_DOCS_URL, PROTOCOL_DOCS_URL

    repository = _repository_url()
    assert f"{repository}/blob/main/docs" == DOCS_URL
    for url in (FLAGS_DOCS_URL, PROTOCOL_DOCS_URL):
        assert (ROOT / url.removeprefix(f"{repository}/blob/main/")).is_file(), url


def test_one_repository_url_everywhere() -> None:
    """The repository URL is written in a few files (the package index shows READMEs and
    metadata without the repository); they must all name the one in pyproject.toml."""
    repository = _repository_url()
    files = [
        "README.md",
        "server/README.md",
        "mkdocs.yml",
        "pyproject.toml",
        "server/pyproject.toml",
        "server/dflockd_server/constants.py",
        *(str(p.relative_to(ROOT)) for p in pages()),
    ]
    for name in files:
        for url in re.findall(r"https://github\.com/[\w.-]+/[\w.-]+", (ROOT / name).read_text()):
            assert url == repository, f"{name} names {url}, pyproject.toml {repository}"
