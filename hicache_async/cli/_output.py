"""Writing a command's output to stdout."""

from __future__ import annotations

import codecs
import contextlib
import errno
import os
import sys

__all__ = ["output_failed", "print_output", "write_stdout"]


_ESCAPE = "hicache_async.cli.escape"


def _escape(error: UnicodeError) -> tuple[str, int]:
    """Codec error handler: each character an encoding cannot take as `\\uXXXX` (a
    surrogate pair past U+FFFF), which JSON reads back as that character; Python's own
    `backslashreplace` writes `\\xe9` for é, which no JSON parser accepts."""
    if not isinstance(error, UnicodeEncodeError):
        raise error
    escaped = []
    for char in error.object[error.start : error.end]:
        point = ord(char)
        if point > 0xFFFF:
            point -= 0x10000
            escaped.append(f"\\u{0xD800 + (point >> 10):04x}\\u{0xDC00 + (point & 0x3FF):04x}")
        else:
            escaped.append(f"\\u{point:04x}")
    return "".join(escaped), error.end


codecs.register_error(_ESCAPE, _escape)


def write_stdout(text: str) -> None:
    """Write `text` to stdout and flush it; OSError when stdout cannot take it, a stdout the
    process started without (`>&-`) included. A character stdout's encoding cannot show (a
    Latin-1 or ASCII locale) is written as a `\\uXXXX` escape, not refused: in `--json`
    output, where such characters only occur inside strings, that is the character itself."""
    stream = sys.stdout
    if stream is None:
        raise OSError(errno.EBADF, "stdout is closed")
    try:
        stream.write(text)
    except UnicodeEncodeError:
        # Nothing was written: the text is encoded whole before it is.
        encoding = stream.encoding or "ascii"
        stream.write(text.encode(encoding, _ESCAPE).decode(encoding))
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
