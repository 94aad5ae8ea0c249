"""What a type checker sees of the public API: real types, and misspelt names caught."""

from __future__ import annotations

from pathlib import Path

import pytest

mypy_api = pytest.importorskip("mypy.api")

#: User code that must check clean: every line mypy reports about it is a defect of the API's
#: types (a backend that is no StorageBackend, a callback typed too narrowly, an Any).
ACCEPTED = Path(__file__).parent / "typing" / "user_api.py"

USER_CODE = """
from hicache_async import HiCach, HiCache
from hicache_async.storage import FileStorag, MemoryStorage
from hicache_async.storage import StorageBackend
from hicache_async.testing import MAC_KEY, FaultyStorag, FaultyStorage, StorageConformance


class EntersAsNone(MemoryStorage):
    async def __aenter__(self) -> None:  # type: ignore[override]
        await super().__aenter__()


def backend(store: StorageBackend) -> None: ...


backend(EntersAsNone())  # refused here as by the conformance suite: `as` would bind None


class TestMine(StorageConformance):
    pass


async def use(cache: HiCache) -> None:
    async with MemoryStorage() as store:
        reveal_type(store)
    cache.match("a prompt as text")
    FaultyStorage(store, eror_rate=0.2)
    reveal_type(MAC_KEY)
"""


@pytest.fixture(scope="module")
def mypy_output(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """mypy --strict over both user files in one run (each run takes many seconds), its
    output split by file."""
    pytest.importorskip("prometheus_client")  # ACCEPTED registers a collector
    tmp_path = tmp_path_factory.mktemp("typing")
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
            str(ACCEPTED),
        ]
    )
    assert err == ""

    def about(path: Path) -> str:
        # mypy names a file under the working directory by its relative path.
        lines = out.splitlines()
        return "\n".join(
            line for line in lines if Path(line.split(":", 1)[0]).resolve() == path.resolve()
        )

    return {"user": about(source), "accepted": about(ACCEPTED)}


def test_a_typed_user_gets_real_types_and_typos_caught(mypy_output: dict[str, str]) -> None:
    out = mypy_output["user"]
    assert 'has no attribute "HiCach"' in out
    assert 'has no attribute "FileStorag"' in out
    assert 'has no attribute "FaultyStorag"' in out
    assert 'Unexpected keyword argument "eror_rate"' in out
    assert 'Revealed type is "hicache_async.storage._memory.MemoryStorage"' in out
    assert 'Revealed type is "bytes"' in out or 'Revealed type is "builtins.bytes"' in out
    assert "StorageConformance" not in out  # subclassable: not Any
    assert 'Argument 1 to "match" of "HiCache" has incompatible type "str"' in out
    assert 'Argument 1 to "backend" has incompatible type "EntersAsNone"' in out


def test_typed_user_code_of_the_documented_api_checks_clean(mypy_output: dict[str, str]) -> None:
    # RedisStorage a StorageBackend, plugins and rank groups of users' own, callbacks that
    # return something, a typed Prometheus collector, the demo's TraceRequest exported, the
    # oracle taking torch tensors: see the file.
    assert mypy_output["accepted"] == ""
