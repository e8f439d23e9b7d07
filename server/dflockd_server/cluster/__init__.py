"""A lock cluster whose membership can change: the fixed-shard map, its etcd store and the
member inside a server (ARCHITECTURE.md's server table says what each module owns)."""
