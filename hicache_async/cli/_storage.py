"""`hicache-async storage stats|ls|verify|gc URL`: inspect and maintain a storage backend.

`stats` shows occupancy and counters, `ls` the stored pages (most recently used first; printed
as they are listed from a backend that streams its listing),
`verify` checks every page's integrity and removes corrupt pages and leftover temporary files,
`gc` evicts least recently used pages until the store is within its capacity. Exit codes: 0 on
success, 1 when the backend fails or stdout cannot be written (closed early by `| head`, a full
disk), 2 on bad arguments or configuration, 3 when `verify` found damaged pages (removed) or
could not check some, or `gc` could not remove some pages or left the store over its capacity
(see the report and the log), 130 when interrupted (Ctrl-C), 143 on SIGTERM (taken as Ctrl-C).
`stats` and `ls` create nothing: they refuse a `file://` root that is not a complete store.

The command opens a Mooncake store as a client that lends the cluster no memory, whatever the
URL says: pages the cluster placed in a lent segment would vanish when the command exits.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any, Protocol, runtime_checkable

import msgspec
import structlog

from .._errors import StorageConfigError, StorageError
from ..storage import (
    FileStorage,
    GcReport,
    MaintainableStorage,
    MemoryStorage,
    PageInfo,
    StorageBackend,
    StorageStats,
    StreamsPages,
    VerifyReport,
)
from ..storage._protocol import encodable_stats
from ._args import backend_for_command, count, run_command
from ._logging import StderrLogger
from ._output import output_failed, print_output, write_stdout
from ._signals import install_inside

__all__ = ["add_arguments", "run"]

_ACTIONS = ("stats", "ls", "verify", "gc")
_PROG = "hicache-async storage"
#: Exit code of a verify that found damage or could not check everything, and of a gc that
#: could not remove some pages or left the store over its capacity.
EXIT_DAMAGE = 3


@runtime_checkable
class _CountsAndLooks(Protocol):
    """Optional beside `MaintainableStorage` (Redis): a count of the stored pages cheaper than
    listing them, and a listing that writes nothing (Redis's records the pass by default)."""

    async def count_pages(self) -> tuple[int, int]: ...

    async def list_pages(
        self, limit: int | None = None, *, record: bool = True
    ) -> list[PageInfo]: ...


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `hicache-async storage`."""
    parser.add_argument("action", choices=_ACTIONS, help="what to do")
    parser.add_argument(
        "url", help="storage URL, e.g. file:///var/cache/hicache?capacity=100GiB or file://"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument("--limit", type=count, metavar="N", help="ls: list at most N pages")


def _fail(message: str, code: int) -> int:
    print(f"{_PROG}: error: {message}", file=sys.stderr)
    return code


def _log_to_stderr() -> None:
    # Output (possibly JSON) goes to stdout, so events such as storage.page.corrupt go to
    # stderr; the rest of the logging configuration (levels, processors) is left as it is.
    structlog.configure(logger_factory=lambda *_: StderrLogger())


def run(args: argparse.Namespace) -> int:
    """Run one action; return the exit code."""
    return run_command(_action, args)


def _action(args: argparse.Namespace) -> int:
    _log_to_stderr()
    if args.limit is not None and args.action != "ls":
        return _fail("--limit only applies to ls", 2)
    looking = args.action in ("stats", "ls")
    try:
        backend = backend_for_command(args.url, "storage", args.action, looking=looking)
    except StorageConfigError as exc:
        return _fail(str(exc), 2)
    if args.action != "stats" and not isinstance(backend, MaintainableStorage):
        return _fail(f"{backend.name} does not support {args.action}", 2)
    try:
        text, code = asyncio.run(_run(backend, args.action, args.limit, as_json=args.json))
    except _OutputError as exc:
        return output_failed(exc.error, prog=_PROG)
    except StorageConfigError as exc:
        return _fail(str(exc), 2)
    except (StorageError, OSError) as exc:
        message = str(exc)
        if not message.startswith(backend.name):  # most backends' messages name them already
            message = f"{backend.name}: {message}"
        return _fail(message, 1)
    if text is None:
        return code
    return print_output(text, prog=_PROG) or code


async def _run(
    backend: StorageBackend, action: str, limit: int | None, *, as_json: bool
) -> tuple[str | None, int]:
    """The action's output (None when it has written it as it went) and the exit code it
    calls for."""
    install_inside()
    async with backend:
        if action == "stats":
            # A third-party record may hold a field JSON cannot encode: shown as its repr.
            stats = encodable_stats(await _store_stats(backend))
            if as_json:
                return msgspec.json.encode(stats).decode(), 0
            return "\n".join(
                f"{name}: {value}" for name, value in msgspec.structs.asdict(stats).items()
            ), 0
        assert isinstance(backend, MaintainableStorage)  # checked by run()
        if action == "ls":
            await _list(backend, limit, as_json=as_json)
            return None, 0
        report: msgspec.Struct
        code = 0
        if action == "verify":
            report = await backend.verify()
            code = EXIT_DAMAGE if _damaged(report) else 0
        else:
            report = await backend.gc()
            code = EXIT_DAMAGE if _short(report) else 0
        if as_json:
            return msgspec.json.encode(report).decode(), code
        fields = msgspec.structs.asdict(report).items()
        return ", ".join(f"{name}={value}" for name, value in fields), code


def _damaged(report: VerifyReport) -> bool:
    return report.corrupt_removed > 0 or report.unchecked > 0


def _short(report: GcReport) -> bool:
    """Whether gc left work undone: pages it could not remove, or the store still over its
    capacity."""
    return report.failed > 0 or report.over_capacity_bytes > 0


async def _store_stats(backend: StorageBackend) -> StorageStats:
    """The backend's stats, with `pages`/`bytes` counted in the store where the backend's own
    figures cover only what this process did (Redis, Mooncake: a fresh client knows nothing
    of the pages already there)."""
    stats = backend.stats()
    if isinstance(backend, FileStorage | MemoryStorage) or not isinstance(
        backend, MaintainableStorage
    ):
        return stats  # the file index is read at open; a memory store starts empty
    if isinstance(backend, _CountsAndLooks):
        counted, nbytes = await backend.count_pages()
        return msgspec.structs.replace(stats, pages=counted, bytes=nbytes)
    pages = await backend.list_pages()
    return msgspec.structs.replace(
        stats, pages=len(pages), bytes=sum(page.nbytes for page in pages)
    )


class _OutputError(Exception):
    """stdout could not take the output, which the command then stops writing."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


def _write(text: str) -> None:
    """Write one piece of an output that is printed as it comes; `_OutputError` when stdout
    cannot take it."""
    try:
        write_stdout(text)
    except OSError as exc:
        raise _OutputError(exc) from exc


async def _list(backend: MaintainableStorage, limit: int | None, *, as_json: bool) -> None:
    """Print the pages as they are listed: in batches from a backend that streams its listing
    (`StreamsPages`), so a store of millions of pages starts printing at once and holds one
    batch; in one piece from `list_pages` otherwise, or with `--limit`. The output is the
    same either way: one table, or one JSON array."""
    batches: AsyncIterator[list[PageInfo]]
    if limit is None and isinstance(backend, StreamsPages):
        batches = backend.stream_pages()
    else:
        batches = _whole_listing(backend, limit)
    count = 0
    async for pages in batches:
        if not pages:  # an empty store's one listing
            continue
        rows = [
            {
                "key": page.key.hex(),
                "nbytes": page.nbytes,
                "num_tokens": page.num_tokens,
                "priority": page.priority,
                "last_access": page.last_access,
            }
            for page in pages
        ]
        if as_json:  # the array's items, without its brackets
            _write(("," if count else "[") + msgspec.json.encode(rows)[1:-1].decode())
        else:
            lines = [_table_line(row) for row in rows]
            if not count:
                lines.insert(0, _TABLE_HEAD)
            _write("".join(f"{line}\n" for line in lines))
        count += len(rows)
    if as_json:
        _write("]\n" if count else "[]\n")
    else:
        _write(f"{count} pages\n" if count else f"{_TABLE_HEAD}\n0 pages\n")


async def _whole_listing(
    backend: MaintainableStorage, limit: int | None
) -> AsyncIterator[list[PageInfo]]:
    if isinstance(backend, _CountsAndLooks):
        yield await backend.list_pages(limit, record=False)  # ls only looks
    else:
        yield await backend.list_pages(limit)


_TABLE_HEAD = f"{'key':<64}  {'bytes':>12}  {'tokens':>6}  {'prio':>4}  last access (UTC)"


def _table_line(row: dict[str, Any]) -> str:
    return (
        f"{row['key']:<64}  {row['nbytes']:>12}  {row['num_tokens']:>6}  "
        f"{row['priority']:>4}  {_when(row['last_access'])}"
    )


def _when(seconds: float) -> str:
    """A last access as a UTC date, or as Unix seconds where no date can show it: a file
    system with 64-bit times (tmpfs, btrfs) keeps any mtime `touch -d` or a wrong clock
    gave a page, and another backend may list what it likes."""
    try:
        return f"{datetime.fromtimestamp(seconds, tz=timezone.utc):%Y-%m-%d %H:%M:%S}"
    except (ValueError, OverflowError, OSError):  # past year 9999, before year 1, nan, inf
        return f"@{seconds:.0f}"
