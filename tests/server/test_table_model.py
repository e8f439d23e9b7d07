"""Model-based test of the pure lock table: random acquire / release / renew / expire /
timeout / disconnect / GC interleavings over two keys, each taken as a lock or as a semaphore
of a few limits, against a plain reference model. A key is one resource (a lock is a semaphore
of limit 1): its first acquire while idle fixes its limit, another limit while it is busy is
refused. The table runs on a fake clock; no sockets."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise

from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dflockd_server.fence import fence_of
from dflockd_server.table import Client, Holder, KeyState, LimitMismatch, LockTable, Waiter
from dflockd_server.tokens import FenceCounter
from tests.support.tables import key_state

KEYS = ["a", "b"]
LIMITS: list[int | None] = [None, 1, 2, 3]  # None: a lock (``l``); N: a semaphore (``sl``)
N_CLIENTS = 3


@dataclass
class ModelKey:
    """The reference: holders (request id -> expiry) in grant order, a FIFO list of waiters."""

    limit: int = 1
    is_sem: bool = False
    holders: dict[int, float] = field(default_factory=lambda: {})
    queue: list[int] = field(default_factory=lambda: [])
    grants: list[int] = field(default_factory=lambda: [])


class LockTableMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.issued: list[int] = []
        counter = FenceCounter(wall_clock_ns=lambda: 1_000)

        def new_token() -> str:
            token = counter.next_token()
            self.issued.append(fence_of(token))
            return token

        self.table = LockTable(clock=lambda: self.now, new_token=new_token, max_locks=100)
        self.clients: list[Client] = [self._open(ci) for ci in range(N_CLIENTS)]
        self.model: dict[str, ModelKey] = {key: ModelKey() for key in KEYS}
        self.seq = 0
        self.req_key: dict[int, str] = {}
        self.req_lease: dict[int, int] = {}
        self.req_client: dict[int, int] = {}
        self.holders: dict[int, Holder] = {}
        self.tokens: dict[int, str] = {}
        """Each grant's token, as its reply gave it (a released holder keeps none)."""
        self.waiters: dict[int, Waiter] = {}
        self.waiter_req: dict[int, int] = {}  # id(waiter) -> request id

    def _open(self, ci: int) -> Client:
        """Client ``ci``'s connection: the odd ones are session connections (issue 47)."""
        client = self.table.open_client()
        client.session = ci % 2 == 1
        return client

    # ------------------------------------------------------------------ the model
    def _fill(self, mk: ModelKey) -> None:
        while mk.queue and len(mk.holders) < mk.limit:
            req = mk.queue.pop(0)
            mk.holders[req] = self.now + self.req_lease[req]
            mk.grants.append(req)

    def _state(self, key: str) -> KeyState:
        state = key_state(self.table, key)
        assert state is not None
        return state

    def _touch(self, mk: ModelKey) -> None:
        for req, expires in list(mk.holders.items()):
            if expires <= self.now:
                del mk.holders[req]
        self._fill(mk)

    def _model_holding(self, req: int) -> ModelKey | None:
        mk = self.model[self.req_key[req]]
        return mk if req in mk.holders else None

    # ------------------------------------------------------------------ table callbacks
    def _woken(self, waiter: Waiter) -> None:
        req = self.waiter_req[id(waiter)]
        assert waiter.holder is not None
        self.holders[req] = waiter.holder
        self.tokens[req] = waiter.holder.token
        del self.waiters[req]

    # ------------------------------------------------------------------ rules
    @rule(
        ci=st.integers(0, N_CLIENTS - 1),
        key=st.sampled_from(KEYS),
        limit=st.sampled_from(LIMITS),
        lease=st.integers(1, 3),
        queue=st.booleans(),
    )
    def acquire(self, ci: int, key: str, limit: int | None, lease: int, queue: bool) -> None:
        mk = self.model[key]
        wanted = 1 if limit is None else limit
        self.seq += 1
        req = self.seq
        self.req_lease[req] = lease
        self.req_key[req] = key
        self.req_client[req] = ci
        # model
        self._touch(mk)
        busy = bool(mk.holders or mk.queue)
        expect: str
        if busy and wanted != mk.limit:
            expect = "mismatch"
        else:
            if not busy:
                mk.limit, mk.is_sem = wanted, limit is not None
            if len(mk.holders) < mk.limit and not mk.queue:
                mk.holders[req] = self.now + lease
                mk.grants.append(req)
                expect = "granted"
            elif queue:
                mk.queue.append(req)
                expect = "queued"
            else:
                expect = "none"
        # table
        try:
            got = self.table.acquire(self.clients[ci], key, lease, limit, queue=queue)
        except LimitMismatch as exc:
            assert expect == "mismatch"
            assert (exc.key, exc.limit) == (key, mk.limit)
            return
        if isinstance(got, Holder):
            assert expect == "granted"
            self.holders[req] = got
            self.tokens[req] = got.token
        elif isinstance(got, Waiter):
            assert expect == "queued"
            got.wake = self._woken
            self.waiters[req] = got
            self.waiter_req[id(got)] = req
        else:
            assert expect == "none"

    @precondition(lambda self: bool(self.holders))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(sorted(self.holders)))
        key = self.req_key[req]
        mk = self.model[key]
        self._touch(mk)
        expected = req in mk.holders
        if expected:
            del mk.holders[req]
            self._fill(mk)
        assert self.table.release(key, self.tokens[req]) is expected

    @rule(key=st.sampled_from(KEYS))
    def force_release(self, key: str) -> None:
        """An operator frees the key whoever holds it: every holder goes, the queue is
        granted in order (``fr``)."""
        mk = self.model[key]
        self._touch(mk)
        freed = sorted(mk.holders)
        mk.holders.clear()
        self._fill(mk)
        got = self.table.force_release(key)
        assert len(got) == len(freed) and not any(holder.live for holder in got)

    @precondition(lambda self: bool(self.holders))
    @rule(data=st.data(), lease=st.integers(1, 3))
    def renew(self, data: st.DataObject, lease: int) -> None:
        req = data.draw(st.sampled_from(sorted(self.holders)))
        key = self.req_key[req]
        mk = self.model[key]
        self._touch(mk)
        expected = req in mk.holders
        if expected:
            mk.holders[req] = self.now + lease
        got = self.table.renew(key, self.tokens[req], lease)
        assert got == (lease if expected else None)

    @precondition(lambda self: bool(self.waiters))
    @rule(data=st.data())
    def time_out_a_waiter(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(sorted(self.waiters)))
        mk = self.model[self.req_key[req]]
        mk.queue.remove(req)
        self._fill(mk)
        waiter = self.waiters.pop(req)
        waiter.wake = None
        self.table.cancel_wait(waiter)

    @rule(dt=st.sampled_from([0.5, 1.0, 2.0, 3.5]), sweep=st.booleans())
    def advance_clock(self, dt: float, sweep: bool) -> None:
        self.now += dt
        if sweep:
            for mk in self.model.values():
                self._touch(mk)
            self.table.expire()

    @rule(ci=st.integers(0, N_CLIENTS - 1), by_peer=st.booleans())
    def disconnect(self, ci: int, by_peer: bool) -> None:
        """The connection closes: by its peer (a plain one's grants end at once, a session
        one's at most the session time later) or by the server itself (they run to their
        lease's end: issue 47)."""
        for req in [r for r in self.waiters if self.req_client[r] == ci]:
            mk = self.model[self.req_key[req]]
            mk.queue.remove(req)
            self._fill(mk)
            del self.waiters[req]
        held = [r for r, h in self.holders.items() if self.req_client[r] == ci and h.live]
        session = self.clients[ci].session
        for req in sorted(held, key=lambda r: fence_of(self.tokens[r])):
            mk = self.model[self.req_key[req]]
            if not by_peer or req not in mk.holders:
                continue
            if session:
                mk.holders[req] = min(mk.holders[req], self.now + self.table.session_ttl_s)
                continue
            del mk.holders[req]  # lapsed but unswept leases are dropped as well
            self._fill(mk)
        self.table.disconnect(self.clients[ci], by_peer=by_peer)
        self.clients[ci] = self._open(ci)
        for req in list(self.req_client):
            if self.req_client[req] == ci:
                self.req_client[req] = -1  # the old connection's requests belong to nobody

    @rule()
    def gc(self) -> None:
        self.table.gc(0.0)
        # gc finds idle keys without scanning the table: it must still find every one.
        assert not [key for key in self.table.grants.keys if self._state(key).idle]

    # ------------------------------------------------------------------ invariants
    @invariant()
    def table_matches_model(self) -> None:
        for key, mk in self.model.items():
            state = key_state(self.table, key)
            live = {r for r, h in self.holders.items() if h.live and self.req_key[r] == key}
            assert live == set(mk.holders), (key, live, mk.holders)
            if state is None:
                assert not mk.holders and not mk.queue
                continue
            assert set(state.holders) == {self.tokens[r] for r in live}
            queue = state.queue
            waiting = [w for w in queue.items[queue.head :] if w.active] if queue else []
            queued = [self.waiter_req[id(w)] for w in waiting]
            assert queued == mk.queue  # FIFO order
            assert state.n_waiting == len(mk.queue)
            assert (state.limit, state.is_sem) == (mk.limit, mk.is_sem)

    @invariant()
    def never_over_limit(self) -> None:
        for key, mk in self.model.items():
            state = key_state(self.table, key)
            if state is not None:
                assert len(state.holders) <= state.limit
                if not state.is_sem:
                    assert state.limit == 1  # a lock is a semaphore of limit 1
            assert len(mk.holders) <= mk.limit

    @invariant()
    def fences_strictly_increase(self) -> None:
        assert all(a < b for a, b in pairwise(self.issued))
        for mk in self.model.values():
            fences = [fence_of(self.tokens[r]) for r in mk.grants if r in self.tokens]
            assert len(fences) == len(mk.grants)
            assert all(a < b for a, b in pairwise(fences))


LockTableMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    suppress_health_check=[HealthCheck.too_slow],
)
TestLockTableModel = LockTableMachine.TestCase
