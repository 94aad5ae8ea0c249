"""The warmup manifest of `RedisStorage`, kept in Redis beside the pages.

Keys, per namespace fingerprint `<ns>` (32 hex digits):

    <prefix>:manifest:{<ns>}                    LIST of JSON records, oldest first
    <prefix>:manifest:{<ns>}:meta               HASH: `bytes` (record bytes), `gen` (generation)
    <prefix>:manifest:{<ns>}:compacting:<hex>   LIST a compaction builds, then renames over
    <prefix>:manifest:namespaces                SET of the namespaces that have a manifest

The `{<ns>}` hash tag puts a namespace's keys in one Redis Cluster slot, so the transaction
of an append, the scripts, and the RENAME of a compaction are legal on a Cluster; pages keep
their untagged keys and spread over all slots. `gen` changes whenever records are removed
from the list (compaction, trim): readers work with head indices, which appends never move,
and start over when `gen` changed under them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import anyio
import anyio.lowlevel
import structlog
from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import (
    ClusterCrossSlotError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    ResponseError,
    WatchError,
)

from .._errors import StorageError
from .._forks import current_pid
from ._manifest import (
    CompactReport,
    ManifestCollector,
    ManifestEntry,
    ManifestLimits,
    ManifestRead,
    add_reports,
    check_same_process,
    encode_entry,
    off_loop,
)

__all__ = [
    "NO_WRITES",
    "REDIS_FAULTS",
    "SCRIPT_RETRY_S",
    "RedisClient",
    "ReadScripts",
    "RedisManifest",
    "keys_refused",
    "named_in_script",
    "no_room",
    "run_read_only",
    "scripting_refused",
    "transactions_refused",
]

#: A standalone client, or the cluster client of `cluster=1`.
RedisClient = Redis | RedisCluster

#: What a server can make redis-py raise: its own errors, the cluster client's (a slot no
#: node serves, a topology it cannot learn: not RedisErrors), and ValueError for a reply
#: whose number does not parse (redis-py does not catch that; it drops the connection).
REDIS_FAULTS = (RedisError, RedisClusterException, ValueError)

# Replies that mean this server (or a proxy, or a cluster) will never run our scripts. Any
# other error reply (BUSY, LOADING, OOM, MASTERDOWN, ...) fails one call and says nothing
# about the next.
_REFUSALS = (
    "unknown command",
    "unsupported command",
    "not supported",
    "crossslot",
)
# An ACL refusal names what it refuses. Only a refused script command (or TOUCH, which
# `exists` can do without) means the same for every later call; a key outside the user's
# patterns ("no permissions to access one of the keys used as arguments") or another
# command refused at connection setup (CLIENT SETNAME) says nothing about scripts, and
# taking it for a refusal would switch the fast path off for the rest of the process.
_REFUSED_COMMAND = re.compile(
    r"no permissions to run the '(eval|evalsha|eval_ro|evalsha_ro|script\|load|touch)' command"
)


def scripting_refused(error: BaseException | str) -> bool:
    """Whether an error reply to a script call (or to TOUCH) means it is refused here for
    good: an unknown or unsupported command, CROSSSLOT, or an ACL refusing that command.

    `error` is redis-py's exception (which drops a known prefix such as NOPERM from its
    text) or the whole error reply.
    """
    if isinstance(error, ClusterCrossSlotError):
        return True
    text = str(error).lower()
    return any(refusal in text for refusal in _REFUSALS) or bool(_REFUSED_COMMAND.search(text))


#: The first line of a script that only reads. Redis 7 takes a script without flags for one
#: that may write: it holds it through a `CLIENT PAUSE WRITE` (what FAILOVER and a manual
#: cluster failover do for seconds), while plain reads are answered at once.
NO_WRITES = "#!lua flags=no-writes\n"

# A transaction the server did not take: MULTI refused (an ACL without it, a proxy), so the
# commands ran one by one and EXEC found no transaction; or EXEC itself refused.
_REFUSED_TRANSACTION = re.compile(
    r"exec without multi|(unknown|unsupported) command\W+(multi|exec)\b"
    r"|no permissions to run the '(multi|exec)' command"
)


def flags_refused(error: BaseException | str) -> bool:
    """Whether an error reply to a script that starts with `NO_WRITES` means the server
    knows no script flags: before Redis 7 the shebang line is a syntax error (`unexpected
    symbol near '#'`); a server that knows shebangs but not the flag names the shebang."""
    text = str(error).lower()
    return "shebang" in text or "near '#'" in text


_SCRIPT_COMMANDS = re.compile(r"redis\.p?call\('([a-z]+)'", re.IGNORECASE)


def named_in_script(error: ResponseError, script: str | bytes | memoryview) -> ResponseError:
    """`error`, naming the commands `script` runs where the server says the user may not
    run one of them: its reply names none ("... can't run this command or subcommand")."""
    if "can't run this command or subcommand" not in str(error) or "(the script runs" in str(error):
        return error
    text = script if isinstance(script, str) else bytes(script).decode("utf-8", "replace")
    names = " ".join(dict.fromkeys(name.upper() for name in _SCRIPT_COMMANDS.findall(text)))
    return ResponseError(f"{error} (the script runs {names}: the user may not run one of them)")


class ReadScripts:
    """How one store runs its read-only scripts (and whether its manifests may run scripts
    at all), learned once and shared by the store and every manifest it builds, so that
    what is learned is logged once per store."""

    __slots__ = (
        "_name",
        "_read_only_told",
        "clock",
        "manifest_retry_at",
        "manifest_scripting",
        "manifest_writes_refused",
        "read_only",
        "window_retry_at",
    )

    def __init__(self, name: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._name = name  # the store's, for its log lines
        #: Seconds for the retries below; a store's tests may drive it.
        self.clock = clock
        #: EVAL_RO until the server refuses it (before Redis 7.0, a proxy, an ACL without
        #: it). Unlike EVAL it asks only for read access to its keys, so a user that may
        #: only read them (`%R~` in its ACL) keeps the scripts.
        self.read_only = True
        self._read_only_told = False
        #: When the manifest's read script, refused its keys where plain reads were not,
        #: is tried again (None: it is in use).
        self.window_retry_at: float | None = None
        #: False once the manifests' scripts are refused as a command (scripting disabled,
        #: a proxy): every manifest of the store then uses plain commands, until a retry
        #: at `manifest_retry_at` finds them allowed again.
        self.manifest_scripting = True
        self.manifest_retry_at: float | None = None
        #: Whether a script that writes was refused since scripts were last allowed: a
        #: read's script (EVAL_RO) that runs then does not show that they are back.
        self.manifest_writes_refused = False

    def refuse_read_only(self, error: BaseException | str) -> None:
        """EVAL from now on: `error`, the reply to an EVAL_RO, refused it (said once per
        store)."""
        self.read_only = False
        if not self._read_only_told:
            self._read_only_told = True
            _log.info("hicache.redis.eval_ro_refused", backend=self._name, error=str(error))

    def refuse_manifest_scripting(self, error: BaseException, *, writes: bool) -> None:
        """Plain commands for every manifest of the store until the retry, a minute on:
        `error` refused a manifest's script as a command (said once per store, not at
        every retry still refused); `writes`: a script that writes, not a read's."""
        self.manifest_writes_refused = self.manifest_writes_refused or writes
        if self.manifest_scripting:
            self.manifest_scripting = False
            _log.warning("hicache.manifest.no_scripting", backend=self._name, error=str(error))
        self.manifest_retry_at = self.clock() + SCRIPT_RETRY_S

    def manifest_may_script(self, *, writes: bool = True) -> bool:
        """Whether a manifest's next step runs its script: while allowed, and where refused,
        one step a minute (the refusal may be over: rights restored, a proxy replaced).
        After a script that writes was refused, only a step that writes (`writes`) takes
        the retry: a read's script running would not show that those are back."""
        if self.manifest_scripting:
            return True
        if self.manifest_writes_refused and not writes:
            return False
        retry_at = self.manifest_retry_at
        if retry_at is None or self.clock() < retry_at:
            return False
        self.manifest_retry_at = self.clock() + SCRIPT_RETRY_S
        return True

    def manifest_script_ran(self, *, writes: bool) -> None:
        """A manifest's script ran (`writes`: one that writes, not a read's): where it was
        refused, scripts are back for every manifest of the store. A read's alone does not
        bring them back after a script that writes was refused (an ACL allowing EVAL_RO but
        not EVAL and EVALSHA): the next step that writes would be refused again."""
        if self.manifest_scripting or (self.manifest_writes_refused and not writes):
            return
        self.manifest_writes_refused = False
        self.manifest_scripting = True
        self.manifest_retry_at = None
        _log.info("hicache.manifest.scripting_restored", backend=self._name)


async def run_read_only(
    client: RedisClient,
    script: AsyncScript,
    keys: Sequence[str | bytes],
    args: Sequence[Any] = (),
    *,
    scripts: ReadScripts,
) -> tuple[AsyncScript, Any]:
    """Run `script` (which starts with `NO_WRITES`): (the script to use from now on, its
    reply). Where the server refuses the flag (Redis before 7.0), the same script without
    it, which such a server does not hold for a pause either.

    Sent with EVAL_RO (EVAL where `scripts` says it is refused) and its text, never
    EVALSHA: a server that has not cached it (after a restart or `SCRIPT FLUSH`) holds an
    EVALSHA through a `CLIENT PAUSE WRITE` before it can answer NOSCRIPT, as it cannot know
    the flags of a script it does not have.
    """
    tried_read_only = False
    while True:
        text = script.script
        read_only = scripts.read_only
        tried_read_only = tried_read_only or read_only
        try:
            if read_only:
                reply = await client.eval_ro(text, len(keys), *keys, *args)  # type: ignore[arg-type]
            else:
                reply = await client.eval(text, len(keys), *keys, *args)  # type: ignore[arg-type]
        except ResponseError as exc:
            if isinstance(text, str) and text.startswith(NO_WRITES) and flags_refused(exc):
                _log.info("hicache.redis.script_flags_refused", error=str(exc))
                script = client.register_script(text[len(NO_WRITES) :])
            elif read_only and scripting_refused(exc):
                scripts.refuse_read_only(exc)
            elif not tried_read_only and keys_refused(exc):
                # EVAL asks for write access to its keys: EVAL_RO, refused before, may be
                # allowed now that the user may only read them (its rights changed).
                scripts.read_only = True
            else:
                raise named_in_script(exc, text) from None
        else:
            return script, reply


async def transactions_refused(client: RedisClient, key: str | bytes) -> bool | None:
    """Whether the server refuses MULTI (an ACL without it, a proxy): True, False, or None
    when the question failed otherwise (the caller's own commands then say how).

    redis-py sends MULTI, the commands and EXEC in one write, so a refused MULTI is known
    only after the commands ran one by one: this asks with a transaction of one EXISTS,
    which changes nothing either way, before any write relies on one.
    """
    try:
        async with client.pipeline(transaction=True) as pipe:
            pipe.exists(key)
            await pipe.execute()
    except ResponseError as exc:
        return True if _REFUSED_TRANSACTION.search(str(exc).lower()) else None
    except REDIS_FAULTS:
        return None
    return False


#: Seconds after which a script refused for its keys is tried again: the user's rights may
#: have been restored.
SCRIPT_RETRY_S = 60.0

_KEYS_REFUSED = re.compile(r"no permissions to access (one of the keys|a key)")


def keys_refused(error: BaseException | str) -> bool:
    """Whether an error reply says the user may not access a key the command names (an ACL
    key pattern; for EVAL, which asks for write access to its keys, a user that may only read
    them)."""
    return bool(_KEYS_REFUSED.search(str(error).lower()))


def no_room(error: BaseException | str) -> bool:
    """Whether an error reply to a write means the server is full (maxmemory reached)."""
    return isinstance(error, OutOfMemoryError) or str(error).startswith("OOM ")


_log = structlog.get_logger("hicache_async")

_NAMESPACE = re.compile(r"[0-9a-f]{32}\Z")
#: Records a window script looks at, and the bytes of records it returns, per round trip.
_WINDOW_RECORDS = 1024
_WINDOW_BYTES = 4 << 20
#: Without scripting a window's records arrive whole, however large: fewer per round trip.
_FALLBACK_WINDOW_RECORDS = 32
#: Bytes of records per RPUSH command.
_PUSH_BYTES = 4 << 20
#: A compaction's temporary list expires on its own if the compaction dies half-way.
_TEMP_TTL_S = 3600
#: The switch script's reply when the temporary list lost records (evicted).
_TEMP_LOST = -2
#: How long the eviction policy probe may take: it only informs, and a read waits for it
#: inside warmup's deadline, so a CONFIG a proxy leaves unanswered must not cost the store's
#: whole timeout.
_EVICTION_PROBE_S = 1.0
#: Attempts of a read (or compaction) that another compaction keeps overtaking.
_ATTEMPTS = 3
#: Namespaces a read over all of them looks at.
_MAX_NAMESPACES = 4096

# Up to ARGV[3] records of [lo, hi] from hi downwards (newest first), as long as the returned
# records stay within ARGV[5] bytes (at least one); a record longer than ARGV[4] comes back as
# its length only, so nothing larger than the bound ever crosses the network. Returns
# {1, record-or-length, ...}, or {0} if `gen` is no longer ARGV[1].
_WINDOW_SCRIPT = (
    NO_WRITES
    + """
local gen = redis.call('HGET', KEYS[2], 'gen') or '0'
if gen ~= ARGV[1] then return {0} end
local hi = tonumber(ARGV[2])
local lo = math.max(0, hi - tonumber(ARGV[3]) + 1)
local items = redis.call('LRANGE', KEYS[1], lo, hi)
local max_entry = tonumber(ARGV[4])
local budget = tonumber(ARGV[5])
local out = {1}
local total = 0
for i = #items, 1, -1 do
  local n = string.len(items[i])
  if n > max_entry then
    out[#out + 1] = n
  else
    if total + n > budget and #out > 1 then break end
    out[#out + 1] = items[i]
    total = total + n
  end
end
return out
"""
)

# Replaces an index key of another type (and adds ARGV[1], if given) in one step: two
# clients repairing at once must not delete each other's new set between TYPE and DEL.
_INDEX_REPAIR_SCRIPT = """
local kind = redis.call('TYPE', KEYS[1])['ok']
local repaired = 0
if kind ~= 'set' and kind ~= 'none' then
    redis.call('DEL', KEYS[1])
    repaired = 1
end
if ARGV[1] then
    redis.call('SADD', KEYS[1], ARGV[1])
end
return repaired
"""

# An append where the server refuses MULTI: the records ARGV[3..] pushed on the list KEYS[1],
# ARGV[1] added to `bytes` of KEYS[2], both given ARGV[2] seconds to live (0: as they are).
# Returns {RPUSH reply, HINCRBY reply}, either an error reply (WRONGTYPE) as in a
# transaction, which runs the other commands all the same.
_APPEND_SCRIPT = """
local length
for i = 3, #ARGV, 1000 do
  length = redis.pcall('RPUSH', KEYS[1], unpack(ARGV, i, math.min(i + 999, #ARGV)))
  if type(length) == 'table' then break end
end
local nbytes = redis.pcall('HINCRBY', KEYS[2], 'bytes', ARGV[1])
if tonumber(ARGV[2]) > 0 then
  redis.pcall('EXPIRE', KEYS[1], ARGV[2])
  redis.pcall('EXPIRE', KEYS[2], ARGV[2])
end
return {length, nbytes}
"""

# `gen` as HINCRBY takes it: "0", or an integer without leading zeros of at most 18
# characters, so that adding one never overflows. Anything else (another client's write) is
# damage.
_SOUND_GEN = re.compile(rb"(0|-[1-9][0-9]{0,16}|[1-9][0-9]{0,17})\Z")

# Moves `gen` of the meta hash KEYS[2] on, never failing: a `gen` HINCRBY would refuse is
# reset to 0 first. A script that failed there would keep its earlier writes (Redis does not
# roll them back) with the generation unchanged, so readers could not tell the list changed.
_BUMP_GEN = """
local function bump_gen()
  local gen = redis.call('HGET', KEYS[2], 'gen')
  if gen and not ((gen == '0' or string.match(gen, '^%-?[1-9]%d*$')) and #gen <= 18) then
    redis.call('HSET', KEYS[2], 'gen', 0)
  end
  redis.call('HINCRBY', KEYS[2], 'gen', 1)
end
"""

# Compaction's switch: the records appended since the snapshot (head index ARGV[2] on) go
# after the compacted ones in the temporary list, which then replaces the manifest; all in
# one atomic step, or nothing (and the temporary list is dropped) if `gen` moved meanwhile,
# or if the temporary list no longer holds the ARGV[5] records built (a server at its
# `maxmemory` evicted it, or part of it: renaming what is left would drop the manifest).
# ARGV: expected gen, snapshot length, compacted bytes, ttl (0: none), compacted records.
# Returns the number of records carried over, -1 (gen moved) or -2 (temporary list lost).
_SWITCH_SCRIPT = (
    _BUMP_GEN
    + """
local gen = redis.call('HGET', KEYS[2], 'gen') or '0'
if gen ~= ARGV[1] then
  redis.call('DEL', KEYS[3])
  return -1
end
if redis.call('LLEN', KEYS[3]) ~= tonumber(ARGV[5]) then
  redis.call('DEL', KEYS[3])
  return -2
end
local tail = redis.call('LRANGE', KEYS[1], tonumber(ARGV[2]), -1)
local nbytes = tonumber(ARGV[3])
for i = 1, #tail, 1000 do
  redis.call('RPUSH', KEYS[3], unpack(tail, i, math.min(i + 999, #tail)))
end
for _, v in ipairs(tail) do nbytes = nbytes + string.len(v) end
if redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('RENAME', KEYS[3], KEYS[1])
  if tonumber(ARGV[4]) > 0 then
    redis.call('EXPIRE', KEYS[1], ARGV[4])
  else
    redis.call('PERSIST', KEYS[1])
  end
else
  redis.call('DEL', KEYS[1])
end
redis.call('HSET', KEYS[2], 'bytes', nbytes)
bump_gen()
if tonumber(ARGV[4]) > 0 then
  redis.call('EXPIRE', KEYS[2], ARGV[4])
end
return #tail
"""
)


# Repair: delete the list (KEYS[1]) or meta hash (KEYS[2]) where it holds another type than
# ours, in one atomic step with the check, so a list another writer repaired and appended to
# meanwhile is never taken for the damaged one. A deleted list's records are gone: the
# generation moves on. Returns the names removed.
_REPAIR_SCRIPT = (
    _BUMP_GEN
    + """
local removed = {}
local kind = redis.call('TYPE', KEYS[1]).ok
if kind ~= 'list' and kind ~= 'none' then
  redis.call('DEL', KEYS[1])
  removed[#removed + 1] = KEYS[1]
end
kind = redis.call('TYPE', KEYS[2]).ok
if kind ~= 'hash' and kind ~= 'none' then
  redis.call('DEL', KEYS[2])
  removed[#removed + 1] = KEYS[2]
elseif #removed > 0 then
  redis.call('HSET', KEYS[2], 'bytes', 0)
  bump_gen()
end
return removed
"""
)


# Trim: keep the newest ARGV[1] records of the list KEYS[1] if it holds more, and move `gen`
# of KEYS[2] on, in one atomic step. Returns 1 if it trimmed.
_TRIM_SCRIPT = (
    _BUMP_GEN
    + """
local cap = tonumber(ARGV[1])
if redis.call('LLEN', KEYS[1]) <= cap then return 0 end
redis.call('LTRIM', KEYS[1], -cap, -1)
bump_gen()
return 1
"""
)


class _Stale(Exception):
    """A compaction or trim changed the list while it was being read."""


class _Damaged(Exception):
    """A namespace's list or meta key holds another type (WRONGTYPE at every command)."""


def _wrong_type(reply: object) -> bool:
    return isinstance(reply, ResponseError) and str(reply).startswith("WRONGTYPE")


class RedisManifest:
    """A bounded, per-namespace warmup manifest in Redis lists.

    `append` pushes records in one transaction (a script where MULTI is refused); once a
    list passes `2 * max_entries` records or `max_bytes` it is compacted (after a failed
    compaction, not again until `max_entries / 2` more records were appended to it), and it
    never keeps more than `4 * max_entries` records (the oldest go first). `read` walks the
    list newest first in windows of bounded size and validates every record; `compact`
    rewrites a list atomically. Build it with `RedisStorage.manifest()`.
    """

    def __init__(
        self,
        client: Callable[[], RedisClient],
        *,
        prefix: str,
        name: str,
        ttl: int | None = None,
        scripting: bool = True,
        limits: ManifestLimits | None = None,
        scripts: ReadScripts | None = None,
        owner_pid: int | None = None,
    ) -> None:
        """`owner_pid`: the process it belongs to (default: this one), whose forked children
        it refuses, even the calls that send nothing."""
        self.limits = limits or ManifestLimits()
        self._client = client
        # What its work off the loop is gated by (see `off_loop`): the store's client, so
        # the manifests one store builds take turns, and other stores' never wait for them.
        self._owner = ("redis", client)
        self._prefix = prefix
        self._name = name
        self._ttl = ttl
        self._scripting_chosen = scripting
        # The store's connections are the parent's in a forked child, which is refused.
        self._pid = current_pid() if owner_pid is None else owner_pid
        # Shared with the store that built it: what one manifest learns about its scripts,
        # the next knows (and does not log again).
        self._scripts = scripts or ReadScripts(name)
        self._window: AsyncScript | None = None
        self._switch: AsyncScript | None = None
        self._repair_script: AsyncScript | None = None
        self._trim_script: AsyncScript | None = None
        self._append_script: AsyncScript | None = None
        self._index_repair_script: AsyncScript | None = None
        # Whether the server takes MULTI (None: not asked yet, see `_multi_allowed`).
        self._multi: bool | None = None
        # Whether the server's eviction policy was looked at (see `_check_eviction`).
        self._eviction_checked = False
        #: Compact a list that passes this many records; trim it to `_cap` records.
        self._compact_records = 2 * self.limits.max_entries
        self._cap = 4 * self.limits.max_entries
        # After an append's compaction of a namespace failed, the records still to append to
        # it before an append compacts it again: a server that stays full (or keeps evicting
        # the temporary list) fails every try, and each try reads and rewrites the list.
        self._compact_backoff: dict[str, int] = {}

    # Keys.

    def list_key(self, namespace: str) -> str:
        """The list that holds the records of `namespace`."""
        return f"{self._prefix}:manifest:{{{namespace}}}"

    def meta_key(self, namespace: str) -> str:
        """The hash with the list's record bytes and generation."""
        return f"{self.list_key(namespace)}:meta"

    @property
    def index_key(self) -> str:
        """The set of namespaces that have a manifest."""
        return f"{self._prefix}:manifest:namespaces"

    @property
    def _scripting(self) -> bool:
        """Whether to run the scripts: chosen at construction, and not refused as a command
        to any manifest of the store (or refused, and due for the retry: a step that reads
        this runs its script)."""
        return self._scripting_chosen and self._scripts.manifest_may_script()

    def _check_process(self) -> None:
        check_same_process(f"the manifest of {self._name}", self._pid)

    # The protocol.

    async def append(self, entries: Sequence[ManifestEntry]) -> None:
        """Push the records (one transaction per namespace); compact or trim past the bounds.

        A record longer than `max_entry_bytes` is not stored: every reader would skip it.
        """
        self._check_process()
        groups: dict[str, list[bytes]] = {}
        for entry in entries:
            if not _NAMESPACE.match(entry.namespace):
                raise ValueError(f"manifest entry namespace is not 32 hex digits: {entry!r}")
            line = encode_entry(entry)[:-1]
            if len(line) > self.limits.max_entry_bytes:
                _log.warning("hicache.manifest.entry_too_large", nbytes=len(line))
                continue
            groups.setdefault(entry.namespace, []).append(line)
        for namespace, lines in groups.items():
            await self._append(namespace, lines)
        if groups:
            # After a call the server answered: a silent one costs no second timeout here.
            await self._check_eviction()
        else:
            await anyio.lowlevel.checkpoint()  # nothing to send: an async call yields all the same

    async def read(self, *, namespace: str | None = None) -> ManifestRead:
        """The newest record per chain (of `namespace`, or of every namespace), bounded.

        At most `max_bytes` of records are read, newest first; `truncated` says the bound
        stopped the read. A read overtaken by a compaction starts over (a few times).
        """
        self._check_process()
        if namespace is not None and not _NAMESPACE.match(namespace):
            return ManifestRead(entries=[])
        result = await self._read(namespace)
        await self._check_eviction()
        return result

    async def _read(self, namespace: str | None) -> ManifestRead:
        if namespace is None:
            namespaces, more = await self._namespaces()
        else:
            namespaces, more = [namespace], False
        result = ManifestRead(entries=[], truncated=more)
        for _ in range(_ATTEMPTS):
            collector = ManifestCollector(self.limits, namespace, newest_first=True)
            budget = self.limits.max_bytes
            truncated = more  # namespaces past the bound were not read
            try:
                for ns in namespaces:
                    try:
                        gen, length = await self._snapshot(ns)
                    except _Damaged as exc:
                        # Another client's key (or a bug's) under this namespace's names:
                        # the other namespaces are still worth reading. The next append or
                        # compaction of this one removes the damaged key.
                        collector.malformed += 1
                        _log.warning(
                            "hicache.manifest.damaged",
                            backend=self._name,
                            namespace=ns,
                            error=str(exc),
                        )
                        continue
                    used, cut = await self._collect(ns, gen, length, collector, budget)
                    budget -= used
                    if cut or budget <= 0:
                        truncated = True
                        break
            except _Stale:
                # What was read before the list changed: partial, and said to be.
                result = await off_loop(
                    functools.partial(collector.result, truncated=True), owner=self._owner
                )
                continue
            return await off_loop(
                functools.partial(collector.result, truncated=truncated), owner=self._owner
            )
        return result

    async def compact(self) -> CompactReport:
        """Rewrite every namespace's list with its newest valid record per chain.

        Each list is replaced atomically (built under a temporary key, then renamed over
        it); records appended meanwhile are kept. A namespace that fails is logged and the
        others are still compacted; then StorageError says which failed.
        """
        self._check_process()
        total = CompactReport(0, 0, 0, 0, 0, 0)
        namespaces, _ = await self._namespaces()
        failed: list[tuple[str, StorageError]] = []
        for namespace in namespaces:
            try:
                report = await self.compact_namespace(namespace)
            except _WritesRefused:
                raise  # every namespace's would be: said once, by the error
            except StorageError as exc:
                # One namespace that fails (a damaged key, a node down) must not keep the
                # ones after it from being compacted and repaired.
                _log.warning(
                    "hicache.manifest.compact_failed",
                    backend=self._name,
                    namespace=namespace,
                    error=str(exc),
                )
                failed.append((namespace, exc))
                continue
            total = add_reports(total, report)
        await self._check_eviction()
        if failed:
            namespace, first = failed[0]
            raise StorageError(
                f"{self._name}: manifest compaction failed for {len(failed)} of "
                f"{len(namespaces)} namespaces (the others were compacted); {namespace}: {first}"
            ) from first
        return total

    async def _check_eviction(self) -> None:
        """Warn once (per manifest) if the server, once full, may evict the manifest's
        keys: a `maxmemory` with an `allkeys-*` policy, or a `volatile-*` one when the
        manifest has a TTL. Warmup then reads what is left of it. Where `CONFIG GET` is
        refused (an ACL, a managed service) or unanswered within `_EVICTION_PROBE_S`, say
        once that the policy could not be checked."""
        if self._eviction_checked:
            return
        self._eviction_checked = True
        client = self._client()
        config: Any = None
        try:
            with anyio.move_on_after(_EVICTION_PROBE_S):
                if isinstance(client, RedisCluster):
                    # Every primary: a keyless command goes to one node only, which may not
                    # be any that holds a namespace's keys.
                    config = await client.config_get(
                        "maxmemory*", target_nodes=RedisCluster.PRIMARIES
                    )
                else:
                    config = await client.config_get("maxmemory*")
        except REDIS_FAULTS as exc:
            self._eviction_unchecked(str(exc))
            return
        if not isinstance(config, dict):
            self._eviction_unchecked(f"no answer within {_EVICTION_PROBE_S:g} s")
            return
        # A cluster's reply is one settings dict per node (a single node's is not nested).
        nodes = list(config.values()) if all(isinstance(v, dict) for v in config.values()) else []
        for node in nodes or [config]:
            settings = {_text(k): _text(v) for k, v in node.items()}
            policy = settings.get("maxmemory-policy", "")
            if settings.get("maxmemory", "0") in ("", "0"):
                continue  # no limit: nothing is ever evicted
            if policy.startswith("allkeys-") or (policy.startswith("volatile-") and self._ttl):
                break
        else:
            return
        _log.warning(
            "hicache.manifest.evictable",
            backend=self._name,
            policy=policy,
            maxmemory=settings.get("maxmemory"),
            detail=(
                "a full server may evict the warmup manifest's keys, and warmup then "
                "reads only what is left; keep it on a server whose policy does not "
                "evict them (noeviction, or volatile-* with no ttl on this store)"
            ),
        )

    def _eviction_unchecked(self, error: str) -> None:
        # Info, not a warning: most servers that refuse CONFIG (managed services) do not
        # evict, but whoever wonders why no `evictable` line came learns why.
        _log.info(
            "hicache.manifest.eviction_unchecked",
            backend=self._name,
            error=error,
            detail="the server's maxmemory-policy could not be checked: if it evicts, a full "
            "server may evict the warmup manifest's keys",
        )

    # Appending.

    async def _append(self, namespace: str, lines: list[bytes]) -> None:
        client = self._client()
        key, meta = self.list_key(namespace), self.meta_key(namespace)
        batches = _batches(lines, _PUSH_BYTES)

        nbytes_added = sum(map(len, lines))

        async def push() -> list[Any]:
            if not await self._multi_allowed(namespace):
                return await self._push_scripted(key, meta, lines, len(batches))
            async with client.pipeline(transaction=True) as pipe:
                for batch in batches:
                    pipe.rpush(key, *batch)
                pipe.hincrby(meta, "bytes", nbytes_added)
                if self._ttl is not None:
                    pipe.expire(key, self._ttl)
                    pipe.expire(meta, self._ttl)
                return list(await pipe.execute(raise_on_error=False))

        try:
            results = await push()
            if any(_wrong_type(r) for r in results):
                # A key of another type under our names refuses every append until it is
                # gone. If it was the list, none of the records was stored: push again.
                await self._repair(namespace)
                if any(_wrong_type(r) for r in results[: len(batches)]):
                    results = await push()
        except REDIS_FAULTS as exc:
            raise StorageError(f"{self._name}: manifest append failed: {exc}") from exc
        # Every time, not once per process: the set may have been evicted or flushed, or
        # pruned while this list was briefly gone. Outside the push's error handling: the
        # records are stored whatever the index does, and the list must still be bounded.
        index_error = await self._add_to_index(namespace)
        # Replies: one RPUSH per batch (the last is the new length), then HINCRBY.
        length, nbytes = results[len(batches) - 1], results[len(batches)]
        if isinstance(length, ResponseError):  # the script's replies where MULTI is refused
            length = named_in_script(length, _APPEND_SCRIPT)
        if isinstance(length, Exception):
            raise StorageError(f"{self._name}: manifest append failed: {length}")
        if isinstance(nbytes, Exception):
            if not (_wrong_type(nbytes) or "not an integer" in str(nbytes)):
                if isinstance(nbytes, ResponseError):
                    nbytes = named_in_script(nbytes, _APPEND_SCRIPT)
                raise StorageError(f"{self._name}: manifest append failed: {nbytes}")
            # The meta hash was damaged (just removed) or its `bytes` is no number: the
            # records are stored, and the compaction below counts them afresh.
            nbytes = self.limits.max_bytes + 1
        waiting = self._compact_backoff.get(namespace)
        if waiting is not None:
            waiting -= len(lines)
            if waiting > 0:
                self._compact_backoff[namespace] = waiting
            else:
                del self._compact_backoff[namespace]
        if int(length) > self._compact_records or int(nbytes) > self.limits.max_bytes:
            if namespace not in self._compact_backoff:
                try:
                    await self.compact_namespace(namespace)
                except StorageError as exc:
                    self._compact_backoff[namespace] = max(1, self.limits.max_entries // 2)
                    _log.warning(
                        "hicache.manifest.compact_failed", backend=self._name, error=str(exc)
                    )
            # Bounds the list meanwhile (and where compaction cannot bring it down).
            await self._trim(namespace)
        if index_error is not None:
            raise index_error

    async def _add_to_index(self, namespace: str) -> StorageError | None:
        """Add `namespace` to the index set, replacing an index key of another type; the
        error, if that fails, for the append to raise once the list is bounded."""
        client = self._client()
        try:
            try:
                await client.sadd(self.index_key, namespace)
            except ResponseError as exc:
                if not _wrong_type(exc):
                    raise
                await self._repair_index(add=namespace)
        except REDIS_FAULTS as exc:
            return StorageError(
                f"{self._name}: manifest append stored its records but could not index "
                f"the namespace: {exc}"
            )
        return None

    async def _repair_index(self, *, add: str | None = None) -> None:
        """Delete the index key if it holds another type than a set, then add `add` to it.

        It is under our prefix, so nobody else's; left in place it fails every append,
        read and compaction for good. The namespaces it should have named come back with
        their next append. One script, so that two clients repairing at once never delete
        each other's new set; where scripting is refused, TYPE, DEL and SADD go one by one,
        and a repair racing another can lose the members that one added meanwhile (they
        come back with their next append).
        """
        client = self._client()
        if self._scripting:
            if self._index_repair_script is None:
                self._index_repair_script = client.register_script(_INDEX_REPAIR_SCRIPT)
            args: list[bytes | int] = [] if add is None else [add.encode()]
            ran, repaired = await self._run_script(
                self._index_repair_script, [self.index_key], args
            )
            if ran:
                if repaired:
                    _log.warning(
                        "hicache.manifest.repaired", backend=self._name, removed=[self.index_key]
                    )
                return
        kind = await client.type(self.index_key)
        if kind not in (b"set", b"none", "set", "none"):
            await client.delete(self.index_key)
            _log.warning("hicache.manifest.repaired", backend=self._name, removed=[self.index_key])
        if add is not None:
            await client.sadd(self.index_key, add)

    async def _push_scripted(
        self, key: str, meta: str, lines: list[bytes], nbatches: int
    ) -> list[Any]:
        """The append's transaction as a script, where the server refuses MULTI: its
        replies as the transaction's would be (one RPUSH reply per batch, then HINCRBY)."""
        if self._scripting:
            if self._append_script is None:
                self._append_script = self._client().register_script(_APPEND_SCRIPT)
            args: list[bytes | int] = [sum(map(len, lines)), self._ttl or 0, *lines]
            ran, reply = await self._run_script(self._append_script, [key, meta], args)
            if ran:
                length, nbytes = reply
                return [length] * nbatches + [nbytes]
        raise self._no_atomic_step("append")

    async def _multi_allowed(self, namespace: str) -> bool:
        """Whether a transaction can be used: asked once, before the first one (see
        `transactions_refused`), as a refused MULTI runs its commands anyway, one by one."""
        if self._multi is None:
            refused = await transactions_refused(self._client(), self.list_key(namespace))
            if refused is not None:
                self._multi = not refused
                if refused:
                    _log.warning("hicache.manifest.no_multi", backend=self._name)
        return self._multi is not False

    def _no_atomic_step(self, what: str) -> StorageError:
        return StorageError(
            f"{self._name}: manifest {what} refused: the server refuses both MULTI and "
            f"scripting, and the manifest needs one of them to change a list and its "
            f"generation together (grant +multi +exec, or +eval +evalsha +script|load)"
        )

    async def _trim(self, namespace: str) -> None:
        """Keep the newest `_cap` records if compaction could not bring the list down.

        The length check, the trim and the move of `gen` are one atomic step (a script, or
        without scripting a watched transaction): a `gen` read apart from its reset could be
        reset again after a compaction had already moved it on, back to a generation readers
        have seen.
        """
        client = self._client()
        key, meta = self.list_key(namespace), self.meta_key(namespace)
        try:
            if self._scripting:
                if self._trim_script is None:
                    self._trim_script = client.register_script(_TRIM_SCRIPT)
                ran, _ = await self._run_script(self._trim_script, [key, meta], [self._cap])
                if ran:
                    return
            if not await self._multi_allowed(namespace):
                raise self._no_atomic_step("trim")
            async with self._slot_client(namespace) as watching:
                for _ in range(_ATTEMPTS):
                    if await self._trim_watched(watching, key, meta):
                        return
        except REDIS_FAULTS as exc:
            raise StorageError(f"{self._name}: manifest trim failed: {exc}") from exc
        # Appends kept changing the list meanwhile; each append that passes the bound trims.
        _log.warning("hicache.manifest.trim_overtaken", backend=self._name, namespace=namespace)

    async def _trim_watched(self, client: Redis, key: str, meta: str) -> bool:
        """The trim without scripting: the length and `gen` read under WATCH, then LTRIM and
        the move of `gen` in MULTI/EXEC; False if a change meanwhile aborted it."""
        async with client.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(key, meta)
                if await pipe.llen(key) <= self._cap:
                    return True
                gen = await pipe.hget(meta, "gen")
                pipe.multi()  # type: ignore[no-untyped-call]
                pipe.ltrim(key, -self._cap, -1)
                _bump_gen(pipe, meta, gen)
                await pipe.execute()
            except WatchError:
                return False
        return True

    # Reading.

    async def _namespaces(self) -> tuple[list[str], bool]:
        """The namespaces in the index set whose list still exists (at most
        `_MAX_NAMESPACES`), and whether there were more.

        Members whose list has gone (expired with `ttl`, or deleted) are removed from the
        set on the way, so that dead namespaces neither grow it nor crowd out live ones.
        """
        client = self._client()
        found: set[str] = set()
        dead: list[str] = []
        more = False

        async def sort_out(batch: list[str]) -> None:
            nonlocal more
            async with client.pipeline(transaction=False) as pipe:
                for name in batch:
                    pipe.exists(self.list_key(name))
                alive = await pipe.execute()
            for name, exists in zip(batch, alive, strict=True):
                if not exists:
                    dead.append(name)
                elif len(found) < _MAX_NAMESPACES:
                    found.add(name)
                else:
                    more = True

        try:
            batch: list[str] = []
            async for member in client.sscan_iter(self.index_key, count=512):
                text = member.decode("ascii", "replace") if isinstance(member, bytes) else ""
                if not _NAMESPACE.match(text):
                    continue
                batch.append(text)
                if len(batch) >= 512:
                    await sort_out(batch)
                    batch = []
                    if more:
                        break
            if batch and not more:
                await sort_out(batch)
            if dead:
                # A list appended to since its EXISTS is put back by that append's SADD.
                await client.srem(self.index_key, *dead)
        except ResponseError as exc:
            if not _wrong_type(exc):
                raise StorageError(f"{self._name}: manifest read failed: {exc}") from exc
            # An index of another type names nothing; appends re-add their namespaces once
            # it is gone.
            try:
                await self._repair_index()
            except REDIS_FAULTS as fault:
                raise StorageError(f"{self._name}: manifest read failed: {fault}") from fault
            return [], False
        except REDIS_FAULTS as exc:
            raise StorageError(f"{self._name}: manifest read failed: {exc}") from exc
        return sorted(found), more

    async def _snapshot(self, namespace: str) -> tuple[bytes, int]:
        """The list's generation and length.

        A plain pipeline, `gen` first: a compaction or trim between the two moves `gen` on,
        which every window read and the switch check against it, so a length of the next
        generation is never used with this one. No transaction: Redis refuses to queue
        commands over `maxmemory` (warmup would read nothing from a full server), and some
        users or proxies may not run MULTI.
        """
        client = self._client()
        try:
            async with client.pipeline(transaction=False) as pipe:
                pipe.hget(self.meta_key(namespace), "gen")
                pipe.llen(self.list_key(namespace))
                gen, length = await pipe.execute(raise_on_error=False)
        except REDIS_FAULTS as exc:
            raise StorageError(f"{self._name}: manifest read failed: {exc}") from exc
        for reply in (gen, length):
            if _wrong_type(reply):
                raise _Damaged(f"{namespace}: {reply}")
            if isinstance(reply, Exception):
                raise StorageError(f"{self._name}: manifest read failed: {reply}")
        if not isinstance(length, int):
            raise StorageError(f"{self._name}: manifest read got LLEN {length!r}")
        return (gen if isinstance(gen, bytes) else b"0"), length

    async def _collect(
        self,
        namespace: str,
        gen: bytes,
        length: int,
        collector: ManifestCollector,
        budget: int,
    ) -> tuple[int, bool]:
        """Feed records [0, length) to `collector`, newest first, until `budget` bytes.

        Returns (bytes read, whether the budget stopped it). Raises `_Stale` if the list's
        generation is no longer `gen`.
        """
        hi = length - 1
        used = 0
        while hi >= 0:
            if used >= budget:
                return used, True
            # The window returns at most what is left of the budget (and one record), so
            # no more than the bound crosses the network, whatever is stored.
            room = min(_WINDOW_BYTES, budget - used)
            items = await self._window_items(namespace, gen, hi, room)
            if not items:
                # The list shrank under us without a new generation (it expired or was
                # deleted): there is nothing left to read.
                return used, False
            used += sum(item if isinstance(item, int) else len(item) for item in items)
            # Decoded on a worker thread: a window holds up to 4 MiB of records.
            await collector.feed(items, owner=self._owner)
            hi -= len(items)
        return used, False

    async def _window_items(
        self, namespace: str, gen: bytes, hi: int, room: int
    ) -> list[bytes | int]:
        """Records (newest first) of a window ending at head index `hi`, within `room`
        bytes (at least one record); the lengths of oversized ones instead of them."""
        client = self._client()
        keys = [self.list_key(namespace), self.meta_key(namespace)]
        max_entry = self.limits.max_entry_bytes
        scripts = self._scripts
        retry_at = scripts.window_retry_at
        retrying = retry_at is not None and scripts.clock() >= retry_at
        if retrying:
            # Its rights may be back: one read tries the script again, once a minute,
            # EVAL_RO first.
            scripts.window_retry_at = scripts.clock() + SCRIPT_RETRY_S
            scripts.read_only = True
        if (
            (retry_at is None or retrying)
            and self._scripting_chosen
            and scripts.manifest_may_script(writes=False)
        ):
            if self._window is None:
                self._window = client.register_script(_WINDOW_SCRIPT)
            args: list[bytes | int] = [gen, hi, _WINDOW_RECORDS, max_entry, room]
            try:
                self._window, reply = await run_read_only(
                    client, self._window, keys, args, scripts=scripts
                )
            except ResponseError as exc:
                if keys_refused(exc):
                    # EVAL asks for write access to its keys (EVAL_RO is refused too here):
                    # a user that may only read them (`%R~` in its ACL) reads plain windows.
                    # One refused the keys themselves fails on those as well.
                    first = scripts.window_retry_at is None  # of the reads refused together
                    scripts.window_retry_at = scripts.clock() + SCRIPT_RETRY_S
                    values = await self._plain_window(client, keys, gen, hi)
                    if first:
                        _log.info(
                            "hicache.manifest.read_unscripted", backend=self._name, error=str(exc)
                        )
                    return values
                if not scripting_refused(exc):
                    raise StorageError(f"{self._name}: manifest read failed: {exc}") from exc
                # Scripting refused here (disabled, a proxy): plain windows from now on.
                scripts.refuse_manifest_scripting(exc, writes=False)
            except REDIS_FAULTS as exc:
                raise StorageError(f"{self._name}: manifest read failed: {exc}") from exc
            else:
                scripts.manifest_script_ran(writes=False)
                if retrying and scripts.window_retry_at is not None:
                    scripts.window_retry_at = None
                    _log.info("hicache.manifest.read_scripted", backend=self._name)
                if not reply or reply[0] != 1:
                    raise _Stale
                return [_item(v) for v in reply[1:]]
        return await self._plain_window(client, keys, gen, hi)

    async def _plain_window(
        self, client: RedisClient, keys: list[str], gen: bytes, hi: int
    ) -> list[bytes | int]:
        """`_window_items` without scripting: fewer records per round trip."""
        max_entry = self.limits.max_entry_bytes
        lo = max(0, hi - _FALLBACK_WINDOW_RECORDS + 1)
        try:
            # The records first, then `gen`, in a plain pipeline (see `_snapshot`): `gen`
            # only moves on, so finding it unchanged after the LRANGE means the LRANGE read
            # the list of that generation.
            async with client.pipeline(transaction=False) as pipe:
                pipe.lrange(keys[0], lo, hi)
                pipe.hget(keys[1], "gen")
                values, current = await pipe.execute()
        except REDIS_FAULTS as exc:
            raise StorageError(f"{self._name}: manifest read failed: {exc}") from exc
        if (current if isinstance(current, bytes) else b"0") != gen:
            raise _Stale
        return [v if len(v) <= max_entry else len(v) for v in reversed(values)]

    # Compaction.

    async def compact_namespace(self, namespace: str) -> CompactReport:
        """Rewrite the list of one namespace atomically; see `compact`."""
        self._check_process()
        if not _NAMESPACE.match(namespace):
            raise ValueError(f"not a namespace fingerprint: {namespace!r}")
        for _ in range(_ATTEMPTS):
            try:
                gen, length = await self._snapshot(namespace)
            except _Damaged:
                await self._repair(namespace)
                continue
            collector = ManifestCollector(self.limits, namespace, newest_first=True, carry=True)
            try:
                await self._collect(namespace, gen, length, collector, self.limits.max_bytes)
            except _Stale:
                continue
            # Records as stored (fields this version does not know kept), newer versions'
            # included, within half of `max_bytes` so the list has room to grow.
            lines = await off_loop(
                functools.partial(_compacted_lines, collector, self.limits.max_bytes // 2),
                owner=self._owner,
            )
            before = await self._bytes(namespace)
            if await self._switch_to(namespace, gen, length, lines):
                self._compact_backoff.pop(namespace, None)
                return CompactReport(
                    records_before=collector.records,
                    entries_after=len(lines),
                    bytes_before=before,
                    bytes_after=sum(map(len, lines)),
                    malformed=collector.malformed,
                    oversized=collector.oversized,
                    newer=collector.newer,
                )
        raise StorageError(
            f"{self._name}: manifest compaction of {namespace} kept being overtaken by others"
        )

    async def _bytes(self, namespace: str) -> int:
        try:
            value = await self._client().hget(self.meta_key(namespace), "bytes")
        except REDIS_FAULTS as exc:
            raise StorageError(f"{self._name}: manifest read failed: {exc}") from exc
        try:
            return int(value) if value is not None else 0
        except ValueError:
            # Not a number (another client wrote it): it is only the report's "before"
            # figure and the trigger for compaction, and the compaction that asked for it
            # writes it afresh, so the manifest stays usable.
            return 0

    async def _repair(self, namespace: str) -> None:
        """Delete the namespace's list or meta key where it holds another type than ours.

        Both are under our prefix and the namespace's hash tag, so nobody else's: left in
        place, such a key fails every append and compaction of the namespace for good.
        Records in a deleted list are lost (they could not be read); a new generation tells
        readers the list changed.
        """
        client = self._client()
        key, meta = self.list_key(namespace), self.meta_key(namespace)
        try:
            wrong: list[str] | None = None
            if self._scripting:
                if self._repair_script is None:
                    self._repair_script = client.register_script(_REPAIR_SCRIPT)
                ran, removed = await self._run_script(self._repair_script, [key, meta], [])
                if ran:
                    wrong = [n.decode() if isinstance(n, bytes) else str(n) for n in removed]
            if wrong is None:
                if not await self._multi_allowed(namespace):
                    raise self._no_atomic_step("repair")
                async with self._slot_client(namespace) as watching:
                    wrong = await self._repair_unscripted(watching, key, meta)
        except REDIS_FAULTS as exc:
            raise StorageError(f"{self._name}: manifest repair failed: {exc}") from exc
        if wrong:
            _log.warning(
                "hicache.manifest.repaired", backend=self._name, namespace=namespace, removed=wrong
            )

    async def _run_script(
        self, script: AsyncScript, keys: list[str], args: list[bytes | int]
    ) -> tuple[bool, Any]:
        """(True, its reply), or (False, None) once scripting is refused here (disabled, a
        proxy, an ACL): logged, and the plain commands are used until the retry."""
        try:
            reply = await script(keys=keys, args=args)
        except ResponseError as exc:
            if not scripting_refused(exc):
                raise named_in_script(exc, script.script) from None
            self._scripts.refuse_manifest_scripting(exc, writes=True)
            return False, None
        self._scripts.manifest_script_ran(writes=True)
        return True, reply

    async def _repair_unscripted(self, client: Redis, key: str, meta: str) -> list[str]:
        """The repair without scripting: check the types (and read `gen`) under WATCH, then
        delete in MULTI/EXEC, so that a key changed meanwhile aborts it (it is then left for
        the next repair). `client` is one whose pipelines can watch (`_slot_client`)."""
        async with client.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(key, meta)
                kinds = [await pipe.type(key), await pipe.type(meta)]
                wrong = [
                    name
                    for name, kind, ours in ((key, kinds[0], b"list"), (meta, kinds[1], b"hash"))
                    if kind not in (ours, b"none", ours.decode(), "none")
                ]
                if not wrong:
                    return []
                gen = None
                if meta not in wrong:
                    gen = await pipe.hget(meta, "gen")
                pipe.multi()  # type: ignore[no-untyped-call]
                pipe.delete(*wrong)
                if meta not in wrong:
                    pipe.hset(meta, "bytes", 0)
                    _bump_gen(pipe, meta, gen)
                await pipe.execute()
            except WatchError:
                return []
        return wrong

    async def _switch_to(self, namespace: str, gen: bytes, length: int, lines: list[bytes]) -> bool:
        """Build the compacted list under a temporary key and switch to it atomically.

        False if a compaction or trim moved the generation meanwhile (nothing changed then).
        """
        client = self._client()
        key, meta = self.list_key(namespace), self.meta_key(namespace)
        temp = f"{key}:compacting:{os.urandom(8).hex()}"
        nbytes = sum(map(len, lines))
        pushed = False
        try:
            for batch in _batches(lines, _PUSH_BYTES):
                async with client.pipeline(transaction=False) as pipe:
                    pipe.rpush(temp, *batch)
                    pipe.expire(temp, _TEMP_TTL_S)
                    await pipe.execute()
                pushed = True
            if self._scripting:
                if self._switch is None:
                    self._switch = client.register_script(_SWITCH_SCRIPT)
                args: list[bytes | int] = [gen, length, nbytes, self._ttl or 0, len(lines)]
                ran, carried = await self._run_script(self._switch, [key, meta, temp], args)
                if ran:
                    if int(carried) == _TEMP_LOST:
                        raise self._temp_lost(namespace)
                    return int(carried) >= 0
            if not await self._multi_allowed(namespace):
                await _forget(client, temp)
                raise self._no_atomic_step("compaction")
            switched = await self._switch_watched(
                namespace, gen, length, temp, nbytes, records=len(lines)
            )
        except ReadOnlyError as exc:
            if pushed:  # the server became a replica meanwhile: its temporary list expires
                await _forget(client, temp)
                raise StorageError(f"{self._name}: manifest compaction failed: {exc}") from exc
            # A read-only replica wrote nothing, and would refuse the delete as well.
            raise _WritesRefused(
                f"{self._name}: manifest compaction refused: the server refused the write "
                f"(READONLY: a read-only replica; compact on its primary)"
            ) from exc
        except REDIS_FAULTS as exc:
            await _forget(client, temp)
            raise StorageError(f"{self._name}: manifest compaction failed: {exc}") from exc
        if switched is None:
            raise self._temp_lost(namespace)
        return switched

    def _temp_lost(self, namespace: str) -> StorageError:
        return StorageError(
            f"{self._name}: manifest compaction of {namespace} lost its temporary list before "
            f"the switch (the server evicted it at its maxmemory; keep manifests on a server "
            f"whose maxmemory-policy does not evict them): the manifest was left as it was"
        )

    async def _switch_watched(
        self, namespace: str, gen: bytes, length: int, temp: str, nbytes: int, *, records: int
    ) -> bool | None:
        """The switch without scripting: WATCH, then RENAME in MULTI/EXEC.

        Any change to the list since the snapshot (an append included) aborts it; the
        caller retries, and the trim bounds the list if appends keep winning. None if the
        temporary list no longer holds its `records` records (evicted): nothing changed.
        """
        async with self._slot_client(namespace) as client:
            return await self._switch_watched_on(
                client,
                namespace,
                gen=gen,
                length=length,
                temp=temp,
                nbytes=nbytes,
                records=records,
            )

    @contextlib.asynccontextmanager
    async def _slot_client(self, namespace: str) -> AsyncIterator[Redis]:
        """A client whose pipelines can WATCH the namespace's keys: the store's own on a
        standalone server. redis-py's cluster pipeline runs each command between WATCH and
        MULTI in a thread of its own that the event loop waits for, blocked; the namespace's
        keys share one slot, so on a cluster this is a client of plain connections to that
        slot's node (two: the watching one, and one for what is asked beside it)."""
        client = self._client()
        if not isinstance(client, RedisCluster):
            yield client
            return
        node = client.get_node_from_key(self.list_key(namespace))
        if node is None:
            raise RedisClusterException(f"no node serves the slot of {namespace}")
        pool = ConnectionPool(
            connection_class=node.connection_class, max_connections=2, **node.connection_kwargs
        )
        standalone = Redis(connection_pool=pool)
        try:
            yield standalone
        finally:
            with contextlib.suppress(*REDIS_FAULTS, OSError):
                await standalone.aclose()
            await pool.aclose()

    async def _switch_watched_on(
        self,
        client: Redis,
        namespace: str,
        *,
        gen: bytes,
        length: int,
        temp: str,
        nbytes: int,
        records: int,
    ) -> bool | None:
        key, meta = self.list_key(namespace), self.meta_key(namespace)
        async with client.pipeline(transaction=True) as pipe:
            try:
                # The temporary list too: an eviction of it after its check aborts the EXEC.
                await pipe.watch(key, meta, temp)
                current = await pipe.hget(meta, "gen")
                if (current or b"0") != gen or await pipe.llen(key) != length:
                    await _forget(client, temp)
                    return False
                if await pipe.llen(temp) != records:
                    await _forget(client, temp)
                    return None
                has_records = records > 0
                pipe.multi()  # type: ignore[no-untyped-call]
                if has_records:
                    # As a raw command: redis-py's cluster pipeline refuses its rename()
                    # outright, though both keys share the namespace's slot.
                    pipe.execute_command("RENAME", temp, key)
                    if self._ttl is not None:
                        pipe.expire(key, self._ttl)
                    else:
                        pipe.persist(key)
                else:
                    pipe.delete(key)
                pipe.hset(meta, "bytes", nbytes)
                _bump_gen(pipe, meta, current)
                if self._ttl is not None:
                    # Refreshed with the list: a meta hash that expired first would reset the
                    # generation readers compare against.
                    pipe.expire(meta, self._ttl)
                await pipe.execute()
            except WatchError:
                await _forget(client, temp)
                return False
        return True


class _WritesRefused(StorageError):
    """The server refuses every write (a read-only replica): so would it for every
    namespace."""


def _bump_gen(pipe: Any, meta: str, gen: object) -> None:
    """Queue the move of `gen` on (as the scripts' `bump_gen`): reset to 0 first when it
    holds what HINCRBY refuses, which would fail that command only, after the list had
    changed, with the generation left where it was."""
    if isinstance(gen, bytes) and not _SOUND_GEN.match(gen):
        pipe.hset(meta, "gen", 0)
    pipe.hincrby(meta, "gen", 1)


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _item(value: Any) -> bytes | int:
    return value if isinstance(value, bytes) else int(value)


def _compacted_lines(collector: ManifestCollector, budget: int) -> list[bytes]:
    """The records a compaction keeps, as stored."""
    return [line for _, line in collector.compacted(budget)]


def _batches(lines: list[bytes], max_bytes: int) -> list[list[bytes]]:
    """Consecutive groups of at most `max_bytes` (at least one line each)."""
    batches: list[list[bytes]] = []
    current: list[bytes] = []
    size = 0
    for line in lines:
        if current and size + len(line) > max_bytes:
            batches.append(current)
            current, size = [], 0
        current.append(line)
        size += len(line)
    if current:
        batches.append(current)
    return batches


async def _forget(client: RedisClient, key: str) -> None:
    """Drop a temporary list; it expires on its own if even this fails."""
    try:
        await client.delete(key)
    except REDIS_FAULTS:
        _log.warning("hicache.manifest.temp_left", key=key)
