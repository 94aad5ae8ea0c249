"""The packaged chat-workload trace and deterministic token ids derived from it.

The trace publishes one id per 512-token block instead of token ids; block id b expands to 512
tokens drawn from a generator seeded by b, so equal ids give equal tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Annotated

import msgspec
import numpy as np

__all__ = ["BLOCK_TOKENS", "TraceRequest", "block_tokens", "load_trace", "request_tokens"]

BLOCK_TOKENS = 512
_VOCAB = 128_000
_TRACE_FILE = "mooncake_conversation_trace.jsonl"


#: A block id seeds the generator of its tokens and is held as a uint32 by the benchmarks.
BlockId = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
Length = Annotated[int, msgspec.Meta(ge=0)]


class TraceRequest(msgspec.Struct, frozen=True):
    """One request of the trace; a line whose lengths are negative, or whose block ids are
    not in [0, 2**32), is refused when the trace is read."""

    timestamp: int
    input_length: Length
    output_length: Length
    hash_ids: list[BlockId]


def default_trace_path() -> Path:
    """The trace shipped in the package."""
    return Path(str(resources.files("hicache_async") / "data" / _TRACE_FILE))


def load_trace(path: str | Path | None = None, *, limit: int | None = None) -> list[TraceRequest]:
    """Read the trace (the packaged one by default), at most `limit` requests. A line that is
    not a request raises `ValueError`, naming the line."""
    decoder = msgspec.json.Decoder(TraceRequest)
    requests: list[TraceRequest] = []
    with open(path or default_trace_path(), "rb") as f:
        for number, line in enumerate(f, 1):
            if limit is not None and len(requests) >= limit:
                break
            if line.strip():
                try:
                    requests.append(decoder.decode(line))
                except msgspec.DecodeError as exc:
                    # msgspec's own errors are ValueErrors only from 0.22 on.
                    raise ValueError(f"line {number}: {exc}") from None
    return requests


_block_cache: dict[int, np.ndarray] = {}


def block_tokens(block_id: int) -> np.ndarray:
    """The 512 token ids that block `block_id` stands for (cached; read-only)."""
    tokens = _block_cache.get(block_id)
    if tokens is None:
        rng = np.random.Generator(np.random.PCG64(block_id))
        tokens = rng.integers(0, _VOCAB, size=BLOCK_TOKENS, dtype=np.uint32)
        tokens.setflags(write=False)
        if len(_block_cache) < 1 << 16:
            _block_cache[block_id] = tokens
    return tokens


def request_tokens(request: TraceRequest) -> np.ndarray:
    """The prompt's token ids: its blocks' tokens, cut to `input_length`."""
    if not request.hash_ids:
        return np.zeros(0, dtype=np.uint32)
    tokens = np.concatenate([block_tokens(b) for b in request.hash_ids])
    return tokens[: request.input_length]


def iter_request_tokens(requests: list[TraceRequest]) -> Iterator[np.ndarray]:
    """Token ids of each request in order."""
    for request in requests:
        yield request_tokens(request)
