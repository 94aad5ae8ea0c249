"""Benchmarks behind `hicache-async bench KIND`.

Each benchmark module exposes `describe: str`, `add_arguments(parser)` and
`run(args) -> list[Record]`; every record compares against a baseline measured in the same run
where one exists.
"""

from ._records import Record, format_records, write_records

__all__ = ["BENCHMARKS", "Record", "format_records", "write_records"]

#: kind -> module path; modules are imported only when their benchmark runs.
BENCHMARKS: dict[str, str] = {
    "tree": "hicache_async.bench.tree",
    "copy": "hicache_async.bench.copy",
    "storage": "hicache_async.bench.storage",
    "orchestration": "hicache_async.bench.orchestration",
    "trace": "hicache_async.bench.trace",
}
