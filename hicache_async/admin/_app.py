"""The admin ASGI application: attach, detach and inspect storage; Prometheus metrics."""

from __future__ import annotations

import asyncio
import hmac
import math
import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import anyio
import msgspec
import structlog

from .._errors import CacheClosedError, HiCacheError, StorageConfigError
from .._numbers import as_float
from .._ratelog import LogLimiter
from ..storage import ENTRY_POINT_GROUP, StorageBackend, StorageError, storage_schemes
from ..workers import StorageStatus
from ._dispatch import CacheLoop
from ._http import (
    ClientDisconnected,
    HTTPError,
    Receive,
    ResponseNotRead,
    Scope,
    Send,
    header,
    is_json,
    read_body,
    redact,
    redact_tree,
    send_error,
    send_response,
)

if TYPE_CHECKING:
    from .._cache import HiCache

__all__ = ["AdminApp", "AttachRequest", "DetachRequest"]

_log = structlog.get_logger("hicache_async")

STORAGE_PATH = "/hicache/storage-backend"
METRICS_PATH = "/metrics"

_JSON = b"application/json"
_METRICS_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
_REALM = b'Bearer realm="hicache-admin"'
# Never a real page key (those are hashes), so the probe reads nothing and writes nothing.
_PROBE_KEY = bytes(32)
_SCHEME_URL = re.compile(r"^\s*(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://")

S = TypeVar("S", bound=msgspec.Struct)


class AttachRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The body of ``PUT /hicache/storage-backend``."""

    url: str
    #: Detach (flushing) whatever is attached first, instead of answering 409.
    replace: bool = False


class DetachRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The (optional) body of ``DELETE /hicache/storage-backend``."""

    #: Write pending backups (within `backup.flush_deadline_s`) before closing, or drop them.
    flush: bool = True


class _Attaching:
    """An attach this app is running: a DELETE that comes before it ends cancels it."""

    __slots__ = ("cancelled", "scope")

    def __init__(self) -> None:
        self.cancelled = False
        # Bounds the open, the attach and the lookup; None outside them.
        self.scope: anyio.CancelScope | None = None

    def cancel(self) -> None:
        self.cancelled = True
        if self.scope is not None:
            self.scope.cancel()


class _Response(NamedTuple):
    status: int
    body: bytes
    content_type: bytes


_Handler = Callable[[Scope, Receive], Awaitable[_Response]]


def _json(status: int, value: msgspec.Struct) -> _Response:
    # Backend names are meant to be credential-free; redacting again costs little.
    body = msgspec.json.encode(redact_tree(msgspec.to_builtins(value)))
    return _Response(status, body, _JSON)


def _decode(body: bytes, kind: type[S]) -> S:
    if not body.strip():
        raise HTTPError(400, "invalid_json", "a JSON object is required as the request body")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise HTTPError(400, "invalid_request", str(exc)) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise HTTPError(400, "invalid_json", str(exc)) from None


def _check_seconds(name: str, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 < as_float(value) < math.inf
    ):
        raise ValueError(f"{name} must be a positive finite number of seconds, got {value!r}")


def _client(scope: Scope) -> str | None:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else None


def _describe(exc: BaseException, name: str) -> str:
    """`exc` as a short detail, never empty: an exception without text names its type."""
    # Backends prefix their errors with their name, which the caller quotes already.
    text = str(exc).strip().removeprefix(f"{name}:").strip()
    if text and not text.endswith(":"):
        return text
    # No text, or a wrapper whose cause had none ("exists failed: "): say what was raised.
    cause = exc.__cause__
    what = repr(cause) if cause is not None else type(exc).__name__
    return f"{text} {what}" if text else what


async def _probe(backend: StorageBackend) -> str | None:
    """Why `backend` cannot serve requests, or None when it answered a lookup."""
    try:
        await backend.exists([_PROBE_KEY])
    except Exception as exc:
        return _describe(exc, backend.name)
    return None


class AdminApp:
    """An ASGI application to manage a `HiCache`'s storage at run time and scrape metrics.

    Routes (under `path_prefix`), all behind ``Authorization: Bearer <token>``:

    - ``GET /hicache/storage-backend``: the storage status as JSON.
    - ``PUT /hicache/storage-backend`` with ``{"url": ..., "replace": false}``: attach.
    - ``DELETE /hicache/storage-backend`` with an optional ``{"flush": true}``: detach.
    - ``GET /metrics``: the Prometheus text exposition.

    A ``PUT`` must open and check its backend within `attach_timeout_s` seconds, or it is
    closed again and the answer is 504. Changes are serialised; a ``DELETE`` cancels the
    attaches of ``PUT`` requests that came before it (closed again, 409 `attach_cancelled`)
    instead of waiting for them to open. A request body must arrive within `body_timeout_s`
    seconds (408 otherwise), and each response must be taken within `send_timeout_s` seconds
    (a client that does not read has that response given up, left incomplete).

    Errors are ``{"error": code, "detail": message}``. The app may run on any event loop:
    cache calls are handed to the cache's loop when the server's loop is another one.
    """

    def __init__(
        self,
        cache: HiCache,
        *,
        token: str | bytes,
        max_body_bytes: int = 64 * 1024,
        path_prefix: str = "",
        attach_timeout_s: float = 30.0,
        body_timeout_s: float = 30.0,
        send_timeout_s: float = 30.0,
    ) -> None:
        if isinstance(token, str):
            token = token.encode()
        if not isinstance(token, bytes):
            raise TypeError(f"token must be str or bytes, got {type(token).__name__}")
        if not token:
            raise ValueError("token must not be empty")
        if any(byte <= 0x20 or byte == 0x7F for byte in token):
            raise ValueError("token must not contain whitespace or control characters")
        if not isinstance(max_body_bytes, int) or max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be a positive integer, got {max_body_bytes!r}")
        _check_seconds("attach_timeout_s", attach_timeout_s)
        _check_seconds("body_timeout_s", body_timeout_s)
        _check_seconds("send_timeout_s", send_timeout_s)
        prefix = path_prefix.rstrip("/")
        if prefix and not prefix.startswith("/"):
            raise ValueError(f"path_prefix must start with '/', got {path_prefix!r}")
        self._cache: HiCache = cache
        self._max_body_bytes = max_body_bytes
        self._path_prefix = prefix
        self._attach_timeout_s = float(attach_timeout_s)
        self._body_timeout_s = float(body_timeout_s)
        self._send_timeout_s = float(send_timeout_s)
        self._token = token
        self._loop = CacheLoop(cache)
        # Serialises admin changes on the cache's loop: check, detach, attach, probe.
        self._lock = asyncio.Lock()
        # Attaches under way or waiting for the lock, for a DELETE to cancel.
        self._attaching: set[_Attaching] = set()
        self._refusals = LogLimiter()
        self._refusals_flush: asyncio.TimerHandle | None = None
        self._routes: dict[str, dict[str, _Handler]] = {
            STORAGE_PATH: {
                "GET": self._get_storage,
                "PUT": self._put_storage,
                "DELETE": self._delete_storage,
            },
            METRICS_PATH: {"GET": self._get_metrics},
        }

    # Read-only: checked above once, and the app is bound to this cache's loop (`_loop`).
    @property
    def cache(self) -> HiCache:
        """The cache the app administers."""
        return self._cache

    @property
    def max_body_bytes(self) -> int:
        """The largest request body taken."""
        return self._max_body_bytes

    @property
    def path_prefix(self) -> str:
        """The prefix the routes are served under, without its trailing `/`."""
        return self._path_prefix

    @property
    def attach_timeout_s(self) -> float:
        """Seconds a `PUT` has to open and check its backend."""
        return self._attach_timeout_s

    @property
    def body_timeout_s(self) -> float:
        """Seconds a request body has to arrive."""
        return self._body_timeout_s

    @property
    def send_timeout_s(self) -> float:
        """Seconds a response has to be taken."""
        return self._send_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI entry point (``http`` and ``lifespan`` scopes; websockets are refused)."""
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)
        elif kind == "websocket":
            await receive()  # websocket.connect
            await send({"type": "websocket.close", "code": 1008})
        else:
            raise ValueError(f"unsupported ASGI scope type {kind!r}")

    # -- protocol ---------------------------------------------------------------------------

    @staticmethod
    async def _lifespan(receive: Receive, send: Send) -> None:
        # The app owns nothing: the host creates, enters and closes the cache.
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._answer(scope, receive, send)
        except ResponseNotRead:
            # Returning with the response incomplete: the server closes the connection.
            _log.warning(
                "hicache.admin.response_not_read",
                path=scope.get("path"),
                client=_client(scope),
                send_timeout_s=self._send_timeout_s,
            )

    async def _answer(self, scope: Scope, receive: Receive, send: Send) -> None:
        timeout_s = self._send_timeout_s
        try:
            self._authorize(scope)
            handler = self._route(scope)
            response = await handler(scope, receive)
        except ClientDisconnected:
            return
        except HTTPError as error:
            await send_error(send, error, timeout_s=timeout_s)
            return
        except CacheClosedError as exc:
            await send_error(
                send, HTTPError(503, "cache_unavailable", str(exc)), timeout_s=timeout_s
            )
            return
        except Exception:
            _log.exception(
                "hicache.admin.failed",
                method=scope.get("method"),
                path=scope.get("path"),
                client=_client(scope),
            )
            await send_error(
                send,
                HTTPError(500, "internal_error", "the request failed; see the server log"),
                timeout_s=timeout_s,
            )
            return
        await send_response(
            send, response.status, response.body, response.content_type, timeout_s=timeout_s
        )

    def _authorize(self, scope: Scope) -> None:
        values = header(scope, b"authorization")
        scheme, _, credentials = values[0].strip().partition(b" ") if values else (b"", b"", b"")
        if scheme.lower() != b"bearer":
            # No bearer credentials at all (no header, or Basic and the like): RFC 6750 gives
            # such a request the challenge without an error code, which is for a bad token.
            self._log_refusal(scope)
            raise HTTPError(
                401,
                "unauthorized",
                "an 'Authorization: Bearer <token>' header is required",
                headers=[(b"www-authenticate", _REALM)],
            )
        presented = credentials.strip()
        # Constant time in the token's content: timing reveals at most its length.
        valid = hmac.compare_digest(presented, self._token)
        if not valid or len(values) != 1:
            self._log_refusal(scope)
            raise HTTPError(
                401,
                "unauthorized",
                "the bearer token is not valid",
                headers=[(b"www-authenticate", _REALM + b', error="invalid_token"')],
            )

    def _log_refusal(self, scope: Scope) -> None:
        # Anyone who reaches the port can send refused requests as fast as the server answers:
        # one line each would flood the log. Per peer host (its port changes per connection),
        # the first is told at once and the others once a minute, with how many were left out.
        client = scope.get("client")
        peer = str(client[0]) if client else ""
        unlogged = self._refusals.admit("hicache.admin.unauthorized", peer)
        if unlogged is not None:
            _log.warning(
                "hicache.admin.unauthorized",
                path=scope.get("path"),
                client=_client(scope),
                unlogged_since_last=unlogged,
            )
        elif self._refusals_flush is None:
            # Left for the peer's next line, refusals after its last one would go untold when
            # it stops there: a burst of guesses would show as one line.
            self._refusals_flush = asyncio.get_running_loop().call_later(
                self._refusals.interval_s, self._flush_refusals
            )

    def _flush_refusals(self) -> None:
        """Log, for each peer, the refusals left out since its last line once that line is
        `interval_s` old."""
        self._refusals_flush = None
        due, waiting = self._refusals.take_due("hicache.admin.unauthorized")
        for peer, unlogged in due:
            _log.warning(
                "hicache.admin.unauthorized", client=peer or None, unlogged_since_last=unlogged
            )
        if waiting:
            self._refusals_flush = asyncio.get_running_loop().call_later(
                self._refusals.interval_s, self._flush_refusals
            )

    def _route(self, scope: Scope) -> _Handler:
        path: str = scope["path"]
        methods = self._routes.get(self._local_path(scope) or "")
        if methods is None:
            raise HTTPError(404, "not_found", f"no admin route at {path!r}")
        handler = methods.get(scope["method"])
        if handler is None:
            allow = ", ".join(sorted(methods))
            raise HTTPError(
                405,
                "method_not_allowed",
                f"{path} accepts {allow}, not {scope['method']}",
                headers=[(b"allow", allow.encode())],
            )
        return handler

    def _local_path(self, scope: Scope) -> str | None:
        path: str = scope["path"]
        root: str = scope.get("root_path", "")
        # Servers and routers disagree on whether `path` still starts with `root_path`.
        candidates = [path[len(root) :], path] if root and path.startswith(root) else [path]
        for candidate in candidates:
            if candidate.startswith(self._path_prefix):
                local = candidate[len(self._path_prefix) :]
                if local in self._routes:
                    return local
        return None

    # -- routes -----------------------------------------------------------------------------

    async def _get_storage(self, scope: Scope, receive: Receive) -> _Response:
        status = await self._loop.call(self._cache.storage_status)
        return _json(200, status)

    async def _put_storage(self, scope: Scope, receive: Receive) -> _Response:
        try:
            return await self._attach_from(scope, receive)
        except HTTPError as error:
            # Refused changes are audited like accepted ones and failed tokens.
            _log.warning(
                "hicache.admin.storage.refused",
                status=error.status,
                error=error.code,
                detail=redact(error.detail),
                client=_client(scope),
            )
            raise

    async def _attach_from(self, scope: Scope, receive: Receive) -> _Response:
        content_type = header(scope, b"content-type")
        if not content_type or not is_json(content_type[0]):
            raise HTTPError(
                415, "unsupported_media_type", "the request body must be application/json"
            )
        body = await read_body(scope, receive, self._max_body_bytes, self._body_timeout_s)
        request = _decode(body, AttachRequest)
        scheme = _SCHEME_URL.match(request.url)
        # Off the loop: the entry-point scan reads every installed distribution's metadata.
        schemes = await anyio.to_thread.run_sync(storage_schemes)
        if scheme is None or scheme.group("scheme").lower() not in schemes:
            # Import-path plugins (`package.module:factory`) would let a token import and call
            # arbitrary code; they can be configured at start-up, not over HTTP. Said here,
            # as `open_storage`'s own message lists them among the accepted forms.
            shown = repr(redact(request.url, url=request.url))
            raise HTTPError(
                400,
                "invalid_storage_url",
                (
                    "the admin API accepts scheme:// URLs only"
                    if scheme is None
                    else f"unknown storage scheme {scheme.group('scheme')!r}"
                )
                + f" in {shown}; accepted: "
                + ", ".join(f"{name}://" for name in schemes)
                + f" (built in or installed as an entry point in group {ENTRY_POINT_GROUP!r})",
            )
        client = _client(scope)
        status, replaced = await self._loop.run(lambda: self._attach(request, client))
        _log.info(
            "hicache.admin.storage.attached",
            backend=status.backend,
            replaced=replaced,
            client=client,
        )
        return _json(200, status)

    async def _delete_storage(self, scope: Scope, receive: Receive) -> _Response:
        body = await read_body(scope, receive, self._max_body_bytes, self._body_timeout_s)
        request = DetachRequest()
        if body.strip():
            content_type = header(scope, b"content-type")
            if not content_type or not is_json(content_type[0]):
                raise HTTPError(
                    415, "unsupported_media_type", "a request body must be application/json"
                )
            request = _decode(body, DetachRequest)
        status, detached = await self._loop.run(lambda: self._detach(request.flush))
        if detached is not None:
            _log.info(
                "hicache.admin.storage.detached",
                backend=detached,
                flush=request.flush,
                client=_client(scope),
            )
        return _json(200, status)

    async def _get_metrics(self, scope: Scope, receive: Receive) -> _Response:
        text = await self._loop.call(self._cache.metrics_text)
        return _Response(200, text.encode(), _METRICS_TYPE)

    # -- on the cache's loop ----------------------------------------------------------------

    def _open_backend(self, url: str) -> StorageBackend:
        try:
            # Set up as the cache would (its MAC key): pages are signed and checked alike.
            return self._cache.open_storage(url)
        except (StorageConfigError, ValueError, TypeError) as exc:
            raise HTTPError(400, "invalid_storage_url", redact(str(exc), url=url)) from None
        except Exception as exc:
            raise HTTPError(
                502, "storage_unreachable", redact(f"cannot create the backend: {exc}", url=url)
            ) from None

    async def _attach(
        self, request: AttachRequest, client: str | None
    ) -> tuple[StorageStatus, str | None]:
        """Attach `request.url` (replacing when asked); the status and what was replaced."""
        attaching = _Attaching()
        self._attaching.add(attaching)
        try:
            return await self._attach_locked(request, client, attaching)
        finally:
            self._attaching.discard(attaching)

    async def _attach_locked(
        self, request: AttachRequest, client: str | None, attaching: _Attaching
    ) -> tuple[StorageStatus, str | None]:
        cache = self._cache
        async with self._lock:
            # A bad URL is a 400 whatever is attached; the backend is only constructed here.
            backend = self._open_backend(request.url)
            current = cache.storage_status()
            if current.attached and not request.replace:
                await backend.close()
                raise HTTPError(
                    409,
                    "storage_attached",
                    f"storage {current.backend!r} is attached; detach it first or send "
                    '"replace": true',
                )
            replaced = current.backend if current.attached else None
            lost = f"; {replaced!r} was detached first, so nothing is attached" if replaced else ""
            opened = False
            problem: str | None = None
            try:
                if replaced is not None:
                    await cache.detach_storage(flush=True)
                    # Logged now: if the new backend fails, nothing else says the old is gone.
                    _log.info(
                        "hicache.admin.storage.detached",
                        backend=replaced,
                        flush=True,
                        client=client,
                    )
                # One bound for opening, attaching and checking: a backend that never answers
                # (a URL `timeout`, connection retries) must not hold the lock DELETE waits on.
                # A DELETE cancels the same scope: the open gives way as it does to the bound.
                with anyio.move_on_after(self._attach_timeout_s) as deadline:
                    attaching.scope = deadline
                    if not attaching.cancelled:  # else a DELETE came while waiting or replacing
                        await cache.attach_storage(backend)
                        opened = True
                        problem = await _probe(backend)
            except BaseException as exc:
                if opened:
                    raise
                # Never entered, or entered and closed again by the cache: close() is a no-op
                # then, but a backend that failed half-way must not keep its threads.
                with anyio.CancelScope(shield=True):
                    await backend.close()
                if not isinstance(exc, Exception):
                    raise
                raise self._attach_error(exc, backend.name, request.url, lost) from None
            finally:
                attaching.scope = None
            if deadline.cancelled_caught or attaching.cancelled:
                if opened:
                    await cache.detach_storage(flush=False)
                else:
                    # Cancelled inside the open: the cache let go of it; close what is left.
                    with anyio.CancelScope(shield=True):
                        await backend.close()
                if attaching.cancelled:
                    raise HTTPError(
                        409,
                        "attach_cancelled",
                        redact(
                            f"storage {backend.name!r} was not attached: a DELETE came before it "
                            f"was{lost}",
                            url=request.url,
                        ),
                    )
                raise HTTPError(
                    504,
                    "storage_timeout",
                    redact(
                        f"storage {backend.name!r} did not open and answer within "
                        f"{self._attach_timeout_s:g} s, so it was not attached{lost}",
                        url=request.url,
                    ),
                )
            if problem is not None:
                await cache.detach_storage(flush=False)
                raise HTTPError(
                    502,
                    "storage_unreachable",
                    redact(
                        f"storage {backend.name!r} is unreachable, so it was not attached "
                        f"({problem}){lost}",
                        url=request.url,
                    ),
                )
            return cache.storage_status(), replaced

    def _attach_error(self, exc: Exception, name: str, url: str, lost: str) -> HTTPError:
        if isinstance(exc, CacheClosedError):
            return HTTPError(503, "cache_unavailable", str(exc))
        closed = self._loop.closed_state()
        if closed is not None:
            # The close detached the backend while it was opening: the storage is not at fault.
            detail = f"the cache is {closed}, so storage {name!r} was not attached{lost}"
            return HTTPError(503, "cache_unavailable", redact(detail, url=url))
        if isinstance(exc, StorageConfigError) and not lost:
            return HTTPError(400, "invalid_storage_url", redact(str(exc), url=url))
        # Refused only once the old backend was detached (a file root that cannot be made):
        # 502 with what was lost, as for any other failure after the detach.
        status = self._cache.storage_status()
        if (
            isinstance(exc, HiCacheError)
            and not isinstance(exc, StorageError)
            and (status.attached or status.opening)
        ):
            # Attached (or being attached) by someone other than this app in the meantime.
            return HTTPError(409, "storage_attached", str(exc))
        detail = f"cannot open storage {name!r} ({_describe(exc, name)}){lost}"
        return HTTPError(502, "storage_unreachable", redact(detail, url=url))

    async def _detach(self, flush: bool) -> tuple[StorageStatus, str | None]:
        """Detach whatever is attached; the status and the detached backend's name.

        Attaches this app started before it are cancelled first (they answer 409
        `attach_cancelled`), so that it waits for none to open.
        """
        cache = self._cache
        for attaching in self._attaching:
            attaching.cancel()
        async with self._lock:
            before = cache.storage_status()
            await cache.detach_storage(flush=flush)
            return cache.storage_status(), before.backend

    def __repr__(self) -> str:
        return f"<AdminApp prefix={self._path_prefix!r} max_body_bytes={self._max_body_bytes}>"
