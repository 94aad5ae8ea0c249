"""FileStorage: one file per page under a private root directory, the embedded default backend.

Layout under the root (directories 0700, files 0600):

    LOCK             flock: exclusive for a private root, shared for `shared=True` instances
    pages/ab/<hex>   a page, `header ‖ payload`, named by its key's 64 hex digits
    tmp/             writes in progress, renamed into pages/ when complete, and spare files

The root must be a directory owned by this user and not world-writable, and not itself a
symlink (directories above it may be); it and everything below it are opened relative to
directory descriptors with O_NOFOLLOW, so a symlink planted in or for the root is never
followed. pages/, tmp/ and each shard directory must be owned by this user and not
world-writable; a shard directory that is not is refused until the next open (its pages are
misses, writes into it fail). A write goes to a fresh
O_EXCL temporary file and is renamed into place, so a page file is either absent or whole; after
a crash without fsync the rename may survive while the data does not, which the page checksum
catches (the page is then corrupt and removed, never served with wrong bytes).

Removed pages (deleted or evicted) are kept as spare files in tmp/, up to `spare_bytes`, and the
next write of the same size goes over one instead of into a new file: the kernel then copies
into blocks and page-cache pages that exist already, which costs it less than allocating them
and pays for the checksum (docs/storage.md). Spare files are never read; they are removed at
close, by `gc()` and when a write finds the disk full, and by the next open or `verify()` if
the process died.

A write the file system has no room for (ENOSPC, EDQUOT) is tried once more in the same put,
after the spare files are released and least recently used pages evicted for what statvfs()
shows is short (bytes or inodes; nothing for a page no eviction could make room for); one that
still finds none, or that the file system refuses for good (EROFS, EFBIG, EACCES), is a MISS,
not an ERROR that a caller would retry (`refused_writes` counts them). A batch logs each
distinct page error once, with how many pages had it.

An in-memory index (key -> size, last access, in LRU order) answers `exists` without a system
call and drives eviction. It is built by scanning the root when the storage opens, in the order
of the files' mtimes, which every use the index counts reaches: a put writes its files with
mtimes that fall from its first key to its last, as the index orders them, and a `get` hit, an
`exists` that finds a page and a put of a page stored already set its file's mtime (falling
likewise within the call) when it is a second or more old. A get, or a put that writes, does it
in its own job; an `exists`, which makes no system call, queues it for a task that it does not
wait for (as does a put that writes nothing), and a close writes out what is still queued. So
recency survives a reopen to within a second (nothing else takes a page's mtime for its write
time). Reads and scans commit what they saw only for keys no put, delete or eviction changed
meanwhile (`_watch`, `_stale`). With
`shared=True` several instances use one root: keys missing from the index are looked up on disk,
pages another instance deleted read as misses, and capacity is enforced over what this instance
knows of (`gc()` rescans the whole root), pages its lookups found included (`_trim_later`).

Each batch is one job on a worker thread (one hand-off); the job spreads its pages over up to
`io_threads` threads and moves bytes with `preadv`/`pwritev` between the files and the caller's
segments, hashing them on the way (`_native`): a read goes through a small buffer that stays in
the CPU cache, a write hashes each piece just before the kernel copies it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import fcntl
import functools
import heapq
import itertools
import math
import os
import secrets
import shlex
import stat
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Iterator, Sequence
from itertools import islice
from pathlib import Path
from typing import Literal, NamedTuple, TypeVar, cast, get_args
from urllib.parse import unquote

import anyio.lowlevel
import msgspec
import numpy as np

from .. import _native
from .._errors import StorageConfigError, StorageError
from .._forks import current_pid, forked_error
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
    fan_out,
    log,
    parse_bool,
    parse_int,
    parse_query,
    parse_size,
    payload_nbytes,
    split_url,
)
from ._flocks import close_lock_fd, open_lock_fd
from ._maintenance import GcReport, PageInfo, VerifyReport
from ._manifest import FileManifest, ManifestLimits, remove_dead_compactions
from ._page import (
    HEADER_NBYTES,
    PageCheck,
    PageHeader,
    PayloadVerifier,
    decode_header,
    encode_header,
    verify_payload,
)
from ._protocol import Outcome, PageBuffer, PageMeta, StorageCapabilities, StorageStats

__all__ = ["FileStorage", "FileStorageStats", "FsyncPolicy", "default_root"]

FsyncPolicy = Literal["none", "data", "always"]


#: What `FileStorage.stats()` answers: `StorageStats`, whose `refused_writes` every backend
#: carries (a subclass of its own would decode from a snapshot's JSON as `StorageStats`).
FileStorageStats = StorageStats


_T = TypeVar("_T")
_PAGES = "pages"
_TMP = "tmp"
_LOCK = "LOCK"
_TMP_SUFFIX = ".tmp"
_DIR_MODE = 0o700
_FILE_MODE = 0o600
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: Corrupt page files that could not be removed, remembered so as not to be read again.
_STUCK_MAX = 1024
# While a root's directory is not writable, write jobs ask whether it has become so at most
# this often (`FileStorage._look_due`).
_LOOK_AGAIN_S = 1.0
# A page file a policy refused to open (see `_PolicyRefused`) is a quiet miss this long.
_POLICY_RETRY_S = 60.0
# O_NONBLOCK: a FIFO planted in the root must not block the open.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# A spare file is written over: it must exist, and nothing planted in its place may block.
_REWRITE_FLAGS = os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_SPARE_SUFFIX = ".spare"
_SPARE_DEFAULT = 1 << 30
_HEX = frozenset("0123456789abcdef")
_KEY_HEX_LEN = 64
# Write granularity of large pages: each piece is hashed just before its copy, while it is
# still in cache; larger pieces mean fewer system calls, which cost microseconds each in a VM.
_CHUNK = 1 << 20
# Past this length a page file is checked for holes before it is read (see `_has_holes`).
_SPARSE_CHECK_NBYTES = 64 << 20
# Pages up to this size are hashed whole and written with their header in one call.
_ONE_WRITE_MAX = 1 << 20
# Below this a batch stays on its one job thread: helpers cost more than they save.
_FANOUT_MIN_BYTES = 2 << 20
_IOV_MAX = 1024
# A temporary file this long untouched is a leftover. In a shared root other instances may be
# writing theirs (even at open); in a private one only our own puts, and only after open.
_STALE_TMP_SHARED_S = 600.0
_STALE_TMP_PRIVATE_S = 60.0
# A use sets the page file's mtime to now (its last use, which orders eviction after a reopen)
# when it is at least this old: a hot page costs no extra system call on every use.
_TOUCH_AFTER_S = 1.0
_TOUCH_AFTER_NS = int(_TOUCH_AFTER_S * 1e9)
# The files one call stamps get mtimes this far apart, falling from its first key to its last,
# so a reopen orders them as the index did (a chain's deepest page oldest). A microsecond, not
# a nanosecond: a float st_mtime still tells them apart (its step is under half of one until
# 2106), and so do file systems that keep mtimes to 100 ns.
_STAMP_STEP_NS = 1_000
# A full disk that the second try of puts keeps making room on logs storage.disk.full at most
# this often: on a disk that stays full some puts find room all the time, so that restarts
# nothing.
_DISK_FULL_LOG_S = 60.0
# A page is planned one block and this fraction of its size more than its own blocks.
_DISK_SLACK_RATIO = 64
# And a second try this many blocks more, once, for directories that grow.
_DISK_GROWTH_BLOCKS = 2
# Changes recorded for reads and scans in flight are pruned when they outgrow this (or twice
# what the previous prune kept).
_CHANGES_PRUNE_MIN = 4096

_URL_PARAMS = {
    "capacity": "byte size, e.g. 10GiB",
    "fsync": "none | data | always",
    "shared": "1 if several instances share the root",
    "io_threads": "threads per batch, >= 1",
    "spare": "byte size of removed page files kept for reuse, e.g. 1GiB (0: none)",
}


def default_root() -> Path:
    """`$XDG_CACHE_HOME/hicache_async`, else `~/.cache/hicache_async` (never a shared temp dir)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "hicache_async"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _root_path(root: object) -> Path:
    """The configured root as an absolute path (`default_root()` for None), checked for what
    no directory name can hold."""
    if root is None:
        return default_root()
    try:
        text = os.fspath(root)  # type: ignore[call-overload]
    except TypeError:
        text = None
    if not isinstance(text, str):
        raise StorageConfigError(
            f"a storage root is a str or os.PathLike path, or None for the default root; "
            f"got {type(root).__name__}"
        )
    if not text or "\0" in text:
        raise StorageConfigError(
            f"storage root {text!r} is not a usable path: accepted: a non-empty path without "
            "NUL bytes"
        )
    return Path(os.path.abspath(text))


class _Entry(msgspec.Struct, gc=False):
    """One indexed page; `seq` orders insertions so a rescan can tell stale entries from new,
    and `mtime` is its file's mtime as this instance last saw, set or queued it: a use that
    finds it `_TOUCH_AFTER_S` old stamps the file again.

    Untracked by the garbage collector (it holds numbers only): a store of a million pages
    would otherwise add a million objects to every full collection, a second or more of
    the loop's time each.
    """

    nbytes: int
    last_access: float
    seq: int
    mtime: float


class _RefusedShardError(OSError):
    """A shard directory owned by someone else or world-writable: never used."""


class _Handles:
    """Directory descriptors of an open root. Shard directories are opened on first use,
    checked like pages/ and tmp/; one that fails the check is refused until the next open."""

    def __init__(
        self,
        root_fd: int,
        pages_fd: int,
        tmp_fd: int,
        lock_fd: int,
        pages_path: Path,
        *,
        shared: bool,
        root_id: tuple[int, int],
    ) -> None:
        self.root_fd = root_fd
        # The root directory's (st_dev, st_ino): what its path must still name.
        self.root_id = root_id
        self.pages_fd = pages_fd
        self.tmp_fd = tmp_fd
        self.lock_fd = lock_fd
        self._pages_path = pages_path
        self._shared = shared
        # Jobs begun on this root so far (`FileStorage.run_job` counts them on the loop).
        self.jobs_begun = 0
        # Descriptors of directories removed (`remove_empty`), or removed under us and made
        # again (`renew_tmp`, `renew_shard`), each with `jobs_begun` when it was retired: a
        # job begun before may still hold it, one begun after never takes it.
        self._retired: list[tuple[int, int]] = []
        # Why tmp/ or pages/ could not be made again, logged once per reason.
        self._dir_refused: dict[str, str] = {}
        self._lock_lost = False  # logged once
        # Shards a scan could not list, and why: logged once until listed again, made again
        # or a page of theirs is read, so that the open's scan and the verify() or gc() after
        # it do not both log the same shard, while one fixed and broken again is logged again.
        self.unreadable: dict[str, str] = {}
        # Why tmp/ could not be listed, logged once until it is listed again or made again.
        self.tmp_unlisted: str | None = None
        self._shards: dict[str, int] = {}
        self._refused: dict[str, str] = {}
        # Shards `remove_empty` took away and no write has made again: a write that finds
        # one gone makes it again without the warning a removal by someone else is worth.
        self._emptied: set[str] = set()
        self._lock = threading.Lock()
        _OPEN_ROOTS.add(self)

    def read_from(self, name: str, shard_fd: int) -> None:
        """A page file of shard `name` (open as `shard_fd`) was opened: a scan that fails to
        list it again meets a new failure, logged again (once, not per page: the shard is
        forgotten once)."""
        if self.unreadable and name in self.unreadable:  # one check per page otherwise
            # A shard its owner may search but not read (chmod u-r) opens its pages and
            # still cannot be listed: such a read shows nothing was fixed.
            with contextlib.suppress(OSError):
                if os.fstat(shard_fd).st_mode & stat.S_IRUSR:
                    self.unreadable.pop(name, None)

    def shard(self, name: str, *, create: bool, durable: bool = False) -> int | None:
        """The descriptor of `pages/<name>`, or None when it does not exist and create is off.
        Raises _RefusedShardError for a directory that fails the ownership and mode checks."""
        fd = self._shards.get(name)
        if fd is not None:
            return fd
        with self._lock:
            return self._shard_locked(name, create=create, durable=durable)

    def _shard_locked(self, name: str, *, create: bool, durable: bool) -> int | None:
        fd = self._shards.get(name)
        if fd is not None:
            return fd
        refused = self._refused.get(name)
        if refused is not None:
            raise _RefusedShardError(errno.EPERM, refused)
        if create:
            try:
                self._make_shard(name, durable=durable)
            except FileNotFoundError:
                # pages/ itself was removed under us (someone emptied the root).
                if not self._renew_pages_locked(self.pages_fd):
                    raise
                self._make_shard(name, durable=durable)
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=self.pages_fd)
        except FileNotFoundError:
            return None
        try:
            _check_private_dir(
                fd,
                f"shard directory {self._pages_path / name}",
                fix=f"{_private_fix(self._pages_path)}, then open the store again",
            )
        except StorageConfigError as exc:
            os.close(fd)
            # Whoever else can write there could plant or swap pages: its pages are misses
            # and writes into it fail, logged once.
            self._refused[name] = str(exc)
            log.warning(
                "storage.shard.refused", directory=str(self._pages_path / name), error=str(exc)
            )
            raise _RefusedShardError(errno.EPERM, str(exc)) from None
        self._shards[name] = fd
        return fd

    def _make_shard(self, name: str, *, durable: bool) -> None:
        try:
            os.mkdir(name, _DIR_MODE, dir_fd=self.pages_fd)
        except FileExistsError:
            return
        self._emptied.discard(name)
        # Another directory than one a scan could not list: its failure is news.
        self.unreadable.pop(name, None)
        if durable:
            os.fsync(self.pages_fd)

    def renew_shard(
        self,
        name: str,
        seen_fd: int,
        *,
        durable: bool,
        then: Callable[[int], object] | None = None,
    ) -> int | None:
        """After a call in `pages/<name>` through `seen_fd` failed with ENOENT: if that
        directory was removed under us (and pages/ with it, perhaps), make it again and return
        its descriptor; None when it was not removed or cannot be made again, except that the
        OSError of making it again is raised (no room, no inode left: the caller's write
        failed for that, not for the ENOENT it met, and is then a MISS). `then`, given
        the descriptor, runs before `remove_empty` can take the directory away again (a
        rename into it: the directory is not empty after it)."""
        with self._lock:
            current = self._shards.get(name)
            if current is not None and current != seen_fd:
                if then is not None:
                    then(current)
                return current  # another thread renewed it
            if current is not None:
                if os.fstat(seen_fd).st_nlink:
                    return None
                del self._shards[name]
                self._retire(seen_fd)
            if not os.fstat(self.pages_fd).st_nlink and not self._renew_pages_locked(self.pages_fd):
                return None
            # Whoever removed it may have removed LOCK too (see `_remade_locked`).
            if not self._hold_lock_locked():
                return None
            emptied = name in self._emptied
            fd = self._shard_locked(name, create=True, durable=durable)
            if fd is not None and then is not None:
                then(fd)
        if not emptied:
            log.warning("storage.shard.recreated", directory=str(self._pages_path / name))
        return fd

    def remove_empty(self, names: Iterable[str]) -> int:
        """Remove the shard directories `names` that are empty, closing this instance's way
        into them first (the descriptor is retired: a thread may still hold it); how many went.
        One that is not empty now (a write landed since it was listed) stays, as it was. A
        write that then finds its directory gone makes it again (`renew_shard`). Only for a
        private root: other instances would go on using descriptors of the removed ones."""
        removed = 0
        with self._lock:
            for name in names:
                if name in self._refused:
                    continue
                fd = self._shards.pop(name, None)
                try:
                    os.rmdir(name, dir_fd=self.pages_fd)
                except FileNotFoundError:
                    pass  # gone already (with pages/, perhaps)
                except OSError:
                    # Not empty (ENOTEMPTY or EEXIST), or not to be removed: it stays open.
                    if fd is not None:
                        self._shards[name] = fd
                    continue
                else:
                    removed += 1
                    self._emptied.add(name)
                if fd is not None:
                    self._retire(fd)
        return removed

    def _retire(self, fd: int) -> None:
        self._retired.append((fd, self.jobs_begun))

    def _renew_pages_locked(self, seen_fd: int) -> bool:
        if self.pages_fd != seen_fd:
            return True  # another thread renewed it
        fd = self._remade_locked(seen_fd, _PAGES)
        if fd is None:
            return False
        # Every shard directory went with it.
        for shard_fd in self._shards.values():
            self._retire(shard_fd)
        self._shards.clear()
        self._refused.clear()
        self.pages_fd = fd
        return True

    def _remade_locked(self, seen_fd: int, name: str) -> int | None:
        """A new descriptor of the root's directory `name` (pages/ or tmp/) if `seen_fd`, its
        old one, shows it removed, made again and checked as at open; None when it was not
        removed or what is there now fails those checks (logged once per reason)."""
        if os.fstat(seen_fd).st_nlink:
            return None
        # Whoever removed it may have removed LOCK with it, and another instance may have
        # taken the root since: then this one must not write into it.
        if not self._hold_lock_locked():
            return None
        what = f"storage directory {self._pages_path.parent / name}"
        try:
            fix = _private_fix(self._pages_path, self._pages_path.parent / _TMP)
            fd = _open_private_dir(self.root_fd, name, what, fix=fix)
        except OSError:  # out of descriptors: the next write tries again
            return None
        except StorageConfigError as exc:
            if str(exc) != self._dir_refused.get(name):  # not again at every write
                self._dir_refused[name] = str(exc)
                log.warning(f"storage.{name}.refused", directory=what, error=str(exc))
            return None
        self._dir_refused.pop(name, None)
        self._retire(seen_fd)
        log.warning(f"storage.{name}.recreated", directory=what)
        return fd

    def _hold_lock_locked(self) -> bool:
        """Whether this instance still holds the root's `LOCK`, taking it again if it was
        removed or replaced; False for good once another instance holds it (logged once)."""
        if self._lock_lost:
            return False
        if self.lock_fd < 0:  # a forked child's copy: it never owned the root
            return False
        mine = os.fstat(self.lock_fd)
        try:
            st = os.stat(_LOCK, dir_fd=self.root_fd, follow_symlinks=False)
        except OSError:
            st = None
        if st is not None and (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
            return True
        root = self._pages_path.parent
        if not os.fstat(self.root_fd).st_nlink:
            # The root itself was removed (rm -rf): nothing can be made in it again, and
            # the lock's open would fail with an error that names LOCK, not the root.
            self._lock_lost = True
            log.error(
                "storage.lock.lost",
                root=str(root),
                error=f"the storage root {root} was removed while the store was open; its "
                "writes fail until it is reopened",
            )
            return False
        try:
            fd = _take_lock(self.root_fd, root, shared=self._shared)
        except OSError:  # out of descriptors: not lost, the next write tries again
            return False
        except StorageConfigError as exc:
            self._lock_lost = True
            log.error("storage.lock.lost", root=str(root), error=str(exc))
            return False
        old, self.lock_fd = self.lock_fd, fd
        close_lock_fd(old)
        log.warning("storage.lock.recreated", root=str(root))
        return True

    def opened(self, name: str) -> bool:
        """Whether the shard directory `name` is open (so exists: a write into it makes no
        directory)."""
        return name in self._shards

    @property
    def has_retired(self) -> bool:
        return bool(self._retired)

    def reap_retired(self, oldest: int) -> None:
        """Close the descriptors of removed directories that no running job can hold: those
        retired once every job begun before is done. `oldest` is the number (in
        `jobs_begun` order) of the oldest job still running, `jobs_begun` when none runs. A
        job begun before may be between taking one and using it, and a closed number can be
        reused for another file at once; a job begun after finds it nowhere, so busy stores
        whose jobs overlap for ever still close them."""
        with self._lock:
            retired = [fd for fd, begun in self._retired if begun <= oldest]
            self._retired = [item for item in self._retired if item[1] > oldest]
        for fd in retired:
            with contextlib.suppress(OSError):
                os.close(fd)

    def renew_tmp(self, seen_fd: int) -> bool:
        """After a call in tmp/ through `seen_fd` failed with ENOENT: if that directory was
        removed (someone deleted tmp/ under a running instance), create and open it again,
        checked as at open, and return True; False when it was not removed or cannot be
        reopened safely (logged)."""
        with self._lock:
            if self.tmp_fd != seen_fd:
                return True  # another thread renewed it
            fd = self._remade_locked(seen_fd, _TMP)
            if fd is None:
                return False
            self.tmp_fd = fd
            # Another directory: its failure to list is news, as a shard's found gone is.
            self.tmp_unlisted = None
        return True

    def close(self) -> None:
        _OPEN_ROOTS.discard(self)
        retired = [fd for fd, _ in self._retired]
        fds = (*self._shards.values(), *retired, self.tmp_fd, self.pages_fd, self.root_fd)
        for fd in fds:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        if self.lock_fd >= 0:
            with contextlib.suppress(OSError):
                close_lock_fd(self.lock_fd)
        self._shards.clear()


_OPEN_ROOTS: weakref.WeakSet[_Handles] = weakref.WeakSet()


def _drop_inherited_locks() -> None:
    """In a forked child: forget the lock descriptors it inherited, which `_flocks` closes
    there (a flock belongs to the open file, so the child's copies would keep a root locked
    after the parent closed it); a close of the child's copy of the store leaves the numbers
    alone, which the child may have reused."""
    for handles in list(_OPEN_ROOTS):
        handles.lock_fd = -1


os.register_at_fork(after_in_child=_drop_inherited_locks)


#: (key, stored bytes, mtime) of a page file found on disk.
_Found = tuple[bytes, int, float]
# Pages the index build at open handles per call that holds the GIL throughout (making
# their positions, freeing them): a few milliseconds each.
_BUILD_SLICE = 1 << 15
# Index entries one step on the loop handles before it lets other tasks run (a merge of a
# rescan, an eviction round, a listing's pages): a few milliseconds each.
_LOOP_SLICE = 1 << 12
# What a rescan changed: the keys indexed when it started that it did not find, and the pages
# it found that were not indexed then, oldest first.
_ScanDiff = tuple[list[bytes], list[_Found]]


def _diff_scan(
    found: list[_Found], indexed: list[bytes], unlisted: Collection[str] = ()
) -> _ScanDiff:
    """Compared off the loop: for a million pages the comparison took the loop a second.
    Indexed keys of the shards in `unlisted` (ones the scan could not list) are not gone:
    the scan did not see their files, which are most likely still there. Empties `found`.

    Runs on a job thread while the loop serves, so no call here holds the GIL over every
    page: a set of a million keys made in one call, their difference, a sort, each held it
    for 0.1-0.5 s. Pages are walked in Python (which lets go of the GIL between steps), the
    keys go into one set per first byte (a set of them all grows in calls of 50 ms), lists
    are made a slice at a time, and the new pages are ordered by numpy's sort, which lets go
    of it: by mtime, ties in listing order."""
    # Indexed keys whose file the scan has not found (yet), by their first byte.
    missing: list[set[bytes]] = [set() for _ in range(256)]
    for key in indexed:
        missing[key[0]].add(key)

    def unindexed() -> Iterator[bool]:
        for key, _, _ in found:
            keys = missing[key[0]]
            if key in keys:
                keys.discard(key)
                yield False
            else:
                yield True

    is_new = np.fromiter(unindexed(), dtype=np.bool_, count=len(found))
    mtimes = np.fromiter((f[2] for f in found), dtype=np.float64, count=len(found))
    positions = np.flatnonzero(is_new)
    order = positions[np.argsort(mtimes[positions], kind="stable")]
    del is_new, mtimes, positions
    new: list[_Found] = []
    for start in range(0, len(order), _BUILD_SLICE):
        new.extend([found[position] for position in order[start : start + _BUILD_SLICE].tolist()])
    del order
    gone = [
        key
        for key in indexed
        if key in missing[key[0]] and (not unlisted or key.hex()[:2] not in unlisted)
    ]
    # Freed a slice at a time: a million tuples take ~0.1 s to free in one call.
    while found:
        del found[-_BUILD_SLICE:]
    return gone, new


# Per-page results a worker thread records for the loop to commit.
_OK = "ok"
_MISS = "miss"
_UNSUPPORTED = "unsupported"
_CORRUPT = "corrupt"
_ERROR = "error"
_EXISTS = "exists"
# verify(): a corrupt page that could not be removed, left unchecked and out of the index.
_STUCK = "stuck"
# A write the file system refused: no room (ENOSPC, EDQUOT), retried once after room is made,
# or refused for good (EROFS, EFBIG; EACCES: a root whose directories this user may not
# write, made read-only by its mode). Either is a MISS, never an ERROR to retry.
_NO_ROOM = "no room"
_REFUSED = "refused"
_NO_ROOM_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_REFUSED_ERRNOS = frozenset({errno.EROFS, errno.EFBIG, errno.EACCES})


# A quota that ran out does not show in statvfs(): the second try counts no free bytes then.
_QUOTA_DETAIL = f"write: {os.strerror(errno.EDQUOT)}"
# A write refused by a directory's mode (`_write_failure`).
_MODE_REFUSED = f"write: {os.strerror(errno.EACCES)}"


class _DiskRoom(NamedTuple):
    """What the file system had free once a put's first try found no room: bytes (none when
    a quota ran out), inodes (None when it has no inode limit) and its block size."""

    nbytes: int
    files: int | None
    block: int
    # What this store's settled writes had taken when it was taken (`_DiskClaims.written`).
    written: tuple[int, int] = (0, 0)


class _NoRoom(NamedTuple):
    """The pages of a put's first try the file system had no room for, as (position, reserved
    size, error), and the room it had then (None: statvfs failed); and the bytes of its
    victims left in place (another instance used them since, see `_used_elsewhere`), whose
    room the put still owes."""

    pages: list[tuple[int, int, str]]
    room: _DiskRoom | None
    spared: int = 0


class _DiskPlan(NamedTuple):
    """Room made on the disk for the first `admitted` pages of a second try: the `victims` to
    evict, and the `nbytes` and `files` (inodes) those pages need beyond what was free."""

    victims: list[bytes]
    admitted: int
    nbytes: int
    files: int


def _disk_room(dir_fd: int, results: Sequence[_Result | None]) -> _DiskRoom | None:
    """The room on the file system of `dir_fd` after writes with `results` found none."""
    try:
        st = os.fstatvfs(dir_fd)
    except OSError:
        return None
    quota = any(result is not None and result[1] == _QUOTA_DETAIL for result in results)
    return _DiskRoom(
        nbytes=0 if quota else st.f_bavail * st.f_frsize,
        files=st.f_favail if st.f_files else None,  # a total of 0: no inode limit
        block=st.f_frsize or 1,
    )


def _in_blocks(nbytes: int, block: int) -> int:
    """`nbytes` rounded up to whole blocks: what a file of that size takes on the disk."""
    return -(-nbytes // block) * block


def _disk_need(nbytes: int, block: int) -> int:
    """The room to plan for writing a file of `nbytes`: its blocks, and slack for what the
    file system adds (extent or indirect blocks, a directory growing by a block), which
    does not show in the file's size."""
    return _in_blocks(nbytes + nbytes // _DISK_SLACK_RATIO, block) + block


def _write_failure(exc: OSError) -> _Result:
    """The result of a page write that failed with `exc`, its errno kept in the code."""
    if isinstance(exc, _RefusedShardError):
        # Refused until the next open: retrying cannot help. Its text names the directory,
        # which would make a logged kind per shard; `storage.shard.refused` named each.
        return (_REFUSED, f"write: {_REFUSED_SHARD}", 0)
    code = (
        _NO_ROOM
        if exc.errno in _NO_ROOM_ERRNOS
        else _REFUSED
        if exc.errno in _REFUSED_ERRNOS
        else _ERROR
    )
    return (code, f"write: {exc.strerror or exc}", 0)


_Result = tuple[str, str, int]  # (code, detail, stored bytes)
_Checked = tuple[str, str]  # (code, reason) of a page verify() checked


def _advance(iov: list[memoryview], done: int) -> list[memoryview]:
    index = 0
    while index < len(iov) and done >= iov[index].nbytes:
        done -= iov[index].nbytes
        index += 1
    rest = iov[index:]
    if done:
        rest[0] = rest[0][done:]
    return rest


def _has_holes(st: os.stat_result) -> bool:
    """Whether a long page file's blocks cover far less than its length.

    The store writes a page whole, never seeking past a byte, so such a file was made by
    something else (a header claiming any length is cheap over a sparse file), and reading
    it all would take as long as its length says. Only far less (a sixteenth), so that a
    file system that compresses, and reports fewer blocks, is not mistaken for it; 0 blocks
    is where the count is not kept.
    """
    allocated = st.st_blocks * 512  # 512-byte units, whatever the block size
    return st.st_size > _SPARSE_CHECK_NBYTES and 0 < allocated < st.st_size // 16


def _preadv_full(fd: int, iov: list[memoryview], offset: int, length: int) -> int:
    """Fill `iov` (`length` bytes) from `offset`, however short the kernel's reads; stop at EOF."""
    total = 0
    while True:
        count = os.preadv(fd, iov[:_IOV_MAX], offset)
        total += count
        if total >= length or count == 0:
            return total
        offset += count
        iov = _advance(iov, count)


def _pwritev_full(fd: int, iov: list[memoryview], offset: int, length: int) -> None:
    written = 0
    while True:
        count = os.pwritev(fd, iov[:_IOV_MAX], offset)
        written += count
        if written >= length:
            return
        if count == 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += count
        iov = _advance(iov, count)


def _is_page_name(name: str) -> bool:
    return len(name) == _KEY_HEX_LEN and _HEX.issuperset(name)


#: Errors of opening anything once the process (EMFILE) or the system (ENFILE) has no
#: descriptor left: passed on as OSError, never called a bad root, and transient when serving.
_OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE})
_DESCRIPTOR_HINTS = {
    errno.EMFILE: "; raise the process's limit (ulimit -n)",
    errno.ENFILE: "; the system's open-file table is full (fs.file-max)",
}


def _private_fix(*paths: Path) -> str:
    """The command that gives `paths` and everything under them the modes the store makes
    (0700, 0600): `chmod -R g+rwX` on a root, or a volume's group ownership set again at
    every mount, leaves every directory below it as group-writable as the first refused."""
    return "chmod -R go-rwx " + " ".join(shlex.quote(str(path)) for path in paths)


def _check_private_dir(
    fd: int, what: str, *, group_may_write: bool = False, fix: str = "chmod 700"
) -> None:
    """Refuse a directory that is not ours or that others may write. The root may be
    writable by its group (one made by `mkdir` under umask 002): its group could then rename
    its entries, which are checked in turn, but put nothing into pages/, which may not be.
    `fix` is the command the message tells to run."""
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode):
        raise StorageConfigError(f"{what} is not a directory; expected a private directory")
    if st.st_uid != os.geteuid():
        raise StorageConfigError(
            f"{what} is owned by uid {st.st_uid}, not by this user "
            f"(uid {os.geteuid()}): its owner could replace pages; use a directory you own"
        )
    if st.st_mode & stat.S_IWOTH:
        raise StorageConfigError(
            f"{what} is world-writable (mode {stat.S_IMODE(st.st_mode):o}): "
            f"other users could plant or replace pages; use a private directory ({fix})"
        )
    if st.st_mode & stat.S_IWGRP and not group_may_write:
        # Pages planted by another user of the group would be served (sound checksums).
        raise StorageConfigError(
            f"{what} is group-writable (mode {stat.S_IMODE(st.st_mode):o}): other users of "
            f"its group could plant or replace pages; use a private directory ({fix}); "
            "instances sharing a root run as its owner"
        )


def _open_private_dir(
    parent_fd: int,
    name: str,
    what: str,
    *,
    group_may_write: bool = False,
    fix: str = "chmod 700",
) -> int:
    """Create `name` (0700) under `parent_fd` if missing and open it, refusing a symlink
    (whoever can change its target could redirect every page) and checking its owner and mode.
    """
    try:
        os.mkdir(name, _DIR_MODE, dir_fd=parent_fd)
    except FileExistsError:
        pass
    except OSError as exc:
        raise StorageConfigError(
            f"{what}: cannot create it ({exc.strerror}); expected a private directory"
        ) from None
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as exc:
        if exc.errno in _OUT_OF_DESCRIPTORS:
            raise  # the process's state, not the directory's: no config error
        # O_DIRECTORY | O_NOFOLLOW on a symlink fails with ELOOP or ENOTDIR depending on the
        # kernel: look before saying which.
        reason = exc.strerror or str(exc)
        with contextlib.suppress(OSError):
            st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                target = os.readlink(name, dir_fd=parent_fd)
                reason = f"is a symlink (to {target!r}), which is never followed"
            elif not stat.S_ISDIR(st.st_mode):
                reason = "is not a directory"
        raise StorageConfigError(
            f"{what}: {reason}; expected a private directory (owned by this user, mode 0700, "
            "not a symlink)"
        ) from None
    try:
        _check_private_dir(fd, what, group_may_write=group_may_write, fix=fix)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _take_lock(root_fd: int, root: Path, *, shared: bool, looking: bool = False) -> int:
    """Open `LOCK` (never through a symlink) and flock it: exclusive for a private root.

    An opener that only looks (`looking`) opens an existing `LOCK` read-only, which flock
    needs no more than, so a store on a read-only file system can still be inspected."""
    lock_fd = _open_lock_checked(root_fd, root, looking=looking, writable=False)
    try:
        _flock(lock_fd, root, shared=shared)
    except OSError as exc:
        close_lock_fd(lock_fd)
        if exc.errno != errno.EBADF:
            raise
    except BaseException:
        close_lock_fd(lock_fd)
        raise
    else:
        return lock_fd
    # NFS emulates flock with byte-range locks, whose exclusive kind needs a descriptor open
    # for writing: only there is one held (which keeps a read-only remount refused as busy).
    # An opener that only looks needs the same, for as long as it looks.
    if not looking:
        lock_fd = _open_lock_checked(root_fd, root, looking=False, writable=True)
    else:
        try:
            lock_fd = open_lock_fd(lambda: _open_lock(root_fd, looking=False, writable=True))
        except OSError as exc:
            if exc.errno in _OUT_OF_DESCRIPTORS:
                raise
            raise StorageConfigError(
                f"cannot lock {root / _LOCK} to look at a private root: its file system takes "
                "an exclusive lock only on a file open for writing (as NFS does), which fails "
                f"here ({exc.strerror or exc}); look with shared=1 in the URL, whose shared "
                "lock needs no write access"
            ) from None
    try:
        _flock(lock_fd, root, shared=shared)
    except BaseException:
        close_lock_fd(lock_fd)
        raise
    return lock_fd


def _open_lock_checked(root_fd: int, root: Path, *, looking: bool, writable: bool) -> int:
    try:
        # Registered from its open, so that a child forked at any point closes its copy.
        return open_lock_fd(lambda: _open_lock(root_fd, looking=looking, writable=writable))
    except OSError as exc:
        if exc.errno in _OUT_OF_DESCRIPTORS:
            raise
        if exc.errno == errno.EROFS:
            raise StorageConfigError(
                f"cannot open the lock file {root / _LOCK}: the storage root is on a read-only "
                "file system; a store that writes needs a writable root (the commands that "
                "only look, `storage stats|ls` and `manifest show`, open a read-only one, "
                "on NFS with shared=1 in the URL)"
            ) from None
        raise StorageConfigError(
            f"cannot open the lock file {root / _LOCK}: {exc.strerror or exc}; expected a "
            "regular file (not a symlink) or none"
        ) from None


def _open_lock(root_fd: int, *, looking: bool, writable: bool) -> int:
    if looking:
        # _READ_FLAGS: no FIFO planted as LOCK blocks the open (`_flock` refuses it).
        with contextlib.suppress(FileNotFoundError):
            return os.open(_LOCK, _READ_FLAGS, dir_fd=root_fd)
    # Read-only where flock allows it: a descriptor open for writing held for the store's life
    # would make the kernel refuse to remount its file system read-only ("busy"). O_NONBLOCK:
    # a read-only open of a FIFO planted as LOCK would wait for a writer for ever (`_flock`
    # refuses it).
    access = os.O_RDWR if writable else os.O_RDONLY
    flags = access | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(_LOCK, flags, _FILE_MODE, dir_fd=root_fd)
    try:
        # An existing LOCK opens read-only even on a read-only file system; a store that
        # writes needs one that is not. The root's own mount is asked: LOCK may be a file
        # mounted from elsewhere, and the store writes into the root, not into LOCK.
        read_only = bool(os.fstatvfs(root_fd).f_flag & os.ST_RDONLY)
    except BaseException:
        os.close(fd)
        raise
    if read_only:
        os.close(fd)
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))
    return fd


def _flock(lock_fd: int, root: Path, *, shared: bool) -> None:
    if not stat.S_ISREG(os.fstat(lock_fd).st_mode):
        raise StorageConfigError(
            f"{root / _LOCK} is not a regular file; remove it (it is created as needed)"
        )
    try:
        fcntl.flock(lock_fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        if shared:
            raise StorageConfigError(
                f"storage root {root} is in use by an instance that opened it privately; to "
                "share a root, every instance must open it with shared=1"
            ) from None
        raise StorageConfigError(
            f"storage root {root} is in use by another instance; every instance sharing a "
            "root must open it with shared=1"
        ) from None


def _open_root(root: Path, *, shared: bool, looking: bool = False) -> _Handles:
    """Create (0700) and check the root, open its directories and take the instance lock
    (opening an existing `LOCK` read-only when `looking`: see `_take_lock`).

    Directories above the root may be symlinks; the root itself and everything in it may not.
    """
    parent = root.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileExistsError, NotADirectoryError):
        raise StorageConfigError(
            f"cannot create storage root {root}: {parent} is not a directory"
        ) from None
    except OSError as exc:
        if exc.errno in _OUT_OF_DESCRIPTORS:
            raise
        raise StorageConfigError(
            f"cannot create storage root {root}: {parent}: {exc.strerror or exc}"
        ) from None
    try:
        if root.name:
            root_fd = _open_private_dir(
                parent_fd, root.name, f"storage root {root}", group_may_write=True
            )
        else:  # "/": nothing above it to hold a symlink
            root_fd = os.open(root, _DIR_FLAGS)
            try:
                _check_private_dir(root_fd, f"storage root {root}", group_may_write=True)
            except BaseException:
                os.close(root_fd)
                raise
    finally:
        os.close(parent_fd)
    opened = [root_fd]
    try:
        fix = _private_fix(root / _PAGES, root / _TMP)
        pages_fd = _open_private_dir(root_fd, _PAGES, f"storage directory {root / _PAGES}", fix=fix)
        opened.append(pages_fd)
        tmp_fd = _open_private_dir(root_fd, _TMP, f"storage directory {root / _TMP}", fix=fix)
        opened.append(tmp_fd)
        root_st = os.fstat(root_fd)
        lock_fd = _take_lock(root_fd, root, shared=shared, looking=looking)
    except BaseException:
        for fd in opened:
            os.close(fd)
        raise
    return _Handles(
        root_fd,
        pages_fd,
        tmp_fd,
        lock_fd,
        root / _PAGES,
        shared=shared,
        root_id=(root_st.st_dev, root_st.st_ino),
    )


_MANIFEST_NAME = "manifest.jsonl"

#: Largest value `read_raw` reads: far past any page (a 70B model's is tens of MiB), and a
#: file larger than that is damage, not a page to hand back whole.
_RAW_MAX_NBYTES = 1 << 30
#: Deepest stray tree removed: each level holds a descriptor. A deeper one is no crash's
#: leftover but planted; it is left in place, logged and counted as unchecked.
_REMOVE_MAX_DEPTH = 64


def _names_root(root: Path, root_id: tuple[int, int]) -> bool:
    """Whether the path `root` still names the directory opened as the root, whose
    (st_dev, st_ino) is `root_id` (not a symlink, not another directory put in its place)."""
    try:
        st = os.lstat(root)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and (st.st_dev, st.st_ino) == root_id


def _remove_tree(name: str, dir_fd: int, stop: threading.Event | None = None) -> None:
    """Remove the directory `name` under `dir_fd` and everything in it, through descriptors
    opened without following symlinks (shutil.rmtree takes `dir_fd` only from Python 3.11).

    Every level it is in stays open, so it never climbs back through "..": a directory moved
    meanwhile is still the one it empties, and nothing it did not enter is reached. Each
    directory is listed once. OSError (ELOOP) for a tree deeper than `_REMOVE_MAX_DEPTH`,
    (EINTR) once `stop` is set."""
    # Per level: its descriptor, its name in the level above, its subdirectories still to go.
    levels: list[tuple[int, str, list[str]]] = []
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
        levels.append((fd, name, []))
        levels[-1][2].extend(_empty_but_dirs(fd))
        while levels:
            if stop is not None and stop.is_set():
                raise OSError(errno.EINTR, f"stopped while removing {name}")
            fd, here, subdirs = levels[-1]
            if subdirs:
                if len(levels) >= _REMOVE_MAX_DEPTH:
                    raise OSError(errno.ELOOP, f"deeper than {_REMOVE_MAX_DEPTH} levels: {name}")
                child = subdirs.pop()
                try:
                    down = os.open(child, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    continue
                levels.append((down, child, []))
                levels[-1][2].extend(_empty_but_dirs(down))
                continue
            levels.pop()
            os.close(fd)
            if levels:
                with contextlib.suppress(FileNotFoundError):
                    os.rmdir(here, dir_fd=levels[-1][0])
    finally:
        for fd, _, _ in levels:
            os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


def _empty_but_dirs(fd: int) -> list[str]:
    """Unlink every entry of the directory `fd` but subdirectories; the subdirectories."""
    with os.scandir(fd) as entries:
        inside = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in entries]
    subdirs = []
    for child, is_dir in inside:
        if is_dir:
            subdirs.append(child)
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(child, dir_fd=fd)
    return subdirs


def _remove_leftovers(
    handles: _Handles,
    *,
    idle_s: float,
    keep: frozenset[str] = frozenset(),
    failed: list[tuple[str, str]] | None = None,
    foreign: list[str] | None = None,
    unlisted: list[str] | None = None,
) -> int:
    """Delete temporary files of interrupted writes not modified for `idle_s` seconds, but
    not those named in `keep`. One that cannot be removed goes to `failed` as (name, error)
    and the rest go on: a single immutable file must not fail an open or a verify(). A file
    not named as the store names its temporary and spare files is no leftover of its own
    (a `tmp/` that was there before the store, an operator's file): it is left in place and
    goes to `foreign`. Why tmp/ itself could not be listed goes to `unlisted`."""
    removed = 0
    now = time.time()
    try:
        fd = os.open(".", _DIR_FLAGS, dir_fd=handles.tmp_fd)  # scandir's own descriptor
    except FileNotFoundError:
        return 0  # removed under us: no leftover is left in it
    except OSError as exc:
        # An unreadable tmp/ (its mode changed under the store, an I/O error, no descriptor
        # left) hides every leftover: counted as one entry left unchecked, as an unreadable
        # shard is, and the rest goes on.
        if unlisted is not None:
            unlisted.append(_unlisted_text(exc))
        return 0
    try:
        with os.scandir(fd) as entries:
            for entry in entries:
                try:
                    if entry.is_dir(follow_symlinks=False) or entry.name in keep:
                        continue
                    if not entry.name.endswith((_TMP_SUFFIX, _SPARE_SUFFIX)):
                        if foreign is not None:
                            foreign.append(f"{_TMP}/{entry.name}")
                        continue
                    if idle_s and now - entry.stat(follow_symlinks=False).st_mtime < idle_s:
                        continue
                    os.unlink(entry.name, dir_fd=handles.tmp_fd)
                    removed += 1
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    if failed is not None:
                        failed.append((entry.name, exc.strerror or str(exc)))
    except OSError as exc:  # the listing itself failed midway: the rest is unchecked
        if unlisted is not None:
            unlisted.append(_unlisted_text(exc))
        return removed
    finally:
        os.close(fd)
    handles.tmp_unlisted = None
    return removed


def _unlisted_text(exc: OSError) -> str:
    hint = ", make it readable" if isinstance(exc, PermissionError) else ""
    return f"{exc.strerror or exc}: cannot list it{hint}"


def _scan(
    handles: _Handles,
    stop: threading.Event,
    strays: list[tuple[int, str]] | None = None,
    *,
    stray_dirs: list[tuple[int, str]] | None = None,
    refused: list[str] | None = None,
    foreign: list[str] | None = None,
    empty: list[str] | None = None,
    stuck: _StuckFiles | None = None,
) -> list[_Found]:
    """Every page file under pages/. Entries that are neither page files nor regular files
    (symlinks, FIFOs, devices) go to `strays` (as (directory fd, name)) when given, and
    directories inside a shard where a page of its belongs (named as its key) to
    `stray_dirs` (other directories there to `foreign`); their descriptors stay open in `handles`.
    A regular file named as a page key (64 hex digits, of either case) that is no page of
    its shard (one moved to another shard or out of the shards, or named in upper case) is
    a stray too: a page the store can neither find nor account for, which would outlive its
    capacity. Other regular files (an operator's notes or backup copy) go to `foreign`:
    never the store's, so never removed. Shards that cannot be opened, or are refused as
    unsafe, go to `refused`; shards listed with nothing in them to `empty`. Files in `stuck`
    (corrupt, and could not be removed) are left out."""
    found: list[_Found] = []
    try:
        pages_fd = os.open(".", _DIR_FLAGS, dir_fd=handles.pages_fd)
        try:
            with os.scandir(pages_fd) as shards:
                shard_names = [
                    (entry.name, entry.is_dir(follow_symlinks=False), _is_regular(entry))
                    for entry in shards
                ]
        finally:
            os.close(pages_fd)
    except OSError as exc:
        # Every page is under it: no scan can say anything of the store.
        hint = (
            "; give this user read and search permission on it (chmod u+rx)"
            if isinstance(exc, PermissionError)
            else _DESCRIPTOR_HINTS.get(exc.errno or 0, "")
        )
        raise StorageError(
            f"{handles._pages_path}: {exc.strerror or exc}: cannot list the pages{hint}"
        ) from exc
    # A shard gone since it was logged is no longer the one logged: made again and
    # unreadable again, it is logged again. A copy: other scans run on other threads.
    listed = {name for name, is_dir, _ in shard_names if is_dir}
    for name in list(handles.unreadable):
        if name not in listed:
            handles.unreadable.pop(name, None)
    for shard_name, is_dir, regular in sorted(shard_names):
        if stop.is_set():
            break
        valid = len(shard_name) == 2 and _HEX.issuperset(shard_name)
        if not (is_dir and valid):
            if regular and not _names_a_page(shard_name) and foreign is not None:
                foreign.append(shard_name)
            elif strays is not None and not is_dir:
                strays.append((handles.pages_fd, shard_name))
            continue
        try:
            shard_fd = handles.shard(shard_name, create=False)
            if shard_fd is None:
                continue
            scan_fd = os.open(".", _DIR_FLAGS, dir_fd=shard_fd)
        except FileNotFoundError:
            continue
        except OSError as exc:  # refused (logged once by `shard`) or unreadable
            _unreadable_shard(handles, shard_name, exc, refused)
            continue
        shard: list[_Found] = []
        listed_any = False
        try:
            with os.scandir(scan_fd) as entries:
                for entry in entries:
                    listed_any = True
                    name = entry.name
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            # A directory where a page belongs would fail every write of
                            # that key; maintenance takes it out. One of another name (an
                            # operator's, an upper-case key, another shard's key) blocks
                            # nothing, and its tree was never the store's.
                            if not (_is_page_name(name) and name[:2] == shard_name):
                                if foreign is not None:
                                    foreign.append(f"{shard_name}/{name}")
                            elif stray_dirs is not None:
                                stray_dirs.append((shard_fd, name))
                        elif not entry.is_file(follow_symlinks=False):
                            if strays is not None:
                                strays.append((shard_fd, name))
                        elif _is_page_name(name) and name[:2] == shard_name:
                            st = entry.stat(follow_symlinks=False)
                            key = bytes.fromhex(name)
                            if stuck and stuck.seen(key, st):
                                continue
                            shard.append((key, st.st_size, st.st_mtime))
                        elif _names_a_page(name):
                            if strays is not None:  # a page out of its place
                                strays.append((shard_fd, name))
                        elif foreign is not None:
                            foreign.append(f"{shard_name}/{name}")
                    except FileNotFoundError:
                        continue
        except OSError as exc:
            # Listing takes a descriptor of its own: out of them (EMFILE near the process's
            # limit), or an unreadable directory, leaves this shard's pages out, as above.
            _unreadable_shard(handles, shard_name, exc, refused)
            continue
        finally:
            os.close(scan_fd)
        handles.unreadable.pop(shard_name, None)
        found.extend(shard)
        if empty is not None and not listed_any:
            empty.append(shard_name)
    return found


def _rename_in(handles: _Handles, tmp_name: str, hexkey: str) -> Callable[[int], None]:
    """Move `tmp_name` from tmp/ to `hexkey` in the shard directory whose descriptor it is
    given."""

    def rename(shard_fd: int) -> None:
        os.rename(tmp_name, hexkey, src_dir_fd=handles.tmp_fd, dst_dir_fd=shard_fd)

    return rename


def _rename_into_shard(
    handles: _Handles, tmp_name: str, hexkey: str, shard_fd: int, *, durable: bool
) -> int:
    """Move `tmp_name` from tmp/ to `hexkey` in its shard directory and return the
    directory's descriptor: one removed under us (an emptied one, by `gc()`) is made again,
    once, under a new descriptor."""
    try:
        os.rename(tmp_name, hexkey, src_dir_fd=handles.tmp_fd, dst_dir_fd=shard_fd)
    except FileNotFoundError:
        renewed = handles.renew_shard(
            hexkey[:2], shard_fd, durable=durable, then=_rename_in(handles, tmp_name, hexkey)
        )
        if renewed is None:
            raise
        return renewed
    return shard_fd


def _unreadable_shard(
    handles: _Handles, name: str, exc: OSError, refused: list[str] | None
) -> None:
    """A shard directory `_scan` could not list: logged (a refused one was when refused; one
    logged with the same error since it was last listed is not again) and counted in
    `refused`."""
    error = exc.strerror or str(exc)
    if not isinstance(exc, _RefusedShardError) and handles.unreadable.get(name) != error:
        handles.unreadable[name] = error
        log.warning(
            "storage.shard.unreadable",
            directory=str(handles._pages_path / name),
            error=error,
        )
    if refused is not None:
        refused.append(name)


def _names_a_page(name: str) -> bool:
    # A page key in either case: the store writes lower case only, so any such file out of
    # its place (or in upper case) is a page it lost track of, never an operator's file.
    return len(name) == _KEY_HEX_LEN and _HEX.issuperset(name.lower())


def _is_regular(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_file(follow_symlinks=False)
    except OSError:  # gone meanwhile, or unreadable: no file to keep
        return False


def _identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    # The inode alone is not enough: a write that reuses a spare file keeps it. Any write,
    # rename or truncation moves the change time.
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _remove_if_same(
    shard_fd: int, name: str, st: os.stat_result | None, *, gone: bool = True
) -> bool:
    """Unlink `name` unless it has changed since we looked at it (`st`); False if it had
    (it is then left alone), `gone` if it is not there (any more)."""
    try:
        if st is not None:
            now = os.stat(name, dir_fd=shard_fd, follow_symlinks=False)
            if _identity(now) != _identity(st):
                return False
        os.unlink(name, dir_fd=shard_fd)
    except FileNotFoundError:
        return gone
    return True


class _StuckFiles:
    """Corrupt page files that could not be removed (a directory this user may not write),
    by key: the identity of the file. A shared root's get looks on disk for every key, so it
    would read such a file in full and report it again at every get; the same file is a quiet
    miss instead. Used by read jobs, hence the lock."""

    def __init__(self) -> None:
        self._files: dict[bytes, tuple[int, int, int, int, int]] = {}
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._files)

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._files

    def seen(self, key: bytes, st: os.stat_result) -> bool:
        """Whether `st` is the file of `key` that could not be removed."""
        with self._lock:
            seen = self._files.get(key)
            if seen is None:
                return False
            if seen == _identity(st):
                return True
            del self._files[key]  # another file now: read as any
            return False

    def add(self, key: bytes, st: os.stat_result) -> bool:
        """Remember `st` as the file of `key` that could not be removed; False when it was
        already (another read of it, in flight at once, remembered it first and reports it:
        this one is a quiet miss, so the page is counted and logged once)."""
        identity = _identity(st)
        with self._lock:
            if self._files.get(key) == identity:
                return False
            self._files.pop(key, None)
            if len(self._files) >= _STUCK_MAX:
                del self._files[next(iter(self._files))]  # the oldest: read and reported again
            self._files[key] = identity
        return True


class _PolicyRefused:
    """Page files a policy refused to open (a security module, seccomp, fanotify: a refusal
    the file's mode does not explain), by key: the identity of the file and until when
    (monotonic) it is not tried again. The first refusal is an ERROR, logged; a get of the
    same file within `_POLICY_RETRY_S` is a miss without another error (each would cost the
    caller an error and a retry), and the next one after it tries again, so a policy
    changed at run time serves the page within that time. Used by read jobs, hence the
    lock."""

    def __init__(self) -> None:
        self._files: dict[bytes, tuple[tuple[int, int, int], float]] = {}
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._files)

    def add(self, key: bytes, st: os.stat_result) -> bool:
        """Record that the file `st` of `key` was refused; False when it was already and is
        not due to be tried again (the caller then reports a quiet miss)."""
        # Not `_identity`: its times move whenever any instance reading the page stamps it,
        # and on a shared root that would make every such read news again. A page written
        # anew is a new file (a rename); one written here into a reused spare file, which
        # keeps its inode, is forgotten by the write (`forget`).
        identity = (st.st_dev, st.st_ino, st.st_size)
        now = time.monotonic()
        with self._lock:
            seen = self._files.get(key)
            if seen is not None and seen[0] == identity and now < seen[1]:
                return False
            self._files.pop(key, None)
            if len(self._files) >= _STUCK_MAX:
                del self._files[next(iter(self._files))]
            self._files[key] = (identity, now + _POLICY_RETRY_S)
        return True

    def forget(self, key: bytes) -> None:
        """The page of `key` was opened, or written here: a later refusal is news."""
        with self._lock:
            self._files.pop(key, None)


def _mode_refuses_read(st: os.stat_result) -> bool:
    """Whether the owner, group and mode bits of `st` deny this process reading the file."""
    if st.st_uid == os.geteuid():
        return not st.st_mode & stat.S_IRUSR
    if st.st_gid == os.getegid() or st.st_gid in os.getgroups():
        return not st.st_mode & stat.S_IRGRP
    return not st.st_mode & stat.S_IROTH


def _open_or_remove_unreadable(
    shard_fd: int,
    key: bytes,
    stuck: _StuckFiles | None = None,
    *,
    retry: bool = False,
    why: list[str] | None = None,
    policy: _PolicyRefused | None = None,
) -> int | str | None:
    """After opening the page file of `key` was refused (EACCES, EPERM): open it again, or
    remove it when it is still the same file and still refused by its mode (EACCES), not by a
    policy the mode does not explain (EPERM, a security module). Every instance of a root runs
    as the root's owner, so a page file its owner may not read (copied in by another user as
    0600, `chmod 000`) would never be read by any of them, and left in place it would make
    every get of its key fail and every put of it find it stored. Returns the descriptor of a
    file that opens now, None when it is gone, "removed", "kept" when it could not be removed
    (remembered in `stuck`), "stuck" for such a file met before, or "" when it cannot be
    looked at either or a policy refuses it (the shard directory, a security module: not the
    file's doing), or "changed" when another file took its place before it was removed (left
    alone). With `retry` (verify()), a file met before is tried again. With "kept",
    why the removal failed is added to `why`, when given. With `policy`, a file a policy
    refused is recorded there, and "refused" is returned for one refused already and not due
    to be tried again (see `_PolicyRefused`)."""
    name = key.hex()
    try:
        st = os.stat(name, dir_fd=shard_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    except OSError:
        return ""
    if stuck and not retry and stuck.seen(key, st):
        return "stuck"
    try:
        return os.open(name, _READ_FLAGS, dir_fd=shard_fd)
    except FileNotFoundError:
        return None
    except PermissionError as exc:
        # Refused by a security module, a seccomp or fanotify policy (EPERM, or EACCES that
        # the file's mode does not explain): a sound page other instances may read.
        if exc.errno != errno.EACCES or not _mode_refuses_read(st):
            if policy is not None and not policy.add(key, st):
                return "refused"
            return ""
    except OSError:
        return ""
    # Only the file stat() saw, refused twice: one renamed over it meanwhile stays, and one
    # removed meanwhile (by another read in flight at once, which reports it) is a miss.
    try:
        if not _remove_if_same(shard_fd, name, st, gone=False):
            # Another file is there now (a put's, after another read removed this one): it
            # was not removed here, so not reported here either.
            return "changed" if _exists(shard_fd, name) else None
    except OSError as exc:  # still a miss; verify() retries the removal
        if stuck is not None and not stuck.add(key, st) and not retry:
            return "stuck"  # another read in flight met it first and reports it
        if why is not None:
            why.append(exc.strerror or str(exc))
        return "kept"
    return "removed"


def _exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _unlink_at(name: str, dir_fd: int) -> None:
    os.unlink(name, dir_fd=dir_fd)


def _unlink_all(dir_fd: int, names: Iterable[str]) -> None:
    for name in names:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dir_fd)


def _unwritable(handles: _Handles) -> str | None:
    """The first of tmp/ and pages/ this user may not write into (by its mode or ACL,
    asked with the effective ids), or None: a root read-only for a reader refuses every
    put."""
    for name, fd in ((_TMP, handles.tmp_fd), (_PAGES, handles.pages_fd)):
        try:
            if not os.access(".", os.W_OK | os.X_OK, dir_fd=fd, effective_ids=True):
                return name
        except OSError:  # not answered (removed under us): the writes tell
            continue
    return None


def _stamp(handles: _Handles, hexkey: str, mtime_ns: int) -> bool:
    """Set the mtime (and atime) of the page file `hexkey` to `mtime_ns`, never through a
    symlink; False when there is no such file or it cannot be stamped (that use is then
    forgotten at the next open, nothing more)."""
    try:
        shard_fd = handles.shard(hexkey[:2], create=False)
        if shard_fd is None:
            return False
        os.utime(hexkey, ns=(mtime_ns, mtime_ns), dir_fd=shard_fd, follow_symlinks=False)
    except OSError:
        return False
    return True


def _stamp_all(handles: _Handles, stamps: dict[bytes, int], base_ns: int) -> None:
    """Stamp the files of `stamps` (key -> position in its call): the first key's newest.
    Not stopped by a close: a system call a page, and a use left out would be lost."""
    for key, position in stamps.items():
        _stamp(handles, key.hex(), base_ns - position * _STAMP_STEP_NS)


def _stamp_queued(handles: _Handles, queued: list[tuple[int, dict[bytes, int]]]) -> None:
    """Stamp the files of each queued call, (its time in ns, key -> position in it)."""
    for base_ns, stamps in queued:
        _stamp_all(handles, stamps, base_ns)


def _header_mismatch(header: PageHeader, key: bytes, namespace: bytes, expected: int) -> str:
    if header.key != key:
        return "key"
    if header.namespace != namespace:
        return "namespace"
    if header.payload_nbytes != expected:
        return "length"
    return ""


class _SparePool:
    """Files of removed pages, kept in tmp/ for writes of the same size (thread-safe)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.nbytes = 0
        # What the files hold on the disk, in whole blocks: the room releasing them makes.
        self.disk_nbytes = 0
        # Size -> (name, bytes on the disk) of each file of that size.
        self._by_size: dict[int, list[tuple[str, int]]] = {}
        # Taken by a write still in progress: still ours, so verify() must not remove them.
        self._taken: set[str] = set()
        # Bumped by each emptying (`release`, `names(drain=True)`), which zeroes `nbytes`: a
        # `keep` that counted its file before one must not add it to the pool after it.
        self._generation = 0
        self._lock = threading.Lock()

    def keep(self, handles: _Handles, shard_fd: int, name: str) -> bool:
        """Move the page file `name` into the pool if it has room; False if it did not take
        it (the caller removes the file). Raises FileNotFoundError when there is no file."""
        st = os.stat(name, dir_fd=shard_fd, follow_symlinks=False)
        size = st.st_size
        # st_blocks counts 512-byte units whatever the block size; 0 where it is not kept.
        disk = st.st_blocks * 512 if st.st_blocks else size
        # A file with another link (planted beside or outside the root) is not ours alone:
        # a write over it as a spare would change what the other name shows. One of another
        # owner, or that others may read (a page copied in), would pass its owner and mode
        # on to the page written over it, which the store creates 0600.
        if (
            not stat.S_ISREG(st.st_mode)
            or st.st_nlink != 1
            or st.st_uid != os.geteuid()
            or st.st_mode & 0o077
        ):
            return False
        with self._lock:
            if self.nbytes + size > self.limit:
                return False
            self.nbytes += size
            self.disk_nbytes += disk
            generation = self._generation
        spare = f"{secrets.token_hex(8)}{_SPARE_SUFFIX}"
        try:
            os.rename(name, spare, src_dir_fd=shard_fd, dst_dir_fd=handles.tmp_fd)
        except BaseException as exc:
            with self._lock:
                if self._generation == generation:  # else the emptying zeroed it already
                    self.nbytes -= size
                    self.disk_nbytes -= disk
            # ENOENT when tmp/ was removed, EACCES when it cannot be written: the page is
            # still there, and the caller unlinks it instead (the next write recreates tmp/).
            if isinstance(exc, OSError) and _exists(shard_fd, name):
                return False
            raise
        with self._lock:
            emptied = self._generation != generation
            if not emptied:
                self._by_size.setdefault(size, []).append((spare, disk))
        if emptied:
            # Emptied while the file moved (a full disk or gc() wants the room back): the
            # pool no longer counts it, so it goes now rather than held uncounted.
            with contextlib.suppress(OSError):
                os.unlink(spare, dir_fd=handles.tmp_fd)
        return True

    def take(self, size: int) -> str | None:
        """The name in tmp/ of a spare file of `size` bytes, now the caller's, or None."""
        with self._lock:
            names = self._by_size.get(size)
            if not names:
                return None
            self.nbytes -= size
            name, disk = names.pop()
            self.disk_nbytes -= disk
            if not names:
                del self._by_size[size]
            self._taken.add(name)
            return name

    def done(self, name: str) -> None:
        """The write that took `name` has renamed or removed it."""
        with self._lock:
            self._taken.discard(name)

    def give_back(self, name: str, size: int, disk: int) -> bool:
        """Take the file `name` in tmp/ (`size` bytes, `disk` on the disk) into the pool,
        taken by a write or not: one that could be neither renamed nor removed. False when
        the pool has no room for it (the caller still owns it)."""
        with self._lock:
            self._taken.discard(name)
            if self.nbytes + size > self.limit:
                return False
            self.nbytes += size
            self.disk_nbytes += disk
            self._by_size.setdefault(size, []).append((name, disk))
        return True

    @property
    def files(self) -> int:
        """How many spare files the pool holds."""
        with self._lock:
            return sum(len(group) for group in self._by_size.values())

    def release(self) -> list[tuple[str, int]]:
        """Empty the pool: (name, size) of each spare file no write has taken, now the
        caller's to unlink (a full disk wants their room back)."""
        with self._lock:
            released = [(name, size) for size, group in self._by_size.items() for name, _ in group]
            self._by_size.clear()
            self.nbytes = self.disk_nbytes = 0
            self._generation += 1
            return released

    def names(self, *, drain: bool = False) -> frozenset[str]:
        """Every spare file's name; with `drain`, the pool is then empty."""
        with self._lock:
            names = frozenset(name for group in self._by_size.values() for name, _ in group)
            names |= self._taken
            if drain:
                self._by_size.clear()
                self.nbytes = self.disk_nbytes = 0
                self._generation += 1
            return names


class _DiskClaims:
    """Room on the disk claimed by this store's page writes in flight (thread-safe): a
    second try plans with the room statvfs showed less what those writes will still take.

    Each page is claimed when its batch is planned and settled once its write ends, or
    when the batch commits (cancelled, stopped, failed). `written` counts what settled
    pages took, so the room a statvfs showed can be brought up to date by what was written
    since (`pending` no longer counts it)."""

    def __init__(self) -> None:
        self.block = 4096  # the file system's, once a statvfs has told it
        self._nbytes = 0
        self._files = 0
        self._written_nbytes = 0
        self._written_files = 0
        self._lock = threading.Lock()

    def claim(self, sizes: Iterable[int]) -> list[int]:
        """Claim room for files of `sizes` bytes; the claims, each settled by `settle`."""
        claims = [_disk_need(size, self.block) for size in sizes]
        with self._lock:
            self._nbytes += sum(claims)
            self._files += len(claims)
        return claims

    def settle(self, claims: list[int], i: int, *, written: bool) -> None:
        """The write of claim `i` ended (`written`: its file took its room)."""
        with self._lock:
            nbytes, claims[i] = claims[i], 0
            if not nbytes:
                return
            self._nbytes -= nbytes
            self._files -= 1
            if written:
                self._written_nbytes += nbytes
                self._written_files += 1

    def settle_all(self, claims: list[int]) -> None:
        """Settle, as not written, every claim of `claims` still open."""
        for i in range(len(claims)):
            self.settle(claims, i, written=False)

    def written(self) -> tuple[int, int]:
        """Bytes and files that settled writes took so far (only ever grows)."""
        with self._lock:
            return self._written_nbytes, self._written_files

    def pending(self) -> tuple[int, int]:
        """Bytes and files claimed by writes not settled yet."""
        with self._lock:
            return self._nbytes, self._files


def _used_elsewhere(shard_fd: int, name: str, seen: float | None) -> float | None:
    """The mtime of the page file `name` when another instance sharing the root has stamped
    a use of it since `seen` (its mtime as this instance last saw or set it), else None.

    A use stamps a file only once it is `_TOUCH_AFTER_S` old, so such a stamp is at least
    that much newer; half of it tells it from this instance's own writes, whose stamps come
    a little after the index's clock. Only this instance's index is behind: evicting by it
    alone would take pages other instances (other models, other versions) use all the time.
    """
    if seen is None:
        return None
    try:
        mtime = os.stat(name, dir_fd=shard_fd, follow_symlinks=False).st_mtime
    except OSError:
        return None  # gone, or unreadable: the removal that follows tells which
    return mtime if mtime - seen >= _TOUCH_AFTER_S / 2 else None


def _remove_page(spares: _SparePool | None, handles: _Handles, shard_fd: int, name: str) -> None:
    """Remove the page file `name`: into the spare pool if it takes it, else unlinked.
    Raises FileNotFoundError when there is no such file."""
    if spares is None or not spares.keep(handles, shard_fd, name):
        os.unlink(name, dir_fd=shard_fd)


class _IndexWalk:
    """The index, most recently used first, a slice at a time across awaits, without a copy.

    A live iterator serves while the index keeps its order. Once it has changed between two
    slices (a put, a read, a removal), the walk goes on after the last page of the previous
    slice that is still there, unused since: the keys after it are copied then, once, a
    reference each (the index's own keys), and pages stored or used since, now at the front,
    are not listed again. When no page of that slice is left, it goes on from the pages used
    no later than the oldest page listed so far, leaving out those of that same last access
    it listed (all the pages of one put share it).
    """

    __slots__ = ("_index", "_last", "_live", "_oldest", "_oldest_listed", "_rest")

    def __init__(self, index: OrderedDict[bytes, _Entry]) -> None:
        self._index = index
        self._live: Iterator[tuple[bytes, _Entry]] = reversed(index.items())
        self._rest: Iterator[bytes] | None = None
        # The previous slice: (key, entry, its last access when taken).
        self._last: list[tuple[bytes, _Entry, float]] = []
        # The oldest last access listed so far, and the keys listed with it: a page's last
        # access only grows, so no other page listed can be as old.
        self._oldest = float("inf")
        self._oldest_listed: set[bytes] = set()

    def take(self, count: int) -> list[tuple[bytes, _Entry]]:
        """The next `count` indexed pages at most (empty at the end). Loop only."""
        chosen: list[tuple[bytes, _Entry]] = []
        if self._rest is None:
            try:
                chosen = list(islice(self._live, count))
            except RuntimeError:  # the order changed since the previous slice
                self._rest = self._after_last()
        if self._rest is not None:
            index = self._index
            for key in self._rest:
                entry = index.get(key)
                if entry is None:  # removed since the copy
                    continue
                chosen.append((key, entry))
                if len(chosen) == count:
                    break
        self._last = [(key, entry, entry.last_access) for key, entry in chosen]
        for key, _, seen in self._last:
            if seen < self._oldest:
                self._oldest = seen
                self._oldest_listed = {key}
            elif seen == self._oldest:
                self._oldest_listed.add(key)
        return chosen

    def _after_last(self) -> Iterator[bytes]:
        index = self._index
        keys = list(reversed(index))
        for key, entry, seen in reversed(self._last):
            if index.get(key) is entry and entry.last_access == seen:
                del keys[: keys.index(key) + 1]
                return iter(keys)
        if not self._last:
            return iter(keys)
        oldest, listed = self._oldest, self._oldest_listed
        return (
            key
            for key in keys
            if (found := index.get(key)) is not None
            and (found.last_access < oldest or (found.last_access == oldest and key not in listed))
        )


_UNREMOVED_EXAMPLES = 3  # keys named per logged line of pages that stayed
_REFUSED_SHARD = "shard directory refused (see storage.shard.refused)"


class _Unremoved:
    """Page files that could not be removed, logged as one line per kind of error (its text
    without the file name, how many pages, a few of their keys): a read-only file system
    fails every page of a delete() or gc() alike, and a line per page would flood the log."""

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        self._seen: dict[str, tuple[int, list[str]]] = {}  # error -> (count, example keys)

    def add(self, hexkey: str, exc: OSError) -> None:
        # A refusal's text names its shard directory, so it would make a kind per shard;
        # `storage.shard.refused` has named each directory already.
        error = _REFUSED_SHARD if isinstance(exc, _RefusedShardError) else exc.strerror or str(exc)
        count, keys = self._seen.setdefault(error, (0, []))
        if len(keys) < _UNREMOVED_EXAMPLES:
            keys.append(hexkey)
        self._seen[error] = (count + 1, keys)

    def log(self, event: str, backend: str, limiter: LogLimiter | None) -> None:
        """Through `limiter`, each kind at most once a minute: the evictions of puts meet
        the same undeletable files again and again."""
        for error, (count, keys) in self._seen.items():
            if limiter is None:
                log.warning(event, backend=backend, error=error, pages=count, keys=keys)
            else:
                # A line left out still counts its pages in the next one's
                # `unlogged_pages_since_last`.
                limiter.warn_tallied(
                    log, event, error, "pages", backend=backend, pages=count, keys=keys
                )
        self._seen.clear()


class _PageErrors:
    """A batch's page errors, logged as one `storage.page.error` per distinct error (its
    count and first key): a full disk fails every page of every batch alike, and a line per
    page would flood the log. A line per batch would too: an error logged by an earlier
    batch is logged again at most once per `limiter`'s interval."""

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        self._seen: dict[str, tuple[int, bytes]] = {}  # error -> (count, first key)

    def add(self, key: bytes, error: str) -> None:
        count, first = self._seen.get(error, (0, key))
        self._seen[error] = (count + 1, first)

    def log(self, backend: str, limiter: LogLimiter) -> None:
        for error, (count, key) in self._seen.items():
            # A line left out still counts its pages in the next one's
            # `unlogged_count_since_last`.
            limiter.warn_tallied(
                log,
                "storage.page.error",
                error,
                "count",
                backend=backend,
                key=key.hex(),
                count=count,
            )


class _Job:
    """Per-batch results written by worker threads (each index by one thread), committed on
    the loop after every thread has stopped, whether the batch finished, failed or was
    cancelled."""

    __slots__ = (
        "cancelled",
        "done",
        "failed",
        "gone",
        "rejected",
        "results",
        "room",
        "spared",
        "stamped",
        "touched",
        "unwritable",
    )

    def __init__(self, count: int) -> None:
        self.results: list[_Result | None] = [None] * count
        self.done = 0  # removals reached (put's victims, delete's keys)
        self.failed: list[int] = []  # positions among those whose file could not be removed
        # Removals reached whose file was gone already (another instance removed it first).
        self.gone = 0
        # Positions of eviction victims left in place, another instance having used them
        # since this one did (a shared root), with their files' mtimes.
        self.spared: dict[int, float] = {}
        # When a write job stamped its files (seconds): later than the call's own clock by
        # as long as the job waited for a thread, and what the files' mtimes say.
        self.stamped = 0.0
        # Positions of the pages whose files a read job stamped, with the mtime (ns) it gave
        # them: stamped later than the index's clock for the call, when the read began.
        self.touched: dict[int, int] = {}
        self.rejected = False  # bad input, refused before any I/O: nothing to commit
        # The caller was cancelled: pages the job never reached are not errors of the store.
        self.cancelled = False
        # The file system's free room, taken when a write found none (for the second try).
        self.room: _DiskRoom | None = None
        # A write job's look at the root after a write was refused by a mode: its number
        # (`FileStorage._looks`) and the directory this user may not write (`_unwritable`),
        # "" when both may be written.
        self.unwritable: tuple[int, str] | None = None

    def segments(self, pages: Sequence[PageBuffer], *, writable: bool) -> list[list[memoryview]]:
        """The pages' byte views; bad buffers mark the job rejected and raise."""
        try:
            return [byte_segments(page, writable=writable) for page in pages]
        except (TypeError, ValueError):
            self.rejected = True
            raise


class FileStorage(BackendBase):
    """Pages as files under a private directory (`file:///path`).

    `capacity_bytes` bounds the stored bytes (headers included); a put that would exceed it
    first evicts the least recently used pages not being read. Up to `spare_bytes` more (by
    default 1 GiB, at most an eighth of the capacity; 0 for none) hold the files of removed
    pages until writes of the same size reuse them. `fsync` is `"none"` (rely on
    the checksum after a crash), `"data"` (fdatasync each page before it is renamed into
    place) or `"always"` (also fsync the directory after the rename). `shared=True` lets
    several instances use one root. `io_threads` is the parallelism inside one batch.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        capacity_bytes: int | None = None,
        fsync: FsyncPolicy = "none",
        shared: bool = False,
        mac_key: bytes | None = None,
        io_threads: int = 4,
        spare_bytes: int | None = None,
    ) -> None:
        path = _root_path(root)
        if fsync not in get_args(FsyncPolicy):
            raise StorageConfigError(f"fsync must be 'none', 'data' or 'always', got {fsync!r}")
        if capacity_bytes is not None and not (_is_int(capacity_bytes) and capacity_bytes >= 1):
            raise StorageConfigError(
                f"capacity_bytes must be an integer >= 1 or None, got {capacity_bytes!r}"
            )
        if not (_is_int(io_threads) and io_threads >= 1):
            raise StorageConfigError(f"io_threads must be an integer >= 1, got {io_threads!r}")
        if not isinstance(shared, bool):
            raise StorageConfigError(f"shared must be True or False, got {shared!r}")
        if spare_bytes is not None and not (_is_int(spare_bytes) and spare_bytes >= 0):
            raise StorageConfigError(
                f"spare_bytes must be an integer >= 0 or None, got {spare_bytes!r}"
            )
        if spare_bytes is None:  # default: 1 GiB, at most an eighth of the capacity
            spare_bytes = min(_SPARE_DEFAULT, (capacity_bytes or _SPARE_DEFAULT * 8) // 8)
        super().__init__(mac_key=mac_key, job_threads=io_threads, thread_name="hicache-file")
        self._root = path
        self._capacity = capacity_bytes
        self._fsync: FsyncPolicy = fsync
        self._shared = shared
        self._io_threads = io_threads
        self._helpers = (
            concurrent.futures.ThreadPoolExecutor(io_threads - 1, "hicache-file-io")
            if io_threads > 1
            else None
        )
        self._name = f"file://{self._root}" + ("?shared=1" if shared else "")
        self._handles: _Handles | None = None
        self._handles_closer: weakref.finalize[[], FileStorage] | None = None
        # Not in a shared root: another instance may be reading a page whose file would be
        # reused (it keeps its inode), and another instance's open or verify cannot tell
        # this instance's spares from leftovers.
        self._spares = _SparePool(spare_bytes) if spare_bytes and not shared else None
        # Loop-owned state: LRU index, bytes indexed, bytes reserved by puts in flight, pins
        # of pages being read, keys being written or evicted.
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()
        self._bytes = 0
        self._reserved = 0
        self._seq = 0
        self._pins: dict[bytes, int] = {}
        self._stuck = _StuckFiles()
        self._policy_refused = _PolicyRefused()
        # Files in tmp/ of writes that failed, which could not be removed then (tmp/ not
        # writable for a while) nor kept as spares: tried again (`_retry_tmp`).
        self._unremoved_tmp: set[str] = set()
        self._unremoved_tmp_lock = threading.Lock()
        # Whom every page file must belong to: the user the root's directories were checked
        # against (every instance of a root runs as its owner).
        self._uid = os.geteuid()
        # The jobs running, by their number in `_Handles.jobs_begun` order (-1: begun before
        # the root was open), each with how many: which retired descriptors may be closed.
        self._running: dict[int, int] = {}
        self._writing: set[bytes] = set()
        self._evicting: set[bytes] = set()
        # Reads and scans observe the disk off the loop and commit later: each index change of
        # a key takes the next epoch, and an observation started at epoch E commits nothing
        # about a key changed after E (`_stale`). Changes are recorded only while an
        # observation is in flight (`_watchers`: start epoch -> how many).
        self._epoch = 0
        self._changed: dict[bytes, int] = {}
        self._watchers: dict[int, int] = {}
        self._prune_at = _CHANGES_PRUNE_MIN
        # Temporary files of interrupted writes removed at open: the count stays for
        # `leftovers_removed_at_open`, and the next verify() reports them as its own.
        self._open_leftovers = 0
        self._unreported_leftovers = 0
        # Pages put found no room for (after one more try) or the file system refused.
        self._refused_writes = 0
        # The directory of the root (tmp/ or pages/) this user may not write, found at open
        # or by a put the mode refused; None while both may be written.
        self._read_only: str | None = None
        # Looks at whether the root may be written are numbered as they begin: puts running
        # at once may finish in another order, and an older look must not undo a newer one.
        self._looks = itertools.count(1)
        self._look_noted = 0
        # When a write job last looked at a root found not writable (`_look_due`); the clock
        # is an attribute so that tests can move it.
        self._clock: Callable[[], float] = time.monotonic
        self._looked_at = -math.inf
        # When the last storage.disk.full was logged (monotonic), None before the first.
        self._disk_full_logged: float | None = None
        # A failing disk fails every batch alike: `storage.page.error` tells each kind of
        # error at once, a repeated one once a minute.
        self._page_errors_log = LogLimiter()
        # Room on the disk that page writes in flight will still take.
        self._claims = _DiskClaims()
        # Set before opening by tools that only look (`hicache-async storage stats|ls`,
        # `manifest show`): opening then leaves temporary files alone, so an inspection
        # changes nothing and a later verify() still finds them, and opens an existing LOCK
        # read-only, so a read-only file system can be inspected.
        self._keep_leftovers = False
        # Stamps of the files of pages that lookups and re-puts used, as (the call's time in
        # ns, key -> position in the call), queued for the one task that writes them.
        self._unstamped: list[tuple[int, dict[bytes, int]]] = []
        self._stamper: asyncio.Task[None] | None = None
        # A shared root's eviction of what lookups found on disk beyond the capacity
        # (`_trim_later`), which no lookup waits for.
        self._trimmer: asyncio.Task[None] | None = None

    @classmethod
    def from_url(cls, url: str, *, mac_key: bytes | None = None) -> FileStorage:
        """`file:///abs/path?capacity=10GiB&fsync=data&shared=1&io_threads=4&spare=1GiB`;
        `file://` alone is the default root. A `#` in a path is written `%23`: a fragment
        is refused."""
        parts = split_url(url, scheme="file")
        if parts.scheme != "file":
            raise StorageConfigError(f"not a file:// URL: {url!r}")
        if "#" in url:
            # urlsplit drops it, and the store would open at another root or ignore settings.
            raise StorageConfigError(
                f"file:// URLs take no fragment, got {url!r}; write a '#' in a path as %23"
            )
        if parts.netloc not in ("", "localhost"):
            raise StorageConfigError(
                f"file:// URLs take an absolute path (file:///abs/path) or none for the default "
                f"root; got host {parts.netloc!r} in {url!r}"
            )
        try:
            # unquote's default would make a byte that is not UTF-8 (%FF) U+FFFD: another
            # directory than the one named. Such paths are refused, as are lone surrogates.
            path = unquote(parts.path, errors="strict")
            path.encode("utf-8")
        except UnicodeError:
            raise StorageConfigError(
                f"file:// paths must be UTF-8 text, their percent-encoded bytes included; got "
                f"{url!r}"
            ) from None
        if path and not path.startswith("/"):
            raise StorageConfigError(f"file:// paths must be absolute, got {path!r}")
        if "\0" in path:
            raise StorageConfigError(
                f"file:// paths cannot hold a NUL byte (or %00), got {url!r}; accepted: "
                "file:///abs/path[?query]"
            )
        params = parse_query(parts.query, _URL_PARAMS, scheme="file")
        capacity = params.get("capacity")
        fsync = params.get("fsync", "none")
        if fsync not in get_args(FsyncPolicy):
            raise StorageConfigError(f"fsync={fsync!r}; accepted: none, data, always")
        threads = parse_int(params.get("io_threads", "4"), field="io_threads", minimum=1)
        spare = params.get("spare")
        return cls(
            path or None,
            capacity_bytes=None if capacity is None else parse_size(capacity, field="capacity"),
            fsync=cast(FsyncPolicy, fsync),  # checked above
            shared=parse_bool(params.get("shared", "0"), field="shared"),
            mac_key=mac_key,
            io_threads=threads,
            spare_bytes=None if spare is None else parse_size(spare, field="spare"),
        )

    @property
    def root(self) -> Path:
        """The root directory as configured."""
        return self._root

    @property
    def leftovers_removed_at_open(self) -> int:
        """Temporary files of interrupted writes removed when the storage opened."""
        return self._open_leftovers

    @property
    def refused_writes(self) -> int:
        """Pages `put` could not store because the file system refused them: no room
        (ENOSPC, EDQUOT) even after releasing spare files and evicting pages for one more
        try, a read-only file system (EROFS), a file size limit (EFBIG), a directory of the
        root this user may not write (EACCES), a shard directory refused as not private.
        Each was a MISS,
        not an ERROR: the same write would fail the same way."""
        return self._refused_writes

    @property
    def read_only(self) -> str | None:
        """The root's directory (`"tmp"` or `"pages"`) this user may not write, found when the
        store opened or when a put was refused by a directory's mode, else None: while it is
        set every put is a refused MISS (with `"pages"`, every put whose shard directory is
        not made yet; `storage.root.read_only` said why, once;
        `storage.root.writable` says when puts find it writable again)."""
        return self._read_only

    @property
    def io_threads(self) -> int:
        """Threads one batch may use."""
        return self._io_threads

    def manifest(self, limits: ManifestLimits | None = None) -> FileManifest:
        """The warmup manifest: `manifest.jsonl` in the root, beside the pages. While the
        store is open, it refuses to work (StorageError) once the root's path no longer names
        the directory the store opened (see `_check_root_path`), and in a child forked from
        the process that opened the store."""
        # One made in a forked child of the process that opened the store is that process's,
        # as the store is: the child is refused both, even a call that does nothing.
        owner = None if self._state is _State.NEW else self._pid
        return FileManifest(
            self._root / _MANIFEST_NAME, limits, guard=self._check_root_path, owner_pid=owner
        )

    async def _check_root_path(self) -> None:
        """StorageError when the store is open and its root's path was replaced since (by a
        symlink, or another directory): the manifest goes by that path, where the pages go by
        the directory's descriptor, and must not follow it out of the root. StorageError too
        in a child forked from the process that opened the store."""
        if self._state is not _State.NEW and current_pid() != self._pid:
            # The store refuses the child every call; a manifest taken from it there would
            # still write the parent's root by path.
            raise StorageError(forked_error(f"the manifest of {self._name}", self._pid))
        handles = self._handles
        if handles is None:
            return
        # The lstat off the loop (a slow or hung file system); the root's identity was taken
        # when it was opened, so no descriptor is used on the thread.
        if not await asyncio.to_thread(_names_root, self._root, handles.root_id):
            raise StorageError(
                f"{self._name}: the storage root was moved away, removed, or replaced since it "
                "was opened (by a symlink or another directory); its manifest is not used until "
                "the next open"
            )

    @property
    def capabilities(self) -> StorageCapabilities:
        """Zero-copy, persistent; shared when opened with `shared=True`."""
        return StorageCapabilities(
            max_batch_pages=256,
            zero_copy=True,
            shared=self._shared,
            persistent=True,
            put_skips_stored=True,
        )

    def __repr__(self) -> str:
        return (
            f"<FileStorage {self._name} state={self._state.value} pages={len(self._index)} "
            f"bytes={self._bytes} capacity={self._capacity} reserved={self._reserved} "
            f"reading={len(self._pins)} writing={len(self._writing)} "
            f"spare={self._spares.nbytes if self._spares else 0}"
            + (f" read_only={self._read_only}" if self._read_only else "")
            + ">"
        )

    # Lifecycle.

    async def _open(self) -> None:
        holder: list[_Handles] = []

        def job(stop: threading.Event) -> tuple[int, str]:
            leftovers = self._open_job(stop, holder)
            # `access` is a system call: asked here, off the loop.
            if self._keep_leftovers:  # an inspection writes nothing: no need to say so
                return leftovers, ""
            self._looked_at = self._clock()
            return leftovers, _unwritable(holder[0]) or ""

        try:
            leftovers, unwritable = await self.run_job(job)
        except BaseException as exc:
            for handles in holder:
                handles.close()
            if isinstance(exc, OSError):  # out of descriptors, an I/O error: not a config's
                raise StorageError(
                    f"cannot open {self._name}: {exc.strerror or exc}"
                    + _DESCRIPTOR_HINTS.get(exc.errno or 0, "")
                ) from exc
            raise
        self._handles = holder[0]
        if not self._keep_leftovers:
            self._note_writable(0, unwritable)
        # Closing the descriptors releases the root's lock, if this store is collected
        # without a close (BackendBase warns): no job runs then, as each holds the store.
        self._handles_closer = weakref.finalize(self, holder[0].close)
        self._handles_closer.atexit = False  # daemon job threads may still be using them
        self._open_leftovers = self._unreported_leftovers = leftovers

    def _open_job(self, stop: threading.Event, holder: list[_Handles]) -> int:
        handles = _open_root(self._root, shared=self._shared, looking=self._keep_leftovers)
        holder.append(handles)
        # A private root is locked exclusively by now, so nobody is writing in it: every
        # temporary file is a leftover, however fresh. A shared one may have writers.
        failed: list[tuple[str, str]] = []
        unlisted: list[str] = []
        leftovers = (
            0
            if self._keep_leftovers
            else _remove_leftovers(
                handles,
                idle_s=_STALE_TMP_SHARED_S if self._shared else 0.0,
                failed=failed,
                unlisted=unlisted,
            )
        )
        self._log_stray_errors(failed)
        self._log_unlisted_tmp(handles, unlisted)
        # The index is built here too: for a million pages, sorting and indexing them on the
        # loop stalled it for seconds (an attach while serving runs this open). Nothing on the
        # loop uses the index before the open returns. Pages beyond a (shrunk) capacity stay
        # until the next put or gc() evicts them (or, in a shared root, `_trim_later`).
        self._index_found(_scan(handles, stop))
        return leftovers

    def _index_found(self, found: list[_Found]) -> None:
        """Index the pages found at open, oldest file first (a stable sort by mtime: ties in
        listing order). Runs on the job thread while the loop goes on serving, so nothing
        here may hold the GIL for long: `sorted` of a million pages did for half a second
        (a sort in C never lets go of it), numpy's sort lets go of it. What still holds it
        is the index growing: an OrderedDict rehashes in one call (0.1-0.2 s at 700 000
        pages). Empties `found`."""
        mtimes = np.fromiter((f[2] for f in found), dtype=np.float64, count=len(found))
        order = np.argsort(mtimes, kind="stable")
        del mtimes
        # A slice at a time: a million Python ints made in one call would hold the GIL too.
        for start in range(0, len(order), _BUILD_SLICE):
            for position in order[start : start + _BUILD_SLICE].tolist():
                key, nbytes, mtime = found[position]
                self._insert(key, nbytes, mtime)
        del order
        self._misfits_first(found)
        # Freed a slice at a time, for the same reason: a million tuples take ~0.1 s to free.
        while found:
            del found[-_BUILD_SLICE:]

    async def _release(self) -> None:
        # Every job has stopped: the stamper's has ended, and what it has not started yet is
        # written here, so a use just before the close still orders the next open. It is
        # awaited first: what it took and did not write goes back to the queue. Both are
        # awaited through a cancellation of the close, which must still release the root.
        interrupted: asyncio.CancelledError | None = None
        for task in (self._trimmer, self._stamper):
            if task is not None:
                task.cancel()
                cancelled = await finish_uncancelled(asyncio.wait([task]))
                interrupted = interrupted or cancelled
        pending, self._unstamped = self._unstamped, []
        try:
            if self._handles is not None and pending:
                handles = self._handles
                cancelled = await self._run_while_closing(lambda: _stamp_queued(handles, pending))
                interrupted = interrupted or cancelled
            if self._helpers is not None:
                self._helpers.shutdown(wait=False)
            if self._handles is not None:
                names = set(self._spares.names(drain=True) if self._spares is not None else ())
                with self._unremoved_tmp_lock:
                    names |= self._unremoved_tmp
                    self._unremoved_tmp.clear()
                if names:  # off the loop: freeing cached pages takes a while per file
                    tmp_fd = self._handles.tmp_fd
                    cancelled = await self._run_while_closing(lambda: _unlink_all(tmp_fd, names))
                    interrupted = interrupted or cancelled
        finally:
            # Whatever ended the steps above (a KeyboardInterrupt in one of them too), the
            # root's lock goes with the descriptors, so that a process that goes on can open
            # it again; but never under a job still running, which could then use a
            # descriptor number reused for another file.
            job = self._closing_job
            if self._handles is not None and (job is None or job.finished):
                if self._handles_closer is not None:
                    self._handles_closer.detach()
                self._handles.close()
                self._handles = None
        if interrupted is not None:
            raise interrupted

    def _abandon(self) -> None:
        # The child's copies of the descriptors only (the lock's was closed at the fork): its
        # spare files, queued stamps and temp files are the parent's.
        if self._helpers is not None:
            self._helpers.shutdown(wait=False)
        if self._handles is not None:
            if self._handles_closer is not None:
                self._handles_closer.detach()
            self._handles.close()
            self._handles = None

    def stats(self) -> StorageStats:
        """Counters and occupancy, without I/O; `refused_writes` too."""
        return msgspec.structs.replace(super().stats(), refused_writes=self._refused_writes)

    def _occupancy(self) -> tuple[int, int, int | None]:
        return len(self._index), self._bytes, self._capacity

    # Index bookkeeping (loop only).

    def _insert(self, key: bytes, nbytes: int, last_access: float) -> None:
        self._mark(key)
        entry = self._index.get(key)
        if entry is not None:
            self._bytes += nbytes - entry.nbytes
            entry.nbytes = nbytes
            entry.last_access = max(entry.last_access, last_access)
            entry.mtime = max(entry.mtime, last_access)
            return
        self._seq += 1
        self._index[key] = _Entry(nbytes, last_access, self._seq, last_access)
        self._bytes += nbytes

    def _drop(self, key: bytes) -> _Entry | None:
        self._mark(key)
        entry = self._index.pop(key, None)
        if entry is not None:
            self._bytes -= entry.nbytes
        return entry

    def _touch(self, key: bytes, now: float) -> bool:
        """Make `key` the most recently used; True when its file is due a stamp of its mtime
        (then counted as done: the caller has it written)."""
        entry = self._index.get(key)
        # A misfit stays first in line for eviction, even when a lookup finds it.
        if entry is None or not self._could_be_page(entry.nbytes):
            return False
        entry.last_access = now
        self._index.move_to_end(key)
        if entry.mtime > now - _TOUCH_AFTER_S:
            return False
        entry.mtime = now
        return True

    def _could_be_page(self, nbytes: int) -> bool:
        """Whether a file of `nbytes` can hold a page of this root (not shorter than a header,
        not longer than the capacity)."""
        return nbytes >= HEADER_NBYTES and (self._capacity is None or nbytes <= self._capacity)

    def _touch_chain(
        self,
        keys: Sequence[bytes],
        now: float,
        stamps: dict[bytes, int] | None = None,
        offset: int = 0,
    ) -> None:
        """Make the indexed `keys` the most recently used, the first of them most of all.

        A batch's keys run down a prefix chain, which is found only up to its first missing
        page: evicting a chain's deepest pages first keeps the rest of it usable. With
        `stamps`, the keys whose file is due a stamp of its mtime go there with their
        position among `keys` plus `offset` (the first, for a key given twice), for the
        caller to have written; without, the caller's job has stamped them (a read stamps
        what it reads).
        """
        # `_touch` inlined: a lookup of 64 keys is timed in microseconds.
        index = self._index
        move_to_end = index.move_to_end
        could_be_page = self._could_be_page
        stale = now - _TOUCH_AFTER_S
        for position in range(len(keys) - 1, -1, -1):
            key = keys[position]
            entry = index.get(key)
            if entry is None or not could_be_page(entry.nbytes):
                continue
            entry.last_access = now
            move_to_end(key)
            if entry.mtime <= stale:
                entry.mtime = now
                if stamps is not None:
                    stamps[key] = offset + position
            elif stamps and key in stamps:
                stamps[key] = offset + position

    async def _touch_chain_in_steps(
        self, keys: Sequence[bytes], now: float, stamps: dict[bytes, int], base: int | None = None
    ) -> None:
        """`_touch_chain` in steps of `_LOOP_SLICE` keys, the last ones first (the order one
        step gives), with a checkpoint between steps: a lookup of a hundred thousand pages
        held the loop for about 0.1 s. Cancelled between steps, it touches the keys still
        untouched at once, so the first stay the most recent (evicting them first would cut
        the chain), and the stamps its entries are due go to the stamper (`base` as for
        `_stamp_later`): their entries say so already."""
        end = len(keys)
        try:
            while end > 0:
                start = max(0, end - _LOOP_SLICE)
                self._touch_chain(keys[start:end], now, stamps, offset=start)
                end = start
                if end:
                    await self._checkpoint()
        except BaseException:
            if not self.closed:
                self._touch_chain(keys[:end], now, stamps)
                if stamps:
                    self._stamp_later(stamps, base)
            raise

    def _mark(self, key: bytes) -> None:
        """Record a change of `key`'s entry (insert, drop, removal) for observations in flight."""
        self._epoch += 1
        if self._watchers:
            self._changed[key] = self._epoch

    def _watch(self) -> int:
        """Start an observation (a read, a stat, a scan); returns its epoch for `_stale`."""
        epoch = self._epoch
        self._watchers[epoch] = self._watchers.get(epoch, 0) + 1
        return epoch

    def _unwatch(self, epoch: int) -> None:
        left = self._watchers[epoch] - 1
        if left:
            self._watchers[epoch] = left
        else:
            del self._watchers[epoch]
        if not self._watchers:
            self._changed.clear()
        elif len(self._changed) > self._prune_at:
            oldest = min(self._watchers)
            self._changed = {k: e for k, e in self._changed.items() if e > oldest}
            self._prune_at = max(_CHANGES_PRUNE_MIN, 2 * len(self._changed))

    def _stale(self, key: bytes, epoch: int) -> bool:
        """Whether what an observation started at `epoch` saw of `key` may be out of date: the
        key was put, deleted or evicted since, or is being written or removed."""
        return self._changed.get(key, 0) > epoch or key in self._writing or key in self._evicting

    async def _merge_scan(self, diff: _ScanDiff, since_seq: int, epoch: int) -> None:
        """Bring the index in line with a disk scan started when `self._seq` was `since_seq`
        and the change epoch `epoch`. Costs the loop what changed, not the store's size, in
        steps of `_LOOP_SLICE` pages with a checkpoint between them: another instance's
        hundred thousand pages took half a second in one. The caller watches `epoch` until
        this returns, so what other calls change meanwhile is never undone (`_stale`), and a
        cancellation at a checkpoint leaves a sound index, merged only in part."""
        gone, new = diff
        index = self._index
        for start in range(0, len(gone), _LOOP_SLICE):
            if start:
                await self._checkpoint()
            for key in gone[start : start + _LOOP_SLICE]:
                entry = index.get(key)
                if entry is not None and entry.seq <= since_seq and not self._stale(key, epoch):
                    self._drop(key)
        if not new:
            return
        # Pages another instance wrote take their place by their file's time (its write, or a
        # read that touched it) among this instance's own, whose order stays as it is: only
        # the entries used since the oldest such time are merged with them and moved, which
        # on a busy shared root is a short tail of the index, not all of it.
        oldest = new[0][2]
        tail: list[tuple[float, int, bytes, _Entry | int]] = []
        for key, entry in reversed(index.items()):
            if entry.last_access <= oldest:
                break
            tail.append((entry.last_access, 0, key, entry))
        tail.reverse()
        merged = heapq.merge(
            tail,
            ((mtime, 1, key, nbytes) for key, nbytes, mtime in new),
            key=lambda item: (item[0], item[1]),
        )
        # Between two steps the index runs: the entries older than every page found, this
        # instance's entries not placed yet, those placed (in merged order), and what other
        # calls put or used meanwhile (`others`), which stays the most recent of all.
        # The entries placed so far, as placed: what follows the last of them still so at the
        # MRU end was used or stored meanwhile (known by identity, not by time: a put commits
        # with the time it began, and another host's clock may run ahead).
        placed: dict[bytes, tuple[_Entry, float]] = {}
        began = (time.time(), self._seq)
        others: list[bytes] = []
        step = own = 0  # own: entries of `tail` the merge has come to
        try:
            for when, _, key, what in merged:
                step += 1
                if step > _LOOP_SLICE:
                    self._to_mru_end(others)
                    await self._checkpoint()
                    step = 1
                    others = self._used_since(placed, began)
                if isinstance(what, _Entry):  # one of this instance's entries
                    own += 1
                    if index.get(key) is not what or what.last_access != when:
                        continue  # removed, or used since: in its place already
                    index.move_to_end(key)
                    placed[key] = (what, when)
                else:  # a page found on disk
                    if key in index or self._stale(key, epoch):
                        continue
                    self._insert(key, what, when)
                    placed[key] = (index[key], when)
                    if not self._could_be_page(what):
                        self._misfit(key, what)
        except BaseException:
            # Stopped between two steps (cancelled, or the store closed): the entries not
            # placed yet are more recent than those placed, and go after them, or a later
            # rescan would leave them first in line for eviction. The pages not merged yet
            # stay on disk for the next rescan to find.
            others = self._used_since(placed, began)
            for when, _, key, what in tail[own:]:
                if index.get(key) is what and what.last_access == when:
                    index.move_to_end(key)
            self._to_mru_end(others)
            raise
        self._to_mru_end(others)
        # Freed a step at a time too: a million of them take the loop ~0.1 s to free.
        while new:
            del new[-_LOOP_SLICE:]
            await anyio.lowlevel.checkpoint()

    def _used_since(
        self, placed: dict[bytes, tuple[_Entry, float]], began: tuple[float, int]
    ) -> list[bytes]:
        """The keys at the MRU end of the index used or stored since a merge began (at time
        and sequence number `began`), in index order: they follow the last entry the merge
        placed that is still as it placed it, or the last entry that was indexed before the
        merge and not used since."""
        keys: list[bytes] = []
        if not placed:
            return keys
        when, seq = began
        for key, entry in reversed(self._index.items()):
            was = placed.get(key)
            if was is not None:
                if was[0] is entry and entry.last_access == was[1]:
                    break
            elif entry.seq <= seq and entry.last_access < when:
                break  # older than the merge and untouched: so is all before it
            keys.append(key)
        keys.reverse()
        return keys

    def _to_mru_end(self, keys: list[bytes]) -> None:
        index = self._index
        for key in keys:
            if key in index:
                index.move_to_end(key)

    async def _checkpoint(self) -> None:
        """Let the loop's other tasks run between steps of a long index change; raises the
        closed error if the store was closed meanwhile."""
        await anyio.lowlevel.checkpoint()
        self._check_open()

    def _misfits_first(self, found: list[_Found]) -> None:
        """Move the pages of `found` whose file size no page of this root can have (shorter
        than a header, longer than the capacity) to the LRU end, whatever their mtime: the
        next put or gc() evicts them before any page that may be sound. A file extended by
        someone else (a sparse `truncate -s 10G`) would otherwise count at its new size and
        make the next put evict every other page to fit it."""
        for key, nbytes, _ in found:
            if self._could_be_page(nbytes):
                continue
            entry = self._index.get(key)
            if entry is not None and entry.nbytes == nbytes:
                self._misfit(key, nbytes)

    def _misfit(self, key: bytes, nbytes: int) -> None:
        self._index.move_to_end(key, last=False)
        log.warning("storage.page.misfit", backend=self._name, key=key.hex(), nbytes=nbytes)

    async def run_job(
        self,
        work: Callable[[threading.Event], _T],
        *,
        interrupt: Callable[[], None] | None = None,
    ) -> _T:
        handles = self._handles
        # A job begun before the root was open counts as older than any retirement.
        number = -1
        if handles is not None:
            number = handles.jobs_begun
            handles.jobs_begun += 1
        running = self._running
        running[number] = running.get(number, 0) + 1
        try:
            return await super().run_job(work, interrupt=interrupt)
        finally:
            left = running[number] - 1
            if left:
                running[number] = left
            else:
                del running[number]
            handles = self._handles
            # Descriptors of directories removed (and made again) that no running job can
            # hold are closed now, not at close(), or a root emptied often runs out of them;
            # with jobs that overlap without end (a busy server), not only once none runs.
            if handles is not None and handles.has_retired:
                handles.reap_retired(min(running, default=handles.jobs_begun))

    def _handles_or_raise(self) -> _Handles:
        handles = self._handles
        if handles is None:  # only between close() and the end of jobs already running
            raise OSError(errno.EBADF, "storage is closed")
        return handles

    def _width(self, count: int, total_bytes: int) -> int:
        if self._helpers is None or count < 2 or total_bytes < _FANOUT_MIN_BYTES:
            return 1
        return min(self._io_threads, count)

    # exists.

    async def _count_in_steps(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, more than one step's, are indexed from the first, counted a
        slice of `_LOOP_SLICE` a step with a checkpoint between: a long prompt at a small
        page size has a hundred thousand keys. What it finds moves to the recent end as it
        walks, so an eviction between its steps takes pages it has not reached, never the
        first of a chain it counted (the touch after it would leave a live tail behind a
        cut); cancelled between steps, it touches what it walked as one step would."""
        index = self._index
        move_to_end = index.move_to_end
        could_be_page = self._could_be_page
        count = 0
        try:
            for start in range(0, len(keys), _LOOP_SLICE):
                if start:
                    await self._checkpoint()
                for key in keys[start : start + _LOOP_SLICE]:
                    entry = index.get(key)
                    if entry is None:
                        break
                    count += 1
                    # A misfit stays first in line for eviction (see `_touch`).
                    if could_be_page(entry.nbytes):
                        move_to_end(key)
                if count < start + _LOOP_SLICE:
                    break
        except BaseException:
            if count and not self.closed:
                owed: dict[bytes, int] = {}
                self._touch_chain(keys[:count], time.time(), owed)
                if owed:
                    self._stamp_later(owed)
            raise
        return count

    async def exists(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, counted from the first, exist consecutively.

        Answered from the index without a system call; in a shared root, keys missing from the
        index are then looked up on disk (one job) and added to it. A lookup is a use: the
        files of pages found whose mtime is a second or more behind are stamped by one job,
        which the call does not wait for (or by the lookup's own job).
        """
        # An answer from the index never suspends: a task looking up in a loop would hold
        # the loop. Taken before anything, so a call cancelled here did nothing. The package
        # runs on asyncio only, where anyio's checkpoint is this same sleep(0) behind a
        # backend lookup that cost a 64-key lookup about 10% (15.3 us against 16.8 us).
        await asyncio.sleep(0)
        self._check_open()
        index = self._index
        count = 0
        try:
            if len(keys) <= _LOOP_SLICE:  # one step, the common case: timed in microseconds
                for key in keys:
                    if key not in index:
                        break
                    count += 1
            else:
                count = await self._count_in_steps(keys)
        except TypeError:  # an unhashable key
            check_keys(keys)
            raise
        # The index holds only page keys: the ones found are sound, so only the rest need
        # checking (the common all-found call pays nothing).
        check_keys(keys[count:])
        now = time.time()
        stamps: dict[bytes, int] = {}
        # A lookup is a use: a prefix every new chain is checked against stays stored.
        if count > _LOOP_SLICE:
            await self._touch_chain_in_steps(keys[:count], now, stamps)
        else:
            self._touch_chain(keys[:count], now, stamps)
        if count == len(keys) or not self._shared:
            if stamps:
                self._stamp_later(stamps)
            return count
        rest = list(keys[count:])
        known = [key in index for key in rest]
        base = time.time_ns()  # the job's stamps and the later ones fall from one time
        found: list[_Found] = []
        began: list[bool] = []  # set by the job unless it was given up before it began
        epoch = self._watch()
        try:
            more = await self.run_job(
                lambda stop: self._stat_job(
                    stop, rest, known, found, stamps, offset=count, base=base, began=began
                )
            )
        finally:
            if not began and stamps:  # the use the index counted reaches the disk
                if self.closed:
                    # A close that began as the job returned: its release writes them.
                    self._unstamped.append((base, stamps))
                else:
                    self._stamp_later(stamps, base)
            fresh = [item for item in found if not self._stale(item[0], epoch)]
            for key, nbytes, mtime in fresh:
                self._insert(key, nbytes, mtime)
            self._misfits_first(fresh)
            self._unwatch(epoch)
            if fresh:
                self._trim_later()
        # Indexed keys past the first missing one were not looked at: their stamps go to
        # the stamper (those found on disk were stamped by the job).
        late: dict[bytes, int] = {}
        await self._touch_chain_in_steps(keys[: count + more], now, late, base)
        if late:
            self._stamp_later(late, base)
        return count + more

    def _stamp_later(self, stamps: dict[bytes, int], base: int | None = None) -> None:
        """Queue the stamps of a call (key -> position) for the stamper task, started if none
        runs: one job writes what calls queued meanwhile, and no call waits for it. `base`
        is the call's time in ns, when some of its stamps were written already."""
        self._unstamped.append((time.time_ns() if base is None else base, stamps))
        if self._stamper is None:
            self._stamper = asyncio.get_running_loop().create_task(self._run_stamper())

    def _trim_later(self) -> None:
        """Start the eviction of what a shared root's lookups indexed beyond the capacity,
        unless one runs: pages another instance stored and this one found on disk count
        as its own do, and a store whose puts all find their pages stored (instances that
        store the same pages, the other first) would otherwise index every page it ever
        found, long after the other instance evicted it."""
        if self._trimmer is None and self._capacity is not None and self._excess() > 0:
            self._trimmer = asyncio.get_running_loop().create_task(self._run_trimmer())

    async def _run_trimmer(self) -> None:
        try:
            await self._evict_in_stead(set(), set())
        except (StorageError, OSError):  # closing
            return
        finally:
            self._trimmer = None

    async def _run_stamper(self) -> None:
        try:
            while self._unstamped:
                queued, self._unstamped = self._unstamped, []
                try:
                    await self._stamp_job(queued)
                except (StorageError, OSError):  # closing: `_release` writes them
                    self._unstamped[:0] = queued
                    return
                except BaseException:  # cancelled by `_release`, which writes them
                    self._unstamped[:0] = queued
                    raise
        finally:
            self._stamper = None

    async def _stamp_job(self, queued: list[tuple[int, dict[bytes, int]]]) -> None:
        await self.run_job(lambda _: _stamp_queued(self._handles_or_raise(), queued))

    def _stat_job(
        self,
        stop: threading.Event,
        keys: list[bytes],
        known: list[bool],
        found: list[_Found],
        stamps: dict[bytes, int],
        *,
        offset: int,
        base: int,
        began: list[bool],
    ) -> int:
        """How many of `keys` are there, from the first; those not `known` (indexed) are
        looked at, and go to `found`. The files of `stamps` (keys before `keys`, at their
        positions) and of pages found a second or more old are stamped, falling from the
        first key to the last from `base` (ns), as `_touch_chain` orders them.

        Given up by its caller's cancellation before it began, it touches no file: nobody
        takes the answer, and the caller waits for the job. `began` stays empty, and the
        caller hands `stamps` to the stamper. A close's stop still stamps (see `_stamp_all`).
        """
        if stop.is_set() and not self.closed:
            return 0
        began.append(True)
        handles = self._handles_or_raise()
        _stamp_all(handles, stamps, base)
        for position, key in enumerate(keys):
            if stop.is_set():
                return position
            if known[position]:
                continue
            hexkey = key.hex()
            try:
                shard_fd = handles.shard(hexkey[:2], create=False)
                if shard_fd is None:
                    return position
                st = os.stat(hexkey, dir_fd=shard_fd, follow_symlinks=False)
            except OSError:
                return position
            if not stat.S_ISREG(st.st_mode):
                return position
            if self._stuck and self._stuck.seen(key, st):
                # A corrupt page that could not be removed: a get misses it, and a stamp
                # would make it another file to the next get, read and reported again.
                return position
            mtime = st.st_mtime
            stamp = base - (offset + position) * _STAMP_STEP_NS
            if stamp - st.st_mtime_ns >= _TOUCH_AFTER_NS and _stamp(handles, hexkey, stamp):
                mtime = stamp / 1e9
            found.append((key, st.st_size, mtime))
        return len(keys)

    # get.

    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        """Read each page straight into its buffer; one outcome per key.

        A corrupt page is removed; a page of a newer format version is a miss left in place.
        """
        self._check_open()
        check_batch(keys, ("buffers", into))
        check_keys(keys, namespace)
        outcomes = [Outcome.MISS] * len(keys)
        todo = [i for i, key in enumerate(keys) if self._shared or key in self._index]
        if len(todo) < len(keys):
            # A bad buffer is the caller's error whether or not its key is stored (the read
            # job checks the buffers it reads into, before any I/O).
            reading = set(todo)
            for i, page in enumerate(into):
                if i not in reading:
                    byte_segments(page, writable=True)
        self._counters.gets += len(keys)
        if not todo:
            await anyio.lowlevel.checkpoint()  # answered from the index: see `exists`
            return outcomes
        todo_keys = [keys[i] for i in todo]
        todo_pages = [into[i] for i in todo]
        pins = self._pins
        for key in todo_keys:
            pins[key] = pins.get(key, 0) + 1
        job = _Job(len(todo))
        epoch = self._watch()
        try:
            await self.run_job(
                lambda stop: self._read_job(stop, job, todo_keys, todo_pages, namespace)
            )
        except asyncio.CancelledError:
            job.cancelled = True
            raise
        finally:
            for key in todo_keys:
                left = pins[key] - 1
                if left:
                    pins[key] = left
                else:
                    del pins[key]
            indexed = self._commit_read(job, todo, todo_keys, outcomes, epoch)
            self._unwatch(epoch)
            if indexed:
                self._trim_later()
        hits = [k for k, o in zip(keys, outcomes, strict=True) if o is Outcome.OK]
        self._touch_chain(hits, time.time())
        return outcomes

    def _read_job(
        self,
        stop: threading.Event,
        job: _Job,
        keys: list[bytes],
        pages: list[PageBuffer],
        namespace: bytes,
    ) -> None:
        handles = self._handles_or_raise()
        segments = job.segments(pages, writable=True)  # before any I/O
        sizes = [sum([view.nbytes for view in views]) for views in segments]
        results = job.results
        base = time.time_ns()
        # Only a shared root's eviction reads what its jobs stamped (`_used_elsewhere`).
        touched = job.touched if self._shared else None

        def work(i: int) -> None:
            stamp = base - i * _STAMP_STEP_NS  # the first hit the most recent, as in the index
            results[i] = self._read_one(
                handles,
                keys[i],
                segments[i],
                sizes[i],
                namespace,
                stamp_ns=stamp,
                touched=touched,
                slot=i,
            )

        fan_out(self._helpers, len(keys), work, stop, self._width(len(keys), sum(sizes)))

    def _read_one(
        self,
        handles: _Handles,
        key: bytes,
        segments: list[memoryview],
        expected: int,
        namespace: bytes,
        *,
        stamp_ns: int,
        touched: dict[int, int] | None = None,
        slot: int = 0,
    ) -> _Result:
        """Read the page of `key` into `segments`; a sound page's file is stamped with
        `stamp_ns` when it is a second or more older, recorded in `touched` at `slot`."""
        hexkey = key.hex()
        try:
            shard_fd = handles.shard(hexkey[:2], create=False)
        except _RefusedShardError:
            return (_MISS, "", 0)  # never read from (logged when refused)
        except OSError as exc:
            if exc.errno in (errno.ENOTDIR, errno.ELOOP):  # a file or symlink: no shard
                return (_MISS, "", 0)
            return (_ERROR, f"shard directory: {exc.strerror}", 0)
        if shard_fd is None:
            return (_MISS, "", 0)
        try:
            fd = os.open(hexkey, _READ_FLAGS, dir_fd=shard_fd)
        except FileNotFoundError:
            return (_MISS, "", 0)
        except PermissionError as exc:
            opened = _open_or_remove_unreadable(
                shard_fd, key, self._stuck, policy=self._policy_refused
            )
            if opened is None or opened == "stuck":
                return (_MISS, "", 0)
            if opened in ("refused", "changed"):
                return (_UNSUPPORTED, "", 0)  # a miss that leaves the page and index alone
            if isinstance(opened, str):
                if not opened:
                    return (_ERROR, f"open: {exc.strerror}", 0)
                return (_CORRUPT, "unreadable", 0)
            fd = opened
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                return (_ERROR, f"open: {exc.strerror}", 0)
            with contextlib.suppress(OSError):  # a symlink where a page belongs
                _remove_if_same(shard_fd, hexkey, None)
            return (_CORRUPT, "symlink", 0)
        handles.read_from(hexkey[:2], shard_fd)
        if self._policy_refused:  # opened now: a later refusal is news
            self._policy_refused.forget(key)
        try:
            st = os.fstat(fd)
            if self._stuck and self._stuck.seen(key, st):
                return (_MISS, "", 0)
            result = self._read_fd(fd, st, key, segments, expected=expected, namespace=namespace)
            if result[0] == _OK and stamp_ns - st.st_mtime_ns >= _TOUCH_AFTER_NS:
                # The mtime is the page's last use: the next open orders eviction by it.
                with contextlib.suppress(OSError):
                    os.utime(fd, ns=(stamp_ns, stamp_ns))
                    if touched is not None:
                        touched[slot] = stamp_ns
        except OSError as exc:
            return (_ERROR, f"read: {exc.strerror}", 0)
        finally:
            os.close(fd)
        if result[0] == _CORRUPT:
            try:
                removed = _remove_if_same(shard_fd, hexkey, st, gone=False)
            except OSError:  # still reported, once; verify() retries the removal
                if not self._stuck.add(key, st):
                    # Another read in flight at once met it first and reports it.
                    return (_MISS, "", 0)
            else:
                if not removed and _exists(shard_fd, hexkey):
                    # Rewritten while it was read: what was read is torn, and the page now
                    # there is another. A miss that removes nothing and leaves the index
                    # alone.
                    return (_UNSUPPORTED, "", 0)
                if not removed:
                    # Removed meanwhile: by another read in flight at once, which reports
                    # it, or by a delete.
                    return (_MISS, "", 0)
        return result

    def _read_fd(
        self,
        fd: int,
        st: os.stat_result,
        key: bytes,
        segments: list[memoryview],
        *,
        expected: int,
        namespace: bytes,
    ) -> _Result:
        size = st.st_size
        if not stat.S_ISREG(st.st_mode):
            return (_CORRUPT, "not a regular file", size)
        if st.st_uid != self._uid:
            # Put there by another user (into a directory that was once group-writable, say):
            # a sound page of theirs is still not one an instance of this root wrote.
            return (_CORRUPT, "owner", size)
        # The header on its own: header and payload in one read measured 0.5x to 0.8x as fast
        # on files not cached, and no faster on cached ones (docs/benchmarks.md, 2026-11-28).
        header_buf = memoryview(bytearray(HEADER_NBYTES))
        got = _preadv_full(fd, [header_buf], 0, HEADER_NBYTES)
        header = decode_header(header_buf) if got == HEADER_NBYTES else PageCheck.CORRUPT
        if header is PageCheck.UNSUPPORTED:
            return (_UNSUPPORTED, "", size)
        if isinstance(header, PageCheck):
            return (_CORRUPT, "header", size)
        mismatch = _header_mismatch(header, key, namespace, expected)
        if mismatch == "namespace":
            return (_UNSUPPORTED, "", size)  # another deployment's page: a miss, left alone
        if mismatch == "length" and size == HEADER_NBYTES + header.payload_nbytes:
            # Sound, but not as long as the reader's buffer: the reader may be the one in the
            # wrong, so a miss that deletes nothing.
            return (_UNSUPPORTED, "", size)
        if mismatch:
            return (_CORRUPT, mismatch, size)
        if size != HEADER_NBYTES + expected:
            return (_CORRUPT, "size", size)
        # Read and checksum in one pass: each piece is hashed while it is still in the cache.
        read, digest = _native.pread_checksum(fd, HEADER_NBYTES, segments)
        if read != expected:
            return (_CORRUPT, "truncated", size)
        if digest != header.checksum:
            return (_CORRUPT, "checksum", size)
        mac_key = self._mac_key
        if (
            mac_key
            and verify_payload(header, segments, mac_key=mac_key, checksum=digest)
            is not PageCheck.OK
        ):
            return (_CORRUPT, "mac", size)
        return (_OK, "", size)

    def _commit_read(
        self, job: _Job, todo: list[int], keys: list[bytes], outcomes: list[Outcome], epoch: int
    ) -> bool:
        """Record a read started at change epoch `epoch`; what it saw of a key changed since
        is left out of the index (a delete, put or eviction decided later). Returns whether
        it indexed a page found on disk (a shared root's)."""
        if job.rejected:  # bad buffers, refused before any I/O: the call did not happen
            self._counters.gets -= len(outcomes)
            return False
        indexed = False
        now = time.time()
        counters = self._counters
        errors = _PageErrors()
        for slot, (i, key) in enumerate(zip(todo, keys, strict=True)):
            result = job.results[slot]
            if result is None:  # stopped by close() (or cancelled: nobody looks)
                outcomes[i] = Outcome.ERROR
                counters.errors += not job.cancelled
                continue
            code, detail, nbytes = result
            if code == _OK:
                outcomes[i] = Outcome.OK
                counters.get_hits += 1
                if self._stale(key, epoch):
                    continue
                entry = self._index.get(key)
                if entry is None:
                    self._insert(key, nbytes, now)  # found on disk in a shared root
                    indexed = True
                elif slot in job.touched:
                    # The job's stamp, not another instance's use (see `_used_elsewhere`).
                    entry.mtime = max(entry.mtime, job.touched[slot] / 1e9)
            elif code == _MISS:
                if not self._stale(key, epoch):
                    self._drop(key)  # deleted by another instance
            elif code == _UNSUPPORTED:
                pass  # a newer writer's page: a miss for us, kept for it
            elif code == _CORRUPT:
                outcomes[i] = Outcome.CORRUPT
                if not self._stale(key, epoch):
                    self._drop(key)
                self._report_corrupt(key, detail)
            else:
                outcomes[i] = Outcome.ERROR
                counters.errors += 1
                errors.add(key, detail)
        errors.log(self._name, self._page_errors_log)
        return indexed

    # put.

    async def put(
        self, keys: Sequence[bytes], pages: Sequence[PageBuffer], metas: Sequence[PageMeta]
    ) -> list[Outcome]:
        """Store each page atomically (temporary file, then rename); one outcome per key.

        An existing key is kept as is (OK); in a shared root its file is looked at first, and
        written again if another instance removed it (a key another batch of this instance
        is writing or looking at is a MISS: that batch's outcome is not known yet). A page
        larger than the capacity, or that does not fit even after evicting every page not
        being read, is a MISS, as is every later page of the batch not stored already.

        The files written get mtimes falling from the first key to the last, the order the
        index gives them, and a page there already is a use whose file's mtime is stamped
        (when a second or more old) by the batch's job, or by a job the call does not wait
        for when nothing is written.
        """
        self._check_open()
        check_put(keys, pages, metas)
        outcomes = [Outcome.OK] * len(keys)
        self._counters.puts += len(keys)
        now = time.time()
        index = self._index
        slots: dict[bytes, int] = {}
        writes: list[int] = []
        sizes: list[int] = []
        duplicates: list[tuple[int, int]] = []
        stamps: dict[bytes, int] = {}
        # A batch runs down a prefix chain: past a page it cannot store, its pages would be
        # unreachable, so storing them would only evict reachable ones.
        full = False
        for i, key in enumerate(keys):
            if key in index and not self._shared:
                if self._touch(key, now):
                    stamps[key] = i
            elif key in slots:
                duplicates.append((i, slots[key]))
            elif key in self._writing or key in self._evicting:
                outcomes[i] = Outcome.MISS  # another batch is writing or removing it
            else:
                size = HEADER_NBYTES + payload_nbytes(pages[i])
                entry = index.get(key)
                oversize = self._capacity is not None and size > self._capacity
                if oversize or (full and entry is None):
                    full = True
                    outcomes[i] = Outcome.MISS
                    continue
                if entry is not None:
                    # Shared root: another instance may have removed the file since this one
                    # indexed it. The job looks and rewrites it if so, at this page's size:
                    # room is planned for what that adds to the size indexed (none past a
                    # page that did not fit: a page stored already stays OK, as in a private
                    # root).
                    self._touch(key, now)
                    size = 0 if full else max(0, size - entry.nbytes)
                slots[key] = len(writes)
                writes.append(i)
                sizes.append(size)
        keep = set(keys)
        # Victims left in place once in this call (another instance used them since): when
        # their turn comes again, after every other page, they go without a second look.
        spared: set[bytes] = set()
        victims, admitted = self._plan_room(sizes, keep=keep, limit=_LOOP_SLICE)
        if admitted < 0:  # more victims than one step on the loop should take
            try:
                victims, admitted = await self._room_in_rounds(
                    sizes, keep, [keys[i] for i in writes], spared
                )
            except asyncio.CancelledError:
                for i in writes:
                    outcomes[i] = Outcome.MISS
                self._count_put(outcomes, duplicates, writes)
                raise
        for i in writes[admitted:]:
            outcomes[i] = Outcome.MISS
        writes, sizes = writes[:admitted], sizes[:admitted]
        try:
            if writes or victims:
                no_room = await self._write_batch(
                    keys=keys,
                    pages=pages,
                    metas=metas,
                    writes=writes,
                    sizes=sizes,
                    victims=victims,
                    spared=spared,
                    stamps=stamps,
                    outcomes=outcomes,
                    now=now,
                )
                owed = no_room.spared
                if no_room.pages:
                    owed += await self._write_again(
                        keys=keys,
                        pages=pages,
                        metas=metas,
                        no_room=no_room,
                        spared=spared,
                        outcomes=outcomes,
                        now=now,
                    )
                if owed and self._capacity is not None:
                    await self._evict_in_stead(keep, spared)
            else:
                if stamps:
                    self._stamp_later(stamps)
                # Nothing to write never suspends otherwise (see `exists`).
                await anyio.lowlevel.checkpoint()
        except asyncio.CancelledError:
            self._count_put(outcomes, duplicates, writes)  # what the job stored still counts
            raise
        self._count_put(outcomes, duplicates, writes)
        self._touch_chain([k for k, o in zip(keys, outcomes, strict=True) if o is Outcome.OK], now)
        return outcomes

    def _count_put(
        self, outcomes: list[Outcome], duplicates: list[tuple[int, int]], writes: list[int]
    ) -> None:
        for i, slot in duplicates:
            outcomes[i] = outcomes[writes[slot]] if slot < len(writes) else Outcome.MISS
        self._counters.put_ok += outcomes.count(Outcome.OK)

    def _evictable(self, key: bytes) -> bool:
        """Neither being read nor being written (a shared root's put of an indexed key)."""
        return key not in self._pins and key not in self._writing

    def _candidates(self, keep: set[bytes]) -> Iterator[tuple[bytes, _Entry]]:
        """Pages that may be evicted, least recently used first: none being read or written,
        none in `keep`."""
        return (
            (key, entry)
            for key, entry in self._index.items()
            if self._evictable(key) and key not in keep
        )

    def _plan_room(
        self, sizes: list[int], *, keep: set[bytes], limit: int | None = None
    ) -> tuple[list[bytes], int]:
        """LRU victims that make room for the first pages of `sizes`, and how many fit; with
        `limit`, (the first `limit` victims, -1) when more would be needed.

        Never picks a page being read (pinned) or one in `keep`.
        """
        if self._capacity is None:
            return [], len(sizes)
        free = self._capacity - self._bytes - self._reserved
        victims: list[bytes] = []
        candidates = self._candidates(keep)
        admitted = 0
        for size in sizes:
            if size == 0:  # a key indexed at this size or larger: its room is counted already
                admitted += 1
                continue
            marked, freed = len(victims), free
            while free < size and (candidate := next(candidates, None)) is not None:
                if len(victims) == limit:
                    return victims, -1
                victims.append(candidate[0])
                free += candidate[1].nbytes
            if free < size:
                del victims[marked:]  # this page does not fit: evict nothing for it
                free = freed
                break
            free -= size
            admitted += 1
        return victims, admitted

    async def _room_in_rounds(
        self, sizes: list[int], keep: set[bytes], writes: list[bytes], spared: set[bytes]
    ) -> tuple[list[bytes], int]:
        """`_plan_room`'s plan for a put whose pages need more than `_LOOP_SLICE` victims: the
        least recently used pages are evicted first, `_LOOP_SLICE` a round, each round one
        job, until the rest of the plan takes no more (a put after a reopen with a smaller
        capacity evicted a hundred thousand pages in one step of the loop). Only pages that
        fit once every page that may go has gone are made room for; `writes` (the keys to be
        written) are marked as being written meanwhile, so no other call writes or evicts
        them. The plan returned is for the caller to carry out in the same step. Victims
        another instance used since go to `spared` (see `_evict`), and later rounds go on
        past them."""
        assert self._capacity is not None
        self._writing.update(writes)
        try:
            while True:
                sizes = sizes[: self._fitting(sizes, keep)]
                victims, admitted = self._plan_room(sizes, keep=keep, limit=_LOOP_SLICE)
                if admitted >= 0:
                    return victims, admitted
                left = len(spared)
                evicted, _, _ = await self._evict(victims, spared, for_put=True)
                if not evicted and len(spared) == left:
                    # Every file of the round stayed, none for a use elsewhere (those go
                    # without a look next time): no rounds can make room.
                    return self._plan_room(sizes, keep=keep)
        finally:
            self._writing.difference_update(writes)

    def _fitting(self, sizes: list[int], keep: set[bytes]) -> int:
        """How many of the first pages of `sizes` fit once every page that may be evicted has
        been (`_plan_room` admits that many), counted without walking the index."""
        assert self._capacity is not None
        index = self._index
        held = 0  # indexed bytes no eviction may take
        for key in {*self._pins, *self._writing, *keep}:
            entry = index.get(key)
            if entry is not None:
                held += entry.nbytes
        room = self._capacity - self._reserved - held
        fits = 0
        for size in sizes:
            if size > room and size:
                break
            room -= size
            fits += 1
        return fits

    async def _evict(
        self,
        victims: list[bytes],
        spared: set[bytes] | None = None,
        *,
        need: int | None = None,
        for_put: bool = False,
        unremoved: _Unremoved | None = None,
        only_unlinked: bool = False,
    ) -> tuple[int, int, list[bytes]]:
        """Evict the indexed `victims` (none being read or written) in one job; returns the
        pages evicted, their bytes, and the keys whose file could not be removed (back in the
        index, at the MRU end). With `spared` (a shared root), a victim another instance used
        since this one did stays, at the MRU end, and goes into `spared`, unless it is there
        already: then it goes without a look. With `need`, the job stops once the victims
        gone (or whose file could not be removed) hold that many bytes: those it did not
        come to stay, first in line. Files that stay go to `unremoved` when given, else are
        logged at the end of the job. With `only_unlinked`, the pages and bytes returned
        leave out victims whose file was already gone (another instance sharing the root
        removed it first): they left the index, but this call removed nothing."""
        removed = [(key, self._drop(key)) for key in victims]
        seen = self._last_seen(removed, spared)
        sizes = [] if need is None else [0 if e is None else e.nbytes for _, e in removed]
        self._evicting.update(victims)
        job = _Job(len(victims))
        epoch = self._watch()
        try:
            await self.run_job(
                lambda stop: self._unlink_job(
                    stop,
                    job,
                    victims,
                    event="storage.evict.error",
                    seen=seen,
                    need=None if need is None else (need, sizes),
                    limiter=self._page_errors_log if for_put else None,
                    unremoved=unremoved,
                )
            )
        finally:
            self._evicting.difference_update(victims)
            self._commit_removal(removed, job, evictions=True, epoch=epoch)
            self._unwatch(epoch)
            if spared is not None:
                spared.update(victims[position] for position in job.spared)
        uncounted = {*job.failed, *job.spared}
        if only_unlinked:
            uncounted.update(
                position
                for position, result in enumerate(job.results[: job.done])
                if result is not None and result[0] == _MISS
            )
        freed = sum(
            entry.nbytes
            for position, (_, entry) in enumerate(removed[: job.done])
            if entry is not None and position not in uncounted
        )
        return job.done - len(uncounted), freed, [victims[position] for position in job.failed]

    def _last_seen(
        self, removed: list[tuple[bytes, _Entry | None]], spared: set[bytes] | None
    ) -> list[float | None] | None:
        """Per victim, its file's mtime as this instance last saw or set it, for
        `_used_elsewhere` (None for a misfit, first in line whoever uses it, and for a victim
        in `spared`, left in place once already by the same call); None for a private root,
        which no other instance uses, and without `spared`."""
        if not self._shared or spared is None:
            return None
        return [
            entry.mtime
            if entry is not None and self._could_be_page(entry.nbytes) and key not in spared
            else None
            for key, entry in removed
        ]

    async def _evict_in_stead(self, keep: set[bytes], spared: set[bytes]) -> None:
        """Evict least recently used pages while the store is over its capacity: a put's
        victims stayed, another instance having used them since this one did. Such pages are
        tried again after every other page, then without a look (`spared`), so the put leaves
        the store within its capacity whoever uses its pages; a page whose file could not be
        removed counts as gone (no other goes in its place). None in `keep`. Each round offers
        its job twice as many pages as the one before if some stayed (at most `_LOOP_SLICE`),
        and the job takes only what it needs: a store whose least recently used pages another
        instance keeps using is gone through in a few jobs, not one a page.

        Down to the capacity, not by the put's own victims that stayed: the pages a round
        offers are out of the index while its job looks at them, and a put or another
        eviction meanwhile counted the room of those the job then left as free."""
        failed: set[bytes] = set()
        unremoved = 0
        reach = 1
        while (owed := self._excess() - unremoved) > 0:
            sizes: dict[bytes, int] = {}  # the round's victims, in LRU order
            offered = 0
            for key, entry in self._candidates(keep):
                if offered >= owed * reach or len(sizes) == _LOOP_SLICE:
                    break
                if key not in failed:
                    sizes[key] = entry.nbytes
                    offered += entry.nbytes
            if not sizes:
                return
            before = len(spared)
            _, _, stayed = await self._evict(list(sizes), spared, need=owed, for_put=True)
            failed.update(stayed)
            # Back in the index, counted as gone.
            unremoved += sum(sizes[key] for key in stayed if key in self._index)
            if len(spared) > before:
                reach = min(2 * reach, _LOOP_SLICE)

    def _plan_disk_room(
        self, pages: list[tuple[int, str]], room: _DiskRoom, *, keep: set[bytes]
    ) -> _DiskPlan:
        """LRU victims that make room on the disk, whatever the capacity, for the first pages
        of `pages` ((file size, shard directory), in batch order) that the file system had
        none for. The spare files (the job releases them first) and the free bytes and
        inodes in `room` count before any victim, and only the resource that is short asks
        for more. A page that evicting every other page would not make room for is planned
        no victim: it and the pages after it are left out, as `_plan_room` leaves them.
        Never picks a page being read or written, or one in `keep`."""
        handles = self._handles_or_raise()
        spares = self._spares
        room = self._room_left(room)
        block = room.block
        free_bytes = room.nbytes + (spares.disk_nbytes if spares is not None else 0)
        free_files = room.files
        if free_files is not None and spares is not None:
            free_files += spares.files
        made: set[str] = set()  # shard directories the planned pages make
        victims: list[bytes] = []
        candidates = self._candidates(keep)
        admitted = need_bytes = need_files = 0
        # Once for the batch: tmp/ or a shard directory that grows (an indexed directory
        # splitting takes two blocks).
        growth = _DISK_GROWTH_BLOCKS * block

        def short(nbytes: int, files: int) -> bool:
            return free_bytes < nbytes or (free_files is not None and free_files < files)

        for size, shard in pages:
            # Out of inodes, a shard directory not made yet costs one (and a block) more,
            # once for all the pages that go into it.
            directory = shard not in made and not handles.opened(shard)
            nbytes = _disk_need(size, block) + directory * block + growth
            files = 1 + directory
            marked, saved = len(victims), (free_bytes, free_files)
            while short(nbytes, files) and (candidate := next(candidates, None)) is not None:
                victims.append(candidate[0])
                free_bytes += _in_blocks(candidate[1].nbytes, block)
                free_files = None if free_files is None else free_files + 1
            if short(nbytes, files):
                del victims[marked:]  # this page does not fit: evict nothing for it
                free_bytes, free_files = saved
                break
            free_bytes -= nbytes
            free_files = None if free_files is None else free_files - files
            if directory:
                made.add(shard)
            growth = 0
            admitted += 1
            need_bytes += nbytes
            need_files += files
        return _DiskPlan(
            victims=victims,
            admitted=admitted,
            nbytes=max(0, need_bytes - room.nbytes),
            files=0 if room.files is None else max(0, need_files - room.files),
        )

    def _room_left(self, room: _DiskRoom) -> _DiskRoom:
        """`room` less what this store's writes took since it was taken and what those in
        flight will still take: two puts on a full disk must not both plan for the same
        free blocks, or for the blocks a victim of the other one freed."""
        written = self._claims.written()
        pending = self._claims.pending()
        nbytes = max(0, room.nbytes - (written[0] - room.written[0]) - pending[0])
        files = room.files
        if files is not None:
            files = max(0, files - (written[1] - room.written[1]) - pending[1])
        return room._replace(nbytes=nbytes, files=files, written=written)

    async def _write_again(
        self,
        *,
        keys: Sequence[bytes],
        pages: Sequence[PageBuffer],
        metas: Sequence[PageMeta],
        no_room: _NoRoom,
        spared: set[bytes],
        outcomes: list[Outcome],
        now: float,
    ) -> int:
        """Write once more the pages of a batch that the file system had no room for: the
        job first releases the spare files, then evicts the least recently used pages that
        the room left short of those pages needs. Planned here in one step, as a put's first
        round, page by page in batch order; a page that no eviction could make room for, the
        pages after it, and any that still finds no room, are MISSes. Returns the bytes of
        victims left in place (see `_write_batch`)."""
        plan = _DiskPlan([], 0, 0, 0)
        if no_room.room is not None:
            needs = [
                (HEADER_NBYTES + payload_nbytes(pages[i]), keys[i].hex()[:2])
                for i, _, _ in no_room.pages
            ]
            plan = self._plan_disk_room(needs, no_room.room, keep=set(keys))
        retried, refused = no_room.pages[: plan.admitted], no_room.pages[plan.admitted :]
        if plan.victims or plan.nbytes or plan.files or refused:
            self._log_disk_full(plan, refused=len(refused))
        given_up = [(keys[i], detail) for i, _, detail in refused]
        if not retried:
            errors = _PageErrors()
            self._refuse(errors, given_up)
            errors.log(self._name, self._page_errors_log)
            return 0
        again = await self._write_batch(
            keys=keys,
            pages=pages,
            metas=metas,
            writes=[i for i, _, _ in retried],
            sizes=[size for _, size, _ in retried],
            victims=plan.victims,
            spared=spared,
            stamps={},
            outcomes=outcomes,
            now=now,
            again=True,
            given_up=given_up,
        )
        return again.spared

    def _log_disk_full(self, plan: _DiskPlan, *, refused: int) -> None:
        """Log `storage.disk.full` for a second try, unless it was logged in the last
        `_DISK_FULL_LOG_S`: a disk that someone else keeps full evicts below the capacity,
        which the operator should hear of, but once a while (on such a disk some puts find
        room all the time, so room found does not restart the count)."""
        clock = time.monotonic()
        if self._disk_full_logged is not None and clock - self._disk_full_logged < (
            _DISK_FULL_LOG_S
        ):
            return
        self._disk_full_logged = clock
        log.warning(
            "storage.disk.full",
            backend=self._name,
            pages=plan.admitted,
            refused=refused,
            victims=len(plan.victims),
            bytes=plan.nbytes,
            inodes=plan.files,
        )

    def _look_due(self, results: list[_Result | None]) -> bool:
        """Whether a write job looks at the root (`_unwritable`, an access check of each
        directory) after its writes `results`: at once when they tell of a change (a write
        refused by a mode while none was known, or one landed while tmp/ was not writable),
        else while a directory is not writable at most every `_LOOK_AGAIN_S`, so that puts
        into shard directories made already (which land while pages/ is not writable) do not
        each ask again. Write jobs only (worker threads)."""
        read_only = self._read_only
        clock = self._clock()
        if read_only is None:
            due = any(result is not None and result[1] == _MODE_REFUSED for result in results)
        else:
            due = clock - self._looked_at >= _LOOK_AGAIN_S or (
                read_only == _TMP and any(r is not None and r[0] == _OK for r in results)
            )
        if due:
            self._looked_at = clock
        return due

    def _note_writable(self, look: int, unwritable: str) -> None:
        """Record what the look numbered `look` at the root found: `unwritable`, the directory
        this user may not write (`_unwritable`), or "" when it may write both; one older than
        a look recorded already is left out. Each change is logged once: a reader's instance
        of a shared root, or a root whose mode changed, refuses every put, which the per-page
        errors alone do not say."""
        if look < self._look_noted:
            return
        self._look_noted = look
        handles = self._handles
        if unwritable == (self._read_only or "") or handles is None:
            return
        root = handles._pages_path.parent
        if unwritable:
            # Shard directories made already may still be writable under a pages/ that is not.
            refused = "every put" if unwritable == _TMP else "a put into a new shard directory"
            log.warning(
                "storage.root.read_only",
                backend=self._name,
                directory=str(root / unwritable),
                error=f"this user (uid {os.geteuid()}) may not write into it: {refused} is "
                "refused, a MISS counted in refused_writes; give the store's user write "
                f"permission (chmod -R u+rwX {shlex.quote(str(root))})",
            )
        else:
            log.info("storage.root.writable", backend=self._name, root=str(root))
        self._read_only = unwritable or None

    def _refuse(self, errors: _PageErrors, pages: list[tuple[bytes, str]]) -> None:
        """Count pages (key, error) the file system refused as `refused_writes`, their
        errors in `errors`: each is a MISS, not an error a caller would retry."""
        self._refused_writes += len(pages)
        for key, detail in pages:
            errors.add(key, detail)

    async def _write_batch(
        self,
        *,
        keys: Sequence[bytes],
        pages: Sequence[PageBuffer],
        metas: Sequence[PageMeta],
        writes: list[int],
        sizes: list[int],
        victims: list[bytes],
        spared: set[bytes],
        stamps: dict[bytes, int],
        outcomes: list[Outcome],
        now: float,
        again: bool = False,
        given_up: Sequence[tuple[bytes, str]] = (),
    ) -> _NoRoom:
        """Write the pages at `writes` after evicting `victims` (see `_evict` for `spared`);
        the pages the file system had no room for, for `_write_again` (none when `again`:
        this is that second try, whose pages without room are MISSes, as are those it left
        out, `given_up`, logged with it), and the bytes of victims left in place."""
        write_keys = [keys[i] for i in writes]
        write_pages = [pages[i] for i in writes]
        write_metas = [metas[i] for i in writes]
        reserve = sum(sizes)
        # Plan: reserve room, claim it on the disk, mark keys, take victims out of the index,
        # in one step.
        self._reserved += reserve
        claims = self._claims.claim(HEADER_NBYTES + payload_nbytes(page) for page in write_pages)
        self._writing.update(write_keys)
        removed = [(key, self._drop(key)) for key in victims]
        seen = self._last_seen(removed, spared)
        self._evicting.update(victims)
        job = _Job(len(writes))
        epoch = self._watch()
        try:
            await self.run_job(
                lambda stop: self._write_job(
                    stop,
                    job,
                    victims=victims,
                    seen=seen,
                    keys=write_keys,
                    pages=write_pages,
                    metas=write_metas,
                    positions=writes,
                    stamps=stamps,
                    claims=claims,
                    no_room=again,
                )
            )
        except asyncio.CancelledError:
            job.cancelled = True
            raise
        finally:
            self._reserved -= reserve
            self._claims.settle_all(claims)  # pages the job did not reach take no room
            self._writing.difference_update(write_keys)
            self._evicting.difference_update(victims)
            self._commit_removal(removed, job, evictions=True, epoch=epoch)
            no_room = self._commit_write(
                job, writes, write_keys, outcomes, now, epoch=epoch, final=again, given_up=given_up
            )
            if job.unwritable is not None:
                self._note_writable(*job.unwritable)
            if self._shared:
                self._as_stamped([*write_keys, *stamps], job.stamped)
            self._unwatch(epoch)
            spared.update(victims[position] for position in job.spared)
        return _NoRoom(
            [(i, sizes[slot], no_room[i]) for slot, i in enumerate(writes) if i in no_room],
            job.room,
            sum(
                entry.nbytes
                for position in job.spared
                if (entry := removed[position][1]) is not None
            ),
        )

    def _write_job(
        self,
        stop: threading.Event,
        job: _Job,
        *,
        victims: list[bytes],
        seen: list[float | None] | None,
        keys: list[bytes],
        pages: list[PageBuffer],
        metas: list[PageMeta],
        positions: list[int],
        stamps: dict[bytes, int],
        claims: list[int],
        no_room: bool = False,
    ) -> None:
        """Remove `victims` (but those another instance used since `seen`, see
        `_used_elsewhere`), stamp the files of `stamps` and write the pages; each page's
        mtime falls with its position in the batch, as the index orders the batch's keys.
        With `no_room` (the disk had none) the spare files are released first, and the
        victims unlinked rather than kept as spares."""
        handles = self._handles_or_raise()
        segments = job.segments(pages, writable=False)  # before any I/O
        sizes = [sum([view.nbytes for view in views]) for views in segments]
        if self._unremoved_tmp:
            self._retry_tmp(handles)
        spares = self._spares
        if no_room:
            self._release_spares(handles, reason="disk full")
            spares = None
        unremoved = _Unremoved()
        # Victims go even when the caller is cancelled: their room was counted free when
        # they were planned, and another put may have used it already.
        for position, key in enumerate(victims):
            hexkey = key.hex()
            try:
                shard_fd = handles.shard(hexkey[:2], create=False)
                if shard_fd is None:
                    job.gone += 1
                else:
                    used = _used_elsewhere(
                        shard_fd, hexkey, None if seen is None else seen[position]
                    )
                    if used is not None:
                        job.spared[position] = used
                    else:
                        _remove_page(spares, handles, shard_fd, hexkey)
            except FileNotFoundError:
                job.gone += 1
            except OSError as exc:  # the page stays: it goes back into the index
                job.failed.append(position)
                unremoved.add(hexkey, exc)
            job.done += 1
        unremoved.log("storage.evict.error", self._name, self._page_errors_log)
        base = time.time_ns()
        job.stamped = base / 1e9
        _stamp_all(handles, stamps, base)
        results = job.results

        def work(i: int) -> None:
            mtime_ns = base - positions[i] * _STAMP_STEP_NS
            result = results[i] = self._write_one(
                handles, keys[i], segments[i], sizes[i], metas[i], mtime_ns=mtime_ns
            )
            self._claims.settle(claims, i, written=result[0] == _OK)

        fan_out(self._helpers, len(keys), work, stop, self._width(len(keys), sum(sizes)))
        if self._look_due(results):
            look = next(self._looks)
            job.unwritable = (look, _unwritable(handles) or "")
        if not no_room and any(result is not None and result[0] == _NO_ROOM for result in results):
            # After every write of the batch (and the removal of their temporary files): the
            # second try asks only for what the file system is short of. What this store
            # wrote so far is read first: a write settled in between counts twice, never none.
            written = self._claims.written()
            room = _disk_room(handles.pages_fd, results)
            if room is not None:
                self._claims.block = room.block
                job.room = room._replace(written=written)

    def _write_one(
        self,
        handles: _Handles,
        key: bytes,
        segments: list[memoryview],
        total: int,
        meta: PageMeta,
        *,
        mtime_ns: int,
    ) -> _Result:
        hexkey = key.hex()
        durable = self._fsync == "always"
        try:
            shard_fd = handles.shard(hexkey[:2], create=True, durable=durable)
            if shard_fd is None:
                return (_ERROR, "shard directory vanished", 0)
            # A private root looks only where a get left a corrupt page it could not remove:
            # a rename over it would fail as well (an immutable file), an ERROR retried.
            if self._shared or (self._stuck and key in self._stuck):
                try:
                    st = os.stat(hexkey, dir_fd=shard_fd, follow_symlinks=False)
                except FileNotFoundError:
                    pass
                else:
                    if self._stuck and self._stuck.seen(key, st):
                        # A corrupt page that could not be removed: tried again (its directory
                        # may be writable now), else not stored, as it cannot be replaced.
                        try:
                            _remove_if_same(shard_fd, hexkey, st)
                        except OSError:
                            return (_REFUSED, "write: a corrupt page that cannot be removed", 0)
                    elif self._shared and stat.S_ISREG(st.st_mode) and st.st_uid == self._uid:
                        # Written by another instance, or still there; one of another user
                        # is written over, as a get would remove it.
                        if mtime_ns - st.st_mtime_ns >= _TOUCH_AFTER_NS:  # a use, as a read
                            _stamp(handles, hexkey, mtime_ns)
                        return (_EXISTS, "", st.st_size)
            tmp_name, fd = self._open_for_write(handles, hexkey, HEADER_NBYTES + total)
            renamed = False
            try:
                try:
                    nbytes = self._write_fd(fd, segments, total, meta, mtime_ns=mtime_ns)
                finally:
                    os.close(fd)
                shard_fd = _rename_into_shard(handles, tmp_name, hexkey, shard_fd, durable=durable)
                renamed = True
            finally:
                if not renamed:
                    self._drop_tmp(handles, tmp_name)
                elif self._spares is not None:
                    self._spares.done(tmp_name)
        except OSError as exc:
            return _write_failure(exc)
        if durable:
            try:
                os.fsync(shard_fd)
            except OSError as exc:  # the page is in place and valid, just maybe not durable
                return (_OK, f"directory fsync: {exc.strerror}", nbytes)
        return (_OK, "", nbytes)

    def _open_for_write(self, handles: _Handles, hexkey: str, size: int) -> tuple[str, int]:
        """A file in tmp/ to write a page of `size` bytes into: a spare file of that size
        (whose every byte the write replaces), else a new one. Returns (name, descriptor)."""
        spares = self._spares
        spare = spares.take(size) if spares is not None else None
        if spares is not None and spare is not None:
            try:
                fd = os.open(spare, _REWRITE_FLAGS, dir_fd=handles.tmp_fd)
            except OSError:
                # Removed meanwhile (verify, another opener), or not to be opened now (out of
                # descriptors): a new file then, and the spare goes, as no pool holds it now.
                pass
            else:
                st = os.fstat(fd)
                if stat.S_ISREG(st.st_mode) and st.st_size == size and st.st_nlink == 1:
                    return spare, fd
                os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(spare, dir_fd=handles.tmp_fd)
            # Not this write's file after all: the caller settles only the one it returns.
            spares.done(spare)
        name = f"{hexkey}.{secrets.token_hex(8)}{_TMP_SUFFIX}"
        return name, self._create_tmp(handles, name)

    def _create_tmp(self, handles: _Handles, name: str) -> int:
        """Create `name` in tmp/ for writing; recreates tmp/ if it was removed under us."""
        tmp_fd = handles.tmp_fd
        try:
            return os.open(name, _WRITE_FLAGS, _FILE_MODE, dir_fd=tmp_fd)
        except FileNotFoundError:
            if not handles.renew_tmp(tmp_fd):
                raise
        if self._spares is not None:
            self._spares.names(drain=True)  # they went with the old tmp/
        return os.open(name, _WRITE_FLAGS, _FILE_MODE, dir_fd=handles.tmp_fd)

    def _drop_tmp(self, handles: _Handles, name: str) -> None:
        """Remove the file `name` in tmp/ of a write that did not rename it. One tmp/ does not
        let go of (its mode, for now) goes into the spare pool where it has room, else is
        remembered: `_retry_tmp` tries again at the next put, `verify()`, `gc()` and close,
        rather than it waiting for the next open."""
        tmp_fd = handles.tmp_fd
        spares = self._spares
        kept = False
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=tmp_fd)
        except OSError:
            if spares is not None:
                with contextlib.suppress(OSError):
                    st = os.stat(name, dir_fd=tmp_fd, follow_symlinks=False)
                    disk = st.st_blocks * 512 if st.st_blocks else st.st_size
                    kept = (
                        stat.S_ISREG(st.st_mode)
                        and st.st_nlink == 1
                        and spares.give_back(name, st.st_size, disk)
                    )
            if not kept:
                with self._unremoved_tmp_lock:
                    self._unremoved_tmp.add(name)
        # A file given back cleared its mark as it went into the pool: another write may
        # have taken it since, and its mark must stay.
        if spares is not None and not kept:
            spares.done(name)

    def _retry_tmp(self, handles: _Handles) -> None:
        """Try again to remove the files `_drop_tmp` could not (on a job thread)."""
        with self._unremoved_tmp_lock:
            names = list(self._unremoved_tmp)
        for name in names:
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=handles.tmp_fd)
            except OSError:
                continue
            with self._unremoved_tmp_lock:
                self._unremoved_tmp.discard(name)

    def _write_fd(
        self, fd: int, segments: list[memoryview], total: int, meta: PageMeta, *, mtime_ns: int
    ) -> int:
        if total <= _ONE_WRITE_MAX:
            # Small enough to stay in the cache between the checksum and the kernel's copy:
            # one system call for header and payload.
            digest = _native.checksum(segments)
            header = encode_header(meta, segments, mac_key=self._mac_key, checksum=digest)
            _pwritev_full(fd, [memoryview(header), *segments], 0, HEADER_NBYTES + total)
        else:
            # Payload first, each piece hashed just before the kernel copies it (so the copy
            # reads the cache, not memory); the header, which carries the checksum, last.
            digest = _native.pwrite_checksum(fd, HEADER_NBYTES, segments, _CHUNK)
            header = encode_header(meta, segments, mac_key=self._mac_key, checksum=digest)
            _pwritev_full(fd, [memoryview(header)], 0, HEADER_NBYTES)
        # After the last write, which sets the mtime to now, and before the sync that makes
        # it durable with the rest. A file system that refuses it costs the order after a
        # reopen, not the page.
        with contextlib.suppress(OSError):
            os.utime(fd, ns=(mtime_ns, mtime_ns))
        self._sync_file(fd)
        return HEADER_NBYTES + total

    def _sync_file(self, fd: int) -> None:
        """Sync a file written in tmp/, before its rename, as the fsync policy asks."""
        if self._fsync == "data":
            os.fdatasync(fd)
        elif self._fsync == "always":
            os.fsync(fd)

    def _commit_write(
        self,
        job: _Job,
        writes: list[int],
        keys: list[bytes],
        outcomes: list[Outcome],
        now: float,
        *,
        epoch: int,
        final: bool,
        given_up: Sequence[tuple[bytes, str]] = (),
    ) -> dict[int, str]:
        """Record a write job's pages; returns the positions of those the file system had no
        room for, with the error, to be written again (none when `final` or cancelled: those
        are MISSes). `given_up`: pages (key, error) of the batch refused without a write,
        counted and logged with the job's."""
        no_room: dict[int, str] = {}
        if job.rejected:  # bad buffers, refused before any I/O: the call did not happen
            self._counters.puts -= len(outcomes)
            return no_room
        errors = _PageErrors()
        for slot, (i, key) in enumerate(zip(writes, keys, strict=True)):
            result = job.results[slot]
            if result is None:
                outcomes[i] = Outcome.ERROR
                self._counters.errors += not job.cancelled
                continue
            code, detail, nbytes = result
            if code in (_OK, _EXISTS):
                outcomes[i] = Outcome.OK  # a second try's page was a MISS until now
                # A delete of the key while it was written (a shared root's delete does not
                # wait for this instance's writes) may have come after the rename: leave the
                # index without it, where a lookup on disk finds it if it is there.
                if self._changed.get(key, 0) <= epoch:
                    self._insert(key, nbytes, now)
                if code == _OK and self._policy_refused:
                    self._policy_refused.forget(key)
                if detail:
                    errors.add(key, detail)
            elif code == _NO_ROOM and not (final or job.cancelled):
                outcomes[i] = Outcome.MISS  # unless the second try stores it
                no_room[i] = detail
            elif code in (_NO_ROOM, _REFUSED):
                # Not an error to retry: the same write would fail the same way.
                outcomes[i] = Outcome.MISS
                self._refuse(errors, [(key, detail)])
            else:
                outcomes[i] = Outcome.ERROR
                self._counters.errors += 1
                errors.add(key, detail)
        self._refuse(errors, list(given_up))  # after the batch's pages written before them
        errors.log(self._name, self._page_errors_log)
        return no_room

    def _as_stamped(self, keys: Iterable[bytes], stamped: float) -> None:
        """Record that a write job stamped the files of `keys` at `stamped` (if it got that
        far): an mtime the index takes for its own, not another instance's use (see
        `_used_elsewhere`)."""
        index = self._index
        for key in keys:
            entry = index.get(key)
            if entry is not None and entry.mtime < stamped:
                entry.mtime = stamped

    def _commit_removal(
        self,
        removed: list[tuple[bytes, _Entry | None]],
        job: _Job,
        *,
        evictions: bool,
        epoch: int | None = None,
    ) -> None:
        """Count removals that happened; put entries the job did not reach back in the index,
        at the LRU end in their original order, and those whose file it failed to remove or
        left in place at the MRU end (the next eviction tries other pages first). With
        `epoch` (watched since the entries left the index), none that another call changed
        meanwhile: a delete that ran then removed the page for good."""
        done, failed = job.done, job.failed
        if evictions:
            # Only this instance's removals: a file another instance sharing the root removed
            # first was its eviction (or delete), counted there.
            self._counters.evictions += done - len(failed) - len(job.spared) - job.gone
        self._counters.errors += len(failed)
        gone = (
            frozenset()
            if epoch is None
            else frozenset(key for key, _ in removed if self._stale(key, epoch))
        )
        for key, _ in removed:
            self._mark(key)
        for key, entry in reversed(removed[done:]):
            if entry is not None and key not in self._index and key not in gone:
                self._index[key] = entry
                self._index.move_to_end(key, last=False)
                self._bytes += entry.nbytes
        for position in failed:
            key, entry = removed[position]
            if entry is not None and key not in self._index and key not in gone:
                self._index[key] = entry
                self._bytes += entry.nbytes
        # Used by another instance since this one did: as recent as that use, here at the MRU
        # end (the next eviction tries other pages first).
        for position, mtime in job.spared.items():
            key, entry = removed[position]
            if entry is not None and key not in self._index and key not in gone:
                entry.last_access = max(entry.last_access, mtime)
                entry.mtime = mtime
                self._index[key] = entry
                self._bytes += entry.nbytes

    # delete.

    async def delete(self, keys: Sequence[bytes]) -> int:
        """Remove the pages; return how many existed and were removed (a page whose file could
        not be removed stays, counted as an error)."""
        self._check_open()
        check_keys(keys)
        unique = list(dict.fromkeys(keys))
        if not self._shared:
            unique = [key for key in unique if key in self._index]
        if not unique:
            await anyio.lowlevel.checkpoint()  # answered from the index: see `exists`
            return 0
        removed = [(key, self._drop(key)) for key in unique]
        self._evicting.update(unique)
        # A page being read is unlinked, not kept as a spare: a write reusing its file would
        # change the bytes under the reader.
        reading = {key for key in unique if key in self._pins}
        job = _Job(len(unique))
        try:
            await self.run_job(
                lambda stop: self._unlink_job(
                    stop, job, unique, event="storage.delete.error", reading=reading
                )
            )
        finally:
            self._evicting.difference_update(unique)
            self._commit_removal(removed, job, evictions=False)
            # Cancelled too: the job removed every page (see _unlink_job).
            count = sum(1 for result in job.results if result is not None and result[0] == _OK)
            self._counters.deletes += count
        return count

    def _unlink_job(
        self,
        stop: threading.Event,
        job: _Job,
        keys: list[bytes],
        *,
        event: str,
        reading: frozenset[bytes] | set[bytes] = frozenset(),
        seen: list[float | None] | None = None,
        need: tuple[int, list[int]] | None = None,
        limiter: LogLimiter | None = None,
        unremoved: _Unremoved | None = None,
    ) -> None:
        """Remove the pages of `keys`; with `seen` (evictions in a shared root) not those
        another instance used since (see `_used_elsewhere`), which go to `job.spared`. With
        `need` (bytes, and each key's size), stop once the keys not spared hold that many.
        Files that stay go to `unremoved` when given (the caller logs them), else are logged
        as `event` at the end, through `limiter` if given (the evictions of puts, which meet
        the same files again and again)."""
        handles = self._handles_or_raise()
        pending = _Unremoved() if unremoved is None else unremoved
        left: int | None = None
        sizes: list[int] = []
        if need is not None:
            left, sizes = need
        # Every removal runs even when the caller is cancelled (unlinks are cheap): the room
        # of these pages was counted free when they left the index, and a put may have used it.
        for slot, key in enumerate(keys):
            if left is not None and left <= 0:
                break
            hexkey = key.hex()
            try:
                shard_fd = handles.shard(hexkey[:2], create=False)
                if shard_fd is None:
                    job.results[slot] = (_MISS, "", 0)
                    job.gone += 1
                elif (
                    used := _used_elsewhere(shard_fd, hexkey, None if seen is None else seen[slot])
                ) is not None:
                    job.spared[slot] = used
                    job.results[slot] = (_EXISTS, "", 0)
                else:
                    spares = None if key in reading else self._spares
                    _remove_page(spares, handles, shard_fd, hexkey)
                    job.results[slot] = (_OK, "", 0)
            except FileNotFoundError:
                job.results[slot] = (_MISS, "", 0)
                job.gone += 1
            except OSError as exc:  # the page stays: it goes back into the index
                job.results[slot] = (_ERROR, str(exc), 0)
                job.failed.append(slot)
                pending.add(hexkey, exc)
            if left is not None and slot not in job.spared:
                left -= sizes[slot]
            job.done = slot + 1
        if unremoved is None:
            pending.log(event, self._name, limiter)

    # Raw access (RawAccess).

    async def read_raw(self, key: bytes) -> bytes | None:
        """The stored `header ‖ payload` bytes of `key`, unchecked, or None when there is no
        page file: like `get`'s misses, also a symlink or other non-regular file where the
        page belongs, and a refused shard directory. Raises StorageError on an I/O error."""
        self._check_open()
        check_key(key)
        try:
            return await self.run_job(lambda stop: self._read_raw_job(stop, key))
        except OSError as exc:
            raise StorageError(f"{self._name}: read_raw failed: {exc}") from exc

    def _read_raw_job(self, stop: threading.Event, key: bytes) -> bytes | None:
        # Given up while it waited for a thread (its caller cancelled, the store closing):
        # nobody would take the bytes, and a slow disk would hold the caller's cancellation.
        if stop.is_set():
            raise StorageError(f"{self._name}: read_raw given up before it began")
        handles = self._handles_or_raise()
        hexkey = key.hex()
        try:
            shard_fd = handles.shard(hexkey[:2], create=False)
        except _RefusedShardError:
            return None  # never read from (logged when refused)
        except OSError as exc:
            if exc.errno in (errno.ENOTDIR, errno.ELOOP):  # a file or symlink: no shard, as get
                return None
            raise
        if shard_fd is None:
            return None
        try:
            fd = os.open(hexkey, _READ_FLAGS, dir_fd=shard_fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a symlink, never followed: no page
                return None
            raise
        handles.read_from(hexkey[:2], shard_fd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None
            if st.st_size > _RAW_MAX_NBYTES:  # no page is this large; a sparse file can be
                raise OSError(errno.EFBIG, f"{st.st_size} bytes, more than a page can be")
            buffer = bytearray(st.st_size)
            count = _preadv_full(fd, [memoryview(buffer)], 0, st.st_size)
            return bytes(buffer[:count])
        finally:
            os.close(fd)

    async def write_raw(self, key: bytes, value: bytes) -> None:
        """Store `value` under `key` unchecked (atomically), replacing what is there. Raises
        StorageError when it cannot (an I/O error, a refused shard directory)."""
        self._check_open()
        check_key(key)
        try:
            await self.run_job(lambda stop: self._write_raw_job(key, value))
        except OSError as exc:
            raise StorageError(f"{self._name}: write_raw failed: {exc}") from exc
        self._insert(key, len(value), time.time())
        if self._policy_refused:
            self._policy_refused.forget(key)

    def _write_raw_job(self, key: bytes, value: bytes) -> None:
        handles = self._handles_or_raise()
        hexkey = key.hex()
        # The fsync policy of puts (`_write_one`): the file before its rename, and with
        # "always" a new shard directory and the directory after the rename.
        durable = self._fsync == "always"
        shard_fd = handles.shard(hexkey[:2], create=True, durable=durable)
        if shard_fd is None:
            raise OSError(errno.ENOENT, "shard directory vanished")
        tmp_name = f"{hexkey}.{secrets.token_hex(8)}{_TMP_SUFFIX}"
        fd = self._create_tmp(handles, tmp_name)
        renamed = False
        try:
            try:
                _pwritev_full(fd, [memoryview(value)], 0, len(value))
                self._sync_file(fd)
            finally:
                os.close(fd)
            shard_fd = _rename_into_shard(handles, tmp_name, hexkey, shard_fd, durable=durable)
            renamed = True
        finally:
            if not renamed:
                self._drop_tmp(handles, tmp_name)
        if durable:
            os.fsync(shard_fd)

    # Maintenance (MaintainableStorage).

    async def list_pages(self, limit: int | None = None) -> list[PageInfo]:
        """Indexed pages, most recently used first, with their header fields (0 tokens and
        priority 0 where the header cannot be read: a damaged page or a newer format's).

        The order is the index's when the call is made; the headers are read and the pages
        listed `_LOOP_SLICE` at a time, one job each, so the loop goes on serving between
        them. A page removed meanwhile is left out; one used meanwhile is listed where it
        was, with its last access as it is when its slice is listed."""
        self._check_open()
        index = self._index
        keys = list(islice(reversed(index), limit))  # references only: 10 ms per million
        if not keys:
            await anyio.lowlevel.checkpoint()  # the slices below take the turns otherwise
            return []
        pages: list[PageInfo] = []
        for start in range(0, len(keys), _LOOP_SLICE):
            chosen = [
                (key, entry)
                for key in keys[start : start + _LOOP_SLICE]
                if (entry := index.get(key)) is not None
            ]
            pages += await self._page_infos(chosen)
        return pages

    def stream_pages(self, batch_pages: int = 1024) -> AsyncIterator[list[PageInfo]]:
        """`list_pages()` in batches of at most `batch_pages` (`StreamsPages`), each read by
        one job, without a copy of the index: memory and the time to the first batch do not
        grow with the store.

        While the index is unchanged (a maintenance tool's listing) the batches are exactly
        `list_pages()`. A page removed while the listing runs is left out; one stored or used
        meanwhile moves to the front of the order, which the listing has passed, so it is
        left out too (or listed where it was, if its batch was taken already). A close raises
        the store's closed error, even mid-batch.
        """
        if not (_is_int(batch_pages) and batch_pages >= 1):
            raise ValueError(f"batch_pages must be an integer >= 1, got {batch_pages!r}")
        self._check_open()
        return self._stream_pages(_IndexWalk(self._index), batch_pages)

    async def _stream_pages(
        self, walk: _IndexWalk, batch_pages: int
    ) -> AsyncIterator[list[PageInfo]]:
        while chosen := walk.take(batch_pages):
            self._check_open()
            pages = await self._page_infos(chosen)
            if pages:
                yield pages

    async def _page_infos(self, chosen: list[tuple[bytes, _Entry]]) -> list[PageInfo]:
        """`PageInfo` of the indexed pages `chosen`, their headers read by one job; pages whose
        file or entry went meanwhile are left out."""
        keys = [key for key, _ in chosen]
        fields = await self.run_job(lambda stop: self._headers_job(stop, keys))
        self._check_open()  # a close stops the job part-way: its answers are not the pages'
        index = self._index
        return [
            PageInfo(
                key=key,
                nbytes=entry.nbytes,
                num_tokens=found[0],
                priority=found[1],
                last_access=entry.last_access,
            )
            for (key, entry), found in zip(chosen, fields, strict=True)
            if found is not None and key in index
        ]

    def _headers_job(
        self, stop: threading.Event, keys: list[bytes]
    ) -> list[tuple[int, int] | None]:
        """(tokens, priority) of each page, (0, 0) when its header cannot be read, None when
        its file is gone."""
        handles = self._handles_or_raise()
        fields: list[tuple[int, int] | None] = []
        buffer = memoryview(bytearray(HEADER_NBYTES))
        for key in keys:
            header: PageHeader | PageCheck = PageCheck.CORRUPT
            hexkey = key.hex()
            if not stop.is_set():
                try:
                    shard_fd = handles.shard(hexkey[:2], create=False)
                    if shard_fd is None:
                        fields.append(None)
                        continue
                    fd = os.open(hexkey, _READ_FLAGS, dir_fd=shard_fd)
                    try:
                        if _preadv_full(fd, [buffer], 0, HEADER_NBYTES) == HEADER_NBYTES:
                            header = decode_header(buffer)
                    finally:
                        os.close(fd)
                except FileNotFoundError:
                    fields.append(None)  # removed since it was indexed: no longer a page
                    continue
                except OSError:
                    pass  # unreadable: listed like a damaged page, as stats() counts it
            if isinstance(header, PageHeader):
                fields.append((header.num_tokens, header.priority))
            else:
                fields.append((0, 0))
        return fields

    async def verify(self) -> VerifyReport:
        """Check every page on disk; remove corrupt pages, temporary leftovers and strays.

        The pages are checked on up to `io_threads` threads (those of batched reads and
        writes); the report does not depend on how many.
        """
        self._check_open()
        since = self._seq
        epoch = self._watch()
        before = list(self._index)  # the set is made off the loop
        try:
            found, unlisted, corrupt, report = await self.run_job(self._verify_job)
            diff = await self.run_job(lambda _: _diff_scan(found, before, unlisted))
            await self._merge_scan(diff, since, epoch)
        finally:
            self._unwatch(epoch)
        for key, reason in corrupt:
            self._report_corrupt(key, reason)
        # Opening removed the leftovers it found before anyone could ask: a verify that
        # opened the root (the CLI's) must still report them.
        pending, self._unreported_leftovers = self._unreported_leftovers, 0
        return msgspec.structs.replace(report, leftovers_removed=report.leftovers_removed + pending)

    def _verify_job(
        self, stop: threading.Event
    ) -> tuple[list[_Found], frozenset[str], list[tuple[bytes, str]], VerifyReport]:
        """Check the root; returns the pages kept, the shards it could not list (whose
        indexed pages stay indexed), the corrupt pages removed, and the report."""
        handles = self._handles_or_raise()
        self._retry_tmp(handles)
        idle = _STALE_TMP_SHARED_S if self._shared else _STALE_TMP_PRIVATE_S
        # This instance's own spare files are not leftovers, however long they have waited.
        spares = self._spares.names() if self._spares is not None else frozenset()
        failed: list[tuple[str, str]] = []
        foreign: list[str] = []
        unlisted: list[str] = []
        leftovers = _remove_leftovers(
            handles, idle_s=idle, keep=spares, failed=failed, foreign=foreign, unlisted=unlisted
        )
        if _names_root(self._root, handles.root_id):  # else the path leads elsewhere
            leftovers += remove_dead_compactions(self._root / _MANIFEST_NAME)
        self._log_stray_errors(failed)
        self._log_unlisted_tmp(handles, unlisted)
        strays: list[tuple[int, str]] = []
        stray_dirs: list[tuple[int, str]] = []
        refused: list[str] = []
        found = _scan(
            handles, stop, strays, stray_dirs=stray_dirs, refused=refused, foreign=foreign
        )
        unchecked = len(refused) + len(failed) + len(unlisted)
        removals: list[tuple[int, str, Callable[[str, int], None]]] = [
            *((dir_fd, name, _unlink_at) for dir_fd, name in strays),
            *(
                (dir_fd, name, functools.partial(_remove_tree, stop=stop))
                for dir_fd, name in stray_dirs
            ),
        ]
        for dir_fd, name, remove in removals:
            try:
                remove(name, dir_fd)
                leftovers += 1
                log.warning("storage.stray.removed", backend=self._name, entry=name)
            except FileNotFoundError:
                pass
            except OSError as exc:
                unchecked += 1
                self._log_stray_errors([(name, str(exc))])
        # The pages are checked on up to `io_threads` threads, each with its own buffer; their
        # results are tallied here, in the scan's order, once every thread has stopped.
        results: list[_Checked | None] = [None] * len(found)
        local = threading.local()

        def check(i: int) -> None:
            scratch: bytearray = getattr(local, "scratch", bytearray())
            results[i], local.scratch = self._check_page(handles, found[i][0], scratch, stop)

        # Reading pages the page cache does not hold, the threads overlap their waits: 200,000
        # pages of 2 KiB took 60 s on one thread, 32 s on two, 28 s on four. Cached ones are
        # checked mostly in Python, under the GIL, which more threads only pass around.
        width = self._width(len(found), sum(item[1] for item in found))
        fan_out(self._helpers, len(found), check, stop, width)
        kept: list[_Found] = []
        corrupt: list[tuple[bytes, str]] = []
        ok = unsupported = 0
        for item, result in zip(found, results, strict=True):
            code, reason = result or (_EXISTS, "")  # never reached (a close): left alone
            if code == _MISS:  # removed meanwhile: no longer indexed
                continue
            if code == _CORRUPT:
                corrupt.append((item[0], reason))
                continue
            if code == _STUCK:  # corrupt and still there: unchecked, and no page to index
                unchecked += 1
                continue
            kept.append(item)
            ok += code == _OK
            unsupported += code == _UNSUPPORTED
            unchecked += code == _ERROR
        report = VerifyReport(
            checked=ok + unsupported + len(corrupt),
            ok=ok,
            corrupt_removed=len(corrupt),
            unsupported=unsupported,
            leftovers_removed=leftovers,
            unchecked=unchecked,
            foreign=len(foreign),
        )
        return kept, frozenset(refused), corrupt, report

    def _check_page(
        self, handles: _Handles, key: bytes, scratch: bytearray, stop: threading.Event
    ) -> tuple[_Checked, bytearray]:
        """Check one page found by verify's scan, removing it if it is corrupt and unchanged
        since it was read. Returns (code, reason) and the buffer to reuse: `_OK`,
        `_UNSUPPORTED`, `_CORRUPT` (removed), `_MISS` (no longer there), `_EXISTS` (changed
        while it was read: left, uncounted), `_ERROR` (left unchecked: unreadable, stopped
        mid-page) or `_STUCK` (corrupt and impossible to remove: left unchecked, remembered
        in `_stuck` and no longer indexed, so that no lookup counts it and no put of a
        private root finds it stored)."""
        hexkey = key.hex()
        shard_fd = handles.shard(hexkey[:2], create=False)
        if shard_fd is None:
            return (_MISS, ""), scratch
        try:
            code, reason, st, scratch = self._verify_file(shard_fd, key, scratch, stop)
        except FileNotFoundError:
            return (_MISS, ""), scratch  # removed meanwhile
        except PermissionError as exc:
            # A page file its owner may not read: removed as a get would (see
            # `_open_or_remove_unreadable`).
            why: list[str] = []
            opened = _open_or_remove_unreadable(shard_fd, key, self._stuck, retry=True, why=why)
            if opened is None:
                return (_MISS, ""), scratch
            if opened == "removed":
                return (_CORRUPT, "unreadable"), scratch
            if opened == "changed":
                return (_EXISTS, ""), scratch  # another file now: left, uncounted
            if isinstance(opened, int):
                os.close(opened)  # readable now: the next verify() checks it
            # Said as a corrupt page that stays is, without the file's name (`key` names it).
            error = (
                f"unreadable, cannot remove it: {why[0]}"
                if why
                else f"unreadable: {exc.strerror or exc}"
            )
            log.warning("storage.page.error", backend=self._name, key=hexkey, error=error)
            return (_STUCK if opened == "kept" else _ERROR, ""), scratch
        except OSError as exc:
            log.warning("storage.page.error", backend=self._name, key=hexkey, error=str(exc))
            return (_ERROR, ""), scratch
        if code != _CORRUPT:
            return (code, reason), scratch  # _ERROR: stopped mid-page (a close), left in place
        try:
            # Evicted, deleted or rewritten while it was read (its file may have been reused
            # by a write meanwhile): what was read is torn, not a corrupt page.
            if not _remove_if_same(shard_fd, hexkey, st, gone=False):
                return (_EXISTS if _exists(shard_fd, hexkey) else _MISS, ""), scratch
        except OSError as exc:  # e.g. immutable: it stays, a miss to gets (see `_StuckFiles`)
            if st is not None:
                self._stuck.add(key, st)
            log.warning(
                "storage.page.error",
                backend=self._name,
                key=hexkey,
                error=f"corrupt ({reason}), cannot remove it: {exc.strerror or exc}",
            )
            return (_STUCK, ""), scratch
        return (_CORRUPT, reason), scratch

    def _log_stray_errors(self, failed: list[tuple[str, str]]) -> None:
        for name, error in failed:
            log.warning("storage.stray.error", backend=self._name, entry=name, error=error)

    def _log_unlisted_tmp(self, handles: _Handles, unlisted: list[str]) -> None:
        """Log why tmp/ could not be listed, once per error until it is listed (or made)
        again: every verify() would meet it again, and the count of `unchecked` tells it
        each time."""
        for error in unlisted:
            if handles.tmp_unlisted != error:
                handles.tmp_unlisted = error
                self._log_stray_errors([(_TMP, error)])

    def _verify_file(
        self, shard_fd: int, key: bytes, scratch: bytearray, stop: threading.Event
    ) -> tuple[str, str, os.stat_result | None, bytearray]:
        fd = os.open(key.hex(), _READ_FLAGS, dir_fd=shard_fd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return (_CORRUPT, "not a regular file", st, scratch)
            if st.st_uid != self._uid:  # another user's (see `_read_fd`)
                return (_CORRUPT, "owner", st, scratch)
            header_buf = memoryview(bytearray(HEADER_NBYTES))
            got = _preadv_full(fd, [header_buf], 0, HEADER_NBYTES)
            header = decode_header(header_buf) if got == HEADER_NBYTES else PageCheck.CORRUPT
            if header is PageCheck.UNSUPPORTED:
                return (_UNSUPPORTED, "", st, scratch)
            if isinstance(header, PageCheck):
                return (_CORRUPT, "header", st, scratch)
            if header.key != key:
                return (_CORRUPT, "key", st, scratch)
            if st.st_size != header.page_nbytes:
                return (_CORRUPT, "size", st, scratch)
            if _has_holes(st):
                # Reading it would take as long as a header over holes cares to claim; but a
                # sound page copied by a sparse-aware tool has holes too: left, unchecked.
                log.warning(
                    "storage.page.error",
                    backend=self._name,
                    key=key.hex(),
                    error="not verified: its file has holes (copied sparse, or not this "
                    "store's writing); a get still checks it",
                )
                return (_ERROR, "sparse", st, scratch)
            # In pieces through one buffer: the header, whatever length it claims (a sparse
            # file can back any), decides how long this takes, never how much memory.
            if not scratch:
                scratch = bytearray(_CHUNK)
            verifier = PayloadVerifier(header, mac_key=self._mac_key)
            offset, end = HEADER_NBYTES, header.page_nbytes
            while offset < end:
                if stop.is_set():  # a huge page takes long to read: close() must not wait
                    return (_ERROR, "stopped", st, scratch)
                piece = memoryview(scratch)[: min(_CHUNK, end - offset)]
                if _preadv_full(fd, [piece], offset, piece.nbytes) != piece.nbytes:
                    return (_CORRUPT, "truncated", st, scratch)
                verifier.update(piece)
                offset += piece.nbytes
            if verifier.result() is not PageCheck.OK:
                return (_CORRUPT, "checksum or mac", st, scratch)
            return (_OK, "", st, scratch)
        finally:
            os.close(fd)

    async def gc(self) -> GcReport:
        """Rescan the root, release the spare files (a full disk wants their room back;
        logged, not in the report), then evict least recently used pages down to the
        capacity. What the rescan found is merged, and pages are evicted, a few thousand
        at a time, the loop serving in between."""
        self._check_open()
        since = self._seq
        epoch = self._watch()
        before = list(self._index)  # the set is made off the loop
        try:
            diff = await self.run_job(lambda stop: self._gc_scan_job(stop, before))
            await self._merge_scan(diff, since, epoch)
        finally:
            self._unwatch(epoch)
        if self._capacity is None:
            return GcReport(evicted_pages=0, freed_bytes=0)
        # In rounds of `_LOOP_SLICE` pages, each one job: a hundred thousand pages evicted in
        # one step held the loop for a tenth of a second. A page whose file could not be
        # removed is tried once, and its bytes count as if evicted: no other page goes in
        # its place. A page another instance used since this one did stays, and is tried
        # again after every other page, then without a look (`spared`).
        # The files that stay are logged once for the whole call, not once per round.
        evicted = freed = unremoved = 0
        failed: set[bytes] = set()
        spared: set[bytes] = set()
        shards: set[str] = set()  # of the victims
        stays = _Unremoved()
        try:
            while True:
                excess = self._bytes + self._reserved - self._capacity - unremoved
                victims: list[bytes] = []
                for key, entry in self._index.items():
                    if excess <= 0 or len(victims) == _LOOP_SLICE:
                        break
                    if self._evictable(key) and key not in failed:
                        victims.append(key)
                        excess -= entry.nbytes
                if not victims:
                    break
                done, nbytes, stayed = await self._evict(
                    victims, spared, unremoved=stays, only_unlinked=True
                )
                evicted += done
                freed += nbytes
                failed.update(stayed)
                unremoved += sum(self._index[key].nbytes for key in stayed if key in self._index)
                if not self._shared:
                    shards.update(key.hex()[:2] for key in victims)
        finally:
            stays.log("storage.evict.error", self._name, None)
        if shards:
            # Those the eviction emptied go now, as the scan's empty ones went (a private
            # root only, see `_gc_scan_job`); one not empty stays, as it was.
            await self.run_job(lambda stop: self._remove_empty_shards(sorted(shards)))
        return GcReport(
            evicted_pages=evicted,
            freed_bytes=freed,
            failed=len(failed),
            over_capacity_bytes=self._excess(),
        )

    def _gc_scan_job(self, stop: threading.Event, before: list[bytes]) -> _ScanDiff:
        """Release the spare files, then scan the root against the index (`before`)."""
        handles = self._handles_or_raise()
        self._release_spares(handles, reason="gc")
        self._retry_tmp(handles)
        unlisted: list[str] = []
        # Shard directories left empty go, on a private root only: another instance sharing
        # the root would go on reading and listing through its descriptor of a removed one,
        # and miss every page written into the one made again.
        empty: list[str] | None = None if self._shared else []
        found = _scan(handles, stop, refused=unlisted, empty=empty, stuck=self._stuck)
        if empty and not stop.is_set():
            self._remove_empty_shards(empty)
        return _diff_scan(found, before, frozenset(unlisted))

    def _remove_empty_shards(self, names: list[str]) -> None:
        """Remove the shard directories of `names` that are empty (a private root's)."""
        removed = self._handles_or_raise().remove_empty(names)
        if removed:
            log.info("storage.shards.removed", backend=self._name, directories=removed)

    def _release_spares(self, handles: _Handles, *, reason: str) -> None:
        """Unlink every spare file no write has taken, logged when there were any: a warning
        when a full disk needed their room, else (`gc()`) as information."""
        if self._spares is None:
            return
        files = nbytes = 0
        for name, size in self._spares.release():
            try:
                os.unlink(name, dir_fd=handles.tmp_fd)
            except OSError:  # gone with tmp/, or removed by verify(): no room held either way
                continue
            files += 1
            nbytes += size
        if files:
            emit = log.warning if reason == "disk full" else log.info
            emit(
                "storage.spares.released",
                backend=self._name,
                reason=reason,
                files=files,
                bytes=nbytes,
            )

    def _excess(self) -> int:
        """Bytes above the capacity, counting the room reserved for puts in flight."""
        assert self._capacity is not None
        return max(0, self._bytes + self._reserved - self._capacity)
