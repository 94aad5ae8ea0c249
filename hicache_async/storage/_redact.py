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


# A host as a URL writes it: a name or IPv4 address, or an IPv6 address in brackets, then an
# optional port.
_HOST = re.compile(r"(?:\[[0-9A-Za-z:.%]+\]|[A-Za-z0-9._~%-]+)(?::[0-9]*)?")
# Parameters that name a credential (as the admin API's redaction has them): an '@' in one
# of their values may be part of it, so it keeps the wider reading.
_SECRET_NAMES = frozenset(
    (
        "password",
        "passwd",
        "pwd",
        "secret",
        "token",
        "api_key",
        "apikey",
        "access_key",
        "secret_key",
    )
)
# A query of `name=value` parameters; a value may hold an '@' (`?name=a@b`).
_PARAMS = re.compile(r"[^=&;@/?#]+=[^&;#]*(?:[&;][^=&;@/?#]+=[^&;#]*)*")


def _data_at(rest: str, at: int) -> bool:
    """Whether the '@' at `rest[at]` is data of a query or fragment rather than a userinfo's end.

    Only where the URL reads as written up to there: its authority (to the first '/', '?' or
    '#') ends in a valid host, the '@' lies in a `name=value` query (not of a parameter
    named as a credential, `password=`), or in a fragment after
    a URL whose every '@' is such data, and no `://` comes between the host and the '@' (a
    URL given as a parameter may hold credentials). A password holding '?' or '#' leaves an
    authority without a valid host or a query that is not parameters, so its '@' still ends
    the userinfo.
    """
    end = next((i for i, c in enumerate(rest) if c in "/?#"), len(rest))
    if at < end or _HOST.fullmatch(rest[:end].rpartition("@")[2]) is None:
        return False
    query = rest.find("?", end)
    fragment = rest.find("#", end)
    if "://" in rest[end:at]:
        return False  # a URL in a parameter (`admin=http://user:pw@host`): its userinfo
    if 0 <= fragment < at:
        return all(_data_at(rest, i) for i, c in enumerate(rest[:fragment]) if c == "@")
    if query < 0 or query > at or (0 <= fragment < query):
        return False
    stop = fragment if fragment > query else len(rest)
    if at >= stop or _PARAMS.fullmatch(rest[query + 1 : stop]) is None:
        return False
    start = max(rest.rfind("&", query, at), rest.rfind(";", query, at), query) + 1
    return rest[start:at].partition("=")[0].lower() not in _SECRET_NAMES


def _split(url: str) -> tuple[str, str, str] | None:
    """(`scheme://`, userinfo, the rest) as written, or None without userinfo.

    The userinfo runs to the last '@' that is not data of a query or fragment (see
    `_data_at`): `urlsplit` stops reading it at the first '/', '?' or '#', so a password
    holding one of those would otherwise be taken for a host or path and quoted in error
    messages. An '@' in a path still masks up to it: `host/a@b` cannot be told from a
    password `a` with a '/' in its user part.
    """
    head = _SCHEME.match(url)
    if head is None:
        return None
    rest = url[head.end() :]
    if not rest or rest[0] in "/?#":  # no authority (`file:///...`, `memory://?...`)
        return None
    at = len(rest)
    while True:
        at = rest.rfind("@", 0, at)
        if at < 0:
            return None
        if not _data_at(rest, at):
            return head.group(0), rest[:at], rest[at + 1 :]


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
