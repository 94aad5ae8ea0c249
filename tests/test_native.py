"""The byte-moving kernels, native (AVX2 and scalar) and Python, against python-xxhash."""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import xxhash

import hicache_async._native as native

IMPLEMENTATIONS = ["avx2", "scalar", "python"]


@pytest.fixture(params=IMPLEMENTATIONS)
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Runs a test once per implementation of the kernels."""
    kernels = native._kernels
    name: str = request.param
    if name == "python":
        monkeypatch.setattr(native, "_kernels", None)
        yield name
        return
    if kernels is None:
        pytest.skip("the native kernels are not built here")
    try:
        kernels.set_simd(name)
    except ValueError:
        pytest.skip(f"no {name} on this CPU")
    try:
        yield name
    finally:
        kernels.set_simd("auto")


def _cut(data: bytes | bytearray | memoryview, rng: random.Random) -> list[memoryview]:
    """`data` as 1 to 6 consecutive views, some possibly empty."""
    view = memoryview(data)
    cuts = sorted(rng.randrange(len(view) + 1) for _ in range(rng.randrange(6)))
    return [view[a:b] for a, b in zip([0, *cuts], [*cuts, len(view)], strict=True)]


# Every length class of XXH3 (0, 1-3, 4-8, 9-16, 17-128, 129-240, more), block and stripe
# boundaries (64, 1024, 1025...), and a few large inputs.
LENGTHS = [
    *range(0, 260),
    *range(1000, 1100),
    2047,
    2048,
    2049,
    4096,
    65535,
    1 << 20,
    (1 << 20) + 17,
]


def test_the_kernels_are_built_here() -> None:
    # CI installs with a C compiler: a silent fallback there would hide a broken build.
    assert native.NATIVE
    assert native.simd() in ("avx2", "scalar")


def test_set_simd_refuses_unknown_names() -> None:
    kernels = native._kernels
    if kernels is None:
        pytest.skip("the native kernels are not built here")
    before = kernels.simd()
    with pytest.raises(ValueError, match="must be"):
        kernels.set_simd("sse9")
    assert kernels.simd() == before


def test_checksum_matches_xxh3_for_every_length_and_cut(impl: str) -> None:
    rng = random.Random(7)
    for length in LENGTHS:
        data = rng.randbytes(length)
        expected = xxhash.xxh3_64_intdigest(data)
        assert native.checksum(_cut(data, rng)) == expected, length
        if impl != "python":  # the kernels' hash-only loop, which writes use
            assert native._kernels.xxh3_copy(None, _cut(data, rng), False) == expected, length


@pytest.mark.parametrize("stream", [True, False])
def test_copy_checksum_copies_exactly_and_hashes(impl: str, stream: bool) -> None:
    rng = random.Random(11)
    for length in [*LENGTHS[::7], 300_001]:
        data = rng.randbytes(length)
        # An odd offset into the target, so every store alignment is exercised.
        target = bytearray(length + 3)
        dst = _cut(memoryview(target)[3:], rng)
        digest = native.copy_checksum(dst, _cut(data, rng), stream=stream)
        assert digest == xxhash.xxh3_64_intdigest(data)
        assert bytes(target[3:]) == data
        assert target[:3] == b"\0\0\0"


def test_copy_checksum_hashes_the_bytes_it_copied_while_the_source_changes(impl: str) -> None:
    # An in-place read copies from memory another process may reuse at any moment: the digest
    # must be of what landed in the target, or a changed page could pass its check.
    source = np.zeros(8192 + 8, dtype=np.uint8)
    target = bytearray(source.nbytes)
    stop = threading.Event()

    def flip() -> None:
        head, tail = source[:8], source[-8:]
        while not stop.is_set():
            np.bitwise_xor(head, 0xFF, out=head)
            np.bitwise_xor(tail, 0xFF, out=tail)

    flipper = threading.Thread(target=flip)
    flipper.start()
    try:
        for _ in range(20_000):
            digest = native.copy_checksum([memoryview(target)], [memoryview(source)])
            assert digest == xxhash.xxh3_64_intdigest(bytes(target))
    finally:
        stop.set()
        flipper.join()


def test_copy_checksum_rejects_unequal_totals(impl: str) -> None:
    target = bytearray(10)
    with pytest.raises(ValueError, match="bytes"):
        native.copy_checksum([memoryview(target)], [b"x" * 11])
    assert target == bytearray(10)


def test_copy_checksum_needs_writable_targets(impl: str) -> None:
    with pytest.raises((BufferError, TypeError)):
        native.copy_checksum([b"0123"], [b"abcd"])


def test_pread_checksum_reads_into_any_cut(impl: str, tmp_path: Path) -> None:
    rng = random.Random(5)
    data = rng.randbytes(3 * native.BOUNCE_NBYTES + 12345)
    path = tmp_path / "page"
    path.write_bytes(b"H" * 128 + data)
    fd = os.open(path, os.O_RDONLY)
    try:
        target = bytearray(len(data))
        nread, digest = native.pread_checksum(fd, 128, _cut(target, rng))
        assert nread == len(data)
        assert digest == xxhash.xxh3_64_intdigest(data)
        assert target == data
        # A short file: what is there, and its checksum.
        longer = bytearray(len(data) + 999)
        nread, digest = native.pread_checksum(fd, 128, [memoryview(longer)])
        assert nread == len(data)
        assert digest == xxhash.xxh3_64_intdigest(data)
    finally:
        os.close(fd)


def test_pread_checksum_raises_on_a_bad_descriptor(impl: str, tmp_path: Path) -> None:
    fd = os.open(tmp_path, os.O_RDONLY)  # a directory: read fails with EISDIR
    try:
        with pytest.raises(OSError, match="directory"):
            native.pread_checksum(fd, 0, [memoryview(bytearray(100))])
    finally:
        os.close(fd)


def test_pwrite_checksum_writes_and_hashes(impl: str, tmp_path: Path) -> None:
    rng = random.Random(9)
    data = rng.randbytes(5 * 100_000 + 77)
    path = tmp_path / "page"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        digest = native.pwrite_checksum(fd, 128, _cut(data, rng), 100_000)
    finally:
        os.close(fd)
    assert digest == xxhash.xxh3_64_intdigest(data)
    assert path.read_bytes() == b"\0" * 128 + data
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError, match="Bad file descriptor"):
            native.pwrite_checksum(fd, 0, [data], 4096)
    finally:
        os.close(fd)


@pytest.mark.parametrize("stream", [True, False])
def test_copy_at_copies_between_addresses(impl: str, stream: bool) -> None:
    rng = np.random.default_rng(2)
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros(1 << 20, dtype=np.uint8)
    spans = np.array([[0, 64, 300_000], [700_000, 400_000, 4097], [9, 500_001, 3]], np.int64)
    native.copy_at(dst.ctypes.data, src.ctypes.data, spans, stream=stream)
    expected = np.zeros_like(dst)
    for s, d, n in spans.tolist():
        expected[d : d + n] = src[s : s + n]
    assert np.array_equal(dst, expected)


def _fake_cache(root: Path, levels: list[tuple[str, str, str]]) -> Path:
    """A sysfs-like cache folder: one indexN per (level, type, size)."""
    for n, (level, kind, size) in enumerate(levels):
        folder = root / f"index{n}"
        folder.mkdir(parents=True)
        (folder / "level").write_text(level + "\n")
        (folder / "type").write_text(kind + "\n")
        (folder / "size").write_text(size + "\n")
    return root


def test_the_bounce_is_sized_to_the_core_s_level_2_cache(tmp_path: Path) -> None:
    levels = [("1", "Data", "48K"), ("1", "Instruction", "32K"), ("2", "Unified", "2048K")]
    found = native._core_cache_nbytes(str(_fake_cache(tmp_path / "a", levels)))
    assert found == 2 << 20
    assert native.bounce_nbytes(found) == 2 << 20
    # Past the clamp either way, and unknown: the defaults.
    assert native.bounce_nbytes(32 << 20) == 4 << 20
    assert native.bounce_nbytes(16 << 10) == 64 << 10
    assert native.bounce_nbytes(None) == 256 << 10
    assert native.bounce_nbytes(0) == 256 << 10


def test_an_unreadable_cache_description_leaves_the_size_unknown(tmp_path: Path) -> None:
    assert native._core_cache_nbytes(str(tmp_path / "missing")) is None
    garbled = _fake_cache(tmp_path / "b", [("2", "Unified", "lots")])
    assert native._core_cache_nbytes(str(garbled)) is None
    no_level_2 = _fake_cache(tmp_path / "c", [("1", "Data", "32K"), ("3", "Unified", "32M")])
    assert native._core_cache_nbytes(str(no_level_2)) is None
    assert native._parse_size("1M") == 1 << 20
    assert native._parse_size("512") == 512
    assert native._parse_size("K") is None


def test_each_thread_reads_through_a_bounce_of_the_chosen_size() -> None:
    assert len(native.bounce_buffer()) == native.BOUNCE_NBYTES
    assert native.bounce_nbytes(native._core_cache_nbytes()) == native.BOUNCE_NBYTES
