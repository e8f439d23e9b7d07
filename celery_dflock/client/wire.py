"""The wire protocol's names and limits, as the client needs them (docs/protocol.md).

The lock server defines the same values for itself (``dflockd_server.constants``); the client
keeps its own copy so that it needs no server code installed, and
``tests/client/test_wire.py`` checks that the two agree."""

from typing import Final

# Where a server listens, and what it grants unless asked otherwise
DEFAULT_PORT: Final = 6388
DEFAULT_MAX_LEASE_TTL_S: Final = 300
DEFAULT_READ_TIMEOUT_S: Final = 23.0

# Framing limits: longer lines, larger numbers and limits are refused by the server
MAX_LINE_BYTES: Final = 256
MAX_AUTH_LINE_BYTES: Final = 65536
MAX_NUMBER: Final = 9_000_000_000
MIN_SEMAPHORE_LIMIT: Final = 1
MAX_SEMAPHORE_LIMIT: Final = 1_048_576
MAX_NOTE_BYTES: Final = 200
PLACEHOLDER: Final = "_"
NO_NOTE: Final = "_"

# Tokens: 32 hex characters, the first 16 the big-endian fencing counter
TOKEN_HEX_CHARS: Final = 32
FENCE_HEX_CHARS: Final = 16

# Commands
CMD_ASKING: Final = "asking"
CMD_AUTH: Final = "auth"
CMD_ENQUEUE: Final = "e"
CMD_FORCE_RELEASE: Final = "fr"
CMD_HAND_DOWN: Final = "hd"
CMD_HELLO: Final = "hello"
CMD_HOLD: Final = "hl"
CMD_LOCK: Final = "l"
CMD_NOTE: Final = "note"
CMD_PING: Final = "ping"
CMD_RELEASE: Final = "r"
CMD_RENEW: Final = "n"
CMD_SEM_ENQUEUE: Final = "se"
CMD_SEM_LOCK: Final = "sl"
CMD_SEM_RELEASE: Final = "sr"
CMD_SEM_RENEW: Final = "sn"
CMD_SEM_WAIT: Final = "sw"
CMD_SHARDS: Final = "shards"
CMD_STATS: Final = "stats"
CMD_TAKE: Final = "ht"
CMD_WAIT: Final = "w"

# Arguments of the hold commands
HOLD_MODE_CONNECTION: Final = "c"
HOLD_MODE_DETACHED: Final = "d"
ON_CLOSE_RELEASE: Final = "r"

# What `hello` may list
FEATURE_DURABLE: Final = "durable"
FEATURE_FENCE: Final = "fence"
FEATURE_FORCE_RELEASE: Final = "force_release"
FEATURE_HELLO: Final = "hello"
FEATURE_HOLDS: Final = "holds"
FEATURE_KEEPALIVE: Final = "keepalive"
FEATURE_PING: Final = "ping"
FEATURE_SESSION: Final = "session"
FEATURE_STATS: Final = "stats"
HELLO_SESSION: Final = "session"

# Reply statuses (the parser matches the first four as literals)
STATUS_OK: Final = "ok"
STATUS_ACQUIRED: Final = "acquired"
STATUS_QUEUED: Final = "queued"
STATUS_TIMEOUT: Final = "timeout"
STATUS_ERROR: Final = "error"
STATUS_ERROR_ALREADY_ENQUEUED: Final = "error_already_enqueued"
STATUS_ERROR_ASK: Final = "error_ask"
STATUS_ERROR_AUTH: Final = "error_auth"
STATUS_ERROR_BOUND: Final = "error_bound"
STATUS_ERROR_DRAINING: Final = "error_draining"
STATUS_ERROR_LEASE_EXPIRED: Final = "error_lease_expired"
STATUS_ERROR_LIMIT_MISMATCH: Final = "error_limit_mismatch"
STATUS_ERROR_MAX_LOCKS: Final = "error_max_locks"
STATUS_ERROR_MAX_WAITERS: Final = "error_max_waiters"
STATUS_ERROR_MOVED: Final = "error_moved"
STATUS_ERROR_NOT_ENQUEUED: Final = "error_not_enqueued"
STATUS_ERROR_READ_ONLY: Final = "error_read_only"
STATUS_ERROR_UNAVAILABLE: Final = "error_unavailable"

# A server's `shards` answer: its mode and its hash
MODE_CLUSTER: Final = "cluster"
HASH_FNV1A32: Final = "fnv1a32"
