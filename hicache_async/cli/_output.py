"""Writing a command's output to stdout."""

from __future__ import annotations

import contextlib
import os
import sys

__all__ = ["output_failed", "print_output"]


def print_output(text: str, *, prog: str) -> int:
    """Print `text` and a newline; return 0, or 1 without a traceback when stdout cannot take
    it: the reader closed it first (`| head`: no message) or the write failed (a full disk: a
    one-line message on stderr, prefixed with `prog`)."""
    try:
        print(text)
        sys.stdout.flush()
    except OSError as exc:
        return output_failed(exc, prog=prog)
    return 0


def output_failed(error: OSError, *, prog: str) -> int:
    """Exit status 1 for an output stdout could not take (`error`), said on stderr unless the
    reader closed stdout first; also for outputs written in pieces."""
    # Python would flush stdout again at exit and report the same error there: point
    # stdout at /dev/null first, as the Python documentation recommends for SIGPIPE.
    # A stdout without a descriptor (a test harness) raises here: nothing flushes it at exit.
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    if not isinstance(error, BrokenPipeError):
        with contextlib.suppress(OSError):
            print(
                f"{prog}: error: cannot write the output: {error.strerror or error}",
                file=sys.stderr,
            )
    return 1
