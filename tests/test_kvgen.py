"""KVGenerator: deterministic, prefix-faithful page bytes, and a checker that names the fault."""

from __future__ import annotations

import copy
import pickle
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_async._config import HostLayout, KVLayout
from hicache_async._pool import KVPool
from hicache_async.testing._kvgen import KVGenerator

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, dtype="bfloat16")
MLA = KVLayout(num_layers=2, attention="mla", kv_lora_rank=10, qk_rope_head_dim=3, dtype="uint8")
PAGE = 8


def _tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**32 - 1, size=n, dtype=np.int64)


def _cells(gen: KVGenerator, data: bytes) -> np.ndarray:
    """Canonical bytes as [buffer, layer, token, bytes-per-token-and-layer]."""
    layout = gen.layout
    return np.frombuffer(data, np.uint8).reshape(
        layout.num_buffers, layout.num_layers, gen.page_size, layout.token_layer_nbytes
    )


@pytest.mark.parametrize("layout", [LAYOUT, MLA])
def test_deterministic_and_sized(layout: KVLayout) -> None:
    tokens = _tokens(4 * PAGE)
    a = KVGenerator(layout, PAGE, seed=1)
    b = KVGenerator(layout, PAGE, seed=1)
    for page in range(4):
        data = a.page_bytes(tokens, page)
        assert len(data) == layout.page_nbytes(PAGE)
        assert data == b.page_bytes(list(tokens.tolist()), page)
    assert a.page_bytes(tokens, 2) != KVGenerator(layout, PAGE, seed=2).page_bytes(tokens, 2)
    # Pages, layers, buffers and heads all differ from one another.
    assert a.page_bytes(tokens, 0) != a.page_bytes(tokens, 1)
    cells = _cells(a, a.page_bytes(tokens, 0))
    assert (
        len(
            {
                cells[b_, layer].tobytes()
                for b_ in range(layout.num_buffers)
                for layer in range(layout.num_layers)
            }
        )
        == layout.num_buffers * layout.num_layers
    )


@pytest.mark.parametrize("how", ["pickle", "deepcopy", "copy"])
def test_a_generator_pickles_and_copies_to_one_writing_the_same_bytes(how: str) -> None:
    # A spawned worker is handed its oracle by pickling; the hash state kept after a call
    # cannot be pickled, so the copy is made from the layout, page size and seed.
    tokens = _tokens(3 * PAGE)
    gen = KVGenerator(LAYOUT, PAGE, seed=7)
    first = gen.page_bytes(tokens, 1)  # leaves a hash state behind
    made = {
        "pickle": lambda: pickle.loads(pickle.dumps(gen)),
        "deepcopy": lambda: copy.deepcopy(gen),
        "copy": lambda: copy.copy(gen),
    }[how]()
    assert (made.layout, made.page_size, made.seed) == (LAYOUT, PAGE, 7)
    assert made.page_bytes(tokens, 1) == first
    assert made.page_bytes(tokens, 2) == gen.page_bytes(tokens, 2)
    other = _tokens(3 * PAGE, seed=1)
    assert made.page_bytes(other, 0) == KVGenerator(LAYOUT, PAGE, seed=7).page_bytes(other, 0)


def test_token_major_is_the_same_bytes_reordered() -> None:
    gen = KVGenerator(LAYOUT, PAGE)
    tokens = _tokens(2 * PAGE)
    layer_major = _cells(gen, gen.page_bytes(tokens, 1))
    token_major = np.frombuffer(gen.page_bytes(tokens, 1, token_major=True), np.uint8).reshape(
        LAYOUT.num_buffers, PAGE, LAYOUT.num_layers, LAYOUT.token_layer_nbytes
    )
    assert np.array_equal(layer_major.transpose(0, 2, 1, 3), token_major)


def test_prefix_property_per_page() -> None:
    gen = KVGenerator(LAYOUT, PAGE)
    tokens = _tokens(5 * PAGE)
    before = [gen.page_bytes(tokens, p) for p in range(5)]
    changed = tokens.copy()
    changed[2 * PAGE + 3] += 1
    after = [gen.page_bytes(changed, p) for p in range(5)]
    assert after[:2] == before[:2]
    assert all(a != b for a, b in zip(after[2:], before[2:], strict=True))
    # Tokens after the page end do not matter at all.
    assert gen.page_bytes(tokens[: 3 * PAGE], 2) == before[2]


def test_prefix_property_per_token() -> None:
    gen = KVGenerator(LAYOUT, PAGE)
    tokens = _tokens(PAGE)
    changed = tokens.copy()
    changed[5] = (changed[5] + 7) % 2**32
    before = _cells(gen, gen.page_bytes(tokens, 0))
    after = _cells(gen, gen.page_bytes(changed, 0))
    assert np.array_equal(before[:, :, :5], after[:, :, :5])
    for token in range(5, PAGE):
        assert not np.array_equal(before[:, :, token], after[:, :, token])


def test_same_tokens_at_other_positions_differ() -> None:
    gen = KVGenerator(LAYOUT, PAGE)
    repeated = np.full(2 * PAGE, 42)
    assert gen.page_bytes(repeated, 0) != gen.page_bytes(repeated, 1)


def test_too_few_tokens() -> None:
    gen = KVGenerator(LAYOUT, PAGE)
    with pytest.raises(ValueError, match="needs 16 tokens"):
        gen.page_bytes(_tokens(PAGE + 3), 1)
    with pytest.raises(ValueError, match="page_index"):
        gen.page_bytes(_tokens(PAGE), -1)


@pytest.mark.parametrize("memory_layout", ["layer_first", "page_first", "page_first_direct"])
def test_fill_and_check(memory_layout: HostLayout) -> None:
    gen = KVGenerator(LAYOUT, PAGE, seed=9)
    pool = KVPool(LAYOUT, PAGE, 4, memory_layout=memory_layout, name="host")
    tokens = _tokens(3 * PAGE)
    gen.fill_page(pool, 3, tokens, 2)
    gen.check_page(pool, 3, tokens, 2)
    with pytest.raises(AssertionError, match="host page 3 does not hold prompt page 1"):
        gen.check_page(pool, 3, tokens, 1)
    with pytest.raises(AssertionError, match="page 0"):
        gen.check_page(pool, 0, tokens, 2)


@pytest.mark.parametrize("memory_layout", ["layer_first", "page_first", "page_first_direct"])
def test_check_page_names_a_single_flipped_byte(memory_layout: HostLayout) -> None:
    gen = KVGenerator(LAYOUT, PAGE)
    pool = KVPool(LAYOUT, PAGE, 2, memory_layout=memory_layout)
    tokens = _tokens(2 * PAGE)
    gen.fill_page(pool, 1, tokens, 1)
    buffer, layer, token, head = 1, 2, 5, 1
    view = pool.page_view(1, layer)[buffer]
    view[token, head].view(torch.uint8)[3].bitwise_xor_(0x10)
    with pytest.raises(AssertionError) as info:
        gen.check_page(pool, 1, tokens, 1)
    message = str(info.value)
    assert "1 bytes differ" in message
    assert re.search(
        rf"buffer {buffer} layer {layer} token {token} \(position {PAGE + token}\) head {head}",
        message,
    ), message


def test_generator_rejects_foreign_pools() -> None:
    gen = KVGenerator(LAYOUT, PAGE)
    with pytest.raises(ValueError, match="layout"):
        gen.fill_page(KVPool(MLA, PAGE, 1), 0, _tokens(PAGE), 0)
    with pytest.raises(ValueError, match="page size"):
        gen.check_page(KVPool(LAYOUT, PAGE * 2, 1), 0, _tokens(PAGE), 0)


def test_a_generators_seed_layout_and_page_size_cannot_be_reassigned() -> None:
    # The words are mixed from the seed and layout once: a seed assigned afterwards named a
    # generator of another rank or run that still wrote the first one's bytes.
    gen = KVGenerator(LAYOUT, PAGE, seed=0)
    first = gen.page_bytes(_tokens(PAGE), 0)
    for name, value in (("seed", 1), ("layout", MLA), ("page_size", PAGE * 2)):
        with pytest.raises(AttributeError):
            setattr(gen, name, value)
    assert (gen.seed, gen.layout, gen.page_size) == (0, LAYOUT, PAGE)
    assert KVGenerator(LAYOUT, PAGE, seed=1).page_bytes(_tokens(PAGE), 0) != first


def test_thue_morse_prompt_and_its_complement_differ() -> None:
    # A linear prefix hash (sum of (tok + 1) * P^(t - i) mod 2^64) maps this pair, which
    # differs at every one of 2048 positions, to the same hash: the Prouhet-Thue-Morse
    # signs make every power of (P - 1) up to 2^11 cancel. The oracle must tell them apart.
    gen = KVGenerator(KVLayout(num_layers=2, num_kv_heads=2, head_dim=8), PAGE)
    n = 2048
    thue_morse = [bin(i).count("1") & 1 for i in range(n)]
    tail = list(range(500, 500 + 2 * PAGE))
    a = [100 + t for t in thue_morse] + tail
    b = [101 - t for t in thue_morse] + tail
    for page in (n // PAGE - 1, n // PAGE, n // PAGE + 1):
        assert gen.page_bytes(a, page) != gen.page_bytes(b, page)


def test_walking_a_prompt_in_any_order_gives_the_same_pages() -> None:
    # The generator resumes its hash from the previous call's prefix: the bytes must not
    # depend on what was asked before.
    tokens = _tokens(6 * PAGE, seed=4)
    fresh = [KVGenerator(LAYOUT, PAGE).page_bytes(tokens, p) for p in range(6)]
    gen = KVGenerator(LAYOUT, PAGE)
    other = _tokens(6 * PAGE, seed=5)
    for page in (5, 0, 1, 3, 2, 4):
        gen.page_bytes(other, page)
        assert gen.page_bytes(tokens, page) == fresh[page]
        assert gen.page_bytes(tokens[: (page + 1) * PAGE], page) == fresh[page]


@settings(max_examples=200, deadline=None)
@given(
    a=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=3 * PAGE),
    b=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=3 * PAGE),
    small=st.booleans(),
)
def test_distinct_prefixes_give_distinct_page_bytes(
    a: list[int], b: list[int], small: bool
) -> None:
    # Optionally squeeze the ids into {0, 1, 2}: structured, low-entropy prompts are where a
    # weak hash collides.
    if small:
        a, b = [x % 3 for x in a], [x % 3 for x in b]
    gen = KVGenerator(KVLayout(num_layers=1, num_kv_heads=1, head_dim=4), PAGE)
    pad = [7] * PAGE  # whole pages; the padding is the same for both prompts
    a, b = a + pad, b + pad
    last = min(len(a), len(b)) // PAGE - 1
    for page in range(last + 1):
        end = (page + 1) * PAGE
        same = a[:end] == b[:end]
        assert (gen.page_bytes(a, page) == gen.page_bytes(b, page)) == same
