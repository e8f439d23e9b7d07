"""tests/support/ports: ports for servers a test starts on ports of its choosing."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

from tests.support.ports import EPHEMERAL_RANGE, REGISTRY, free_port, free_ports
from tests.support.venvs import ROOT


def test_ports_asked_for_together_are_distinct() -> None:
    """A fleet's ports are asked for together. Asked for one after another, each released
    before the next, they may repeat (the kernel hands a released port out again): CI once
    started a static fleet whose members list named one port twice, and its servers refused
    the list. 500 sequential picks repeat a port almost always (about 99%); these never do."""
    ports = free_ports(500)
    assert len(set(ports)) == len(ports)
    assert all(0 < port < 65536 for port in ports)


def test_a_single_free_port_is_bindable() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_ports_are_from_below_the_ephemeral_range_and_never_given_twice() -> None:
    """No outgoing connection's own end is put on them (CI once saw a member restarted in place
    find its port taken), and a port given to this process is not given again while it runs."""
    low = int(EPHEMERAL_RANGE.read_text().split()[0])
    first, second = free_ports(100), free_ports(100)
    assert all(port < low for port in first + second)
    assert not set(first) & set(second)


_TAKER = (
    "import sys; from tests.support.ports import free_ports; "
    "print(*free_ports(int(sys.argv[1])), flush=True); sys.stdin.read()"
)
"""A process that takes ``argv[1]`` ports, prints them, and runs until its stdin closes."""


def test_ports_given_to_another_process_are_not_given_elsewhere_while_it_runs() -> None:
    """pytest-xdist's processes and CI's other jobs share the machine: a port one of them
    holds for a server it restarts in place is never handed to another. Once that process has
    ended, its ports can be given again. (Each side is a process of its own: this one keeps
    the ports it is given until it ends.)"""

    def taker(count: int) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-c", _TAKER, str(count)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def ports_of(proc: subprocess.Popen[str]) -> set[int]:
        assert proc.stdout is not None
        return {int(port) for port in proc.stdout.readline().split()}

    with taker(3000) as first:
        theirs = ports_of(first)
        with taker(3000) as second:
            assert len(theirs) == 3000 and not theirs & ports_of(second)
            second.communicate("")
        first.communicate("")
    # Ended: the next hand-out drops its ports from the registry (they can be given again, and
    # the other processes of the run, CI's other jobs included, may be given them at once: a
    # port of theirs reserved now must be a live process's, not the ended one's).
    free_port()
    owners = {int(port): pid for port, pid in json.loads(REGISTRY.read_text()).items()}
    ended = {first.pid, second.pid}
    assert not {p for p in theirs if owners.get(p) in ended}, (
        "the ended process's ports are still reserved"
    )
