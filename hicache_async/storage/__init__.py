"""Storage (L3): the async backend protocol, the page format and the backends."""

from ._page import HEADER_NBYTES, PageCheck, PageHeader, decode_header, encode_header
from ._protocol import (
    Outcome,
    PageBuffer,
    PageMeta,
    StorageBackend,
    StorageCapabilities,
    StorageError,
    StorageStats,
)

__all__ = [
    "HEADER_NBYTES",
    "Outcome",
    "PageBuffer",
    "PageCheck",
    "PageHeader",
    "PageMeta",
    "StorageBackend",
    "StorageCapabilities",
    "StorageError",
    "StorageStats",
    "decode_header",
    "encode_header",
]
