"""Byte-moving kernels: checksums computed while pages are copied, read or written.

The native extension (`_kernels.c`, built at install time where a C compiler exists) does each
of these in one pass over the bytes and without the GIL. Where it is missing, or when
`HICACHE_ASYNC_NATIVE=0` is set, the same functions run in Python with python-xxhash: the same
results, with more passes over memory. Every checksum is xxh3-64 (seed 0), so pages written
by either path read back through the other.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from . import _fallback

__all__ = [
    "BOUNCE_NBYTES",
    "NATIVE",
    "bounce_buffer",
    "checksum",
    "copy_at",
    "copy_checksum",
    "pread_checksum",
    "pwrite_checksum",
    "simd",
]

Buffer = bytes | bytearray | memoryview

_CACHE_DIR = "/sys/devices/system/cpu/cpu0/cache"
_DEFAULT_BOUNCE = 256 << 10
_MIN_BOUNCE, _MAX_BOUNCE = 64 << 10, 4 << 20
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _parse_size(text: str) -> int | None:
    """'1024K' (sysfs' spelling) in bytes, or None."""
    text = text.strip().upper()
    digits = text.rstrip("KMG")
    unit = text[len(digits) :]
    if not digits.isdigit() or unit not in _UNITS:
        return None
    return int(digits) * _UNITS[unit]


def _core_cache_nbytes(cache_dir: str = _CACHE_DIR) -> int | None:
    """The size of one core's level-2 cache from sysfs, or None where it cannot be read."""
    try:
        entries = sorted(os.listdir(cache_dir))
    except OSError:
        return None
    for entry in entries:
        if not entry.startswith("index"):
            continue
        folder = os.path.join(cache_dir, entry)
        try:
            with open(os.path.join(folder, "level")) as f:
                level = f.read().strip()
            with open(os.path.join(folder, "type")) as f:
                kind = f.read().strip()
            with open(os.path.join(folder, "size")) as f:
                size = _parse_size(f.read())
        except OSError:
            continue
        if level == "2" and kind in ("Unified", "Data"):
            return size
    return None


def bounce_nbytes(cache_nbytes: int | None) -> int:
    """The bounce size for a core whose level-2 cache holds `cache_nbytes` (None: unknown).

    As large as that cache: the checksumming copy then reads what the kernel just wrote from
    the cache, and a page of up to that size costs one read call. Measured on a core with a
    1 MiB L2, 768 KiB pages read 10-15% faster through 1 MiB than through 256 KiB, and 2 MiB
    (past the cache) was slower again.
    """
    if not cache_nbytes:
        return _DEFAULT_BOUNCE
    return max(_MIN_BOUNCE, min(_MAX_BOUNCE, cache_nbytes))


#: Bytes a read goes through at a time (see `bounce_nbytes`).
BOUNCE_NBYTES = bounce_nbytes(_core_cache_nbytes())


def _load() -> Any:
    if os.environ.get("HICACHE_ASYNC_NATIVE", "1") == "0":
        return None
    try:
        from . import _kernels
    except ImportError:  # not built here (no compiler at install time): the Python paths run
        return None
    return _kernels


_kernels: Any = _load()

#: Whether the native kernels are in use.
NATIVE: bool = _kernels is not None

_local = threading.local()


def simd() -> str:
    """What the kernels run on: 'avx2', 'scalar' (native) or 'python'."""
    return str(_kernels.simd()) if _kernels is not None else "python"


def bounce_buffer() -> bytearray:
    """This thread's read bounce buffer (`BOUNCE_NBYTES`), allocated once per thread."""
    buf: bytearray | None = getattr(_local, "bounce", None)
    if buf is None:
        buf = bytearray(BOUNCE_NBYTES)
        _local.bounce = buf
    return buf


def checksum(segments: Sequence[Buffer]) -> int:
    """xxh3-64 of the segments' bytes in order, without joining them."""
    # Hashing alone has no copy to fuse with, and python-xxhash's dispatched loop is the
    # faster one on the CPUs measured here.
    hasher = xxhash.xxh3_64()
    for segment in segments:
        hasher.update(segment)
    return int(hasher.intdigest())


def copy_checksum(dst: Sequence[Buffer], src: Sequence[Buffer], *, stream: bool = True) -> int:
    """Copy the bytes of `src` into `dst` (equal totals, any segmentation on either side) and
    return their xxh3-64, in one pass. `stream` bypasses the CPU cache for the stores, for
    copies whose destination is not read again soon."""
    if _kernels is not None:
        return int(_kernels.xxh3_copy(dst, src, stream))
    return _fallback.copy_checksum(dst, src)


def pread_checksum(fd: int, offset: int, dst: Sequence[Buffer]) -> tuple[int, int]:
    """Read from `fd` at `offset` into `dst` until it is full or the file ends; returns (bytes
    read, xxh3-64 of those bytes). Raises OSError on a read error."""
    if _kernels is not None:
        nread, digest = _kernels.pread_xxh3(fd, offset, dst, bounce_buffer())
        return int(nread), int(digest)
    return _fallback.pread_checksum(fd, offset, dst, BOUNCE_NBYTES)


def pwrite_checksum(fd: int, offset: int, src: Sequence[Buffer], chunk: int) -> int:
    """Write `src` to `fd` from `offset` in pieces of at most `chunk` bytes; returns the
    xxh3-64 of what was written. Raises OSError on a write error."""
    if _kernels is not None:
        return int(_kernels.xxh3_pwrite(fd, offset, src, chunk))
    return _fallback.pwrite_checksum(fd, offset, src, chunk)


def copy_at(dst_addr: int, src_addr: int, spans: np.ndarray[Any, Any], *, stream: bool) -> None:
    """Copy `length` bytes from `src_addr + s` to `dst_addr + d` for each int64 row
    (s, d, length) of `spans`. The caller owns the memory and has checked every span against
    it (nothing is checked here); `stream` bypasses the CPU cache for the stores."""
    if _kernels is not None:
        _kernels.copy_at(dst_addr, src_addr, spans, stream)
        return
    for s, d, n in spans.tolist():
        ctypes.memmove(dst_addr + d, src_addr + s, n)  # releases the GIL like the kernel
