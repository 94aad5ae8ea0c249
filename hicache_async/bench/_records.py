"""Benchmark records: `{name, value, unit, baseline, ratio}`, written as a JSON list."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import msgspec

__all__ = ["Record", "check_finite", "format_records", "write_records"]


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


def check_finite(records: Sequence[Record]) -> None:
    """Raise ValueError naming the first record with a nan or infinite figure (JSON would
    turn it into null, which reads as "no baseline" rather than as a broken run)."""
    for r in records:
        for field in ("value", "baseline", "ratio"):
            number = getattr(r, field)
            if number is not None and not math.isfinite(number):
                raise ValueError(f"record {r.name!r} has a non-finite {field}: {number!r}")


def write_records(path: str | Path, records: Sequence[Record]) -> None:
    """Write records as a JSON list (the format `nox -s bench` collects); refuses non-finite
    figures (ValueError) and writes nothing then."""
    check_finite(records)
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(list(records))) + b"\n")


def format_records(records: Sequence[Record]) -> str:
    """A plain table for the terminal."""
    lines = [f"{'name':<48} {'value':>14} {'unit':<10} {'baseline':>14} {'ratio':>7}"]
    for r in records:
        base = f"{r.baseline:14.4g}" if r.baseline is not None else f"{'-':>14}"
        ratio = f"{r.ratio:7.3f}" if r.ratio is not None else f"{'-':>7}"
        lines.append(f"{r.name:<48} {r.value:14.4g} {r.unit:<10} {base} {ratio}")
    return "\n".join(lines)
