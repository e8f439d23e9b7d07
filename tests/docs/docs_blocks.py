"""The fenced code blocks of the docs pages and the README, as the docs tests read them.

A block can be marked as not runnable with an HTML comment on the line before it (blank lines
between are allowed), which the built site does not show:

    <!-- not-run: why it cannot run alone, and which test runs it instead -->
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"

_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w+-]*)\s*$")
_NOT_RUN = re.compile(r"^\s*<!--\s*not-run:\s*(?P<reason>.+?)\s*-->\s*$")


@dataclass(frozen=True, slots=True)
class Block:
    """One fenced block: its language, text, first line (1-based) and not-run reason."""

    path: Path
    lang: str
    code: str
    line: int
    not_run: str | None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def pages() -> list[Path]:
    """Every Markdown page of the docs site (generated ones included)."""
    return sorted(DOCS.rglob("*.md"))


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of one Markdown file, in order."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    pending_reason: str | None = None
    while i < len(lines):
        line = lines[i]
        marker = _NOT_RUN.match(line)
        if marker:
            pending_reason = marker.group("reason")
            i += 1
            continue
        fence = _FENCE.match(line)
        if fence is None:
            if line.strip():
                pending_reason = None
            i += 1
            continue
        start = i + 1
        end = start
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        assert end < len(lines), f"{path}:{i + 1}: a code block is never closed"
        code = "\n".join(lines[start:end]) + "\n"
        found.append(Block(path, fence.group("lang"), code, start, pending_reason))
        pending_reason = None
        i = end + 1
    return found


def shell_commands(block: Block) -> list[str]:
    """The commands of a bash block, one per line, without trailing comments."""
    commands: list[str] = []
    for raw in block.code.splitlines():
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        commands.append(re.sub(r"\s+#\s.*$", "", text).strip())
    return commands
