"""The server's protocol and default-setting constants."""

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

DEFAULT_HOST: Final = "0.0.0.0"
DEFAULT_PORT: Final = 6388
DEFAULT_LEASE_TTL_S: Final = 33
DEFAULT_MAX_LEASE_TTL_S: Final = 300  # the longest lease allowed: it bounds the restart grace
DEFAULT_CLUSTER_LEASE_TTL_S: Final = 5  # a member's etcd lease: a dead one is noticed in about this
DEFAULT_LEASE_SWEEP_INTERVAL_S: Final = 1.0
DEFAULT_GC_INTERVAL_S: Final = 5.0
DEFAULT_GC_MAX_IDLE_S: Final = 60.0
DEFAULT_MAX_LOCKS: Final = 1024
DEFAULT_READ_TIMEOUT_S: Final = 23.0
DEFAULT_AUTO_RELEASE_ON_DISCONNECT: Final = True
DEFAULT_MAX_CONNECTIONS: Final = 4096
"""Hundreds of workers fit many times over; a flood stops here, not at the open-file limit."""
FD_HEADROOM: Final = 64  # fds beyond `max_connections`: listeners, event loop, state files, metrics
DEFAULT_MAX_CONNECTIONS_PER_IP: Final = 0
DEFAULT_MAX_WAITERS: Final = 0
LOCKS_PER_IP_AUTO_SHARE: Final = (3, 4)
"""``--max-locks-per-ip auto``: the share of ``--max-locks`` one client address may take."""
NO_CAP: Final = 1 << 62  # a cap no count reaches: no cap, where a comparison is cheaper than a test
DEFAULT_MAX_LOCKS_PER_CONNECTION: Final = 64
DEFAULT_MAX_WAITS_PER_CONNECTION: Final = 64
DEFAULT_WRITE_TIMEOUT_S: Final = 5.0
DEFAULT_SHUTDOWN_TIMEOUT_S: Final = 30.0
DEFAULT_TLS_HANDSHAKE_TIMEOUT_S: Final = 10.0
DEFAULT_MAX_TLS_HANDSHAKES: Final = 512
DEFAULT_TLS_RELOAD_INTERVAL_S: Final = 10.0
DEFAULT_LOG_LEVEL: Final = "info"
DEFAULT_EVENT_LOOP: Final = "auto"
JOURNAL_FSYNC_MODES: Final = ("always", "everysec", "no")
DEFAULT_JOURNAL_FSYNC: Final = "everysec"

MAX_LINE_BYTES: Final = 256  # longest request line (before its newline) the server accepts
MAX_AUTH_LINE_BYTES: Final = 65536  # longest argument line of an `auth` request
MAX_NUMBER: Final = 9_000_000_000  # numbers (seconds, limits) above this are refused as malformed
MIN_SECONDS: Final = 0.001  # the shortest timeout or interval a setting takes (a millisecond)
QUICK_NUMBERS: Final = 1001  # 0 to 1,000 are read from a table built at import, not digit by digit
MAX_SEMAPHORE_LIMIT: Final = 1_048_576
MIN_SEMAPHORE_LIMIT: Final = 1
PLACEHOLDER: Final = "_"  # sent in place of an unused key or argument (`auth`, `stats`, `ping`)

TOKEN_HEX_CHARS: Final = 32
FENCE_HEX_CHARS: Final = 16  # a token's first 16 hex characters are its fencing counter
FENCE_MAX: Final = (1 << 64) - 1

CMD_LOCK: Final = "l"
CMD_RENEW: Final = "n"
CMD_RELEASE: Final = "r"
CMD_ENQUEUE: Final = "e"
CMD_WAIT: Final = "w"
CMD_SEM_LOCK: Final = "sl"
CMD_SEM_ENQUEUE: Final = "se"
CMD_SEM_WAIT: Final = "sw"
CMD_SEM_RENEW: Final = "sn"
CMD_SEM_RELEASE: Final = "sr"
CMD_AUTH: Final = "auth"
CMD_STATS: Final = "stats"
CMD_PING: Final = "ping"
CMD_HELLO: Final = "hello"
CMD_SHARDS: Final = "shards"
CMD_HOLD: Final = "hl"  # an acquire with an owner note, bound to the connection or detached
CMD_NOTE: Final = "note"
CMD_TAKE: Final = "ht"  # take over: bind a detached lock grant to this connection
CMD_HAND_DOWN: Final = "hd"  # hand down: detach a lock grant from its connection
CMD_ASKING: Final = "asking"
CMD_FORCE_RELEASE: Final = "fr"  # force release: every grant on the key freed, whoever holds it
HOLD_MODE_CONNECTION: Final = "c"
HOLD_MODE_DETACHED: Final = "d"
MAX_NOTE_BYTES: Final = 200  # longest owner note: printable ASCII bytes, `!`..`~`
ON_CLOSE_RELEASE: Final = "r"  # `ht`'s `<onclose>` to release at the close (N: detach for N s)
NO_NOTE: Final = "_"  # the note a `timeout` reply to `hl` names when the holder gave none

SERVER_NAME: Final = "dflockd-server"  # the `server` field of the `hello` reply
SERVER_VERSION: Final = "0.2.0"  # `celery-dflock` of the same version depends on exactly this one
# Features ``hello`` lists (docs/protocol.md).
FEATURE_FENCE: Final = "fence"
FEATURE_PING: Final = "ping"
FEATURE_STATS: Final = "stats"
FEATURE_HELLO: Final = "hello"
FEATURE_SEMAPHORE: Final = "semaphore"
FEATURE_TWO_PHASE: Final = "two_phase"
FEATURE_LIMIT_MISMATCH: Final = "limit_mismatch"
"""An acquire with another limit on a busy key (a lock's is 1) gets ``error_limit_mismatch``."""
FEATURE_SHARDS: Final = "shards"
FEATURE_DURABLE: Final = "durable"
FEATURE_HOLDS: Final = "holds"
FEATURE_ASK: Final = "ask"
FEATURE_FORCE_RELEASE: Final = "force_release"
FEATURE_READ_ONLY: Final = "read_only"  # listed with `durable`
FEATURE_SESSION: Final = "session"  # listed unless `--session-ttl` is 0
HELLO_SESSION: Final = "session"  # the argument of `hello` that opts the connection in to sessions
FEATURE_KEEPALIVE: Final = "keepalive"  # client sessions; listed with `session`
SESSION_ID_CHARS: Final = frozenset(
    "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-_"
)
"""A client session id's characters (a bearer credential, as a token is)."""
SESSION_ID_MIN: Final = 16
SESSION_ID_MAX: Final = 64
DEFAULT_SESSION_TTL_S: Final = 3
FEATURES: Final = (
    FEATURE_FENCE, FEATURE_PING, FEATURE_STATS, FEATURE_HELLO, FEATURE_SEMAPHORE, FEATURE_TWO_PHASE,
    FEATURE_LIMIT_MISMATCH, FEATURE_SHARDS, FEATURE_HOLDS, FEATURE_ASK, FEATURE_FORCE_RELEASE,
)  # fmt: skip
"""What ``hello`` lists, in this order (beyond every dflockd's ``l``, ``n``, ``r``)."""

STATUS_OK: Final = "ok"
STATUS_ACQUIRED: Final = "acquired"
STATUS_QUEUED: Final = "queued"
STATUS_TIMEOUT: Final = "timeout"
STATUS_ERROR: Final = "error"
STATUS_ERROR_AUTH: Final = "error_auth"
STATUS_ERROR_MAX_LOCKS: Final = "error_max_locks"
STATUS_ERROR_MAX_WAITERS: Final = "error_max_waiters"
STATUS_ERROR_LIMIT_MISMATCH: Final = "error_limit_mismatch"
STATUS_ERROR_NOT_ENQUEUED: Final = "error_not_enqueued"
STATUS_ERROR_ALREADY_ENQUEUED: Final = "error_already_enqueued"
STATUS_ERROR_LEASE_EXPIRED: Final = "error_lease_expired"
STATUS_ERROR_DRAINING: Final = "error_draining"
STATUS_ERROR_MOVED: Final = "error_moved"
STATUS_ERROR_BOUND: Final = "error_bound"
STATUS_ERROR_ASK: Final = "error_ask"
STATUS_ERROR_UNAVAILABLE: Final = "error_unavailable"
STATUS_ERROR_READ_ONLY: Final = "error_read_only"

MODE_SINGLE: Final = "single"  # serves every key
MODE_STATIC: Final = "static"  # serves the keys crc32 over `--members` gives to `--advertise`
MODE_CLUSTER: Final = "cluster"  # serves the keys whose shard (in etcd's shard map) is its own now
STRATEGY_CRC32: Final = "crc32"  # a static server's strategy: `zlib.crc32(key) % len(members)`
HASH_FNV1A32: Final = "fnv1a32"  # a cluster server's key hash: FNV-1a 32 of the UTF-8 key
CLUSTER_SCHEME: Final = "etcd"
CLUSTER_TLS_SCHEME: Final = "etcds"
DEFAULT_CLUSTER_PREFIX: Final = "/dflockd"
CLUSTER_COMMAND_HELP: Final[Mapping[str, tuple[str, str]]] = MappingProxyType({
    "rebalance": ("[--dry-run] [--verbose]", "even out the shards over the live members"),
    "pin": ("SHARD [NODE]", "never move SHARD automatically (optionally onto NODE)"),
    "unpin": ("SHARD", "let SHARD be moved automatically again"),
    "shards": ("", "summarise the shard map"),
})  # fmt: skip
"""``dflockd COMMAND --cluster URL ...`` (``cluster.ops``): each one's arguments and meaning."""

STATS_DUTY_FACTOR: Final = 9.0
"""The next ``stats`` snapshot waits this many times what the last took: a stats flood takes
at most a tenth of the server's time (``snapshots``)."""
STATS_ANSWERS_PER_TURN: Final = 4
AUTH_FAILURE_DELAY_S: Final = 0.5  # the pause before a wrong secret's `error_auth` (slows guessing)
WRITE_BUFFER_HIGH_WATER: Final = 64 * 1024
"""Unsent bytes past which a connection's reading pauses and its write timeout starts."""
WRITE_BUFFER_LOW_WATER: Final = 16 * 1024
SOCKET_BUFFER_BYTES: Final = 16 * 1024
"""``SO_SNDBUF`` and ``SO_RCVBUF`` of every connection (Linux doubles it): autotuned ones let a
connection that never reads pin much kernel memory before ``WRITE_BUFFER_HIGH_WATER``."""
MAX_PIPELINE_BUFFER: Final = 64 * 1024
"""Pipelined request bytes buffered behind a blocking one before reading pauses."""
MAX_REQUESTS_PER_PASS: Final = 128  # requests answered per connection before the loop serves others
JOURNAL_LONE_TURNS: Final = 16
"""Group writes in a row that each held back only one connection's replies, after which it
writes the journal itself (``stream.GroupWrite``)."""
JOURNAL_DIRECT_WRITES: Final = 512
"""A connection's own journal writes, after which its replies wait for the group write again."""
FRAGMENT_READ_DELAY_S: Final = 0.05
"""After a second read in a row that completed no request, a connection is not read for this
long, doubled at each further one up to ``FRAGMENT_READ_DELAY_MAX_S``, jittered, and reset by a
completed request: a dripping sender is read in batches."""
FRAGMENT_READ_DELAY_MAX_S: Final = 1.0
BACKLOG: Final = 1024
STOP_SETTLE_S: Final = 1.0  # how long `stop()` waits for closed connections' transports to say so
STOP_SETTLE_POLL_S: Final = 0.001
DRAIN_POLL_S: Final = 0.01
METRICS_LATENCY_BUCKETS_S: Final = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
"""Upper bounds of the request-duration histogram (a waiting acquire counts its wait)."""
METRICS_SCRAPE_TIMEOUT_S: Final = 5.0
METRICS_MAX_HTTP_CONNECTIONS: Final = 16
"""Most connections the metrics port serves at once; it closes others at once, so clients that
never finish a request cannot take the lock server's open files (or threads)."""
METRICS_HTTP_TIMEOUT_S: Final = 10.0  # a metrics-port connection silent this long is closed
FENCE_PERSIST_BLOCK: Final = 1 << 20  # the ceiling stored is this many grants ahead of the counter

DOCS_URL: Final = "https://github.com/celery-dflock/celery-dflock/blob/main/docs"
PROTOCOL_DOCS_URL: Final = f"{DOCS_URL}/protocol.md"
FLAGS_DOCS_URL: Final = f"{DOCS_URL}/reference/server-flags.md"
