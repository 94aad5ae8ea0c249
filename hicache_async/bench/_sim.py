"""Simulation helpers of `bench trace`: a model profile, a virtual-clock prefill scheduler and the
hit-rate upper bound of a trace.

Nothing here sleeps or reads a wall clock: time is what the profile says work costs, and events
happen in virtual-time order.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import Protocol

import msgspec

from .._trace import BLOCK_TOKENS, TraceRequest

__all__ = [
    "LLAMA3_8B_H100",
    "PROFILES",
    "Bound",
    "Engine",
    "ModelProfile",
    "NoCacheEngine",
    "percentile",
    "simulate",
    "upper_bound",
]


class ModelProfile(msgspec.Struct, frozen=True, kw_only=True):
    """What a model on its hardware costs: compute per token, KV size, tier bandwidths.

    Prefill time of `n` new tokens after a cached prefix of `p` tokens is
    ``n * prefill_s_per_token + (n * p + n * (n + 1) / 2) * attention_s_per_pair``: the
    linear layers per token, plus causal attention per (query, key) pair.
    """

    name: str
    description: str
    prefill_s_per_token: float
    attention_s_per_pair: float
    kv_bytes_per_token: int
    device_kv_tokens: int
    host_to_device_gbps: float
    storage_read_gbps: float

    def compute_s(self, new_tokens: int, cached_tokens: int) -> float:
        """Seconds to prefill `new_tokens` after `cached_tokens` of cached prefix."""
        n = new_tokens
        pairs = n * cached_tokens + n * (n + 1) / 2
        return n * self.prefill_s_per_token + pairs * self.attention_s_per_pair

    def kv_bytes(self, tokens: int) -> int:
        """Bytes of KV of `tokens` tokens of the real model."""
        return tokens * self.kv_bytes_per_token

    def host_load_s(self, tokens: int) -> float:
        """Seconds to copy `tokens` tokens of KV from the host pool to the device."""
        return self.kv_bytes(tokens) / (self.host_to_device_gbps * 1e9)

    def storage_read_s(self, tokens: int) -> float:
        """Seconds to read `tokens` tokens of KV from storage into the host pool."""
        return self.kv_bytes(tokens) / (self.storage_read_gbps * 1e9)


def _llama3_8b_h100() -> ModelProfile:
    # Llama-3-8B: 8.03e9 parameters, 32 layers, hidden 4096, 8 KV heads of dim 128, bf16.
    # H100 SXM: 989 TFLOP/s dense bf16 (datasheet), of which prefill is taken to reach 50%.
    flops = 989e12 * 0.5
    params, layers, hidden = 8.03e9, 32, 4096
    kv_per_token = 2 * layers * 8 * 128 * 2  # K and V of every layer: 128 KiB
    # 88% of the 80 GB for weights and KV (SGLang's static share on an H100), minus weights.
    kv_tokens = int((80e9 * 0.88 - 2 * params) / kv_per_token)
    return ModelProfile(
        name="llama3-8b-h100",
        description="Llama-3-8B bf16 on one H100 SXM",
        prefill_s_per_token=2 * params / flops,
        attention_s_per_pair=4 * layers * hidden / flops,
        kv_bytes_per_token=kv_per_token,
        device_kv_tokens=kv_tokens,
        host_to_device_gbps=50.0,  # PCIe 5.0 x16, ~50 of its 64 GB/s achieved
        storage_read_gbps=6.0,  # one PCIe 4.0 NVMe SSD (~7 GB/s sequential read), derated
    )


LLAMA3_8B_H100 = _llama3_8b_h100()
PROFILES: dict[str, ModelProfile] = {LLAMA3_8B_H100.name: LLAMA3_8B_H100}


class Engine(Protocol):
    """What `simulate` drives: the cache side of one simulated server."""

    async def arrive(self, index: int, now: float) -> float:
        """Request `index` arrived at `now`; return when it can be scheduled (>= now)."""
        ...

    async def start(self, index: int, now: float) -> float | None:
        """Start its prefill at `now`; return its duration, or None when memory is short
        (it is retried after the next prefill finishes)."""
        ...

    async def finish(self, index: int, now: float) -> None:
        """Its prefill finished at `now`."""
        ...


class NoCacheEngine:
    """Every token computed, nothing loaded: the baseline TTFT."""

    def __init__(self, profile: ModelProfile, lengths: Sequence[int]) -> None:
        self._profile = profile
        self._lengths = lengths

    async def arrive(self, index: int, now: float) -> float:
        return now

    async def start(self, index: int, now: float) -> float | None:
        return self._profile.compute_s(self._lengths[index], 0)

    async def finish(self, index: int, now: float) -> None:
        return None


# Same-time events: finishes free slots first, then readiness, then arrivals.
_FINISH, _READY, _ARRIVE = 0, 1, 2


async def simulate(
    arrivals: Sequence[float], engine: Engine, *, slots: int
) -> tuple[list[float], list[float]]:
    """Run requests arriving at `arrivals` (seconds, non-decreasing) through `slots`
    concurrent prefills, first come first served among those ready.

    Returns (TTFT, queueing delay) per request, in seconds of virtual time.
    """
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    count = len(arrivals)
    events: list[tuple[float, int, int]] = []  # (time, kind, request)
    started = [math.nan] * count
    finished = [math.nan] * count
    ready: list[int] = []  # heap of ready requests, by arrival order
    free = slots
    running = 0
    blocked = False
    next_arrival = 0
    while next_arrival < count or events:
        if next_arrival < count and (
            not events or (arrivals[next_arrival], _ARRIVE) < events[0][:2]
        ):
            now, kind, index = arrivals[next_arrival], _ARRIVE, next_arrival
            next_arrival += 1
        else:
            now, kind, index = heapq.heappop(events)
        if kind == _ARRIVE:
            when = await engine.arrive(index, now)
            if when <= now:
                heapq.heappush(ready, index)
            else:
                heapq.heappush(events, (when, _READY, index))
        elif kind == _READY:
            heapq.heappush(ready, index)
        else:
            await engine.finish(index, now)
            finished[index] = now
            free += 1
            running -= 1
            blocked = False
        while free and ready and not blocked:
            index = ready[0]
            duration = await engine.start(index, now)
            if duration is None:
                if not running:
                    raise RuntimeError(
                        f"request {index} does not fit in the device pool even when idle"
                    )
                blocked = True
                break
            heapq.heappop(ready)
            started[index] = now
            free -= 1
            running += 1
            heapq.heappush(events, (now + duration, _FINISH, index))
    ttft = [f - a for f, a in zip(finished, arrivals, strict=True)]
    queued = [s - a for s, a in zip(started, arrivals, strict=True)]
    return ttft, queued


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0-100) by linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


class Bound(msgspec.Struct, frozen=True):
    """What a cache of unlimited size could serve of a trace, replayed in order.

    `block_hit_rate`: blocks (partial last blocks included) whose (position, prefix of
    hash_ids) appeared in an earlier request, over all blocks: the trace README's figure.
    `token_hit_rate`: prompt tokens in whole pages of `page_size` that an earlier request
    computed as whole pages, matched as a prefix, over all prompt tokens: what a
    page-granular cache, which never caches a short tail page, could reach at most.
    """

    blocks: int
    block_hits: int
    tokens: int
    token_hits: int

    @property
    def block_hit_rate(self) -> float:
        return self.block_hits / self.blocks if self.blocks else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.token_hits / self.tokens if self.tokens else 0.0


def upper_bound(requests: Sequence[TraceRequest], page_size: int) -> Bound:
    """The unlimited-cache bound of `requests` for pages of `page_size` tokens."""
    if page_size < 1 or BLOCK_TOKENS % page_size:
        raise ValueError(f"page_size must divide {BLOCK_TOKENS}, got {page_size}")
    per_block = BLOCK_TOKENS // page_size
    # A prefix of hash_ids is a trie node; equal nodes mean equal tokens up to that block.
    trie: dict[tuple[int, int], int] = {}
    # Whole pages of a block computed so far, per node (pages fill a block from its start).
    computed: dict[int, int] = {}
    blocks = block_hits = tokens = token_hits = 0
    for request in requests:
        length = request.input_length
        tokens += length
        node = -1
        matching = True
        for position, block_id in enumerate(request.hash_ids):
            child = trie.get((node, block_id))
            blocks += 1
            if child is None:
                child = len(trie)
                trie[(node, block_id)] = child
            else:
                block_hits += 1
            node = child
            full = min(per_block, max(0, (length - position * BLOCK_TOKENS) // page_size))
            if matching:
                have = min(full, computed.get(node, 0))
                token_hits += have * page_size
                matching = have == per_block
            if full > computed.get(node, 0):
                computed[node] = full
    return Bound(blocks=blocks, block_hits=block_hits, tokens=tokens, token_hits=token_hits)
