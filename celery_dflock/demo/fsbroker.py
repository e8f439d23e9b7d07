# pyright: reportMissingTypeStubs=false
"""kombu's filesystem transport with atomic puts and bindings, for the demo and the test harness.

kombu's own ``_put`` creates the message file and then writes into it, and ``_get`` takes any
file named ``*.<queue>.msg`` unlocked: a worker may claim a half-written file. Here a message
is written under a name no queue matches (no queue name, no ``.msg``) and renamed into place
once complete, so a reader sees a whole message or none. kombu's exchange tables have the same
race (``_queue_bind`` creates the file, then locks it); here a table changes under a lock on a
file of its own and is renamed into place whole.

Use it with ``broker_url="filesystem://"`` and ``broker_transport=TRANSPORT``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from time import monotonic
from typing import Any, cast

from kombu.exceptions import ChannelError
from kombu.transport import filesystem, virtual
from kombu.utils import json as kombu_json

TRANSPORT = "celery_dflock.demo.fsbroker:Transport"
"""The ``broker_transport`` setting that selects this transport."""

_dumps: Callable[[Any], str] = cast(Any, kombu_json).dumps
_loads: Callable[[str], Any] = cast(Any, kombu_json).loads
_fs: Any = filesystem  # untyped
_PARTIAL_NAME = ".partial-{}.tmp"


def _put_whole(final: Path, data: bytes) -> None:
    """Write ``data`` under a partial name beside ``final`` and rename it into place."""
    partial = final.with_name(_PARTIAL_NAME.format(uuid.uuid4()))
    try:
        partial.write_bytes(data)
        os.replace(partial, final)
    except OSError:
        partial.unlink(missing_ok=True)
        raise


class Channel(filesystem.Channel):
    """A filesystem channel whose messages and exchange tables appear only when complete."""

    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        final = Path(cast(Any, self).data_folder_out) / name
        try:
            _put_whole(final, _dumps(payload).encode())
        except OSError as exc:
            raise ChannelError(f"Cannot add file {str(final)!r} to directory: {exc}") from exc

    def _table_file(self, exchange: str) -> Path:
        """The file holding ``exchange``'s table (kombu 5.5+ also checks the name is safe)."""
        channel: Any = self
        if (checked := getattr(channel, "_exchange_file", None)) is not None:
            return Path(checked(exchange))
        return Path(channel.control_folder) / f"{exchange}.exchange"

    def get_table(self, exchange: str) -> list[Any]:
        """``exchange``'s table: whole, as its last change left it (no lock needed to read)."""
        file = self._table_file(exchange)
        try:
            text = file.read_text(encoding="utf-8")
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise ChannelError(f"Cannot open {file}: {exc}") from exc
        return [_fs.exchange_queue_t(*entry) for entry in _loads(text)]

    def _change_table(
        self, exchange: str, routing_key: str, pattern: str, queue: str, *, add: bool
    ) -> None:
        """Add the binding to ``exchange``'s table (first), or remove it, under the table's own
        lock, and put the result in place whole (nothing is written when it is already so)."""
        entry = _fs.exchange_queue_t(routing_key or "", pattern or "", queue or "")
        file = self._table_file(exchange)
        try:
            file.parent.mkdir(exist_ok=True)
            # The lock file is opened for appending: created if missing, never truncated.
            with open(file.with_name(file.name + ".lock"), "ab") as guard:
                _fs.lock(guard, _fs.LOCK_EX)
                try:
                    table = self.get_table(exchange)
                    if (entry in table) != add:
                        if add:
                            table.insert(0, entry)
                        else:
                            table.remove(entry)
                        _put_whole(file, _dumps(table).encode())
                finally:
                    _fs.unlock(guard)
        except OSError as exc:
            raise ChannelError(f"Cannot change {file}: {exc}") from exc

    def _queue_bind(self, exchange: str, routing_key: str, pattern: str, queue: str) -> None:
        self._change_table(exchange, routing_key, pattern, queue, add=True)

    def _delete(
        self, queue: str, exchange: str, routing_key: str, pattern: str, *args: Any, **kwargs: Any
    ) -> None:
        # The virtual transport's own (drop the queue's messages), then the binding.
        base: Any = virtual.Channel
        base._delete(self, queue, exchange, routing_key, pattern, *args, **kwargs)
        self._change_table(exchange, routing_key, pattern, queue, add=False)


class Transport(filesystem.Transport):
    """kombu's filesystem transport, with `Channel`'s atomic puts and bindings."""

    Channel = Channel
