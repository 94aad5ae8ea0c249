"""Opening a Mooncake backend whose master or metadata server accepts connections and never
answers: a `StorageError` within the probe's bound, not minutes of a frozen process.

Mooncake's `setup()` retries such a server 20 times (30 s each for a master, 6 s for an HTTP
metadata server) holding the GIL, so a frozen open freezes every thread of its process: each
open runs in a child process, which the test kills once its wall-time bound has passed.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import threading
from collections.abc import Iterator

import pytest

from hicache_async.testing._servers import MooncakeMaster

# Far above the probe (3 s per server) and a child's start, far below what setup() takes.
BOUND_S = 60.0
SMALL = "segment_size=64MiB&buffer_size=16MiB&staging_size=8MiB&protocol=tcp"

_OPEN = """
import asyncio, sys
from hicache_async import StorageError
from hicache_async.storage._mooncake import MooncakeStorage

async def main() -> None:
    try:
        async with MooncakeStorage.from_url(sys.argv[1]):
            print("opened")
    except StorageError as exc:
        print(exc)

asyncio.run(main())
"""


@contextlib.contextmanager
def _black_hole() -> Iterator[int]:
    """A loopback port whose connections are accepted and held, never read or answered."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):  # the listener was closed
            while True:
                held.append(listener.accept()[0])

    thread = threading.Thread(target=accept, name="black-hole", daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()
        thread.join(5)
        for connection in held:
            connection.close()


async def _open_in_child(url: str) -> str:
    """What opening `url` in a child process printed; fails if it did not end in time."""
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _OPEN, url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        out, _ = await asyncio.wait_for(child.communicate(), BOUND_S)
    except asyncio.TimeoutError:
        child.kill()
        await child.wait()
        pytest.fail(f"opening {url} froze for more than {BOUND_S:g} s")
    assert child.returncode == 0
    return out.decode().strip()


async def test_a_master_that_never_answers_fails_to_open() -> None:
    with _black_hole() as port:
        said = await _open_in_child(f"mooncake://127.0.0.1:{port}?{SMALL}")
    assert said.endswith(
        f"the Mooncake master at 127.0.0.1:{port} accepts connections but does not answer "
        "(nothing within 3 s)"
    ), said


@pytest.mark.parametrize("scheme", ["http", "https"])
async def test_a_metadata_server_that_never_answers_fails_to_open(
    mooncake_master: MooncakeMaster, scheme: str
) -> None:
    with _black_hole() as port:
        url = (
            f"mooncake://{mooncake_master.address}?{SMALL}&local_hostname=127.0.0.1"
            f"&metadata={scheme}://127.0.0.1:{port}/metadata"
        )
        said = await _open_in_child(url)
    assert said.endswith(
        f"the Mooncake metadata server at 127.0.0.1:{port} accepts connections but does not "
        "answer (nothing within 3 s)"
    ), said


async def test_a_live_master_and_metadata_server_pass_the_probe(
    mooncake_master: MooncakeMaster,
) -> None:
    # The master drops the probe's bytes at once, the metadata server answers its request.
    said = await _open_in_child(f"{mooncake_master.url}&segment_size=64MiB&staging_size=8MiB")
    assert said == "opened"
