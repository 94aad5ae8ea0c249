"""Hostile input: malformed configurations, token ids and tensors that are not token ids,
damaged pages, garbage in the storage root, bad storage URLs — and the security checks: pages
without the MAC key on a shared root, and storage roots other users could tamper with.

Each must get a clear error — an exception of hicache_async's own types whose message names
the problem — or be skipped and counted (a damaged page is a miss, recomputed, counted as
corrupt). Nothing crashes the loop, and nothing already cached is lost: prompts served before
the hostile calls are served afterwards with the same tiers and the right bytes.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hicache_async import (
    CacheConfig,
    ConfigError,
    HiCache,
    HiCacheError,
    InvalidTokensError,
    KVLayout,
    Namespace,
    OutOfPagesError,
    StorageConfigError,
    load_config,
    page_keys,
)
from hicache_async.storage import (
    HEADER_NBYTES,
    FileStorage,
    MemoryStorage,
    Outcome,
    PageMeta,
    RedisStorage,
    open_storage,
)
from hicache_async.testing import KVGenerator, serve

from . import PAGE, Record, assert_drained, make_config, prompt_pool, settle

#: The loop this suite runs under in the short run (the full run uses every loop).
SHORT_LOOP = "asyncio"


LAYOUT = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 4}

# (overrides of a valid configuration, the field the error must name)
CONFIG_CASES: list[tuple[dict[str, Any], str]] = [
    ({"device_pages": "8"}, "device_pages"),
    ({"device_pages": 0}, "device_pages"),
    ({"device_pages": -3}, "device_pages"),
    ({"device_pages": 8.5}, "device_pages"),
    ({"device_pages": True}, "device_pages"),
    ({"device_pages": None}, "device_pages"),
    ({"page_size": 0}, "page_size"),
    ({"page_size": [4]}, "page_size"),
    ({"host_pages": 0}, "host_pages"),
    ({"host_ratio": math.nan}, "host_ratio"),
    ({"host_ratio": math.inf}, "host_ratio"),
    ({"host_ratio": -1.0}, "host_ratio"),
    ({"host_ratio": 2.0, "host_pages": 4}, "host_pages"),
    ({"bogus": 1}, "bogus"),
    ({"write_policy": "sometimes"}, "write_policy"),
    ({"eviction": "random"}, "eviction"),
    ({"host_layout": "diagonal"}, "host_layout"),
    ({"tp_rank": 2, "tp_size": 2}, "tp_rank"),
    ({"tp_size": 0}, "tp_size"),
    ({"device": "tpu"}, "device"),
    ({"device": "cuda:x"}, "device"),
    ({"storage": 5}, "storage"),
    ({"model_id": None}, "model_id"),
    ({"layout": "llama"}, "layout"),
    ({"layout": {**LAYOUT, "dtype": "int4"}}, "layout.dtype"),
    ({"layout": {**LAYOUT, "num_layers": -1}}, "layout.num_layers"),
    ({"layout": {**LAYOUT, "head_dim": math.nan}}, "layout.head_dim"),
    ({"layout": {**LAYOUT, "kv_lora_rank": 8}}, "layout.kv_lora_rank"),
    ({"layout": {**LAYOUT, "extra": 1}}, "layout"),
    ({"layout": {"num_layers": 2, "attention": "mla"}}, "layout.kv_lora_rank"),
    ({"prefetch": "fast"}, "prefetch"),
    ({"prefetch": {"bogus": 0}}, "prefetch"),
    ({"prefetch": {"policy": "eventually"}}, "prefetch.policy"),
    ({"prefetch": {"timeout_base_s": math.nan}}, "prefetch.timeout_base_s"),
    ({"prefetch": {"timeout_max_s": math.inf}}, "prefetch.timeout_max_s"),
    ({"prefetch": {"timeout_base_s": 5.0, "timeout_max_s": 1.0}}, "prefetch.timeout_max_s"),
    ({"prefetch": {"io_timeout_s": 0}}, "prefetch.io_timeout_s"),
    ({"prefetch": {"max_host_share": 1.5}}, "prefetch.max_host_share"),
    ({"prefetch": {"workers": 0}}, "prefetch.workers"),
    ({"backup": {"max_retries": -1}}, "backup.max_retries"),
    ({"backup": {"retry_backoff_s": -math.inf}}, "backup.retry_backoff_s"),
    ({"backup": {"io_timeout_s": math.nan}}, "backup.io_timeout_s"),
    ({"warmup": {"ratio": 2}}, "warmup.ratio"),
    ({"warmup": {"enabled": "yes"}}, "warmup.enabled"),
]


def _config_dict(overrides: dict[str, Any]) -> dict[str, Any]:
    base: dict[str, Any] = {"layout": dict(LAYOUT), "device_pages": 8, "page_size": PAGE}
    base.update(overrides)
    return base


@pytest.mark.parametrize(("overrides", "field"), CONFIG_CASES, ids=lambda v: repr(v)[:40])
def test_malformed_config_names_the_field(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_dict(_config_dict(overrides))
    assert info.value.field == field or field in str(info.value), info.value
    assert info.value.reason


@pytest.mark.parametrize(
    "text",
    ["{", "[]", "null", '"config"', "{}", '{"layout": 1}', '{"device_pages": NaN}', "\x00\xff"],
)
def test_malformed_json_is_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError, match=r"invalid configuration at"):
        CacheConfig.from_json(text)


@pytest.mark.parametrize(
    "text", ["x = ", "device_pages = nan", "[layout]\nnum_layers = 'two'", "device_pages = 1e999"]
)
def test_malformed_toml_is_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError, match=r"invalid configuration at"):
        CacheConfig.from_toml(text)


@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [
        ("garbage.toml", b"\x00\x01 = \x02", "TOML"),
        ("garbage.json", b"{'layout': }", "JSON"),
        ("absent.toml", None, "cannot read"),
        ("config.yaml", b"layout: {}", "config file type"),
        ("config", b"", "config file type"),
        ("directory.toml", "dir", "not a regular file"),
        # Not UTF-8: escapes as UnicodeDecodeError today.
        ("binary.json", b"\xff\xfe\xb9garbage", "binary.json"),
        ("binary.toml", b"device_pages = 8\n\xc3\x28", "binary.toml"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_config_files_that_are_not_configs(
    tmp_path: Path, name: str, content: bytes | str | None, needle: str
) -> None:
    path = tmp_path / name
    if content == "dir":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert needle in str(info.value), info.value


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"device_pages": 2**70}, "device_pages"),
        ({"host_pages": 2**70}, "host_pages"),
        ({"page_size": 2**40}, "page_size"),
        ({"layout": {**LAYOUT, "head_dim": 2**62}}, "layout.head_dim"),
    ],
    ids=["device_pages", "host_pages", "page_size", "head_dim"],
)
def test_pool_sizes_no_machine_can_hold_are_config_errors(
    overrides: dict[str, Any], field: str
) -> None:
    """Today these pass validation and fail when the cache opens, with an OverflowError or a
    TypeError from torch instead of a ConfigError naming the field."""
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_dict(_config_dict(overrides))
    assert info.value.field == field


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("prefetch", {"policy": "wait_complete"}),
        ("backup", None),
        ("warmup", "on"),
        ("storage", 3),
        ("eviction", 1),
    ],
)
def test_directly_built_config_checks_types(field: str, value: object) -> None:
    """`CacheConfig(...)` built in Python (not decoded) must refuse wrong types as `from_dict`
    does; today a dict for `prefetch` passes and the cache fails later with AttributeError."""
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4)
    wrong: dict[str, Any] = {field: value}
    with pytest.raises(ConfigError) as info:
        CacheConfig(layout=layout, device_pages=8, **wrong)
    assert field in str(info.value)


async def test_opening_with_an_overflowing_pool_is_a_config_error() -> None:
    async def open_cache() -> None:
        config = CacheConfig.from_dict(_config_dict({"device_pages": 2**70}))
        async with HiCache(config):
            pass

    # Validation may refuse the size before the cache is built: what matters is that no torch
    # error escapes on the way to an open cache.
    with pytest.raises(HiCacheError):
        await open_cache()


@pytest.mark.parametrize("pool", ["device", "host", "both"])
async def test_opening_pools_larger_than_the_machine_is_a_config_error(pool: str) -> None:
    """Sizes within what validation allows but beyond this machine's memory: refused when the
    cache opens, naming the field, before any memory is touched."""
    page_nbytes = CacheConfig.from_dict(_config_dict({})).page_nbytes
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    too_many = memory // page_nbytes + 1
    half = too_many // 2 + 1  # each pool fits, the two together do not
    sizes = {"device": (too_many, 8), "host": (8, too_many), "both": (half, half)}[pool]
    config = CacheConfig.from_dict(
        _config_dict({"device": "cpu", "device_pages": sizes[0], "host_pages": sizes[1]})
    )
    with pytest.raises(ConfigError) as info:
        async with HiCache(config):
            pass
    assert info.value.field == ("device_pages" if pool == "device" else "host_pages")
    assert "bytes" in info.value.reason


# Token ids and things that are not token ids.

_TOKEN_CASES: dict[str, Callable[[], Any]] = {
    "negative": lambda: [1, -1, 2],
    "2**32": lambda: [1, 2**32],
    "2**100": lambda: [2**100],
    "float": lambda: [1.5, 2.0],
    "nan": lambda: [math.nan],
    "str": lambda: "1 2 3",
    "bytes": lambda: b"\x01\x02",
    "list of str": lambda: ["1", "2"],
    "mixed": lambda: [1, "2"],
    "nested": lambda: [[1, 2], [3, 4]],
    "ragged": lambda: [1, [2, 3]],
    "none": lambda: None,
    "none inside": lambda: [1, None],
    "dict": lambda: {"input_ids": [1, 2]},
    "scalar": lambda: 7,
    "object": object,
    "bools": lambda: [True, False],
    "generator": lambda: (i for i in range(8)),
    "numpy float": lambda: np.ones(8),
    "numpy uint64 big": lambda: np.array([2**40], dtype=np.uint64),
    "numpy 2-D": lambda: np.zeros((2, 8), dtype=np.int64),
    "numpy str": lambda: np.array(["1", "2"]),
    "tensor float32": lambda: torch.ones(8),
    "tensor float16 kv": lambda: torch.zeros(2, 2, 8, 2, 4, dtype=torch.float16),
    "tensor bfloat16": lambda: torch.ones(8, dtype=torch.bfloat16),
    "tensor float8": lambda: torch.zeros(8, dtype=torch.float8_e4m3fn),
    "tensor complex": lambda: torch.ones(8, dtype=torch.complex64),
    "tensor 2-D int": lambda: torch.zeros(1, 8, dtype=torch.int64),
    "tensor negative": lambda: torch.tensor([3, -4]),
    "tensor bool": lambda: torch.ones(8, dtype=torch.bool),
}


def _token_calls(cache: HiCache, tokens: Any) -> dict[str, Callable[[], Awaitable[object]]]:
    """Every public entry point that takes token ids, as awaitables."""

    async def request() -> object:
        with cache.request(tokens):
            return None

    async def sync(call: Callable[[], object]) -> object:
        return call()

    return {
        "request": request,
        "match": lambda: sync(lambda: cache.match(tokens)),
        "keys_for": lambda: sync(lambda: cache.keys_for(tokens)),
        "prefetch": lambda: cache.prefetch(tokens),
        "start_prefetch": lambda: cache.start_prefetch(tokens),
    }


@pytest.mark.parametrize("case", list(_TOKEN_CASES))
async def test_hostile_token_ids_are_invalid_tokens_errors(case: str) -> None:
    config = make_config()
    async with HiCache(config, storage="memory://?capacity=1MiB") as cache:
        for name, call in _token_calls(cache, _TOKEN_CASES[case]()).items():
            with pytest.raises(InvalidTokensError) as info:
                await call()
            assert "token ids" in str(info.value), (name, info.value)
        await settle(cache)
        assert_drained(cache)


async def _served_state(
    cache: HiCache, prompts: list[np.ndarray[Any, Any]]
) -> list[tuple[int, int]]:
    return [(cache.match(p).device_tokens, cache.match(p).host_tokens) for p in prompts]


async def test_nothing_cached_is_lost_to_hostile_calls(figures: Record) -> None:
    """Every hostile token case, empty prompts and a bad storage attach, against one open cache
    holding prompts: afterwards the same prompts are cached in the same tiers and serve the
    right bytes. Errors are collected, not raised, so one bad case cannot hide the others."""
    config = make_config()
    generator = KVGenerator(config.layout, PAGE, seed=8)
    prompts = prompt_pool(8, seed=12)
    wrong: list[str] = []
    async with HiCache(config, storage="memory://?capacity=4MiB") as cache:
        for prompt in prompts:
            await serve(cache, prompt, generator)
        await settle(cache)
        before = await _served_state(cache, prompts)
        calls = 0
        for case, make in _TOKEN_CASES.items():
            for name, call in _token_calls(cache, make()).items():
                calls += 1
                try:
                    await call()
                except HiCacheError:
                    pass
                except Exception as exc:
                    wrong.append(f"{case} / {name}: {type(exc).__name__}: {exc}")
                else:
                    wrong.append(f"{case} / {name}: accepted")
        empties: tuple[Any, ...] = ([], np.zeros(0, dtype=np.int64), torch.zeros(0))
        for empty in empties:
            result = await serve(cache, empty, generator)  # nothing to do, nothing to fail
            assert result.num_tokens == 0
        await cache.detach_storage()
        for url in ("nope://", "file://relative", "memory://?capacity=lots"):
            with pytest.raises(StorageConfigError):
                await cache.attach_storage(url)
        await cache.attach_storage("memory://?capacity=4MiB")
        await settle(cache)
        after = await _served_state(cache, prompts)
        for prompt in prompts:
            result = await serve(cache, prompt, generator, check="all")
            assert result.computed_tokens == len(prompt) % PAGE, result
        await settle(cache)
        assert_drained(cache)
    figures("hostile calls", calls=calls, not_hicache_errors=len(wrong))
    assert after == before
    assert not wrong, "\n".join(wrong)


async def test_request_larger_than_the_pool_fails_without_evicting() -> None:
    """A prompt that can never fit raises OutOfPagesError; today the allocation first evicts
    every unlocked device page (dropping those without a host copy) and only then raises."""
    config = make_config(device_pages=48, host_pages=8)
    generator = KVGenerator(config.layout, PAGE, seed=9)
    prompts = prompt_pool(8, seed=13)
    async with HiCache(config) as cache:
        for prompt in prompts:
            await serve(cache, prompt, generator)
        await settle(cache)
        before = await _served_state(cache, prompts)
        huge = np.arange(1_000_000, dtype=np.int64) % 30_000
        with pytest.raises(OutOfPagesError, match="cannot provide"):
            await serve(cache, huge, generator)
        await settle(cache)
        assert_drained(cache)
        assert await _served_state(cache, prompts) == before


@pytest.mark.parametrize("priority", [1 << 31, -(1 << 31) - 1, 1.5])
async def test_priority_a_page_header_cannot_hold_is_refused_at_the_request(
    priority: Any,
) -> None:
    """Pages carry their priority as int32: a request with one out of range fails at once
    with a ValueError, instead of its backups failing later, and the cache is untouched."""
    config = make_config()
    generator = KVGenerator(config.layout, PAGE, seed=10)
    prompts = prompt_pool(2, seed=14)
    async with HiCache(config, storage="memory://?capacity=4MiB") as cache:
        await serve(cache, prompts[0], generator)
        await settle(cache)
        before = await _served_state(cache, prompts)
        with pytest.raises(ValueError, match="priority"):
            cache.request(prompts[1], priority=priority)
        assert await _served_state(cache, prompts) == before
        with cache.request(prompts[1], priority=(1 << 31) - 1) as request:
            assert request.priority == (1 << 31) - 1
        await settle(cache)
        assert_drained(cache)


# Damaged pages and garbage in the storage root.


class _Borrowed:
    """Lends an open backend to a cache without handing over its lifetime."""

    def __init__(self, inner: FileStorage | MemoryStorage) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @property
    def name(self) -> str:
        return self._inner.name

    @property
    def capabilities(self) -> Any:
        return self._inner.capabilities

    async def __aenter__(self) -> _Borrowed:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def exists(self, keys: Any) -> int:
        return await self._inner.exists(keys)

    async def get(self, keys: Any, into: Any, *, namespace: bytes) -> Any:
        return await self._inner.get(keys, into, namespace=namespace)

    async def put(self, keys: Any, pages: Any, metas: Any) -> Any:
        return await self._inner.put(keys, pages, metas)

    async def delete(self, keys: Any) -> int:
        return await self._inner.delete(keys)

    def stats(self) -> Any:
        return self._inner.stats()

    async def close(self) -> None:
        return None


def _damage(value: bytes, kind: str, other: bytes, rng: random.Random) -> bytes:
    if kind == "flipped payload bit":
        damaged = bytearray(value)
        damaged[rng.randrange(HEADER_NBYTES, len(value))] ^= 1 << rng.randrange(8)
        return bytes(damaged)
    if kind == "flipped header bit":
        damaged = bytearray(value)
        damaged[rng.randrange(8, HEADER_NBYTES)] ^= 1 << rng.randrange(8)
        return bytes(damaged)
    if kind == "truncated":
        return value[: rng.randrange(HEADER_NBYTES, len(value))]
    if kind == "header only":
        return value[:HEADER_NBYTES]
    if kind == "empty":
        return b""
    if kind == "oversized":
        return value + os.urandom(4096)
    if kind == "random bytes":
        return os.urandom(len(value))
    if kind == "another page":
        return other
    raise AssertionError(kind)


DAMAGE = [
    "flipped payload bit",
    "flipped header bit",
    "truncated",
    "header only",
    "empty",
    "oversized",
    "random bytes",
    "another page",
]


@pytest.mark.parametrize("kind", ["memory", "file"])
@pytest.mark.parametrize("damage", DAMAGE)
async def test_damaged_pages_are_counted_misses(kind: str, damage: str, tmp_path: Path) -> None:
    config = make_config(prefetch={"batch_pages": 2})
    generator = KVGenerator(config.layout, PAGE, seed=10)
    prompt = np.random.default_rng(2).integers(0, 30_000, size=10 * PAGE)
    other = np.random.default_rng(3).integers(0, 30_000, size=2 * PAGE)
    rng = random.Random(damage)
    storage: FileStorage | MemoryStorage
    if kind == "memory":
        storage = MemoryStorage(capacity_bytes=1 << 20)
    else:
        storage = FileStorage(tmp_path / "l3")
    async with storage:
        async with HiCache(config, storage=_Borrowed(storage)) as writer:
            await serve(writer, prompt, generator, prefetch=False)
            await serve(writer, other, generator, prefetch=False)
            await writer.drain()
            keys = writer.keys_for(prompt)
            stranger = await storage.read_raw(writer.keys_for(other)[1])
        assert stranger is not None
        victim = keys[5]
        value = await storage.read_raw(victim)
        assert value is not None
        damaged = _damage(value, damage, stranger, rng)
        await storage.write_raw(victim, damaged)
        corrupt_before = storage.stats().corrupt
        async with HiCache(config, storage=_Borrowed(storage)) as reader:
            result = await serve(reader, prompt, generator, check="all")
            # Pages before the damaged one came from storage; from it on, computed.
            assert result.storage_tokens == 5 * PAGE, result
            assert result.computed_tokens == len(prompt) - 5 * PAGE
            await settle(reader)
            assert_drained(reader)
        assert storage.stats().corrupt == corrupt_before + 1, "the damage was not counted"
        # The damaged page was removed; the reader recomputed it and backed it up again.
        stored = await storage.read_raw(victim)
        assert stored is not None
        assert stored[HEADER_NBYTES:] == value[HEADER_NBYTES:]
        assert await storage.read_raw(keys[4]) is not None


async def test_newer_format_page_is_a_miss_left_in_place(tmp_path: Path) -> None:
    config = make_config()
    generator = KVGenerator(config.layout, PAGE, seed=11)
    prompt = np.random.default_rng(4).integers(0, 30_000, size=6 * PAGE)
    root = tmp_path / "l3"
    async with HiCache(config, storage=f"file://{root}") as writer:
        await serve(writer, prompt, generator, prefetch=False)
        await writer.drain()
        key = writer.keys_for(prompt)[2]
    page = root / "pages" / key.hex()[:2] / key.hex()
    value = bytearray(page.read_bytes())
    value[4] = 9  # format version 9: a newer writer's page
    page.write_bytes(bytes(value))
    async with HiCache(config, storage=f"file://{root}") as reader:
        result = await serve(reader, prompt, generator, check="all")
        assert result.storage_tokens == 2 * PAGE
        status = reader.storage_status().storage
        assert status is not None
        assert status.corrupt == 0
    assert page.read_bytes() == bytes(value)


def _plant_garbage(root: Path, keys: list[bytes]) -> dict[str, int]:
    """Every kind of entry a storage root should not contain, in every place it could be."""
    hexes = [k.hex() for k in keys]

    def page(h: str) -> Path:
        return root / "pages" / h[:2] / h

    page(hexes[3]).unlink()
    page(hexes[3]).mkdir()  # a directory where a page belongs
    page(hexes[4]).unlink()
    os.mkfifo(page(hexes[4]))  # a FIFO: opening it must not block
    page(hexes[5]).unlink()
    page(hexes[5]).symlink_to("/etc/passwd")  # a symlink: never followed
    with page(hexes[6]).open("r+b") as f:
        f.truncate(1 << 30)  # oversized (sparse)
    page(hexes[7]).write_bytes(os.urandom(300))  # garbage with a page's name
    (root / "garbage.bin").write_bytes(os.urandom(100))
    (root / "pages" / "zz").write_bytes(b"stray")
    (root / "pages" / "qq").mkdir()
    (root / "pages" / "qq" / "deeper").mkdir()
    (page(hexes[0]).parent / "not-a-page").write_bytes(b"stray")
    wrong_shard = root / "pages" / ("00" if hexes[8][:2] != "00" else "01")
    wrong_shard.mkdir(exist_ok=True, mode=0o700)
    (wrong_shard / hexes[8]).write_bytes(page(hexes[8]).read_bytes())  # a page in the wrong shard
    (root / "tmp" / "junk.tmp").write_bytes(b"partial")
    os.mkfifo(root / "tmp" / "fifo.tmp")
    return {"strays_in_pages": 4, "tmp": 2}


async def test_garbage_in_the_storage_root(tmp_path: Path, figures: Record) -> None:
    config = make_config(prefetch={"batch_pages": 2})
    generator = KVGenerator(config.layout, PAGE, seed=12)
    prompt = np.random.default_rng(5).integers(0, 30_000, size=10 * PAGE)
    root = tmp_path / "l3"
    async with HiCache(config, storage=f"file://{root}") as writer:
        await serve(writer, prompt, generator, prefetch=False)
        await writer.drain()
        keys = writer.keys_for(prompt)
    _plant_garbage(root, keys)
    async with HiCache(config, storage=f"file://{root}?capacity=64MiB") as reader:
        result = await serve(reader, prompt, generator, check="all")
        assert result.storage_tokens == 3 * PAGE, result  # up to the directory
        await settle(reader)
        assert_drained(reader)
    async with FileStorage(root) as storage:
        report = await storage.verify()
        again = await storage.verify()
    figures(
        "garbage root",
        checked=report.checked,
        corrupt_removed=report.corrupt_removed,
        leftovers_removed=report.leftovers_removed,
    )
    assert report.corrupt_removed >= 2  # the oversized page and the garbage page
    assert report.leftovers_removed >= 4  # strays in pages/ (FIFO, symlink, stray files)
    assert (again.corrupt_removed, again.leftovers_removed) == (0, 0), again
    assert not (root / "pages" / keys[5].hex()[:2] / keys[5].hex()).is_symlink()


# Bad storage URLs.

URL_CASES: list[tuple[object, str]] = [
    ("", "non-empty string"),
    ("   ", "non-empty string"),
    (None, "non-empty string"),
    (3, "non-empty string"),
    (b"file:///x", "non-empty string"),
    ("nope://x", "unknown storage scheme 'nope'"),
    ("http://example.com/", "unknown storage scheme 'http'"),
    ("file:relative", "start with file://"),
    ("file://relative/path", "absolute path"),
    ("file:///x?capacity=lots", "capacity='lots'"),
    ("file:///x?capacity=-1", "capacity='-1'"),
    ("file:///x?capacity=0", "capacity"),
    ("file:///x?capacity=1e400", "capacity='1e400'"),
    ("file:///x?capacity=1&capacity=2", "given twice"),
    ("file:///x?bogus=1", "unknown parameter 'bogus'"),
    ("file:///x?a", "malformed query"),
    ("file:///x?fsync=maybe", "fsync='maybe'"),
    ("file:///x?io_threads=0", "io_threads"),
    ("file:///x?io_threads=-1", "io_threads='-1'"),
    ("file:///x?shared=maybe", "shared='maybe'"),
    ("memory://host", "take no host"),
    ("memory://?capacity=nan", "capacity='nan'"),
    ("memory://?capacity=0", "capacity"),
    ("mooncake://", "host:port"),
    ("redis://h?bogus=1", "unknown parameter 'bogus'"),
    ("no_such_module_xyz.sub:factory", "cannot import storage plugin module"),
    ("os:sep", "is not callable"),
    ("os:no_such_attribute", "not found"),
    # These raise TypeError / ValueError from underneath today:
    ("json:dumps", "json:dumps"),
    ("builtins:len", "builtins:len"),
    ("redis://host:notaport/0", "notaport"),
    ("redis://\udcff:6379/0", "must be a host name or an IP address"),
    ("redis://" + "a" * 64 + ".example:6379/0", "must be a host name or an IP address"),
    ("redis://u:\udcff@host:6379/0", "the password of a redis:// URL"),
    ("redis://\udcff:p@host:6379/0", "the user of a redis:// URL"),
    # redis-py decodes a %-escaped host before it looks it up: "%ff" is no UTF-8.
    ("redis://%ff:6379/0", "must be a host name or an IP address"),
    ("redis://" + "%61" * 64 + ".example:6379/0", "must be a host name or an IP address"),
    ("mooncake://\udcff:50051", "mooncake master must name a host"),
    ("mooncake://h:50051?local_hostname=" + "a" * 64, "mooncake local_hostname must name a host"),
    ("file:///tmp/a\x00b", "file:///tmp/a"),
]


@pytest.mark.parametrize(("url", "needle"), URL_CASES, ids=lambda v: repr(v)[:40])
def test_bad_storage_url_is_a_storage_config_error(url: object, needle: str) -> None:
    with pytest.raises(StorageConfigError) as info:
        open_storage(url)  # type: ignore[arg-type]
    assert needle in str(info.value), info.value


def test_a_redis_host_is_judged_as_redis_py_decodes_it() -> None:
    # Each label of this host name is 40 letters once its %-escapes are decoded, as redis-py
    # connects to it, though 120 characters as written.
    host = ".".join(["%61" * 40, "%62" * 40])
    backend = open_storage(f"redis://{host}:6379/0")
    assert isinstance(backend, RedisStorage)


@pytest.mark.parametrize(
    "storage",
    ["file:///dev/null", "file:///proc/self", 3, object()],
    ids=["dev-null", "proc-self", "int", "object"],
)
async def test_bad_storage_when_opening_is_a_storage_config_error(storage: object) -> None:
    """Roots that cannot be storage, and objects that are not backends, refused with a
    StorageConfigError when the cache opens (today `proc-self` escapes as FileNotFoundError
    and the non-backend objects as TypeError from inside the storage task)."""
    with pytest.raises(StorageConfigError):
        async with HiCache(make_config(), storage=storage):  # type: ignore[arg-type]
            pass


# Security: keyed MACs on a shared root, and roots other users could tamper with.

MAC_KEY = b"reliability-mac-key-0123456789ab"


async def _write_pages_directly(
    root: Path, config: CacheConfig, prompt: np.ndarray[Any, Any], mac_key: bytes | None
) -> int:
    """Store `prompt`'s pages (correct bytes, right namespace) with a bare FileStorage."""
    generator = KVGenerator(config.layout, PAGE, seed=14)
    namespace = Namespace.from_config(config)
    keys = page_keys(prompt, PAGE, namespace.seed)
    pages = [[memoryview(generator.page_bytes(prompt, i))] for i in range(len(keys))]
    metas = [PageMeta(key, namespace.fingerprint, PAGE) for key in keys]
    async with FileStorage(root, shared=True, mac_key=mac_key) as storage:
        outcomes = await storage.put(keys, pages, metas)
    assert outcomes == [Outcome.OK] * len(keys)
    return len(keys)


@pytest.mark.parametrize(
    "writer_key", [None, b"another-key-0123456789abcdef0123"], ids=["no key", "other key"]
)
async def test_pages_without_the_mac_key_are_rejected_and_counted(
    writer_key: bytes | None, tmp_path: Path, figures: Record
) -> None:
    config = make_config()
    generator = KVGenerator(config.layout, PAGE, seed=14)
    prompt = np.random.default_rng(6).integers(0, 30_000, size=8 * PAGE)
    root = tmp_path / "shared"
    written = await _write_pages_directly(root, config, prompt, writer_key)
    url = f"file://{root}?shared=1"
    async with HiCache(config, storage=url, mac_key=MAC_KEY) as reader:
        result = await serve(reader, prompt, generator, check="all")
        status = reader.storage_status()
        await settle(reader)
        assert_drained(reader)
    assert status.storage is not None
    assert status.prefetch is not None
    figures(
        f"mac ({'unkeyed' if writer_key is None else 'other key'} writer)",
        written=written,
        served_from_storage=result.storage_tokens,
        corrupt_counted=status.storage.corrupt,
    )
    assert result.storage_tokens == 0
    assert result.computed_tokens == len(prompt)
    assert status.storage.corrupt >= 1
    assert status.prefetch.corrupt >= 1
    # The reader removed the pages it refused and backed up its own, keyed, copies; the
    # pages after the first refused one were never read and stay until verify removes them.
    async with FileStorage(root, shared=True, mac_key=MAC_KEY) as storage:
        report = await storage.verify()
    assert report.ok == status.storage.corrupt, report
    assert report.corrupt_removed == written - status.storage.corrupt, report


async def test_pages_with_the_mac_key_are_served(tmp_path: Path) -> None:
    """The control: the same pages written with the reader's key come from storage."""
    config = make_config()
    generator = KVGenerator(config.layout, PAGE, seed=14)
    prompt = np.random.default_rng(6).integers(0, 30_000, size=8 * PAGE)
    root = tmp_path / "shared"
    await _write_pages_directly(root, config, prompt, MAC_KEY)
    async with HiCache(config, storage=f"file://{root}?shared=1", mac_key=MAC_KEY) as reader:
        result = await serve(reader, prompt, generator, check="all")
        status = reader.storage_status().storage
    assert result.storage_tokens == len(prompt)
    assert status is not None
    assert status.corrupt == 0


def _world_writable(root: Path) -> None:
    root.mkdir()
    root.chmod(0o777)


def _other_owner(root: Path) -> None:
    root.mkdir(mode=0o700)
    os.chown(root, 65534, 65534)  # nobody


def _symlink(root: Path) -> None:
    real = root.with_name("real")
    real.mkdir(mode=0o700)
    root.symlink_to(real, target_is_directory=True)


def _pages_symlink(root: Path) -> None:
    root.mkdir(mode=0o700)
    elsewhere = root.with_name("elsewhere")
    elsewhere.mkdir(mode=0o700)
    (root / "pages").symlink_to(elsewhere, target_is_directory=True)


def _pages_world_writable(root: Path) -> None:
    root.mkdir(mode=0o700)
    (root / "pages").mkdir()
    (root / "pages").chmod(0o777)


ROOTS = {
    "world-writable": (_world_writable, "world-writable"),
    "other owner": (_other_owner, "owned by uid"),
    "symlink": (_symlink, "symlink"),
    # Refused, though as "Not a directory" (O_DIRECTORY | O_NOFOLLOW gives ENOTDIR).
    "pages symlink": (_pages_symlink, "/pages:"),
    "pages world-writable": (_pages_world_writable, "world-writable"),
}


@pytest.mark.parametrize("case", list(ROOTS))
async def test_unsafe_storage_roots_are_refused(case: str, tmp_path: Path) -> None:
    """A root another user could write to, or that points somewhere else, is refused with a
    StorageConfigError saying why (today a symlinked root is followed and accepted)."""
    prepare, needle = ROOTS[case]
    if case == "other owner" and os.geteuid() != 0:
        pytest.skip("creating a directory owned by another user needs root")
    root = tmp_path / "root"
    prepare(root)
    with pytest.raises(StorageConfigError) as info:
        async with FileStorage(root):
            pass
    assert needle in str(info.value), info.value
    with pytest.raises(StorageConfigError):
        async with HiCache(make_config(), storage=f"file://{root}"):
            pass
