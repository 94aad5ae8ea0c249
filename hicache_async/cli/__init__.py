"""The `hicache-async` command line."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import logging
import os
import signal
import sys
from collections.abc import Sequence

from .. import __version__
from ._signals import ignore_at_exit, received, reset

# The rest is imported inside main(), where a Ctrl-C while it loads (most of the start-up
# time) is an interrupt like any other, not a traceback.

__all__ = ["console_main", "main"]

#: Exit code after Ctrl-C (SIGINT): 128 + the signal number, as shells report it.
EXIT_INTERRUPTED = 130
#: Exit code after SIGTERM, which the storage and manifest commands take as Ctrl-C.
EXIT_TERMINATED = 128 + signal.SIGTERM

#: command -> module exposing `add_arguments(parser)` and `run(args) -> int`.
COMMANDS: dict[str, tuple[str, str]] = {
    "example": (
        "hicache_async.cli._example",
        "replay trace requests through every tier (no model; pages checked)",
    ),
    "storage": ("hicache_async.cli._storage", "inspect and maintain a storage backend"),
    "demo": (
        "hicache_async.cli._demo",
        "replay a chat trace through a small model, with and without the cache",
    ),
    "manifest": ("hicache_async.cli._manifest", "show or compact a backend's warmup manifest"),
}


def _build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    from ..bench import BENCHMARKS

    # Only the chosen command's module is imported to add its arguments: the others import
    # torch, and `storage ls` should not take seconds to start. The top-level parser (but for
    # `--version`) and `bench` take no options with values, so the first words that are not
    # options name the command and the benchmark.
    words = [arg for arg in argv if not arg.startswith("-")]
    chosen = words[0] if words else None
    leading = argv[: argv.index(chosen)] if chosen is not None else argv
    if any(len(arg) > 2 and "--version".startswith(arg) for arg in leading):
        # `--version` (or an abbreviation argparse takes for it) before the command prints
        # and exits before the command parses: its module (torch) need not load.
        chosen = None
    parser = argparse.ArgumentParser(
        prog="hicache-async", description="Hierarchical KV cache for LLM serving, asyncio-native."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_path, help_text) in COMMANDS.items():
        if importlib.util.find_spec(module_path) is None:
            continue  # not part of this build
        cmd = sub.add_parser(name, help=help_text)
        if name == chosen:
            importlib.import_module(module_path).add_arguments(cmd)
    bench = sub.add_parser("bench", help="run a benchmark against an in-process baseline")
    kinds = bench.add_subparsers(dest="kind", required=True)
    kind = words[1] if chosen == "bench" and len(words) > 1 else None
    for name, module_path in BENCHMARKS.items():
        if importlib.util.find_spec(module_path) is None:
            continue  # not part of this build
        if chosen != "bench" or (kind in BENCHMARKS and name != kind):
            kinds.add_parser(name)
            continue
        # The chosen benchmark, or all of them when `bench` alone lists them with their help.
        module = importlib.import_module(module_path)
        bench_parser = kinds.add_parser(name, help=module.describe)
        bench_parser.add_argument("--json", metavar="PATH", help="write the records as JSON")
        module.add_arguments(bench_parser)
    return parser


def _bench(args: argparse.Namespace) -> int:
    """Run one benchmark. Exit 2 when its options cannot run (checked before anything is
    measured, `prepare(args)` where the module has one), 1 when the run itself fails."""
    from .._errors import HiCacheError
    from ..bench import BENCHMARKS, format_records, write_records
    from ..bench._records import check_finite
    from ._args import check_output_path
    from ._output import print_output

    prog = f"hicache-async bench {args.kind}"
    module = importlib.import_module(BENCHMARKS[args.kind])
    try:
        if args.json:
            check_output_path(args.json)  # now, not after a run of many minutes
        prepare = getattr(module, "prepare", None)
        if prepare is not None:
            prepare(args)
    except (HiCacheError, ValueError, OSError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    try:
        records = module.run(args)
    except (HiCacheError, OSError) as exc:
        # A backend or baseline that cannot be reached, a root that cannot be written: one
        # line, not a traceback.
        print(f"{prog}: failed: {exc}", file=sys.stderr)
        return 1
    # A stdout that cannot take the table still gets the run's records written.
    printed = print_output(format_records(records), prog=prog)
    try:
        if args.json:
            write_records(args.json, records)
        else:
            check_finite(records)
    except (ValueError, OSError) as exc:
        print(f"{prog}: failed: {exc}", file=sys.stderr)
        return 1
    return printed


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command of `hicache-async` (`argv`, or the process's arguments) and return its
    exit code. A function a host process may call too: the signal dispositions it finds are
    the ones it leaves (see `_signals`)."""
    reset()  # a signal an earlier call received is not this one's
    try:
        from ._logging import configure_logging

        # An application, unlike the library, decides what its log shows: warnings and up.
        configure_logging(logging.WARNING)
        if argv is None:
            argv = sys.argv[1:]
        args = _build_parser(argv).parse_args(argv)
        if args.command == "bench":
            return _bench(args)
        module_path, _ = COMMANDS[args.command]
        code: int = importlib.import_module(module_path).run(args)
    except KeyboardInterrupt:
        # Ctrl-C is the user's choice, not a failure to debug: no traceback. The commands do
        # their work under asyncio.run (or anyio.run), which cancels the main task on SIGINT
        # (Python 3.10: once the loop stops) and lets it close what it opened (a store: lock
        # released, temporary files removed) before this is raised. The storage and manifest
        # commands take SIGTERM the same way.
        terminated = received() == signal.SIGTERM
        with contextlib.suppress(OSError):
            word = "terminated" if terminated else "interrupted"
            print(f"hicache-async: {word}", file=sys.stderr)
        return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED
    return code


def console_main() -> int:
    """Entry point of the `hicache-async` executable and `python -m hicache_async`: `main()`,
    after which an interrupted command's process ignores further signals while it exits."""
    if sys.stderr is None:
        # Started with stderr closed (`2>&-`): messages go nowhere rather than, as
        # print(file=None) sends them, to stdout among the data a script reads.
        sys.stderr = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 - for the process
    code = main()
    if code in (EXIT_INTERRUPTED, EXIT_TERMINATED):
        ignore_at_exit()  # another Ctrl-C would only cut the exit short with a traceback
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(console_main())
