"""A publisher process of the publish-time (queue-once) fault workload.

``python -m tests.faults.publish_workload --client NAME --events FILE --ledger FILE --stop FILE
--accounts a,b,c``, configured like the workers (``DFLOCK_TEST_SETTINGS``). Until the stop file
exists it publishes ``publish_fenced_increment`` of a random account through the task (so the
account's key is held from publish), each with a task id it chose, and appends to its events
file, before and after each publish (``time.monotonic()``, one clock for every process):

* ``{"event": "request", "task_id", "account", "t"}``
* ``{"event": "reply", "task_id", "result_id", "t"}``: ``result_id == task_id`` when this
  publish took the key and sent its message; otherwise the id of the task holding the key.

A test kills these processes with SIGKILL at any moment: the lines are appended with one
``write`` each, so a line is whole or absent.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import uuid
from typing import Any

from tests.faults.celery_faults_app import publish_fenced_increment

PAUSE_S = 0.02
"""Longest pause between two publishes of one publisher (random, from 0)."""


def _append(path: str, entry: dict[str, Any]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(entry) + "\n").encode())
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--client", required=True)
    parser.add_argument("--events", required=True)
    parser.add_argument("--ledger", required=True)
    parser.add_argument("--stop", required=True)
    parser.add_argument("--accounts", required=True)
    parser.add_argument("--hold-s", type=float, default=0.02)
    args = parser.parse_args(argv)
    accounts = args.accounts.split(",")
    task: Any = publish_fenced_increment
    _append(args.events, {"event": "ready", "client": args.client, "pid": os.getpid()})
    n = 0
    while not os.path.exists(args.stop):
        account = random.choice(accounts)
        task_id = str(uuid.uuid4())
        label = f"{args.client}-{n}"
        n += 1
        _append(
            args.events,
            {"event": "request", "task_id": task_id, "account": account, "t": time.monotonic()},
        )
        kwargs = {"account": account, "ledger": args.ledger, "label": label, "hold_s": args.hold_s}
        result = task.apply_async(kwargs=kwargs, task_id=task_id)
        _append(
            args.events,
            {"event": "reply", "task_id": task_id, "result_id": result.id, "t": time.monotonic()},
        )
        time.sleep(random.uniform(0, PAUSE_S))
    return 0


if __name__ == "__main__":
    sys.exit(main())
