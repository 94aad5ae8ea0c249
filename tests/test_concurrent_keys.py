"""Overlapping puts, gets, deletes and `exists` of the same keys on the in-process backends
(memory, a private file root, two instances of a shared one), with and without faults and
cancellations; see `_key_races`."""

from __future__ import annotations

from pathlib import Path

import pytest
from _key_races import Race, race_and_check

from hicache_async.storage import FileStorage, MemoryStorage
from hicache_async.testing._faults import FaultyStorage

_SEEDS = [1, 2, 3]


@pytest.mark.parametrize("seed", _SEEDS)
async def test_memory(seed: int) -> None:
    await race_and_check(lambda: [MemoryStorage(capacity_bytes=64 << 20)], Race(seed))


@pytest.mark.parametrize("seed", _SEEDS)
async def test_memory_with_faults(seed: int) -> None:
    def backends() -> list[FaultyStorage]:
        inner = MemoryStorage(capacity_bytes=64 << 20)
        return [FaultyStorage(inner, seed=seed, error_rate=0.1, partial_batch_rate=0.2)]

    await race_and_check(backends, Race(seed, faults=True))


@pytest.mark.parametrize("seed", _SEEDS)
async def test_private_file_root(seed: int, tmp_path: Path) -> None:
    await race_and_check(lambda: [FileStorage(tmp_path / "root")], Race(seed))


@pytest.mark.parametrize("seed", _SEEDS)
async def test_private_file_root_with_faults(seed: int, tmp_path: Path) -> None:
    def backends() -> list[FaultyStorage]:
        inner = FileStorage(tmp_path / "root")
        return [FaultyStorage(inner, seed=seed, error_rate=0.1, partial_batch_rate=0.2)]

    await race_and_check(backends, Race(seed, faults=True))


@pytest.mark.parametrize("seed", _SEEDS)
async def test_shared_file_root_two_instances(seed: int, tmp_path: Path) -> None:
    root = tmp_path / "root"
    await race_and_check(
        lambda: [FileStorage(root, shared=True), FileStorage(root, shared=True)],
        Race(seed, exists_trusts_own_index=True, check_occupancy=False),
    )


@pytest.mark.parametrize("seed", _SEEDS)
async def test_damaged_pages_on_a_shared_file_root(seed: int, tmp_path: Path) -> None:
    # Pages damaged after their put (flipped bytes, cut values) never read as OK.
    root = tmp_path / "root"

    def backends() -> list[FileStorage | FaultyStorage]:
        damaging = FaultyStorage(
            FileStorage(root, shared=True), seed=seed, corrupt_rate=0.2, truncate_rate=0.2
        )
        return [damaging, FileStorage(root, shared=True)]

    race = Race(seed, faults=True, exists_trusts_own_index=True, check_occupancy=False)
    await race_and_check(backends, race)


@pytest.mark.parametrize("seed", _SEEDS)
async def test_damaged_pages_in_memory(seed: int) -> None:
    def backends() -> list[FaultyStorage]:
        inner = MemoryStorage(capacity_bytes=64 << 20)
        return [FaultyStorage(inner, seed=seed, corrupt_rate=0.2, truncate_rate=0.2)]

    await race_and_check(backends, Race(seed, faults=True))
