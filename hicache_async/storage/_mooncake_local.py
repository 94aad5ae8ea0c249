"""Reading pages that lie in this Mooncake client's own segment straight from its memory.

A client lends the cluster a segment of its own address space, and the master places objects
there. For those, a transfer through the engine is a loopback copy plus, for us, a separate
checksum pass over the landed bytes. Reading them in place instead costs one pass: the
payload is copied into the page and hashed in the same loop (`_native.copy_checksum`).

Safety rests on three checks, each of which sends the page back to the engine's path:

- the replica is complete, in memory, and its `transport_endpoint` is this client's own
  (`get_hostname()`, `ip:port`, unique per process on a host), so its `buffer_address` is
  an address in this process;
- the whole object lies in a readable mapping of this process (`/proc/self/maps`, looked up
  once per mapping and remembered), so a surprise never turns into a crash;
- the header and the checksum of the bytes copied verify. The replica list comes from
  `batch_get_replica_desc`, whose RPC grants the objects the master's read lease (5 s by
  default), as the engine's own reads rely on; an object removed with `force` and its memory
  reused in the meantime fails the check and is read through the engine, never served.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["LocalObjects", "readable_mapping"]


def readable_mapping(address: int, nbytes: int, maps: str | None = None) -> tuple[int, int] | None:
    """The readable mapping of this process that holds `[address, address + nbytes)`, as
    `(start, end)`, or None (no such mapping, or not Linux)."""
    if maps is None:
        if not sys.platform.startswith("linux"):
            return None
        try:
            with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
                maps = f.read()
        except OSError:
            return None
    end = address + nbytes
    # The kernel lists a region as several mappings when parts of it differ in flags it does
    # not show here: contiguous readable mappings count as one.
    merged: tuple[int, int] | None = None
    for line in maps.splitlines():
        fields = line.split(maxsplit=2)
        if len(fields) < 2 or not fields[1].startswith("r"):
            merged = None
            continue
        low, _, high = fields[0].partition("-")
        try:
            start, stop = int(low, 16), int(high, 16)
        except ValueError:
            merged = None
            continue
        joins = merged is not None and merged[1] == start
        merged = (merged[0], stop) if merged is not None and joins else (start, stop)
        if merged[0] <= address and end <= merged[1]:
            return merged
    return None


class LocalObjects:
    """Finds which objects of a batch lie in this client's segment (worker threads only)."""

    def __init__(self, endpoint: str) -> None:
        if not endpoint:
            raise ValueError("endpoint must be this client's ip:port")
        self.endpoint = endpoint
        # Mappings already found to hold objects. Replaced whole (never mutated), so jobs on
        # several threads can read it without a lock; a lost update only costs a lookup.
        self._mappings: tuple[tuple[int, int], ...] = ()

    def _readable(self, address: int, nbytes: int) -> bool:
        end = address + nbytes
        if any(start <= address and end <= stop for start, stop in self._mappings):
            return True
        found = readable_mapping(address, nbytes)
        if found is None:
            return False
        self._mappings = (*self._mappings, found)
        return True

    def sources(
        self, store: Any, names: Sequence[str], sizes: Sequence[int]
    ) -> dict[int, memoryview]:
        """For each object of `names` stored here with exactly its expected size, a read-only
        view of its bytes, by position in `names`. Objects elsewhere are left out."""
        if not names:
            return {}
        try:
            described = store.batch_get_replica_desc(list(names))
        except Exception:  # any failure here only means: through the engine
            return {}
        found: dict[int, memoryview] = {}
        for index, (name, size) in enumerate(zip(names, sizes, strict=True)):
            for replica in described.get(name, ()):
                if not replica.is_memory_replica() or replica.status.name != "COMPLETE":
                    continue
                buffer = replica.get_memory_descriptor().buffer_descriptor
                address = int(buffer.buffer_address)
                if (
                    buffer.transport_endpoint != self.endpoint
                    or int(buffer.size) != size
                    or address <= 0
                    or not self._readable(address, size)
                ):
                    continue
                view = memoryview((ctypes.c_char * size).from_address(address))
                found[index] = view.cast("B").toreadonly()
                break
        return found
