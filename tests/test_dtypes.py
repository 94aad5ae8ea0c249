"""Every accepted dtype, with odd shapes, stored and loaded byte for byte through every tier, and
the oracle that checks it tells layouts of one page size apart."""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args

import msgspec
import numpy as np
import pytest

from hicache_async import CacheConfig, HiCache, KVLayout, Namespace
from hicache_async._config import DType
from hicache_async.testing import KVGenerator, serve

DTYPES: tuple[str, ...] = get_args(DType)

# Rows of 3 to 14 bytes: no word wider than a byte or two divides them, and a page of one
# layer and one head is only a few bytes.
SHAPES: dict[str, dict[str, Any]] = {
    "mha-odd": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 7},
    "mla": {"num_layers": 3, "attention": "mla", "kv_lora_rank": 5, "qk_rope_head_dim": 2},
}


def _config(layout: KVLayout, page_size: int, **overrides: Any) -> CacheConfig:
    base: dict[str, Any] = {
        "layout": msgspec.to_builtins(layout),
        "page_size": page_size,
        "device_pages": 32,
        "host_pages": 64,
        "model_id": "dtypes",
        "prefetch": {"policy": "wait_complete", "threshold_tokens": 0},
    }
    base.update(overrides)
    return CacheConfig.from_dict(base)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("dtype", DTYPES)
async def test_every_dtype_comes_back_byte_exact_after_a_restart(
    tmp_path: Path, dtype: str, shape: str
) -> None:
    layout = KVLayout(**SHAPES[shape], dtype=dtype)
    page_size = 3
    config = _config(layout, page_size)
    generator = KVGenerator(layout, page_size, seed=5)
    prompts = [np.arange(start, start + 7 * page_size + 1) for start in (0, 1000)]
    whole = 7 * page_size * len(prompts)
    store = f"file://{tmp_path}"
    async with HiCache(config, storage=store) as first:
        for prompt in prompts:
            await serve(first, prompt, generator, check="all")
        await first.drain()
    async with HiCache(config, storage=store) as cold:  # storage -> host -> device
        served = [await serve(cold, p, generator, check="all") for p in prompts]
        assert sum(s.storage_tokens for s in served) == whole
        assert sum(s.checked_pages for s in served) == whole // page_size
    warm = _config(layout, page_size, warmup={"enabled": True, "ratio": 1.0})
    async with HiCache(warm, storage=store) as cache:  # manifest warmup -> host -> device
        result = await cache.wait_warmup()
        assert result is not None
        assert result.pages_loaded == whole // page_size
        served = [await serve(cache, p, generator, check="all", prefetch=False) for p in prompts]
        assert sum(s.host_tokens for s in served) == whole


LOOKALIKES = {
    "dtype": ({"dtype": "float16"}, {"dtype": "bfloat16"}),
    "float8": ({"dtype": "float8_e4m3fn"}, {"dtype": "float8_e5m2"}),
    "uint8": ({"dtype": "uint8"}, {"dtype": "float8_e4m3fn"}),
    "head-split": ({"num_kv_heads": 2, "head_dim": 8}, {"num_kv_heads": 1, "head_dim": 16}),
}


@pytest.mark.parametrize("which", sorted(LOOKALIKES))
async def test_a_page_read_under_a_lookalike_layout_fails_the_check(
    tmp_path: Path, which: str
) -> None:
    # A namespace that failed to tell two layouts apart would hand one model the other's
    # pages; they are the same size, so only the oracle can notice.
    written_as, read_as = (
        KVLayout(num_layers=2, **{"num_kv_heads": 2, "head_dim": 8, **fields})
        for fields in LOOKALIKES[which]
    )
    page_size = 4
    assert written_as.page_nbytes(page_size) == read_as.page_nbytes(page_size)
    writer_config = _config(written_as, page_size)
    reader_config = _config(read_as, page_size)
    shared = Namespace.from_config(writer_config)
    prompt = np.arange(3 * page_size + 1)
    store = f"file://{tmp_path}"
    async with HiCache(writer_config, storage=store, namespace=shared) as writer:
        await serve(writer, prompt, KVGenerator(written_as, page_size))
        await writer.drain()
    async with HiCache(reader_config, storage=store, namespace=shared) as reader:
        with pytest.raises(AssertionError, match="does not hold prompt page 0"):
            await serve(reader, prompt, KVGenerator(read_as, page_size))


# Layouts whose pages are all 512 bytes at 4 tokens a page.
SAME_SIZE = [
    *(KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=d) for d in ("float16", "bfloat16")),
    *(
        KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=d)
        for d in ("float8_e4m3fn", "float8_e5m2", "uint8")
    ),
    KVLayout(num_layers=2, num_kv_heads=1, head_dim=16),
    KVLayout(num_layers=2, num_kv_heads=4, head_dim=4),
    KVLayout(num_layers=1, num_kv_heads=2, head_dim=16),
    # One latent buffer of 32 elements: the bytes of two buffers of 16.
    KVLayout(num_layers=2, attention="mla", kv_lora_rank=32),
    KVLayout(num_layers=2, attention="mla", kv_lora_rank=24, qk_rope_head_dim=8),
]


def test_layouts_of_one_page_size_never_share_a_namespace() -> None:
    assert {layout.page_nbytes(4) for layout in SAME_SIZE} == {512}
    for tp_size in (1, 2):
        namespaces = [
            Namespace.from_config(
                CacheConfig(layout=layout, page_size=4, device_pages=4, tp_size=tp_size)
            )
            for layout in SAME_SIZE
        ]
        assert len({ns.seed for ns in namespaces}) == len(SAME_SIZE)
        assert len({ns.fingerprint for ns in namespaces}) == len(SAME_SIZE)


def test_the_oracle_writes_other_bytes_for_every_layout_of_one_page_size() -> None:
    tokens = np.arange(8)
    pages = {KVGenerator(layout, 4).page_bytes(tokens, 1) for layout in SAME_SIZE}
    assert len(pages) == len(SAME_SIZE)


# (word type, exponent mask, mantissa mask, quiet-NaN bit) of the wider floats.
_NAN_BITS = {
    "float16": (np.uint16, 0x7C00, 0x03FF, 0x0200),
    "bfloat16": (np.uint16, 0x7F80, 0x007F, 0x0040),
    "float32": (np.uint32, 0x7F800000, 0x007FFFFF, 0x00400000),
}


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_oracle_writes_the_bit_patterns_that_floats_compare_wrongly(dtype: str) -> None:
    # A copy that went through a float type (canonicalizing NaNs, or comparing them unequal,
    # or -0 equal to 0) would only show on pages that hold such patterns: the oracle writes
    # raw bits, every pattern included, and compares bytes.
    layout = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, dtype=dtype)
    data = np.frombuffer(KVGenerator(layout, 16).page_bytes(np.arange(16), 0), np.uint8)
    if layout.itemsize == 1:
        assert len(np.unique(data)) == 256  # NaNs, infinities and -0 of both float8 kinds
        return
    word, exponent, mantissa, quiet = _NAN_BITS[dtype]
    words = data.view(word)
    nans = words[((words & exponent) == exponent) & ((words & mantissa) != 0)]
    assert (nans & quiet).any()  # quiet NaNs
    assert ((nans & quiet) == 0).any()  # signalling NaNs, which a float load may quieten
