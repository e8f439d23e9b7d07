# pyright: reportMissingTypeStubs=false
"""kombu's filesystem transport with atomic puts, for the demo and the test harness.

kombu's own ``_put`` creates the message file and then writes into it, and ``_get`` takes any
file whose name ends in ``.<queue>.msg`` without locking it: a worker polling at the wrong
moment claims an empty or half-written file and dies on the JSON error. Here a message is
written under a name no queue matches and renamed into place once complete (a rename within a
folder is atomic), so a reader sees a whole message or none. The name being written holds
neither the queue's name nor ``.msg``: kombu 5.7 matches the text after a name's first dot,
but older kombu matches any name that merely contains ``<queue>.msg``.

Use it with ``broker_url="filesystem://"`` and ``broker_transport=TRANSPORT``. Claiming is
kombu's: a worker moves the message file out of the queue folder (to the temp folder, with
``store_processed`` off), and only one move can succeed.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from time import monotonic
from typing import Any, cast

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils import json as kombu_json

__all__ = ["TRANSPORT", "Channel", "Transport"]

TRANSPORT = "celery_dflock.demo.fsbroker:Transport"
"""The ``broker_transport`` setting that selects this transport."""

_dumps: Callable[[Any], str] = cast(Any, kombu_json).dumps
"""kombu's JSON encoder (UUIDs, dates, Decimals), as kombu's own ``_put`` uses."""

_PARTIAL_NAME = ".partial-{}.tmp"
"""The name a message is written under before it is renamed into its queue: no queue's name
and no ``.msg`` in it, so no kombu version's reader takes it for a message."""


class Channel(filesystem.Channel):
    """A filesystem channel whose messages appear in the queue folder only when complete."""

    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        folder = str(cast(Any, self).data_folder_out)
        final = os.path.join(folder, name)
        partial = os.path.join(folder, _PARTIAL_NAME.format(uuid.uuid4()))
        try:
            with open(partial, "wb") as fh:
                fh.write(_dumps(payload).encode())
            os.replace(partial, final)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {final!r} to directory: {exc}") from exc


class Transport(filesystem.Transport):
    """kombu's filesystem transport, with :class:`Channel`'s atomic puts."""

    Channel = Channel
