"""ASGI plumbing for the admin app: typed errors, JSON responses, bounded bodies, redaction."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

import anyio
import msgspec

from ..storage._redact import scrub_secrets

__all__ = [
    "ClientDisconnected",
    "HTTPError",
    "Message",
    "ResponseNotRead",
    "Receive",
    "Scope",
    "Send",
    "header",
    "is_json",
    "read_body",
    "redact",
    "redact_tree",
    "send_error",
    "send_response",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# Admin responses describe live infrastructure: never cache them, never sniff them.
_COMMON_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"cache-control", b"no-store"),
    (b"x-content-type-options", b"nosniff"),
)

# `scheme://userinfo@` anywhere in a message: the userinfo may hold a password or a token.
# A scheme starts only where a run of scheme characters starts: otherwise every position of
# a long run would be tried, in time quadratic in the message's length.
_USERINFO = re.compile(r"(?<![A-Za-z0-9+.-])(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^\s/@'\"<>]+@")
# `password=...` style query parameters (a plugin URL may carry its credentials that way).
_SECRET_PARAM = re.compile(
    r"(?P<name>\b(?:password|passwd|pwd|secret|token|api_key|apikey|access_key|secret_key)=)"
    r"[^&\s'\"<>]*",
    re.IGNORECASE,
)


class HTTPError(Exception):
    """An error response: `{"error": code, "detail": detail}` with `status`."""

    def __init__(
        self,
        status: int,
        code: str,
        detail: str,
        *,
        headers: Iterable[tuple[bytes, bytes]] = (),
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.code = code
        self.detail = detail
        self.headers = tuple(headers)


class ClientDisconnected(Exception):
    """The client went away before its request body arrived; nobody is left to answer."""


class ResponseNotRead(Exception):
    """The client did not take a response within the send bound; it was given up."""


class _ErrorBody(msgspec.Struct, frozen=True):
    error: str
    detail: str


def redact(text: str, *, url: str | None = None) -> str:
    """`text` without URL credentials, and without any part of `url`'s userinfo."""
    if url:
        # A backend's own message may quote the secret outside of a URL, or a piece of it
        # when an unescaped '/', '?' or '#' in the password made it look like a host or path.
        text = scrub_secrets(text, url)
    text = _USERINFO.sub(r"\g<scheme>***@", text)
    return _SECRET_PARAM.sub(r"\g<name>***", text)


def redact_tree(value: Any) -> Any:
    """Every string in a JSON-like tree (dicts, lists) passed through `redact`."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {key: redact_tree(item) for key, item in value.items()}
    if isinstance(value, list):
        return [redact_tree(item) for item in value]
    return value


def header(scope: Scope, name: bytes) -> list[bytes]:
    """Every value of the request header `name` (lower case), in order."""
    return [value for key, value in scope.get("headers", ()) if key.lower() == name]


def is_json(content_type: bytes) -> bool:
    """`application/json` or `application/<something>+json`, parameters ignored."""
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or (
        media.startswith(b"application/") and media.endswith(b"+json")
    )


async def read_body(scope: Scope, receive: Receive, limit: int, timeout_s: float) -> bytes:
    """The request body, refused with 413 as soon as it exceeds `limit` bytes, and with 408
    unless all of it arrives within `timeout_s` seconds.

    A declared `Content-Length` over the limit is refused before reading anything; otherwise
    chunks are taken one at a time and the first one that would cross the limit is dropped,
    so at most `limit` bytes are ever held.
    """
    # No `Connection: close`: closing with body bytes still arriving resets the connection
    # before the client reads the 413; the server discards the rest of the body instead.
    too_large = HTTPError(
        413, "payload_too_large", f"the request body is larger than {limit} bytes"
    )
    lengths = header(scope, b"content-length")
    if lengths:
        try:
            declared = int(lengths[0])
        except ValueError:
            raise HTTPError(400, "bad_request", "Content-Length is not an integer") from None
        if declared > limit:
            raise too_large
    body = bytearray()
    # A client that stalls its body would otherwise hold the connection (and a file
    # descriptor) for as long as it likes.
    with anyio.move_on_after(timeout_s):
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnected
            chunk: bytes = message.get("body", b"")
            if len(body) + len(chunk) > limit:
                raise too_large
            body += chunk
            if not message.get("more_body", False):
                return bytes(body)
    # The rest of the body may still come: close rather than read it as the next request.
    raise HTTPError(
        408,
        "request_timeout",
        f"the request body did not arrive within {timeout_s:g} s",
        headers=[(b"connection", b"close")],
    )


async def send_response(
    send: Send,
    status: int,
    body: bytes,
    content_type: bytes,
    headers: Iterable[tuple[bytes, bytes]] = (),
    *,
    timeout_s: float,
) -> None:
    """One complete response with `Content-Type` and `Content-Length` set; `ResponseNotRead`
    unless the server took all of it within `timeout_s` seconds.

    A server waits for the client to read before it takes more (flow control): a client that
    pipelines requests and never reads would hold the connection, and a graceful shutdown
    waiting for it, for as long as it likes. Given up, the response stays incomplete: a server
    closes the connection then (uvicorn first tries a 500 if no header went out).
    """
    with anyio.move_on_after(timeout_s):
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", content_type),
                    (b"content-length", str(len(body)).encode()),
                    *_COMMON_HEADERS,
                    *headers,
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
        return
    raise ResponseNotRead(f"the response was not taken within {timeout_s:g} s")


async def send_error(send: Send, error: HTTPError, *, timeout_s: float) -> None:
    """`error` as its JSON body, with any URL credential in the detail removed."""
    body = msgspec.json.encode(_ErrorBody(error.code, redact(error.detail)))
    await send_response(
        send, error.status, body, b"application/json", error.headers, timeout_s=timeout_s
    )
