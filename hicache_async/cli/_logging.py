"""Where and how the commands log: on stderr only, in colour only on a terminal that wants it."""

from __future__ import annotations

import logging
import os
import sys

import structlog

__all__ = ["StderrLogger", "configure_logging", "wants_colour"]


class StderrLogger:
    """A structlog logger writing each line to the current `sys.stderr` (looked up at each
    line: a test harness may swap it). A line stderr cannot take is dropped: a closed
    stderr (`2>&-`) must neither send log lines to stdout, which holds the command's data,
    nor fail the store operation that logged."""

    def msg(self, message: str) -> None:
        """Write `message` and a newline, or drop it."""
        stream = sys.stderr
        if stream is None:
            return  # print(file=None) would write to stdout
        try:
            stream.write(message + "\n")
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stderr
            return

    log = debug = info = warn = warning = msg
    error = critical = exception = fatal = failure = err = msg


def _stderr_logger(*_args: object) -> StderrLogger:
    return StderrLogger()


def wants_colour() -> bool:
    """Whether log lines get ANSI colours: only when stderr, where they go, is a terminal
    (not when stdout is one and stderr a file), and neither `NO_COLOR` (any non-empty value)
    nor `TERM=dumb` asks for none."""
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    stream = sys.stderr
    try:
        return stream is not None and stream.isatty()
    except (OSError, ValueError):  # a closed stderr
        return False


def configure_logging(level: int = logging.WARNING) -> None:
    """Log events of `level` and up to stderr, as structlog's default lines, coloured where
    `wants_colour()` says so (decided now, as stderr is now)."""
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.StackInfoRenderer(),
            structlog.dev.set_exc_info,
            structlog.processors.TimeStamper(fmt="%Y-%m-%d %H:%M:%S", utc=False),
            structlog.dev.ConsoleRenderer(colors=wants_colour()),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=_stderr_logger,
    )
