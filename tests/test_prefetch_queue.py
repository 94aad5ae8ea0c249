"""The prefetch worker's bookkeeping under load: the bounded queue's line of senders waiting
for room, and the order in which cancelled starts enter their tensor-parallel agreements.

Each costs O(1) amortized per sender or start, however many wait: the tests count the work
done (entries compared or scanned) rather than time it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import anyio
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream
from test_cancelled_close import _until

from hicache_async.distributed import SingleRank, agreement_tag
from hicache_async.workers._prefetch import PrefetchHandle, StartOrder, _PrefetchQueue

SIZE = 2
WAITING = 200


class _Compared(PrefetchHandle):
    """A real handle that counts how often a handle is compared with another: what searching
    a line of senders for one of them costs."""

    compared = 0

    def __eq__(self, other: object) -> bool:
        _Compared.compared += 1
        return self is other

    __hash__ = PrefetchHandle.__hash__


def _handle(n: int) -> _Compared:
    return _Compared(None, [n.to_bytes(8, "big")], 4, f"r{n}", "wait_complete")


_Full = tuple[_PrefetchQueue, MemoryObjectReceiveStream[PrefetchHandle]]


@pytest.fixture
def full_queue() -> Iterator[_Full]:
    """A queue of `SIZE` slots, all taken, and its stream's receiving end; both ends of the
    stream are closed after the test (an unclosed one warns when collected)."""
    send, receive = anyio.create_memory_object_stream[PrefetchHandle](float("inf"))
    with send, receive:
        queue = _PrefetchQueue(SIZE, send, receive)
        for n in range(SIZE):
            queue.send_nowait(_handle(n))
        yield queue, receive


async def _in_line(queue: _PrefetchQueue, handles: list[_Compared]) -> list[asyncio.Task[None]]:
    """Senders of `handles`, waiting in line for room in the full `queue`, in that order."""
    senders: list[asyncio.Task[None]] = []
    for handle in handles:
        senders.append(asyncio.create_task(queue.send(handle)))
        await _until(lambda: len(queue._waiting) == len(senders))
    return senders


async def test_senders_admitted_from_a_full_queue_leave_the_line_without_searching_it(
    full_queue: _Full,
) -> None:
    # Each admission took its sender out of the line already: leaving it must not scan what
    # is still waiting (a quadratic cost in the number of senders).
    queue, receive = full_queue
    handles = [_handle(SIZE + n) for n in range(WAITING)]
    senders = await _in_line(queue, handles)
    _Compared.compared = 0
    for sender in senders:
        queue.release(receive.receive_nowait())  # a worker takes one: the next is admitted
        await asyncio.wait_for(sender, 10)
    assert _Compared.compared == 0
    assert (len(queue._waiting), queue.queued) == (0, SIZE)
    taken = [receive.receive_nowait() for _ in range(SIZE)]
    assert taken == handles[-SIZE:]  # admitted in arrival order


@pytest.mark.parametrize("order", ["arrival", "reverse"])
async def test_senders_cancelled_in_line_leave_no_live_entry_and_lose_no_slot(
    order: str, full_queue: _Full
) -> None:
    # Every other sender is cancelled. The line is not searched for them (the latest in
    # line are the costliest to find): their entries may stay, dead, but never more of them
    # than of live ones; every slot goes to a live sender, in arrival order.
    queue, receive = full_queue
    handles = [_handle(SIZE + n) for n in range(WAITING)]
    senders = await _in_line(queue, handles)
    _Compared.compared = 0
    cancelled = senders[::2] if order == "arrival" else senders[::2][::-1]
    live = senders[1::2]
    for gone, sender in enumerate(cancelled, 1):
        sender.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(sender, 10)
        assert len(queue._waiting) <= 2 * (len(senders) - gone)
    assert _Compared.compared == 0
    assert len(queue._waiting) <= 2 * len(live)
    admitted = []
    for sender in live:
        taken = receive.receive_nowait()
        admitted.append(taken)
        queue.release(taken)
        await asyncio.wait_for(sender, 10)
    admitted += [receive.receive_nowait() for _ in range(SIZE)]
    assert admitted[SIZE:] == handles[1::2]
    assert (len(queue._waiting), queue.queued) == (0, SIZE)
    assert _Compared.compared == 0


async def test_a_sender_cancelled_as_its_slot_frees_passes_the_slot_on(full_queue: _Full) -> None:
    # The first sender's cancellation lands before it runs again, and a slot frees up in
    # between: the slot goes to the next sender, and the first leaves nothing in the line.
    queue, receive = full_queue
    first, second = await _in_line(queue, [_handle(SIZE), _handle(SIZE + 1)])
    first.cancel()
    queue.release(receive.receive_nowait())
    await asyncio.wait_for(second, 10)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(first, 10)
    assert (len(queue._waiting), queue.queued) == (0, SIZE)
    queue.release(receive.receive_nowait())
    queue.send_nowait(_handle(SIZE + 2))  # the room is there for anyone
    assert [h.request_id for h in (receive.receive_nowait(), receive.receive_nowait())] == [
        f"r{SIZE + 1}",
        f"r{SIZE + 2}",
    ]


async def test_a_queue_closed_with_dead_entries_in_line_refuses_the_live_senders(
    full_queue: _Full,
) -> None:
    queue, _ = full_queue
    senders = await _in_line(queue, [_handle(SIZE + n) for n in range(4)])
    senders[2].cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(senders[2], 10)
    queue.close()
    for sender in senders[:2] + senders[3:]:
        with pytest.raises(anyio.ClosedResourceError):
            await asyncio.wait_for(sender, 10)
    assert not queue._waiting


class _Scanned(set[int]):
    """The start order's pending numbers, counting the entries looked at to find the
    earliest: each one iterated over, and each membership test."""

    def __init__(self) -> None:
        super().__init__()
        self.scanned = 0

    def __iter__(self) -> Iterator[int]:
        for seq in super().__iter__():
            self.scanned += 1
            yield seq

    def __contains__(self, seq: object) -> bool:
        self.scanned += 1
        return super().__contains__(seq)


async def test_cancelled_starts_behind_pending_ones_cost_no_scan_of_the_pending() -> None:
    # A burst of starts, the later half cancelled before their handles were given out: each
    # is owed behind the earlier, still pending ones. Finding the earliest pending start
    # must not look at all of them for every start owed.
    group = SingleRank()
    order = StartOrder(group)
    order._pending = pending = _Scanned()
    starts = [order.started() for _ in range(2 * WAITING)]
    early, late = starts[:WAITING], starts[WAITING:]
    for seq in late:
        await order.owe(seq, agreement_tag("prefetch", seq))
    assert group.statistics().collectives == 0  # all owed behind the pending ones
    for seq in early[:-1]:
        order.entered(seq)
        await order.pay()
    assert group.statistics().collectives == 0  # the last pending one still holds them
    order.entered(early[-1])
    await order.pay()
    assert group.statistics().collectives == len(late)  # all due now, entered with 0
    assert pending.scanned <= 4 * len(starts)
    assert not pending
    assert not order._owed
