"""Benchmark records: `{name, value, unit, baseline, ratio}`, written as a JSON list."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import msgspec

__all__ = ["Record", "format_records", "write_records"]


class Record(msgspec.Struct, frozen=True):
    """One measured figure; `baseline` and `ratio` are None where nothing compares."""

    name: str
    value: float
    unit: str
    baseline: float | None = None
    ratio: float | None = None

    @classmethod
    def compare(cls, name: str, value: float, unit: str, baseline: float) -> Record:
        """A record with its ratio to a baseline measured in the same run."""
        ratio = value / baseline if baseline else None
        return cls(name=name, value=value, unit=unit, baseline=baseline, ratio=ratio)


def write_records(path: str | Path, records: Sequence[Record]) -> None:
    """Write records as a JSON list (the format `nox -s bench` collects)."""
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(list(records))) + b"\n")


def format_records(records: Sequence[Record]) -> str:
    """A plain table for the terminal."""
    lines = [f"{'name':<48} {'value':>14} {'unit':<10} {'baseline':>14} {'ratio':>7}"]
    for r in records:
        base = f"{r.baseline:14.4g}" if r.baseline is not None else f"{'-':>14}"
        ratio = f"{r.ratio:7.3f}" if r.ratio is not None else f"{'-':>7}"
        lines.append(f"{r.name:<48} {r.value:14.4g} {r.unit:<10} {base} {ratio}")
    return "\n".join(lines)
