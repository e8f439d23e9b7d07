"""The session-scoped testing recipe of docs/testing.md in a user's own project: a fresh venv
with the built distributions, pytest under ``filterwarnings = error``, with and without
pytest-celery."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.venvs import BUILD_TIMEOUT_S, ROOT, make_venv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(BUILD_TIMEOUT_S + 240)]  # built_dist: a C build

RECIPE_PAGE = ROOT / "docs" / "testing.md"
RECIPE_HEADING = "## A session-scoped recipe, with or without pytest-celery"


def _recipe() -> dict[str, str]:
    """The recipe's files, taken from its docs page: each block starts with `# <file name>`."""
    page = RECIPE_PAGE.read_text()
    start = page.index(RECIPE_HEADING)
    section = page[start : page.index("\n## ", start + 1)]
    files: dict[str, str] = {}
    for block in re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL):
        first, _, rest = block.partition("\n")
        name = first.removeprefix("# ").strip()
        assert name.endswith(".py"), f"a recipe block names no file: {first!r}"
        files[name] = rest
    assert set(files) == {"conftest.py", "test_report.py"}
    return files


@pytest.mark.parametrize("with_pytest_celery", [True, False], ids=["pytest-celery", "contrib"])
def test_the_docs_recipe_is_green_in_a_user_project(
    built_dist: Path, tmp_path: Path, with_pytest_celery: bool
) -> None:
    requirements = ["celery-dflock[server]", "pytest"]  # as docs/testing.md says
    if with_pytest_celery:
        requirements.append("pytest-celery")
    python = make_venv(tmp_path / "venv", sys.executable, *requirements, find_links=built_dist)
    project = tmp_path / "project"
    project.mkdir()
    for name, text in _recipe().items():
        (project / name).write_text(text)
    (project / "pytest.ini").write_text(
        "[pytest]\nfilterwarnings =\n    error\naddopts = -p no:cacheprovider\n"
    )
    done = subprocess.run(
        [str(python), "-m", "pytest", "-q"],
        cwd=project,
        capture_output=True,
        text=True,
        check=False,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout
