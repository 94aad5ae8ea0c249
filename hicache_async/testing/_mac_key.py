"""The MAC key of the conformance suite, importable without pytest."""

from __future__ import annotations

__all__ = ["MAC_KEY"]

#: The key a `mac_backend` fixture must be opened with.
MAC_KEY = b"conformance-mac-key-0123456789ab"
