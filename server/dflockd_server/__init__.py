"""A dflockd-compatible lock server."""
