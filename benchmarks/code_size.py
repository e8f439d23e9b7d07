"""How much code the lock server is: its lines now against the commit issue 52 was measured at.

    uv run python -m benchmarks.code_size
    uv run python -m benchmarks.code_size --quick   # the same: counting takes under a second

Counts the Python files of the server package (``server/dflockd_server``, every ``*.py`` git
tracks there; the tests live elsewhere) in the working tree, and the same files at
``--baseline`` (default ``BASELINE``, the commit issue 52's figures came from) as git has them.
Lines are physical lines (what ``wc -l`` counts); ``code lines`` leave out blank lines, comment
lines and docstrings (``tokenize``). Issue 52's goal 5: the server's line count goes down.
A clone without the baseline commit (a shallow one) reports that, and decides no goal.
"""

from __future__ import annotations

import io
import subprocess
import sys
import token
import tokenize
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks._common import REPO, BenchRun, Goal, Table, base_parser, fmt_num

NAME = "code_size"
SERVER_PACKAGE = "server/dflockd_server"
BASELINE = "063e7e8"
"""The commit issue 52 ("Fast by default ... with less code") measured the server at."""
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


def _git(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, check=False)


def tracked_files(rev: str | None) -> list[str] | None:
    """The package's tracked ``*.py`` files at ``rev`` (None: the index, for the working
    tree); None when git does not know ``rev`` here."""
    if rev is None:
        done = _git("ls-files", "-z", "--", SERVER_PACKAGE)
    else:
        done = _git("ls-tree", "-r", "-z", "--name-only", rev, "--", SERVER_PACKAGE)
    if done.returncode != 0:
        return None
    return sorted(p for p in done.stdout.decode().split("\0") if p.endswith(".py"))


def sizes_now() -> dict[str, FileSize]:
    files = tracked_files(None) or []
    return {path: measure((REPO / path).read_bytes()) for path in files if (REPO / path).exists()}


def sizes_at(rev: str) -> dict[str, FileSize] | None:
    files = tracked_files(rev)
    if files is None:
        return None
    out: dict[str, FileSize] = {}
    for path in files:
        done = _git("show", f"{rev}:{path}")
        if done.returncode != 0:
            return None
        out[path] = measure(done.stdout)
    return out


def total(sizes: dict[str, FileSize]) -> FileSize:
    return FileSize(sum(s.lines for s in sizes.values()), sum(s.code for s in sizes.values()))


def short(path: str) -> str:
    return path.removeprefix(SERVER_PACKAGE + "/")


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
        params={"package": SERVER_PACKAGE, "baseline": baseline},
    )
    now = sizes_now()
    then = sizes_at(baseline)
    now_total = total(now)
    then_total = total(then) if then is not None else None
    table = Table(
        f"The server's Python code ({SERVER_PACKAGE}, tests not included)",
        ["tree", "files", "lines", "code lines"],
        notes=[
            "lines: physical lines; code lines: without blank lines, comment lines and docstrings",
        ],
    )
    if then is not None and then_total is not None:
        table.rows.append(
            [
                f"{baseline} (issue 52's baseline)",
                str(len(then)),
                fmt_num(then_total.lines, 0),
                fmt_num(then_total.code, 0),
            ]
        )
    table.rows.append(
        ["this checkout", str(len(now)), fmt_num(now_total.lines, 0), fmt_num(now_total.code, 0)]
    )
    run.add(table)
    run.data["now"] = {"files": len(now), "lines": now_total.lines, "code": now_total.code}
    if then is None or then_total is None:
        print(f"baseline {baseline} is not in this clone (a shallow one?): no goal decided")
        run.write()
        return 0
    run.data["baseline"] = {
        "rev": baseline,
        "files": len(then),
        "lines": then_total.lines,
        "code": then_total.code,
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
                short(path),
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
    share = now_total.lines / then_total.lines if then_total.lines else float("nan")
    run.goals.append(
        Goal(
            goal=f"the server's line count (without tests) below its count at {baseline} "
            "(issue 52)",
            measured=(
                f"{now_total.lines:,} lines against {then_total.lines:,} ({share:.2f}x); "
                f"code lines {now_total.code:,} against {then_total.code:,}"
            ),
            met=now_total.lines < then_total.lines,
        )
    )
    run.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
