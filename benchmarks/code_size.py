"""How much code the product is: its lines now against the commit issue 71 was filed at.

    uv run python -m benchmarks.code_size
    uv run python -m benchmarks.code_size --quick   # the same: counting takes under a second

Counts the Python files of the product (every ``*.py`` git tracks under ``celery_dflock`` and
``server/dflockd_server``, the generated blocking client ``celery_dflock/client/_sync`` aside;
the tests live elsewhere) in the working tree, and the same files at ``--baseline`` (default
``BASELINE``, the commit issue 71 was filed at) as git has them. Lines are physical lines (what
``wc -l`` counts); ``code lines`` leave out blank lines, comment lines and docstrings
(``tokenize``). Issue 71's goal: at most ``GOAL_LINES``. A clone without the baseline commit
(a shallow one) reports that beside the goal.
"""

from __future__ import annotations

import ast
import io
import re
import shutil
import subprocess
import sys
import tempfile
import token
import tokenize
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks._common import REPO, BenchRun, Goal, Table, base_parser, fmt_num

NAME = "code_size"
PACKAGES = ("celery_dflock", "server/dflockd_server")
GENERATED = "celery_dflock/client/_sync/"
"""Generated from ``_async`` by ``scripts/unasync.py``: not counted."""
BASELINE = "6a55fc6"
"""The commit issue 71 ("A lighter house") was filed at: 30,538 lines."""
GOAL_LINES = 24_000
TOP_FILES = 25
"""Files listed by how far their line count moved (the rest summed in one row)."""


@dataclass(frozen=True)
class FileSize:
    lines: int
    code: int


def measure(source: bytes) -> FileSize:
    """Physical lines, and lines holding code (not blank, not only a comment, not a docstring)."""
    lines = source.count(b"\n")  # as wc -l counts them
    code_lines: set[int] = set()
    previous = token.NEWLINE
    try:
        for tok in tokenize.tokenize(io.BytesIO(source).readline):
            kind = tok.type
            if kind in (token.NEWLINE, token.INDENT, token.DEDENT):
                previous = kind  # what a statement starts after
                continue
            if kind in (token.COMMENT, token.NL, token.ENCODING, token.ENDMARKER):
                continue
            # A string standing alone as a statement is a docstring (or a bare note).
            statement_start = previous in (token.NEWLINE, token.INDENT, token.DEDENT)
            if kind == token.STRING and statement_start:
                previous = kind
                continue
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
            previous = kind
    except (tokenize.TokenError, SyntaxError):
        return FileSize(lines, lines)
    return FileSize(lines, len(code_lines))


def without_prose(source: str) -> str:
    """``source`` without its docstrings (those that are not a body's only statement) and its
    comment lines: what is left when every word for readers is gone."""
    tree = ast.parse(source)
    strings = {
        id(node): node
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    }
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            statements: list[ast.stmt] | None = getattr(node, field, None)
            if isinstance(statements, list) and len(statements) == 1:
                strings.pop(id(statements[0]), None)  # a body's only statement stays
    docstrings = {
        line for node in strings.values() for line in range(node.lineno, (node.end_lineno or 0) + 1)
    }
    kept = [
        line
        for number, line in enumerate(source.split("\n"), 1)
        if number not in docstrings and not line.lstrip().startswith("#")
    ]
    return "\n".join(kept)


def _formatted(sources: dict[str, bytes], edit: Callable[[str], str]) -> dict[str, bytes] | None:
    """``sources`` (path: text), each changed by ``edit``, then formatted by ``ruff format``
    under the project's settings (None without ruff)."""
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
        for path, text in sources.items():
            target = root / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(edit(text.decode()))
        subprocess.run([ruff, "format", "--quiet", "."], cwd=root, check=True)
        return {path: (root / path).read_bytes() for path in sources}


def bare_lines(sources: dict[str, bytes]) -> int | None:
    """The lines of ``sources`` without prose, formatted: the floor that trimming words alone
    reaches."""
    done = _formatted(sources, without_prose)
    return None if done is None else sum(text.count(b"\n") for text in done.values())


def unpacked(sources: dict[str, bytes]) -> FileSize | None:
    """The size of ``sources`` with every table kept packed by ``# fmt: skip`` laid out as
    ``ruff format`` lays out code: a figure that packing rows cannot lower."""
    done = _formatted(sources, lambda text: re.sub(r"[ \t]*# fmt: skip\b", "", text))
    return None if done is None else total(sizes(done))


def _git(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, check=False)


def tracked_files(rev: str | None) -> list[str] | None:
    """The package's tracked ``*.py`` files at ``rev`` (None: the index, for the working
    tree); None when git does not know ``rev`` here."""
    if rev is None:
        done = _git("ls-files", "-z", "--", *PACKAGES)
    else:
        done = _git("ls-tree", "-r", "-z", "--name-only", rev, "--", *PACKAGES)
    if done.returncode != 0:
        return None
    paths = done.stdout.decode().split("\0")
    return sorted(p for p in paths if p.endswith(".py") and not p.startswith(GENERATED))


def sources_now() -> dict[str, bytes]:
    files = tracked_files(None) or []
    return {path: (REPO / path).read_bytes() for path in files if (REPO / path).exists()}


def sources_at(rev: str) -> dict[str, bytes] | None:
    files = tracked_files(rev)
    if files is None:
        return None
    out: dict[str, bytes] = {}
    for path in files:
        done = _git("show", f"{rev}:{path}")
        if done.returncode != 0:
            return None
        out[path] = done.stdout
    return out


def sizes(sources: dict[str, bytes]) -> dict[str, FileSize]:
    return {path: measure(source) for path, source in sources.items()}


def total(sizes: dict[str, FileSize]) -> FileSize:
    return FileSize(sum(s.lines for s in sizes.values()), sum(s.code for s in sizes.values()))


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser(NAME, __doc__.split("\n", 1)[0] if __doc__ else NAME)
    parser.add_argument(
        "--baseline", default=BASELINE, help=f"the commit to count against ({BASELINE})"
    )
    args = parser.parse_args(argv)
    baseline: str = args.baseline
    run = BenchRun(
        NAME,
        args,
        list(sys.argv[1:] if argv is None else argv),
        params={"packages": list(PACKAGES), "generated": GENERATED, "baseline": baseline},
    )
    now_sources = sources_now()
    then_sources = sources_at(baseline)
    now = sizes(now_sources)
    then = sizes(then_sources) if then_sources is not None else None
    now_total = total(now)
    then_total = total(then) if then is not None else None
    now_bare = bare_lines(now_sources)
    then_bare = bare_lines(then_sources) if then_sources is not None else None
    now_unpacked = unpacked(now_sources)
    then_unpacked = unpacked(then_sources) if then_sources is not None else None
    table = Table(
        "The product's Python code (celery_dflock and server/dflockd_server, tests and the "
        "generated blocking client not included)",
        ["tree", "files", "lines", "code lines", "bare lines", "unpacked lines", "unpacked code"],
        notes=[
            "lines: physical lines; code lines: without blank lines, comment lines and docstrings",
            "bare lines: the files with every docstring and comment line deleted, then formatted "
            "as the project formats code (ruff format): what deleting prose alone could reach",
            "unpacked: lines and code lines with every table packed under `# fmt: skip` laid out "
            "as ruff format lays out code",
        ],
    )

    def row(
        tree: str, files: int, size: FileSize, bare: int | None, flat: FileSize | None
    ) -> list[str]:
        shown = fmt_num(bare, 0) if bare is not None else "no ruff"
        cells = [fmt_num(n, 0) for n in (flat.lines, flat.code)] if flat else ["no ruff"] * 2
        return [tree, str(files), fmt_num(size.lines, 0), fmt_num(size.code, 0), shown, *cells]

    if then is not None and then_total is not None:
        table.rows.append(
            row(f"{baseline} (issue 71 filed)", len(then), then_total, then_bare, then_unpacked)
        )
    table.rows.append(row("this checkout", len(now), now_total, now_bare, now_unpacked))
    run.add(table)
    run.data["now"] = {
        "files": len(now),
        "lines": now_total.lines,
        "code": now_total.code,
        "bare": now_bare,
        "unpacked": None
        if now_unpacked is None
        else {"lines": now_unpacked.lines, "code": now_unpacked.code},
    }
    run.goals.append(
        Goal(
            goal=f"the product's line count (no tests, no generated code) at most {GOAL_LINES:,} "
            "(issue 71)",
            measured=f"{now_total.lines:,} lines; code lines {now_total.code:,}",
            met=now_total.lines <= GOAL_LINES,
        )
    )
    if then is None or then_total is None:
        print(f"baseline {baseline} is not in this clone (a shallow one?)")
        run.write()
        return 0
    run.goals.append(
        Goal(
            goal=f"code lines at most {baseline}'s, with every feature and fix since (the bound "
            "proposed for issue 71's acceptance 1)",
            measured=f"code lines {now_total.code:,} (at {baseline}: {then_total.code:,})"
            + (
                f"; tables unpacked {now_unpacked.code:,} (at {baseline}: {then_unpacked.code:,})"
                if now_unpacked is not None and then_unpacked is not None
                else ""
            ),
            met=now_total.code <= then_total.code
            and (
                now_unpacked is None
                or then_unpacked is None
                or now_unpacked.code <= then_unpacked.code
            ),
        )
    )
    run.data["baseline"] = {
        "rev": baseline,
        "files": len(then),
        "lines": then_total.lines,
        "code": then_total.code,
        "bare": then_bare,
        "unpacked": None
        if then_unpacked is None
        else {"lines": then_unpacked.lines, "code": then_unpacked.code},
    }
    moved = sorted(
        (
            (path, then.get(path), now.get(path))
            for path in set(then) | set(now)
            if then.get(path) != now.get(path)
        ),
        key=lambda row: -abs((row[2].lines if row[2] else 0) - (row[1].lines if row[1] else 0)),
    )
    by_file = Table(
        f"Where the lines moved since {baseline}, by file (largest first)",
        ["file", f"lines at {baseline}", "lines now", "change", "code lines change"],
        notes=["a file that is new has no lines at the baseline; one removed has none now"],
    )
    for path, before, after in moved[:TOP_FILES]:
        b = before or FileSize(0, 0)
        a = after or FileSize(0, 0)
        by_file.rows.append(
            [
                path,
                fmt_num(b.lines, 0) if before else "-",
                fmt_num(a.lines, 0) if after else "-",
                f"{a.lines - b.lines:+,}",
                f"{a.code - b.code:+,}",
            ]
        )
    rest = moved[TOP_FILES:]
    if rest:
        change = sum((a.lines if a else 0) - (b.lines if b else 0) for _, b, a in rest)
        code = sum((a.code if a else 0) - (b.code if b else 0) for _, b, a in rest)
        by_file.rows.append([f"{len(rest)} other files", "", "", f"{change:+,}", f"{code:+,}"])
    if moved:
        run.add(by_file)
    run.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
