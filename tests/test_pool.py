"""KVPool: memory layouts, canonical page bytes, views, and make_pools."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from hicache_async import HiCache
from hicache_async._allocator import PageAllocator
from hicache_async._config import MAX_POOL_NBYTES, CacheConfig, HostLayout, KVLayout
from hicache_async._errors import ConfigError
from hicache_async._pool import KVPool, PoolStatistics, make_pools
from hicache_async.testing._kvgen import KVGenerator

MEMORY_LAYOUTS: tuple[HostLayout, ...] = ("layer_first", "page_first", "page_first_direct")
DTYPES = ("float16", "bfloat16", "float32", "float8_e4m3fn", "uint8")
PAGE_SIZE = 4
NUM_PAGES = 6


def _layout(attention: str, dtype: str) -> KVLayout:
    if attention == "mha":
        return KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=dtype)  # type: ignore[arg-type]
    return KVLayout(
        num_layers=3,
        attention="mla",
        kv_lora_rank=12,
        qk_rope_head_dim=4,
        dtype=dtype,  # type: ignore[arg-type]
    )


@pytest.fixture(params=["mha", "mla"])
def attention(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=DTYPES)
def dtype(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.mark.parametrize("memory_layout", MEMORY_LAYOUTS)
def test_segments_round_trip_and_shapes(
    attention: str, dtype: str, memory_layout: HostLayout
) -> None:
    layout = _layout(attention, dtype)
    pool = KVPool(layout, PAGE_SIZE, NUM_PAGES, memory_layout=memory_layout)
    nb, nl = layout.num_buffers, layout.num_layers
    heads, width = layout.token_shape

    segments = pool.page_segments(2)
    expected_count = {"layer_first": nb * nl, "page_first": nb, "page_first_direct": 1}
    assert len(segments) == expected_count[memory_layout]
    assert sum(s.nbytes for s in segments) == pool.page_nbytes == layout.page_nbytes(PAGE_SIZE)
    assert all(not s.readonly and s.format == "B" and s.ndim == 1 for s in segments)
    assert pool.nbytes == pool.page_nbytes * NUM_PAGES
    assert pool.dtype.itemsize == layout.itemsize

    data = os.urandom(pool.page_nbytes)
    pool.write_page(2, data)
    assert pool.read_page(2) == data
    assert b"".join(pool.page_segments(2)) == data
    for other in (0, 1, 3, NUM_PAGES - 1):
        assert pool.read_page(other) == bytes(pool.page_nbytes)

    for layer in range(nl):
        views = pool.page_view(2, layer)
        assert len(views) == nb
        for view in views:
            assert view.shape == (PAGE_SIZE, heads, width)
            assert view.dtype == pool.dtype


@pytest.mark.parametrize("memory_layout", MEMORY_LAYOUTS)
def test_segments_write_through_to_the_page(memory_layout: HostLayout) -> None:
    layout = _layout("mha", "float16")
    pool = KVPool(layout, PAGE_SIZE, NUM_PAGES, memory_layout=memory_layout)
    data = os.urandom(pool.page_nbytes)
    start = 0
    for segment in pool.page_segments(4):
        segment[:] = data[start : start + segment.nbytes]
        start += segment.nbytes
    assert pool.read_page(4) == data
    assert pool.read_page(3) == bytes(pool.page_nbytes)
    assert pool.read_page(5) == bytes(pool.page_nbytes)


def test_canonical_order_is_shared_by_layer_first_and_page_first_direct(
    attention: str, dtype: str
) -> None:
    layout = _layout(attention, dtype)
    lf = KVPool(layout, PAGE_SIZE, NUM_PAGES, memory_layout="layer_first")
    pfd = KVPool(layout, PAGE_SIZE, NUM_PAGES, memory_layout="page_first_direct")
    data = os.urandom(lf.page_nbytes)
    lf.write_page(1, data)
    pfd.write_page(5, lf.read_page(1))
    assert pfd.read_page(5) == data
    for layer in range(layout.num_layers):
        for a, b in zip(lf.page_view(1, layer), pfd.page_view(5, layer), strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_every_layout_holds_the_same_kv(attention: str, dtype: str) -> None:
    """The same model output written into each layout gives identical per-layer views."""
    layout = _layout(attention, dtype)
    gen = KVGenerator(layout, PAGE_SIZE, seed=3)
    tokens = np.arange(100, 100 + 3 * PAGE_SIZE)
    pools = [KVPool(layout, PAGE_SIZE, NUM_PAGES, memory_layout=m) for m in MEMORY_LAYOUTS]
    for i, pool in enumerate(pools):
        gen.fill_page(pool, i, tokens, 2)
    for layer in range(layout.num_layers):
        reference = [v.view(torch.uint8).clone() for v in pools[0].page_view(0, layer)]
        for i, pool in enumerate(pools[1:], start=1):
            for ref, view in zip(reference, pool.page_view(i, layer), strict=True):
                assert torch.equal(ref, view.view(torch.uint8))
    # page_first stores the token-major order, the others the layer-major one.
    assert pools[1].read_page(1) == gen.page_bytes(tokens, 2, token_major=True)
    assert pools[0].read_page(0) == pools[2].read_page(2) == gen.page_bytes(tokens, 2)


def test_layer_buffers_share_memory_with_pages() -> None:
    layout = _layout("mha", "float32")
    pool = KVPool(layout, PAGE_SIZE, NUM_PAGES)
    k, v = pool.layer_buffers(1)
    assert k.shape == (NUM_PAGES * PAGE_SIZE, 2, 8)
    slot = 3 * PAGE_SIZE + 2
    k[slot].fill_(1.5)
    v[slot].fill_(-2.0)
    page_k, page_v = pool.page_view(3, 1)
    assert torch.all(page_k[2] == 1.5)
    assert torch.all(page_v[2] == -2.0)
    assert torch.count_nonzero(page_k) == 2 * 8
    assert pool.read_page(3) != bytes(pool.page_nbytes)

    other = KVPool(layout, PAGE_SIZE, NUM_PAGES, memory_layout="page_first")
    with pytest.raises(ValueError, match="layer_first"):
        other.layer_buffers(0)


def test_copy_views_cover_each_layer_exactly() -> None:
    layout = _layout("mha", "bfloat16")
    for memory_layout in MEMORY_LAYOUTS:
        pool = KVPool(layout, PAGE_SIZE, NUM_PAGES, memory_layout=memory_layout)
        view = pool.copy_views(2)
        assert view.shape[:4] == (2, NUM_PAGES, PAGE_SIZE, 2)
        assert view.shape[4] * view.element_size() == 8 * 2
        assert not view.dtype.is_floating_point
        view[1, 4].fill_(-1)
        assert torch.all(pool.page_view(4, 2)[1].view(torch.uint8) == 255)
        assert torch.count_nonzero(pool.page_view(4, 2)[0]) == 0
        assert torch.count_nonzero(pool.page_view(4, 1)[1]) == 0
        assert torch.count_nonzero(pool.page_view(3, 2)[1]) == 0


@pytest.mark.parametrize("memory_layout", MEMORY_LAYOUTS)
@pytest.mark.parametrize("per_token", [False, True])
def test_copy_rows_hold_the_pages_they_are_said_to(
    memory_layout: HostLayout, per_token: bool
) -> None:
    layout = _layout("mha", "float32")
    pool = KVPool(layout, PAGE_SIZE, NUM_PAGES, memory_layout=memory_layout)
    pool.data.view(torch.uint8).random_(0, 256)
    pages = np.array([4, 1, 5])
    if memory_layout == "page_first" and not per_token:
        with pytest.raises(ValueError, match="token-major"):
            pool.copy_rows(per_token=False)
        with pytest.raises(ValueError, match="token-major"):
            pool.copy_row_index(pages, per_token=False)
        return
    rows = pool.copy_rows(per_token=per_token)
    index, step = pool.copy_row_index(pages, per_token=per_token)
    per_page = PAGE_SIZE if per_token else 1
    assert index.shape == (2, len(pages) * per_page)
    for layer in range(layout.num_layers):
        view = pool.copy_views(layer)
        for b in range(2):
            got = rows[torch.from_numpy(index[b] + layer * step)]
            want = view[b, torch.from_numpy(pages)].reshape(got.shape)
            assert torch.equal(got, want)


def test_bad_arguments_are_rejected() -> None:
    layout = _layout("mha", "float16")
    pool = KVPool(layout, PAGE_SIZE, NUM_PAGES)
    for page in (-1, NUM_PAGES):
        with pytest.raises(ValueError, match="out of range"):
            pool.page_view(page, 0)
        with pytest.raises(ValueError, match="out of range"):
            pool.page_segments(page)
        with pytest.raises(ValueError, match="out of range"):
            pool.read_page(page)
    with pytest.raises(ValueError, match="layer"):
        pool.page_view(0, 3)
    # A bool is no page or layer number (True would pass as 1).
    for page, layer in ((True, 0), (0, True), (np.True_, 0)):
        with pytest.raises(TypeError, match="must be an int, got"):
            pool.page_view(page, layer)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="page must be an int, got bool"):
        pool.read_page(True)
    with pytest.raises(ValueError, match="bytes"):
        pool.write_page(0, b"\x00" * (pool.page_nbytes - 1))
    with pytest.raises(ValueError, match="memory_layout"):
        KVPool(layout, PAGE_SIZE, NUM_PAGES, memory_layout="token_first")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_pages"):
        KVPool(layout, PAGE_SIZE, 0)
    with pytest.raises(ValueError, match="page_size"):
        KVPool(layout, 0, NUM_PAGES)


def test_pools_too_big_to_allocate_are_config_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    layout = _layout("mha", "float16")
    past_bound = MAX_POOL_NBYTES // layout.page_nbytes(PAGE_SIZE) + 1
    with pytest.raises(ConfigError) as info:
        KVPool(layout, PAGE_SIZE, past_bound, config_field="host_pages")
    assert info.value.field == "host_pages"
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    past_memory = memory // layout.page_nbytes(PAGE_SIZE) + 1
    with pytest.raises(ConfigError, match=f"more than the {memory} bytes cpu has") as info:
        KVPool(layout, PAGE_SIZE, past_memory)
    assert info.value.field == "num_pages"

    def refuse(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    # Whatever torch says when it cannot allocate comes out as a ConfigError.
    monkeypatch.setattr(torch, "empty", refuse)
    with pytest.raises(ConfigError, match="can't allocate memory") as info:
        KVPool(layout, PAGE_SIZE, NUM_PAGES, name="device", config_field="device_pages")
    assert info.value.field == "device_pages"
    assert str(NUM_PAGES * layout.page_nbytes(PAGE_SIZE)) in info.value.reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine")
def test_pinning_needs_cuda() -> None:
    with pytest.raises(ValueError, match="pin_memory"):
        KVPool(_layout("mha", "float16"), PAGE_SIZE, NUM_PAGES, pin_memory=True)


def test_non_cpu_pools_have_no_segments() -> None:
    layout = _layout("mha", "float16")
    pool = KVPool(layout, PAGE_SIZE, NUM_PAGES, device="meta")
    with pytest.raises(ValueError, match="CPU pool"):
        pool.page_segments(0)


def test_statistics_and_repr() -> None:
    layout = _layout("mla", "float16")
    pool = KVPool(layout, PAGE_SIZE, NUM_PAGES, memory_layout="page_first", name="host")
    assert pool.allocator.alloc(2) == [0, 1]
    assert pool.statistics() == PoolStatistics(
        name="host",
        device="cpu",
        memory_layout="page_first",
        num_pages=NUM_PAGES,
        page_nbytes=pool.page_nbytes,
        free=NUM_PAGES - 2,
        used=2,
        pinned=False,
    )
    assert "2/6 used" in repr(pool)


def test_make_pools_sizes_and_layouts() -> None:
    config = CacheConfig(
        layout=_layout("mha", "float16"),
        device_pages=5,
        page_size=PAGE_SIZE,
        host_ratio=3.0,
        host_layout="page_first_direct",
        device="auto",
    )
    device_pool, host_pool = make_pools(config)
    assert device_pool.num_pages == 5
    assert host_pool.num_pages == 15 == config.resolved_host_pages
    assert device_pool.memory_layout == "layer_first"
    assert host_pool.memory_layout == "page_first_direct"
    assert host_pool.device.type == "cpu"
    assert host_pool.page_nbytes == device_pool.page_nbytes == config.page_nbytes
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert device_pool.device.type == expected
    assert host_pool.pinned == torch.cuda.is_available()
    if not torch.cuda.is_available():
        assert not host_pool.statistics().pinned
        assert not host_pool.data.is_pinned()


def test_make_pools_explicit_cpu_device() -> None:
    config = CacheConfig(
        layout=_layout("mla", "bfloat16"), device_pages=3, page_size=8, host_pages=7, device="cpu"
    )
    device_pool, host_pool = make_pools(config)
    assert (device_pool.device.type, device_pool.num_pages) == ("cpu", 3)
    assert (host_pool.num_pages, host_pool.memory_layout) == (7, "layer_first")
    assert device_pool.read_page(2) == bytes(device_pool.page_nbytes)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pools() -> None:
    config = CacheConfig(layout=_layout("mha", "float16"), device_pages=4, page_size=PAGE_SIZE)
    device_pool, host_pool = make_pools(config)
    assert device_pool.device.type == "cuda"
    assert host_pool.pinned
    assert host_pool.data.is_pinned()
    with pytest.raises(ValueError, match="CPU pool"):
        device_pool.page_segments(0)
    data = os.urandom(device_pool.page_nbytes)
    device_pool.write_page(3, data)
    assert device_pool.read_page(3) == data


async def test_a_pools_shape_and_allocator_cannot_be_replaced_under_its_cache() -> None:
    # Given a fresh allocator, the cache handed a second request the device pages the first
    # still wrote its KV into; a changed page size or count no longer matched the views.
    config = CacheConfig(
        layout=KVLayout(num_layers=1, num_kv_heads=1, head_dim=4),
        page_size=4,
        device_pages=4,
        host_pages=8,
    )
    async with HiCache(config) as cache:
        pool = cache.device_pool
        with cache.request(list(range(8))) as first:
            held = await first.allocate(8)
            for name, value in (
                ("allocator", PageAllocator(4, name="device")),
                ("page_size", 2),
                ("num_pages", 8),
                ("page_nbytes", 1),
                ("nbytes", 1),
                ("layout", KVLayout(num_layers=2, num_kv_heads=1, head_dim=4)),
                ("memory_layout", "page_first"),
                ("device", torch.device("meta")),
                ("dtype", torch.float32),
                ("name", "host"),
            ):
                with pytest.raises(AttributeError):
                    setattr(pool, name, value)
            with cache.request(list(range(100, 108))) as second:
                assert not set(await second.allocate(8)) & set(held)
        assert (pool.page_size, pool.num_pages, pool.name) == (4, 4, "device")
