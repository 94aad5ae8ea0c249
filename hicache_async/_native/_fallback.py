"""The kernels in Python, for installs without the native extension: same results, more
passes over memory."""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence

import xxhash

__all__ = ["copy_checksum", "pread_checksum", "pwrite_checksum"]

Buffer = bytes | bytearray | memoryview

# Pieces hashed right after they are copied, while they are still in the CPU cache.
_PIECE = 256 << 10


def _flat(buffer: Buffer) -> memoryview:
    view = memoryview(buffer)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _pieces(segments: Sequence[Buffer], limit: int) -> list[memoryview]:
    """The segments as consecutive byte views of at most `limit` bytes."""
    out: list[memoryview] = []
    for segment in segments:
        flat = _flat(segment)
        for start in range(0, flat.nbytes, limit):
            out.append(flat[start : start + limit])
    return out


def copy_checksum(dst: Sequence[Buffer], src: Sequence[Buffer]) -> int:
    """Copy the bytes of `src` into `dst` (same total) and return their xxh3-64."""
    targets = [_flat(d) for d in dst]
    if sum(t.nbytes for t in targets) != sum(_flat(s).nbytes for s in src):
        raise ValueError("dst and src hold different numbers of bytes")
    hasher = xxhash.xxh3_64()
    index, at = 0, 0
    for piece in _pieces(src, _PIECE):
        taken = 0
        while taken < piece.nbytes:
            target = targets[index]
            n = min(piece.nbytes - taken, target.nbytes - at)
            target[at : at + n] = piece[taken : taken + n]
            # The copy is hashed, not the source, which may change meanwhile.
            hasher.update(target[at : at + n])
            taken += n
            at += n
            if at == target.nbytes:
                index, at = index + 1, 0
    return int(hasher.intdigest())


def pread_checksum(fd: int, offset: int, dst: Sequence[Buffer], chunk: int) -> tuple[int, int]:
    """Fill `dst` from `fd` at `offset` until full or at end of file: (bytes read, xxh3-64)."""
    hasher = xxhash.xxh3_64()
    done = 0
    for piece in _pieces(dst, chunk):
        got = 0
        while got < piece.nbytes:
            count = os.preadv(fd, [piece[got:]], offset + done + got)
            if count == 0:
                break
            got += count
        hasher.update(piece[:got])
        done += got
        if got < piece.nbytes:
            break
    return done, int(hasher.intdigest())


def pwrite_checksum(fd: int, offset: int, src: Sequence[Buffer], chunk: int) -> int:
    """Write `src` to `fd` from `offset`, hashing each piece as it goes; returns the xxh3-64."""
    hasher = xxhash.xxh3_64()
    at = offset
    for piece in _pieces(src, chunk):
        hasher.update(piece)
        written = 0
        while written < piece.nbytes:
            count = os.pwritev(fd, [piece[written:]], at + written)
            if count == 0:
                raise OSError(errno.EIO, "pwritev wrote nothing")
            written += count
        at += written
    return int(hasher.intdigest())
