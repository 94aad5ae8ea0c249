"""Figures the reliability suites measure, printed at the end of the run.

Each suite records what it did (kills, requests, faults injected, lag, memory, blocking calls)
through the `figures` fixture; the terminal summary lists them, and with
`HICACHE_RELIABILITY_REPORT=path.json` they are also written there as JSON.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from . import FULL, Record

_FIGURES: list[dict[str, Any]] = []


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
            f"{key}={_format(value)}"
            for key, value in entry.items()
            if key not in ("test", "name")
        )
        terminalreporter.write_line(f"{entry['name']}: {values}")
    target = os.environ.get("HICACHE_RELIABILITY_REPORT")
    if target:
        Path(target).write_text(
            json.dumps({"scale": scale, "figures": _FIGURES}, indent=2, default=str) + "\n"
        )
