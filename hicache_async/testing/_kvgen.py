"""A deterministic stand-in for a model's KV: the oracle that tier and storage tests check against.

The bytes of token t in layer l, buffer b, head h depend on the token ids up to and including t,
on t itself, on (l, b, h), on the element's index and on the seed, and on nothing else; so two
prompts that share a prefix share that prefix's pages, exactly as real KV does.

How: a polynomial prefix hash per token, h_t = sum_{i<=t} (tok_i + 1) * P^(t-i) mod 2^64,
computed for all tokens at once as P^t * cumsum((tok_i + 1) * P^-i) (P is odd, so invertible
mod 2^64); a splitmix64 round turns (h_t, t) into a token word and (seed, b, l, h, element) into a
coordinate word; one multiply-xorshift of their sum gives each 64-bit word of the page.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._config import KVLayout
from .._keys import as_token_array
from .._pool import KVPool

__all__ = ["KVGenerator"]

_U64 = np.uint64
_P = 0x100000001B3  # FNV-64 prime: odd, hence invertible mod 2^64
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_POSITION = 0xD6E8FEB86659FD93
_MASK = (1 << 64) - 1

Tokens = Sequence[int] | np.ndarray[Any, Any]


def _inverse_mod_2_64(a: int) -> int:
    # Newton's iteration doubles the correct low bits each step; 6 steps cover 64 bits.
    x = a
    for _ in range(6):
        x = (x * (2 - a * x)) & _MASK
    return x


def _splitmix(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    x = x + _U64(_GOLDEN)
    x = (x ^ (x >> _U64(30))) * _U64(_MIX1)
    x = (x ^ (x >> _U64(27))) * _U64(_MIX2)
    result: np.ndarray[Any, Any] = x ^ (x >> _U64(31))
    return result


class KVGenerator:
    """Generates the KV bytes a model would write for a prompt, page by page."""

    def __init__(self, layout: KVLayout, page_size: int, *, seed: int = 0) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.layout = layout
        self.page_size = page_size
        self.seed = seed
        heads, width = layout.token_shape
        self._row_nbytes = width * layout.itemsize
        words = -(-self._row_nbytes // 8)
        nb, nl = layout.num_buffers, layout.num_layers
        # One coordinate word per (buffer, layer, head, word), shaped to broadcast over tokens.
        coords = np.arange(nb * nl * heads * words, dtype=_U64)
        with np.errstate(over="ignore"):
            seeded = coords ^ _U64((seed * _GOLDEN) & _MASK)
            self._coords = _splitmix(seeded).reshape(nb, nl, 1, heads, words)
        self._pow = np.ones(1, dtype=_U64)
        self._ipow = np.ones(1, dtype=_U64)

    def _powers(self, n: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        if len(self._pow) < n:
            size = max(n, 2 * len(self._pow))
            base = np.full(size, _P, dtype=_U64)
            base[0] = 1
            inverse = np.full(size, _inverse_mod_2_64(_P), dtype=_U64)
            inverse[0] = 1
            with np.errstate(over="ignore"):
                self._pow = np.cumprod(base, dtype=_U64)
                self._ipow = np.cumprod(inverse, dtype=_U64)
        return self._pow[:n], self._ipow[:n]

    def page_bytes(self, tokens: Tokens, page_index: int, *, token_major: bool = False) -> bytes:
        """The canonical bytes of page `page_index` of a prompt with token ids `tokens`.

        Only `tokens[:(page_index + 1) * page_size]` matter. `token_major` selects the
        `page_first` order ([buffer][token][layer][head][width]) instead of the layer-major one.
        """
        if page_index < 0:
            raise ValueError(f"page_index must be >= 0, got {page_index}")
        ns = self.page_size
        end = (page_index + 1) * ns
        toks = as_token_array(tokens)
        if len(toks) < end:
            raise ValueError(f"page {page_index} needs {end} tokens, the prompt has {len(toks)}")
        pw, ipw = self._powers(end)
        with np.errstate(over="ignore"):
            weighted = (toks[:end].astype(_U64) + _U64(1)) * ipw
            prefix = np.cumsum(weighted, dtype=_U64)[end - ns :] * pw[end - ns :]
            positions = np.arange(end - ns, end, dtype=_U64) * _U64(_POSITION)
            per_token = _splitmix(prefix ^ positions).reshape(1, 1, ns, 1, 1)
            words = per_token + self._coords
            words *= _U64(_MIX1)
            words ^= words >> _U64(29)
        raw: np.ndarray[Any, Any] = words.view(np.uint8)
        if raw.shape[-1] != self._row_nbytes:
            raw = raw[..., : self._row_nbytes]
        if token_major:
            raw = raw.transpose(0, 2, 1, 3, 4)
        data: bytes = raw.tobytes()
        return data

    def fill_page(self, pool: KVPool, page: int, tokens: Tokens, page_index: int) -> None:
        """Write page `page_index` of the prompt into `page` of `pool`, as the model would."""
        self._check_pool(pool)
        pool.write_page(page, self.page_bytes(tokens, page_index, token_major=pool.token_major))

    def check_page(self, pool: KVPool, page: int, tokens: Tokens, page_index: int) -> None:
        """Raise `AssertionError` unless `page` of `pool` holds page `page_index` of the prompt.

        The message names the page and the buffer, layer and token of the first difference.
        """
        self._check_pool(pool)
        expected = self.page_bytes(tokens, page_index, token_major=pool.token_major)
        actual = pool.read_page(page)
        if actual == expected:
            return
        diff = np.frombuffer(actual, np.uint8) != np.frombuffer(expected, np.uint8)
        first = int(np.argmax(diff))
        buffer, layer, token, head = self._locate(first, token_major=pool.token_major)
        raise AssertionError(
            f"{pool.name} page {page} does not hold prompt page {page_index}: "
            f"{int(diff.sum())} bytes differ, the first (byte {first}) at buffer {buffer} "
            f"layer {layer} token {token} (position {page_index * self.page_size + token}) "
            f"head {head}"
        )

    def _locate(self, offset: int, *, token_major: bool) -> tuple[int, int, int, int]:
        """(buffer, layer, token, head) of a byte offset into a page's canonical bytes."""
        layers, ns = self.layout.num_layers, self.page_size
        row = self._row_nbytes
        tl = self.layout.token_layer_nbytes
        head = (offset % tl) // row
        cell = offset // tl
        if token_major:
            buffer, rest = divmod(cell, ns * layers)
            token, layer = divmod(rest, layers)
        else:
            buffer, rest = divmod(cell, layers * ns)
            layer, token = divmod(rest, ns)
        return buffer, layer, token, head

    def _check_pool(self, pool: KVPool) -> None:
        if pool.layout != self.layout or pool.page_size != self.page_size:
            raise ValueError(f"{pool.name} has another layout or page size than this generator")

    def __repr__(self) -> str:
        return f"KVGenerator(layout={self.layout!r}, page_size={self.page_size}, seed={self.seed})"
