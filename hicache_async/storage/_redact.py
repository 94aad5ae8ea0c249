"""Keeping the credentials of a storage URL out of messages, however the URL is written."""

from __future__ import annotations

import re
from urllib.parse import unquote

__all__ = ["mask_userinfo", "scrub_secrets", "url_secrets"]

_SCHEME = re.compile(r"^\s*[A-Za-z][A-Za-z0-9+.-]*://")
# Where a parser may cut a password that was not percent-encoded; each piece can be quoted.
_CUTS = re.compile(r"[/?#:@]")
# Shorter pieces are left: masking every "0" or "db" would garble messages for 2 characters.
_MIN_PIECE = 3


def _split(url: str) -> tuple[str, str, str] | None:
    """(`scheme://`, userinfo, the rest) as written, or None without userinfo.

    The userinfo runs to the *last* '@': `urlsplit` stops reading it at the first '/', '?'
    or '#', so a password holding one of those would otherwise be taken for a host or path
    and quoted in error messages. An '@' later in a path or query masks more than needed.
    """
    head = _SCHEME.match(url)
    if head is None:
        return None
    rest = url[head.end() :]
    if not rest or rest[0] in "/?#":  # no authority (`file:///...`, `memory://?...`)
        return None
    userinfo, at, host = rest.rpartition("@")
    if not at:
        return None
    return head.group(0), userinfo, host


def url_secrets(url: str) -> list[str]:
    """The texts of `url` that may be a credential, longest first, as written and decoded.

    The password (or, without one, the user part, which is then a token) and its pieces.
    """
    parts = _split(url)
    if parts is None:
        return []
    userinfo = parts[1]
    user, colon, password = userinfo.partition(":")
    secret = password if colon else user
    found: set[str] = set()
    for text in (userinfo, secret, *_CUTS.split(secret)):
        for form in (text, unquote(text)):
            if len(form) >= _MIN_PIECE or (form and form == secret):
                found.add(form)
    return sorted(found, key=len, reverse=True)


def scrub_secrets(text: str, url: str) -> str:
    """`text` with every credential of `url` (see `url_secrets`) replaced by ``***``."""
    for secret in url_secrets(url):
        text = text.replace(secret, "***")
    return text


def mask_userinfo(url: str) -> str:
    """`url` with its whole userinfo replaced by ``***``, for quoting it in messages."""
    parts = _split(url)
    if parts is None:
        return url
    head, _, host = parts
    return f"{head}***@{host}"
