"""The nemeses of issue 27 against a lock cluster started as users start it (acceptance 1, 2
and 6).

Three members of a real etcd, each the installed ``dflockd`` with ``--cluster`` and
``--advertise`` and every other setting as shipped (`nemesis_run.DefaultMember`); client
processes with 3 s leases running the fenced workload of `workload`, and the history checker
over every hold of the run. Each nemesis asserts what the issue asks: no double grant (the
unfenced rule: no two provably valid holds of a key overlap; the fenced one: a key's fences
rise in grant order whichever member grants), no lost or stale update of the fenced counter,
and the faulted member's keys granted again afterwards. How long those keys went without a
grant (the availability gap) is printed and put in the fault report (tests/faults/README.md);
it is asserted only for acceptance 2, whose 15 s is a bound users rely on.

The nemeses, each reproducing a defect the issue found in 7070cf0:

- a member paused (SIGSTOP) past its etcd lease, or cut off from etcd only (a proxy between it
  and etcd stalls; its clients still reach it), while waiters are queued behind a long hold on
  its key: once the shard's heir grants the key, the member is resumed (or reconnected); it
  must not grant the waiters it queued before (one of them a raw protocol waiter, asserted
  directly: its client cannot take it elsewhere meanwhile);
- kill -9 of a member: its keys pass on within 15 s (acceptance 2), and a second process with
  the leader's ``--advertise`` refuses to start meanwhile;
- etcd killed (SIGKILL) past the members' lease and restarted, then paused (SIGSTOP) past it.

And issue 47's: a member's only etcd endpoint stalled while a client asks it for a lease longer
than any it granted: only that grant waits for etcd, every other connection is served.

The restarts in place and churn are in test_cluster_restarts.py.
"""

from __future__ import annotations

import concurrent.futures
import signal
import time
from pathlib import Path

import pytest

from dflockd_server.cluster.fencestore import published_longest
from tests.faults.conftest import FaultReport, long_only
from tests.faults.nemesis_run import (
    CLIENT_LEASE_S,
    DEFAULT_CLUSTER_LEASE_S,
    ETCD_DOWN_S,
    FAILOVER_MARGIN_S,
    KILL9_TAKEOVER_BOUND_S,
    PROGRESS_GRANTS,
    PROGRESS_S,
    TAKEOVER_TIMEOUT_S,
    WAITER_HOLD_S,
    NemesisEtcd,
    NemesisRun,
    checked,
    queue_behind_a_long_hold,
    report,
    wait_for,
)
from tests.faults.workload import Injection, now
from tests.support.wire import Wire, holders_and_waiters

pytestmark = pytest.mark.timeout(240)
"""A nemesis run takes 20-60 s on a loaded 2-core machine; the suite's 120 s is too tight."""


@pytest.mark.parametrize(
    "nemesis",
    [
        "pause",
        pytest.param(
            "partition",
            marks=long_only(
                "the simulator's cluster seeds cut members off from etcd; CI runs the pause"
            ),
        ),
    ],
)
def test_a_member_paused_or_cut_off_from_etcd_grants_no_waiter_it_queued(
    tmp_path: Path, fault_report: FaultReport, nemesis_etcd: NemesisEtcd, nemesis: str
) -> None:
    """Acceptance 1 (partition with queued waiter) and 6 (a member paused past its etcd lease,
    a member partitioned from etcd only)."""
    with NemesisRun(
        tmp_path, etcd=nemesis_etcd, seed=2701, etcd_proxies=nemesis == "partition"
    ) as run:
        run.wait_progress(PROGRESS_S, PROGRESS_GRANTS)
        victim = run.victim()
        keys = run.keys_of(victim)
        key = keys[0]
        queue_behind_a_long_hold(run, victim, key)
        # And one raw waiter (the protocol, from the test): its client library cannot move it
        # to another member meanwhile, so it is still queued there when the member resumes.
        raw = Wire(victim.address, timeout=TAKEOVER_TIMEOUT_S)
        queued = holders_and_waiters(victim.address, key)[1]
        raw.send("l", key, f"{int(TAKEOVER_TIMEOUT_S)} {CLIENT_LEASE_S}")
        wait_for(
            lambda: holders_and_waiters(victim.address, key)[1] > queued, "the raw waiter queued"
        )
        others = [m for m in run.members if m.running and m is not victim]
        t = now()
        if nemesis == "pause":
            run.pause_member(victim)
        else:
            run.cut_from_etcd(victim)
        # The keys served by another member (a probe on each, the server's availability).
        served = run.wait_served_elsewhere(keys, victim, t)
        # Contenders whose client starts from the other members (a client that still has
        # the faulted member in its map waits on it), so that the heir grants the key over
        # and over while the faulted member comes back.
        contenders = run.aim(key, 2, seeds=others)
        run.wait_granted_after((key,), t, grantees={w.client for w in contenders})
        run.wait_progress(PROGRESS_S, 5)
        if nemesis == "pause":
            run.resume_member(victim)
        else:
            run.reconnect_to_etcd(victim)
        # The faulted member must not grant the waiter it queued before (issue 27's first
        # defect): it answers it once it has fenced itself, or once it resumes.
        raw_reply = raw.recv()
        raw.close()
        assert not raw_reply.startswith("ok "), (
            f"{victim.advertise} granted {key} to a waiter it had queued before it was "
            f"{nemesis}d, after {others[0].advertise} or {others[1].advertise} took the key "
            f"over: {raw_reply!r}"
        )
        # The waiters' long holds, if the faulted member granted them, end within this.
        run.wait_progress(WAITER_HOLD_S + PROGRESS_S, PROGRESS_GRANTS)
        gap = run.record_gap(f"member {nemesis}: workload", keys, t)
        run.wait_map(live=3)
        back = now()
        run.wait_granted_after(tuple(run.keys_of(victim)) or (key,), back)
        run.settle(TAKEOVER_TIMEOUT_S)
        result = run.finish()
    what = "SIGSTOP" if nemesis == "pause" else "cut off from etcd (proxy stalled)"
    report(
        fault_report,
        result,
        f"lock cluster (defaults): a member {what} past its etcd lease with waiters queued "
        "behind a long hold, resumed once the heir granted the key",
        [gap],
        f"its keys served by another member after {max(served.values()):.1f} s (a probe); "
        f"the waiter it had queued was answered {raw_reply.split()[0]!r}",
    )


@pytest.mark.alone  # its bound is a time users rely on: measured with the machine to itself
def test_kill9_of_a_member_its_keys_pass_on_within_15s_and_a_duplicate_advertise_refuses(
    tmp_path: Path, fault_report: FaultReport, nemesis_etcd: NemesisEtcd
) -> None:
    """Acceptance 2 (kill -9 of a member started with defaults whose clients use 3 s leases:
    its keys are served by another member within 15 s) and 6 (a duplicate ``--advertise``:
    a second process with the leader's, started while the failover runs, refuses)."""
    with NemesisRun(tmp_path, etcd=nemesis_etcd, seed=2703) as run:
        run.wait_progress(PROGRESS_S, PROGRESS_GRANTS)
        victim = run.victim()
        leader = run.member(run.leader().advertise)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            takeover = run.kill_member(victim)
            twin_run = pool.submit(run.duplicate, leader)
            served = run.wait_served_elsewhere(takeover.keys, victim, takeover.killed_t)
            gap = run.record_gap("member SIGKILL", takeover.keys, takeover.killed_t)
            twin = twin_run.result(TAKEOVER_TIMEOUT_S)
        assert twin.returncode != 0, twin.stderr
        assert "--advertise" in twin.stderr and leader.advertise in twin.stderr, twin.stderr
        run.wait_map(live=2)
        leaders_keys = run.keys_of(leader)
        run.wait_granted_after(leaders_keys, now())  # the original serves on
        run.settle(TAKEOVER_TIMEOUT_S)
        result = run.finish()
    # The bound users rely on, measured by a probe that asks the member etcd's map names for
    # each key until one grants it (or says it is held there), from just before the SIGKILL.
    # Expected about 9 s: the dead member's etcd lease runs out at most --cluster-lease-ttl
    # (5 s) after its last keep-alive, then the heir waits the longest lease it published
    # (3 s) + the failover margin (1 s) + a tick, raises its fence in etcd and serves. The
    # probe keeps one connection to each other member and asks every 50 ms from the test
    # process (not a worker process that may be waiting out a refused request), so a loaded
    # machine only lengthens what it measures: its keys were served after 8.1-10.0 s at load
    # 11-14 on 2 cores (the first heir at 8.1 s, the other a second or two later: each heir
    # counts from when it saw the member gone), and after 12.0-15.3 s in the suite on a
    # machine half as fast (CI, 2026-11-29, in the suite's first minutes: every core
    # saturated). So it runs `alone`, as the abuse runs' latencies do: the 5 s left to 15 s
    # absorb scheduling without hiding a failover that waited --max-lease-ttl (300 s) or a
    # second cluster lease. The workload's own first grants (`gap`, printed and reported)
    # come later still, a client that was refused waiting before it asks again.
    expected_s = DEFAULT_CLUSTER_LEASE_S + CLIENT_LEASE_S + FAILOVER_MARGIN_S
    worst_served = max(served.values())
    print(f"served elsewhere after {worst_served:.1f} s (probe), per key {served}")
    assert worst_served <= KILL9_TAKEOVER_BOUND_S, (served, expected_s)
    report(
        fault_report,
        result,
        "lock cluster (defaults, 3 s leases): a member SIGKILLed; a second process with the "
        "leader's --advertise started meanwhile",
        [gap],
        f"served by another member after {worst_served:.1f} s (a probe on the key's new "
        f"member; bound 15 s, about {expected_s:.0f} s expected); the duplicate refused to "
        f"start ({twin.stderr.strip().splitlines()[-1][:160]})",
    )


def test_etcd_killed_then_paused_past_the_members_lease(
    tmp_path: Path, fault_report: FaultReport, nemesis_etcd: NemesisEtcd
) -> None:
    """Acceptance 6: etcd killed and paused."""
    with NemesisRun(tmp_path, etcd=nemesis_etcd, seed=2705) as run:
        run.wait_progress(PROGRESS_S, PROGRESS_GRANTS)
        outages: list[str] = []
        for how in ("SIGKILL", "SIGSTOP"):
            t = now()
            if how == "SIGKILL":
                run.kill_etcd()
                time.sleep(ETCD_DOWN_S)
                nemesis_etcd.start()
            else:
                nemesis_etcd.signal(signal.SIGSTOP)
                time.sleep(ETCD_DOWN_S)
                nemesis_etcd.signal(signal.SIGCONT)
            run.injections.append(Injection(f"etcd {how} for {ETCD_DOWN_S:.0f} s", t))
            run.wait_map(live=3)
            run.wait_granted_after(tuple(run.keys), now())
            run.wait_progress(PROGRESS_S, PROGRESS_GRANTS)
            outages.append(
                f"etcd {how} for {ETCD_DOWN_S:.0f} s: no key granted for "
                f"{run.longest_pause(t, now()):.1f} s at most"
            )
            print(outages[-1])
        run.settle(TAKEOVER_TIMEOUT_S)
        result = run.finish()
    report(
        fault_report,
        result,
        f"lock cluster (defaults): etcd SIGKILLed for {ETCD_DOWN_S:.0f} s and restarted, then "
        f"SIGSTOPped for {ETCD_DOWN_S:.0f} s",
        [],
        "; ".join(outages),
    )


STALL_S = 1.0
"""How long pings go on while the member's etcd is stalled, before the grant within the bound
and the check that the longer one waits: all of it well under the member's 5 s etcd lease
(its last keep-alive may be 1.7 s before the stall) and the 5 s its etcd client waits for the
held publish, so the member serves on, on a loaded machine too."""
LONG_LEASE_S = 20
"""A lease longer than every one the workload used (3 s): its grant needs a longer bound in
etcd (``<prefix>/longest/<member>``), published while the member's etcd is stalled."""


def test_a_stalled_etcd_endpoint_holds_up_only_the_grant_that_needs_a_longer_bound(
    tmp_path: Path, fault_report: FaultReport, nemesis_etcd: NemesisEtcd
) -> None:
    """Issue 47: the only etcd endpoint of a member stalls (its proxy forwards nothing) while a
    client asks it for a lease longer than it ever granted. That grant waits for the publish of
    the longer bound (the fail-over bound holds); every other connection of the member is
    served meanwhile: pings, and a grant within the bound. Before, the publish ran on the event
    loop and the member answered nothing until etcd's client gave up (5 s)."""
    with NemesisRun(tmp_path, etcd=nemesis_etcd, seed=2707, etcd_proxies=True) as run:
        run.wait_progress(PROGRESS_S, PROGRESS_GRANTS)
        victim = run.victim()
        keys = run.keys_of(victim)
        names = (f"stall{i}" for i in range(10_000))
        own = (k for k in names if run.etcd_owner(k)[0] == victim.advertise)
        long_key, short_key = next(own), next(own)
        proxy = run.etcd_proxies[victim.advertise]
        pinger = Wire(victim.address)
        assert pinger.req("ping") == "ok"
        parked = Wire(victim.address, timeout=TAKEOVER_TIMEOUT_S)
        t = now()
        proxy.stall(TAKEOVER_TIMEOUT_S)  # resumed below, well within the member's etcd lease
        run.injections.append(Injection("the member's only etcd endpoint stalled", t))
        parked.send("l", long_key, f"0 {LONG_LEASE_S}")
        slowest, pings = 0.0, 0
        while now() - t < STALL_S:
            began = now()
            assert pinger.req("ping") == "ok"
            slowest, pings = max(slowest, now() - began), pings + 1
            time.sleep(0.01)
        within = Wire(victim.address)
        granted = within.req("l", short_key, f"0 {CLIENT_LEASE_S}")
        assert granted.startswith("ok "), granted  # a grant within the bound is not held up
        assert within.req("r", short_key, granted.split()[1]) == "ok"
        within.close()
        parked.assert_silent(0.2)  # the longer grant waits for etcd
        stalled_s = now() - t
        proxy.resume()
        reply = parked.recv().split()
        assert reply[0] == "ok" and reply[2] == str(LONG_LEASE_S), reply
        assert parked.req("r", long_key, reply[1]) == "ok"
        parked.close()
        pinger.close()
        published = published_longest(nemesis_etcd.client(), run.prefix)[victim.advertise]
        assert published >= LONG_LEASE_S
        run.wait_progress(PROGRESS_S, PROGRESS_GRANTS)
        run.settle(TAKEOVER_TIMEOUT_S)
        result = run.finish()
    during = sum(
        1
        for h in result.holds
        if h.key in keys and h.granted_t is not None and t <= h.granted_t <= t + stalled_s
    )
    observed = (
        f"etcd stalled {stalled_s:.2f} s: {pings} pings answered (slowest "
        f"{slowest * 1000:.1f} ms), a 3 s lease granted, the workload granted its keys "
        f"{during} times meanwhile; the {LONG_LEASE_S} s lease was answered once etcd had "
        f"{published} s"
    )
    print(observed)
    print(checked(result))
    report(
        fault_report,
        result,
        "lock cluster (defaults): a member's only etcd endpoint stalled while a client asks "
        f"it for a {LONG_LEASE_S} s lease (longer than any before)",
        [],
        observed,
    )
