"""Shared fixtures; every async test runs under the default loop and under uvloop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator, Mapping

import pytest
import structlog
from _gated_copies import GatedEngine
from hypothesis import HealthCheck, settings

# One mooncake_master per session, for the backend tests and the fork tests alike.
from hicache_async.testing._fixtures import mooncake_master, mooncake_url

__all__ = ["mooncake_master", "mooncake_url"]

# Hypothesis' per-example deadline is a timed assertion: on a shared two-core machine a
# multi-MB example can take 250 ms for reasons that have nothing to do with the code. The
# too_slow health check times example generation the same way.
settings.register_profile("hicache", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("hicache")

try:
    import uvloop
except ImportError:  # pragma: no cover - the testing extra brings it everywhere but Windows
    uvloop = None


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
        "asyncio": asyncio.new_event_loop
    }
    if uvloop is not None:
        factories["uvloop"] = uvloop.new_event_loop
    return factories


@pytest.fixture
async def gate() -> AsyncIterator[GatedEngine]:
    """A gated copy engine (see `_gated_copies`), closed after the test."""
    engine = GatedEngine()
    try:
        yield engine
    finally:
        await engine.aclose()


@pytest.fixture(autouse=True)
def _logging_config_restored() -> Iterator[None]:
    """The command line, run in-process by some tests, configures logging as an application
    (warnings and up): the tests after it must still see the library's info events."""
    saved = structlog.get_config()
    try:
        yield
    finally:
        structlog.configure(**saved)
