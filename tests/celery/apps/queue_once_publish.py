"""A publisher process of the queue-once tests: ``python -m apps.queue_once_publish TASK NAME``.

Configured like the workers (``DFLOCK_TEST_SETTINGS``). Waits for ``--go`` (a file) when given,
so several publishers start publishing together; publishes ``--count`` times (``apply_async``
through the task, as a web process would), and prints one JSON line per publish: the returned
id, or the error's type and ``task_id``. With ``--linger`` it then waits to be killed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from celery_dflock.client.errors import AlreadyQueued

from .queue_once import TASKS

GO_WAIT_S = 60.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("task")
    parser.add_argument("name")
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--go", default=None)
    parser.add_argument("--release-file", default=None)
    parser.add_argument("--linger", action="store_true")
    args = parser.parse_args(argv)
    task = TASKS[args.task]
    deadline = time.monotonic() + GO_WAIT_S
    print(json.dumps({"ready": os.getpid()}), flush=True)
    while args.go is not None and not os.path.exists(args.go) and time.monotonic() < deadline:
        time.sleep(0.005)
    for _ in range(args.count):
        try:
            result = task.apply_async((args.name, args.release_file))
        except AlreadyQueued as exc:
            line = {"error": type(exc).__name__, "task_id": exc.task_id, "key": exc.key}
        else:
            line = {"id": result.id}
        print(json.dumps(line), flush=True)
    if args.linger:
        time.sleep(GO_WAIT_S)
    return 0


if __name__ == "__main__":
    sys.exit(main())
