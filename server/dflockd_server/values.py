"""The parsers and checks the settings table (``settings``) names: each parser turns a raw string
into a value or raises ``ValueError`` with a short reason; each check returns ``None`` or a reason a
typed value is unusable."""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from dflockd_server import constants as c

T = TypeVar("T")


def parse_int(raw: str) -> int:
    text = raw.strip()
    if not text.removeprefix("-").isdigit() or not text.isascii():
        raise ValueError("not an integer")
    return int(text)


def parse_float(raw: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        raise ValueError("not a number") from None
    if not math.isfinite(value):
        raise ValueError("not a finite number")
    return value


def parse_bool(raw: str) -> bool:
    text = raw.strip().lower()
    if text in {"1", "yes", "true", "on"}:
        return True
    if text in {"0", "no", "false", "off"}:
        return False
    raise ValueError("expected 1/yes/true or 0/no/false")


def parse_str(raw: str) -> str:
    if not (text := raw.strip()):
        raise ValueError("empty")
    return text


def _or_auto(parse: Callable[[str], T]) -> Callable[[str], T | None]:
    """``parse``, or ``auto`` (``None``: derived at start-up from other settings)."""

    def parse_or_auto(raw: str) -> T | None:
        return None if raw.strip().lower() == "auto" else parse(raw)

    return parse_or_auto


parse_grace = _or_auto(parse_float)
parse_auto_int = _or_auto(parse_int)


def _one_of(choices: tuple[str, ...]) -> tuple[Callable[[str], str], Callable[[str], str | None]]:
    """The parser (any case) and the check of a setting that is one of ``choices``."""
    expected = f"expected one of {', '.join(choices)}"

    def parse(raw: str) -> str:
        text = raw.strip().lower()
        if text not in choices:
            raise ValueError(expected)
        return text

    def check(value: str) -> str | None:
        return None if value in choices else expected

    return parse, check


parse_log_level, check_log_level = _one_of(("debug", "info", "warning", "error", "critical"))
parse_fsync, check_fsync = _one_of(c.JOURNAL_FSYNC_MODES)
parse_event_loop, check_event_loop = _one_of(("auto", "asyncio", "uvloop"))


def _parses(parse: Callable[[T], object]) -> Callable[[T], str | None]:
    """The check that a value is what ``parse`` reads: its ``ValueError``'s reason, or None."""

    def check(value: T) -> str | None:
        try:
            parse(value)
        except ValueError as exc:
            return str(exc)
        return None

    return check


def check_positive(value: float) -> str | None:
    return None if value > 0 else "must be > 0"


def check_non_negative(value: float) -> str | None:
    return None if value >= 0 else "must be >= 0"


def check_seconds(value: float) -> str | None:
    """A duration the server waits or repeats at: from ``MIN_SECONDS`` (a sweep or a timer
    more often burns a core to do nothing) to ``MAX_NUMBER`` (a lease's limit; a timeout of
    1e300 s was taken as given)."""
    if c.MIN_SECONDS <= value <= c.MAX_NUMBER:
        return None
    return f"must be {c.MIN_SECONDS:g} to {c.MAX_NUMBER} seconds"


def check_seconds_or_0(value: float) -> str | None:
    """``check_seconds``, or 0 (none, or at once, as the setting says)."""
    if value == 0 or check_seconds(value) is None:
        return None
    return f"must be 0 or {c.MIN_SECONDS:g} to {c.MAX_NUMBER} seconds"


def check_auto(value: float | None) -> str | None:
    """0 to ``MAX_NUMBER`` (as far as a lease may go), or ``auto`` (``None``)."""
    if value is None or 0 <= value <= c.MAX_NUMBER:
        return None
    return f"must be 0..{c.MAX_NUMBER} or auto"


def check_port(value: int) -> str | None:
    return None if 0 <= value <= 65535 else "must be 0..65535"


def check_lease(value: int) -> str | None:
    return None if 0 < value <= c.MAX_NUMBER else f"must be 1..{c.MAX_NUMBER}"


def check_nothing(_value: object) -> str | None:
    return None


def parse_member(raw: str) -> str:
    """``HOST:PORT`` (an IPv6 host in brackets: ``[::1]:6388``), as written."""
    text = raw.strip()
    host, sep, port = text.rpartition(":")
    if host.startswith("[") != host.endswith("]") or (":" in host and not host.startswith("[")):
        raise ValueError(f"{text!r} is not HOST:PORT (put an IPv6 host in brackets: [::1]:6388)")
    if not sep or host in ("", "[]") or any(ch.isspace() or ch in ",/" for ch in host):
        raise ValueError(f"{text!r} is not HOST:PORT")
    if not port.isascii() or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"{text!r}: the port must be 1..65535")
    return f"{host}:{int(port)}"


def _each_once(given: Iterable[str]) -> tuple[str, ...]:
    """Each of ``given`` as ``parse_member`` reads it, in order; refused when none is given or one
    appears twice (however written)."""
    if not (members := tuple(map(parse_member, given))):
        raise ValueError("empty: give HOST:PORT,HOST:PORT,... (every member, in one order)")
    for i, member in enumerate(members):
        if member in members[:i]:
            raise ValueError(
                f"{member} appears twice (each member once, in the same order everywhere)"
            )
    return members


def parse_members(raw: str) -> tuple[str, ...]:
    """A comma-separated list of ``HOST:PORT``, in order, each once."""
    return _each_once(part for part in raw.split(",") if part.strip())


check_members = _parses(_each_once)
check_member = _parses(parse_member)


@dataclass(frozen=True, slots=True)
class ClusterUrl:
    """The ``--cluster`` setting, read."""

    endpoints: tuple[tuple[str, int], ...]
    """``(host, port)`` of each etcd endpoint, as listed (an IPv6 host without brackets)."""
    tls: bool
    prefix: str

    def format(self) -> str:
        """The URL written out in full (``etcd://h1:2379,h2:2379/dflockd``)."""
        shown = ",".join(
            f"[{host}]:{port}" if ":" in host else f"{host}:{port}" for host, port in self.endpoints
        )
        scheme = c.CLUSTER_TLS_SCHEME if self.tls else c.CLUSTER_SCHEME
        return f"{scheme}://{shown}{self.prefix}"


CLUSTER_URL_FORM = "etcd://HOST:PORT[,HOST:PORT...][/PREFIX] (etcds://... for TLS)"


def split_cluster_url(url: str) -> ClusterUrl:
    """``--cluster`` read (prefix default ``/dflockd``); ``ValueError`` saying what is wrong."""
    text = url.strip()
    scheme, sep, rest = text.partition("://")
    if not sep or scheme not in (c.CLUSTER_SCHEME, c.CLUSTER_TLS_SCHEME):
        raise ValueError(f"{text!r} is not {CLUSTER_URL_FORM}")
    if "?" in rest or "#" in rest or "@" in rest:
        raise ValueError(
            f"{text!r}: no query, fragment or user@ allowed ({CLUSTER_URL_FORM}; the etcd user "
            "is --cluster-user)"
        )
    addresses, slash, prefix = rest.partition("/")
    endpoints: list[tuple[str, int]] = []
    for address in addresses.split(","):
        if not address.strip():
            raise ValueError(f"{text!r}: an empty etcd endpoint in the list ({CLUSTER_URL_FORM})")
        member = parse_member(address)
        host, _, port = member.rpartition(":")
        endpoint = (host.strip("[]"), int(port))
        if endpoint in endpoints:
            raise ValueError(f"{text!r}: the etcd endpoint {member} is listed twice")
        endpoints.append(endpoint)
    prefix = f"/{prefix}".rstrip("/") if slash else ""
    if any(ch.isspace() for ch in prefix):
        raise ValueError(f"{text!r}: the prefix holds whitespace")
    return ClusterUrl(
        tuple(endpoints), scheme == c.CLUSTER_TLS_SCHEME, prefix or c.DEFAULT_CLUSTER_PREFIX
    )


def parse_cluster(raw: str) -> str:
    """``--cluster``, normalized (the default prefix written out)."""
    return split_cluster_url(raw).format()


check_cluster = _parses(split_cluster_url)


def check_readable_file(value: str) -> str | None:
    """Why the file a setting names cannot be read, or None: missing or unreadable, a
    directory, or no regular file (a FIFO: the start waited without end for a writer to open
    it; a pipe, as ``<(...)``: read twice, it was empty the second time)."""
    try:
        mode = os.stat(value).st_mode
        if stat.S_ISDIR(mode):
            return "it is a directory: give the file in it"
        if not stat.S_ISREG(mode):
            return "it is no regular file (a FIFO, a pipe, a socket or a device): give a file"
        with open(value, "rb"):
            pass
    except OSError as exc:
        return f"cannot read it: {exc.strerror or exc}"
    return None
