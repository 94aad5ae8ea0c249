"""RedisStorage: pages in Redis (or Valkey) through `redis.asyncio`.

Each page is one string value `header ‖ payload` under its own key `<prefix>:<key-hex>`: no
multi-key commands and no hash tags, so the same layout works on Redis Cluster with pages
spread over all slots. Batches go out as non-transactional pipelines, a few at a time over a
bounded `BlockingConnectionPool`; on plain TCP the page values themselves travel over the
backend's own bulk connections (`_redis_bulk`), which send page segments as they are and
receive values straight into the pages. With `cluster=1` everything, page values included,
goes through redis-py's `RedisCluster`; each batch's keys are grouped by the node that owns
their slot and every pipeline goes to one node, so a lost node fails only its own keys.
docs/storage-redis.md records the measurements behind that, the pipeline sizes and the
limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import itertools
import math
import numbers
import re
import secrets
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from operator import itemgetter
from typing import Any, NamedTuple, TypeGuard, TypeVar, cast
from urllib.parse import SplitResult, unquote, urlencode, urlunsplit

import anyio
import anyio.lowlevel
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.connection import Connection
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import (
    AskError,
    AuthenticationError,
    ClusterDownError,
    MovedError,
    NoPermissionError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError

from .._errors import StorageConfigError, StorageError, type_name
from .._numbers import as_float
from .._ratelog import LogLimiter
from .._uncancelled import finish_uncancelled
from ._base import (
    BackendBase,
    _State,
    byte_segments,
    check_batch,
    check_key,
    check_keys,
    check_put,
    corrupt_reason,
    log,
    parse_bool,
    parse_int,
    parse_number,
    parse_port,
    parse_query,
    parse_size,
    payload_nbytes,
    split_url,
)
from ._maintenance import GcReport, PageInfo, VerifyReport
from ._manifest import ManifestLimits
from ._manifest_redis import (
    NO_WRITES,
    REDIS_FAULTS,
    SCRIPT_RETRY_S,
    ReadScripts,
    RedisClient,
    RedisManifest,
    flags_refused,
    keys_refused,
    named_in_script,
    no_room,
    run_read_only,
    scripting_refused,
    transactions_refused,
)
from ._page import (
    HEADER_NBYTES,
    PageCheck,
    PageHeader,
    PayloadVerifier,
    check_header,
    created_recency,
    decode_header,
    encode_header,
    read_value_into,
    verify_payload,
)
from ._protocol import Outcome, PageBuffer, PageMeta, StorageCapabilities
from ._redis_bulk import BulkConnection, BulkConnectionPool, ReplyError
from ._redis_cluster import GuardedCluster, closed_by_server

__all__ = ["RedisStorage"]

_MiB = 1 << 20
#: Bytes per pipeline, measured on loopback (docs/storage-redis.md): with 4 MiB values SET is
#: fastest one value per round trip on two connections (~0.9 GB/s; one 64-value pipeline
#: gives ~0.2 GB/s), GET with two values (~8 MiB) per pipeline (~0.7 GB/s). Small pages
#: reach the same rates with 1-4 MiB per pipeline; much more than that slows both down.
_PUT_PIPELINE_BYTES = 4 * _MiB
_GET_PIPELINE_BYTES = 8 * _MiB
#: Pipelines on bulk connections. GET replies land in the pages as they arrive, and small
#: pipelines keep both connections busy (768 KiB pages: ~2.6 GB/s at 2 MiB, ~2.2 at 8 MiB);
#: SETs hash each page while the server reads the one before, which long pipelines let run
#: back to back (~1.9 GB/s at 16 MiB, ~1.8 at 4 MiB).
_BULK_GET_PIPELINE_BYTES = 2 * _MiB
_BULK_PUT_PIPELINE_BYTES = 16 * _MiB
#: The longest `ttl`, in seconds (10 years). Redis 7 refuses an `EX` whose expiry in
#: milliseconds overflows 64 bits (`invalid expire time`), at every SET; older servers
#: overflowed silently and dropped the key at once. Far below either, and longer than any page
#: is worth keeping.
_MAX_TTL_S = 10 * 365 * 24 * 3600
#: Connections one batch uses at once.
_CONCURRENCY = 2
#: `exists` as one server-side loop over the keys: one round trip instead of a pipeline of
#: EXISTS, whose per-command client overhead (~30 us each in redis-py) made 64 keys cost ~2 ms
#: against ~0.3 ms here. TOUCH answers as EXISTS does and counts as a use for the server's
#: LRU/LFU eviction (EXISTS does not): a prefix that new chains are looked up against stays.
#: Where TOUCH is refused (an ACL listing commands, a proxy) the key is asked with EXISTS.
#: Flagged as one that does not write (TOUCH is a read) so that Redis 7 answers it through a
#: `CLIENT PAUSE WRITE`, as it does GET; a server before 7.0 gets it without the flag.
_PREFIX_SCRIPT = (
    NO_WRITES + "for i, key in ipairs(KEYS) do "
    "local found = redis.pcall('TOUCH', key) "
    "if type(found) == 'table' then found = redis.call('EXISTS', key) end "
    "if found == 0 then return i - 1 end "
    "end return #KEYS"
)
_KEYS_PER_SCRIPT = 1024
_HEX_DIGITS = b"0123456789abcdef"
# Removes a page verify() found damaged only if it still holds that value (same length, same
# leading bytes): a page stored again meanwhile is sound and stays.
_REMOVE_IF_SAME_SCRIPT = (
    "if redis.call('STRLEN', KEYS[1]) == tonumber(ARGV[1]) and "
    "redis.call('GETRANGE', KEYS[1], 0, #ARGV[2] - 1) == ARGV[2] then "
    "return redis.call('DEL', KEYS[1]) end return 0"
)
# write_raw where the server refuses MULTI: the length it replaces, and the SET (with EX
# ARGV[2] unless empty), in one step.
_WRITE_RAW_SCRIPT = (
    "local n = redis.call('STRLEN', KEYS[1]) "
    "if ARGV[2] == '' then redis.call('SET', KEYS[1], ARGV[1]) "
    "else redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2]) end return n"
)
#: Below this many bytes per pipeline, checksums (and copies) stay on the loop, which they hold
#: for at most ~0.25 ms: a thread hand-off (~0.1 ms each way) at every pipeline cost more
#: throughput than that (768 KiB pages, put 1.7 -> 1.9 GB/s, get 2.2 -> 2.5).
_INLINE_MAX_BYTES = 4 * _MiB
#: On bulk connections, pages up to this size are hashed one at a time on the loop just before
#: each is sent (~0.1 ms each at most), which hides the hash behind the server's reading;
#: bigger ones on a worker thread that runs ahead of the sends.
_HASH_AT_SEND_MAX = 2 * _MiB
#: An error reply to a key's SET or GET is logged at most once per this many seconds per
#: kind (its first word), and so many kinds at most are told apart.
_REPLY_ERROR_INTERVAL_S = 60.0
_REPLY_ERROR_KINDS = 32
#: Small commands (EXISTS, DEL, SCAN results) per pipeline.
_KEYS_PER_PIPELINE = 256
#: Keys of DELs whose replies never came that are kept for a later look (see
#: `_settle_deletes`); beyond this, the oldest stay counted as stored.
_MAX_UNSETTLED = 16 * _KEYS_PER_PIPELINE
_MAX_COMMANDS_PER_PIPELINE = 512
#: `verify` reads payloads in pieces of this size, at most so many bytes per pipeline: what it
#: holds does not depend on what is stored.
_VERIFY_PIECE_BYTES = _MiB
_VERIFY_PIPELINE_BYTES = 8 * _MiB
#: Connections per cluster node beyond the `max_connections` commands and pipelines that run
#: at once: a manifest compaction without scripting holds one through its WATCH.
_CLUSTER_SPARE_CONNECTIONS = 2

_SCHEMES = ("redis", "rediss")
_URL_PARAMS = {
    "ttl": "seconds a page lives after it is written (default: no expiry)",
    "prefix": "key prefix (default hicache)",
    "max_connections": "connection pool bound (default 16)",
    "timeout": "seconds per socket operation and pool wait (default 5)",
    "concurrency": "connections one batch uses (default 2)",
    "put_pipeline_bytes": "bytes per SET pipeline (default 16MiB, 4MiB with bulk=0)",
    "get_pipeline_bytes": "bytes per GET pipeline (default 2MiB, 8MiB with bulk=0)",
    "max_batch_pages": "advertised batch size (default 512)",
    "capacity": "bytes under the prefix that gc() trims to (default: none)",
    "gc_wait": "seconds a gc() waits for another's lease before it gives up (default: 300; "
    "none: no bound)",
    "multikey": "0: no multi-key calls (Redis Cluster, proxies); default 1 (0 with cluster=1)",
    "cluster": "1: Redis Cluster, the URL's host:port a seed node, database 0; default 0",
    "bulk": "0: page values through redis-py too; default 1 (own plain-TCP connections)",
    # Passed through to redis-py.
    "ssl_cert_reqs": "rediss: none | optional | required",
    "ssl_ca_certs": "rediss: CA bundle path",
    "ssl_certfile": "rediss: client certificate path",
    "ssl_keyfile": "rediss: client key path",
    "ssl_check_hostname": "rediss: true | false",
    "client_name": "CLIENT SETNAME value",
}
_PASSTHROUGH = (
    "ssl_cert_reqs",
    "ssl_ca_certs",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_check_hostname",
    "client_name",
)


_CERT_REQS = ("none", "optional", "required")
# Where a listing or verify records that it has just read (so touched) every page.
_TOUCHED_NAME = "maintenance-read-at"
_PREFIX_REFUSED = "*?[]\\"
# gc's lease under the prefix: one pass at a time. Each pass's listing reads every header,
# which Redis counts as a use, so two at once rank the pages differently, and each, sizing
# its victims from the whole total, evicts its own: far below the capacity together.
_GC_LEASE_NAME = "gc-lease"
#: How long a lease outlives its holder's last renewal: a gc killed mid-pass holds the next
#: one back at most this long. Renewed every third of it while the pass runs.
_GC_LEASE_S = 30.0
#: How often a gc waiting for another's lease asks for it again.
_GC_LEASE_POLL_S = 0.5
#: How long a gc waits for another's lease by default (`gc_wait`): past a pass killed
#: mid-way (`_GC_LEASE_S`), but not for the whole of a long live pass, which brings the
#: store within its capacity itself. Unbounded, scheduled gc runs slower than their period
#: piled up, each waiting for the last and then listing every page again.
_GC_WAIT_DEFAULT_S = 300.0
# Renew (ARGV[2] ms) or release the lease only while it still holds this pass's token.
_RENEW_LEASE_SCRIPT = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then "
    "return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end return 0"
)
_RELEASE_LEASE_SCRIPT = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
)


def _refused_in_prefix(c: str) -> bool:
    return not c.isprintable() or c.isspace() or c in _PREFIX_REFUSED or c in "{}"


_Method = TypeVar("_Method", bound=Callable[..., Awaitable[Any]])
_C = TypeVar("_C")


def _counted(method: _Method) -> _Method:
    """Counts the call as in flight, so that `close()` releases the connections only after it:
    a connection released under a running call would be reconnected by redis-py's retry and
    returned, open, to the closed pool."""

    @functools.wraps(method)
    async def counted(self: RedisStorage, /, *args: Any, **kwargs: Any) -> Any:
        self._in_flight += 1
        try:
            return await method(self, *args, **kwargs)
        finally:
            self._in_flight -= 1
            if not self._in_flight and self._idle is not None:
                self._idle.set()

    # The method's own type, exactly: type checkers then see each protocol method as the
    # `async def` it is (a coroutine function's type, which pyright tells from a Coroutine's),
    # so that RedisStorage is a StorageBackend to them.
    return cast(_Method, counted)


def _check_passthrough(params: dict[str, str], *, tls: bool) -> None:
    """Refuse what redis-py would drop silently (blank values) or fail on only later, at open
    or at every batch (TLS settings without TLS, an unknown ssl_cert_reqs)."""
    for name in _PASSTHROUGH:
        if name not in params:
            continue
        value = params[name]
        if not value:
            raise StorageConfigError(f"redis URL parameter {name} has no value")
        if name == "client_name" and not all("!" <= c <= "~" for c in value):
            # The server refuses such a name at every connection: the store would open but
            # fail every call.
            raise StorageConfigError(
                f"redis URL parameter client_name must be printable ASCII without spaces: {value!r}"
            )
        if name.startswith("ssl_") and not tls:
            raise StorageConfigError(f"redis URL parameter {name} needs a rediss:// URL")
    if params.get("ssl_cert_reqs", "required") not in _CERT_REQS:
        raise StorageConfigError(
            f"redis URL parameter ssl_cert_reqs={params['ssl_cert_reqs']!r}; accepted: "
            + ", ".join(_CERT_REQS)
        )
    if "ssl_check_hostname" in params:
        # Spelled the way redis-py reads it, whichever spelling parse_bool accepted.
        checked = parse_bool(params["ssl_check_hostname"], field="ssl_check_hostname")
        params["ssl_check_hostname"] = "true" if checked else "false"


#: What a bulk GET yields per key before the payload checksums are checked: the header of a
#: payload now in its page, None (absent), (verdict, reason, stored length) for a value its
#: header rejects, or the key's error reply.
_Received = PageHeader | tuple[PageCheck, str, int] | ReplyError | None


def _retry() -> Retry:
    """redis-py's retry of a command: twice, soon, and only after a lost or refused
    connection. Not after a timeout: `timeout` is the bound the user set on a command, and
    retrying would make a silent server take several times that to fail (a serving
    request's miss arrives that much later)."""
    return Retry(
        ExponentialBackoff(cap=0.2, base=0.02), retries=2, supported_errors=(RedisConnectionError,)
    )


#: Error replies by which a cluster node says it does not serve the key's slot now: the
#: node is down for that call, not refusing one key.
_NOT_SERVED = (ClusterDownError, TryAgainError, MovedError, AskError)


def _refused(error: Exception) -> bool:
    """Whether `error`, in place of a command's reply, is the server refusing that command
    (it ran the others of the pipeline), not a failure of the connection or of the node."""
    return isinstance(error, (ResponseError, ReplyError)) and not isinstance(error, _NOT_SERVED)


class _DeletesFailed(StorageError):
    """A delete pipeline with `failed` DELs that got an error instead of a reply; `removed`
    of the others removed their key. `answered`: every such error is the server's error
    reply (it ran the pipeline), not a connection lost or timed out under it."""

    def __init__(self, message: str, *, failed: int, removed: int, answered: bool) -> None:
        super().__init__(message)
        self.failed = failed
        self.removed = removed
        self.answered = answered


class _Stream(NamedTuple):
    """A page `verify` reads the payload of: its key, stored length, the header as read, and
    the verifier its payload's pieces go to."""

    rkey: bytes
    length: int
    head: bytes
    verifier: PayloadVerifier


class _Listed(NamedTuple):
    """One page as a listing found it (see `list_pages`)."""

    rkey: bytes
    nbytes: int
    num_tokens: int
    priority: int
    last_access: float


_READ_REFUSALS = re.compile(
    r"no permissions to run the '(strlen|getrange|exists)' command"
    r"|unknown command|unsupported command|not supported"
)


def _read_refused(error: BaseException) -> bool:
    """Whether an error reply to STRLEN, GETRANGE or EXISTS means the command is refused
    here for good (an ACL that lists commands, a proxy), not a fault of one key."""
    return bool(_READ_REFUSALS.search(_reply_text(error).lower()))


_IDLE_REFUSALS = re.compile(
    r"no permissions to run the 'object(\|idletime)?' command|unknown (sub)?command"
    r"|unsupported command|not supported"
)


def _idle_refused(error: BaseException) -> bool:
    """Whether an error reply to OBJECT IDLETIME means it is refused here (an ACL, a renamed
    command, a proxy), not that the policy keeps no idle time (LFU)."""
    return bool(_IDLE_REFUSALS.search(_reply_text(error).lower()))


def _touched_of(reply: object) -> int | None:
    """Seconds since a pass last read every page under the prefix, from the `OBJECT
    IDLETIME` reply for its mark: on the server's own idle clock, so comparable with the
    pages' idle times read with it; None if unknown (never marked, an LFU policy, refused)."""
    return reply if _is_int(reply) else None


#: Pages `gc` sorts in one piece: a sort holds the GIL throughout, this many for about 2 ms.
_GC_SLICE = 8192


def _gc_victims(
    entries: Sequence[tuple[float, int, bytes]],
    total: int,
    capacity: int,
    *,
    slice_len: int = _GC_SLICE,
) -> list[bytes]:
    """The keys `gc` evicts, least recently used first, until the rest (of `total` bytes
    in all) fit `capacity`: among equal last accesses the last one listed goes first.

    `entries` are (last access, bytes, key) in listing order. Run on a worker thread, in
    slices: one sort of every page would hold the GIL, so the loop, throughout; the slices
    are merged by a generator, between whose steps the loop gets the GIL back.
    """
    # Slices taken from the end and reversed, each sorted stably by last access: the merge
    # (which takes ties from earlier slices first) then yields ties latest listed first.
    ends = range(len(entries), 0, -slice_len)
    runs = [sorted(entries[max(end - slice_len, 0) : end][::-1], key=itemgetter(0)) for end in ends]
    victims: list[bytes] = []
    for _, nbytes, rkey in heapq.merge(*runs, key=itemgetter(0)):
        if total <= capacity:
            break
        victims.append(rkey)
        total -= nbytes
    return victims


def _nbytes_from_start(head: bytes) -> int | None:
    """A value's length told by its first `HEADER_NBYTES` bytes: itself if shorter, else
    the page size its header gives; None if the header does not decode."""
    if len(head) < HEADER_NBYTES:
        return len(head)
    header = decode_header(head)
    return None if isinstance(header, PageCheck) else header.page_nbytes


def _last_access(page: PageInfo) -> float:
    return page.last_access


def _reply_text(error: object) -> str:
    """The server's error reply as it was sent: redis-py drops the code of the ones it knows
    (ERR, NOPERM, READONLY, ...) from its exception's text and keeps it apart."""
    code = getattr(error, "status_code", None)
    text = str(error)
    return f"{code} {text}" if isinstance(code, str) and code else text


async def _close_clients(client: RedisClient | None, pool: BlockingConnectionPool | None) -> None:
    if client is not None:
        await client.aclose()
    if pool is not None:
        await pool.aclose()


def _settle(future: asyncio.Future[bytes], value: bytes, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(value)
    else:
        future.set_exception(error)
        future.exception()  # whoever awaits it gets the error; nobody has to


_MIN_TIMEOUT_S = 0.001


def _check_host_and_fragment(parts: SplitResult) -> None:
    if not parts.hostname or parts.fragment:
        # redis-py would take `redis:///0` for localhost, and drop a fragment unsaid.
        raise StorageConfigError(
            f"a {parts.scheme}:// URL needs a host, and takes no fragment: "
            f"{parts.scheme}://[user:password@]host[:port][/db][?params]"
        )
    # Otherwise found only at the first connection, as a bare codec error (a host or password
    # given as bytes that are not UTF-8, which Python reads from argv as lone surrogates).
    # Judged as redis-py connects to it: %-escapes decoded, those of no UTF-8 as U+FFFD.
    try:
        unquote(parts.hostname).encode("idna")
    except UnicodeError:
        raise StorageConfigError(
            f"the host of a {parts.scheme}:// URL must be a host name or an IP address, got "
            f"{parts.hostname!r}"
        ) from None
    for what, text in (("user", parts.username), ("password", parts.password)):
        try:
            (text or "").encode()
        except UnicodeError:
            # Never quoted: it may be (part of) the password.
            raise StorageConfigError(
                f"the {what} of a {parts.scheme}:// URL must be text UTF-8 can encode"
            ) from None


# The largest database index SELECT takes (a server's `databases` may allow fewer; that is
# refused at open).
_MAX_DB = (1 << 31) - 1
# Replies to the connection's own SELECT or AUTH that no later call can get past.
_REFUSED_AT_CONNECT = (
    "DB index",  # SELECT past the server's `databases`
    "value is not an integer or out of range",  # SELECT of an index it cannot parse
    "without any password configured",  # AUTH to a server that has no password
)


def _int_param(params: Mapping[str, str], name: str) -> int | None:
    raw = params.get(name)
    if raw is None:
        return None
    return parse_int(raw, field=f"redis URL parameter {name}", minimum=1)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_arguments(
    *,
    url: object,
    prefix: object,
    ttl: object,
    timeout: object,
    gc_wait: object,
    counts: Mapping[str, object],
    sizes: Mapping[str, object],
    flags: Mapping[str, object],
    connection_kwargs: object,
) -> None:
    """Refuse arguments of the wrong type or range before anything uses them: a float or
    bool `ttl`, say, would be accepted here and refused by the server at every SET."""
    if not isinstance(url, str):
        raise StorageConfigError(f"redis url must be a str, got {type_name(url)}")
    if not isinstance(prefix, str):
        raise StorageConfigError(f"redis prefix must be a str, got {type_name(prefix)}")
    if ttl is not None and not (_is_int(ttl) and 1 <= ttl <= _MAX_TTL_S):
        raise StorageConfigError(
            f"redis ttl must be an integer from 1 to {_MAX_TTL_S} seconds (10 years) or None, "
            f"got {ttl!r}"
        )
    for field, value in counts.items():
        if not (_is_int(value) and value >= 1):
            raise StorageConfigError(f"redis {field} must be an integer >= 1, got {value!r}")
    for field, value in sizes.items():
        if value is not None and not (_is_int(value) and value >= 1):
            raise StorageConfigError(
                f"redis {field} must be an integer >= 1 (bytes) or None, got {value!r}"
            )
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, numbers.Real)
        or not _MIN_TIMEOUT_S <= as_float(timeout) < math.inf
    ):
        # Less than a millisecond is no timeout a round trip can meet: every call would fail.
        raise StorageConfigError(
            f"redis timeout must be a finite number of seconds >= {_MIN_TIMEOUT_S}, got {timeout!r}"
        )
    if gc_wait is not None and (
        isinstance(gc_wait, bool)
        or not isinstance(gc_wait, numbers.Real)
        or not 0 <= as_float(gc_wait) < math.inf
    ):
        raise StorageConfigError(
            f"redis gc_wait must be a finite number of seconds >= 0 or None, got {gc_wait!r}"
        )
    for field, value in flags.items():
        if not (isinstance(value, bool) or (field == "multikey" and value is None)):
            accepted = "True, False or None" if field == "multikey" else "True or False"
            raise StorageConfigError(f"redis {field} must be {accepted}, got {value!r}")
    if connection_kwargs is not None and not isinstance(connection_kwargs, Mapping):
        raise StorageConfigError(
            f"redis connection_kwargs must be a mapping or None, got {type_name(connection_kwargs)}"
        )


def _chunks(sizes: Sequence[int], max_bytes: int) -> list[range]:
    """Consecutive index ranges of at most `max_bytes` of payload (at least one page) each;
    headers are left out so that, say, two 4 MiB pages make one 8 MiB pipeline."""
    chunks: list[range] = []
    start = 0
    total = 0
    for i, size in enumerate(sizes):
        if i > start and (total + size > max_bytes or i - start >= _MAX_COMMANDS_PER_PIPELINE):
            chunks.append(range(start, i))
            start, total = i, 0
        total += size
    if start < len(sizes):
        chunks.append(range(start, len(sizes)))
    return chunks


class _Chunk(NamedTuple):
    """The keys of one pipeline: indexes into the batch, all of one node group."""

    group: int  # which of the batch's node groups (0 off a cluster)
    indexes: Sequence[int]


def _cut(groups: Sequence[Sequence[int]], sizes: Sequence[int], max_bytes: int) -> list[_Chunk]:
    """Each group's indexes cut as `_chunks` cuts them, the groups' chunks taken in turn:
    the batch's connections then work on different nodes at once."""
    cut = [
        [_Chunk(g, group[r.start : r.stop]) for r in _chunks([sizes[i] for i in group], max_bytes)]
        for g, group in enumerate(groups)
    ]
    return [chunk for row in itertools.zip_longest(*cut) for chunk in row if chunk is not None]


class RedisStorage(BackendBase):
    """Pages in Redis: `SET NX` per page, pipelined over a bounded connection pool.

    Build it with `RedisStorage.from_url("redis://host:6379/0?ttl=3600&prefix=hicache")` or
    with keyword arguments (the URL then carries only what redis-py understands). With
    `mac_key` every page written carries a keyed MAC and every page read must. With
    `cluster=True` the URL names a seed node of a Redis Cluster and every command goes
    through redis-py's cluster client (`multikey` then defaults to False).
    """

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        mac_key: bytes | None = None,
        prefix: str = "hicache",
        ttl: int | None = None,
        max_connections: int = 16,
        timeout: float = 5.0,
        concurrency: int = _CONCURRENCY,
        put_pipeline_bytes: int | None = None,
        get_pipeline_bytes: int | None = None,
        max_batch_pages: int = 512,
        capacity_bytes: int | None = None,
        multikey: bool | None = None,
        bulk: bool = True,
        cluster: bool = False,
        connection_kwargs: Mapping[str, Any] | None = None,
        gc_wait: float | None = _GC_WAIT_DEFAULT_S,
    ) -> None:
        """`gc_wait`: seconds a `gc()` waits for another pass's lease under the prefix
        before it gives up and reports `skipped` (None: for as long as that pass runs)."""
        _check_arguments(
            url=url,
            prefix=prefix,
            ttl=ttl,
            timeout=timeout,
            gc_wait=gc_wait,
            counts={
                "max_connections": max_connections,
                "concurrency": concurrency,
                "max_batch_pages": max_batch_pages,
            },
            sizes={
                "put_pipeline_bytes": put_pipeline_bytes,
                "get_pipeline_bytes": get_pipeline_bytes,
                "capacity_bytes": capacity_bytes,
            },
            flags={"multikey": multikey, "bulk": bulk, "cluster": cluster},
            connection_kwargs=connection_kwargs,
        )
        parts = split_url(url, scheme="redis")
        if parts.scheme not in _SCHEMES:
            raise StorageConfigError(
                f"redis URL must start with redis:// or rediss://, got {parts.scheme!r}"
            )
        _check_host_and_fragment(parts)
        port = parse_port(parts, scheme=parts.scheme) or 6379
        db = parts.path.lstrip("/") or "0"
        # Past 2**31 - 1 Redis refuses SELECT with a reply that reads like any other error.
        parse_int(
            db,
            field="redis URL database",
            maximum=_MAX_DB,
            detail=" (the path: /0, /1, ... or none for 0)",
        )
        # Only what redis-py reads may ride in this URL: redis-py would take anything else for
        # a connection argument and fail at the first connection.
        params = parse_query(parts.query, _URL_PARAMS, scheme=parts.scheme)
        ours = [name for name in params if name not in _PASSTHROUGH]
        if ours:
            raise StorageConfigError(
                f"redis URL parameters {', '.join(ours)} are read by RedisStorage.from_url; "
                f"pass them to RedisStorage() as arguments"
            )
        _check_passthrough(params, tls=parts.scheme == "rediss")
        if cluster and db != "0":
            raise StorageConfigError(
                f"redis URL database /{db} with cluster=1: Redis Cluster has only database 0"
            )
        if cluster and multikey:
            raise StorageConfigError(
                "redis multikey=1 with cluster=1: page keys lie in different cluster slots, "
                "so no multi-key call can cover them; leave multikey out (0)"
            )
        query = urlencode([(k, params[k]) for k in _PASSTHROUGH if k in params])
        url = urlunsplit((parts.scheme, parts.netloc, parts.path, query, ""))
        # Backslash escapes in SCAN patterns: such a prefix would match other keys than its own.
        # Braces would make a cluster hash tag of it (every page in one slot); page names are
        # cut after the prefix by length, which only ASCII keeps the same in bytes.
        if not prefix or not prefix.isascii() or any(_refused_in_prefix(c) for c in prefix):
            raise StorageConfigError(
                f"redis prefix must be non-empty printable ASCII, without spaces, glob "
                f"characters ({_PREFIX_REFUSED}) or braces: {prefix!r}"
            )
        # Job threads check and copy values off the loop, one per connection a batch uses.
        super().__init__(
            mac_key=mac_key,
            job_threads=min(concurrency, max_connections),
            thread_name="hicache-redis",
        )
        host = parts.hostname or "localhost"
        self._name = f"{parts.scheme}://{host}:{port}/{db}?prefix={prefix}" + (
            "&cluster=1" if cluster else ""
        )
        self._url = url
        self._prefix = prefix
        self._ttl = ttl
        self._timeout = float(timeout)
        self._max_connections = max_connections
        self._concurrency = min(concurrency, max_connections)
        self._put_pipeline_bytes = put_pipeline_bytes
        self._get_pipeline_bytes = get_pipeline_bytes
        self._max_batch_pages = max_batch_pages
        self._capacity = capacity_bytes
        self._gc_wait = None if gc_wait is None else float(gc_wait)
        self._connection_kwargs = dict(connection_kwargs or {})
        self._cluster = cluster
        self._multikey = not cluster if multikey is None else multikey
        # What the store and its manifests learned about their read-only scripts.
        self._scripts = ReadScripts(self._name)
        # When exists, its script refused, tries it again (None: never, or in use).
        self._script_retry_at: float | None = None
        self._bounded_reads = True  # False once STRLEN or GETRANGE is refused (_read_starts)
        self._touch = True  # False once TOUCH is refused (see _exists_by_pipeline)
        # When exists, TOUCH refused, asks with it again (None: in use): as the script, on
        # the same clock.
        self._touch_retry_at: float | None = None
        self._strlen = True  # False once STRLEN is refused (see _delete_rkeys)
        self._idle_refusal_told = False  # see _judged
        # The bulk connections talk to one server: a cluster's values go through its client.
        self._bulk_wanted = bulk and not cluster
        self._in_flight = 0
        self._moved_noted = False
        # Per kind of error reply: when it was last logged, and how many were not since.
        self._reply_errors: dict[str, tuple[float, int]] = {}
        # A server gone down fails every batch: each kind of failure is logged at once, a
        # repeated one once a minute.
        self._batch_faults = LogLimiter()
        self._idle: asyncio.Event | None = None
        # SET's trailing arguments, packed once: `NX` and, with a TTL, `EX <seconds>`.
        ex = [] if ttl is None else [b"EX", str(ttl).encode()]
        self._set_argc = 4 + len(ex)
        self._set_tail = b"\r\n$2\r\nNX\r\n" + b"".join(
            b"$%d\r\n%s\r\n" % (len(arg), arg) for arg in ex
        )
        self._pool: BlockingConnectionPool | None = None
        self._client: RedisClient | None = None
        self._prefix_script: AsyncScript | None = None
        self._remove_if_same: AsyncScript | None = None
        self._write_raw_script: AsyncScript | None = None
        self._multi: bool | None = None  # whether MULTI is taken (None: not asked yet)
        self._bulk: BulkConnectionPool | None = None
        # What this instance added minus what it removed (stats() does no I/O).
        self._pages = 0
        self._bytes = 0
        # Keys a DEL was sent for without a reply: whether it ran is looked at later.
        self._unsettled: dict[bytes, None] = {}

    @classmethod
    def from_url(cls, url: str, *, mac_key: bytes | None = None) -> RedisStorage:
        """Build from `redis[s]://[user:password@]host[:port][/db][?params]`.

        Parameters: `ttl` (seconds), `prefix`, `max_connections`, `timeout` (seconds),
        `concurrency`, `put_pipeline_bytes`, `get_pipeline_bytes`, `max_batch_pages`,
        `capacity` (a byte size such as 10GiB), `gc_wait` (seconds, default 300; `none`: no
        bound), `multikey` (0: no multi-key calls), `bulk` (0: page values through redis-py),
        `cluster` (1: Redis Cluster, seeded by the URL's host:port, database 0), for TLS
        `ssl_cert_reqs`, `ssl_ca_certs`, `ssl_certfile`, `ssl_keyfile`, `ssl_check_hostname`,
        and `client_name`. Anything else raises `StorageConfigError` listing what is accepted.
        """
        parts = split_url(url, scheme="redis")
        if parts.scheme not in _SCHEMES:
            raise StorageConfigError(
                f"redis URL must start with redis:// or rediss://, got {parts.scheme!r}"
            )
        _check_host_and_fragment(parts)
        params = parse_query(parts.query, _URL_PARAMS, scheme=parts.scheme)
        kwargs: dict[str, Any] = {}
        for name in (
            "ttl",
            "max_connections",
            "concurrency",
            "max_batch_pages",
        ):
            value = _int_param(params, name)
            if value is not None:
                kwargs[name] = value
        for name in ("put_pipeline_bytes", "get_pipeline_bytes"):
            if name in params:
                kwargs[name] = parse_size(params[name], field=name)
        if "capacity" in params:
            kwargs["capacity_bytes"] = parse_size(params["capacity"], field="capacity")
        if "prefix" in params:
            kwargs["prefix"] = params["prefix"]
        if "multikey" in params:
            kwargs["multikey"] = parse_bool(params["multikey"], field="multikey")
        if "bulk" in params:
            kwargs["bulk"] = parse_bool(params["bulk"], field="bulk")
        if "cluster" in params:
            kwargs["cluster"] = parse_bool(params["cluster"], field="cluster")
        if "timeout" in params:
            kwargs["timeout"] = parse_number(params["timeout"], field="redis URL parameter timeout")
        if "gc_wait" in params:
            wait = params["gc_wait"]
            kwargs["gc_wait"] = (
                None
                if wait.lower() == "none"
                else parse_number(wait, field="redis URL parameter gc_wait")
            )
        _check_passthrough(params, tls=parts.scheme == "rediss")
        query = urlencode([(k, params[k]) for k in _PASSTHROUGH if k in params])
        base = urlunsplit((parts.scheme, parts.netloc, parts.path, query, ""))
        return cls(base, mac_key=mac_key, **kwargs)

    @property
    def capabilities(self) -> StorageCapabilities:
        return StorageCapabilities(
            max_batch_pages=self._max_batch_pages, zero_copy=False, shared=True, persistent=True
        )

    @property
    def prefix(self) -> str:
        """The key prefix: pages live under `<prefix>:<key-hex>`."""
        return self._prefix

    def __repr__(self) -> str:
        return f"<RedisStorage {self._name} state={self._state.value}>"

    def manifest(self, limits: ManifestLimits | None = None) -> RedisManifest:
        """The warmup manifest, in Redis beside the pages (`<prefix>:manifest:{<ns>}`).

        Its keys of one namespace share a hash tag, so its scripts and transactions are
        legal on Redis Cluster even with `multikey=0`; where scripting is refused it falls
        back to plain commands and transactions, where MULTI is refused to scripts (where
        both are, its writes raise `StorageError`). It follows the page TTL, if one is set.
        """
        return RedisManifest(
            self._redis,
            prefix=self._prefix,
            name=self._name,
            ttl=self._ttl,
            limits=limits,
            scripts=self._scripts,
            # One made in a forked child of the process that opened the store is that
            # process's, as the store is: the child is refused both.
            owner_pid=None if self._state is _State.NEW else self._pid,
        )

    # Lifecycle.

    async def _open(self) -> None:
        # Few quick retries: a lost server must turn into ERROR outcomes soon, not after a
        # long backoff; every socket operation and pool wait is bounded by `timeout`.
        if self._cluster:
            await self._open_cluster()
            return
        self._pool = BlockingConnectionPool.from_url(
            self._url,
            max_connections=self._max_connections,
            timeout=self._timeout,
            socket_timeout=self._timeout,
            socket_connect_timeout=self._timeout,
            retry=_retry(),
            **self._connection_kwargs,
        )
        self._client = Redis(connection_pool=self._pool)
        settings = self._pool.connection_kwargs
        # Plain TCP only: TLS and Unix sockets keep every command on redis-py.
        if self._bulk_wanted and self._pool.connection_class is Connection:
            self._bulk = BulkConnectionPool(
                str(settings.get("host", "localhost")),
                int(settings.get("port", 6379)),
                db=int(settings.get("db", 0) or 0),
                username=settings.get("username"),
                password=settings.get("password"),
                client_name=settings.get("client_name"),
                limit=self._max_connections,
                timeout=self._timeout,
            )
        self._prefix_script = self._client.register_script(_PREFIX_SCRIPT)
        self._remove_if_same = self._client.register_script(_REMOVE_IF_SAME_SCRIPT)
        if await self._check_reachable(self._client) and self._bulk is not None:
            await self._check_bulk_setup(self._bulk)

    async def _check_bulk_setup(self, bulk: BulkConnectionPool) -> None:
        """Open one bulk connection, which sends its own AUTH and SELECT: redis-py lets an
        AUTH to a server without a password pass, the bulk path does not, and every batch
        would fail on it. Such a refusal raises `StorageConfigError`; anything else (the
        server went away since the ping) is for the batches to meet."""
        try:
            with anyio.fail_after(self._timeout):
                async with bulk.connection():
                    return
        except ConnectionRefusedError as exc:
            message = str(exc)
            if any(refusal in message for refusal in _REFUSED_AT_CONNECT):
                raise StorageConfigError(
                    f"{self._name}: the server refused this configuration: {message}"
                ) from None
        except (OSError, TimeoutError):
            return

    async def _check_reachable(self, client: RedisClient) -> bool:
        """Ping the server: a refusal of this configuration (credentials, database, a
        connection setting the ACL refuses) raises `StorageConfigError`, as no later call could
        succeed; an unreachable server is only logged (False), as it may come (back) later
        and until then batches are ERROR."""
        try:
            try:
                await client.ping()
            except REDIS_FAULTS as exc:
                # The cluster client wraps what a node refused (RedisClusterException).
                cause = exc.__cause__ or exc.__context__
                if isinstance(cause, (AuthenticationError, NoPermissionError)):
                    raise cause from None
                raise
        except (AuthenticationError, NoPermissionError, ResponseError) as exc:
            message = str(exc)
            if isinstance(exc, NoPermissionError) and "'ping'" in message:
                return True  # only PING is refused: the calls the store makes may be allowed
            if isinstance(exc, (AuthenticationError, NoPermissionError)) or any(
                refusal in message for refusal in _REFUSED_AT_CONNECT
            ):
                raise StorageConfigError(
                    f"{self._name}: the server refused this configuration: {message}"
                ) from None
            log.warning("storage.redis.unreachable", backend=self._name, error=message)
        except (*REDIS_FAULTS, OSError) as exc:
            log.warning("storage.redis.unreachable", backend=self._name, error=str(exc))
        else:
            return True
        return False

    async def _open_cluster(self) -> None:
        # redis-py's cluster client keeps a pool per node and learns the slot map from the
        # seed at the first command. It follows MOVED and ASK, and retries TRYAGAIN,
        # CLUSTERDOWN and lost nodes at most twice here (relearning the slot map, after a
        # 0.25 s pause for a pipeline or on CLUSTERDOWN), so a fault becomes an error soon.
        # At most `max_connections` commands and pipelines run at once (see _redis_cluster).
        client = GuardedCluster.from_url(
            self._url,
            turns=self._max_connections,
            max_connections=self._max_connections + _CLUSTER_SPARE_CONNECTIONS,
            socket_timeout=self._timeout,
            socket_connect_timeout=self._timeout,
            retry=_retry(),
            **self._connection_kwargs,
        )
        self._client = client
        self._prefix_script = client.register_script(_PREFIX_SCRIPT)
        self._remove_if_same = client.register_script(_REMOVE_IF_SAME_SCRIPT)
        await self._check_reachable(client)

    async def _release(self) -> None:
        # Calls in flight finish first (each socket operation is bounded by `timeout`, and a
        # batch takes no new chunk once closed); even a cancelled close releases after that.
        interrupted: asyncio.CancelledError | None = None
        if self._in_flight:
            self._idle = asyncio.Event()
            interrupted = await finish_uncancelled(self._idle.wait())
        client, pool, bulk = self._client, self._pool, self._bulk
        self._client = self._pool = self._bulk = None
        if bulk is not None:
            bulk.close()
        # To their end however the caller is cancelled: a cancelled aclose() (a cache never
        # left, its loop ending) left the connections open.
        cancelled = await finish_uncancelled(_close_clients(client, pool))
        interrupted = interrupted or cancelled
        if interrupted is not None:
            raise interrupted

    def _occupancy(self) -> tuple[int, int, int | None]:
        return max(self._pages, 0), max(self._bytes, 0), self._capacity

    # The protocol.

    @_counted
    async def exists(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, exist consecutively.

        One script call per 1024 keys (`multikey=1`, the default), or one EXISTS per key in
        a pipeline (`multikey=0`, for Redis Cluster and proxies that refuse multi-key calls).
        """
        client = self._redis()
        check_keys(keys)
        if not keys:
            # Nothing to ask: a retry of the script here would run none of it and take its
            # refusal for over (see below). A turn all the same: an async call always yields.
            await anyio.lowlevel.checkpoint()
            return 0
        retry_at = self._script_retry_at
        retrying = retry_at is not None and self._scripts.clock() >= retry_at
        if retrying:
            # The refusal may be over (rights restored): one call tries the script again,
            # once a minute, EVAL_RO first.
            self._script_retry_at = self._scripts.clock() + SCRIPT_RETRY_S
            self._scripts.read_only = True
        if (self._multikey or retrying) and self._prefix_script is not None:
            try:
                if self._bulk is not None:
                    count = await self._exists_on_bulk(self._bulk, keys)
                else:
                    count = await self._exists_by_script(keys)
            except ResponseError as exc:
                if keys_refused(exc):
                    # EVAL asks for write access to its keys, so a user that may only read
                    # them (`%R~` in its ACL) is refused the script but not TOUCH, where
                    # EVAL_RO is refused too. A user refused the keys themselves fails here
                    # too, and keeps the script.
                    count = await self._exists_by_pipeline(client, keys)
                    self._no_scripting(exc)
                    return count
                if not scripting_refused(exc):  # BUSY, LOADING, ...: this call fails
                    self._counters.errors += 1
                    named = named_in_script(exc, self._prefix_script.script)
                    raise StorageError(f"{self._name}: exists failed: {named}") from exc
                # Scripting refused here (disabled, a proxy): one EXISTS per key from now on.
                self._no_scripting(exc)
            else:
                if retrying and not self._multikey:
                    self._multikey = True
                    self._script_retry_at = None
                    log.info("storage.redis.scripting_restored", backend=self._name)
                return count
        return await self._exists_by_pipeline(client, keys)

    def _no_scripting(self, error: BaseException) -> None:
        """`exists` goes without its script, and tries it again after `SCRIPT_RETRY_S`: said
        once, by the first of the calls that were refused it together, not at every retry."""
        if self._multikey:
            log.warning("storage.redis.no_scripting", backend=self._name, error=str(error))
        self._multikey = False
        self._script_retry_at = self._scripts.clock() + SCRIPT_RETRY_S

    async def _exists_by_pipeline(self, client: RedisClient, keys: Sequence[bytes]) -> int:
        """`exists` as a TOUCH (or EXISTS) per key, in pipelines."""
        count = 0
        for start in range(0, len(keys), _KEYS_PER_PIPELINE):
            batch = keys[start : start + _KEYS_PER_PIPELINE]
            touched = self._touch
            retry_at = self._touch_retry_at
            retrying = not touched and retry_at is not None and self._scripts.clock() >= retry_at
            if retrying:
                # The refusal may be over (rights restored): one batch asks with TOUCH
                # again, once a minute.
                self._touch_retry_at = self._scripts.clock() + SCRIPT_RETRY_S
            results = await self._exists_replies(client, batch, touch=touched or retrying)
            if (touched or retrying) and any(
                isinstance(r, Exception) and scripting_refused(r) for r in results
            ):
                # TOUCH refused here (an ACL listing commands, a proxy): EXISTS until the
                # retry. Calls that asked with TOUCH meanwhile ask again too, and say nothing,
                # as does a retry still refused.
                if self._touch:
                    log.warning("storage.redis.no_touch", backend=self._name)
                    self._touch_retry_at = self._scripts.clock() + SCRIPT_RETRY_S
                self._touch = False
                results = await self._exists_replies(client, batch, touch=False)
            elif retrying and not self._touch:
                if all(isinstance(r, Exception) for r in results):
                    # Not answered at all (a lost server): that says nothing of the rights,
                    # so the next call asks with TOUCH again.
                    self._touch_retry_at = retry_at
                else:
                    self._touch = True
                    self._touch_retry_at = None
                    log.info("storage.redis.touch_restored", backend=self._name)
            # Up to the first missing key: a key unanswered before it (its node lost, an
            # error reply) leaves the count unknown, and a shorter count would say that key
            # is missing, which a caller may act on (the backup's prefix check writes such
            # pages again and counts them lost). One unanswered after it changes nothing.
            for result in results:
                if isinstance(result, Exception):
                    self._counters.errors += 1
                    raise StorageError(f"{self._name}: exists failed: {result}") from result
                if not result:
                    return count
                count += 1
        return count

    async def _exists_replies(
        self, client: RedisClient, batch: Sequence[bytes], *, touch: bool
    ) -> list[object]:
        """A TOUCH (an EXISTS that counts as a use), or an EXISTS where `touch` is False, per
        key: the replies, error replies included, in a pipeline per cluster node, those
        running at once. A pipeline that fails as a whole gives its error for each of its
        keys, so one lost node leaves the other nodes' answers."""
        unasked = StorageError(f"{self._name}: closed during the call")
        replies: list[object] = [unasked] * len(batch)

        async def ask(group: Sequence[int]) -> None:
            try:
                async with client.pipeline(transaction=False) as pipe:
                    for i in group:
                        if touch:
                            pipe.touch(self._rkey(batch[i]))
                        else:
                            pipe.exists(self._rkey(batch[i]))
                    results: list[object] = list(await pipe.execute(raise_on_error=False))
            except REDIS_FAULTS as exc:
                results = [exc] * len(group)
            for i, result in zip(group, results, strict=True):
                replies[i] = result

        groups = self._by_node(batch)
        await self._run_chunks(groups, ask, concurrency=len(groups))
        return replies

    async def _exists_on_bulk(self, bulk: BulkConnectionPool, keys: Sequence[bytes]) -> int:
        """`_exists_by_script` over a bulk connection: EVAL without redis-py's command
        machinery, about half the client time per call on loopback. EVAL_RO (or EVAL) with
        the script's text, not EVALSHA, for the reason `run_read_only` gives."""
        assert self._prefix_script is not None
        text = self._prefix_script.script
        body = text.encode() if isinstance(text, str) else bytes(text)
        count = 0
        start = 0
        tried_read_only = False
        while start < len(keys):
            batch = [self._rkey(k) for k in keys[start : start + _KEYS_PER_SCRIPT]]
            read_only = self._scripts.read_only
            tried_read_only = tried_read_only or read_only
            name = b"EVAL_RO" if read_only else b"EVAL"
            command = (name, body, b"%d" % len(batch), *batch)
            try:
                reply = await bulk.exchange(
                    functools.partial(BulkConnection.call_integer, command=command)
                )
            except (*REDIS_FAULTS, OSError) as exc:
                self._counters.errors += 1
                raise StorageError(f"{self._name}: exists failed: {self._fault(exc)}") from exc
            if isinstance(reply, ReplyError):
                if read_only and scripting_refused(str(reply)):
                    self._scripts.refuse_read_only(str(reply))
                    continue  # the same keys with EVAL
                if not tried_read_only and keys_refused(str(reply)):
                    # As `run_read_only`: EVAL_RO may be allowed now where EVAL is not.
                    self._scripts.read_only = True
                    continue
                if not flags_refused(str(reply)):
                    raise ResponseError(str(reply))  # scripting refused: see exists()
                # A server without script flags: redis-py's path learns the plain script.
                return count + await self._exists_by_script(keys[start:])
            if not 0 <= reply <= len(batch):
                self._counters.errors += 1
                raise StorageError(f"{self._name}: exists got {reply} for {len(batch)} keys")
            count += reply
            if reply < len(batch):
                break
            start += len(batch)
        return count

    async def _exists_by_script(self, keys: Sequence[bytes]) -> int:
        assert self._prefix_script is not None
        count = 0
        for start in range(0, len(keys), _KEYS_PER_SCRIPT):
            batch = [self._rkey(k) for k in keys[start : start + _KEYS_PER_SCRIPT]]
            try:
                script, reply = await run_read_only(
                    self._redis(), self._prefix_script, batch, scripts=self._scripts
                )
                self._prefix_script = script
                found = int(reply)
            except ResponseError:
                raise
            except REDIS_FAULTS as exc:
                self._counters.errors += 1
                raise StorageError(f"{self._name}: exists failed: {exc}") from exc
            count += found
            if found < len(batch):
                break
        return count

    @_counted
    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        """GET each page and check it into its buffer; one outcome per key."""
        client = self._redis()
        check_batch(keys, ("buffers", into))
        check_keys(keys, namespace)
        if not keys:
            await anyio.lowlevel.checkpoint()  # nothing to ask: an async call yields all the same
            return []
        targets = [byte_segments(page, writable=True) for page in into]
        outcomes = [Outcome.ERROR] * len(keys)
        corrupt: list[bytes] = []
        corrupt_nbytes: list[int] = []  # the stored length each was read with
        # Pages judged damaged from a value read in two commands (index, length, header,
        # reason): judged for good by their removal, which takes only that value. Another
        # writer may have replaced it between the commands; then it is a miss.
        suspects: list[tuple[int, int, bytes, str]] = []
        payloads = [payload_nbytes(page) for page in targets]
        mac_key = self._mac_key

        def judge(i: int, result: PageCheck, reason: str, stored: int) -> None:
            if result is PageCheck.OK:
                outcomes[i] = Outcome.OK
            elif result is PageCheck.UNSUPPORTED:
                outcomes[i] = Outcome.MISS  # a newer writer's page: not ours to judge
            else:
                outcomes[i] = Outcome.CORRUPT
                corrupt.append(keys[i])
                corrupt_nbytes.append(stored)
                self._report_corrupt(keys[i], reason)

        # A pipeline that failed as a whole (a timeout, a lost connection) has already cost
        # the timeout, and redis-py's retries; the batch's other pipelines to the same server
        # (or cluster node) would most likely pay them again, one after another: a stalled
        # server would hold a batch for minutes. They are ERROR at once instead, and a batch
        # fails in about one timeout. On a cluster each pipeline goes to one node, and only
        # that node's are given up: the keys of the other nodes are read as usual.
        given_up: set[int] = set()

        async def fetch_values(chunk: _Chunk) -> None:
            if chunk.group in given_up:
                return  # stays ERROR
            bounded = self._bounded_reads
            try:
                found, failed = await self._read_starts(
                    client, chunk.indexes, keys=keys, payloads=payloads
                )
            except REDIS_FAULTS as exc:
                failed, found = exc, []
            bounded &= self._bounded_reads  # this chunk's values were read in two commands
            if failed is not None:
                self._batch_failed("storage.redis.get_failed", str(failed))
                given_up.add(chunk.group)
                if not found:
                    return
            checks: list[PageCheck | None] = [None] * len(found)

            def check(stop: threading.Event) -> None:
                for slot, (i, value, stored) in enumerate(found):
                    if stop.is_set():
                        return
                    if value is not None:
                        checks[slot] = read_value_into(
                            value,
                            key=keys[i],
                            namespace=namespace,
                            into=targets[i],
                            mac_key=mac_key,
                            stored_nbytes=stored,
                        )

            # Hashing and copying a few MiB takes milliseconds: a worker thread does it (while
            # the loop receives the next pipeline) unless the chunk is small. Either way it is
            # finished before this coroutine returns, even when cancelled (run_job waits).
            if sum(len(v) for _, v, _ in found if v is not None) >= _INLINE_MAX_BYTES:
                await self.run_job(check)
            else:
                check(threading.Event())
            for (i, value, stored), result in zip(found, checks, strict=True):
                if value is None:
                    outcomes[i] = Outcome.MISS
                elif result is not None:
                    reason = ""
                    if result is PageCheck.CORRUPT:
                        reason = corrupt_reason(
                            value,
                            key=keys[i],
                            namespace=namespace,
                            payload_nbytes=payloads[i],
                            stored_nbytes=stored,
                        )
                        if bounded:
                            outcomes[i] = Outcome.CORRUPT
                            suspects.append((i, stored, bytes(value[:HEADER_NBYTES]), reason))
                            continue
                    judge(i, result, reason, stored)

        async def fetch_into(bulk: BulkConnectionPool, chunk: _Chunk) -> None:
            if chunk.group in given_up:
                return  # stays ERROR
            try:
                received = await self._bulk_gets(
                    bulk,
                    chunk.indexes,
                    keys=keys,
                    targets=targets,
                    payloads=payloads,
                    namespace=namespace,
                )
            except (*REDIS_FAULTS, OSError) as exc:
                self._batch_failed("storage.redis.get_failed", self._fault(exc))
                given_up.add(chunk.group)
                return
            landed = [(i, got) for i, got in received if isinstance(got, PageHeader)]
            checks: list[PageCheck | None] = [None] * len(landed)

            def check(stop: threading.Event) -> None:
                for slot, (i, header) in enumerate(landed):
                    if stop.is_set():
                        return
                    checks[slot] = verify_payload(header, targets[i], mac_key=mac_key)

            if sum(payloads[i] for i, _ in landed) >= _INLINE_MAX_BYTES:
                await self.run_job(check)
            else:
                check(threading.Event())
            verdicts = iter(checks)
            for i, got in received:
                if got is None:
                    outcomes[i] = Outcome.MISS
                elif isinstance(got, PageHeader):
                    verdict = next(verdicts)
                    if verdict is not None:
                        judge(i, verdict, "checksum or mac", HEADER_NBYTES + payloads[i])
                elif isinstance(got, tuple):
                    judge(i, *got)
                else:  # an error reply for this key, which stays ERROR
                    self._note_reply(got)

        bulk = self._bulk
        fetch = fetch_values if bulk is None else functools.partial(fetch_into, bulk)
        pipeline = self._get_pipeline_bytes or (
            _GET_PIPELINE_BYTES if bulk is None else _BULK_GET_PIPELINE_BYTES
        )
        await self._run_chunks(_cut(self._by_node(keys), payloads, pipeline), fetch)
        for i, length, head, reason in suspects:
            try:
                removed = await self._remove_if_same_value(self._rkey(keys[i]), length, head)
            except REDIS_FAULTS as exc:
                # Damaged for all this reader knows: counted, and the next reader retries.
                self._counters.errors += 1
                log.warning("storage.redis.remove_failed", backend=self._name, error=str(exc))
                removed = True
            else:
                if removed:
                    self._pages -= 1
                    self._bytes -= length
            if removed:
                self._report_corrupt(keys[i], reason)
            else:
                outcomes[i] = Outcome.MISS  # replaced meanwhile: what is stored now may be sound
        if corrupt:
            try:
                await self._delete_rkeys([self._rkey(k) for k in corrupt], corrupt_nbytes)
            except StorageError as exc:
                # Counted either way; the next reader that meets the page retries.
                log.warning("storage.redis.remove_failed", backend=self._name, error=str(exc))
        c = self._counters
        c.gets += len(keys)
        c.get_hits += outcomes.count(Outcome.OK)
        c.errors += outcomes.count(Outcome.ERROR)
        return outcomes

    async def _read_starts(
        self,
        client: RedisClient,
        chunk: Sequence[int],
        *,
        keys: Sequence[bytes],
        payloads: Sequence[int],
    ) -> tuple[list[tuple[int, bytes | memoryview | None, int]], BaseException | None]:
        """Per key of the chunk without an error reply: (index, the value's first
        header + expected payload bytes or None when absent, the stored length); and the
        failure of a second look, which leaves only the keys it was for ERROR.

        A whole GET would hold whatever a writer stored under a page key (512 MB values
        exhaust a reader's memory before any check); STRLEN says how long the value is and
        GETRANGE reads one byte more than a page of the expected size, which is all a page
        that passes its checks holds. Error replies are noted; those keys stay ERROR.
        """
        if not self._bounded_reads:
            return await self._read_whole(client, chunk, keys=keys), None
        async with client.pipeline(transaction=False) as pipe:
            for i in chunk:
                rkey = self._rkey(keys[i])
                pipe.strlen(rkey)
                pipe.getrange(rkey, 0, HEADER_NBYTES + payloads[i])
            replies = await pipe.execute(raise_on_error=False)
        refused = next((r for r in replies if isinstance(r, Exception) and _read_refused(r)), None)
        if refused is not None:
            # An ACL listing commands without STRLEN or GETRANGE, or a proxy without them.
            self._bounded_reads = False
            log.warning(
                "storage.redis.bounded_reads_refused", backend=self._name, error=str(refused)
            )
            return await self._read_whole(client, chunk, keys=keys), None
        found: list[tuple[int, bytes | memoryview | None, int]] = []
        unsure: list[int] = []  # absent, or an empty value: the replies are the same
        for k, i in enumerate(chunk):
            stored, value = replies[2 * k], replies[2 * k + 1]
            error = next((r for r in (stored, value) if isinstance(r, Exception)), None)
            page = HEADER_NBYTES + payloads[i]
            if error is not None:
                self._note_reply(error)
            elif not isinstance(stored, int) or not isinstance(value, bytes):
                self._note_reply(f"ERR unexpected replies {stored!r:.40} {value!r:.40}")
            elif stored == 0 and not value:
                unsure.append(i)
            elif len(value) != min(stored, page + 1):
                # Replaced or deleted between the two commands (the byte past a page shows a
                # longer value): nothing consistent was read, and what is stored now may be
                # sound. A miss; the next reader looks again.
                found.append((i, None, 0))
            else:
                found.append((i, value if len(value) <= page else memoryview(value)[:page], stored))
        if unsure:
            try:
                async with client.pipeline(transaction=False) as pipe:
                    for i in unsure:
                        rkey = self._rkey(keys[i])
                        pipe.exists(rkey)
                        pipe.strlen(rkey)
                    replies = await pipe.execute(raise_on_error=False)
            except REDIS_FAULTS as exc:
                return found, exc
            if any(isinstance(r, Exception) and _read_refused(r) for r in replies):
                # EXISTS refused (an ACL that lists commands): GET tells them apart too.
                return found + await self._read_whole(client, unsure, keys=keys), None
            for k, i in enumerate(unsure):
                exists, stored = replies[2 * k], replies[2 * k + 1]
                if isinstance(exists, Exception) or isinstance(stored, Exception):
                    self._note_reply(exists if isinstance(exists, Exception) else stored)
                elif exists == 1 and stored == 0:
                    found.append((i, b"", 0))  # an empty value: no page, corrupt
                else:
                    found.append((i, None, 0))  # absent (or stored only since: a miss)
        return found, None

    async def _read_whole(
        self, client: RedisClient, chunk: Sequence[int], *, keys: Sequence[bytes]
    ) -> list[tuple[int, bytes | memoryview | None, int]]:
        """As `_read_starts`, with whole values (GET): where STRLEN or GETRANGE is refused."""
        async with client.pipeline(transaction=False) as pipe:
            for i in chunk:
                pipe.get(self._rkey(keys[i]))
            values = await pipe.execute(raise_on_error=False)
        found: list[tuple[int, bytes | memoryview | None, int]] = []
        for i, value in zip(chunk, values, strict=True):
            if isinstance(value, Exception):
                self._note_reply(value)  # an error reply for this key: it stays ERROR
            elif value is None or isinstance(value, bytes):
                found.append((i, value, 0 if value is None else len(value)))
        return found

    async def _bulk_gets(
        self,
        bulk: BulkConnectionPool,
        chunk: Sequence[int],
        *,
        keys: Sequence[bytes],
        targets: Sequence[list[memoryview]],
        payloads: Sequence[int],
        namespace: bytes,
    ) -> list[tuple[int, _Received]]:
        """GET the chunk's keys on a bulk connection, each value's payload received straight
        into its page. Per key: the header of a payload now in place (its checksum still to
        check), None (absent), (verdict, reason) for a value rejected by its header, or the
        error reply."""
        request = b"".join(
            b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(rkey), rkey)
            for rkey in (self._rkey(keys[i]) for i in chunk)
        )

        async def talk(conn: BulkConnection) -> list[tuple[int, _Received]]:
            received: list[tuple[int, _Received]] = []
            await conn.send([request])
            for i in chunk:
                length = await conn.read_bulk_length()
                if length is None or isinstance(length, ReplyError):
                    received.append((i, length))
                    continue
                head = memoryview(bytearray(min(length, HEADER_NBYTES)))
                await conn.read_into(head)
                header = decode_header(head)
                expected = payloads[i]
                verdict = check_header(
                    header,
                    key=keys[i],
                    namespace=namespace,
                    payload_nbytes=expected,
                    stored_nbytes=length,
                )
                if verdict is PageCheck.OK and isinstance(header, PageHeader):
                    for segment in targets[i]:
                        await conn.read_into(segment)
                    received.append((i, header))
                else:
                    await conn.skip(length - head.nbytes)
                    reason = corrupt_reason(
                        head, key=keys[i], namespace=namespace, payload_nbytes=expected
                    )
                    received.append((i, (verdict, reason, length)))
                await conn.skip(2)
            return received

        return await bulk.exchange(talk)  # GET is safe to repeat

    @_counted
    async def put(
        self, keys: Sequence[bytes], pages: Sequence[PageBuffer], metas: Sequence[PageMeta]
    ) -> list[Outcome]:
        """SET NX each page (`header ‖ payload`); an existing key is kept and is OK."""
        self._redis()
        check_put(keys, pages, metas)
        if not keys:
            await anyio.lowlevel.checkpoint()  # nothing to send: an async call yields all the same
            return []
        if self._unsettled:
            # Before a page that a DEL without reply removed is stored, and counted, again.
            await self._settle_deletes([self._rkey(k) for k in keys])
        sources = [byte_segments(page, writable=False) for page in pages]
        outcomes = [Outcome.ERROR] * len(keys)
        payloads = [payload_nbytes(page) for page in sources]

        mac_key = self._mac_key
        given_up: set[int] = set()  # node groups whose pipeline failed as a whole: see get()

        async def store(piece: _Chunk) -> None:
            if piece.group in given_up:
                return  # stays ERROR
            chunk = piece.indexes

            def encode(stop: threading.Event) -> list[bytes]:
                return [encode_header(metas[i], sources[i], mac_key=mac_key) for i in chunk]

            bulk = self._bulk
            try:
                if bulk is not None:

                    async def parts(k: int) -> list[bytes | memoryview]:
                        i = chunk[k]
                        if ahead is None:
                            # Hashed just before it is sent, while the server is still reading
                            # the page before; the send then copies bytes the hash has just
                            # brought into the cache.
                            header = encode_header(metas[i], sources[i], mac_key=mac_key)
                        else:
                            header = await ahead[i]
                        return self._set_parts(self._rkey(keys[i]), header, sources[i])

                    results = await self._bulk_sets(bulk, len(chunk), parts)
                else:
                    # Checksums (and MACs) of a few MiB take milliseconds: off the loop when
                    # large.
                    if sum(payloads[i] for i in chunk) >= _INLINE_MAX_BYTES:
                        headers = await self.run_job(encode)
                    else:
                        headers = encode(threading.Event())
                    items = [
                        (self._rkey(keys[i]), header, sources[i])
                        for i, header in zip(chunk, headers, strict=True)
                    ]
                    results = await self._send_sets(items)
            except (*REDIS_FAULTS, OSError) as exc:  # OSError: from the bulk connections
                self._batch_failed("storage.redis.put_failed", self._fault(exc))
                given_up.add(piece.group)
                return
            for i, result in zip(chunk, results, strict=True):
                if isinstance(result, Exception):
                    if no_room(result):  # maxmemory under noeviction: declined, not failed
                        outcomes[i] = Outcome.MISS
                    self._note_reply(result)
                    continue
                outcomes[i] = Outcome.OK
                if result:  # None: the key existed and was kept as it was
                    self._pages += 1
                    self._bytes += HEADER_NBYTES + payloads[i]

        pipeline = self._put_pipeline_bytes or (
            _PUT_PIPELINE_BYTES if self._bulk is None else _BULK_PUT_PIPELINE_BYTES
        )
        # Pages too big to hash on the loop are hashed in order on a worker thread that runs
        # ahead of the sends, so hashing one overlaps sending the ones before.
        ahead: list[asyncio.Future[bytes]] | None = None
        hashing: asyncio.Future[None] | None = None
        if self._bulk is not None and keys and max(payloads) > _HASH_AT_SEND_MAX:
            ahead, hashing = self._encode_ahead(metas, sources)
        try:
            await self._run_chunks(_cut(self._by_node(keys), payloads, pipeline), store)
        finally:
            if hashing is not None:
                hashing.cancel()  # the job stops between pages and is waited for
                await asyncio.gather(hashing, return_exceptions=True)
        c = self._counters
        c.puts += len(keys)
        c.put_ok += outcomes.count(Outcome.OK)
        c.errors += outcomes.count(Outcome.ERROR)
        return outcomes

    async def _send_sets(
        self, items: Sequence[tuple[bytes, bytes, Sequence[memoryview]]]
    ) -> list[object]:
        """`SET rkey header‖segments NX [EX ttl]` for each item, pipelined on one connection.

        The commands are packed here so that the header and the page's segments go to the
        socket as they are: redis-py's SET takes one value, which would mean joining (one
        more allocation and copy of every page). Replies: True (stored), None (the key
        existed) or the error reply of that command.
        """
        pool = self._pool
        if pool is None:
            return await self._cluster_sets(items)
        chunks = [
            part
            for rkey, header, segments in items
            for part in self._set_parts(rkey, header, segments)
        ]
        connection = await pool.get_connection()  # type: ignore[no-untyped-call]
        # The transports the pages were written to: uvloop keeps the buffers given to write()
        # until they are sent, and redis-py closes gracefully on failure or cancellation, so
        # the rest of the pipeline would be read from the caller's pages after put() returned
        # (by then they may hold other bytes). Aborting drops it; the server never runs the
        # command it got only part of.
        transports: list[asyncio.WriteTransport] = []

        def drop_unsent() -> None:
            for transport in transports:
                transport.abort()

        async def attempt() -> list[object]:
            if not connection.is_connected:
                await connection.connect()
            transports.append(connection._writer.transport)
            await connection.send_packed_command(chunks, check_health=False)
            replies: list[object] = []
            for _ in items:
                try:
                    reply = await connection.read_response()
                except ResponseError as exc:
                    replies.append(exc)
                    continue
                replies.append(True if reply in (b"OK", "OK") else None)
            return replies

        async def failed(error: BaseException) -> None:
            drop_unsent()
            await connection.disconnect()

        try:
            # A dropped connection (e.g. the server restarted) is retried like redis-py's own
            # commands; SET NX makes a repeated page harmless. On any other failure or a
            # cancellation redis-py disconnects, so a half-sent pipeline is never continued.
            retry = connection.retry
            result: list[object] = (
                await attempt() if retry is None else await retry.call_with_retry(attempt, failed)
            )
        except BaseException:
            drop_unsent()
            raise
        finally:
            await pool.release(connection)
        return result

    async def _cluster_sets(
        self, items: Sequence[tuple[bytes, bytes, Sequence[memoryview]]]
    ) -> list[object]:
        """The SETs of `_send_sets` through the cluster client, which splits the pipeline per
        node. Its SET takes one value, so each page is joined into a private copy (which also
        means nothing reads the caller's pages after a cancelled put)."""
        client = self._redis()
        async with client.pipeline(transaction=False) as pipe:
            for rkey, header, segments in items:
                pipe.set(rkey, b"".join((header, *segments)), nx=True, ex=self._ttl)
            replies = await pipe.execute(raise_on_error=False)
        return [
            reply if isinstance(reply, Exception) else (True if reply else None)
            for reply in replies
        ]

    def _encode_ahead(
        self, metas: Sequence[PageMeta], sources: Sequence[list[memoryview]]
    ) -> tuple[list[asyncio.Future[bytes]], asyncio.Future[None]]:
        """Start hashing every page's header on a worker thread, in order: a future per
        header, and the job (cancel and await it when done with the headers)."""
        loop = asyncio.get_running_loop()
        headers: list[asyncio.Future[bytes]] = [loop.create_future() for _ in metas]
        mac_key = self._mac_key

        def encode_all(stop: threading.Event) -> None:
            for meta, segments, header in zip(metas, sources, headers, strict=True):
                if stop.is_set():
                    return
                value = encode_header(meta, segments, mac_key=mac_key)
                loop.call_soon_threadsafe(_settle, header, value, None)

        def finished(job: asyncio.Future[None]) -> None:
            # However the job ended, nobody may wait for a header forever. (Runs after every
            # header the job produced: call_soon callbacks run in order.)
            error = StorageError(f"{self._name}: hashing stopped")
            if not job.cancelled() and job.exception() is not None:
                error = StorageError(f"{self._name}: hashing failed: {job.exception()}")
            for header in headers:
                _settle(header, b"", error)

        job = asyncio.ensure_future(self.run_job(encode_all))
        job.add_done_callback(finished)
        return headers, job

    def _set_parts(
        self, rkey: bytes, header: bytes, segments: Sequence[memoryview]
    ) -> list[bytes | memoryview]:
        """`SET rkey header‖segments NX [EX ttl]`, packed around the segments."""
        nbytes = len(header) + sum(len(s) for s in segments)
        head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s" % (
            self._set_argc,
            len(rkey),
            rkey,
            nbytes,
            header,
        )
        return [head, *segments, self._set_tail]

    async def _bulk_sets(
        self,
        bulk: BulkConnectionPool,
        count: int,
        parts: Callable[[int], Awaitable[Sequence[bytes | memoryview]]],
    ) -> list[object]:
        """`count` SETs on a bulk connection, command `k` being `await parts(k)`, each built
        just before it is sent. Replies: True (stored), None (the key existed) or the error
        reply of that command."""

        async def talk(conn: BulkConnection) -> list[object]:
            for k in range(count):
                await conn.send(await parts(k))
            return [await conn.read_status() for _ in range(count)]

        return await bulk.exchange(talk)  # SET NX makes a repeat harmless

    @_counted
    async def delete(self, keys: Sequence[bytes]) -> int:
        """DEL each key; how many existed and were removed. On a cluster the keys of a
        node that fails stay (counted in `errors`); `StorageError` only if no node answered."""
        self._redis()
        check_keys(keys)
        if not keys:
            await anyio.lowlevel.checkpoint()  # nothing to send: an async call yields all the same
            return 0
        # Keys removed before a refused DEL or a cancel count too: the call then raises.
        totals = [0, 0]
        try:
            removed, _, _ = await self._delete_rkeys([self._rkey(k) for k in keys], totals=totals)
        finally:
            self._counters.deletes += totals[0]
        return removed

    # Raw access (RawAccess).

    @_counted
    async def read_raw(self, key: bytes) -> bytes | None:
        """The stored `header ‖ payload` of `key`, or None when absent."""
        client = self._redis()
        check_key(key)
        try:
            value = await client.get(self._rkey(key))
        except REDIS_FAULTS as exc:
            raise StorageError(f"{self._name}: read_raw failed: {exc}") from exc
        if value is None:
            return None
        if not isinstance(value, bytes):  # decode_responses is never set, but be exact
            raise StorageError(f"{self._name}: read_raw got {type(value).__name__}")
        return value

    @_counted
    async def write_raw(self, key: bytes, value: bytes) -> None:
        """Store `value` under `key` as is, replacing what is there (keeps the TTL policy)."""
        client = self._redis()
        check_key(key)
        rkey = self._rkey(key)
        try:
            if self._multi is None:
                # Asked before the first: a refused MULTI would run the SET all the same.
                refused = await transactions_refused(client, rkey)
                self._multi = None if refused is None else not refused
            if self._multi is not False:
                # The length it replaces, in the same transaction, keeps stats() true.
                async with client.pipeline(transaction=True) as pipe:
                    pipe.strlen(rkey)
                    pipe.set(rkey, value, ex=self._ttl)
                    replaced, _ = await pipe.execute()
            else:
                replaced = await self._write_raw_scripted(client, rkey, value)
        except REDIS_FAULTS as exc:
            raise StorageError(f"{self._name}: write_raw failed: {exc}") from exc
        if not replaced:
            self._pages += 1
        self._bytes += len(value) - int(replaced)

    async def _write_raw_scripted(self, client: RedisClient, rkey: bytes, value: bytes) -> int:
        """write_raw's transaction as a script, where the server refuses MULTI."""
        if self._write_raw_script is None:
            self._write_raw_script = client.register_script(_WRITE_RAW_SCRIPT)
        ttl = b"" if self._ttl is None else str(self._ttl).encode()
        try:
            return int(await self._write_raw_script(keys=[rkey], args=[value, ttl]))
        except ResponseError as exc:
            if not scripting_refused(exc):
                raise
            raise StorageError(
                f"{self._name}: write_raw refused: the server refuses both MULTI and "
                f"scripting, and write_raw needs one of them (grant +multi +exec, or +eval "
                f"+evalsha +script|load): {exc}"
            ) from None

    # Maintenance (MaintainableStorage).

    @_counted
    async def list_pages(self, limit: int | None = None, *, record: bool = True) -> list[PageInfo]:
        """Pages under the prefix (SCAN), most recently used first by Redis's idle time.

        Under an LFU `maxmemory-policy` Redis keeps no idle time; the page's creation time
        stands in for its last access then. Reading the headers counts as a use for Redis:
        with `record` the pass then writes the `maintenance-read-at` mark that lets later
        listings see past it; without, it writes nothing (the CLI's `ls`). With `limit`
        only that many pages are held at a time (a bounded heap over the same order), and
        without `record` only the headers that can decide the result are read: see
        `_best_listed`.
        """
        if limit is not None and limit <= 0:
            return []
        if limit is not None and not record:
            return await self._best_listed(limit)
        pages: list[PageInfo] = []
        async for batch in self._listed(record=record):
            pages.extend(
                PageInfo(
                    key=self._key_of(rkey),
                    nbytes=nbytes,
                    num_tokens=tokens,
                    priority=priority,
                    last_access=last,
                )
                for rkey, nbytes, tokens, priority, last in batch
            )
            if limit is not None and len(pages) > 2 * limit:
                # As sorted(reverse=True)[:limit], ties in scan order: the pages kept are
                # those the full listing would start with.
                pages = heapq.nlargest(limit, pages, key=_last_access)
        pages.sort(key=_last_access, reverse=True)  # stable: ties in scan order
        return pages if limit is None else pages[:limit]

    async def count_pages(self) -> tuple[int, int]:
        """(pages, bytes) under the prefix: the pages `list_pages` lists, their stored bytes.

        A `STRLEN` per key and nothing else (an `EXISTS` for an empty value, to tell it from
        a key gone since the scan): no header is read or decoded, nothing is written.
        """
        client = self._redis()
        pages = nbytes = 0
        async for batch in self._scan():
            try:
                async with client.pipeline(transaction=False) as pipe:
                    for rkey in batch:
                        pipe.strlen(rkey)
                    lengths = await pipe.execute(raise_on_error=False)
                empty = [rkey for rkey, n in zip(batch, lengths, strict=True) if n == 0]
                if empty:
                    async with client.pipeline(transaction=False) as pipe:
                        for rkey in empty:
                            pipe.exists(rkey)  # EXISTS, unlike a read, is no use for Redis
                        pages += sum(1 for there in await pipe.execute() if there)
            except REDIS_FAULTS as exc:
                raise StorageError(f"{self._name}: count_pages failed: {exc}") from exc
            for length in lengths:
                if isinstance(length, NoPermissionError):
                    # As in list_pages: a count without these keys would pass for the store's.
                    raise StorageError(f"{self._name}: count_pages failed: {length}")
                if _is_int(length) and length > 0:  # not a string (WRONGTYPE): not listed
                    pages += 1
                    nbytes += length
        return pages, nbytes

    async def _listed(self, *, record: bool) -> AsyncIterator[list[_Listed]]:
        """The pages under the prefix, one pipeline's worth at a time (so a caller keeps only
        what it needs and the loop runs between pipelines); the mark is written at the end
        with `record`."""
        client = self._redis()
        mark = self._touched_rkey()
        async for batch in self._scan():
            try:
                async with client.pipeline(transaction=False) as pipe:
                    # The mark's idle time with the pages': compared with theirs, it must be
                    # read when they are, not at the listing's start (a page used shortly
                    # after the pass would look unused since, once the listing took longer).
                    pipe.object("idletime", mark)
                    for rkey in batch:
                        # IDLETIME first: GETRANGE counts as an access.
                        pipe.object("idletime", rkey)
                        pipe.getrange(rkey, 0, HEADER_NBYTES - 1)
                        pipe.strlen(rkey)
                    results = await pipe.execute(raise_on_error=False)
            except REDIS_FAULTS as exc:
                raise StorageError(f"{self._name}: list_pages failed: {exc}") from exc
            # These idle times count to this batch's answer, not to the listing's start: a
            # listing that took seconds made the pages it reached last look that much older,
            # and gc evicted newer pages before older ones.
            now = time.time()
            touched = _touched_of(results[0])
            listed: list[_Listed] = []
            for j, rkey in enumerate(batch):
                idle, head, nbytes = results[1 + 3 * j : 4 + 3 * j]
                page = self._judged(rkey, idle, head, nbytes, now=now, touched=touched)
                if page is not None:
                    listed.append(page)
            yield listed
        if record:
            await self._mark_touched()

    def _judged(
        self,
        rkey: bytes,
        idle: object,
        head: object,
        nbytes: object,
        *,
        now: float,
        touched: int | None,
    ) -> _Listed | None:
        """A page as a listing gives it, from its `OBJECT IDLETIME`, header `GETRANGE` and
        `STRLEN` replies (read in that order: the GETRANGE counts as an access); None for a
        key gone since the scan or not a string. `now`: when `idle`, and the mark's idle time
        `touched`, were read."""
        if isinstance(nbytes, NoPermissionError):
            # The ACL keeps these keys from this user: a listing without them would pass for
            # the whole store (gc and stats would see it empty).
            raise StorageError(f"{self._name}: list_pages failed: {nbytes}")
        # A key gone since the scan has no idle time (nil); under an LFU policy an existing
        # one answers an error instead. An empty value is listed.
        if not isinstance(nbytes, int) or (nbytes == 0 and idle is None):
            return None
        if isinstance(idle, Exception) and not self._idle_refusal_told and _idle_refused(idle):
            # Otherwise unsaid: gc would evict by age and keep pages nobody uses.
            self._idle_refusal_told = True
            log.warning(
                "storage.redis.idletime_refused",
                backend=self._name,
                error=_reply_text(idle),
                detail="pages are listed, and evicted by gc, by their creation, not their last use",
            )
        header = decode_header(head) if isinstance(head, bytes) else PageCheck.CORRUPT
        tokens = priority = 0
        created = now  # a newer format's: unknown, so counted as new
        if not isinstance(header, PageCheck):
            tokens, priority = header.num_tokens, header.priority
            created = created_recency(header.created_ns / 1e9, now)
        last = now - idle if isinstance(idle, int) else created
        if touched is not None and isinstance(idle, int) and idle >= touched:
            # Not used since a pass that read every page and recorded it (which Redis
            # counts as a use): its creation is the best recency left, but never later
            # than the pass's mark (to the idle clock's one second), which pages used since
            # come after. Its writer's clock stamped it: one running ahead, or this host's
            # stepped back since, would list it before them, and gc would evict them first.
            last = min(created, now - touched + 1)
        if header is PageCheck.CORRUPT:
            last = 0.0  # damaged: the first gc evicts, whatever read it last
        return _Listed(rkey, nbytes, tokens, priority, last)

    async def _best_listed(self, limit: int) -> list[PageInfo]:
        """The first `limit` pages of the full listing (`list_pages(limit, record=False)`),
        reading only the headers that can decide them.

        `OBJECT IDLETIME` (which, unlike a read, is no use for Redis) of every page comes
        first, pipelined; a page whose idle time sets its last access (no LFU policy, used
        since the last recorded pass) is last used at most then: less if its header says it
        is damaged. Such pages are read (header and `STRLEN`) best first, and only while they
        could still beat the `limit`-th page kept so far (ties go by scan order, as in the
        full listing); the others, whose order their header decides, are all read. A page
        that turns out damaged or gone makes room for the next.
        """
        client = self._redis()
        mark = self._touched_rkey()
        # The best `limit` pages so far, the worst on top: (last access, -scan index, page).
        best: list[tuple[float, int, _Listed]] = []
        damaged = 0  # of those, listed as last used at 0: any page with an idle time beats them
        scanned = 0

        async def read(
            candidates: Sequence[tuple[int, bytes, object]], now: float, touched: int | None
        ) -> None:
            nonlocal damaged
            try:
                async with client.pipeline(transaction=False) as pipe:
                    for _, rkey, _ in candidates:
                        pipe.getrange(rkey, 0, HEADER_NBYTES - 1)
                        pipe.strlen(rkey)
                    results = await pipe.execute(raise_on_error=False)
            except REDIS_FAULTS as exc:
                raise StorageError(f"{self._name}: list_pages failed: {exc}") from exc
            for j, (index, rkey, idle) in enumerate(candidates):
                head, nbytes = results[2 * j : 2 * j + 2]
                page = self._judged(rkey, idle, head, nbytes, now=now, touched=touched)
                if page is None:
                    continue
                entry = (page.last_access, -index, page)
                if len(best) < limit:
                    heapq.heappush(best, entry)
                elif entry[:2] > best[0][:2]:
                    damaged -= heapq.heapreplace(best, entry)[0] == 0.0
                else:
                    continue
                damaged += page.last_access == 0.0

        async for batch in self._scan():
            # Each batch's idle times, the mark's with them, count to when they were read
            # (as in `_listed`): a listing that took seconds would otherwise rank the pages it
            # reached last as that much older, and some used after the pass as unused since.
            replies = await self._idle_times(client, [mark, *batch])
            now = time.time()
            touched, idles = _touched_of(replies[0]), replies[1:]
            unbounded: list[tuple[int, bytes, object]] = []
            bounded: list[tuple[float, int, bytes, int]] = []  # (bound, -index, key, idle)
            for index, (rkey, idle) in enumerate(zip(batch, idles, strict=True), scanned):
                if idle is None:
                    continue  # gone since the scan
                if _is_int(idle) and (touched is None or idle < touched):
                    bounded.append((now - idle, -index, rkey, idle))
                else:
                    unbounded.append((index, rkey, idle))
            scanned += len(batch)
            for start in range(0, len(unbounded), _KEYS_PER_PIPELINE):
                await read(unbounded[start : start + _KEYS_PER_PIPELINE], now, touched)
            bounded.sort(reverse=True)
            taken = 0
            while taken < len(bounded):
                # Those that could still enter: as many as there is room for (damaged pages
                # kept give theirs up), or once full of sound ones, at most as many as may be
                # kept.
                bar = best[0][:2] if len(best) == limit else None
                room = limit - len(best) + damaged or limit
                chunk = []
                for bound, negative, rkey, idle in bounded[taken : taken + room]:
                    if bar is not None and (bound, negative) < bar:
                        break
                    chunk.append((-negative, rkey, idle))
                if not chunk:
                    break
                taken += len(chunk)
                await read(chunk, now, touched)
        best.sort(reverse=True)
        return [
            PageInfo(
                key=self._key_of(page.rkey),
                nbytes=page.nbytes,
                num_tokens=page.num_tokens,
                priority=page.priority,
                last_access=page.last_access,
            )
            for _, _, page in best
        ]

    async def _idle_times(self, client: RedisClient, rkeys: Sequence[bytes]) -> list[object]:
        """`OBJECT IDLETIME` of each key, pipelined (on a bulk connection where there is one:
        redis-py's own costs several times the server's time for such small replies): the
        seconds, None for a key gone, or the error reply (an LFU policy keeps no idle time)."""
        bulk = self._bulk
        try:
            if bulk is None:
                async with client.pipeline(transaction=False) as pipe:
                    for rkey in rkeys:
                        pipe.object("idletime", rkey)
                    return list(await pipe.execute(raise_on_error=False))
            request = b"".join(
                b"*3\r\n$6\r\nOBJECT\r\n$8\r\nIDLETIME\r\n$%d\r\n%s\r\n" % (len(rkey), rkey)
                for rkey in rkeys
            )

            async def talk(conn: BulkConnection) -> list[object]:
                await conn.send([request])
                return [await conn.read_integer() for _ in rkeys]

            return await bulk.exchange(talk)  # reads nothing: safe to repeat
        except (*REDIS_FAULTS, OSError) as exc:
            raise StorageError(f"{self._name}: list_pages failed: {self._fault(exc)}") from exc

    def _touched_rkey(self) -> bytes:
        return f"{self._prefix}:{_TOUCHED_NAME}".encode()  # never a page key (not hex)

    async def _mark_touched(self) -> None:
        """Record that every page was just read: the mark's own idle time then tells which
        pages were not used since. A server refusing the write (a read-only user) costs
        only the ordering of the next listing."""
        try:
            await self._redis().set(self._touched_rkey(), repr(time.time()).encode())
        except REDIS_FAULTS as exc:
            log.warning("storage.redis.touch_mark_failed", backend=self._name, error=str(exc))

    @_counted
    async def verify(self) -> VerifyReport:
        """Read every page under the prefix; remove the ones that fail their checks.

        Without a namespace only what a page says about itself is checked: header, key,
        length, checksum, and the MAC when this instance holds a key. Keys under the prefix
        that are not page keys are left alone (they may belong to someone else).
        """
        client = self._redis()
        checked = ok = unsupported = unchecked = 0
        bad: list[tuple[bytes, int, bytes]] = []  # key, length, leading bytes of what was read

        def unreadable(rkey: bytes, error: Exception) -> None:
            # Not a string (WRONGTYPE: another client's hash or list under a page key, left
            # alone as not ours to remove), or the node failed.
            nonlocal unchecked
            unchecked += 1
            log.warning(
                "storage.page.error",
                backend=self._name,
                key=self._key_of(rkey).hex(),
                error=str(error),
            )

        async for batch in self._scan():
            # The header and the length first: a value is read no further than its header
            # allows, and its payload in pieces (whatever a writer stored under a page key,
            # verify holds at most one pipeline of pieces).
            try:
                async with client.pipeline(transaction=False) as pipe:
                    for rkey in batch:
                        pipe.exists(rkey)  # an empty value and an absent key read the same
                        pipe.strlen(rkey)
                        pipe.getrange(rkey, 0, HEADER_NBYTES - 1)
                    replies = await pipe.execute(raise_on_error=False)
            except REDIS_FAULTS as exc:
                raise StorageError(f"{self._name}: verify failed: {exc}") from exc
            streams: list[_Stream] = []
            for j, rkey in enumerate(batch):
                replied = replies[3 * j : 3 * j + 3]
                error = next((r for r in replied if isinstance(r, Exception)), None)
                if error is not None:
                    unreadable(rkey, error)
                    continue
                exists, length, head = replied
                if not exists or not isinstance(length, int) or not isinstance(head, bytes):
                    continue  # gone since the scan
                if len(head) != min(length, HEADER_NBYTES):
                    continue  # replaced between the commands: the next pass checks it
                header = decode_header(head)
                key = self._key_of(rkey)
                if header is PageCheck.UNSUPPORTED:
                    checked += 1
                    unsupported += 1
                elif (
                    isinstance(header, PageCheck)
                    or header.key != key
                    or length != header.page_nbytes
                ):
                    checked += 1
                    bad.append((rkey, length, head))
                else:
                    verifier = PayloadVerifier(header, mac_key=self._mac_key)
                    streams.append(_Stream(rkey, length, head, verifier))
            for stream, verdict in zip(
                streams, await self._verify_payloads(client, streams), strict=True
            ):
                if isinstance(verdict, Exception):
                    unreadable(stream.rkey, verdict)
                    continue
                if verdict is None:
                    continue  # gone or replaced while its pieces were read
                checked += 1
                if verdict is PageCheck.OK:
                    ok += 1
                elif verdict is PageCheck.CORRUPT:
                    bad.append((stream.rkey, stream.length, stream.head))
        removed = 0
        for rkey, length, head in bad:
            try:
                deleted = await self._remove_if_same_value(rkey, length, head)
            except REDIS_FAULTS as exc:
                self._counters.errors += 1
                raise StorageError(f"{self._name}: verify failed: {exc}") from exc
            # Reported only once removed: a value read in several commands that another
            # writer replaced meanwhile (not removed then) is no damage.
            if deleted:
                self._report_corrupt(self._key_of(rkey), "verify")
                removed += 1
                self._pages -= 1
                self._bytes -= length
        await self._mark_touched()
        return VerifyReport(
            checked=checked,
            ok=ok,
            corrupt_removed=removed,
            unsupported=unsupported,
            leftovers_removed=0,
            unchecked=unchecked,
        )

    async def _verify_payloads(
        self, client: RedisClient, streams: Sequence[_Stream]
    ) -> list[PageCheck | Exception | None]:
        """Feed each stream's payload to its verifier in GETRANGE pieces, at most
        `_VERIFY_PIPELINE_BYTES` per pipeline; its verdict, the error reply that stopped it,
        or None if the value changed while it was read (a piece came back short)."""
        verdicts: list[PageCheck | Exception | None] = [None] * len(streams)
        stopped = [False] * len(streams)
        pieces = (
            (s, start, min(start + _VERIFY_PIECE_BYTES, stream.length))
            for s, stream in enumerate(streams)
            for start in range(HEADER_NBYTES, stream.length, _VERIFY_PIECE_BYTES)
        )

        async def run(batch: list[tuple[int, int, int]]) -> None:
            try:
                async with client.pipeline(transaction=False) as pipe:
                    for s, start, end in batch:
                        pipe.getrange(streams[s].rkey, start, end - 1)
                    replies = await pipe.execute(raise_on_error=False)
            except REDIS_FAULTS as exc:
                raise StorageError(f"{self._name}: verify failed: {exc}") from exc
            for (s, start, end), piece in zip(batch, replies, strict=True):
                if stopped[s]:
                    continue
                if isinstance(piece, Exception):
                    verdicts[s] = piece
                    stopped[s] = True
                elif not isinstance(piece, bytes) or len(piece) != end - start:
                    stopped[s] = True
                else:
                    streams[s].verifier.update(piece)

        batch: list[tuple[int, int, int]] = []
        nbytes = 0
        for piece in pieces:
            batch.append(piece)
            nbytes += piece[2] - piece[1]
            if nbytes >= _VERIFY_PIPELINE_BYTES or len(batch) >= _MAX_COMMANDS_PER_PIPELINE:
                await run(batch)
                batch, nbytes = [], 0
        if batch:
            await run(batch)
        for s, stream in enumerate(streams):
            if not stopped[s]:
                verdicts[s] = stream.verifier.result()
        return verdicts

    async def _remove_if_same_value(self, rkey: bytes, length: int, head: bytes) -> bool:
        """DEL `rkey` if it still holds a value of `length` bytes starting with `head`."""
        script = self._remove_if_same
        assert script is not None  # registered at open
        try:
            return bool(await script(keys=[rkey], args=[length, head]))
        except ResponseError as exc:
            if not scripting_refused(exc):
                raise
            # Scripting refused (disabled, a proxy): the same check, then the delete, with a
            # window between them in which the page may be stored again.
            log.warning("storage.redis.no_scripting", backend=self._name, error=str(exc))
        client = self._redis()
        async with client.pipeline(transaction=False) as pipe:
            pipe.strlen(rkey)
            pipe.getrange(rkey, 0, len(head) - 1)
            stored, start = await pipe.execute()
        if stored != length or start != head:
            return False
        return bool(await client.delete(rkey))

    @_counted
    async def gc(self) -> GcReport:
        """Evict least recently used pages until those under the prefix fit `capacity`.

        Without a capacity this evicts nothing (Redis's own `maxmemory` policy bounds it),
        once the server has answered a PING: a server that cannot be reached raises
        StorageError, as with a capacity, not an empty report that reads as success.
        A pass that finds another holding the prefix's lease for longer than `gc_wait`
        (300 s unless set; `None` waits as long as the other pass runs) gives up and
        reports `skipped`, having evicted nothing.
        """
        client = self._redis()
        if self._capacity is None:
            await self._ping_for("gc", client)
            return GcReport(evicted_pages=0, freed_bytes=0)
        async with self._gc_lease(client) as held:
            if not held:
                return GcReport(evicted_pages=0, freed_bytes=0, skipped=True)
            return await self._gc_pass(client, self._capacity)

    async def _gc_pass(self, client: RedisClient, capacity: int) -> GcReport:
        """One gc pass, under the prefix's lease (`_gc_lease`)."""
        # Headers are needed (a damaged page goes first; one not used since the last recorded
        # pass goes by its creation), but not PageInfo objects: (last access, bytes, key).
        entries: list[tuple[float, int, bytes]] = []
        total = 0
        async for batch in self._listed(record=True):
            for listed in batch:
                entries.append((listed.last_access, listed.nbytes, listed.rkey))
                total += listed.nbytes
        if total <= capacity:
            return GcReport(evicted_pages=0, freed_bytes=0)
        # Sorting every page at once held the loop (~0.1 s for 200k pages).
        victims = await self.run_job(lambda stop: _gc_victims(entries, total, capacity))
        if not victims:
            return GcReport(evicted_pages=0, freed_bytes=0)
        totals = [0, 0]
        try:
            evicted, freed, failed = await self._delete_rkeys(victims, totals=totals)
        finally:
            self._counters.evictions += totals[0]
        # Victims on a cluster node lost after the listing stay, as the file store's that
        # could not be removed: told, not raised, once another node's were evicted.
        over = max(total - freed - capacity, 0) if failed else 0
        return GcReport(
            evicted_pages=evicted, freed_bytes=freed, failed=failed, over_capacity_bytes=over
        )

    @contextlib.asynccontextmanager
    async def _gc_lease(self, client: RedisClient) -> AsyncIterator[bool]:
        """Hold the prefix's gc lease for the block, which gets True: a gc waits while
        another holds it (the next pass then sees what the first left), up to `gc_wait`,
        after which the block gets False and holds nothing. A server refusing the SET (an
        ACL, a read-only replica) runs the pass without it, once logged."""
        rkey = f"{self._prefix}:{_GC_LEASE_NAME}".encode()  # never a page key (not hex)
        token = secrets.token_hex(16).encode()
        ttl_ms = int(_GC_LEASE_S * 1000)
        loop = asyncio.get_running_loop()
        # A holder renews its lease for as long as its pass runs: without a bound, a caller
        # would wait for the whole of another's long pass.
        deadline = None if self._gc_wait is None else loop.time() + self._gc_wait
        waited = False
        refusal: str | None = None
        while True:
            try:
                taken = await client.set(rkey, token, nx=True, px=ttl_ms)
            except REDIS_FAULTS as exc:
                if not _refused(exc):
                    raise StorageError(f"{self._name}: gc failed: {exc}") from exc
                refusal = _reply_text(exc)
                break
            if taken:
                break
            left = math.inf if deadline is None else deadline - loop.time()
            if left <= 0:
                log.info(
                    "storage.redis.gc_skipped",
                    backend=self._name,
                    gc_wait=self._gc_wait,
                    detail="another gc still holds this prefix's lease: this one evicts "
                    "nothing and reports skipped=True",
                )
                yield False
                return
            if not waited:
                waited = True
                log.info(
                    "storage.redis.gc_waiting",
                    backend=self._name,
                    detail=f"another gc holds this prefix's lease: this one runs after it "
                    f"(a holder gone lets go within {_GC_LEASE_S:g} s)",
                )
            await asyncio.sleep(min(_GC_LEASE_POLL_S, left))
        if refusal is not None:
            log.warning(
                "storage.redis.gc_lease_refused",
                backend=self._name,
                error=refusal,
                detail="gc runs without its lease: two at once under this prefix may evict "
                "more than needed",
            )
            yield True
            return
        renewal = asyncio.ensure_future(self._renew_gc_lease(client, rkey, token, ttl_ms))
        try:
            yield True
        finally:
            renewal.cancel()
            await asyncio.gather(renewal, return_exceptions=True)
            with contextlib.suppress(*REDIS_FAULTS):  # else it expires
                await self._lease_call(client, _RELEASE_LEASE_SCRIPT, rkey, token)

    async def _renew_gc_lease(
        self, client: RedisClient, rkey: bytes, token: bytes, ttl_ms: int
    ) -> None:
        """Keep the lease while the pass runs; say so once if it was lost (the loop held
        past its expiry, and another gc may have started)."""
        while True:
            await asyncio.sleep(_GC_LEASE_S / 3)
            try:
                kept = await self._lease_call(client, _RENEW_LEASE_SCRIPT, rkey, token, ttl_ms)
            except REDIS_FAULTS:
                continue  # the pass's own commands fail on this too; tried again
            if not kept:
                log.warning(
                    "storage.redis.gc_lease_lost",
                    backend=self._name,
                    detail="the gc lease expired before it was renewed: another gc may run at once",
                )
                return

    async def _lease_call(
        self, client: RedisClient, source: str, rkey: bytes, token: bytes, ttl_ms: int = 0
    ) -> bool:
        """Renew (`ttl_ms`) or release the lease if it still holds `token`: one script, or
        where scripting is refused, a GET and then the PEXPIRE or DEL (with a window between
        them in which the lease may expire and be taken by another)."""
        args: list[bytes | int] = [token, ttl_ms] if ttl_ms else [token]
        try:
            return bool(await client.eval(source, 1, rkey, *args))
        except ResponseError as exc:
            if not scripting_refused(exc):
                raise
        if await client.get(rkey) != token:
            return False
        if ttl_ms:
            return bool(await client.pexpire(rkey, ttl_ms))
        return bool(await client.delete(rkey))

    # Internals.

    def _note_reply(self, error: object) -> None:
        """Log an error reply to one key's SET or GET, which fails only that key (`ERROR`,
        or `MISS` for OOM). A server that refuses every key (an ACL, a key of another type,
        a read-only replica) would otherwise show only as a 100 % error rate: each kind of
        reply (its first word: ERR, NOPERM, WRONGTYPE, ...) is logged at most once per
        `_REPLY_ERROR_INTERVAL_S`, with how many went unlogged since, never once per key."""
        text = _reply_text(error)
        if text.startswith("MOVED") or isinstance(error, MovedError):
            if not self._cluster and not self._moved_noted:
                # Pointed at a cluster node without cluster=1: a MOVED for every key of
                # another node.
                self._moved_noted = True
                log.warning(
                    "storage.redis.cluster_node",
                    backend=self._name,
                    error=text,
                    hint="the server is a Redis Cluster node: open it with cluster=1",
                )
            return
        kind = text.split(" ", 1)[0]
        if kind not in self._reply_errors and len(self._reply_errors) >= _REPLY_ERROR_KINDS:
            kind = "other"  # a server inventing replies cannot grow this without bound
        now = time.monotonic()
        last, unlogged = self._reply_errors.get(kind, (-math.inf, 0))
        if now - last < _REPLY_ERROR_INTERVAL_S:
            self._reply_errors[kind] = (last, unlogged + 1)
            return
        self._reply_errors[kind] = (now, 0)
        log.warning(
            "storage.redis.reply_error",
            backend=self._name,
            error=text,
            unlogged_since_last=unlogged,
        )

    async def _ping_for(self, call: str, client: RedisClient) -> None:
        """One round trip; StorageError naming `call` if the server does not answer."""
        try:
            await client.ping()
        except NoPermissionError:
            return  # only PING is refused: the server answered
        except (*REDIS_FAULTS, OSError) as exc:
            raise StorageError(f"{self._name}: {call} failed: {self._fault(exc)}") from exc

    def _batch_failed(self, event: str, error: str) -> None:
        """Log a pipeline of a `get` or `put` given up on, rate-limited per kind of error."""
        self._batch_faults.warn(log, event, error, backend=self._name)

    def _fault(self, exc: BaseException) -> str:
        """What failed, for a message: a bulk exchange that ran out of time raises a
        TimeoutError without text."""
        if isinstance(exc, TimeoutError):
            return f"timed out after {self._timeout}s"
        return str(exc) or repr(exc)

    def _redis(self) -> RedisClient:
        self._check_open()
        assert self._client is not None
        return self._client

    def _rkey(self, key: bytes) -> bytes:
        return f"{self._prefix}:{key.hex()}".encode()

    def _key_of(self, rkey: bytes) -> bytes:
        return bytes.fromhex(rkey[len(self._prefix) + 1 :].decode("ascii"))

    async def _scan(self) -> AsyncIterator[list[bytes]]:
        """Page keys under the prefix in batches (SCAN: no order, a key may repeat)."""
        client = self._redis()
        batch: list[bytes] = []
        seen: set[bytes] = set()
        try:
            async for rkey in client.scan_iter(match=f"{self._prefix}:*".encode(), count=1000):
                if rkey in seen or not self._is_page_rkey(rkey):
                    continue
                seen.add(rkey)
                batch.append(rkey)
                if len(batch) >= _KEYS_PER_PIPELINE:
                    yield batch
                    batch = []
        except REDIS_FAULTS as exc:
            raise StorageError(f"{self._name}: scan failed: {exc}") from exc
        if batch:
            yield batch

    def _is_page_rkey(self, rkey: bytes) -> bool:
        # Exactly what _rkey writes (32-byte keys, lower-case hex): anything else under the
        # prefix may be someone else's and is never listed, verified or evicted.
        tail = rkey[len(self._prefix) + 1 :]
        return len(tail) == 64 and not tail.translate(None, _HEX_DIGITS)

    def _by_node(self, keys: Sequence[bytes]) -> list[Sequence[int]]:
        """The indexes of `keys` grouped by the cluster node that owns each key
        (`GuardedCluster.by_node`); off a cluster, one group of them all."""
        client = self._client
        if isinstance(client, GuardedCluster) and len(keys) > 1:
            return list(client.by_node([self._rkey(k) for k in keys]))
        return [range(len(keys))]

    async def _run_chunks(
        self,
        chunks: Sequence[_C],
        run: Callable[[_C], Awaitable[None]],
        *,
        concurrency: int | None = None,
    ) -> None:
        """Run `run` over `chunks` on at most `concurrency` (default: the backend's)
        connections at once."""
        if len(chunks) <= 1:
            for chunk in chunks:
                await run(chunk)
            return
        pending = iter(chunks)

        async def worker() -> None:
            for chunk in pending:
                if self.closed:  # close() waits for this call: take no more
                    return
                await run(chunk)

        tasks = [
            asyncio.ensure_future(worker())
            for _ in range(min(concurrency or self._concurrency, len(chunks)))
        ]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            # Cancelled or failed: stop the siblings and wait for them, so nothing of this
            # call runs after it has returned.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _delete_rkeys(
        self,
        rkeys: Sequence[bytes],
        read_nbytes: Sequence[int] | None = None,
        *,
        totals: list[int] | None = None,
    ) -> tuple[int, int, int]:
        """DEL the keys: (how many existed, their bytes, how many were left on cluster nodes
        that failed or refused their DEL while others answered: counted in `errors`, not
        removed). `totals`, if given, is [removed, bytes] as counted so far, kept up to date
        even when the call raises after removing some keys.

        Each DEL comes with a STRLEN for the byte count. Where STRLEN is refused (an ACL
        that lists commands, a proxy), a key's bytes are the length its value was just read
        with (`read_nbytes`, from a get), else what its header says (a GETRANGE of it, exact
        for a page as written and for a value shorter than a header), else unknown: counted
        as this instance's mean page, so that `stats().bytes` neither drifts below zero nor
        grows without bound.

        A pipeline, once sent, is never sent again (see `_send_once`), and its replies are
        read and counted even if the call is cancelled meanwhile: the server runs the DELs it
        received either way, and pages removed but still counted would stay in `stats()`.
        """
        client = self._redis()
        if self._unsettled:
            # Those about to be deleted, before their DEL finds nothing; and some others.
            await self._settle_deletes([*rkeys, *list(self._unsettled)[:_KEYS_PER_PIPELINE]])
        if totals is None:
            totals = [0, 0]  # removed, freed
        # On a cluster each node's keys go in pipelines of their own, so that a lost node
        # fails only its keys: the other nodes' are removed (as the file store removes what
        # it can). A failed pipeline gives up the rest of its node's (they would pay the same
        # timeout), and only when no node answered does the call raise.
        groups = (
            client.by_node(rkeys) if isinstance(client, GuardedCluster) else [range(len(rkeys))]
        )
        failed = 0
        fault: StorageError | None = None
        answered = False
        for group in groups:
            for start in range(0, len(group), _KEYS_PER_PIPELINE):
                indexes = group[start : start + _KEYS_PER_PIPELINE]
                batch = [rkeys[i] for i in indexes]
                sizes = None if read_nbytes is None else [read_nbytes[i] for i in indexes]
                try:
                    cancelled = await finish_uncancelled(
                        self._delete_batch(client, batch, sizes, totals)
                    )
                except _DeletesFailed as exc:
                    if len(groups) == 1:
                        raise
                    fault = fault or exc
                    self._batch_failed("storage.redis.delete_failed", str(exc))
                    if exc.answered:
                        # The node refused some DELs and ran the others: only the refused
                        # keys are left, and its next pipelines are still sent.
                        failed += exc.failed
                        answered = True
                        continue
                    failed += len(group) - start - exc.removed
                    break
                except StorageError as exc:
                    if len(groups) == 1:
                        raise
                    fault = fault or exc
                    failed += len(group) - start
                    self._batch_failed("storage.redis.delete_failed", str(exc))
                    break
                answered = True
                if cancelled is not None:
                    raise cancelled  # between pipelines, not after the last one
        if fault is not None and not answered:
            raise fault
        return totals[0], totals[1], failed

    async def _delete_batch(
        self,
        client: RedisClient,
        batch: Sequence[bytes],
        read_nbytes: Sequence[int] | None,
        totals: list[int],
    ) -> None:
        """One pipeline of `_delete_rkeys`; what it removed is added to `totals`."""
        commands: list[tuple[bytes | str | int, ...]] = []
        for rkey in batch:
            if self._strlen:
                commands.append(("STRLEN", rkey))
            else:
                commands.append(("GETRANGE", rkey, 0, HEADER_NBYTES - 1))
            commands.append(("DEL", rkey))
        sent = False

        def on_sent() -> None:
            nonlocal sent
            sent = True

        try:
            results = await self._send_once(client, commands, on_sent=on_sent)
        except REDIS_FAULTS as exc:
            self._counters.errors += 1
            if sent:
                # The server may have run the DELs (a timeout, a lost connection): they
                # stay counted until a later call finds them gone.
                self._unsettled.update(dict.fromkeys(batch))
                for rkey in list(self._unsettled)[: len(self._unsettled) - _MAX_UNSETTLED]:
                    del self._unsettled[rkey]
            raise StorageError(f"{self._name}: delete failed: {exc}") from exc
        # A server that refused a DEL ran the others of the pipeline, those after it too:
        # each one that removed its key is counted before the failure is raised.
        fault: Exception | None = None
        failed = removed = 0
        answered = True
        for k, (sized, deleted) in enumerate(zip(results[::2], results[1::2], strict=True)):
            if isinstance(deleted, Exception):
                fault = fault or deleted
                failed += 1
                answered = answered and _refused(deleted)
                continue
            if self._strlen and isinstance(sized, Exception) and _read_refused(sized):
                self._strlen = False  # learnt from the header from now on
                log.warning("storage.redis.strlen_refused", backend=self._name, error=str(sized))
            if not deleted:
                continue
            size = sized if _is_int(sized) else None
            if size is None and read_nbytes is not None:
                size = read_nbytes[k]
            if size is None and isinstance(sized, bytes):
                size = _nbytes_from_start(sized)
            totals[0] += 1
            totals[1] += self._uncount(size)
            removed += 1
        if fault is not None:
            self._counters.errors += 1
            raise _DeletesFailed(
                f"{self._name}: delete failed: {fault}",
                failed=failed,
                removed=removed,
                answered=answered,
            )

    async def _settle_deletes(self, rkeys: Sequence[bytes]) -> None:
        """Uncount those of `rkeys` whose DEL got no reply (see `_delete_batch`) and that are
        gone now: the server ran the DEL after all. Those still there leave the watch (their
        DEL did not run). The bytes of a page found gone are unknown: it counts as this
        instance's mean page. If the server does not answer, they stay for the next call."""
        taken = [rkey for rkey in rkeys if self._unsettled.pop(rkey, False) is None]
        if not taken:
            return
        try:
            async with self._redis().pipeline(transaction=False) as pipe:
                for rkey in taken:
                    pipe.exists(rkey)
                found = await pipe.execute(raise_on_error=False)
        except BaseException as exc:
            self._unsettled.update(dict.fromkeys(taken))
            if isinstance(exc, REDIS_FAULTS):
                return  # this call goes on; its own commands meet the fault
            raise
        for there in found:
            if there == 0:
                self._uncount(None)

    def _uncount(self, size: int | None) -> int:
        """Take one page of `size` bytes off the counts; an unknown size counts as this
        instance's mean page, and its last page as all the bytes left, so `bytes` is back at
        0 when `pages` is. Returns the bytes taken off."""
        if size is None:
            left = max(self._bytes, 0)
            size = left // self._pages if self._pages > 1 else left
        self._pages -= 1
        self._bytes -= size
        return size

    async def _send_once(
        self,
        client: RedisClient,
        commands: Sequence[tuple[bytes | str | int, ...]],
        *,
        on_sent: Callable[[], None],
    ) -> list[object]:
        """The replies to a pipeline of `commands` (error replies among them), sent at most
        once. redis-py's retry sends a pipeline again after a timeout, when the server may
        well have run the first (a DEL that ran finds nothing the second time); here only
        getting a connection is retried (one the server dropped is replaced). On a cluster
        the cluster client's pipeline is used, which follows MOVED and may resend."""
        pool = self._pool
        if pool is None:
            async with client.pipeline(transaction=False) as pipe:
                for command in commands:
                    pipe.execute_command(*command)
                on_sent()
                return list(await pipe.execute(raise_on_error=False))
        connection = await pool.get_connection()  # type: ignore[no-untyped-call]
        replies: list[object] = []
        try:
            if closed_by_server(connection):
                # redis-py 8 hands out a pooled connection the server closed while it sat
                # idle (`timeout` in redis.conf, a restart): its pool skips that check when
                # maintenance notifications are on. Nothing was sent on it: a new one is safe.
                await connection.disconnect()
            if not connection.is_connected:
                await connection.connect()
            on_sent()
            await connection.send_packed_command(connection.pack_commands(commands))
            for _ in commands:
                try:
                    replies.append(await connection.read_response())
                except ResponseError as exc:
                    replies.append(exc)
        except BaseException:
            # Replies may be left unread on it: never reused.
            await connection.disconnect()
            raise
        finally:
            await pool.release(connection)
        return replies
