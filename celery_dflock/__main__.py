"""The ``celery-dflock`` command: ``celery-dflock demo`` shows the whole thing working."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence

from celery_dflock import __version__

NEEDS_SERVER = (
    "celery-dflock demo starts a lock server in this process, and the lock server is not "
    "installed: install the `server` extra (pip install 'celery-dflock[server]'), which brings "
    "dflockd-server of the same version"
)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line and run the sub-command."""
    parser = argparse.ArgumentParser(
        prog="celery-dflock",
        description="Distributed locks for Celery tasks and beat, backed by dflockd.",
    )
    parser.add_argument("--version", action="version", version=f"celery-dflock {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="run a lock server, two workers and two beats locally and show a timeline",
        description=(
            "Start a lock server in this process, two prefork workers and two singleton "
            "beats, send overlapping tasks on a few keys, then print a per-key timeline "
            "and a verdict. Needs no Redis and no Docker (filesystem broker by default)."
        ),
    )
    demo.add_argument(
        "--broker",
        metavar="URL",
        default=None,
        help="broker URL to use instead of the embedded filesystem broker (e.g. redis://127.0.0.1:6379/0)",
    )
    args = parser.parse_args(argv)
    if importlib.util.find_spec("dflockd_server") is None:
        parser.exit(2, f"celery-dflock: error: {NEEDS_SERVER}\n")
    from celery_dflock.demo.runner import broker_problem, run

    if args.broker is not None and (problem := broker_problem(args.broker)):
        parser.exit(2, f"celery-dflock: error: --broker {args.broker!r}: {problem}\n")
    return run(args.broker, sys.stdout)


if __name__ == "__main__":
    raise SystemExit(main())
