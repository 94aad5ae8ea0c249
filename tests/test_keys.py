from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from _unowned_storage import Unowned

from hicache_async import (
    CacheConfig,
    HiCache,
    InvalidTokensError,
    KVLayout,
    Namespace,
    PrefetchConfig,
    page_keys,
)
from hicache_async.storage import MemoryStorage
from hicache_async.testing import KVGenerator, serve


def _sglang_reference(tokens: list[int], page_size: int) -> list[str]:
    """SGLang HiCache's chain, written out independently: hex digests, prior hash as bytes."""
    keys: list[str] = []
    prior: str | None = None
    for start in range(0, len(tokens) - page_size + 1, page_size):
        hasher = hashlib.sha256()
        if prior:
            hasher.update(bytes.fromhex(prior))
        for t in tokens[start : start + page_size]:
            hasher.update(struct.pack("<I", t))
        prior = hasher.hexdigest()
        keys.append(prior)
    return keys


def test_empty_namespace_matches_sglang_chain() -> None:
    tokens = [(i * 7919) % 50_000 for i in range(10 * 16 + 5)]
    keys = page_keys(tokens, 16)
    assert len(keys) == 10
    assert [k.hex() for k in keys] == _sglang_reference(tokens, 16)


def test_pinned_vector() -> None:
    # sha256(le32(1) le32(2)) and then sha256(that || le32(3) le32(4))
    first = hashlib.sha256(bytes([1, 0, 0, 0, 2, 0, 0, 0])).digest()
    second = hashlib.sha256(first + bytes([3, 0, 0, 0, 4, 0, 0, 0])).digest()
    assert page_keys([1, 2, 3, 4, 5], 2) == [first, second]


def test_prefix_property_and_continuation() -> None:
    tokens = list(range(100))
    full = page_keys(tokens, 10)
    assert page_keys(tokens[:50], 10) == full[:5]
    assert page_keys(tokens[50:], 10, prior=full[4]) == full[5:]


def test_namespace_separates_deployments() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4)
    a = Namespace.from_config(CacheConfig(layout=layout, device_pages=4, model_id="a"))
    b = Namespace.from_config(CacheConfig(layout=layout, device_pages=4, model_id="b"))
    c = Namespace.from_config(
        CacheConfig(layout=layout, device_pages=4, model_id="a", tp_rank=1, tp_size=2)
    )
    tokens = list(range(32))
    chains = {tuple(page_keys(tokens, 8, ns.seed)) for ns in (a, b, c)}
    assert len(chains) == 3
    assert len({a.fingerprint, b.fingerprint, c.fingerprint}) == 3
    assert a.salted("x").seed != a.seed
    assert a.salted("") == a
    sglang = Namespace.from_config(
        CacheConfig(layout=layout, device_pages=4), sglang_compatible=True
    )
    assert sglang.seed == b""
    assert sglang.fingerprint != bytes(16)


def test_a_token_major_host_layout_is_a_namespace_of_its_own() -> None:
    """`page_first` stores pages token-major: its pages must never be read by a deployment
    whose pages are layer-major, with SGLang-compatible keys too (the fingerprint tells)."""

    def namespace(host_layout: str, *, sglang: bool = False) -> Namespace:
        config = CacheConfig.from_dict(
            {
                "layout": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 4},
                "device_pages": 4,
                "model_id": "a",
                "host_layout": host_layout,
            }
        )
        return Namespace.from_config(config, sglang_compatible=sglang)

    layer_major = namespace("layer_first")
    assert namespace("page_first_direct") == layer_major  # the same bytes per page
    token_major = namespace("page_first")
    assert token_major.seed != layer_major.seed
    assert token_major.fingerprint != layer_major.fingerprint
    assert (
        namespace("page_first", sglang=True).fingerprint
        != namespace("layer_first", sglang=True).fingerprint
    )


@pytest.mark.parametrize(
    "tokens", [[-1, 2], [2**32], ["a", "b"], [[1, 2]], [1.5, 2.0], "abc", [True, False]]
)
def test_invalid_tokens_are_rejected(tokens: object) -> None:
    with pytest.raises(InvalidTokensError):
        page_keys(tokens, 1)


def test_accepts_numpy_and_torch() -> None:
    tokens = list(range(64))
    expected = page_keys(tokens, 16)
    assert page_keys(np.arange(64, dtype=np.int64), 16) == expected
    assert page_keys(torch.arange(64), 16) == expected
    assert page_keys([], 16) == []


def test_ranks_share_chains_but_not_storage_keys_or_fingerprints() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4)
    ranks = [
        Namespace.from_config(CacheConfig(layout=layout, device_pages=4, tp_rank=r, tp_size=2))
        for r in range(2)
    ]
    single = Namespace.from_config(CacheConfig(layout=layout, device_pages=4))
    tokens = list(range(32))
    chains = [page_keys(tokens, 8, ns.seed) for ns in ranks]
    assert chains[0] == chains[1]  # every rank names a prefix the same way
    assert ranks[0].storage_keys(chains[0]) != ranks[1].storage_keys(chains[1])
    assert ranks[0].fingerprint != ranks[1].fingerprint
    assert single.storage_keys(chains[0]) == chains[0]  # one rank: keys are storage keys
    assert page_keys(tokens, 8, single.seed) != chains[0]  # tp_size is in the seed


def test_mla_ranks_share_one_namespace_whatever_the_tp_size() -> None:
    # Every rank holds the same latent KV: one copy per page in storage, not one per rank,
    # and the pages of a TP1 deployment serve a TP8 one.
    layout = KVLayout(num_layers=2, attention="mla", kv_lora_rank=8, qk_rope_head_dim=4)
    single = Namespace.from_config(CacheConfig(layout=layout, device_pages=4))
    for size in (2, 8):
        for rank in range(size):
            config = CacheConfig(layout=layout, device_pages=4, tp_rank=rank, tp_size=size)
            assert Namespace.from_config(config) == single
    keys = page_keys(list(range(32)), 8, single.seed)
    assert single.storage_keys(keys) == keys
    # MHA ranks still hold different heads: their own keys and fingerprints.
    mha = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4)
    assert (
        len(
            {
                Namespace.from_config(CacheConfig(layout=mha, device_pages=4, tp_rank=r, tp_size=2))
                for r in range(2)
            }
        )
        == 2
    )


async def test_an_mla_rank_serves_the_pages_another_rank_stored() -> None:
    layout = KVLayout(num_layers=2, attention="mla", kv_lora_rank=8, qk_rope_head_dim=4)
    prompt = list(range(100, 164))

    def config(rank: int) -> CacheConfig:
        return CacheConfig(
            layout=layout,
            page_size=8,
            device_pages=32,
            model_id="mla",
            tp_rank=rank,
            tp_size=2,
            prefetch=PrefetchConfig(threshold_tokens=8),
        )

    generator = KVGenerator(layout, 8)
    async with MemoryStorage() as store:
        async with HiCache(config(0), storage=Unowned(store)) as first:
            await serve(first, prompt, generator, prefetch=False)
            await first.drain()
        assert store.stats().pages == len(prompt) // 8
        async with HiCache(config(1), storage=Unowned(store)) as second:
            result = await second.prefetch(prompt, policy="wait_complete")
            assert (result.status.value, result.storage_tokens) == ("complete", len(prompt))
            await serve(second, prompt, generator, prefetch=False, check="all")
        assert store.stats().pages == len(prompt) // 8  # no second copy


@pytest.mark.parametrize(
    "tokens",
    [
        [1, True],
        [np.bool_(True), 1],
        np.array([1, True], dtype=object),
        np.array([np.bool_(False), 2], dtype=object),
    ],
)
def test_bools_among_ints_are_rejected(tokens: object) -> None:
    # numpy would silently make them 0 and 1: a different page than the caller meant.
    with pytest.raises(InvalidTokensError, match="bool"):
        page_keys(tokens, 1)


@pytest.mark.parametrize(
    "tokens",
    [
        [np.int64(1), 2, 3, 4],
        np.array([np.int64(1), 2, np.uint32(3), 4], dtype=object),
        np.array([1, 2, 3, 4], dtype=object),
    ],
)
def test_numpy_integer_scalars_are_accepted(tokens: object) -> None:
    assert page_keys(tokens, 2) == page_keys([1, 2, 3, 4], 2)


@pytest.mark.parametrize(
    "tokens", [[2**63, 1], [-1, 2**63], [2**64, 1], [2**32, 0], np.array([2**32], np.uint64)]
)
def test_out_of_range_tokens_say_so(tokens: object) -> None:
    with pytest.raises(InvalidTokensError, match=r"must be in \[0, 2\*\*32\)"):
        page_keys(tokens, 1)
    assert page_keys([2**32 - 1, 0], 2) == page_keys(np.array([2**32 - 1, 0], np.uint32), 2)


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"seed": b"x", "fingerprint": b"short"}, ValueError, "fingerprint must be 16 bytes"),
        ({"seed": b"", "fingerprint": bytes(17)}, ValueError, "fingerprint must be 16 bytes"),
        ({"seed": b"", "fingerprint": "f" * 16}, TypeError, "fingerprint must be bytes"),
        ({"seed": b"", "fingerprint": bytearray(16)}, TypeError, "fingerprint must be bytes"),
        ({"seed": "seed", "fingerprint": bytes(16)}, TypeError, "seed must be bytes"),
        ({"seed": None, "fingerprint": bytes(16)}, TypeError, "seed must be bytes"),
        (
            {"seed": b"", "fingerprint": bytes(16), "rank_salt": 1},
            TypeError,
            "rank_salt must be bytes",
        ),
    ],
)
def test_a_namespace_refuses_what_every_backup_would_fail_on(
    fields: dict[str, object], error: type[Exception], message: str
) -> None:
    # A short fingerprint used to be taken, and then every page's backup failed.
    with pytest.raises(error, match=message):
        Namespace(**fields)  # type: ignore[arg-type]


def test_a_namespace_takes_any_seed_and_a_16_byte_fingerprint() -> None:
    assert Namespace(seed=b"x", fingerprint=bytes(16)).seed == b"x"
    assert Namespace(b"", bytes(16), b"rank").rank_salt == b"rank"
    assert Namespace.empty().salted("s").salted(b"t").fingerprint != bytes(16)


@pytest.mark.parametrize("sglang_compatible", [False, True])
@pytest.mark.parametrize("page_size", [2, 16, 64])
def test_no_prompt_reaches_a_salted_chain(page_size: int, sglang_compatible: bool) -> None:
    # The salted seed once hashed the salt itself after b"\0salt\0": for a salt of
    # 4 * page_size - 6 bytes that is exactly the chain step of a first page holding those
    # bytes, so an unsalted prompt's chain, shifted by a page, was the salted prompt's chain
    # and a salted request loaded another prompt's pages.
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4)
    config = CacheConfig(layout=layout, device_pages=4, page_size=page_size)
    namespace = Namespace.from_config(config, sglang_compatible=sglang_compatible)
    salt = bytes(range(4 * page_size - 6))
    page0 = np.frombuffer(b"\x00salt\x00" + salt, dtype="<u4")
    rest = np.arange(3 * page_size, dtype="<u4")
    unsalted = page_keys(np.concatenate([page0, rest]), page_size, namespace.seed)
    salted = page_keys(rest, page_size, namespace.salted(salt).seed)
    assert len(salted) == 3
    assert not set(salted) & set(unsalted)
    # And a salt still separates: the same tokens under two salts share no key.
    other = page_keys(rest, page_size, namespace.salted(salt + b"!").seed)
    assert not set(salted) & set(other)


def _uint32_buffers() -> list[object]:
    import array

    return [
        np.arange(8, dtype="<u4"),
        np.arange(8, dtype="<u4")[::1],
        torch.arange(8, dtype=torch.int64).to(torch.uint32),
        memoryview(np.arange(8, dtype="<u4")),
        array.array("I", range(8)),
        _OwnBuffer(),
    ]


class _OwnBuffer:
    """A container whose `__array__` hands out the array it keeps."""

    def __init__(self) -> None:
        self.data = np.arange(8, dtype="<u4")

    def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
        return self.data

    def __iter__(self) -> Iterator[int]:
        return iter(self.data.tolist())


@pytest.mark.parametrize("tokens", _uint32_buffers(), ids=type)
def test_token_arrays_never_share_the_callers_buffer(tokens: object) -> None:
    # A request keeps its tokens; a caller reusing its buffer must not change them.
    from hicache_async._keys import as_token_array

    array = as_token_array(tokens)
    assert array.tolist() == list(range(8))
    buffer = np.asarray(tokens.numpy() if isinstance(tokens, torch.Tensor) else tokens)
    if isinstance(tokens, _OwnBuffer):
        buffer = tokens.data
    assert not np.shares_memory(array, buffer)


async def test_a_request_keeps_its_tokens_when_the_caller_reuses_its_buffer() -> None:
    from hicache_async import HiCache

    config = CacheConfig(
        layout=KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype="float16"),
        device_pages=8,
        page_size=4,
        host_pages=8,
    )
    tokens = np.arange(8, dtype="<u4")
    async with HiCache(config) as cache:
        request = cache.request(tokens)
        tokens[:] = 100
        assert request.tokens.tolist() == list(range(8))
        request.release()
