"""The shipped pytest plugin works in a user's suite, run by a real pytest in a subprocess."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from hicache_async.testing import serve

if TYPE_CHECKING:
    from hicache_async import HiCache
    from hicache_async.testing import KVGenerator

pytest_plugins = ["pytester"]

USER_SUITE = """
import numpy as np
from hicache_async.storage import MemoryStorage
from hicache_async.testing import serve


async def test_serves_from_cache(hicache, kv_generator):
    prompt = np.arange(100, 180)
    first = await serve(hicache, prompt, kv_generator)
    second = await serve(hicache, prompt, kv_generator, check="all")
    assert first.computed_tokens == 80
    assert second.device_tokens == 80


async def test_file_cache_and_faults(hicache_file, kv_generator, faulty_storage):
    await serve(hicache_file, np.arange(64), kv_generator)
    faulty = faulty_storage(MemoryStorage(capacity_bytes=1 << 20), error_rate=1.0)
    assert faulty.name.startswith("faulty+")


def test_redis(redis_url):
    assert redis_url.startswith("redis://127.0.0.1:")
"""


def test_plugin_fixtures_in_a_user_suite(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_user=USER_SUITE)
    pytester.makeini("[pytest]\nasyncio_mode = auto\n")
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3)


@pytest.mark.parametrize("check", ["ALL", "full", "", None])
async def test_serve_rejects_an_unknown_check(
    hicache: HiCache, kv_generator: KVGenerator, check: object
) -> None:
    # A typo must not turn into a run that checks nothing.
    with pytest.raises(ValueError, match="check must be one of"):
        await serve(hicache, list(range(64)), kv_generator, check=check)  # type: ignore[arg-type]
    assert (await serve(hicache, list(range(64)), kv_generator, check="all")).checked_pages == 0
