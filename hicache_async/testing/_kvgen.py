"""A deterministic stand-in for a model's KV: the oracle that tier and storage tests check against.

The bytes of token t in layer l, buffer b, head h depend on the token ids up to and including t,
on t itself, on (l, b, h), on the element's index, on the seed and on the layout (dtype, heads,
head size, attention kind), and on nothing else; so two prompts that share a prefix share that
prefix's pages, exactly as real KV does, and two layouts whose pages are the same size (float16
and bfloat16, two heads of 8 and one of 16) never write the same bytes, as two real models
would not: a page read under the wrong layout fails the check instead of passing it.

How: token t's word is h_t = BLAKE2b-64 of the token ids 0..t (little-endian uint32), a
sequential, nonlinear hash of the whole prefix (its length, so t, is part of the input); a
splitmix64 round turns (seed, layout hash, b, l, h, element) into a coordinate word; one
multiply-xorshift of h_t + coordinate gives each 64-bit word of the page. Both steps after the
hash are bijections of h_t for a fixed coordinate, so two prefixes give the same bytes only if
their 64-bit hashes collide (about 2^-64 per pair). An earlier linear polynomial hash had
structural collisions (a Thue-Morse prompt and its complement gave identical pages), which an
oracle must not have.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
import numpy as np

from .._config import KVLayout
from .._keys import TokenIds, as_token_array
from .._pool import KVPool

__all__ = ["KVGenerator"]

_U64 = np.uint64
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_MASK = (1 << 64) - 1


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
        self._layout = layout
        self._page_size = page_size
        self._seed = seed
        heads, width = layout.token_shape
        self._row_nbytes = width * layout.itemsize
        words = -(-self._row_nbytes // 8)
        nb, nl = layout.num_buffers, layout.num_layers
        # One coordinate word per (buffer, layer, head, word), shaped to broadcast over tokens.
        coords = np.arange(nb * nl * heads * words, dtype=_U64)
        # Without the layout, the words depend on the page geometry only, so a float16 page
        # read back where a bfloat16 one was expected (a namespace that failed to tell them
        # apart) would check as correct.
        described = msgspec.json.encode(layout, order="sorted")
        layout_word = int.from_bytes(hashlib.blake2b(described, digest_size=8).digest(), "little")
        with np.errstate(over="ignore"):
            seeded = coords ^ _U64(((seed * _GOLDEN) ^ layout_word) & _MASK)
            self._coords = _splitmix(seeded).reshape(nb, nl, 1, heads, words)
        # The hash state after the prefix of the last call, so that walking a prompt page by
        # page hashes each token once (a comparison, far cheaper than hashing, checks that
        # the next call's prompt starts with that prefix). One tuple, replaced whole, so a
        # generator shared by threads never pairs a prefix with another prefix's state.
        self._resume: tuple[bytes, Any] = (b"", hashlib.blake2b(digest_size=8))

    # Read-only: the words were mixed from the seed and the layout once, above; assigned
    # afterwards, they would name an oracle that still wrote the old bytes.
    @property
    def layout(self) -> KVLayout:
        """The layout the bytes are made for."""
        return self._layout

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self._page_size

    @property
    def seed(self) -> int:
        """The seed mixed into every word."""
        return self._seed

    def _token_hashes(self, toks: np.ndarray[Any, Any], start: int, end: int) -> list[int]:
        """h_t for t in [start, end): the 64-bit hash of the token ids 0..t."""
        data = toks[:end].astype("<u4", copy=False).tobytes()
        done, state = self._resume
        if len(done) <= 4 * start and data.startswith(done):
            hasher = state.copy()
            hasher.update(data[len(done) : 4 * start])
        else:
            hasher = hashlib.blake2b(data[: 4 * start], digest_size=8)
        self._resume = (data[: 4 * start], hasher.copy())
        hashes = []
        for offset in range(4 * start, 4 * end, 4):
            hasher.update(data[offset : offset + 4])
            hashes.append(int.from_bytes(hasher.digest(), "little"))
        return hashes

    def page_bytes(self, tokens: TokenIds, page_index: int, *, token_major: bool = False) -> bytes:
        """The canonical bytes of page `page_index` of a prompt with token ids `tokens`.

        Only `tokens[:(page_index + 1) * page_size]` matter. `token_major` selects the
        `page_first` order ([buffer][token][layer][head][width]) instead of the layer-major one.
        """
        if page_index < 0:
            raise ValueError(f"page_index must be >= 0, got {page_index}")
        ns = self._page_size
        end = (page_index + 1) * ns
        toks = as_token_array(tokens)
        if len(toks) < end:
            raise ValueError(f"page {page_index} needs {end} tokens, the prompt has {len(toks)}")
        hashes = self._token_hashes(toks, end - ns, end)
        per_token = np.array(hashes, dtype=_U64).reshape(1, 1, ns, 1, 1)
        with np.errstate(over="ignore"):
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

    def fill_page(self, pool: KVPool, page: int, tokens: TokenIds, page_index: int) -> None:
        """Write page `page_index` of the prompt into `page` of `pool`, as the model would."""
        self._check_pool(pool)
        pool.write_page(page, self.page_bytes(tokens, page_index, token_major=pool.token_major))

    def check_page(self, pool: KVPool, page: int, tokens: TokenIds, page_index: int) -> None:
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
            f"layer {layer} token {token} (position {page_index * self._page_size + token}) "
            f"head {head}"
        )

    def _locate(self, offset: int, *, token_major: bool) -> tuple[int, int, int, int]:
        """(buffer, layer, token, head) of a byte offset into a page's canonical bytes."""
        layers, ns = self._layout.num_layers, self._page_size
        row = self._row_nbytes
        tl = self._layout.token_layer_nbytes
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
        if pool.layout != self._layout or pool.page_size != self._page_size:
            raise ValueError(f"{pool.name} has another layout or page size than this generator")

    def __reduce__(self) -> tuple[Any, ...]:
        """Rebuilt from its layout, page size and seed, so it pickles (e.g. for a spawned
        process) and deep-copies: the hash state it keeps between calls cannot be pickled,
        and everything else is made from those three."""
        return (_rebuild, (self._layout, self._page_size, self._seed))

    def __repr__(self) -> str:
        return (
            f"KVGenerator(layout={self._layout!r}, page_size={self._page_size}, seed={self._seed})"
        )


def _rebuild(layout: KVLayout, page_size: int, seed: int) -> KVGenerator:
    return KVGenerator(layout, page_size, seed=seed)
