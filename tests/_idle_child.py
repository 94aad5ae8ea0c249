"""A forked child that does nothing until told to exit: a long-lived worker (a
multiprocessing one, say) that never touches what it inherited from the parent."""

from __future__ import annotations

import asyncio
import os


class IdleChild:
    """Forks at construction; the child waits for `exit()`, then exits normally."""

    def __init__(self) -> None:
        self._wait_fd, self._wake_fd = os.pipe()
        self._ready_fd, self._running_fd = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            try:
                os.write(self._running_fd, b"r")  # the fork handlers have run
                os.read(self._wait_fd, 1)
            finally:
                os._exit(0)

    async def started(self) -> None:
        """Until the child runs, its fork handlers done."""
        assert await asyncio.to_thread(os.read, self._ready_fd, 1) == b"r"

    async def exit(self) -> int:
        """Tell the child to exit and wait for it; its exit code."""
        os.write(self._wake_fd, b"x")
        _, status = await asyncio.to_thread(os.waitpid, self.pid, 0)
        for fd in (self._wait_fd, self._wake_fd, self._ready_fd, self._running_fd):
            os.close(fd)
        return os.waitstatus_to_exitcode(status)
