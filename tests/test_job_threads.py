"""The worker threads behind every backend's `run_job`: results, errors, cancellation, shutdown."""

from __future__ import annotations

import asyncio
import threading

import pytest

from hicache_async.storage._threads import Job, JobThreads


def _finished(job: Job[object] | Job[str]) -> bool:
    return job.finished


def pool_thread_ident(pool: JobThreads) -> int | None:
    return pool._threads[0].ident


async def _run(pool: JobThreads, job: Job[object]) -> object:
    pool.start(job)
    await job.wait()
    return job.result()


async def test_a_job_returns_its_value_from_a_worker_thread() -> None:
    pool = JobThreads(2, "t")
    loop = asyncio.get_running_loop()
    caller = threading.get_ident()
    job: Job[object] = Job(lambda stop: (threading.get_ident(), stop.is_set()), loop)
    assert await _run(pool, job) == (pool_thread_ident(pool), False)
    assert pool_thread_ident(pool) != caller
    assert job.finished
    assert "finished" in repr(job)
    pool.shutdown()


async def test_a_job_error_is_raised_on_the_loop() -> None:
    pool = JobThreads(1, "t")

    def fail(stop: threading.Event) -> None:
        raise OSError(5, "disk on fire")

    job: Job[object] = Job(fail, asyncio.get_running_loop())
    with pytest.raises(OSError, match="disk on fire"):
        await _run(pool, job)
    pool.shutdown()


async def test_result_before_the_end_is_refused() -> None:
    release = threading.Event()
    pool = JobThreads(1, "t")
    job: Job[object] = Job(lambda stop: release.wait(5), asyncio.get_running_loop())
    pool.start(job)
    with pytest.raises(RuntimeError, match="not finished"):
        job.result()
    release.set()
    await job.wait()
    assert job.result() is True
    pool.shutdown()


async def test_a_cancelled_wait_leaves_the_work_running_and_drain_waits_for_it() -> None:
    pool = JobThreads(1, "t")
    started, release = threading.Event(), threading.Event()
    seen: list[bool] = []

    def work(stop: threading.Event) -> str:
        started.set()
        release.wait(5)
        seen.append(stop.is_set())
        return "done"

    job: Job[str] = Job(work, asyncio.get_running_loop())
    pool.start(job)
    waiter = asyncio.create_task(job.wait())
    await asyncio.to_thread(started.wait, 5)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not _finished(job)  # the work goes on
    job.stop.set()
    drainer = asyncio.create_task(job.drain())
    await asyncio.sleep(0)
    drainer.cancel()  # a cancellation during the drain is noted, not obeyed
    await asyncio.sleep(0)
    release.set()
    # The cancellation itself, for the caller to raise (an anyio scope knows its own).
    assert isinstance(await drainer, asyncio.CancelledError)
    assert _finished(job)  # set on the loop by the job's end
    assert seen == [True]
    assert job.result() == "done"
    pool.shutdown()


async def test_threads_are_started_as_needed_and_reused() -> None:
    pool = JobThreads(3, "t")
    loop = asyncio.get_running_loop()
    idents = set()
    for _ in range(20):  # one after another: one thread does them all
        idents.add(await _run(pool, Job(lambda stop: threading.get_ident(), loop)))
    assert len(idents) == 1
    gate = threading.Barrier(3, timeout=5)
    jobs: list[Job[object]] = [Job(lambda stop: gate.wait(), loop) for _ in range(3)]
    for job in jobs:  # three at once need three threads (the barrier waits for all)
        pool.start(job)
    for job in jobs:
        await job.wait()
        job.result()
    assert "threads=3/3" in repr(pool)
    pool.shutdown()


def test_shutdown_runs_queued_jobs_then_refuses_new_ones() -> None:
    pool = JobThreads(1, "shutdown-test")
    release = threading.Event()
    ran: list[str] = []

    def first() -> None:
        release.wait(5)
        ran.append("first")

    def queued() -> None:
        ran.append("queued")

    pool.start(first)
    pool.start(queued)
    threading.Timer(0.05, release.set).start()
    pool.shutdown(wait=True)  # waits for both: queued jobs have callers waiting for them
    assert ran == ["first", "queued"]
    assert "shut down" in repr(pool)
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.start(queued)
    pool.shutdown()  # idempotent
    assert ran == ["first", "queued"]
    assert not [t for t in threading.enumerate() if t.name.startswith("shutdown-test_")]


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="max_workers"):
        JobThreads(0, "t")


def test_a_job_whose_loop_has_closed_ends_quietly() -> None:
    loop = asyncio.new_event_loop()
    job: Job[int] = Job(lambda stop: 7, loop)
    loop.close()
    job.run()  # nobody waits: the end is dropped, not raised on the worker
    assert not job.finished
