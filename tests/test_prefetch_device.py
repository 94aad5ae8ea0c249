"""A prefetch in flight holds the prefix its pages hang from in the tree, not on the device.

Its read can last up to `prefetch.io_timeout_s`, and under the `timeout` policy it goes on
after `ready()` has returned. Had it locked the device prefix meanwhile, a request alone in a
small device pool, for a prompt of its own, failed with `OutOfPagesError` although nothing
else used the pool.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import anyio
import numpy as np
import pytest
from _unowned_storage import Unowned

from hicache_async import CacheConfig, HiCache, PrefetchStatus
from hicache_async.storage import MemoryStorage, Outcome, PageBuffer, StorageBackend
from hicache_async.testing import KVGenerator, assert_drained, serve

PAGE = 2
DEVICE_PAGES = 4
GUARD_S = 30.0  # a hang guard only


def _config(write_policy: str) -> CacheConfig:
    return CacheConfig.from_dict(
        {
            "layout": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 4},
            "page_size": PAGE,
            "device_pages": DEVICE_PAGES,
            "host_pages": 4 * DEVICE_PAGES,
            "model_id": "prefetch-device-test",
            "write_policy": write_policy,
            "prefetch": {"policy": "wait_complete", "threshold_tokens": PAGE},
        }
    )


class HeldGets(Unowned):
    """A real backend whose gets wait for `gate`; `waiting` is set once one does."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.gate = asyncio.Event()
        self.waiting = asyncio.Event()

    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        self.waiting.set()
        await self.gate.wait()
        return await self.inner.get(keys, into, namespace=namespace)


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
async def test_a_request_alone_gets_the_device_pages_under_a_prefetch_in_flight(
    write_policy: str,
) -> None:
    generator = KVGenerator(_config(write_policy).layout, PAGE, seed=7)
    stored = np.arange(1000, 1000 + DEVICE_PAGES * PAGE)  # the whole prompt in storage
    own = np.arange(5000, 5000 + DEVICE_PAGES * PAGE)  # a prompt filling the device pool
    memory = MemoryStorage(capacity_bytes=1 << 20)
    with anyio.fail_after(GUARD_S):
        async with memory:
            async with HiCache(_config("write_through"), storage=Unowned(memory)) as first:
                await serve(first, stored, generator, prefetch=False)
                await first.drain()
            store = HeldGets(memory)
            async with HiCache(_config(write_policy), storage=store) as cache:
                # Half of the stored prompt on the device; the prefetch reads the rest.
                await serve(cache, stored[: 2 * PAGE], generator, prefetch=False)
                handle = await cache.start_prefetch(stored)
                await store.waiting.wait()
                assert handle.status is PrefetchStatus.RUNNING
                served = await serve(cache, own, generator, prefetch=False, check="all")
                assert served.computed_tokens == len(own)
                store.gate.set()
                result = await handle.wait()
                assert result.status is PrefetchStatus.COMPLETE
                # The prefix went to the host meanwhile; the pages read hang from it.
                again = await serve(cache, stored, generator, prefetch=False, check="all")
                assert again.computed_tokens == 0
                await cache.drain()
                assert_drained(cache)
