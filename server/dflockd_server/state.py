"""The state directory: where a server keeps what must outlive it (its lease journal, its fence
ceiling, the longest lease it granted), and what a start makes of it (docs/server.md, "State and
restarts").

By default each server has its own, by address (``$XDG_STATE_HOME/dflockd/<host>-<port>``; none
on port 0, where no client can hold a lease from an earlier server), locked with its pid in
``lock``. A start (``plan_start``) restores every lease of the journal still running (``replay``
says for how long, and when the start must wait too); it waits a restart grace, the longest lease
the previous run recorded (else ``max_lease_ttl_s``), when what that run granted cannot be known:
earlier state but no journal, or one unreadable, without a whole header, or damaged before its
last record. A start on the same boot as one stopped during its grace waits out the rest of it."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from dflockd_server.config import Config, ConfigError
from dflockd_server.fence import FenceStateError
from dflockd_server.grace import (
    GraceDecision,
    decide_grace,
    grace_left,
    grace_path,
    read_longest_lease,
)
from dflockd_server.pagecache import mount_id, tail_resident
from dflockd_server.recorded import RecordedGrant, RecordedGrants
from dflockd_server.replay import (
    COMPLETE_SUFFIX,
    JournalRead,
    Restore,
    read_journal,
    restored_leases,
)
from dflockd_server.settings import names

log = logging.getLogger("dflockd_server")

NO_STATE = "none"  # `--state-dir none`: keep no state

JOURNAL, FENCE, GRACE, LOCK = "journal", "fence", "grace", "lock"
DAMAGED_SUFFIX = ".damaged"


def default_state_dir(host: str, port: int, env: Mapping[str, str] | None = None) -> str:
    """``$XDG_STATE_HOME/dflockd/<host>-<port>`` (``~/.local/state`` when unset)."""
    env = os.environ if env is None else env
    base = env.get("XDG_STATE_HOME") or os.path.join(
        env.get("HOME") or os.path.expanduser("~"), ".local", "state"
    )
    name = f"{host.strip('[]').replace(':', '_').replace('/', '_') or 'any'}-{port}"
    return os.path.join(base, "dflockd", name)


def resolve_state_dir(config: Config, env: Mapping[str, str] | None = None) -> str | None:
    """The state directory a server with ``config`` uses, in full (``~`` is the home directory, as
    in a shell: docker-compose, systemd and Kubernetes do not expand it), or None (no state)."""
    if (given := config.state_dir) is not None:
        return None if given.lower() == NO_STATE else os.path.abspath(os.path.expanduser(given))
    return None if config.port == 0 else default_state_dir(config.host, config.port, env)


class StateDir:
    """An open state directory: made if missing (mode 0700), locked for this process."""

    __slots__ = ("_lock_fd", "address", "path")

    def __init__(self, path: str, *, address: str | None = None) -> None:
        self.path = path
        self.address = address  # `host:port` when `path` is that address's default directory
        self._lock_fd = -1

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def open(self) -> None:
        """Make and lock it; `ConfigError` when it cannot be made, or another server uses it."""
        where = f"{names('state_dir')} {self.path}"
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
            fd = os.open(self.file(LOCK), os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise ConfigError(
                f"{where}: cannot use it ({exc}); give a directory this user can write, or "
                "--state-dir none to keep no state (a restart then forgets every lock)"
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            owner = ""
            with contextlib.suppress(OSError):
                owner = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            os.close(fd)
            if self.address is not None:
                raise ConfigError(
                    f"another dflockd (pid {owner or '?'}) already runs on {self.address}: "
                    f"stop it, or start this one on another {names('port')}. (It holds "
                    f"this address's default state directory, {self.path}.)"
                ) from None
            raise ConfigError(
                f"{where}: another dflockd (pid {owner or '?'}) is using it; two servers "
                "cannot share a state directory: give this one its own --state-dir"
            ) from None
        with contextlib.suppress(OSError):  # the pid is only for the message above
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def close(self) -> None:
        fd, self._lock_fd = self._lock_fd, -1
        if fd >= 0:
            os.close(fd)  # releases the flock

    def has_earlier_state(self) -> bool:
        """Whether a run before this one left state here (a fence ceiling or grace record)."""
        return any(os.path.exists(self.file(name)) for name in (FENCE, GRACE))


@dataclass(frozen=True, slots=True)
class StartPlan:
    """What a start does with the state it finds."""

    grace: GraceDecision
    grace_record: str | None  # where the longest lease granted is kept (`grace`), or None
    fence_file: str | None
    journal: str | None = None
    """The journal's path; None without a state directory (then no ``leases``, no ``read``)."""
    leases: list[RecordedGrant] = field(default_factory=lambda: [])
    """The leases to restore, each with its seconds left (``left``)."""
    read: JournalRead | None = None
    longest_restored: int = 0
    """The longest lease among ``leases`` (its own or its ``<onclose>`` lease), 0 when none."""
    resume: bool = False
    """Every lease comes back to its recorded end: the start goes on appending to the journal
    (``Journal.resume``) rather than writing a new file."""
    ended: list[str] = field(default_factory=lambda: [])
    """With ``resume``: tokens of grants ended before the restart (the start records their end)."""


def plan_start(config: Config, state: StateDir | None) -> StartPlan:
    """Read the state and decide the start (see the module's doc)."""
    if state is None:
        record = grace_path(config.fence_state_file) if config.fence_state_file else None
        previous = read_longest_lease(record) if record is not None else None
        existed = config.fence_state_file is not None and os.path.exists(config.fence_state_file)
        grace = _with_grace_left(config, decide_grace(config, previous, existed), record)
        return StartPlan(grace, record, config.fence_state_file)
    record = state.file(GRACE)
    fence = config.fence_state_file or state.file(FENCE)
    journal = state.file(JOURNAL)
    why = ""
    recorded = record  # where the longest lease granted is read, if a grace must be guessed
    read: JournalRead | None = None
    leases: list[RecordedGrant] = []
    restore: Restore | None = None
    resume = False
    ended: list[str] = []
    # Asked before anything reads the file (reading it brings its last page in).
    resident = tail_resident(journal)
    try:
        if os.path.exists(journal):
            read = read_journal(journal)
    except OSError as exc:
        why = f"the journal {journal} cannot be read ({exc})"
    else:
        if read is not None and read.anchor is None and state.has_earlier_state():
            # Each journal is written whole, fsynced and renamed in place: one without a whole
            # header is what a disk error and a repair left, not what a run wrote.
            why = (
                f"the journal {journal} holds no header (emptied or cut short by a disk error "
                "or a repair?); what the previous run granted is unknown"
            )
        elif read is not None:
            run_longest = None
            with contextlib.suppress(FenceStateError):
                run_longest = read_longest_lease(record)
            complete = os.path.exists(journal + COMPLETE_SUFFIX)
            restore = restored_leases(
                read,
                complete=complete,
                run_longest=config.max_lease_ttl_s if run_longest is None else run_longest,
                tail_lost=_tail_lost(read, complete, state.path, resident),
            )
            leases = restore.leases
            # (more leases ended than are restored: a new file, which holds only these, is smaller)
            if restore.exact and not read.damage and len(restore.ended) <= len(leases):
                resume, ended = True, restore.ended
            read.leases = RecordedGrants()  # the plan's now: let go as they are restored
            _report(journal, read)
            if read.damaged_before_tail:
                why = (
                    f"the journal {journal} is damaged before its end ({read.damage}); the "
                    "leases recorded after the damage are unknown"
                )
        elif state.has_earlier_state():
            why = (
                f"the state directory {state.path} holds no journal (removed, or written by "
                "a version that kept none); what the previous run granted is unknown"
            )
        elif state.address is not None and (earlier := _another_host_of(state.path)):
            port = state.path.rpartition("-")[2]
            why = (
                f"the state directory {earlier.path} holds the state of a server that ran on "
                f"port {port} with another --host, whose holders may come back to this one "
                f"(start with --state-dir {earlier.path} to restore their leases)"
            )
            recorded = earlier.file(GRACE)
    if config.restart_grace_s is not None:
        grace = GraceDecision(config.restart_grace_s, "set by restart_grace_s")
    elif why:
        source, unknown = "the longest lease it recorded", "no longest lease recorded"
        try:
            longest = read_longest_lease(recorded)
        except FenceStateError as exc:
            longest, unknown = None, str(exc)
        if longest is None:
            longest, source = config.max_lease_ttl_s, f"max_lease_ttl_s ({unknown})"
        grace = GraceDecision(float(longest), f"{why}: waiting {source}")
    elif restore is not None:
        grace = GraceDecision(
            restore.grace_s, f"restored {len(leases)} lease(s) from the journal ({restore.how})"
        )
    else:
        grace = GraceDecision(0.0, f"first start with the state directory {state.path}")
    grace = _with_grace_left(config, grace, record)
    longest = restore.longest if restore is not None else 0
    return StartPlan(grace, record, fence, journal, leases, read, longest, resume, ended)


def _another_host_of(path: str) -> StateDir | None:
    """The default directory, holding state, of another host on the port of ``path``, this address's
    default (the server ran with another ``--host``; its holders come back to this one), or None."""
    parent, name = os.path.split(path)
    port = name.rpartition("-")[2]
    with contextlib.suppress(OSError):
        for other in sorted(os.listdir(parent)):
            earlier = StateDir(os.path.join(parent, other))
            if other != name and other.rpartition("-")[2] == port and earlier.has_earlier_state():
                return earlier
    return None


def _with_grace_left(config: Config, grace: GraceDecision, record: str | None) -> GraceDecision:
    """``grace``, or the rest of the grace of a start on this boot stopped during it, if longer."""
    if config.restart_grace_s is not None or record is None:
        return grace
    if (left := grace_left(record)) <= grace.seconds:
        return grace
    return GraceDecision(
        left,
        f"a start on this boot was stopped during its restart grace: waiting out the {left:g} s "
        f"left of it (this start alone: {grace.why})",
    )


def _tail_lost(read: JournalRead, complete: bool, directory: str, resident: bool | None) -> str:
    """Why the journal may lack its last records on this boot ("" where it cannot), its last
    page being out of the page cache: its file system was mounted anew since, or a write
    failed before that run ended (no ``complete`` mark)."""
    if resident is not False:
        return ""
    now = mount_id(directory) if read.mount is not None else None
    if now is not None and now != read.mount:
        why = (
            f"the state dir's file system was mounted anew since the journal was written "
            f"(mount {read.mount}, now {now}; after a repair?), and what the kernel had not yet "
            "put on the disk went with the old mount"
        )
    elif not complete:
        why = (
            "a write of the journal failed before the previous run ended (no complete mark) "
            "and its last page is no longer in the page cache: what an fsync could not put "
            "on the disk is gone"
        )
    else:
        return ""
    log.warning("journal: %s", why)
    return why


def _report(path: str, read: JournalRead) -> None:
    """Log what was dropped of a damaged journal, and keep a copy of it."""
    if not read.damage:
        return
    log.warning(
        "journal: dropped %d byte(s) in %d line(s) from the first damaged record of %s (%s)%s",
        read.dropped_bytes,
        read.dropped_lines,
        path,
        read.damage,
        "; it was the last record (a write cut short), so nothing acknowledged under "
        "--journal-fsync always is lost"
        if read.torn_tail
        else "; the records after it are dropped too",
    )
    try:
        with open(path, "rb") as src, open(path + DAMAGED_SUFFIX, "wb") as dst:
            dst.write(src.read())
        log.warning("journal: the damaged journal is kept as %s", path + DAMAGED_SUFFIX)
    except OSError as exc:
        log.warning("journal: could not keep a copy of the damaged journal: %s", exc)
