"""CI helper for the run at the lowest allowed Celery: print the floor, or check a venv has it.

``python .ci/lowest.py floor`` prints celery's floor from pyproject.toml (``celery>=5.3`` ->
``5.3``); ``python .ci/lowest.py check`` (run by the lowest venv's interpreter) fails unless the
installed celery is that floor and kombu the higher of celery's floor for it and ours (if any).
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _release(version: str) -> tuple[int, ...]:
    parts = [int(p) for p in re.findall(r"\d+", version.split("+", maxsplit=1)[0])[:3]]
    return tuple(parts + [0] * (3 - len(parts)))


def _floor(requirements: list[str], name: str) -> str:
    for requirement in requirements:
        if ";" in requirement:  # an extra's or a platform's requirement
            continue
        found = re.match(rf"{name}\s*\(?[^a-z_\-\[]*?>=\s*([0-9][0-9.]*)", requirement)
        if found:
            return found.group(1)
    raise SystemExit(f"no '{name}>=...' floor in {requirements}")


def main() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    celery_floor = _floor(pyproject["project"]["dependencies"], "celery")
    if sys.argv[1:] == ["floor"]:
        print(celery_floor)
        return
    celery = importlib.metadata.version("celery")
    kombu = importlib.metadata.version("kombu")
    floors = [_floor(importlib.metadata.requires("celery") or [], "kombu")]
    if any(re.match(r"kombu\b", r) for r in pyproject["project"]["dependencies"]):
        floors.append(_floor(pyproject["project"]["dependencies"], "kombu"))
    kombu_floor = max(floors, key=_release)
    print(f"celery {celery} (floor {celery_floor}), kombu {kombu} (floor {kombu_floor})")
    if _release(celery) != _release(celery_floor) or _release(kombu) != _release(kombu_floor):
        raise SystemExit("the lowest-versions venv does not hold the floors of celery and kombu")


if __name__ == "__main__":
    main()
