"""The stored page format: a fixed 128-byte header, then the payload.

Header, little-endian:

    offset size field
         0    4 magic b"HCKV"
         4    2 format version (1)
         6    2 flags (bit 0: a keyed MAC is present)
         8   16 namespace fingerprint of the writer
        24   32 page key
        56    8 payload length in bytes
        64    4 token count
        68    4 priority (signed)
        72    8 xxh3-64 of the payload
        80    8 creation time, unix nanoseconds
        88   32 keyed MAC (blake2b-256 over header bytes 0..88 and the payload), or zeros
       120    8 xxh3-64 of header bytes 0..120

Evolution: a reader accepts exactly the versions it knows. A page of a newer version is a miss
that is left in place (a newer writer shares the store), and so is one with a flag bit the reader
does not know (a later release may define one without a new version); a header that fails its
own checksum is corrupt. New fields go into a new version; the 128-byte size and the first 8
bytes never change. A release that raises FORMAT_VERSION must treat a page of an earlier
version it no longer reads the same way (UNSUPPORTED, never CORRUPT): the instances not yet
upgraded still read it.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
import time
from collections.abc import Iterable

import msgspec
import numpy as np
import xxhash

from .. import _native
from ._protocol import PageBuffer, PageMeta

__all__ = [
    "FORMAT_VERSION",
    "HEADER_NBYTES",
    "MAGIC",
    "PageCheck",
    "PageHeader",
    "PayloadVerifier",
    "check_header",
    "created_recency",
    "decode_header",
    "encode_header",
    "payload_checksum",
    "read_value_into",
    "scatter",
    "verify_payload",
]

MAGIC = b"HCKV"
FORMAT_VERSION = 1
HEADER_NBYTES = 128
FLAG_MAC = 1
_KNOWN_FLAGS = FLAG_MAC

_BODY = struct.Struct("<4sHH16s32sQIiQQ32s")  # bytes 0..120
_TAIL = struct.Struct("<Q")
_MAC_OFFSET = 88
assert _BODY.size + _TAIL.size == HEADER_NBYTES
#: How far ahead of a listing's clock a page's creation stamp is still believed (the
#: allowance the Mooncake manifest lock gives clocks ahead).
CREATED_AHEAD_S = 300.0


def created_recency(created_s: float, now: float) -> float:
    """The last use a listing gives a page known only by its header's creation time (seconds).

    A stamp up to `CREATED_AHEAD_S` ahead of `now` (a writer's clock a little fast) counts
    as `now`; one further ahead (a host booted with a wrong time, a forged header) as never
    used (0.0), the first `gc` evicts: otherwise such a writer would pin its pages, listed
    newest, until that time came.
    """
    if created_s > now + CREATED_AHEAD_S:
        return 0.0
    return min(created_s, now)


class PageCheck(enum.Enum):
    """Why a stored page is not served."""

    OK = "ok"
    #: magic, header checksum, key, length, namespace, payload checksum or MAC mismatch.
    CORRUPT = "corrupt"
    #: written by a newer format version, or under another namespace: a miss, left in place.
    UNSUPPORTED = "unsupported"


class PageHeader(msgspec.Struct, frozen=True):
    """A decoded page header."""

    version: int
    flags: int
    namespace: bytes
    key: bytes
    payload_nbytes: int
    num_tokens: int
    priority: int
    checksum: int
    created_ns: int
    mac: bytes

    @property
    def page_nbytes(self) -> int:
        return HEADER_NBYTES + self.payload_nbytes


def payload_checksum(segments: Iterable[memoryview | bytes]) -> int:
    """xxh3-64 over the payload segments in order, without joining them."""
    return _native.checksum(list(segments))


def _mac_hasher(mac_key: bytes, header_body: bytes) -> hashlib.blake2b:
    hasher = hashlib.blake2b(key=mac_key, digest_size=32, person=b"hicache-page")
    hasher.update(header_body[:_MAC_OFFSET])
    return hasher


def _mac(mac_key: bytes, header_body: bytes, segments: Iterable[memoryview | bytes]) -> bytes:
    hasher = _mac_hasher(mac_key, header_body)
    for segment in segments:
        hasher.update(segment)
    return hasher.digest()


def check_priority(priority: object, *, field: str = "priority") -> int:
    """`priority` as a Python int; ValueError unless a page header can hold it (an int32).

    A numpy integer is taken as its value (returned as an int, so it never reaches the
    manifest's JSON encoder as a numpy scalar); a bool is not, though an int check lets it
    through (True would be stored as priority 1).
    """
    message = f"{field} must be an int in [-2**31, 2**31), got {priority!r}"
    if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)):
        raise ValueError(message)  # noqa: TRY004  (documented: ValueError, as for the range)
    value = int(priority)
    if not -(1 << 31) <= value < 1 << 31:
        raise ValueError(message)
    return value


def check_header_fields(meta: PageMeta) -> None:
    """Raise ValueError unless the header can hold `meta.num_tokens` (uint32) and
    `meta.priority` (int32)."""
    tokens = meta.num_tokens
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 <= tokens < 1 << 32:
        raise ValueError(f"meta.num_tokens must be in [0, 2**32), got {meta.num_tokens!r}")
    check_priority(meta.priority, field="meta.priority")


def encode_header(
    meta: PageMeta,
    payload: PageBuffer,
    *,
    mac_key: bytes | None = None,
    checksum: int | None = None,
    created_ns: int | None = None,
) -> bytes:
    """The 128-byte header for `payload` (a page's segments) described by `meta`."""
    if len(meta.key) != 32:
        raise ValueError(f"page keys are 32 bytes, got {len(meta.key)}")
    if not isinstance(meta.namespace, bytes) or len(meta.namespace) != 16:
        raise ValueError(f"namespace fingerprints are 16 bytes, got {meta.namespace!r:.40}")
    check_header_fields(meta)
    nbytes = sum(memoryview(s).nbytes for s in payload)
    digest = payload_checksum(payload) if checksum is None else checksum
    created = time.time_ns() if created_ns is None else created_ns
    flags = FLAG_MAC if mac_key else 0
    fields = (
        MAGIC,
        FORMAT_VERSION,
        flags,
        meta.namespace,
        meta.key,
        nbytes,
        meta.num_tokens,
        meta.priority,
        digest,
        created,
    )
    body = _BODY.pack(*fields, bytes(32))
    if mac_key:
        body = _BODY.pack(*fields, _mac(mac_key, body, payload))
    return body + _TAIL.pack(xxhash.xxh3_64_intdigest(body))


def decode_header(raw: bytes | memoryview) -> PageHeader | PageCheck:
    """Decode a header, or say why it cannot be trusted. Never raises on bad bytes."""
    if len(raw) < HEADER_NBYTES:
        return PageCheck.CORRUPT
    raw = bytes(raw[:HEADER_NBYTES])
    if raw[:4] != MAGIC:
        return PageCheck.CORRUPT
    (version,) = struct.unpack_from("<H", raw, 4)
    if version > FORMAT_VERSION:
        return PageCheck.UNSUPPORTED
    body = raw[: _BODY.size]
    (stored,) = _TAIL.unpack_from(raw, _BODY.size)
    if version != FORMAT_VERSION or xxhash.xxh3_64_intdigest(body) != stored:
        return PageCheck.CORRUPT
    (_, version, flags, namespace, key, nbytes, tokens, priority, digest, created, mac) = (
        _BODY.unpack(body)
    )
    if flags & ~_KNOWN_FLAGS:
        # A flag a later release defined may change how the payload reads: served as it
        # stands, it could be a wrong page. A miss, left for the writer's release.
        return PageCheck.UNSUPPORTED
    return PageHeader(
        version=version,
        flags=flags,
        namespace=namespace,
        key=key,
        payload_nbytes=nbytes,
        num_tokens=tokens,
        priority=priority,
        checksum=digest,
        created_ns=created,
        mac=mac,
    )


def check_header(
    header: PageHeader | PageCheck,
    *,
    key: bytes,
    namespace: bytes,
    payload_nbytes: int,
    stored_nbytes: int | None = None,
) -> PageCheck:
    """Check a decoded header against what the reader expects, before reading the payload.

    `stored_nbytes`, when known, is the length of the whole stored value (header included).
    """
    if isinstance(header, PageCheck):
        return header
    if header.key != key:
        return PageCheck.CORRUPT
    if header.namespace != namespace:
        # A sound page of another deployment sharing the store (e.g. SGLang-compatible
        # keys under another layout): a miss for us, but not ours to delete.
        return PageCheck.UNSUPPORTED
    if header.payload_nbytes != payload_nbytes:
        if stored_nbytes is not None and stored_nbytes != HEADER_NBYTES + header.payload_nbytes:
            return PageCheck.CORRUPT  # its own length does not add up: torn or damaged
        # A page that agrees with itself but not with the reader's buffer: the reader may be
        # the one in the wrong, and deleting would lose a sound page. A miss, left in place.
        return PageCheck.UNSUPPORTED
    if stored_nbytes is not None and stored_nbytes != HEADER_NBYTES + payload_nbytes:
        return PageCheck.CORRUPT
    return PageCheck.OK


def verify_payload(
    header: PageHeader,
    payload: PageBuffer,
    *,
    mac_key: bytes | None = None,
    checksum: int | None = None,
) -> PageCheck:
    """Check the payload's checksum (and MAC when the reader holds a key).

    `checksum`, when given, is the payload's checksum already computed by the caller.
    """
    if checksum is None:
        checksum = payload_checksum(payload)
    if checksum != header.checksum:
        return PageCheck.CORRUPT
    if mac_key:
        # A reader with a key trusts only pages MACed with it: an unkeyed writer could have
        # produced any payload with a matching checksum.
        if not header.flags & FLAG_MAC:
            return PageCheck.CORRUPT
        if not hmac.compare_digest(_mac(mac_key, _mac_body(header), payload), header.mac):
            return PageCheck.CORRUPT
    return PageCheck.OK


def _mac_body(header: PageHeader) -> bytes:
    """The header bytes the MAC covers (its own field zeroed), rebuilt from `header`."""
    return _BODY.pack(
        MAGIC,
        header.version,
        header.flags,
        header.namespace,
        header.key,
        header.payload_nbytes,
        header.num_tokens,
        header.priority,
        header.checksum,
        header.created_ns,
        bytes(32),
    )


class PayloadVerifier:
    """`verify_payload` over a payload fed in pieces, in order: its memory does not depend on
    the payload's length, so a header claiming a huge payload costs time, never memory."""

    def __init__(self, header: PageHeader, *, mac_key: bytes | None = None) -> None:
        self._header = header
        self._xxh = xxhash.xxh3_64()
        self._mac_key = mac_key
        self._hmac: hashlib.blake2b | None = None
        if mac_key and header.flags & FLAG_MAC:
            self._hmac = _mac_hasher(mac_key, _mac_body(header))

    def update(self, piece: memoryview | bytes) -> None:
        """Feed the next piece of the payload."""
        self._xxh.update(piece)
        if self._hmac is not None:
            self._hmac.update(piece)

    def result(self) -> PageCheck:
        """OK when the pieces fed so far are the payload the header describes."""
        if self._xxh.intdigest() != self._header.checksum:
            return PageCheck.CORRUPT
        if self._mac_key:
            if self._hmac is None:  # unkeyed page: see verify_payload
                return PageCheck.CORRUPT
            if not hmac.compare_digest(self._hmac.digest(), self._header.mac):
                return PageCheck.CORRUPT
        return PageCheck.OK


def scatter(source: bytes | memoryview, into: PageBuffer) -> None:
    """Copy `source` into the segments of `into` in order (lengths must add up)."""
    view = memoryview(source).cast("B")
    offset = 0
    for segment in into:
        flat = segment if segment.format == "B" and segment.ndim == 1 else segment.cast("B")
        end = offset + flat.nbytes
        flat[:] = view[offset:end]
        offset = end
    if offset != len(view):
        raise ValueError(f"payload of {len(view)} bytes does not fill buffers of {offset}")


def _scatter_checksum(source: bytes | memoryview, into: PageBuffer) -> int:
    """`scatter`, returning the checksum of what it copied (one pass over the bytes)."""
    view = memoryview(source).cast("B")
    if len(view) != sum(segment.nbytes for segment in into):
        raise ValueError(f"payload of {len(view)} bytes does not match the buffers")
    return _native.copy_checksum(list(into), [view])


def read_value_into(
    value: bytes | memoryview,
    *,
    key: bytes,
    namespace: bytes,
    into: PageBuffer,
    mac_key: bytes | None = None,
    stored_nbytes: int | None = None,
) -> PageCheck:
    """Check a stored `header ‖ payload` value and copy its payload into `into`.

    For value stores (memory, Redis, Mooncake) that hand back a page as one buffer.
    `stored_nbytes`, when given, is the stored value's length and `value` its first bytes
    (a reader that fetched no more than a page of the expected size); otherwise `value` is
    the whole value.
    """
    header = decode_header(value)
    expected = sum(s.nbytes for s in into)
    stored = len(value) if stored_nbytes is None else stored_nbytes
    check = check_header(
        header, key=key, namespace=namespace, payload_nbytes=expected, stored_nbytes=stored
    )
    if check is not PageCheck.OK or isinstance(header, PageCheck):
        return check
    checksum = _scatter_checksum(memoryview(value)[HEADER_NBYTES:], into)
    return verify_payload(header, into, mac_key=mac_key, checksum=checksum)
