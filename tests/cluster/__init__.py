"""Tests of the lock cluster (issue 16): the shard map, the etcd client."""
