"""The fields docs/operations.md's log table gives each event, to compare logged lines with."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

_DOC = Path(__file__).resolve().parents[1] / "docs" / "operations.md"
#: What structlog's capture adds to every entry.
_CAPTURED = {"event", "log_level"}


@functools.cache
def documented_fields() -> dict[str, frozenset[str]]:
    """event -> the fields its row names (rows of event families, `x.*`, left out)."""
    logs = _DOC.read_text().split("\n## Logs", 1)[1]
    rows: dict[str, frozenset[str]] = {}
    for line in logs.splitlines():
        cells = line.split(" | ")
        if not line.startswith("| `") or len(cells) < 4:
            continue
        fields = frozenset(re.findall(r"`([a-z_]+)`", cells[2]))
        for event in re.findall(r"`([a-z_.]+)`", cells[0].removeprefix("| ")):
            if not event.endswith("*"):
                rows[event] = fields
    return rows


def assert_documented(entries: Iterable[Mapping[str, Any]], exact: Iterable[str] = ()) -> int:
    """Each entry of an event the table lists logs only fields its row names, and those of
    the events in `exact` every field it names; how many entries were compared."""
    rows = documented_fields()
    exact = set(exact)
    compared = 0
    for entry in entries:
        event = entry["event"]
        if event not in rows:
            continue
        logged = set(entry) - _CAPTURED
        assert logged <= rows[event], (event, sorted(logged - rows[event]))
        if event in exact:
            assert logged == rows[event], (event, sorted(rows[event] - logged))
        compared += 1
    return compared
