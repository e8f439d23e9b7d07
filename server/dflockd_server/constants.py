"""Protocol and default-setting constants, defined once for the server and the client."""

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

# ---------------------------------------------------------------- default settings
DEFAULT_HOST: Final = "0.0.0.0"
DEFAULT_PORT: Final = 6388
DEFAULT_LEASE_TTL_S: Final = 33
DEFAULT_MAX_LEASE_TTL_S: Final = 300
"""Longest lease a request may ask for: it bounds the restart grace (``grace``)."""
DEFAULT_CLUSTER_LEASE_TTL_S: Final = 5
"""A cluster member's etcd lease: a dead member is noticed within about this."""
DEFAULT_LEASE_SWEEP_INTERVAL_S: Final = 1.0
DEFAULT_GC_INTERVAL_S: Final = 5.0
DEFAULT_GC_MAX_IDLE_S: Final = 60.0
DEFAULT_MAX_LOCKS: Final = 1024
DEFAULT_READ_TIMEOUT_S: Final = 23.0
DEFAULT_AUTO_RELEASE_ON_DISCONNECT: Final = True
DEFAULT_MAX_CONNECTIONS: Final = 4096
"""A fleet of hundreds of Celery worker processes (a connection or two each, one per lock
held) fits many times over; a connection flood stops here, not at the open-file limit."""
FD_HEADROOM: Final = 64
"""Open files kept beyond ``max_connections`` (listeners, event loop, state files, metrics)."""
DEFAULT_MAX_CONNECTIONS_PER_IP: Final = 0
DEFAULT_MAX_WAITERS: Final = 0
LOCKS_PER_IP_AUTO_SHARE: Final = (3, 4)
"""``--max-locks-per-ip auto``: the share of ``--max-locks`` (768 of 1024) that one client
address's connections together may hold or wait on; a quarter stays for other addresses."""
NO_CAP: Final = 1 << 62
"""A cap no count reaches (a cap of 0, "none", where a comparison is cheaper than a test)."""
DEFAULT_MAX_LOCKS_PER_CONNECTION: Final = 64
"""Locks and semaphore slots one connection may hold (with its queued waits) at once."""
DEFAULT_MAX_WAITS_PER_CONNECTION: Final = 64
"""Queued acquires plus pending two-phase enqueues of one connection."""
DEFAULT_WRITE_TIMEOUT_S: Final = 5.0
DEFAULT_SHUTDOWN_TIMEOUT_S: Final = 30.0
DEFAULT_TLS_HANDSHAKE_TIMEOUT_S: Final = 10.0
DEFAULT_MAX_TLS_HANDSHAKES: Final = 512
DEFAULT_LOG_LEVEL: Final = "info"
DEFAULT_EVENT_LOOP: Final = "auto"
JOURNAL_FSYNC_MODES: Final = ("always", "everysec", "no")
"""``--journal-fsync``: fsync before each reply, once a second, or when the OS decides."""
DEFAULT_JOURNAL_FSYNC: Final = "everysec"

# ---------------------------------------------------------------- framing limits
MAX_LINE_BYTES: Final = 256
"""Longest request line (before its newline) the server accepts."""
MAX_AUTH_LINE_BYTES: Final = 65536
"""Longest argument line of an ``auth`` request."""
MAX_NUMBER: Final = 9_000_000_000
"""Numbers (seconds, limits) above this are refused as malformed."""
QUICK_NUMBERS: Final = 1001
"""0 to 1,000 (leases up to the default ``--max-lease-ttl``, the usual timeouts) are read from
a table built at import (about 100 KB), not digit by digit."""
MAX_SEMAPHORE_LIMIT: Final = 1_048_576
MIN_SEMAPHORE_LIMIT: Final = 1
PLACEHOLDER: Final = "_"
"""Sent in place of an unused key or argument (``auth``, ``stats``, ``ping``)."""

# ---------------------------------------------------------------- tokens / fences
TOKEN_HEX_CHARS: Final = 32
FENCE_HEX_CHARS: Final = 16
"""The first 16 hex characters of a token are the big-endian fencing counter."""
FENCE_MAX: Final = (1 << 64) - 1

# ---------------------------------------------------------------- commands
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
"""Which keys this server serves: ``ok <one-line JSON>`` (``ownership``)."""
CMD_HOLD: Final = "hl"
"""``hl <key> <timeout> <lease> <mode> <note>``: acquire a lock with an owner note, bound to the
connection (``c``) or detached (``d``: freed only by ``r`` or its lease)."""
CMD_NOTE: Final = "note"
"""``note <key> <token> <note>``: replace the owner note of a held grant."""
CMD_TAKE: Final = "ht"
"""``ht <key> <token> <lease> <onclose> <note>`` (take over): bind a detached lock grant to this
connection, with a new lease and note; ``<onclose>``: what its close does."""
CMD_HAND_DOWN: Final = "hd"
"""``hd <key> <token> <lease>`` (hand down): detach a grant of a lock from its connection."""
CMD_ASKING: Final = "asking"
"""``asking _ _``: the next acquire follows an ``error_ask`` (cluster mode: the member importing
the key's shard serves it; docs/protocol.md, *Key-level moves*)."""
CMD_FORCE_RELEASE: Final = "fr"
"""``fr <key> <note>`` (an operator's force release): free every grant on ``key``, whoever
holds it, and grant the next waiters; ``<note>`` (an owner note, or ``_``) says who asks, for
the log. Answered ``ok <grants freed>`` (0: nothing held it)."""
COMMANDS: Final[frozenset[str]] = frozenset(
    {
        CMD_LOCK,
        CMD_RENEW,
        CMD_RELEASE,
        CMD_ENQUEUE,
        CMD_WAIT,
        CMD_SEM_LOCK,
        CMD_SEM_ENQUEUE,
        CMD_SEM_WAIT,
        CMD_SEM_RENEW,
        CMD_SEM_RELEASE,
        CMD_AUTH,
        CMD_STATS,
        CMD_PING,
        CMD_HELLO,
        CMD_SHARDS,
        CMD_HOLD,
        CMD_NOTE,
        CMD_TAKE,
        CMD_HAND_DOWN,
        CMD_ASKING,
        CMD_FORCE_RELEASE,
    }
)
HOLD_MODE_CONNECTION: Final = "c"
"""``hl`` mode: the grant is released when its connection closes, as ``l``'s."""
HOLD_MODE_DETACHED: Final = "d"
"""``hl`` mode: the grant survives its connection (freed by ``r`` or lease expiry only)."""
MAX_NOTE_BYTES: Final = 200
"""Longest owner note (``hl``, ``note``): 1..200 printable ASCII bytes, ``!``..``~``."""
ON_CLOSE_RELEASE: Final = "r"
"""``ht``'s ``<onclose>``: release the grant when the connection closes (as ``l``'s); an
integer N >= 1 instead detaches it, with a lease of N seconds from the close."""
NO_NOTE: Final = "_"
"""The note a ``timeout`` reply to ``hl`` names when the holder gave none."""

# ---------------------------------------------------------------- hello
SERVER_NAME: Final = "dflockd-server"
"""The ``server`` field of the ``hello`` reply."""
SERVER_VERSION: Final = "0.2.0"
"""``dflockd_server.__version__`` and ``hello``'s ``version``; ``celery-dflock`` of the same
version depends on exactly this one."""
FEATURE_FENCE: Final = "fence"
"""Tokens are fencing tokens (their first 16 hex characters: a strictly increasing counter)."""
FEATURE_PING: Final = "ping"
FEATURE_STATS: Final = "stats"
FEATURE_HELLO: Final = "hello"
FEATURE_SEMAPHORE: Final = "semaphore"
"""``sl`` / ``se`` / ``sw`` / ``sn`` / ``sr``."""
FEATURE_TWO_PHASE: Final = "two_phase"
"""``e`` / ``w`` (and ``se`` / ``sw`` with ``semaphore``)."""
FEATURE_LIMIT_MISMATCH: Final = "limit_mismatch"
"""A key is one resource (a lock: a semaphore of limit 1): an acquire with another limit on a
busy key (``l`` / ``e`` included) gets ``error_limit_mismatch``."""
FEATURE_SHARDS: Final = "shards"
"""``shards``; an acquire of a key not served here gets ``error_moved`` or ``error_unavailable``."""
FEATURE_DURABLE: Final = "durable"
"""Leases survive a restart (the lease journal): a holder reconnects and renews by token."""
FEATURE_HOLDS: Final = "holds"
"""``hl``, ``note``, ``ht`` and ``hd``; ``stats`` lists each lock's ``owner`` note and whether
it is ``detached``."""
FEATURE_ASK: Final = "ask"
"""Key-level moves: ``error_ask <HOST:PORT>`` to an acquire, and ``asking``."""
FEATURE_FORCE_RELEASE: Final = "force_release"
"""``fr``: an operator frees a key whoever holds it (``celery dflock release``)."""
FEATURE_READ_ONLY: Final = "read_only"
"""Listed with ``durable``: while the lease journal cannot be written, acquires, ``ht``, ``hd``
and ``note`` get ``error_read_only``; held locks stay held."""
FEATURE_SESSION: Final = "session"
"""``hello _ session``: a close by the peer (EOF, reset) ends the connection's grants
``session_ttl_s`` (in the ``hello`` reply) later, not at once, unless renewed by token on
another connection meanwhile. Listed unless ``--session-ttl`` is 0."""
HELLO_SESSION: Final = "session"
"""The argument of ``hello`` that opts the connection in to sessions."""
FEATURE_KEEPALIVE: Final = "keepalive"
"""Client sessions (docs/protocol.md): ``hello _ session <id> <ttl>`` joins the connection to
session ``<id>`` (made if new), whose grants outlive the close of its connections; ``ping _
session <id>`` keeps it and its grants alive ``<ttl>`` more seconds (each grant for its lease);
one not kept alive for ``<ttl>`` ends with its grants. Listed with ``session``."""
SESSION_ID_CHARS: Final = frozenset(
    "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-_"
)
"""A client session id's characters (picked at random: a bearer credential, as a token is)."""
SESSION_ID_MIN: Final = 16
SESSION_ID_MAX: Final = 64
"""A client session's id has this many characters at least and at most."""
DEFAULT_SESSION_TTL_S: Final = 3
"""``--session-ttl``: a killed holder's key is free this long (plus up to one lease sweep)
after the kernel closed its session connection."""
FEATURES: Final = (
    FEATURE_FENCE,
    FEATURE_PING,
    FEATURE_STATS,
    FEATURE_HELLO,
    FEATURE_SEMAPHORE,
    FEATURE_TWO_PHASE,
    FEATURE_LIMIT_MISMATCH,
    FEATURE_SHARDS,
    FEATURE_HOLDS,
    FEATURE_ASK,
    FEATURE_FORCE_RELEASE,
)
"""What ``hello`` lists, in this order: the support beyond every dflockd's ``l``, ``n``, ``r``."""

# ---------------------------------------------------------------- reply statuses
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
"""``error_moved <HOST:PORT>``: that member serves the key, not this server."""
STATUS_ERROR_BOUND: Final = "error_bound"
"""``error_bound <holder-note>`` to ``ht``: the grant is bound to a live connection (``_``: no
note)."""
STATUS_ERROR_ASK: Final = "error_ask"
"""Cluster mode: ask that member once, ``asking`` before the acquire (the shard moves key by
key; the client's map stays)."""
STATUS_ERROR_UNAVAILABLE: Final = "error_unavailable"
"""Nobody serves the key at this moment (cluster mode, transient): try again shortly."""
STATUS_ERROR_READ_ONLY: Final = "error_read_only"
"""The lease journal cannot be written now (a full or failing disk): nothing new is granted,
locks held stay held, granting resumes by itself; try again shortly."""

# ---------------------------------------------------------------- ownership (shards)
MODE_SINGLE: Final = "single"
"""Serves every key (no ``--members``, no ``--cluster``)."""
MODE_STATIC: Final = "static"
"""Serves the keys the crc32 strategy over ``--members`` gives to ``--advertise``."""
MODE_CLUSTER: Final = "cluster"
"""Serves the keys whose shard (in etcd's fixed shard map) is currently its own."""
STRATEGY_CRC32: Final = "crc32"
"""The ``strategy`` of a static server's ``shards``: ``zlib.crc32(key) % len(members)``."""
HASH_FNV1A32: Final = "fnv1a32"
"""The ``hash`` of a cluster server's ``shards``: FNV-1a 32 of the UTF-8 key."""
CLUSTER_SCHEME: Final = "etcd"
CLUSTER_TLS_SCHEME: Final = "etcds"
"""``etcds://...``: the cluster's etcd is reached over TLS (``--cluster-ca-file``...)."""
DEFAULT_CLUSTER_PREFIX: Final = "/dflockd"
CLUSTER_COMMAND_HELP: Final[Mapping[str, tuple[str, str]]] = MappingProxyType(
    {
        "rebalance": ("[--dry-run] [--verbose]", "even out the shards over the live members"),
        "pin": ("SHARD [NODE]", "never move SHARD automatically (optionally onto NODE)"),
        "unpin": ("SHARD", "let SHARD be moved automatically again"),
        "shards": ("", "summarise the shard map"),
    }
)
"""``dflockd COMMAND --cluster URL ...``, the operator's commands (``cluster.ops``; ``dflockd
--help`` lists them): each one's arguments and what it does."""
CLUSTER_COMMANDS: Final = frozenset(CLUSTER_COMMAND_HELP)

# ---------------------------------------------------------------- server internals
STATS_DUTY_FACTOR: Final = 9.0
"""The next ``stats`` snapshot waits this many times what the last took to make and deliver:
a stats flood takes at most a tenth of the server's time (``snapshots``)."""
STATS_ANSWERS_PER_TURN: Final = 4
"""Waiting ``stats`` answered per turn of the loop (other connections are served between)."""
AUTH_FAILURE_DELAY_S: Final = 0.5
"""Pause before answering a wrong secret with ``error_auth`` (slows down guessing)."""
WRITE_BUFFER_HIGH_WATER: Final = 64 * 1024
"""Unsent reply bytes (beyond the kernel's, ``SOCKET_BUFFER_BYTES``) past which a connection
counts as not reading: reading it pauses and the write timeout starts, whatever it waits for."""
WRITE_BUFFER_LOW_WATER: Final = 16 * 1024
SOCKET_BUFFER_BYTES: Final = 16 * 1024
"""``SO_SNDBUF`` and ``SO_RCVBUF`` of every connection (set on the listeners, inherited;
Linux doubles it, so 32 KiB each way: many small lines). Autotuned, 2,000 connections that
sent ``stats`` and a waiting acquire and never read pinned 1.09 GB of kernel memory, and their
replies never reached ``WRITE_BUFFER_HIGH_WATER`` to start the write timeout."""
MAX_PIPELINE_BUFFER: Final = 64 * 1024
"""Pipelined request bytes buffered behind a blocking one (or a later pass) before reading
pauses."""
MAX_REQUESTS_PER_PASS: Final = 128
"""Requests answered for one connection before the loop turns to the others (a ``stats``, whose
cost grows with the table, ends the pass itself): one pipelining thousands holds up no other."""
JOURNAL_LONE_TURNS: Final = 16
"""Group writes in a row that each held back only one connection's replies, after which it
writes the journal itself before its replies (``stream.GroupWrite``; not with ``always``)."""
JOURNAL_DIRECT_WRITES: Final = 512
"""A connection's own journal writes, after which its replies wait for the group write again
(to see whether connections share the loop's turns now)."""
FRAGMENT_READ_DELAY_S: Final = 0.05
"""After a second read in a row that completed no request, a connection is not read for this
long, doubled at each further such read up to ``FRAGMENT_READ_DELAY_MAX_S`` (never above a
quarter of the read timeout), jittered 0.5-1.5 times, and reset by a completed request: a
dripping sender is read in batches, not once per byte, and delays no other connection."""
FRAGMENT_READ_DELAY_MAX_S: Final = 1.0
BACKLOG: Final = 1024
"""The listening sockets' accept queue."""
STOP_SETTLE_S: Final = 1.0
"""How long ``stop()`` waits for closed connections' transports to report closed (a client
that does not read its last reply holds its own up)."""
STOP_SETTLE_POLL_S: Final = 0.001
DRAIN_POLL_S: Final = 0.01
"""How often a draining server looks whether its last lock is released."""
METRICS_LATENCY_BUCKETS_S: Final = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
"""Upper bounds of the request-duration histogram (a waiting acquire counts its wait)."""
METRICS_SCRAPE_TIMEOUT_S: Final = 5.0
"""How long a scrape waits for the event loop to take its snapshot."""
FENCE_PERSIST_BLOCK: Final = 1 << 20
"""The fence state file records a ceiling this many grants ahead of the counter."""

DOCS_URL: Final = "https://github.com/celery-dflock/celery-dflock/blob/main/docs"
"""The repository's ``docs/`` folder."""
PROTOCOL_DOCS_URL: Final = f"{DOCS_URL}/protocol.md"
"""Named by ``dflockd --help``."""
FLAGS_DOCS_URL: Final = f"{DOCS_URL}/reference/server-flags.md"
"""The generated reference of every server flag and environment variable (``--help``)."""
