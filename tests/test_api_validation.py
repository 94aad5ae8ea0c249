"""The public API's argument checks: misuse raises the documented error at once, before any
state changes, and the cache goes on working afterwards."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest
import structlog
import torch
from _gated_copies import PAGE, GatedEngine, config

from hicache_async import (
    ConfigError,
    HiCache,
    Namespace,
    PrefetchStatus,
    StorageConfigError,
    WarmupStatus,
    WrongThreadError,
)

try:
    import uvloop
except ImportError:  # pragma: no cover - the testing extra brings it everywhere but Windows
    uvloop = None

#: For the tests that drive loops themselves (the conftest parametrizes only async tests).
LOOP_FACTORIES: list[Callable[[], asyncio.AbstractEventLoop]] = [asyncio.new_event_loop]
if uvloop is not None:
    LOOP_FACTORIES.append(uvloop.new_event_loop)


# -- leaving the cache from the wrong thread or loop ------------------------------------------


def _leave_one_step(cache: HiCache) -> None:
    """Run `cache.__aexit__` up to its first suspension. Stepped by hand rather than awaited:
    without the ownership check it would wait for the owner's supervisor forever."""
    leaving = cache.__aexit__(None, None, None)
    try:
        leaving.send(None)
    finally:
        leaving.close()


async def test_aexit_from_another_thread_is_refused_and_changes_nothing() -> None:
    async with HiCache(config()) as cache:
        req = cache.request(list(range(4 * PAGE)))
        await req.allocate(4 * PAGE)

        with pytest.raises(WrongThreadError):
            await asyncio.to_thread(_leave_one_step, cache)
        assert cache.statistics().state == "open"
        assert not req.released
        assert req.commit() == 4
        assert cache.match(list(range(4 * PAGE))).device_tokens == 4 * PAGE
    assert cache.statistics().state == "closed"
    assert req.released


@pytest.mark.parametrize("new_loop", LOOP_FACTORIES)
def test_aexit_from_another_loop_is_refused_and_changes_nothing(
    new_loop: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    owner, other = new_loop(), new_loop()
    try:
        cache = HiCache(config())
        owner.run_until_complete(cache.__aenter__())

        async def leave_from_other_loop() -> None:
            _leave_one_step(cache)

        with pytest.raises(WrongThreadError, match="another event loop"):
            other.run_until_complete(leave_from_other_loop())
        assert cache.statistics().state == "open"
        owner.run_until_complete(cache.__aexit__(None, None, None))
        assert cache.statistics().state == "closed"
        # Closed, leaving again is nothing to refuse, from any loop (a teardown may repeat it).
        other.run_until_complete(cache.__aexit__(None, None, None))
        never_entered = HiCache(config())
        other.run_until_complete(never_entered.__aexit__(None, None, None))
    finally:
        other.close()
        owner.close()


# -- a CUDA device the machine lacks ---------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
async def test_a_cuda_device_without_cuda_is_a_config_error_on_entry(device: str) -> None:
    cache = HiCache(msgspec.structs.replace(config(), device=device))
    with pytest.raises(ConfigError, match="none is available") as raised:
        await cache.__aenter__()
    assert raised.value.field == "device"
    assert cache.statistics().state == "closed"


# -- prefetch policies -----------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["bogus", "", 123, "TIMEOUT"])
async def test_an_unknown_prefetch_policy_is_refused(policy: object) -> None:
    async with HiCache(config()) as cache:
        prompt = list(range(4 * PAGE))
        with pytest.raises(ValueError, match="policy must be None or one of 'best_effort'"):
            await cache.start_prefetch(prompt, policy=policy)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="policy must be"):
            await cache.prefetch(prompt, policy=policy)  # type: ignore[arg-type]
        result = await cache.prefetch(prompt, policy="best_effort")
        assert result.status is PrefetchStatus.SKIPPED


# -- salts -----------------------------------------------------------------------------------


@pytest.mark.parametrize("salt", [123, 0, False, 1.5, 2**62, bytearray(b"salt")])
async def test_a_salt_that_is_not_str_or_bytes_is_refused_everywhere(salt: object) -> None:
    async with HiCache(config()) as cache:
        prompt = list(range(4 * PAGE))
        bad: Any = salt
        with pytest.raises(TypeError, match="salt must be a str, bytes or None"):
            cache.keys_for(prompt, salt=bad)
        with pytest.raises(TypeError, match="salt must be"):
            cache.match(prompt, salt=bad)
        with pytest.raises(TypeError, match="salt must be"):
            cache.request(prompt, salt=bad)
        with pytest.raises(TypeError, match="salt must be"):
            await cache.start_prefetch(prompt, salt=bad)
        with pytest.raises(TypeError, match="salt must be"):
            await cache.prefetch(prompt, salt=bad)
        with pytest.raises(TypeError, match="salt must be"):
            await cache.agree_cached_tokens(prompt, salt=bad)
        with pytest.raises(TypeError, match="salt must be"):
            cache.namespace.salted(bad)
        assert cache.statistics().live_requests == 0
        # What is accepted: an empty salt is no salt, and str and bytes salt alike.
        assert cache.keys_for(prompt, salt="") == cache.keys_for(prompt)
        assert cache.keys_for(prompt, salt="s") == cache.keys_for(prompt, salt=b"s")
        assert cache.keys_for(prompt, salt="s") != cache.keys_for(prompt)


# -- warmup limits ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        ({"ratio": 2}, "warmup.ratio"),
        ({"ratio": -1}, "warmup.ratio"),
        ({"ratio": "x"}, "warmup.ratio"),
        ({"ratio": float("nan")}, "warmup.ratio"),
        ({"deadline_s": -1}, "warmup.deadline_s"),
        ({"deadline_s": float("inf")}, "warmup.deadline_s"),
    ],
)
@pytest.mark.parametrize("storage", [None, "memory://"])
async def test_warmup_arguments_have_the_configuration_limits(
    arguments: dict[str, Any], field: str, storage: str | None
) -> None:
    async with HiCache(config(), storage=storage) as cache:
        with pytest.raises(ConfigError) as raised:
            await cache.warmup(**arguments)
        assert raised.value.field == field
        # The bounds themselves are accepted (an empty store has nothing to warm up).
        expected = WarmupStatus.NO_STORAGE if storage is None else WarmupStatus.COMPLETE
        assert (await cache.warmup(ratio=1, deadline_s=30)).status is expected
        assert (await cache.warmup(ratio=0)).status is expected
        # numpy's scalars are numbers too.
        assert (
            await cache.warmup(ratio=np.float32(0.5), deadline_s=np.int64(5))
        ).status is expected
        with pytest.raises(ConfigError):
            await cache.warmup(ratio=np.bool_(True))


# -- counts ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("count", "error", "message"),
    [
        ("3", TypeError, "must be an int, got str"),
        (None, TypeError, "must be an int, got NoneType"),
        (1.5, TypeError, "must be an int, got float"),
        (float("inf"), TypeError, "must be an int, got float"),
        (True, TypeError, "must be an int, got bool"),
        # numpy's bool is also named `bool`: the message qualifies it.
        (np.True_, TypeError, r"must be an int, got numpy\.bool"),
        (-1, ValueError, "must be >= 0, got -1"),
    ],
)
async def test_counts_must_be_ints(count: Any, error: type[Exception], message: str) -> None:
    async with HiCache(config()) as cache:
        prompt = list(range(4 * PAGE))
        if count is not None:  # None is no cap
            with pytest.raises(error, match=f"max_cached_tokens {message}"):
                cache.request(prompt, max_cached_tokens=count)
        assert cache.statistics().live_requests == 0
        with cache.request(prompt) as req:
            with pytest.raises(error, match=f"num_tokens {message}"):
                await req.allocate(count)
            assert req.page_table == []
            # numpy integers are ints; a count rounds up to whole pages.
            assert len(await req.allocate(np.int64(PAGE + 1))) == 2
        with cache.request(prompt, max_cached_tokens=np.int64(PAGE)) as capped:
            assert capped.cached_tokens == 0


# -- the constructor -------------------------------------------------------------------------


@pytest.mark.parametrize("mac_key", ["a str of more than 16 chars", bytearray(32), 12345])
def test_a_mac_key_that_is_not_bytes_is_refused_at_construction(mac_key: Any) -> None:
    # Without storage nothing would ever use the key, so only the constructor can tell.
    with pytest.raises(TypeError, match="mac_key must be bytes or None, got"):
        HiCache(config(), mac_key=mac_key)
    assert HiCache(config(), mac_key=bytes(16)).statistics().state == "new"


@pytest.mark.parametrize(
    ("argument", "value", "message"),
    [
        ("namespace", 5, "namespace must be a Namespace or None, got int"),
        ("namespace", bytes(16), "namespace must be a Namespace or None, got bytes"),
        ("copy_engine", 5, r"copy_engine must be a CopyEngine \(copy, aclose, statistics\)"),
        ("copy_engine", object(), "copy_engine must be a CopyEngine"),
        ("rank_group", 5, "rank_group must be a RankGroup or None, got int"),
        ("clock", 5, "clock must be a callable returning seconds, got int"),
    ],
)
def test_arguments_of_the_wrong_type_are_refused_at_construction(
    argument: str, value: Any, message: str
) -> None:
    # Each used to fail only once the cache was open, as an AttributeError.
    with pytest.raises(TypeError, match=message):
        HiCache(config(), **{argument: value})


async def test_a_namespace_and_a_copy_engine_of_the_right_type_are_used(gate: GatedEngine) -> None:
    namespace = Namespace(seed=b"seed", fingerprint=bytes(range(16)))
    async with HiCache(config(), namespace=namespace, copy_engine=gate) as cache:
        assert cache.namespace is namespace
        req = cache.request(list(range(2 * PAGE)))
        await req.allocate(2 * PAGE)
        assert req.commit() == 2
        req.release()
        assert cache.match(list(range(2 * PAGE))).device_tokens == 2 * PAGE


@pytest.mark.parametrize("storage", [123, b"memory://", object()])
def test_storage_that_is_neither_a_url_nor_a_backend_is_refused_at_construction(
    storage: Any,
) -> None:
    with pytest.raises(StorageConfigError, match="pass a storage URL"):
        HiCache(config(), storage=storage)


# -- flags -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flush", "shown"), [("no", "str"), (0, "int"), (None, "NoneType"), (np.True_, r"numpy\.bool")]
)
@pytest.mark.parametrize("storage", [None, "memory://"])
async def test_detach_flush_must_be_a_bool(flush: Any, shown: str, storage: str | None) -> None:
    async with HiCache(config(), storage=storage) as cache:
        with pytest.raises(TypeError, match=f"flush must be a bool, got {shown}$"):
            await cache.detach_storage(flush=flush)
        assert cache.storage_status().attached == (storage is not None)
        await cache.detach_storage(flush=False)
        assert not cache.storage_status().attached


# -- a loop that ends with the cache open ----------------------------------------------------


@pytest.mark.parametrize("new_loop", LOOP_FACTORIES)
def test_a_loop_ending_with_the_cache_open_warns_that_it_was_not_closed(
    new_loop: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    cache = HiCache(config())

    async def forget_to_leave() -> None:
        await cache.__aenter__()

    with structlog.testing.capture_logs() as logs, asyncio.Runner(loop_factory=new_loop) as runner:
        runner.run(forget_to_leave())
    assert [(e["event"], e["log_level"]) for e in logs] == [("hicache.unclosed", "warning")]
