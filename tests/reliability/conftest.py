"""Event loops for the reliability suites, and the figures they measure.

The full run (HICACHE_RELIABILITY=full) runs every async test under each loop factory; the
short run under one, named by the module's `SHORT_LOOP` (suites pick different ones, so CI
covers both loops without running everything twice).

Each suite records what it did (kills, requests, faults injected, lag, memory, blocking calls)
through the `figures` fixture; the terminal summary lists them, and with
`HICACHE_RELIABILITY_REPORT=path.json` they are also written there as JSON.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import structlog

from . import FULL, Record

uvloop: Any
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
    if FULL:
        return factories
    short = getattr(getattr(item, "module", None), "SHORT_LOOP", "asyncio")
    # Named by the loop it really runs under: without uvloop, asyncio's.
    return {short: factories[short]} if short in factories else {"asyncio": asyncio.new_event_loop}


_FIGURES: list[dict[str, Any]] = []


@pytest.fixture(autouse=True)
def _quiet_library_logs() -> Iterator[None]:
    """The suites inject thousands of faults, each logged as a warning; keep errors only (a
    failing test's report stays readable). The previous configuration comes back after."""
    previous = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    try:
        yield
    finally:
        structlog.configure(**previous)


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Record:
    """`figures(name, **values)` records one line of figures for the summary."""

    def record(name: str, **values: Any) -> None:
        _FIGURES.append({"test": request.node.nodeid, "name": name, **values})

    return record


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _FIGURES:
        return
    scale = "full" if FULL else "short"
    terminalreporter.section(f"reliability figures ({scale})")
    for entry in _FIGURES:
        values = ", ".join(
            f"{key}={_format(value)}" for key, value in entry.items() if key not in ("test", "name")
        )
        terminalreporter.write_line(f"{entry['name']}: {values}")
    target = os.environ.get("HICACHE_RELIABILITY_REPORT")
    if target:
        Path(target).write_text(
            json.dumps({"scale": scale, "figures": _FIGURES}, indent=2, default=str) + "\n"
        )
