"""MooncakeStorage: pages in a Mooncake Store cluster (`mooncake-transfer-engine`).

A page is one Mooncake object `header ‖ payload` named `<prefix>:<key-hex>`. Transfers are
zero-copy where the caller's memory is registered with the transfer engine: a put sends
`[header, segment, segment, ...]` with `batch_put_from_multi_buffers` and a get scatters the
object into `[header slot, segment, ...]` with `batch_get_into_multi_buffers`; the 128-byte
header lives in a registered staging arena this backend owns. Memory that is not registered
goes through that arena with one copy. Host memory is registered explicitly with
`register_memory`, or on first use when a segment lies in a buffer object of at least
`auto_register` bytes (a host pool): that object is then kept alive until `close()`.

Mooncake's calls block in C++ (releasing the GIL), so each batch is one job on a worker
thread. See docs/storage-mooncake.md for the URL, the capabilities and the limits.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import bisect
import collections
import concurrent.futures
import contextlib
import ctypes
import functools
import http.client
import importlib.util
import os
import socket
import ssl
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal
from urllib.parse import quote, unquote, urlsplit

import anyio.lowlevel
import numpy as np

from .. import _native
from .._errors import StorageConfigError, StorageError, type_name
from .._extras import install_hint
from .._ratelog import LogLimiter
from ._base import (
    BackendBase,
    byte_segments,
    check_batch,
    check_key,
    check_keys,
    check_put,
    fan_out,
    log,
    parse_bool,
    parse_int,
    parse_port,
    parse_query,
    parse_size,
    split_url,
)
from ._maintenance import GcReport, PageInfo, VerifyReport
from ._manifest import ManifestLimits
from ._manifest_mooncake import MooncakeManifest
from ._mooncake_local import LocalObjects
from ._mooncake_watch import (
    MasterWatch,
    answers,
    http_answer,
    http_body,
    http_probe,
    reachable,
    tcp_probe,
)
from ._page import (
    HEADER_NBYTES,
    PageCheck,
    PageHeader,
    check_header,
    created_recency,
    decode_header,
    encode_header,
    scatter,
    verify_payload,
)
from ._protocol import Outcome, PageBuffer, PageMeta, StorageCapabilities
from ._redact import mask_userinfo

__all__ = ["MooncakeStorage", "close_idle_clients", "pooled_client"]

# Mooncake's error codes (mooncake-store/include/types.h) that change an outcome.
_NO_SPACE = -200  # NO_AVAILABLE_HANDLE: the cluster has no room; not stored, nothing wrong
_INVALID_PARAMS = -600  # among others: the object is larger than the buffers given
_TRANSFER_FAIL = -800  # among others: the object's length differs from the buffers'
_NOT_FOUND = -704
_RPC_FAIL = -900  # the master did not answer
# An object another client is still putting: not readable yet, so a miss like an absent one.
_NOT_READY = -703
_ALREADY_EXISTS = -705
_REFUSED = (_INVALID_PARAMS, _TRANSFER_FAIL)
#: The reason a get job gives for a page it read in place from this client's segment.
_DIRECT = "direct"

_MiB = 1 << 20
_ALIGN = 64
_DEFAULT_SEGMENT = 1 << 30
# Mooncake's segment allocator refuses less (its `setup()` then fails with a bare -600).
_MIN_SEGMENT = 16 * _MiB
# Mooncake's copying calls allocate from the local buffer: the manifest's puts (chunks of up
# to half of it, index objects of 64 KiB) and the whole reads of raw and damaged pages.
_MIN_BUFFER = _MiB
_DEFAULT_BUFFER = 64 * _MiB
_DEFAULT_STAGING = 64 * _MiB
_DEFAULT_AUTO_REGISTER = 64 * _MiB
# Below this much payload per batch, checksums stay on the job's thread: helpers would cost
# more hand-offs than they save.
_FANOUT_MIN_BYTES = 4 * _MiB
# Puts go out in groups of about this much payload on two lanes, so that checksumming one
# group overlaps the transfer of another (more lanes only compete for memory bandwidth).
_PUT_GROUP_BYTES = 64 * _MiB
_PUT_LANES = 2
_PROBE_TIMEOUT_S = 3.0
# Sent to a server to see it answer: not its protocol, so a live one drops the connection.
_NOT_A_REQUEST = bytes(32)
# What Mooncake's HTTP metadata servers answer (with 404) for a key they do not hold.
_METADATA_NOT_FOUND = b"metadata not found"
# Where Mooncake's HTTP metadata client and servers take their shared token from.
_METADATA_TOKEN_ENV = "MC_METADATA_HTTP_TOKEN"
# The most of a metadata server's answer the probe reads: a status line, a few headers and
# that short body.
_METADATA_ANSWER_NBYTES = 4096
# A get reads a page that failed its checks again, whole, only up to this size, to tell a
# page damaged where it is stored (removed) from a read that raced a replacement (kept).
_MAX_JUDGED_BYTES = 256 * _MiB
_HEX_DIGITS = "0123456789abcdef"
_ADMIN_TIMEOUT_S = 10.0
# The most of the master's `/get_all_keys` answer a listing reads (the names of every object
# in the cluster, about 80 bytes per page): past it the listing fails, so a huge or endless
# answer cannot grow the process without bound.
_MAX_KEY_LIST_BYTES = 1 << 30
_KEY_LIST_READ_BYTES = _MiB
# Whitespace a line of that answer may carry around a page name.
_KEY_LINE_SLACK = 256
# A put refused for want of room sets the master's eviction going (its eviction thread
# wakes every 10 ms): the refused pages get one more try once it has had a few rounds.
_NO_SPACE_RETRY_S = 0.05
# Forget refused auto-registrations now and then: freed memory gets new owners.
_MAX_REFUSED = 1024
# Idle clients kept for reuse (see `_ClientPool`): one per setting a process switches between.
_MAX_IDLE_CLIENTS = 4

_URL_PARAMS = {
    "metadata": "transfer metadata: http://host:port/metadata, etcd://host:port or "
    "P2PHANDSHAKE (default)",
    "protocol": "tcp (default) or rdma",
    "device": "RDMA device names (protocol=rdma)",
    "local_hostname": "address other nodes reach this client at (default 127.0.0.1)",
    "segment_size": "memory this client lends the cluster (default 1GiB; 0 for none)",
    "buffer_size": "Mooncake's local buffer for copying calls (default 64MiB)",
    "staging_size": "registered arena for headers and unregistered memory (default 64MiB)",
    "auto_register": "register buffer objects of at least this size on first use "
    "(default 64MiB; 0: never)",
    "prefix": "object name prefix (default hicache)",
    "admin": "master admin URL http://host:port, for list_pages, verify and gc",
    "replicas": "replicas per page (default 1)",
    "threads": "worker threads for Mooncake calls and checksums (default 4)",
    "max_batch_pages": "pages per Mooncake call (default 256)",
    "capacity": "bytes under the prefix that gc() trims to (default: none)",
    "direct_reads": "read pages in this client's own segment in place (default true)",
    "placement": "where puts place pages: local (this client's segment first; the default "
    "when it lends one) or any (the master's choice)",
}
_PLACEMENTS = ("any", "local")


_METADATA_PORTS = {"http": 80, "https": 443, "etcd": 2379}


def _metadata_address(metadata: str) -> tuple[str, int] | None:
    """The metadata server's (host, port) to probe; None for P2PHANDSHAKE.

    Checked before Mooncake sees it: an unknown scheme aborts the whole process inside
    Mooncake (a fatal log, not an error code).
    """
    if metadata == "P2PHANDSHAKE":
        return None
    accepted = "accepted: P2PHANDSHAKE, http://host:port/metadata or etcd://host:port"
    if not isinstance(metadata, str):
        raise StorageConfigError(f"mooncake metadata must be a str, got {type_name(metadata)}")
    try:
        parts = urlsplit(metadata)
        port = parts.port
    except ValueError as exc:
        raise StorageConfigError(
            f"mooncake metadata {mask_userinfo(metadata)!r}: {exc}; {accepted}"
        ) from None
    # As written: Mooncake matches its plugins' names case-sensitively (urlsplit lowers it).
    scheme = metadata.partition("://")[0]
    if scheme not in _METADATA_PORTS or not parts.hostname:
        raise StorageConfigError(
            f"mooncake metadata {mask_userinfo(metadata)!r} is not usable; {accepted}"
        )
    if "?" in metadata:
        # Mooncake appends `?key=...` to the URL as written: a second `?` names no key.
        raise StorageConfigError(
            f"mooncake metadata {mask_userinfo(metadata)!r} must not carry a query string "
            f"(Mooncake adds its own `?key=`); {accepted}"
        )
    # An IPv6 zone is escaped in a URL (`[fe80::1%25eth0]`), as curl reads it; the resolver
    # takes it bare.
    host = unquote(parts.hostname) if ":" in parts.hostname else parts.hostname
    return host, _METADATA_PORTS[scheme] if port is None else port


def _address(view: memoryview) -> int:
    """The address of a contiguous byte view (writable or not)."""
    if not view.readonly:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _root_region(view: memoryview) -> tuple[int, int, object] | None:
    """The whole buffer object `view` is a slice of: (address, size, owner), if it has one.

    Follows memoryview and numpy `.base` chains to the object that owns the memory (a host
    pool's array, a bytearray, an mmap).
    """
    obj: object = view.obj
    while True:
        if isinstance(obj, memoryview):
            obj = obj.obj
            continue
        base = getattr(obj, "base", None)
        if base is None:
            break
        try:
            memoryview(base)
        except TypeError:
            break
        obj = base
    try:
        root = memoryview(obj)  # type: ignore[arg-type]  # checked by the TypeError
    except TypeError:
        return None
    if not root.c_contiguous or root.nbytes == 0:
        return None
    if root.format != "B" or root.ndim != 1:
        root = root.cast("B")
    return _address(root), root.nbytes, obj


class _Interruptible:
    """The socket of one admin request, which the loop can shut down to end a read blocked
    in a worker thread (a cancelled or closed listing)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._shut = False

    def attach(self, sock: socket.socket) -> None:
        """Called on the worker once connected (for https, the TLS socket before its
        handshake)."""
        with self._lock:
            self._sock = sock
            if self._shut:
                _shut_down(sock)

    def shut(self) -> None:
        """End the request's reads now and any later ones (from any thread)."""
        with self._lock:
            self._shut = True
            if self._sock is not None:
                _shut_down(self._sock)

    def opener(self) -> urllib.request.OpenerDirector:
        """A urllib opener whose connections attach their socket here."""
        attach = self.attach

        class Plain(http.client.HTTPConnection):
            def connect(self) -> None:
                super().connect()
                attach(self.sock)

        class Secure(http.client.HTTPSConnection):
            def connect(self) -> None:
                # Attached before the handshake: a server that accepts and never answers it
                # held a cancelled listing for the whole timeout.
                http.client.HTTPConnection.connect(self)
                sock = context.wrap_socket(
                    self.sock,
                    server_hostname=getattr(self, "_tunnel_host", None) or self.host,
                    do_handshake_on_connect=False,
                )
                self.sock = sock
                attach(sock)
                sock.do_handshake()

        class PlainHandler(urllib.request.HTTPHandler):
            def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
                return self.do_open(Plain, req)

        context = ssl.create_default_context()

        class SecureHandler(urllib.request.HTTPSHandler):
            def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
                return self.do_open(Secure, req, context=context)

        return urllib.request.build_opener(PlainHandler, SecureHandler)


def _shut_down(sock: socket.socket) -> None:
    # The plain socket's call, also for a TLS socket: it acts on the descriptor alone (a
    # socket already closed has none), leaving the TLS state to the thread reading it.
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


def _silent_server(master: str, metadata: str) -> str | None:
    """Why the Mooncake master or metadata server named cannot be counted on to answer (it
    cannot be reached, or accepts connections and says nothing within the probe timeout),
    or None when both answer.

    Mooncake's `setup()` and `close()` call them holding the GIL, and wait out their timeouts
    on one that does not answer: over a minute for a frozen master.
    """
    host, _, port = master.rpartition(":")
    silent = _unanswered("master", master, (host.strip("[]"), int(port)), _NOT_A_REQUEST)
    address = _metadata_address(metadata)
    if silent is not None or address is None:
        return silent
    host, port_number = address
    shown = f"[{host}]:{port_number}" if ":" in host else f"{host}:{port_number}"
    if metadata.startswith("etcd://"):
        # Only whether it accepts (an etcd client retries one that does not for minutes):
        # how etcd treats bytes that are not its protocol is not relied on.
        if not reachable(address, _PROBE_TIMEOUT_S):
            return f"cannot reach the Mooncake metadata server at {shown}"
        return None
    if metadata.startswith("http://"):
        return _not_metadata_server(metadata, shown, address)
    # https: a TLS server drops bytes that are not a handshake at once. What answers is not
    # told (the probe would need the certificates Mooncake's curl trusts).
    return _unanswered("metadata server", shown, address, _NOT_A_REQUEST, proxied=metadata)


def _not_metadata_server(metadata: str, shown: str, address: tuple[str, int]) -> str | None:
    """Why the server at `address` is not the Mooncake HTTP metadata server `metadata`
    names (it cannot be reached, stays silent, or answers as another service does), or None.

    Any server answers a request: the master's own metadata server, Mooncake's Python one and
    its Go example all answer a GET of an absent key with 404 `metadata not found`, where
    another service passed the probe and Mooncake's `setup()` then failed with a bare -1.
    """
    parts = urlsplit(metadata)
    # The key as Mooncake asks for one (`<metadata>?key=<escaped key>`), never stored.
    target = f"{parts.path or '/'}?key="
    target += quote(f"hicache/probe/{os.urandom(8).hex()}", safe="")
    # As curl sends it: without an IPv6 zone, which means nothing to the server.
    host = shown if "%" not in shown else f"{shown.partition('%')[0]}]{shown.rpartition(']')[2]}"
    lines = [f"GET {target} HTTP/1.1", f"Host: {host}", "Connection: close"]
    token = os.environ.get(_METADATA_TOKEN_ENV, "")
    if token:
        # Mooncake's client sends this shared token to the servers that require it (those of
        # later releases answer 401 without it), in place of the URL's user information.
        lines.append(f"Authorization: Bearer {token}")
    elif parts.username is not None:
        # curl sends a URL's user information as basic authentication: so does the probe.
        user = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        lines.append(f"Authorization: Basic {base64.b64encode(user.encode()).decode()}")
    request = "\r\n".join([*lines, "", ""]).encode()
    answer = http_answer(address, request, _PROBE_TIMEOUT_S, _METADATA_ANSWER_NBYTES)
    if answer is None:
        if _through_proxy(metadata):
            return None  # reached, if at all, as Mooncake's curl reaches it: not told here
        return f"cannot reach the Mooncake metadata server at {shown}"
    if answer is False:
        return (
            f"the Mooncake metadata server at {shown} accepts connections but does not "
            f"answer (nothing within {_PROBE_TIMEOUT_S:g} s)"
        )
    head = answer.partition(b"\r\n\r\n")[0]
    status = head.partition(b"\r\n")[0].split(b" ")[1:2]
    if status == [b"404"] and _METADATA_NOT_FOUND in http_body(answer):
        return None
    line = head.partition(b"\r\n")[0][:80].decode("ascii", "replace")
    said = f"answered {line!r}" if line else "got no answer"
    hint = ""
    if status == [b"401"] and token:
        hint = f" ({_METADATA_TOKEN_ENV} does not hold the token the server requires)"
    elif status == [b"401"]:
        hint = f" (the server requires a token: {_METADATA_TOKEN_ENV} names none)"
    return (
        f"{mask_userinfo(metadata)} is no Mooncake metadata server: a GET of an absent key "
        f"{said}, not 404 {_METADATA_NOT_FOUND.decode()!r}{hint}"
    )


def _through_proxy(metadata: str) -> bool:
    """Whether Mooncake's curl asks the metadata server `metadata` names through the proxy
    the environment names for its scheme, as curl reads it (`http_proxy` in lower case only,
    `https_proxy` or `HTTPS_PROXY`, else `all_proxy` or `ALL_PROXY`), unless `no_proxy`
    names the host.

    The probe connects directly: a server that only the proxy reaches (a name only it
    resolves, a network only it is on) serves Mooncake all the same.
    """
    environ = os.environ
    names = ["http_proxy"] if metadata.startswith("http://") else ["https_proxy", "HTTPS_PROXY"]
    if not any(environ.get(name) for name in [*names, "all_proxy", "ALL_PROXY"]):
        return False
    return not urllib.request.proxy_bypass(urlsplit(metadata).hostname or "")


def _unanswered(
    role: str, shown: str, address: tuple[str, int], request: bytes, *, proxied: str = ""
) -> str | None:
    """Why the Mooncake `role` at `address` did not answer `request` (or close the
    connection) within the probe timeout; None if it did, or if it cannot be connected to
    but Mooncake reaches the URL `proxied` through a proxy."""
    answered = answers(address, request, _PROBE_TIMEOUT_S)
    if answered is None:
        if proxied and _through_proxy(proxied):
            return None  # reached, if at all, as Mooncake's curl reaches it: not told here
        return f"cannot reach the Mooncake {role} at {shown}"
    if not answered:
        return (
            f"the Mooncake {role} at {shown} accepts connections but does not answer "
            f"(nothing within {_PROBE_TIMEOUT_S:g} s)"
        )
    return None


_ClientKey = tuple[str, str, str, str, str, int, int]


class _ClientPool:
    """Idle Mooncake clients, reused by later backends with the same client settings.

    Mooncake's `close()` (and its destructor) holds the GIL for 1-2 s while it joins its
    heartbeat threads and unmounts the segment, which would stall the event loop every time a
    backend is detached. So a closed backend hands its client back here (its registrations
    undone) and the next backend with the same settings takes it over; the pages in its
    segment stay available meanwhile. At most `_MAX_IDLE_CLIENTS` are kept: past it, the one
    handed back longest ago is closed (as `close_idle` with `reachable_only` does), so a
    process that moves between many masters or settings does not keep a client, its threads
    and its segment for each. At exit the idle clients are closed, except those whose master
    or metadata server does not answer (gone or frozen): closing them would spend seconds on
    RPCs to it, over a minute on a frozen one, so they are kept referenced (no
    destructor runs) and left to Mooncake's own exit handler. A forked child abandons the
    clients it inherited (see `_abandon_all`).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Oldest first: the end is the most recently handed back.
        self._idle: list[tuple[_ClientKey, Any]] = []
        self._abandoned: list[Any] = []
        atexit.register(self.close_all)
        os.register_at_fork(after_in_child=self._abandon_all)

    def take(self, key: _ClientKey) -> Any | None:
        with self._lock:
            for i in range(len(self._idle) - 1, -1, -1):
                if self._idle[i][0] == key:
                    return self._idle.pop(i)[1]
            return None

    def give_back(self, key: _ClientKey, client: Any) -> None:
        with self._lock:
            self._idle.append((key, client))
            surplus = self._idle[: max(len(self._idle) - _MAX_IDLE_CLIENTS, 0)]
            del self._idle[: len(surplus)]
        # On the caller's thread (a worker's, for a backend): the close holds the GIL for its
        # 1-2 s, as any close does, once per client past the bound.
        self._close(surplus, reachable_only=True)

    def close_idle(self, master: str | None = None, *, reachable_only: bool = False) -> int:
        """Close the idle clients of `master` (all when None); how many were closed. With
        `reachable_only`, those whose master or metadata server does not answer (gone, or
        frozen) are abandoned instead (see the class)."""
        with self._lock:
            chosen = [e for e in self._idle if master is None or e[0][0] == master]
            self._idle = [e for e in self._idle if not (master is None or e[0][0] == master)]
        return self._close(chosen, reachable_only=reachable_only)

    def _close(self, entries: list[tuple[_ClientKey, Any]], *, reachable_only: bool) -> int:
        closed = 0
        # A silent master or metadata server is checked once, not per client: each check
        # of it waits out the probe timeout, and the idle clients of one master (other
        # settings) would wait it out again each, at exit. One that answered is checked
        # again (cheap), as it may stop answering during a close.
        silent_ones: dict[tuple[str, str], str] = {}
        for key, client in entries:
            # Not only reachable: a close waits out its RPCs' timeouts on a master (or
            # metadata server) that accepts connections without answering, a frozen one,
            # holding the GIL all along (76 s measured), which would freeze the loop of the
            # backend whose close hands back a client past the bound.
            silent = None
            if reachable_only:
                servers = (key[0], key[1])
                silent = silent_ones.get(servers) or _silent_server(*servers)
                if silent is not None:
                    silent_ones[servers] = silent
            if silent is not None:
                log.warning("storage.mooncake.master_gone_at_exit", master=key[0], reason=silent)
                with self._lock:
                    self._abandoned.append(client)
                continue
            client.close()
            closed += 1
        return closed

    def close_all(self) -> None:
        self.close_idle(reachable_only=True)

    def _abandon_all(self) -> None:
        """In a forked child: the idle clients are the parent's, whose threads the child
        does not have (closing or using one there crashes it), so none is handed out or
        closed at exit; they stay referenced instead."""
        self._lock = threading.Lock()  # another thread of the parent may have held it
        self._abandoned.extend(client for _, client in self._idle)
        self._idle.clear()


_POOL = _ClientPool()


def _check_admin(admin: str) -> None:
    """StorageConfigError unless `admin` is an http(s)://host[:port] URL urllib can call;
    messages quote it with any user information masked."""
    try:
        parts = urlsplit(admin)
    except ValueError:  # an unclosed IPv6 bracket, say
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise StorageConfigError(
            f"mooncake admin must be an http://host:port URL, got {mask_userinfo(admin)!r}"
        )
    if parts.username is not None or parts.password is not None:
        # urllib sends no credentials from a URL: they would only end up in messages.
        raise StorageConfigError(
            "mooncake admin must not hold a user or password (http://host:port): "
            "the admin server is called without them"
        )
    parse_port(parts, scheme=f"mooncake admin {parts.scheme}")


def close_idle_clients(master: str | None = None, *, reachable_only: bool = False) -> int:
    """Close the pooled Mooncake clients that no backend uses, of `master` ("host:port") or
    of all masters; return how many.

    Closed backends leave their client in a pool for the next backend with the same
    settings (Mooncake's own close holds the GIL for 1-2 s); the pool keeps the 4 handed back
    last and closes older ones. Call this before stopping a
    master, so the clients unmount their segments while it still answers; it blocks for
    those seconds per client. With `reachable_only`, the clients of a master or metadata
    server that does not answer within 3 s (gone, or accepting connections but frozen) are
    left unclosed (closing them would wait seconds on it, over a minute on a frozen one), as at
    exit; a program can so close them itself before it exits, where an interrupt is its own
    to handle, not one in an exit handler.
    """
    return _POOL.close_idle(master, reachable_only=reachable_only)


def _no_library() -> str:
    """What to install for Mooncake's client: off Linux, nothing (the `mooncake` extra
    installs nothing there)."""
    if not sys.platform.startswith("linux"):
        return (
            "the mooncake backend needs the Mooncake Python package, which is published for "
            f"Linux only (mooncake-transfer-engine); this platform is {sys.platform!r}"
        )
    return (
        f"the mooncake backend needs the Mooncake Python package: {install_hint('mooncake')} "
        "(mooncake-transfer-engine-non-cuda) or mooncake-transfer-engine for CUDA/RDMA hosts"
    )


def client_library() -> Any:
    """Mooncake's `mooncake.store` module; `StorageError` naming what to install when the
    `mooncake` extra is missing (an `ImportError` traceback tells a user nothing)."""
    try:
        import mooncake.store
    except ImportError as exc:
        raise StorageError(_no_library()) from exc
    return mooncake.store


def _library_installed() -> bool:
    """Whether the `mooncake` package is there, without importing it (that is left to the
    open, on a worker thread)."""
    try:
        return importlib.util.find_spec("mooncake") is not None
    except ValueError:  # in sys.modules without a spec: there, whatever it is
        return True


@contextlib.contextmanager
def pooled_client(url: str) -> Iterator[Any]:
    """A raw `MooncakeDistributedStore` set up as the `mooncake://` URL says (for benchmarks
    and tools), taken from the idle pool when one matches and returned to it afterwards.

    The caller undoes its own `register_buffer` calls before leaving the block.
    """
    store_class = client_library().MooncakeDistributedStore
    config = MooncakeStorage.from_url(url)
    key = config._client_key()
    client = _POOL.take(key)
    if client is None:
        client = config._new_client(store_class)
    try:
        yield client
    finally:
        _POOL.give_back(key, client)


class _Regions:
    """Registered memory ranges, sorted and disjoint; touched only on the event loop."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._owners: list[object] = []

    def __len__(self) -> int:
        return len(self._starts)

    def covers(self, address: int, nbytes: int) -> bool:
        i = bisect.bisect_right(self._starts, address) - 1
        return i >= 0 and address + nbytes <= self._ends[i]

    def overlaps(self, address: int, nbytes: int) -> bool:
        i = bisect.bisect_left(self._ends, address + 1)
        return i < len(self._starts) and self._starts[i] < address + nbytes

    def add(self, address: int, nbytes: int, owner: object) -> None:
        i = bisect.bisect_left(self._starts, address)
        self._starts.insert(i, address)
        self._ends.insert(i, address + nbytes)
        self._owners.insert(i, owner)

    def remove(self, address: int) -> bool:
        i = bisect.bisect_left(self._starts, address)
        if i < len(self._starts) and self._starts[i] == address:
            del self._starts[i], self._ends[i], self._owners[i]
            return True
        return False

    def addresses(self) -> list[int]:
        return list(self._starts)


class _Arena:
    """First-fit allocator over the registered staging buffer; used only on the event loop.

    Requests are served first come, first served: while one waits, later ones queue behind
    it even if they would fit, so a large request is not starved by a stream of small ones.
    Requests never exceed capacity.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(0, capacity)]
        # Waiting requests, oldest first: (bytes, the future their offset is given through).
        self._queue: collections.deque[tuple[int, asyncio.Future[int]]] = collections.deque()

    @staticmethod
    def rounded(nbytes: int) -> int:
        return max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)

    def _take(self, nbytes: int) -> int | None:
        for i, (offset, size) in enumerate(self._free):
            if size >= nbytes:
                if size == nbytes:
                    del self._free[i]
                else:
                    self._free[i] = (offset + nbytes, size - nbytes)
                return offset
        return None

    async def acquire(self, nbytes: int) -> int:
        nbytes = self.rounded(nbytes)
        if nbytes > self.capacity:
            raise ValueError(f"{nbytes} bytes exceed the staging arena of {self.capacity}")
        if not self._queue and (offset := self._take(nbytes)) is not None:
            return offset
        waiter: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        entry = (nbytes, waiter)
        self._queue.append(entry)
        try:
            return await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                # Granted, then cancelled before it resumed: the space goes back.
                self.release(waiter.result(), nbytes)
            else:
                with contextlib.suppress(ValueError):  # `_serve` may have dropped it
                    self._queue.remove(entry)
                self._serve()  # it may have been the head that held the others back
            raise

    def release(self, offset: int, nbytes: int) -> None:
        nbytes = self.rounded(nbytes)
        bisect.insort(self._free, (offset, nbytes))
        merged: list[tuple[int, int]] = []
        for start, size in self._free:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((start, size))
        self._free = merged
        self._serve()

    def _serve(self) -> None:
        """Grant waiting requests in order, up to the first that does not fit."""
        while self._queue:
            nbytes, waiter = self._queue[0]
            if waiter.done():  # cancelled while it waited
                self._queue.popleft()
                continue
            offset = self._take(nbytes)
            if offset is None:
                return
            self._queue.popleft()
            waiter.set_result(offset)


class _Plan:
    """How one page moves: its byte segments, their addresses, zero-copy or staged."""

    __slots__ = ("addresses", "arena_bytes", "nbytes", "segments", "zero_copy")

    def __init__(self, segments: list[memoryview], addresses: list[int], zero_copy: bool) -> None:
        self.segments = segments
        self.addresses = addresses
        self.nbytes = sum(len(s) for s in segments)
        self.zero_copy = zero_copy
        #: Arena space the page needs: its header slot, plus the payload when staged.
        self.arena_bytes = _Arena.rounded(HEADER_NBYTES + (0 if zero_copy else self.nbytes))


def _header_reason(
    header: PageHeader | PageCheck, key: bytes, namespace: bytes, payload_nbytes: int
) -> str:
    """Which header check failed, for the `storage.page.corrupt` log event."""
    if isinstance(header, PageCheck):
        return "header"
    if header.key != key:
        return "key"
    if header.namespace != namespace:
        return "namespace"
    if header.payload_nbytes != payload_nbytes:
        return "length"
    return "checksum or mac"


def _put_groups(items: list[int], sizes: list[int], group_bytes: int) -> list[list[int]]:
    """`items` cut, in order, into runs of at least `group_bytes` (the last may be short)."""
    groups: list[list[int]] = []
    current: list[int] = []
    nbytes = 0
    for item, size in zip(items, sizes, strict=True):
        current.append(item)
        nbytes += size
        if nbytes >= group_bytes:
            groups.append(current)
            current, nbytes = [], 0
    if current:
        groups.append(current)
    return groups


def _object_buffers(
    items: Sequence[int],
    plans: Sequence[_Plan],
    chunk: Sequence[int],
    slots: Sequence[int | None],
    arena_base: int,
) -> tuple[list[list[int]], list[list[int]]]:
    """Each object's buffers and their sizes for Mooncake's multi-buffer calls: the header's
    arena slot then the page's own segments (zero-copy), or the slot holding both (staged)."""
    buffers: list[list[int]] = []
    sizes: list[list[int]] = []
    for j in items:
        plan, slot = plans[chunk[j]], slots[j]
        assert slot is not None
        if plan.zero_copy:
            buffers.append([arena_base + slot, *plan.addresses])
            sizes.append([HEADER_NBYTES, *(len(s) for s in plan.segments)])
        else:
            buffers.append([arena_base + slot])
            sizes.append([HEADER_NBYTES + plan.nbytes])
    return buffers, sizes


_ReadState = Literal["missing", "damaged", "failed", "read"]


def _read_states(
    store: Any, names: Sequence[str], codes: Sequence[int], expected: Sequence[int]
) -> list[_ReadState]:
    """What each batch read of `names` (`expected` bytes each) says of its object: missing,
    damaged (stored at another length), failed (nothing known of it) or read whole.

    Mooncake refuses a length mismatch with the `_REFUSED` codes, among other causes: one
    size lookup for all of them tells a damaged object from a failed transfer."""
    refused = [n for n, c in zip(names, codes, strict=True) if c in _REFUSED]
    stored = dict(zip(refused, _stored_sizes(store, refused), strict=True))
    states: list[_ReadState] = []
    for name, code, size in zip(names, codes, expected, strict=True):
        if code in (_NOT_FOUND, _NOT_READY):
            states.append("missing")
        elif code in _REFUSED and stored[name] not in (-1, size):
            states.append("damaged")
        elif code < 0:
            states.append("failed")
        elif code != size:
            states.append("damaged")
        else:
            states.append("read")
    return states


def _stored_sizes(store: Any, names: Sequence[str]) -> list[int]:
    """Each object's stored length, -1 when absent, from one `batch_get_replica_desc` RPC
    (a `get_size` per name would be one round trip each)."""
    if not names:
        return []
    described = store.batch_get_replica_desc(list(names))
    sizes: list[int] = []
    for name in names:
        size = -1
        for replica in described.get(name, ()):
            if replica.is_memory_replica():
                size = int(replica.get_memory_descriptor().buffer_descriptor.size)
                break
        if size < 0 and name in described:
            size = max(int(store.get_size(name)), -1)  # a disk replica: ask for it alone
        sizes.append(size)
    return sizes


def _present_sizes(store: Any, names: Sequence[str]) -> list[int]:
    """`_stored_sizes` of `names` that may be absent: Mooncake's client logs an error line
    for each absent key a replica lookup asks about, so one `batch_is_exist` RPC first keeps
    absent keys out of it (a key whose existence is not known is still asked about)."""
    if not names:
        return []
    states = list(store.batch_is_exist(list(names)))
    asked = [name for name, state in zip(names, states, strict=True) if state != 0]
    sizes = dict(zip(asked, _stored_sizes(store, asked), strict=True))
    return [sizes.get(name, -1) for name in names]


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _int_param(params: dict[str, str], name: str, default: int, *, minimum: int = 1) -> int:
    raw = params.get(name)
    if raw is None:
        return default
    # Say what the parameter is, as the message for an unknown one does.
    return parse_int(
        raw,
        field=f"mooncake URL parameter {name}",
        minimum=minimum,
        detail=f": {_URL_PARAMS[name]}",
    )


_TOO_BIG = "storage.mooncake.page_exceeds_staging"
#: Puts the cluster refused for want of room (its segments full of objects it may not evict).
_PUT_NO_SPACE = "storage.mooncake.put_no_space"
_PUT_FAILED = "storage.mooncake.put_failed"


class MooncakeStorage(BackendBase):
    """Pages in Mooncake Store, moved zero-copy from and to registered host memory.

    Build it with `MooncakeStorage.from_url("mooncake://master:50051?metadata=...")` or with
    keyword arguments. `segment_size` is the memory this client lends the cluster (pages can
    be placed there; they go when this client closes); `staging_size` is the registered arena
    for headers and for memory that is not registered. Pages that lie in this client's own
    segment are read in place, copied and checksummed in one pass (`direct_reads`);
    `placement="local"` (the default when this client lends a segment) puts pages there first,
    so this instance reads its own pages back without the transfer engine; `"any"` leaves the
    choice to the master.
    """

    def __init__(
        self,
        master: str = "127.0.0.1:50051",
        *,
        mac_key: bytes | None = None,
        metadata: str = "P2PHANDSHAKE",
        protocol: str = "tcp",
        device: str = "",
        local_hostname: str = "127.0.0.1",
        segment_size: int = _DEFAULT_SEGMENT,
        buffer_size: int = _DEFAULT_BUFFER,
        staging_size: int = _DEFAULT_STAGING,
        auto_register: int = _DEFAULT_AUTO_REGISTER,
        prefix: str = "hicache",
        admin: str | None = None,
        replicas: int = 1,
        threads: int = 4,
        max_batch_pages: int = 256,
        capacity_bytes: int | None = None,
        direct_reads: bool = True,
        placement: str | None = None,
    ) -> None:
        host, _, port = master.rpartition(":")
        if not host or not port.isdigit():
            raise StorageConfigError(f"mooncake master must be host:port, got {master!r}")
        for what, name in (("master", host.strip("[]")), ("local_hostname", local_hostname)):
            # Otherwise found at the open, as a bare codec error from the resolver.
            try:
                if isinstance(name, str):
                    name.encode("idna")
            except UnicodeError:
                raise StorageConfigError(
                    f"mooncake {what} must name a host by a host name or an IP address, "
                    f"got {name!r}"
                ) from None
        if protocol not in ("tcp", "rdma"):
            raise StorageConfigError(f"mooncake protocol must be tcp or rdma, got {protocol!r}")
        if not prefix or any(c.isspace() for c in prefix):
            raise StorageConfigError(
                f"mooncake prefix must be non-empty without spaces: {prefix!r}"
            )
        if placement is None:
            placement = "local" if segment_size > 0 else "any"
        if placement not in _PLACEMENTS:
            raise StorageConfigError(
                f"mooncake placement must be one of {', '.join(_PLACEMENTS)}, got {placement!r}"
            )
        if placement == "local" and segment_size == 0:
            raise StorageConfigError("mooncake placement=local needs a segment (segment_size > 0)")
        if admin is not None:
            _check_admin(admin)
        if device and protocol != "rdma":
            raise StorageConfigError(
                f"mooncake device names RDMA devices; it needs protocol=rdma, got {protocol!r}"
            )
        metadata_address = _metadata_address(metadata)
        for field, value, minimum in (
            ("segment_size", segment_size, 0),
            ("buffer_size", buffer_size, _MIN_BUFFER),
            ("staging_size", staging_size, _MiB),
            ("auto_register", auto_register, 0),
            ("replicas", replicas, 1),
            ("threads", threads, 1),
            ("max_batch_pages", max_batch_pages, 1),
            ("capacity_bytes", 1 if capacity_bytes is None else capacity_bytes, 1),
        ):
            if value < minimum:
                raise StorageConfigError(f"mooncake {field} must be >= {minimum}, got {value}")
        if 0 < segment_size < _MIN_SEGMENT:
            raise StorageConfigError(
                f"mooncake segment_size must be 0 or >= {_MIN_SEGMENT} (16MiB, the smallest "
                f"segment Mooncake mounts), got {segment_size}"
            )
        super().__init__(mac_key=mac_key, job_threads=threads, thread_name="hicache-mooncake")
        # xxh3 and blake2b release the GIL: a batch's checksums run on up to `threads` threads.
        self._threads = threads
        self._helpers = (
            concurrent.futures.ThreadPoolExecutor(threads - 1, "hicache-mooncake-hash")
            if threads > 1
            else None
        )
        self._master = master
        self._master_addr = (host.strip("[]"), int(port))
        self._metadata = metadata
        self._metadata_address = metadata_address
        self._protocol = protocol
        self._device = device
        self._local_hostname = local_hostname
        self._segment_size = segment_size
        self._buffer_size = buffer_size
        self._staging_size = staging_size
        self._auto_register = auto_register
        self._prefix = prefix
        self._admin = admin.rstrip("/") if admin else None
        self._replicas = replicas
        self._max_batch_pages = max_batch_pages
        self._capacity = capacity_bytes
        self._name = f"mooncake://{master}?prefix={prefix}"
        self._store: Any = None
        self._config: Any = None
        self._arena_array: np.ndarray[Any, np.dtype[np.uint8]] | None = None
        self._arena_view: memoryview | None = None
        self._arena_base = 0
        self._arena = _Arena(staging_size)
        # Pages too large for the arena fail every batch they are in: logged once a minute.
        self._too_big_log = LogLimiter()
        # A full cluster refuses every backup batch: each kind of refusal once a minute.
        self._put_log = LogLimiter()
        self._regions = _Regions()
        self._pending: list[tuple[int, int, object]] = []
        #: Set once `_open` has finished, opened or not (None until it begins).
        self._opening: asyncio.Event | None = None
        self._refused: set[tuple[int, int]] = set()
        self._pages = 0
        self._bytes = 0
        self._zero_copy_pages = 0
        self._staged_pages = 0
        self._direct_reads = direct_reads and segment_size > 0
        self._placement = placement
        self._local: LocalObjects | None = None
        self._direct_pages = 0
        self._put_group_bytes = _PUT_GROUP_BYTES
        self._watch: MasterWatch | None = None
        # Waits `close()` ends early (see `_pause`).
        self._pauses: set[asyncio.Future[None]] = set()

    @classmethod
    def from_url(cls, url: str, *, mac_key: bytes | None = None) -> MooncakeStorage:
        """Build from `mooncake://master-host:port?metadata=...&protocol=tcp&...`.

        Parameters: `metadata`, `protocol`, `device`, `local_hostname`, `segment_size`,
        `buffer_size`, `staging_size`, `auto_register` (byte sizes such as 1GiB), `prefix`,
        `admin`, `replicas`, `threads`, `max_batch_pages`, `capacity`, `direct_reads`,
        `placement`. Anything else raises
        `StorageConfigError` listing what is accepted, as is a missing `mooncake` extra.
        """
        if not _library_installed():
            # Told at once, as a missing redis-py is by `open_storage("redis://...")`: a URL
            # this installation cannot serve, not a store that failed to open.
            raise StorageConfigError(_no_library())
        parts = split_url(url, scheme="mooncake")
        if parts.scheme != "mooncake":
            raise StorageConfigError(f"not a mooncake:// URL: {parts.scheme!r}")
        port = parse_port(parts, scheme="mooncake")
        if not parts.hostname or port is None:
            raise StorageConfigError(f"mooncake:// URL needs the master's host:port, got {url!r}")
        if parts.username is not None or parts.path not in ("", "/") or parts.fragment:
            # Mooncake takes no credentials and the master no database: what was meant?
            raise StorageConfigError(
                "a mooncake:// URL is the master's host:port and query parameters only; "
                "it takes no user, password, path or fragment"
            )
        params = parse_query(parts.query, _URL_PARAMS, scheme="mooncake")

        def size(name: str, default: int) -> int:
            return parse_size(params[name], field=name) if name in params else default

        host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
        capacity = params.get("capacity")
        return cls(
            f"{host}:{port}",
            mac_key=mac_key,
            metadata=params.get("metadata", "P2PHANDSHAKE"),
            protocol=params.get("protocol", "tcp"),
            device=params.get("device", ""),
            local_hostname=params.get("local_hostname", "127.0.0.1"),
            segment_size=size("segment_size", _DEFAULT_SEGMENT),
            buffer_size=size("buffer_size", _DEFAULT_BUFFER),
            staging_size=size("staging_size", _DEFAULT_STAGING),
            auto_register=size("auto_register", _DEFAULT_AUTO_REGISTER),
            prefix=params.get("prefix", "hicache"),
            admin=params.get("admin"),
            replicas=_int_param(params, "replicas", 1),
            threads=_int_param(params, "threads", 4),
            max_batch_pages=_int_param(params, "max_batch_pages", 256),
            capacity_bytes=None if capacity is None else parse_size(capacity, field="capacity"),
            direct_reads=parse_bool(params.get("direct_reads", "1"), field="direct_reads"),
            placement=params.get("placement"),
        )

    @property
    def capabilities(self) -> StorageCapabilities:
        # Zero copy for registered memory; pages live in clients' segments, so they outlive
        # this process only when it lends none.
        return StorageCapabilities(
            max_batch_pages=self._max_batch_pages,
            zero_copy=self._auto_register > 0 or len(self._regions) > 0,
            shared=True,
            persistent=self._segment_size == 0,
            put_skips_stored=True,  # `batch_is_exist` first (see `_put_job`)
        )

    @property
    def prefix(self) -> str:
        """Objects are named `<prefix>:<key-hex>`."""
        return self._prefix

    @property
    def zero_copy_pages(self) -> int:
        """Pages moved straight from or to the caller's registered memory so far."""
        return self._zero_copy_pages

    @property
    def staged_pages(self) -> int:
        """Pages moved through the staging arena (their memory was not registered)."""
        return self._staged_pages

    @property
    def placement(self) -> str:
        """Where puts place pages: `"any"` (the master's choice) or `"local"` (this client's
        segment first)."""
        return self._placement

    @property
    def direct_pages(self) -> int:
        """Pages read in place from this client's own segment (`direct_reads`), not through
        the transfer engine."""
        return self._direct_pages

    def __repr__(self) -> str:
        return (
            f"<MooncakeStorage {self._name} state={self._state.value} "
            f"registered={len(self._regions)}>"
        )

    def manifest(self, limits: ManifestLimits | None = None) -> MooncakeManifest:
        """The warmup manifest: immutable, hard-pinned objects `<prefix>:manifest:<ns>:...`
        in the store beside the pages (docs/warmup.md). Listing its namespaces (`read()`
        without one, `compact()`) needs `admin`."""
        return MooncakeManifest(self, limits)

    # Memory registration.

    async def register_memory(self, memory: object, nbytes: int | None = None) -> None:
        """Register host memory with the transfer engine so pages in it move zero-copy.

        `memory` is a buffer object (a host pool's array, a bytearray, a memoryview over
        either), which is kept alive until `close()`, or an integer address with `nbytes`,
        which the caller keeps valid until `unregister_memory` or `close()`. Call it before
        or after entering; while entering it waits for the backend to open and then
        registers (raising StorageError if it did not open). Overlapping an already
        registered range is an error.
        """
        if self.closed:
            raise StorageError(f"{self._name} is closed")
        if isinstance(memory, int):
            if nbytes is None or nbytes < 1:
                raise ValueError("register_memory(address, nbytes) needs nbytes >= 1")
            address, size, owner = memory, nbytes, None
        else:
            view = memoryview(memory)  # type: ignore[arg-type]
            if not view.c_contiguous:
                raise ValueError("register_memory needs contiguous memory")
            view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
            address, size, owner = _address(view), view.nbytes, memory
            if nbytes is not None:
                if not 0 < nbytes <= size:
                    raise ValueError(f"nbytes must be in [1, {size}], got {nbytes}")
                size = nbytes
        if self._store is None and self._opening is not None:
            # Entering is under way and registers only what was pending when it began: wait
            # for it, then register as on an open backend (or fail if it did not open).
            await self._opening.wait()
            self._check_open()
        if self._regions.overlaps(address, size) or any(
            a < address + size and address < a + n for a, n, _ in self._pending
        ):
            raise ValueError("this memory overlaps a registered range")
        if self._store is None:
            self._pending.append((address, size, owner))
            return
        await self._register([(address, size, owner)], strict=True)

    async def unregister_memory(self, memory: object) -> None:
        """Undo `register_memory` (by the same object or address)."""
        self._check_open()
        if isinstance(memory, int):
            address = memory
        else:
            view = memoryview(memory)  # type: ignore[arg-type]
            view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
            address = _address(view)
        if not self._regions.remove(address):
            raise ValueError("this memory is not registered")
        store = self._store
        await self.run_job(lambda stop: store.unregister_buffer(address))

    async def _register(self, regions: list[tuple[int, int, object]], *, strict: bool) -> None:
        store = self._store
        codes: list[int] = []

        def job(stop: threading.Event) -> None:
            for address, size, _ in regions:
                codes.append(int(store.register_buffer(address, size)))

        try:
            await self.run_job(job)
        finally:
            # Cancelled or not, the job has finished: what it registered must be known here,
            # or close() would hand the pooled client back with stale registrations.
            for (address, size, owner), code in zip(regions, codes, strict=False):
                if code == 0 and not self._regions.overlaps(address, size):
                    self._regions.add(address, size, owner)
        for (address, size, _), code in zip(regions, codes, strict=True):
            if code == 0:
                continue
            if strict:
                raise StorageError(f"{self._name}: register_buffer failed with {code}")
            if len(self._refused) >= _MAX_REFUSED:
                self._refused.clear()
            self._refused.add((address, size))
            log.warning("storage.mooncake.register_failed", backend=self._name, code=code)

    # Lifecycle.

    async def _open(self) -> None:
        self._opening = opening = asyncio.Event()
        try:
            await self._open_client()
        finally:
            opening.set()

    async def _open_client(self) -> None:
        library = client_library()
        try:
            arena = np.zeros(self._staging_size, dtype=np.uint8)
        except MemoryError as exc:
            raise StorageError(
                f"{self._name}: cannot allocate the staging arena "
                f"(staging_size={self._staging_size} bytes)"
            ) from exc
        arena_base = int(arena.ctypes.data)
        pending = list(self._pending)

        regions_of_open = [(arena_base, self._staging_size), *((a, n) for a, n, _ in pending)]
        key = self._client_key()
        # The client the job set up, for undoing it if the caller is cancelled meanwhile.
        opened: list[Any] = []

        def job(stop: threading.Event) -> tuple[Any, Any, str]:
            store = _POOL.take(key)
            if store is None:
                store = self._new_client(library.MooncakeDistributedStore)
            codes = [int(store.register_buffer(a, n)) for a, n in regions_of_open]
            if any(codes):
                for (address, _), code in zip(regions_of_open, codes, strict=True):
                    if code == 0:
                        store.unregister_buffer(address)
                _POOL.give_back(key, store)
                failed = next(c for c in codes if c)
                raise StorageError(f"{self._name}: register_buffer failed with {failed}")
            # From here on a failure or a cancellation undoes the registrations (`undo`).
            opened.append(store)
            config = library.ReplicateConfig()
            config.replica_num = self._replicas
            hostname = str(store.get_hostname())
            if self._placement == "local":
                # The master falls back to other segments when this one is full.
                config.preferred_segment = hostname
            return store, config, hostname

        def undo() -> None:
            (store,) = opened
            for address, _ in regions_of_open:
                store.unregister_buffer(address)
            _POOL.give_back(key, store)

        try:
            self._store, self._config, hostname = await self.run_job(job)
        except BaseException:
            if opened:  # failed or cancelled once registered: the client goes back as it came
                await self._run_while_closing(undo)
            raise
        self._local = LocalObjects(hostname) if self._direct_reads else None
        probe = http_probe(self._admin) if self._admin else tcp_probe(self._master_addr)
        self._watch = MasterWatch(probe, name=self._master)
        self._watch.start()
        self._arena_array = arena
        self._arena_view = arena.data
        self._arena_base = arena_base
        for address, size, owner in pending:
            self._regions.add(address, size, owner)
        self._pending.clear()

    async def close(self) -> None:
        """Stop running jobs and waits, wait for the jobs, hand the client back to the pool.
        Idempotent."""
        for pause in self._pauses:
            _wake(pause)
        await super().close()

    async def _pause(self, delay: float) -> None:
        """Sleep `delay` seconds, or until `close()` begins."""
        if self.closed:
            return
        loop = asyncio.get_running_loop()
        pause: asyncio.Future[None] = loop.create_future()
        timer = loop.call_later(delay, _wake, pause)
        self._pauses.add(pause)
        try:
            await pause
        finally:
            timer.cancel()
            self._pauses.discard(pause)

    async def _release(self) -> None:
        if self._watch is not None:
            self._watch.stop()
        if self._helpers is not None:
            self._helpers.shutdown(wait=False)  # every job (and so every helper) has finished
        store, self._store = self._store, None
        addresses = [*self._regions.addresses(), self._arena_base]
        key = self._client_key()

        def release() -> None:
            for address in addresses:
                store.unregister_buffer(address)
            _POOL.give_back(key, store)

        interrupted: asyncio.CancelledError | None = None
        if store is not None:
            # Until it is done, the registered memory stays referenced here.
            interrupted = await self._run_while_closing(release)
        self._regions = _Regions()
        self._arena_view = None
        self._arena_array = None
        if interrupted is not None:
            raise interrupted

    def _client_key(self) -> _ClientKey:
        return (
            self._master,
            self._metadata,
            self._protocol,
            self._device,
            self._local_hostname,
            self._segment_size,
            self._buffer_size,
        )

    def _new_client(self, factory: Callable[[], Any]) -> Any:
        # setup() retries a master or a metadata server that does not answer for minutes
        # (20 tries of 30 s, of 6 s for an HTTP metadata server) and holds the GIL while it
        # does, so no timeout or cancellation can cut it short: each is probed first.
        silent = _silent_server(self._master, self._metadata)
        if silent is not None:
            raise StorageError(f"{self._name}: {silent}")
        store = factory()
        code = store.setup(
            self._local_hostname,
            self._metadata,
            self._segment_size,
            self._buffer_size,
            self._protocol,
            self._device,
            self._master,
        )
        if code != 0:
            raise StorageError(f"{self._name}: Mooncake setup failed with {code}")
        return store

    def _occupancy(self) -> tuple[int, int, int | None]:
        return max(self._pages, 0), max(self._bytes, 0), self._capacity

    # The protocol.

    async def exists(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, exist consecutively (`batch_is_exist`)."""
        store = self._open_store()
        check_keys(keys)
        if not keys:
            await anyio.lowlevel.checkpoint()  # an async call always lets the loop run once
            return 0
        await self._check_master_turning()
        names = [self._mkey(k) for k in keys]

        def lookup(stop: threading.Event) -> list[int]:
            # Given up while it waited for a thread (its caller cancelled, the backend
            # closing): asking a master that may not answer could take its 30 s timeout.
            if stop.is_set():
                raise StorageError(f"{self._name}: exists given up before it began")
            return list(store.batch_is_exist(names))

        results = await self.run_job(lookup)
        count = 0
        for result in results:
            if result == 1:
                count += 1
            elif result == 0:
                break
            else:
                self._counters.errors += 1
                raise StorageError(f"{self._name}: exists failed with {result}")
        return count

    async def get(
        self, keys: Sequence[bytes], into: Sequence[PageBuffer], *, namespace: bytes
    ) -> list[Outcome]:
        """Read each page into its buffer (zero-copy where registered); one outcome each."""
        self._open_store()
        check_batch(keys, ("buffers", into))
        check_keys(keys, namespace)
        if not keys:
            await anyio.lowlevel.checkpoint()  # an async call always lets the loop run once
            return []
        targets = [byte_segments(page, writable=True) for page in into]
        if len(set(keys)) < len(keys):
            return await self._get_repeated(keys, into, targets, namespace)
        outcomes = [Outcome.ERROR] * len(keys)
        if self._master_down():
            await anyio.lowlevel.checkpoint()  # see _check_master_turning
            return self._count_failed(outcomes, get=True)
        plans = await self._plan(targets)
        self._count_paths(plans)
        corrupt: list[tuple[int, str]] = []
        removed: list[int] = []
        try:
            for chunk in self._chunks(plans):
                part = await self._staged(
                    chunk,
                    plans,
                    functools.partial(
                        self._get_job, keys, plans, namespace, corrupt=corrupt, removed=removed
                    ),
                )
                for i, (outcome, reason) in zip(chunk, part, strict=True):
                    outcomes[i] = outcome
                    if reason == _DIRECT:
                        self._direct_pages += 1
        finally:
            # A cancelled get's job has finished as well: count what it found and removed.
            for i, reason in corrupt:
                self._report_corrupt(keys[i], reason)
            # The stored size of a removed object is not known, the page's is.
            self._pages -= len(removed)
            self._bytes -= sum(HEADER_NBYTES + plans[i].nbytes for i in removed)
        c = self._counters
        c.gets += len(keys)
        c.get_hits += outcomes.count(Outcome.OK)
        c.errors += outcomes.count(Outcome.ERROR)
        return outcomes

    async def _get_repeated(
        self,
        keys: Sequence[bytes],
        into: Sequence[PageBuffer],
        targets: Sequence[list[memoryview]],
        namespace: bytes,
    ) -> list[Outcome]:
        """A get whose batch names a key more than once. Mooncake's batch read fills only the
        last buffer of an object named twice yet reports every one of them read, so another
        buffer would keep what its staging slot or page held before: each key is read once
        per length asked, and a repeat of the same length takes that read's outcome and a
        copy of its bytes."""
        first: dict[tuple[bytes, int], int] = {}
        copies: dict[int, int] = {}
        for i, key in enumerate(keys):
            f = first.setdefault((key, sum(s.nbytes for s in targets[i])), i)
            if f != i:
                copies[i] = f
        # Lengths of one key that differ are read in calls of their own, one after another.
        rounds: list[list[int]] = []
        seen: dict[bytes, int] = {}
        for i in first.values():
            turn = seen.get(keys[i], 0)
            seen[keys[i]] = turn + 1
            if turn == len(rounds):
                rounds.append([])
            rounds[turn].append(i)
        outcomes = [Outcome.ERROR] * len(keys)
        for positions in rounds:
            part = await self.get(
                [keys[i] for i in positions], [into[i] for i in positions], namespace=namespace
            )
            for i, outcome in zip(positions, part, strict=True):
                outcomes[i] = outcome
        for i, f in copies.items():
            outcomes[i] = outcomes[f]
            if outcomes[f] is Outcome.OK:
                _native.copy_checksum(targets[i], targets[f])
        repeated = [outcomes[i] for i in copies]
        c = self._counters
        c.gets += len(repeated)
        c.get_hits += repeated.count(Outcome.OK)
        c.corrupt += repeated.count(Outcome.CORRUPT)
        c.errors += repeated.count(Outcome.ERROR)
        return outcomes

    async def put(
        self, keys: Sequence[bytes], pages: Sequence[PageBuffer], metas: Sequence[PageMeta]
    ) -> list[Outcome]:
        """Store each missing page whole (Mooncake publishes an object only once all of it
        has arrived); an existing key is kept and is OK."""
        self._open_store()
        check_put(keys, pages, metas)
        if not keys:
            await anyio.lowlevel.checkpoint()  # an async call always lets the loop run once
            return []
        # A key given twice is sent once (its first page): Mooncake would report both copies
        # of one object as stored. The repeats take the first one's outcome.
        position: dict[bytes, int] = {}
        firsts: list[int] = []
        for i, key in enumerate(keys):
            if key not in position:
                position[key] = len(firsts)
                firsts.append(i)
        segments = [byte_segments(page, writable=False) for page in pages]  # checks them all
        if self._master_down():
            await anyio.lowlevel.checkpoint()  # see _check_master_turning
            return self._count_failed([Outcome.ERROR] * len(keys), get=False)
        unique = [keys[i] for i in firsts]
        unique_metas = [metas[i] for i in firsts]
        plans = await self._plan([segments[i] for i in firsts])
        self._count_paths(plans)
        sent = [Outcome.ERROR] * len(unique)
        stored: list[int] = []
        # (index, Mooncake's code) of each refused page, per try: only the last try's
        # refusals of a page are logged.
        refused: list[tuple[int, int]] = []
        retry_refused: list[tuple[int, int]] = []
        retried = False
        try:
            await self._put_pages(
                unique,
                plans,
                unique_metas,
                range(len(unique)),
                sent=sent,
                stored=stored,
                refused=refused,
            )
            full = [i for i, code in refused if code == _NO_SPACE]
            if full:
                # Cancellable on the loop, and a close ends it: these pages then stay MISS,
                # as they do for a master found down meanwhile (a try would wait out its
                # timeout).
                await self._pause(_NO_SPACE_RETRY_S)
                if not self.closed and not self._master_down():
                    retried = True
                    await self._put_pages(
                        unique,
                        plans,
                        unique_metas,
                        full,
                        sent=sent,
                        stored=stored,
                        refused=retry_refused,
                    )
        finally:
            # A cancelled put's job has finished as well: count what it stored.
            self._pages += len(stored)
            self._bytes += sum(HEADER_NBYTES + plans[i].nbytes for i in stored)
            last = [r for r in refused if not (retried and r[1] == _NO_SPACE)]
            self._log_refused([code for _, code in last + retry_refused])
        outcomes = [sent[position[key]] for key in keys]
        c = self._counters
        c.puts += len(keys)
        c.put_ok += outcomes.count(Outcome.OK)
        c.errors += outcomes.count(Outcome.ERROR)
        return outcomes

    async def _put_pages(
        self,
        keys: Sequence[bytes],
        plans: Sequence[_Plan],
        metas: Sequence[PageMeta],
        indices: Sequence[int],
        *,
        sent: list[Outcome],
        stored: list[int],
        refused: list[tuple[int, int]],
    ) -> None:
        """Put the pages at `indices` (into `keys`, `plans` and `metas`), chunk by chunk,
        setting their outcomes in `sent`."""
        for part_range in self._chunks([plans[i] for i in indices]):
            chunk = indices[part_range.start : part_range.stop]
            part = await self._staged(
                chunk,
                plans,
                functools.partial(
                    self._put_job, keys, plans, metas, stored=stored, refused=refused
                ),
            )
            for i, outcome in zip(chunk, part, strict=True):
                sent[i] = outcome

    def _log_refused(self, codes: list[int]) -> None:
        """Log each kind of refused put (at most once a minute per kind): a full cluster's
        refusals are MISS outcomes, which nothing else reports."""
        for code in sorted(set(codes)):
            event = _PUT_NO_SPACE if code == _NO_SPACE else _PUT_FAILED
            pages = codes.count(code)
            # A line left out still counts its pages in the next one's.
            admitted = self._put_log.admit_counting(event, str(code), pages)
            if admitted is not None:
                log.warning(
                    event,
                    backend=self._name,
                    code=code,
                    pages=pages,
                    unlogged_since_last=admitted[0],
                    unlogged_pages_since_last=admitted[1],
                )

    async def delete(self, keys: Sequence[bytes]) -> int:
        """Remove the objects (forced: a reader's lease does not hold them); how many
        existed."""
        store = self._open_store()
        check_keys(keys)
        if not keys:
            await anyio.lowlevel.checkpoint()  # an async call always lets the loop run once
            return 0
        await self._check_master_turning()
        removed, _, failed = await self._remove(store, keys, evictions=False)
        if failed:
            code = failed[0][1]
            raise StorageError(f"{self._name}: delete failed for {len(failed)} keys: {code}")
        return removed

    async def _remove(
        self, store: Any, keys: Sequence[bytes], *, evictions: bool
    ) -> tuple[int, int, list[tuple[int, int]]]:
        """Remove the objects; (how many existed, their stored bytes, (position, error code)
        of each that could not be removed), counted as deletes or evictions (failures as
        errors)."""
        names = [self._mkey(k) for k in keys]

        def job(stop: threading.Event) -> tuple[list[int], list[int]]:
            # Sizes first, for the byte counts: Mooncake's remove does not say.
            sizes = _present_sizes(store, names)
            if self._master_down():  # the sizes call waited for a master gone meanwhile
                return [_RPC_FAIL] * len(names), sizes
            return list(store.batch_remove(names, force=True)), sizes

        results, sizes = await self.run_job(job)
        removed = freed = 0
        for result, size in zip(results, sizes, strict=True):
            if result == 0:
                removed += 1
                freed += max(size, 0)
                self._pages -= 1
                self._bytes -= max(size, 0)
        if evictions:
            self._counters.evictions += removed
        else:
            self._counters.deletes += removed
        # Another client still putting the object (-703): the put lands after this delete.
        failed = [(i, r) for i, r in enumerate(results) if r not in (0, _NOT_FOUND, _NOT_READY)]
        self._counters.errors += len(failed)
        return removed, freed, failed

    # Raw access (RawAccess).

    async def read_raw(self, key: bytes) -> bytes | None:
        """The stored `header ‖ payload` of `key`, or None when absent."""
        store = self._open_store()
        check_key(key)
        await self._check_master_turning()
        name = self._mkey(key)

        def job(stop: threading.Event) -> bytes | None:
            size = int(store.get_size(name))
            if size == _NOT_FOUND:
                return None
            if size < 0:
                raise StorageError(f"{self._name}: read_raw failed with {size}")
            value = bytes(store.get(name))
            if len(value) != size:
                raise StorageError(f"{self._name}: read_raw got {len(value)} of {size} bytes")
            return value

        return await self.run_job(job)

    async def write_raw(self, key: bytes, value: bytes) -> None:
        """Store `value` under `key` as is, replacing what is there (`upsert`)."""
        store = self._open_store()
        check_key(key)
        await self._check_master_turning()
        name = self._mkey(key)
        code = await self.run_job(lambda stop: int(store.upsert(name, bytes(value))))
        if code != 0:
            raise StorageError(f"{self._name}: write_raw failed with {code}")

    # Maintenance (MaintainableStorage); the object list comes from the master's admin API.

    async def list_pages(self, limit: int | None = None) -> list[PageInfo]:
        """Pages under the prefix, newest first.

        Mooncake reports no access times, so `last_access` is the page's creation time.
        Needs `admin` (the master's admin/metrics URL).
        """
        store = self._open_store()
        names = await self._list_names()
        pages: list[PageInfo] = []
        step = min(self._max_batch_pages, self._arena.capacity // HEADER_NBYTES)
        for start in range(0, len(names), step):
            part = names[start : start + step]
            base = await self._acquire_arena(len(part) * HEADER_NBYTES)
            try:
                pages.extend(
                    await self.run_job(functools.partial(self._headers_job, store, part, base))
                )
            finally:
                self._arena.release(base, len(part) * HEADER_NBYTES)
        pages.sort(key=lambda p: p.last_access, reverse=True)
        return pages if limit is None else pages[:limit]

    async def verify(self) -> VerifyReport:
        """Read every page under the prefix and remove the ones that fail their checks.

        Without a namespace only what a page says about itself is checked: header, key,
        length, checksum, and the MAC when this instance holds a key. A page that cannot be
        read is left in place, not checked, and counted in `stats().errors`. Needs `admin`.
        """
        store = self._open_store()
        pages = await self.list_pages()
        checked = ok = unsupported = unchecked = 0
        bad: list[bytes] = []
        batch: list[PageInfo] = []
        batch_bytes = 0

        async def flush() -> None:
            nonlocal checked, ok, unsupported, unchecked, batch, batch_bytes
            if not batch:
                return
            need = sum(_Arena.rounded(p.nbytes) for p in batch)
            base = await self._acquire_arena(need)
            try:
                checks = await self.run_job(
                    functools.partial(self._verify_job, store, list(batch), base)
                )
            finally:
                self._arena.release(base, need)
            for info, check in zip(batch, checks, strict=True):
                if check is None:
                    continue  # gone since it was listed
                if isinstance(check, int):
                    # Not read (a failed transfer, the master not answering): left in place.
                    self._counters.errors += 1
                    unchecked += 1
                    log.warning(
                        "storage.page.error", backend=self._name, key=info.key.hex(), error=check
                    )
                    continue
                checked += 1
                if check is PageCheck.OK:
                    ok += 1
                elif check is PageCheck.UNSUPPORTED:
                    unsupported += 1
                else:
                    bad.append(info.key)
                    self._report_corrupt(info.key, "verify")
            batch, batch_bytes = [], 0

        for info in pages:
            size = _Arena.rounded(info.nbytes)
            if size > self._arena.capacity:
                log.warning(
                    "storage.mooncake.verify_skipped",
                    backend=self._name,
                    key=info.key.hex(),
                    nbytes=info.nbytes,
                )
                unchecked += 1
                continue
            if batch_bytes + size > self._arena.capacity or len(batch) >= self._max_batch_pages:
                await flush()
            batch.append(info)
            batch_bytes += size
        await flush()
        removed = await self.delete(bad) if bad else 0
        return VerifyReport(
            checked=checked,
            ok=ok,
            corrupt_removed=removed,
            unsupported=unsupported,
            leftovers_removed=0,
            unchecked=unchecked,
        )

    async def gc(self) -> GcReport:
        """Evict the oldest pages until those under the prefix fit `capacity`.

        Without a capacity this evicts nothing (the master evicts on its own when its memory
        passes `eviction_high_watermark_ratio`), once the master has answered one existence
        query: a master that does not answer raises StorageError, as with a capacity, not an
        empty report that reads as success.
        """
        store = self._open_store()
        if self._capacity is None:
            await self._check_master_turning()
            probe = [self._mkey(bytes(32))]
            (answer,) = await self.run_job(lambda stop: list(store.batch_is_exist(probe)))
            if answer not in (0, 1):
                raise StorageError(
                    f"{self._name}: gc failed: the Mooncake master did not answer ({answer})"
                )
            return GcReport(evicted_pages=0, freed_bytes=0)
        pages = await self.list_pages()
        total = sum(p.nbytes for p in pages)
        victims: list[PageInfo] = []
        while pages and total > self._capacity:
            victims.append(pages.pop())
            total -= victims[-1].nbytes
        if not victims:
            return GcReport(evicted_pages=0, freed_bytes=0)
        # What was removed, not what was chosen: another client may have removed some since.
        # Objects the master refused to remove stay, counted (as in the file store's gc); a
        # master that did not answer is the backend failing, not a page.
        keys = [p.key for p in victims]
        evicted, freed, failed = await self._remove(store, keys, evictions=True)
        if any(code == _RPC_FAIL for _, code in failed):
            raise StorageError(f"{self._name}: gc failed: the Mooncake master did not answer")
        if failed:
            log.warning(
                "storage.evict.error", backend=self._name, pages=len(failed), error=failed[0][1]
            )
        stayed = sum(victims[position].nbytes for position, _ in failed)
        return GcReport(
            evicted_pages=evicted,
            freed_bytes=freed,
            failed=len(failed),
            over_capacity_bytes=max(0, total + stayed - self._capacity),
        )

    # Internals: planning and staging (event loop).

    def _open_store(self) -> Any:
        self._check_open()
        return self._store

    def _master_store(self) -> Any:
        """The client, for a call that goes to the master (the warmup manifest's): raises
        StorageError at once while the master is known not to answer."""
        store = self._open_store()
        self._check_master()
        return store

    async def _master_store_turning(self) -> Any:
        """`_master_store`, letting the loop run once before it raises (see
        `_check_master_turning`)."""
        store = self._open_store()
        await self._check_master_turning()
        return store

    def _master_down(self) -> bool:
        """Whether the master is known not to answer now (see _mooncake_watch)."""
        return self._watch is not None and self._watch.down

    def _count_failed(self, outcomes: list[Outcome], *, get: bool) -> list[Outcome]:
        """Count a batch that failed whole before any call (the master is not answering)."""
        c = self._counters
        if get:
            c.gets += len(outcomes)
        else:
            c.puts += len(outcomes)
        c.errors += len(outcomes)
        return outcomes

    async def _check_master_turning(self) -> None:
        """`_check_master`, letting the loop run once before it raises: a task calling in a
        loop against a master known down would otherwise never give the loop a turn."""
        if self._master_down():
            await anyio.lowlevel.checkpoint()
        self._check_master()

    def _check_master(self) -> None:
        """StorageError at once while the master is known not to answer: a call would wait
        seconds for the same failure."""
        if self._master_down():
            self._counters.errors += 1
            raise StorageError(f"{self._name}: the Mooncake master is not answering")

    async def _acquire_arena(self, nbytes: int) -> int:
        """`nbytes` of the staging arena; StorageError if the backend closed while waiting
        for them (the arena's memory is gone then)."""
        base = await self._arena.acquire(nbytes)
        if self.closed:
            self._arena.release(base, nbytes)
            self._check_open()
        return base

    def _mkey(self, key: bytes) -> str:
        return f"{self._prefix}:{key.hex()}"

    async def _plan(self, pages: list[list[memoryview]]) -> list[_Plan]:
        """Addresses of every segment, registering host pools met for the first time."""
        addresses = [[_address(s) for s in segs if len(s)] for segs in pages]
        segments = [[s for s in segs if len(s)] for segs in pages]
        if self._auto_register:
            candidates: dict[int, tuple[int, int, object]] = {}
            for segs, addrs in zip(segments, addresses, strict=True):
                for seg, address in zip(segs, addrs, strict=True):
                    if self._regions.covers(address, len(seg)):
                        continue
                    root = _root_region(seg)
                    if root is None or root[1] < self._auto_register:
                        continue
                    start, size, _ = root
                    if (
                        (start, size) in self._refused
                        or not start <= address <= address + len(seg) <= start + size
                        or self._regions.overlaps(start, size)
                    ):
                        continue
                    candidates[start] = root
            if candidates:
                await self._register(list(candidates.values()), strict=False)
        return [
            _Plan(
                segs,
                addrs,
                all(self._regions.covers(a, len(s)) for s, a in zip(segs, addrs, strict=True)),
            )
            for segs, addrs in zip(segments, addresses, strict=True)
        ]

    @staticmethod
    def _worth_fanning(items: Sequence[Any], chunk: Sequence[int], plans: Sequence[_Plan]) -> bool:
        """Enough payload to hash that helper threads pay for their hand-offs."""
        total = 0
        for item in items:
            j = item[0] if isinstance(item, tuple) else item
            total += plans[chunk[j]].nbytes
        return len(items) > 1 and total >= _FANOUT_MIN_BYTES

    def _count_paths(self, plans: Sequence[_Plan]) -> None:
        zero_copy = sum(1 for plan in plans if plan.zero_copy)
        self._zero_copy_pages += zero_copy
        self._staged_pages += len(plans) - zero_copy

    def _chunks(self, plans: Sequence[_Plan]) -> list[range]:
        """Index ranges that each fit the arena and `max_batch_pages` (usually one)."""
        chunks: list[range] = []
        start = 0
        used = 0
        for i, plan in enumerate(plans):
            need = min(plan.arena_bytes, self._arena.capacity)
            if i > start and (
                used + need > self._arena.capacity or i - start >= self._max_batch_pages
            ):
                chunks.append(range(start, i))
                start, used = i, 0
            used += need
        if start < len(plans):
            chunks.append(range(start, len(plans)))
        return chunks

    async def _staged(
        self,
        chunk: Sequence[int],
        plans: Sequence[_Plan],
        job: Callable[[Sequence[int], int], Callable[[threading.Event], list[Any]]],
    ) -> list[Any]:
        """Run one chunk's job with its arena space held; pages too large for the arena
        fail alone (ERROR) instead of failing the chunk."""
        too_big = [plans[i].arena_bytes > self._arena.capacity for i in chunk]
        unlogged = self._too_big_log.admit(_TOO_BIG) if any(too_big) else None
        if unlogged is not None:
            log.warning(
                _TOO_BIG,
                backend=self._name,
                staging_size=self._arena.capacity,
                unlogged_since_last=unlogged,
            )
        need = sum(plans[i].arena_bytes for i, big in zip(chunk, too_big, strict=True) if not big)
        base = await self._acquire_arena(need)
        try:
            return await self.run_job(job(chunk, base))
        finally:
            self._arena.release(base, need)

    # Internals: thread jobs (no loop-owned state is touched from these).

    def _slots(self, plans: Sequence[_Plan], chunk: Sequence[int], base: int) -> list[int | None]:
        """Arena offset of each page's slot (None: the page does not fit the arena)."""
        slots: list[int | None] = []
        offset = base
        for i in chunk:
            if plans[i].arena_bytes > self._arena.capacity:
                slots.append(None)
                continue
            slots.append(offset)
            offset += plans[i].arena_bytes
        return slots

    def _get_job(
        self,
        keys: Sequence[bytes],
        plans: Sequence[_Plan],
        namespace: bytes,
        chunk: Sequence[int],
        base: int,
        *,
        corrupt: list[tuple[int, str]],
        removed: list[int],
    ) -> Callable[[threading.Event], list[tuple[Outcome, str]]]:
        """The job reading `chunk`; it appends the pages it finds damaged to `corrupt` (index,
        reason) and, once per object, those whose object it removed to `removed`."""
        store, arena, arena_base = self._store, self._arena_view, self._arena_base
        mac_key, local = self._mac_key, self._local
        assert arena is not None
        slots = self._slots(plans, chunk, base)

        def read_in_place(
            todo: list[int], results: list[tuple[Outcome, str]], stop: threading.Event
        ) -> list[int]:
            """Serve what lies in this client's segment; the rest, still to read."""
            assert local is not None
            names = [self._mkey(keys[chunk[j]]) for j in todo]
            sizes = [HEADER_NBYTES + plans[chunk[j]].nbytes for j in todo]
            items = list(local.sources(store, names, sizes).items())
            served = [False] * len(items)

            def read(index: int) -> None:
                position, view = items[index]
                i = chunk[todo[position]]
                plan = plans[i]
                header = decode_header(view[:HEADER_NBYTES])
                result = check_header(
                    header,
                    key=keys[i],
                    namespace=namespace,
                    payload_nbytes=plan.nbytes,
                    stored_nbytes=view.nbytes,
                )
                if result is not PageCheck.OK or isinstance(header, PageCheck):
                    return  # the engine's path decides (corrupt, newer, or changed meanwhile)
                digest = _native.copy_checksum(plan.segments, [view[HEADER_NBYTES:]])
                checked = verify_payload(header, plan.segments, mac_key=mac_key, checksum=digest)
                served[index] = checked is PageCheck.OK

            local_pages = [todo[position] for position, _ in items]
            width = self._threads if self._worth_fanning(local_pages, chunk, plans) else 1
            fan_out(self._helpers, len(items), read, stop, width)
            done = {items[k][0] for k, ok in enumerate(served) if ok}
            for position in done:
                results[todo[position]] = (Outcome.OK, _DIRECT)
            return [j for position, j in enumerate(todo) if position not in done]

        def judged_whole(
            i: int, name: str, again: Callable[[], PageCheck | None]
        ) -> PageCheck | None:
            # The object read whole and judged; None when it is gone or changed meanwhile, or
            # too big to read just to judge. Mooncake's `get` copies through its local buffer
            # and gives nothing for an object larger than it: `again` then judges instead.
            size = int(store.get_size(name))
            if size < 0 or size > _MAX_JUDGED_BYTES:
                return None
            value = memoryview(bytes(store.get(name)))
            if not value and size:
                return again()
            if len(value) != size:
                return None
            header = decode_header(value[:HEADER_NBYTES])
            verdict = check_header(
                header,
                key=keys[i],
                namespace=namespace,
                payload_nbytes=plans[i].nbytes,
                stored_nbytes=size,
            )
            if verdict is PageCheck.OK and not isinstance(header, PageCheck):
                return verify_payload(header, [value[HEADER_NBYTES:]], mac_key=mac_key)
            return verdict

        def judged_by_header(j: int, name: str) -> PageCheck | None:
            # The object's header, read through the engine into the page's own slot, judged
            # against its stored length; None when it is gone or changed meanwhile.
            i, slot = chunk[j], slots[j]
            assert slot is not None
            size = int(store.get_size(name))
            if size < 0:
                return None
            if size < HEADER_NBYTES:
                return PageCheck.CORRUPT  # shorter than any page's header
            got = store.get_into_ranges(
                [arena_base], [[name]], [[[slot]]], [[[0]]], [[[HEADER_NBYTES]]]
            )
            counts = list(got[0][0]) if got and got[0] else []
            if counts != [HEADER_NBYTES] or int(store.get_size(name)) != size:
                return None
            verdict = check_header(
                decode_header(arena[slot : slot + HEADER_NBYTES]),
                key=keys[i],
                namespace=namespace,
                payload_nbytes=plans[i].nbytes,
                stored_nbytes=size,
            )
            return None if verdict is PageCheck.OK else verdict  # OK: now of the page's length

        def other_length(j: int, name: str) -> tuple[Outcome, str]:
            # Stored at another length than the buffer, and whole (Mooncake publishes objects
            # whole). A page that agrees with itself (another layout under shared keys, or a
            # reader's wrong-sized buffer) is a miss left in place; only a damaged one goes.
            # Its header tells which, whatever its size: the payload of a page of another
            # length is its own readers' to check, and Mooncake's `get`, which copies through
            # its local buffer, gives nothing for an object larger than `buffer_size`.
            if judged_by_header(j, name) is PageCheck.CORRUPT:
                return (Outcome.CORRUPT, "length")
            return (Outcome.MISS, "")

        def job(stop: threading.Event) -> list[tuple[Outcome, str]]:
            results: list[tuple[Outcome, str]] = [(Outcome.ERROR, "")] * len(chunk)
            todo = [j for j, slot in enumerate(slots) if slot is not None]
            if local is not None and todo:
                todo = read_in_place(todo, results, stop)
                # Stopped, or the lookup waited for a master gone meanwhile (the rest ERROR).
                if stop.is_set() or self._master_down():
                    return results
            names = [self._mkey(keys[chunk[j]]) for j in todo]
            buffers, sizes = _object_buffers(todo, plans, chunk, slots, arena_base)
            codes = list(store.batch_get_into_multi_buffers(names, buffers, sizes)) if todo else []
            damaged: list[tuple[int, str]] = []  # (j, name), judged on a whole read
            suspect: list[tuple[int, str]] = []  # (j, name), failed the check of the batch read
            arrived: list[tuple[int, str]] = []
            expected = [HEADER_NBYTES + plans[chunk[j]].nbytes for j in todo]
            states = _read_states(store, names, codes, expected)
            for j, name, state in zip(todo, names, states, strict=True):
                if state == "missing":
                    results[j] = (Outcome.MISS, "")
                elif state == "damaged":
                    results[j] = other_length(j, name)
                    if results[j][0] is Outcome.CORRUPT:
                        damaged.append((j, name))
                elif state == "failed":
                    results[j] = (Outcome.ERROR, "")
                else:
                    arrived.append((j, name))
            checks: list[tuple[PageCheck, str] | None] = [None] * len(arrived)

            def check(index: int) -> None:
                j = arrived[index][0]
                i, slot, plan = chunk[j], slots[j], plans[chunk[j]]
                assert slot is not None
                header = decode_header(arena[slot : slot + HEADER_NBYTES])
                result = check_header(  # the object arrived: it is as long as the page
                    header,
                    key=keys[i],
                    namespace=namespace,
                    payload_nbytes=plan.nbytes,
                    stored_nbytes=HEADER_NBYTES + plan.nbytes,
                )
                if result is PageCheck.OK and not isinstance(header, PageCheck):
                    if plan.zero_copy:
                        result = verify_payload(header, plan.segments, mac_key=mac_key)
                    else:
                        staged = arena[slot + HEADER_NBYTES : slot + HEADER_NBYTES + plan.nbytes]
                        result = verify_payload(header, [staged], mac_key=mac_key)
                        if result is PageCheck.OK:
                            scatter(staged, plan.segments)
                checks[index] = (result, _header_reason(header, keys[i], namespace, plan.nbytes))

            # Checksums (and staged copies) of many MiB: spread over the helper threads. A
            # cancelled caller's stop flag ends the hand-out; unchecked pages stay ERROR.
            width = self._threads if self._worth_fanning(arrived, chunk, plans) else 1
            fan_out(self._helpers, len(arrived), check, stop, width)
            for (j, name), checked in zip(arrived, checks, strict=True):
                if checked is None:
                    continue
                result, reason = checked
                if result is PageCheck.OK:
                    results[j] = (Outcome.OK, "")
                elif result is PageCheck.UNSUPPORTED:
                    results[j] = (Outcome.MISS, "")  # a newer writer's page: left in place
                else:
                    results[j] = (Outcome.CORRUPT, reason)
                    suspect.append((j, name))

            def read_again(j: int, name: str) -> PageCheck | None:
                # The page read once more as the batch read it (no local buffer needed);
                # None when it is gone, or stored at another length, meanwhile.
                plan, slot = plans[chunk[j]], slots[j]
                assert slot is not None
                buffers, sizes = _object_buffers([j], plans, chunk, slots, arena_base)
                code = int(store.batch_get_into_multi_buffers([name], buffers, sizes)[0])
                if code != HEADER_NBYTES + plan.nbytes:
                    return None
                header = decode_header(arena[slot : slot + HEADER_NBYTES])
                result = check_header(
                    header,
                    key=keys[chunk[j]],
                    namespace=namespace,
                    payload_nbytes=plan.nbytes,
                    stored_nbytes=code,
                )
                if result is not PageCheck.OK or isinstance(header, PageCheck):
                    return result
                if plan.zero_copy:
                    return verify_payload(header, plan.segments, mac_key=mac_key)
                staged = arena[slot + HEADER_NBYTES : slot + HEADER_NBYTES + plan.nbytes]
                return verify_payload(header, [staged], mac_key=mac_key)

            # A read sees other bytes when the object was removed and its memory reused while
            # it ran (a concurrent delete and put): only an object that reads damaged again,
            # whole, is judged corrupt and removed; else it is a miss left alone.
            for j, name in suspect:
                again = functools.partial(read_again, j, name)
                if judged_whole(chunk[j], name, again) is PageCheck.CORRUPT:
                    damaged.append((j, name))
                else:
                    results[j] = (Outcome.MISS, "")
            if damaged:
                corrupt.extend((chunk[j], results[j][1]) for j, _ in damaged)
                # One remove per object (a key may come twice), and only a removal this call
                # made counts: a concurrent get of the same page may have removed it first.
                first: dict[str, int] = {}
                for j, name in damaged:
                    first.setdefault(name, chunk[j])
                doomed = list(first)
                gone = list(store.batch_remove(doomed, force=True))
                removed.extend(first[n] for n, c in zip(doomed, gone, strict=True) if c == 0)
            return results

        return job

    def _put_job(
        self,
        keys: Sequence[bytes],
        plans: Sequence[_Plan],
        metas: Sequence[PageMeta],
        chunk: Sequence[int],
        base: int,
        *,
        stored: list[int],
        refused: list[tuple[int, int]],
    ) -> Callable[[threading.Event], list[Outcome]]:
        """The job storing `chunk`; it appends what it stored to `stored` and each page
        refused, with Mooncake's code, to `refused`."""
        store, arena, arena_base = self._store, self._arena_view, self._arena_base
        config, mac_key = self._config, self._mac_key
        assert arena is not None
        slots = self._slots(plans, chunk, base)
        group_bytes = self._put_group_bytes

        def job(stop: threading.Event) -> list[Outcome]:
            results = [Outcome.ERROR] * len(chunk)
            candidates = [j for j, slot in enumerate(slots) if slot is not None]
            name_of = {j: self._mkey(keys[chunk[j]]) for j in candidates}
            # Existing pages are OK as they are: skip their checksum and transfer.
            present = list(store.batch_is_exist(list(name_of.values()))) if name_of else []
            todo: list[int] = []
            for j, state in zip(candidates, present, strict=True):
                if state == 1:
                    results[j] = Outcome.OK
                elif state == 0:
                    todo.append(j)
                # else: the master did not answer; a put would fail the same way (slowly).
            groups = _put_groups(todo, [plans[chunk[j]].nbytes for j in todo], group_bytes)

            def prepare(j: int) -> None:
                plan, slot = plans[chunk[j]], slots[j]
                assert slot is not None
                header = encode_header(metas[chunk[j]], plan.segments, mac_key=mac_key)
                arena[slot : slot + HEADER_NBYTES] = header
                if not plan.zero_copy:
                    offset = slot + HEADER_NBYTES
                    for segment in plan.segments:
                        arena[offset : offset + len(segment)] = segment
                        offset += len(segment)

            def send(index: int) -> None:
                # One lane checksums its group while another lane's group is in transfer:
                # the two passes overlap instead of adding up.
                group = groups[index]
                ready = [False] * len(group)

                def prepare_one(k: int) -> None:
                    prepare(group[k])
                    ready[k] = True

                # A lone group spreads its checksums over the helpers instead.
                alone = len(groups) == 1 and self._worth_fanning(group, chunk, plans)
                fan_out(self._helpers, len(group), prepare_one, stop, self._threads if alone else 1)
                sent = [j for j, done in zip(group, ready, strict=True) if done]
                if not sent or stop.is_set():
                    return  # a cancelled caller waits for this job: no transfer it gave up
                buffers, sizes = _object_buffers(sent, plans, chunk, slots, arena_base)
                names = [name_of[j] for j in sent]
                codes = list(store.batch_put_from_multi_buffers(names, buffers, sizes, config))
                for j, code in zip(sent, codes, strict=True):
                    if code == 0:
                        stored.append(chunk[j])  # list.append is atomic: lanes share it
                    if code in (0, _ALREADY_EXISTS):
                        results[j] = Outcome.OK
                        continue
                    refused.append((chunk[j], code))
                    results[j] = Outcome.MISS if code == _NO_SPACE else Outcome.ERROR

            # A cancelled caller's stop flag ends the hand-out; pages not sent stay ERROR.
            fan_out(self._helpers, len(groups), send, stop, _PUT_LANES)
            return results

        return job

    async def _list_names(self) -> list[str]:
        """Object names under the prefix that are page keys (from `/get_all_keys`)."""
        if self._admin is None:  # a missing URL parameter: configuration, not a failure
            raise StorageConfigError(
                f"{self._name}: listing pages needs the master's admin URL (?admin=http://...)"
            )
        await self._check_master_turning()
        url = f"{self._admin}/get_all_keys"
        lead = f"{self._prefix}:"
        longest = len(lead.encode()) + 64 + _KEY_LINE_SLACK
        names: list[str] = []

        def keep(lines: bytes) -> None:
            # Whole lines only: a newline never falls inside a multi-byte character.
            for line in lines.decode(errors="replace").splitlines():
                name = line.strip()
                if not name.startswith(lead):
                    continue
                tail = name[len(lead) :]
                if len(tail) != 64 or tail.strip(_HEX_DIGITS):
                    continue  # not a page name of ours despite the prefix (as `_mkey` writes them)
                names.append(name)

        def too_long() -> StorageError:
            return StorageError(
                f"{self._name}: {mask_userinfo(url)} answered more than "
                f"{_MAX_KEY_LIST_BYTES // _MiB} MiB of object names; the listing stops there"
            )

        listing = _Interruptible()

        def job(stop: threading.Event) -> None:
            # Read a piece at a time, keeping only this prefix's page names: the answer lists
            # every object in the cluster, which can be far more than this store's pages.
            try:
                with listing.opener().open(url, timeout=_ADMIN_TIMEOUT_S) as response:
                    if response.length is not None and response.length > _MAX_KEY_LIST_BYTES:
                        raise too_long()
                    total = 0
                    pending = b""  # the start of a line the next piece ends
                    skipping = False  # within a line too long to be a page name
                    while True:
                        if stop.is_set():
                            # A close, not only a cancelled caller, stops the read: the names
                            # read so far are no listing of the store.
                            raise StorageError(f"{self._name} is closed")
                        piece = response.read(_KEY_LIST_READ_BYTES)
                        if stop.is_set():  # the read may have ended at the socket's shutdown
                            raise StorageError(f"{self._name} is closed")
                        if not piece:
                            if response.length:  # unlike read(), read(n) takes a cut answer
                                raise http.client.IncompleteRead(b"", response.length)
                            keep(pending)
                            return
                        total += len(piece)
                        if total > _MAX_KEY_LIST_BYTES:
                            raise too_long()
                        data = pending + piece
                        if skipping:
                            end = data.find(b"\n")
                            data = b"" if end < 0 else data[end + 1 :]
                            skipping = end < 0
                        whole, newline, pending = data.rpartition(b"\n")
                        keep(whole + newline)
                        if len(pending) > longest:
                            # Kept whole, a line without end would be copied at every piece.
                            pending = b""
                            skipping = True
            except (OSError, http.client.HTTPException) as exc:  # URLError is an OSError
                if stop.is_set():  # the socket was shut down under the read
                    raise StorageError(f"{self._name} is closed") from exc
                raise StorageError(f"{self._name}: {mask_userinfo(url)} failed: {exc}") from exc

        # A cancellation or a close shuts the socket down: a read waiting for the next piece
        # (up to the timeout without data) ends at once, and no thread is left blocked.
        await self.run_job(job, interrupt=listing.shut)
        return names

    def _headers_job(
        self, store: Any, names: Sequence[str], base: int, stop: threading.Event
    ) -> list[PageInfo]:
        arena = self._arena_view
        assert arena is not None
        offsets = [[base + n * HEADER_NBYTES] for n in range(len(names))]
        got = store.get_into_ranges(
            [self._arena_base],
            [list(names)],
            [offsets],
            [[[0]] * len(names)],
            [[[HEADER_NBYTES]] * len(names)],
        )
        now = time.time()
        headers: list[PageHeader | PageCheck] = []
        for n in range(len(names)):
            counts = got[0][n] if got and len(got[0]) > n else [-1]
            offset = base + n * HEADER_NBYTES
            headers.append(
                decode_header(arena[offset : offset + HEADER_NBYTES])
                if counts and counts[0] == HEADER_NBYTES
                else PageCheck.CORRUPT
            )
        # Objects are listed by their stored size, not the one their header claims: what
        # stats and gc count, and what verify reads (a short object then fails its check).
        # Objects removed since the names were listed are left out of the size lookup, which
        # has Mooncake log an error line per absent key (its cost: about 1% of a listing).
        sizes = _present_sizes(store, names)
        pages: list[PageInfo] = []
        lead = len(self._prefix) + 1
        for name, header, size in zip(names, headers, sizes, strict=True):
            if size < 0:
                continue  # gone since it was listed
            key = bytes.fromhex(name[lead:])
            if isinstance(header, PageCheck):
                # A damaged page is the first gc evicts; one of a newer format version (sound,
                # for the instances that can read it) counts as new, its time being unknown.
                last = 0.0 if header is PageCheck.CORRUPT else now
                pages.append(
                    PageInfo(key=key, nbytes=size, num_tokens=0, priority=0, last_access=last)
                )
                continue
            pages.append(
                PageInfo(
                    key=key,
                    nbytes=size,
                    num_tokens=header.num_tokens,
                    priority=header.priority,
                    last_access=created_recency(header.created_ns / 1e9, now),
                )
            )
        return pages

    def _verify_job(
        self, store: Any, pages: Sequence[PageInfo], base: int, stop: threading.Event
    ) -> list[PageCheck | int | None]:
        """Each page's check; None when it is gone, Mooncake's code when it was not read."""
        arena = self._arena_view
        assert arena is not None
        names = [self._mkey(p.key) for p in pages]
        offsets: list[int] = []
        offset = base
        for page in pages:
            offsets.append(offset)
            offset += _Arena.rounded(page.nbytes)
        codes = list(
            store.batch_get_into(
                names, [self._arena_base + o for o in offsets], [p.nbytes for p in pages]
            )
        )
        states = _read_states(store, names, codes, [p.nbytes for p in pages])
        checks: list[PageCheck | int | None] = []
        for page, start, code, state in zip(pages, offsets, codes, states, strict=True):
            if state == "missing":
                checks.append(None)
                continue
            if state == "damaged":
                checks.append(PageCheck.CORRUPT)
                continue
            if state == "failed":
                checks.append(int(code))
                continue
            value = arena[start : start + page.nbytes]
            header = decode_header(value)
            if isinstance(header, PageCheck):
                checks.append(header)
            elif header.key != page.key or page.nbytes != HEADER_NBYTES + header.payload_nbytes:
                checks.append(PageCheck.CORRUPT)
            else:
                checks.append(
                    verify_payload(header, [value[HEADER_NBYTES:]], mac_key=self._mac_key)
                )
        return checks
