"""`Client` and `AsyncClient`: the one public entry to the lock servers, and what integrations
use with them (the Celery layer uses nothing else of the client layer)."""

from __future__ import annotations

from celery_dflock.client._async.client import AsyncClient
from celery_dflock.client._servers import Hold, ServerInfo
from celery_dflock.client._settings import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_RENEW_RATIO,
    DEFAULT_SERVERS,
    DEFAULT_SESSION_TTL_S,
    MIN_SESSION_TTL_S,
    ClientSettings,
    Lease,
    check_auth_token,
    check_limit,
    check_renew_ratio,
    check_servers,
    lease_seconds,
    positive_seconds,
    whole_seconds,
)
from celery_dflock.client._status import ServerShards, ServerStatus
from celery_dflock.client._sync.client import Client
from celery_dflock.client._threads import leave_signals_to_the_main_thread
from celery_dflock.client.wire import FEATURE_FENCE, FEATURE_HELLO, FEATURE_PING, FEATURE_STATS

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT_S", "DEFAULT_RENEW_RATIO", "DEFAULT_SERVERS", "DEFAULT_SESSION_TTL_S",
    "FEATURE_FENCE", "FEATURE_HELLO", "FEATURE_PING", "FEATURE_STATS", "MIN_SESSION_TTL_S",
    "AsyncClient", "Client", "ClientSettings", "Hold", "Lease", "ServerInfo", "ServerShards",
    "ServerStatus", "check_auth_token", "check_limit", "check_renew_ratio", "check_servers",
    "lease_seconds", "leave_signals_to_the_main_thread", "positive_seconds", "whole_seconds",
]  # fmt: skip
