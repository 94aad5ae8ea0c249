"""The process id, kept current across `os.fork` by a hook, so that objects which hold threads,
descriptors or an event loop of the process that made them can refuse a forked child at the
cost of an integer comparison rather than a system call."""

from __future__ import annotations

import os

__all__ = ["current_pid", "forked_error"]

_pid = [os.getpid()]  # a list, so that the hook can set it without `global`


def _after_fork_in_child() -> None:
    _pid[0] = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)


def current_pid() -> int:
    """This process's id."""
    return _pid[0]


def forked_error(name: str, owner_pid: int) -> str:
    """The message for `name`, made or opened in process `owner_pid`, used in a forked child."""
    return (
        f"{name} belongs to process {owner_pid} and was used in process {_pid[0]}, a child forked "
        "from it: its threads did not follow the fork and its descriptors and connections are "
        "shared with the parent; make (and open) a new one in the child"
    )
