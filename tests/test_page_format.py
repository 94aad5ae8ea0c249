"""The stored page format: header layout, checksums, MAC, evolution rule."""

from __future__ import annotations

import struct

import msgspec
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from hicache_async.storage import HEADER_NBYTES, PageCheck, PageHeader, PageMeta, check_metas
from hicache_async.storage._page import (
    FORMAT_VERSION,
    MAGIC,
    PayloadVerifier,
    _scatter_checksum,
    check_header,
    decode_header,
    encode_header,
    payload_checksum,
    read_value_into,
    scatter,
    verify_payload,
)

KEY = bytes(range(32))
NS = bytes(range(100, 116))
MAC_KEY = b"k" * 32


def _meta(key: bytes = KEY, namespace: bytes = NS) -> PageMeta:
    return PageMeta(key=key, namespace=namespace, num_tokens=64, priority=-3)


def _value(payload: bytes, mac_key: bytes | None = None) -> bytes:
    return encode_header(_meta(), [memoryview(payload)], mac_key=mac_key) + payload


def test_header_layout_is_pinned() -> None:
    payload = b"abcdefgh" * 10
    header = encode_header(_meta(), [memoryview(payload)], created_ns=123456789)
    assert len(header) == HEADER_NBYTES == 128
    assert header[:4] == MAGIC == b"HCKV"
    assert struct.unpack_from("<HH", header, 4) == (FORMAT_VERSION, 0)
    assert header[8:24] == NS
    assert header[24:56] == KEY
    assert struct.unpack_from("<QIi", header, 56) == (80, 64, -3)
    assert struct.unpack_from("<QQ", header, 72) == (xxhash.xxh3_64_intdigest(payload), 123456789)
    assert header[88:120] == bytes(32)  # no MAC
    assert struct.unpack_from("<Q", header, 120)[0] == xxhash.xxh3_64_intdigest(header[:120])


def test_decode_round_trip() -> None:
    payload = bytes(1000)
    decoded = decode_header(encode_header(_meta(), [memoryview(payload)], created_ns=7))
    assert isinstance(decoded, PageHeader)
    assert (decoded.key, decoded.namespace, decoded.num_tokens, decoded.priority) == (
        KEY,
        NS,
        64,
        -3,
    )
    assert decoded.payload_nbytes == 1000
    assert decoded.page_nbytes == 1128
    assert decoded.created_ns == 7
    assert decoded.checksum == xxhash.xxh3_64_intdigest(payload)


def test_checksum_over_segments_equals_checksum_of_the_join() -> None:
    parts = [b"one", b"", b"three", b"x" * 5000]
    assert payload_checksum([memoryview(p) for p in parts]) == xxhash.xxh3_64_intdigest(
        b"".join(parts)
    )


def test_encode_rejects_bad_key_and_namespace_sizes() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        encode_header(_meta(key=b"short"), [])
    with pytest.raises(ValueError, match="16 bytes"):
        encode_header(_meta(namespace=b"short"), [])
    with pytest.raises(ValueError, match="16 bytes"):
        encode_header(_meta(namespace=NS.hex()[:16]), [])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_tokens", True), ("priority", False), ("priority", True), ("namespace", "n" * 16)],
)
def test_check_metas_refuses_bools_and_a_str_namespace(field: str, value: object) -> None:
    # A bool is an int to isinstance, and a 16-character str has a namespace's length: both
    # must be refused before any I/O, not stored as 1 or fail midway as a struct.error.
    meta = msgspec.structs.replace(_meta(), **{field: value})
    with pytest.raises(ValueError, match=field if field != "namespace" else "16 bytes"):
        check_metas([KEY], [meta])


@given(position=st.integers(0, HEADER_NBYTES - 1), bit=st.integers(0, 7))
def test_any_flipped_header_bit_is_caught(position: int, bit: int) -> None:
    header = bytearray(encode_header(_meta(), [memoryview(b"payload")]))
    header[position] ^= 1 << bit
    version = struct.unpack_from("<H", header, 4)[0]
    expected = PageCheck.UNSUPPORTED if version > FORMAT_VERSION else PageCheck.CORRUPT
    assert decode_header(bytes(header)) is expected


@given(st.binary(max_size=300))
def test_decode_never_raises_on_garbage(raw: bytes) -> None:
    result = decode_header(raw)
    assert isinstance(result, (PageHeader, PageCheck))


def test_newer_version_is_unsupported_whatever_follows() -> None:
    # The evolution rule: magic and version never move, so a reader can always tell a newer
    # page (left alone) from a damaged one (removed).
    newer = MAGIC + struct.pack("<HH", FORMAT_VERSION + 1, 0) + bytes(200)
    assert decode_header(newer) is PageCheck.UNSUPPORTED
    older = MAGIC + struct.pack("<HH", 0, 0) + bytes(200)
    assert decode_header(older) is PageCheck.CORRUPT
    assert decode_header(b"HCK") is PageCheck.CORRUPT


def test_check_header_compares_key_namespace_and_length() -> None:
    header = decode_header(encode_header(_meta(), [memoryview(bytes(10))]))
    assert check_header(header, key=KEY, namespace=NS, payload_nbytes=10) is PageCheck.OK
    check = check_header(header, key=bytes(32), namespace=NS, payload_nbytes=10)
    assert check is PageCheck.CORRUPT
    # Another length than the reader's: a miss to leave in place if the page agrees with
    # itself (the reader's buffer may be what is wrong), damaged if its own length does not.
    assert check_header(header, key=KEY, namespace=NS, payload_nbytes=11) is PageCheck.UNSUPPORTED
    whole = HEADER_NBYTES + 10
    for nbytes, stored, expected in (
        (11, whole, PageCheck.UNSUPPORTED),
        (11, whole + 1, PageCheck.CORRUPT),
        (10, whole, PageCheck.OK),
        (10, whole - 1, PageCheck.CORRUPT),
    ):
        check = check_header(
            header, key=KEY, namespace=NS, payload_nbytes=nbytes, stored_nbytes=stored
        )
        assert check is expected, (nbytes, stored)
    # Another deployment's sound page: a miss to leave in place, whatever its length.
    for nbytes in (10, 11):
        check = check_header(header, key=KEY, namespace=bytes(16), payload_nbytes=nbytes)
        assert check is PageCheck.UNSUPPORTED
    unsupported = check_header(PageCheck.UNSUPPORTED, key=KEY, namespace=NS, payload_nbytes=10)
    assert unsupported is PageCheck.UNSUPPORTED


def test_verify_payload_checksum_and_mac() -> None:
    payload = bytes(range(256)) * 4
    plain = decode_header(encode_header(_meta(), [memoryview(payload)]))
    keyed = decode_header(encode_header(_meta(), [memoryview(payload)], mac_key=MAC_KEY))
    assert isinstance(plain, PageHeader)
    assert isinstance(keyed, PageHeader)
    assert keyed.flags & 1
    good = [memoryview(payload)]
    bad = [memoryview(payload[:-1] + b"\x00")]
    assert verify_payload(plain, good) is PageCheck.OK
    assert verify_payload(plain, bad) is PageCheck.CORRUPT
    assert verify_payload(keyed, good, mac_key=MAC_KEY) is PageCheck.OK
    assert verify_payload(keyed, good) is PageCheck.OK  # a reader without a key checks less
    assert verify_payload(plain, good, mac_key=MAC_KEY) is PageCheck.CORRUPT  # no MAC at all
    assert verify_payload(keyed, good, mac_key=b"other" * 6) is PageCheck.CORRUPT
    assert verify_payload(keyed, bad, mac_key=MAC_KEY) is PageCheck.CORRUPT


@pytest.mark.parametrize("mac_key", [None, MAC_KEY, b"other" * 6])
@pytest.mark.parametrize("keyed", [False, True])
@pytest.mark.parametrize("damaged", [False, True])
def test_payload_verifier_in_pieces_agrees_with_verify_payload(
    mac_key: bytes | None, keyed: bool, damaged: bool
) -> None:
    payload = bytes(range(256)) * 40
    header = decode_header(
        encode_header(_meta(), [memoryview(payload)], mac_key=MAC_KEY if keyed else None)
    )
    assert isinstance(header, PageHeader)
    read = payload[:-1] + b"\x00" if damaged else payload
    verifier = PayloadVerifier(header, mac_key=mac_key)
    for start in range(0, len(read), 999):
        verifier.update(memoryview(read)[start : start + 999])
    expected = verify_payload(header, [memoryview(read)], mac_key=mac_key)
    assert verifier.result() is expected
    assert (expected is PageCheck.OK) == (
        not damaged and (mac_key is None or (mac_key == MAC_KEY and keyed))
    )


def test_read_value_into() -> None:
    payload = bytes(range(200))
    value = _value(payload)
    into = [memoryview(bytearray(50)), memoryview(bytearray(150))]
    assert read_value_into(value, key=KEY, namespace=NS, into=into) is PageCheck.OK
    assert b"".join(bytes(v) for v in into) == payload
    assert read_value_into(value + b"x", key=KEY, namespace=NS, into=into) is PageCheck.CORRUPT
    assert read_value_into(value[:-1], key=KEY, namespace=NS, into=into) is PageCheck.CORRUPT
    other = read_value_into(value, key=KEY, namespace=bytes(16), into=into)
    assert other is PageCheck.UNSUPPORTED
    short = [memoryview(bytearray(199))]  # a sound page, a buffer of another length
    assert read_value_into(value, key=KEY, namespace=NS, into=short) is PageCheck.UNSUPPORTED
    newer = value[:4] + struct.pack("<H", FORMAT_VERSION + 1) + value[6:]
    assert read_value_into(newer, key=KEY, namespace=NS, into=into) is PageCheck.UNSUPPORTED


def test_scatter_checks_lengths() -> None:
    into = [memoryview(bytearray(3)), memoryview(bytearray(2))]
    scatter(b"abcde", into)
    assert [bytes(v) for v in into] == [b"abc", b"de"]
    with pytest.raises(ValueError, match="does not fill"):
        scatter(b"abcdef", into)


@given(
    sizes=st.lists(st.integers(0, 700_000), min_size=1, max_size=4),
    seed=st.integers(0, 255),
)
def test_scatter_checksum_copies_and_hashes_in_one_pass(sizes: list[int], seed: int) -> None:
    """Copied piece by piece (pieces of 256 KiB, so segments span several), the bytes and
    the checksum are those of a plain copy and a checksum of the whole."""
    payload = bytes((seed + i * 7) % 256 for i in range(sum(sizes)))
    into = [memoryview(bytearray(n)) for n in sizes]
    checksum = _scatter_checksum(payload, into)
    assert b"".join(bytes(v) for v in into) == payload
    assert checksum == payload_checksum([payload]) == xxhash.xxh3_64_intdigest(payload)
    with pytest.raises(ValueError, match="does not match"):
        _scatter_checksum(payload + b"x", into)
    if payload:
        with pytest.raises(ValueError, match="does not match"):
            _scatter_checksum(payload[:-1], into)


def _with_flags(value: bytes, flags: int) -> bytes:
    """`value` with its header's flags replaced and its header checksum made right again."""
    head = bytearray(value[:HEADER_NBYTES])
    struct.pack_into("<H", head, 6, flags)
    struct.pack_into("<Q", head, 120, xxhash.xxh3_64_intdigest(bytes(head[:120])))
    return bytes(head) + value[HEADER_NBYTES:]


def test_a_flag_bit_the_reader_does_not_know_is_a_miss_left_in_place() -> None:
    payload = bytes(range(200))
    value = _value(payload)
    assert isinstance(decode_header(_with_flags(value, 0)), PageHeader)  # the rebuild is sound
    into = [memoryview(bytearray(200))]
    for flags in (2, 1 << 15, 2 | 1):
        unknown = _with_flags(value, flags)
        assert decode_header(unknown) is PageCheck.UNSUPPORTED
        assert read_value_into(unknown, key=KEY, namespace=NS, into=into) is PageCheck.UNSUPPORTED


@pytest.mark.parametrize("position", range(4))
def test_another_magic_is_corrupt_even_with_a_sound_header_checksum(position: int) -> None:
    """The magic is checked on its own: a value of another format whose last 8 header bytes
    happen to hash the rest is never read as a page."""
    value = bytearray(_value(bytes(range(200))))
    value[position] ^= 0x20
    struct.pack_into("<Q", value, 120, xxhash.xxh3_64_intdigest(bytes(value[:120])))
    assert decode_header(bytes(value)) is PageCheck.CORRUPT
    into = [memoryview(bytearray(200))]
    assert read_value_into(bytes(value), key=KEY, namespace=NS, into=into) is PageCheck.CORRUPT


@pytest.mark.parametrize("position", [0, 15, 16, 31])
def test_a_key_differing_in_any_byte_is_corrupt(position: int) -> None:
    """The whole 32-byte key is compared: a page filed under another key is never served."""
    value = _value(bytes(range(200)))
    other = bytearray(KEY)
    other[position] ^= 1
    header = decode_header(value)
    check = check_header(header, key=bytes(other), namespace=NS, payload_nbytes=200)
    assert check is PageCheck.CORRUPT
    into = [memoryview(bytearray(200))]
    assert read_value_into(value, key=bytes(other), namespace=NS, into=into) is PageCheck.CORRUPT
    assert read_value_into(value, key=KEY, namespace=NS, into=into) is PageCheck.OK


@pytest.mark.parametrize(("offset", "fmt"), [(56, "<Q"), (64, "<I"), (68, "<i"), (80, "<Q")])
def test_the_mac_covers_every_header_field_before_it(offset: int, fmt: str) -> None:
    """Length, token count, priority and creation time changed under a keyed page (its
    header checksum recomputed, as anyone can) fail the MAC."""
    payload = bytes(range(200))
    value = bytearray(_value(payload, mac_key=MAC_KEY))
    (field,) = struct.unpack_from(fmt, value, offset)
    struct.pack_into(fmt, value, offset, field + 1)
    struct.pack_into("<Q", value, 120, xxhash.xxh3_64_intdigest(bytes(value[:120])))
    header = decode_header(bytes(value))
    assert isinstance(header, PageHeader)
    assert verify_payload(header, [memoryview(payload)]) is PageCheck.OK  # no key: not seen
    assert verify_payload(header, [memoryview(payload)], mac_key=MAC_KEY) is PageCheck.CORRUPT
    verifier = PayloadVerifier(header, mac_key=MAC_KEY)
    verifier.update(payload)
    assert verifier.result() is PageCheck.CORRUPT


@pytest.mark.parametrize("priority", [-(2**31) - 1, 2**31])
def test_a_priority_past_int32_is_a_value_error(priority: int) -> None:
    meta = PageMeta(key=KEY, namespace=NS, num_tokens=1, priority=priority)
    with pytest.raises(ValueError, match="priority"):
        encode_header(meta, [memoryview(b"x")])


@pytest.mark.parametrize("num_tokens", [-1, 2**32])
def test_a_token_count_past_uint32_is_a_value_error(num_tokens: int) -> None:
    meta = PageMeta(key=KEY, namespace=NS, num_tokens=num_tokens, priority=0)
    with pytest.raises(ValueError, match="num_tokens"):
        encode_header(meta, [memoryview(b"x")])
    top = PageMeta(key=KEY, namespace=NS, num_tokens=2**32 - 1, priority=0)
    header = decode_header(encode_header(top, [memoryview(b"x")]))
    assert isinstance(header, PageHeader)
    assert header.num_tokens == 2**32 - 1
