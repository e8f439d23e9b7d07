"""A seeded, deterministic simulator of lock servers and their clients (issue 70).

Everything a run does comes from one ``random.Random(seed)``: the workload, the network's
delays, every fault. Time is virtual (``loop.Loop``: a discrete-event scheduler), so hours of
simulated faults take seconds, and a run replays exactly from its seed. The server's code is the
real one (``dflockd_server.table.LockTable``, ``dispatch.Session``, the fence counter), and so
are the clients' decisions (``celery_dflock.client._core.LockCore``, ``_session.ClientSession``);
only their I/O is replaced: sockets by ``network.Link``, the event loop and its clocks by
``loop.Loop``. A cluster's seeds (``cluster``) run members whose ``ClusterNode``, ``Member``,
``Handover``, decisions, ask tickets and fence counters are the real ones, driven by steps, over
a model of etcd (``etcd``), with clients routed by the real ``ClusterRouter``/``KeyRoute``
(``clusterclient``). Every run is judged by tests/faults/history.py and by the run's
invariants. ``python -m tests.sim --help`` runs seeds by hand; docs/testing.md says how.
"""
