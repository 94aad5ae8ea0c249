"""What a type checker sees of the public API: real types, and misspelt names caught."""

from __future__ import annotations

from pathlib import Path

import pytest

mypy_api = pytest.importorskip("mypy.api")

USER_CODE = """
from hicache_async import HiCach
from hicache_async.storage import FileStorag, MemoryStorage
from hicache_async.testing import MAC_KEY, FaultyStorag, FaultyStorage, StorageConformance


class TestMine(StorageConformance):
    pass


async def use() -> None:
    async with MemoryStorage() as store:
        reveal_type(store)
    FaultyStorage(store, eror_rate=0.2)
    reveal_type(MAC_KEY)
"""


def test_a_typed_user_gets_real_types_and_typos_caught(tmp_path: Path) -> None:
    source = tmp_path / "user.py"
    source.write_text(USER_CODE)
    out, err, _ = mypy_api.run(
        [
            "--strict",
            "--python-version",
            "3.10",  # the oldest supported: `Self` must not turn into Any there
            "--cache-dir",
            str(tmp_path / "cache"),
            str(source),
        ]
    )
    assert err == ""
    assert 'has no attribute "HiCach"' in out
    assert 'has no attribute "FileStorag"' in out
    assert 'has no attribute "FaultyStorag"' in out
    assert 'Unexpected keyword argument "eror_rate"' in out
    assert 'Revealed type is "hicache_async.storage._memory.MemoryStorage"' in out
    assert 'Revealed type is "bytes"' in out or 'Revealed type is "builtins.bytes"' in out
    assert "StorageConformance" not in out  # subclassable: not Any
