"""The etcd client's errors: what its callers catch, and how one attempt failed (the transport
decides from that whether the request may go to another endpoint)."""

from __future__ import annotations


class EtcdError(Exception):
    """An etcd request failed (the message names the etcd URL and the operation)."""


class EtcdAuthError(EtcdError):
    """etcd refused this client's user or password, or needs one (retrying will not help)."""


class StatusError(EtcdError):
    def __init__(self, text: str, status: int, detail: str) -> None:
        super().__init__(text)
        self.status = status
        self.detail = detail


class DuplicateMember(EtcdError):
    """Another live process is registered in the cluster under this member's address."""


class NotSent(Exception):
    """An attempt failed before its request left (another endpoint may take it)."""


class NoAnswer(Exception):
    """An attempt's request was sent, and no answer came (etcd may apply it, even later)."""
