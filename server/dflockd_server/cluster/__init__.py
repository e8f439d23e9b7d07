"""A lock cluster whose membership can change: the shard map and its etcd store.

``shardmap`` (pure map), ``etcd/`` (a small etcd v3 client), ``membership`` (a member under
an etcd lease, the leader's upkeep), ``mapwrite`` (conditioned map writes), ``decide`` (pure
verdicts) and ``snapshot`` (the server's ``Ownership``), ``node`` (the member inside a server),
``handover`` (the moves it writes), ``ops`` (the operator's commands).
"""
