"""`hicache-async manifest show|compact URL`: inspect or compact a store's warmup manifest."""

from __future__ import annotations

import argparse
import asyncio
import re
import sys

import msgspec

from .._errors import HiCacheError, StorageConfigError
from ..storage._manifest import SupportsManifest
from ._args import backend_for_command, run_command
from ._output import print_output
from ._signals import install_inside

__all__ = ["add_arguments", "run"]

_PROG = "hicache-async manifest"

# A namespace fingerprint: 16 bytes, as the manifest records it (lowercase hex).
_NAMESPACE = re.compile(r"[0-9a-f]{32}\Z")


def _namespace(text: str) -> str:
    """`--namespace`: 32 hex digits, either case; lowercased, as entries hold it."""
    value = text.strip().lower()
    if not _NAMESPACE.match(value):
        raise argparse.ArgumentTypeError(
            f"a namespace fingerprint is 32 hex digits (16 bytes), got {text!r}"
        )
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["show", "compact"])
    parser.add_argument("url", help="storage URL, e.g. file:///path or redis://127.0.0.1:6379/0")
    parser.add_argument(
        "--namespace",
        type=_namespace,
        help="show: only entries of this namespace fingerprint (32 hex digits)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")


async def _run(args: argparse.Namespace) -> object:
    install_inside()
    backend = backend_for_command(args.url, "manifest", args.action, looking=args.action == "show")
    async with backend:
        if not isinstance(backend, SupportsManifest):
            raise StorageConfigError(f"{backend.name} keeps no warmup manifest")
        manifest = backend.manifest()
        if args.action == "compact":
            return await manifest.compact()
        return await manifest.read(namespace=args.namespace)


def run(args: argparse.Namespace) -> int:
    """Run one action; return the exit code."""
    return run_command(_action, args)


def _action(args: argparse.Namespace) -> int:
    if args.action == "compact" and args.namespace is not None:
        # compact rewrites every namespace's entries; a filter it ignored would mislead.
        print(f"{_PROG}: error: --namespace only applies to show", file=sys.stderr)
        return 2
    try:
        result = asyncio.run(_run(args))
    except (StorageConfigError, ValueError) as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return 2
    except (HiCacheError, OSError, RecursionError) as exc:  # the store failed, not the caller
        print(f"{_PROG}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return print_output(_format(args, result), prog=_PROG)


def _format(args: argparse.Namespace, result: object) -> str:
    """The output of `run`, as one text: written at once, so that a closed stdout is one
    error, handled in one place."""
    if args.json:
        return msgspec.json.encode(result).decode()
    data = msgspec.to_builtins(result)
    if args.action == "compact":
        return "\n".join(f"{key}: {value}" for key, value in data.items())
    lines = [
        f"{len(data['entries'])} entries ({data['malformed']} malformed, "
        f"{data['oversized']} oversized skipped, {data['newer']} of a newer version left"
        f"{', truncated' if data['truncated'] else ''})"
    ]
    lines.extend(
        f"  {entry['keys'][-1][:16]}…  pages={len(entry['keys'])} tokens={entry['num_tokens']} "
        f"priority={entry['priority']} last_use={entry['last_use']:.0f}"
        for entry in data["entries"]
    )
    return "\n".join(lines)
