"""file:// and memory:// URLs refuse a fragment, as redis:// and mooncake:// do: urlsplit drops
it, so `file:///x/cache#2` would open /x/cache and `memory://#capacity=1KiB` get 1 GiB."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache_async.storage import FileStorage, StorageConfigError, open_storage


@pytest.mark.parametrize(
    "url",
    [
        "file:///{root}/cache#2",
        "file:///{root}/cache#capacity=1KiB",
        "file:///{root}/cache?capacity=1GiB#x",
        "file:///{root}/cache#",
        "file://#x",
    ],
)
def test_a_file_url_with_a_fragment_is_refused_and_creates_nothing(
    tmp_path: Path, url: str
) -> None:
    url = url.format(root=str(tmp_path).lstrip("/"))
    with pytest.raises(StorageConfigError, match=r"take no fragment.*%23"):
        open_storage(url)
    with pytest.raises(StorageConfigError, match=r"take no fragment.*%23"):
        FileStorage.from_url(url)
    assert list(tmp_path.iterdir()) == []


def test_a_hash_in_a_file_path_is_written_percent_23(tmp_path: Path) -> None:
    storage = open_storage(f"file://{tmp_path}/cache%232")
    assert isinstance(storage, FileStorage)
    assert storage.root == tmp_path / "cache#2"


@pytest.mark.parametrize(
    "url", ["memory://#capacity=1KiB", "memory://?capacity=1KiB#x", "memory://#"]
)
def test_a_memory_url_with_a_fragment_is_refused(url: str) -> None:
    with pytest.raises(StorageConfigError, match=r"take no fragment.*capacity=SIZE"):
        open_storage(url)
