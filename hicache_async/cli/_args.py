"""Argument types and checks shared by the commands."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from .._errors import StorageConfigError, StorageError
from ..storage import FileStorage, open_storage
from ._signals import ignore_while_ending, signals_interrupt

if TYPE_CHECKING:
    from ..storage import StorageBackend

__all__ = [
    "ascii_only",
    "check_output_path",
    "close_pooled_clients",
    "run_command",
    "count",
    "incomplete_message",
    "integer",
    "positive_float",
    "positive_int",
    "local_only",
    "seed",
    "store_incomplete",
    "store_missing",
]


def ascii_only(text: str, kind: str) -> None:
    """Refuse `text` (an `argparse.ArgumentTypeError` saying it is not `kind`) unless it is
    ASCII: int() and float() also read other scripts' digits (an Arabic-Indic three as 3),
    which URL parameters refuse."""
    if not text.isascii():
        raise argparse.ArgumentTypeError(f"{text!r} is not {kind} (ASCII digits 0-9)")


def integer(text: str) -> int:
    """An integer in ASCII digits, for argparse's `type=` (its range checked elsewhere)."""
    return _int_at_least(text, None)


def _int_at_least(text: str, low: int | None, high: int | None = None) -> int:
    ascii_only(text, "an integer")
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if low is not None and value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
    if high is not None and value > high:
        raise argparse.ArgumentTypeError(f"must be <= {high}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An integer of at least 1, for argparse's `type=`."""
    return _int_at_least(text, 1)


def count(text: str) -> int:
    """An integer from 1 to `sys.maxsize`, for argparse's `type=`: a count handed to
    `itertools.islice` or a slice, which larger integers overflow."""
    return _int_at_least(text, 1, sys.maxsize)


def seed(text: str) -> int:
    """A seed for numpy's generators: an integer of at least 0, for argparse's `type=`."""
    return _int_at_least(text, 0)


def positive_float(text: str) -> float:
    """A finite number above 0, for argparse's `type=` (nan and inf are refused)."""
    ascii_only(text, "a number")
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def check_output_path(path: str) -> None:
    """Raise OSError unless a file can be written at `path`, so a long run is not lost to a
    bad path found only at its end."""
    target = Path(path)
    if target.is_dir():
        raise IsADirectoryError(f"{path} is a directory")
    parent = target.parent
    if not parent.is_dir():
        raise FileNotFoundError(f"cannot write {path}: no directory {parent}")
    if target.exists() and not os.access(target, os.W_OK):
        raise PermissionError(f"cannot write {path}: permission denied")
    if not target.exists() and not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write {path}: {parent} is not writable")


def store_missing(root: Path) -> bool:
    """Whether `root` does not hold a file store: opening one creates `pages/`, `tmp/` and
    `LOCK`, so an inspection tool must not open a directory that has neither `pages/` nor
    `LOCK` (it would turn any directory into a store)."""
    return not (root.is_dir() and ((root / "pages").is_dir() or (root / "LOCK").is_file()))


def store_incomplete(root: Path) -> list[str]:
    """What `root`, a file store by `store_missing`, lacks of a complete one (`pages/`, `tmp/`,
    `LOCK`): opening it would create those, which a command that only looks must not do."""
    parts = [("pages/", (root / "pages").is_dir()), ("tmp/", (root / "tmp").is_dir())]
    parts.append(("LOCK", (root / "LOCK").is_file()))
    return [name for name, present in parts if not present]


def incomplete_message(root: Path, lacking: list[str], doing: str) -> str:
    """The refusal of a command that only looks (`doing`) at an incomplete store."""
    return (
        f"{root} is not a complete store (no {', '.join(lacking)}), and {doing} creates "
        "nothing there; `hicache-async storage verify` opens it as a store, creating them"
    )


def local_only(backend: StorageBackend, command: str) -> str | None:
    """Why `command` refuses `backend`, or None: a store neither shared nor persistent (such
    as `memory://`) lives inside the process that opened it, so a fresh instance is empty and
    whatever it reported would say nothing about the store another process holds."""
    caps = backend.capabilities
    if caps.shared or caps.persistent:
        return None
    return (
        f"{backend.name} lives inside the process that opened it; the {command} command "
        "cannot reach it (use file://, redis:// or mooncake://)"
    )


def mooncake_lending_nothing(url: str) -> str:
    """`url`, for a Mooncake store with `segment_size=0` (and no placement, which only puts
    use): a command's client must not lend the cluster memory that vanishes at its exit, and
    what it writes (a compacted manifest) must land in memory that outlives it."""
    parts = urlsplit(url.strip())
    if parts.scheme.lower() != "mooncake":
        return url
    query = [
        (name, value)
        for name, value in parse_qsl(parts.query, keep_blank_values=True)
        if name not in ("segment_size", "placement")
    ]
    return urlunsplit(parts._replace(query=urlencode([*query, ("segment_size", "0")])))


def backend_for_command(url: str, command: str, action: str, *, looking: bool) -> StorageBackend:
    """The backend `url` names, built (not entered) for `command`'s `action`, or
    `StorageConfigError` saying why the command refuses it: a store local to one process, a
    directory that holds no store, or, for an action that only looks (`looking`), an
    incomplete one, which opening would complete. A Mooncake client lends nothing."""
    backend = open_storage(url)  # the URL as given is checked, then adjusted
    lending_nothing = mooncake_lending_nothing(url)
    if lending_nothing != url:
        backend = open_storage(lending_nothing)
        # Mooncake's backend imports its client library only when it opens; a missing one is
        # the installation's fault, not the store's, so it exits 2 as a missing redis-py does.
        from ..storage._mooncake import client_library

        try:
            client_library()
        except StorageError as exc:
            raise StorageConfigError(str(exc)) from None
    refusal = local_only(backend, command)
    if refusal is not None:
        raise StorageConfigError(refusal)
    if isinstance(backend, FileStorage):
        root = backend.root
        try:
            missing = store_missing(root)
            lacking = store_incomplete(root) if looking and not missing else []
        except OSError as exc:  # a root this user may not search
            raise StorageConfigError(f"cannot look into {root}: {exc.strerror or exc}") from None
        if missing:
            # Opening would create a store there (pages/, tmp/, LOCK); a command should not.
            raise StorageConfigError(f"no storage at {root}")
        if lacking:
            raise StorageConfigError(incomplete_message(root, lacking, action))
        backend._keep_leftovers = looking  # looking must leave the store as it was
    return backend


def close_pooled_clients() -> None:
    """Close the Mooncake clients a command's backends left pooled (about a second each),
    before the command returns: a Ctrl-C then is the command's interrupt, where in the exit
    handler that would close them otherwise it prints a traceback. Those of a master that
    is gone are left, as at exit (closing them would wait seconds on it)."""
    mooncake = sys.modules.get("hicache_async.storage._mooncake")
    if mooncake is not None:  # never imported: no client to close
        mooncake.close_idle_clients(reachable_only=True)


def run_command(action: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """`action(args)` for a command that opens a store: SIGTERM taken as Ctrl-C, the first
    signal the only one (see `_signals`), and the pooled Mooncake clients closed before it
    returns."""
    with signals_interrupt():
        try:
            return action(args)
        except KeyboardInterrupt:
            ignore_while_ending()  # a second Ctrl-C must not cut the clean-up short
            raise
        finally:
            close_pooled_clients()
