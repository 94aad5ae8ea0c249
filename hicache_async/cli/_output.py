"""Writing a command's output to stdout."""

from __future__ import annotations

import contextlib
import errno
import os
import sys

__all__ = ["output_failed", "print_output", "write_stdout"]


def write_stdout(text: str) -> None:
    """Write `text` to stdout and flush it; OSError when stdout cannot take it, a stdout the
    process started without (`>&-`) included. A character stdout's encoding cannot show (a
    Latin-1 or ASCII locale) is written as a backslash escape, not refused."""
    stream = sys.stdout
    if stream is None:
        raise OSError(errno.EBADF, "stdout is closed")
    try:
        stream.write(text)
    except UnicodeEncodeError:
        # Nothing was written: the text is encoded whole before it is.
        encoding = stream.encoding or "ascii"
        stream.write(text.encode(encoding, "backslashreplace").decode(encoding))
    stream.flush()


def print_output(text: str, *, prog: str) -> int:
    """Print `text` and a newline; return 0, or 1 without a traceback when stdout cannot take
    it: the reader closed it first (`| head`: no message), it was closed at the start (`>&-`)
    or the write failed (a full disk): a one-line message on stderr, prefixed with `prog`."""
    try:
        write_stdout(text + "\n")
    except OSError as exc:
        return output_failed(exc, prog=prog)
    return 0


def output_failed(error: OSError, *, prog: str) -> int:
    """Exit status 1 for an output stdout could not take (`error`), said on stderr unless the
    reader closed stdout first; also for outputs written in pieces."""
    # Python would flush stdout again at exit and report the same error there: point
    # stdout at /dev/null first, as the Python documentation recommends for SIGPIPE.
    # A stdout without a descriptor (a test harness, or none at all) raises here: nothing
    # flushes it at exit.
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
    if not isinstance(error, BrokenPipeError):
        with contextlib.suppress(OSError):
            print(
                f"{prog}: error: cannot write the output: {error.strerror or error}",
                file=sys.stderr,
            )
    return 1
