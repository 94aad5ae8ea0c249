"""Keeping the credentials of a storage URL out of messages, however the URL is written."""

from __future__ import annotations

import re
from urllib.parse import unquote, unquote_plus

__all__ = ["mask_userinfo", "scrub_secrets", "url_secrets"]

_SCHEME = re.compile(r"^\s*[A-Za-z][A-Za-z0-9+.-]*://")
# Where a parser may cut a password that was not percent-encoded; each piece can be quoted.
_CUTS = re.compile(r"[/?#:@]")
# Shorter pieces are left: masking every "0" or "db" would garble messages for 2 characters.
_MIN_PIECE = 3


# A host as a URL writes it: a name or IPv4 address, or an IPv6 address in brackets, then an
# optional port of at least one digit (`user:` before a password that begins with '?' or '#'
# is no host).
_HOST = re.compile(r"(?:\[[0-9A-Za-z:.%]+\]|[A-Za-z0-9._~%-]+)(?::[0-9]+)?")
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
# A query of `name=value` parameters, as names and values are written; a value may hold an
# '@' (`?name=a@b`). A password with '?' seldom reads as one: its name would have to be a
# word and no value could hold a '?', a space or a quote.
_NAME_VALUE = r"[A-Za-z0-9._~%+-]+=[^&;#?\s'\"<>]*"
_PARAMS = re.compile(rf"{_NAME_VALUE}(?:[&;]{_NAME_VALUE})*")


def _data_at(rest: str, at: int) -> bool:
    """Whether the '@' at `rest[at]` is data of a query rather than a userinfo's end.

    Only where the URL reads as written up to there: its authority (to the first '/', '?' or
    '#') ends in a valid host, the '@' lies in a `name=value` query (not of a parameter
    named as a credential, `password=`) before any '#', and no `//` comes between the host
    and the '@', as written or decoded (a URL given as a parameter may hold credentials). A
    password holding '?' leaves an authority without a valid host or a query that is not
    parameters, so its '@' still ends the userinfo. An '@' after a '#' always does: no
    built-in backend takes a fragment, and a password may begin with '#' (`user:#pw@host`).
    """
    end = next((i for i, c in enumerate(rest) if c in "/?#"), len(rest))
    if at < end or _HOST.fullmatch(rest[:end].rpartition("@")[2]) is None:
        return False
    query = rest.find("?", end)
    fragment = rest.find("#", end)
    if "//" in unquote_plus(rest[end:at]):
        return False  # a URL in a parameter (`admin=http://user:pw@host`): its userinfo
    if 0 <= fragment < at or query < 0 or query > at:
        return False
    stop = fragment if fragment > query else len(rest)
    if _PARAMS.fullmatch(rest[query + 1 : stop]) is None:
        return False
    start = max(rest.rfind("&", query, at), rest.rfind(";", query, at), query) + 1
    return unquote_plus(rest[start:at].partition("=")[0]).lower() not in _SECRET_NAMES


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


# A query parameter as written: its name, then its value up to the next '&', ';' or '#'.
_PARAM = re.compile(r"(?P<name>[^=&;#?]+)=(?P<value>[^&;#]*)")


def _secret_values(url: str) -> list[tuple[str, str]]:
    """(value as written, value decoded) of each query parameter that may hold a credential:
    one named as a credential (`password=`), or a URL with a userinfo of its own, written
    plainly or percent-encoded (`metadata=http%3A%2F%2Fuser%3Apw%40host`)."""
    query = url.partition("?")[2].partition("#")[0]
    found = []
    for match in _PARAM.finditer(query):
        value = match.group("value")
        decoded = unquote_plus(value)
        if unquote_plus(match.group("name")).strip().lower() in _SECRET_NAMES or (
            decoded != url and _split(decoded) is not None
        ):
            found.append((value, decoded))
    return found


def url_secrets(url: str) -> list[str]:
    """The texts of `url` that may be a credential, longest first, as written and decoded.

    The password (or, without one, the user part, which is then a token) and its pieces, and
    the credentials of query parameters (see `_secret_values`).
    """
    found: set[str] = set()
    for value, decoded in _secret_values(url):
        found.update(form for form in (value, decoded) if form)
        found.update(url_secrets(decoded) if decoded != url else ())
    parts = _split(url)
    if parts is None:
        return sorted(found, key=len, reverse=True)
    userinfo = parts[1]
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


def _mask_values(text: str) -> str:
    """`text` with the value of each query parameter that may hold a credential as ``***``."""
    head, mark, query = text.partition("?")
    if not mark:
        return text
    query, hash_mark, fragment = query.partition("#")
    risky = {value for value, _ in _secret_values(text)}

    def masked(match: re.Match[str]) -> str:
        value = match.group("value")
        return f"{match.group('name')}=***" if value and value in risky else match.group(0)

    return f"{head}?{_PARAM.sub(masked, query)}{hash_mark}{fragment}"


def mask_userinfo(url: str) -> str:
    """`url` with its whole userinfo replaced by ``***``, for quoting it in messages, and
    the values of query parameters that may hold a credential (`password=`, a URL with a
    userinfo of its own) too."""
    parts = _split(url)
    if parts is None:
        return _mask_values(url)
    head, _, host = parts
    return f"{head}***@{_mask_values(host)}"
