"""Keeping the credentials of a storage URL out of messages, however the URL is written."""

from __future__ import annotations

import bisect
import re
from urllib.parse import unquote

__all__ = ["mask_userinfo", "scrub_secrets", "url_secrets"]

_SCHEME = re.compile(r"^\s*[A-Za-z][A-Za-z0-9+.-]*://")
# A URL inside this one (a query parameter's value, such as a metadata server's): its
# userinfo is as secret. A scheme starts only where a run of scheme characters starts.
_NESTED = re.compile(r"(?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]*://")
# An authority without userinfo, as it must be written: a host (a name, an address or an
# [IP literal]) and an optional port of digits.
_HOST_PORT = re.compile(r"(?:\[[0-9A-Za-z:.%_~-]*\]|[A-Za-z0-9._~!$&'()*+,;=%-]+)(?::[0-9]*)?")
# Where a parser may cut a password that was not percent-encoded; each piece can be quoted.
_CUTS = re.compile(r"[/?#:@]")
# Shorter pieces are left: masking every "0" or "db" would garble messages for 2 characters.
_MIN_PIECE = 3


def _userinfo_spans(url: str) -> list[tuple[int, int]]:
    """[start, end) of the userinfo of `url` and of each URL nested in it, in order.

    The userinfo runs to the last '@' of the authority, which the first '/', '?' or '#'
    ends: an '@' after it (in a path, a query or a fragment) is kept. An authority that is
    no host[:port] and has no '@', in a URL with an '@' further on, is a password holding an
    unescaped '/', '?' or '#' (where `urlsplit` stops reading it, so that it would be taken
    for a host or a path and quoted in error messages): that userinfo runs to the URL's
    last '@'. Linear in the URL's length, however many URLs it nests.
    """
    head = _SCHEME.match(url)
    if head is None:
        return []
    # Positions found once: each URL's authority is then found by bisection.
    ends = [i for i, c in enumerate(url) if c in "/?#"]
    ats = [i for i, c in enumerate(url) if c == "@"]
    spans: list[tuple[int, int]] = []
    start = head.end()
    while True:
        after = start
        if start < len(url) and url[start] not in "/?#":  # else no authority (`file:///`)
            cut = bisect.bisect_left(ends, start)
            end = ends[cut] if cut < len(ends) else len(url)
            last = bisect.bisect_left(ats, end) - 1  # the last '@' before `end`
            if last >= 0 and ats[last] >= start:
                spans.append((start, ats[last]))
                after = ats[last] + 1
            elif ats and ats[-1] > end and not _HOST_PORT.fullmatch(url, start, end):
                spans.append((start, ats[-1]))
                after = ats[-1] + 1
        found = _NESTED.search(url, after)
        if found is None:
            return spans
        start = found.end()


def url_secrets(url: str) -> list[str]:
    """The texts of `url` that may be a credential, longest first, as written and decoded.

    The password (or, without one, the user part, which is then a token) and its pieces, of
    `url` and of any URL nested in it.
    """
    found: set[str] = set()
    for start, end in _userinfo_spans(url):
        userinfo = url[start:end]
        user, colon, password = userinfo.partition(":")
        secret = password if colon else user
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
    """`url` with each userinfo (its own, and that of a URL nested in it) replaced by
    ``***``, for quoting it in messages; everything else is kept as written."""
    parts: list[str] = []
    kept = 0
    for start, end in _userinfo_spans(url):
        parts += (url[kept:start], "***")
        kept = end
    parts.append(url[kept:])
    return "".join(parts)
