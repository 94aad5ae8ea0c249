"""Real servers for tests: a private `redis-server` and a `mooncake_master` on loopback.

Each manager picks free ports on 127.0.0.1 (retrying if another process takes one first),
starts the binary, waits until it answers, and stops it again: on `stop()`, on leaving its
`with` block, at interpreter exit, and (on Linux) when the parent process dies. A missing binary
raises `ServerBinaryNotFoundError` naming it, so a suite fails loudly instead of skipping.
"""

from __future__ import annotations

import abc
import atexit
import ctypes
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType

__all__ = [
    "MooncakeMaster",
    "RedisServer",
    "ServerBinaryNotFoundError",
    "ServerError",
    "find_mooncake_master",
    "free_port",
]

_HOST = "127.0.0.1"
_START_ATTEMPTS = 5


class ServerError(RuntimeError):
    """A test server could not be started or did not become ready."""


class ServerBinaryNotFoundError(ServerError, FileNotFoundError):
    """The server's executable is not installed (the message says how to install it)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (callers retry on a race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection((_HOST, port), timeout=0.5):
            return True
    except OSError:
        return False


def _parent_death_hook() -> Callable[[], None] | None:
    # Children get SIGTERM if this process dies without running atexit (e.g. SIGKILL by CI).
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def hook() -> None:
        prctl(pr_set_pdeathsig, signal.SIGTERM)

    return hook


_PDEATHSIG = _parent_death_hook()
# Strong references: a server nobody stops explicitly is still stopped at exit.
_LIVE: set[_ManagedServer] = set()
_LIVE_LOCK = threading.Lock()


def _stop_all() -> None:
    with _LIVE_LOCK:
        servers = list(_LIVE)
    for server in servers:
        server.stop()


atexit.register(_stop_all)


class _ManagedServer(abc.ABC):
    """Shared lifecycle: temp dir, process start with retries, readiness wait, cleanup."""

    _label = "server"

    def __init__(self, *, startup_timeout: float) -> None:
        self._startup_timeout = startup_timeout
        self._process: subprocess.Popen[bytes] | None = None
        self._tmpdir: str | None = None
        self._log_path: Path | None = None

    @abc.abstractmethod
    def _command(self) -> list[str]:
        """The command line that starts the server on the chosen ports."""

    @abc.abstractmethod
    def _choose_ports(self) -> None:
        """Pick the ports for the next start attempt."""

    @abc.abstractmethod
    def _ready(self) -> bool:
        """The server answers on every port."""

    @abc.abstractmethod
    def _ports_fixed(self) -> bool:
        """The caller chose every port (so a failed start is not retried on others)."""

    # -- lifecycle ----------------------------------------------------------------------
    @property
    def running(self) -> bool:
        """The process is alive."""
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return self._process.pid if self.running and self._process is not None else None

    @property
    def directory(self) -> Path:
        """The private working directory (logs, data); removed on `stop()`."""
        if self._tmpdir is None:
            raise ServerError(f"{self._label} is not started")
        return Path(self._tmpdir)

    def log_tail(self, nbytes: int = 4000) -> str:
        """The end of the server's log, for error messages."""
        if self._log_path is None or not self._log_path.exists():
            return ""
        data = self._log_path.read_bytes()
        return data[-nbytes:].decode(errors="replace")

    def start(self) -> _ManagedServer:
        """Start the server and wait until it answers. Idempotent while running."""
        if self.running:
            return self
        self._tmpdir = tempfile.mkdtemp(prefix=f"hicache-{self._label}-")
        self._log_path = Path(self._tmpdir) / f"{self._label}.log"
        last_log = ""
        attempts = 1 if self._ports_fixed() else _START_ATTEMPTS
        for _ in range(attempts):
            self._choose_ports()
            if self._launch_and_wait():
                with _LIVE_LOCK:
                    _LIVE.add(self)
                return self
            last_log = self.log_tail()
            self._kill()
            # A port taken between choosing and binding: choose again.
        self._remove_tmpdir()
        raise ServerError(
            f"{self._label} did not become ready after {attempts} attempt(s); log tail:\n{last_log}"
        )

    def _launch_and_wait(self) -> bool:
        assert self._log_path is not None
        command = self._command()
        with open(self._log_path, "wb") as log:
            self._process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self._tmpdir,
                preexec_fn=_PDEATHSIG,  # noqa: PLW1509 - only a prctl call in the child
            )
        deadline = time.monotonic() + self._startup_timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                return False
            if self._ready():
                return True
            time.sleep(0.05)
        return False

    def _kill(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)

    def _remove_tmpdir(self) -> None:
        tmpdir, self._tmpdir = self._tmpdir, None
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)

    def stop(self) -> None:
        """Stop the server and remove its directory. Idempotent."""
        self._kill()
        self._remove_tmpdir()
        with _LIVE_LOCK:
            _LIVE.discard(self)

    def kill(self) -> None:
        """Kill the server abruptly (SIGKILL), as a crash would; keeps its directory."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(timeout=5)

    def __enter__(self) -> _ManagedServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class RedisServer(_ManagedServer):
    """A private `redis-server` on 127.0.0.1 without persistence.

    >>> with RedisServer() as server:
    ...     url = server.url  # redis://127.0.0.1:PORT/0
    """

    _label = "redis"

    def __init__(
        self,
        port: int | None = None,
        *,
        binary: str = "redis-server",
        extra_args: Sequence[str] = (),
        startup_timeout: float = 10.0,
    ) -> None:
        super().__init__(startup_timeout=startup_timeout)
        found = shutil.which(binary)
        if found is None:
            raise ServerBinaryNotFoundError(
                f"{binary!r} is not installed or not on PATH; install it with "
                "`apt-get install redis-server` (or run scripts/setup.sh --dev)"
            )
        self._binary = found
        self._requested_port = port
        self._port = port or 0
        self._extra_args = list(extra_args)

    @property
    def host(self) -> str:
        return _HOST

    @property
    def port(self) -> int:
        """The port the server listens on."""
        if not self._port:
            raise ServerError("redis-server is not started")
        return self._port

    @property
    def url(self) -> str:
        """`redis://127.0.0.1:PORT/0`."""
        return f"redis://{_HOST}:{self.port}/0"

    def start(self) -> RedisServer:
        super().start()
        return self

    def __enter__(self) -> RedisServer:
        return self.start()

    def _ports_fixed(self) -> bool:
        return self._requested_port is not None

    def _choose_ports(self) -> None:
        self._port = self._requested_port or free_port()

    def _command(self) -> list[str]:
        assert self._tmpdir is not None
        return [
            self._binary,
            "--bind",
            _HOST,
            "--port",
            str(self._port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self._tmpdir,
            "--protected-mode",
            "yes",
            *self._extra_args,
        ]

    def _ready(self) -> bool:
        try:
            with socket.create_connection((_HOST, self._port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False


def find_mooncake_master(binary: str | None = None) -> str:
    """The `mooncake_master` executable: `binary`, the one in the mooncake wheel, or PATH."""
    if binary is not None:
        found = shutil.which(binary)
        if found is None:
            raise ServerBinaryNotFoundError(f"mooncake master binary {binary!r} not found")
        return found
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "mooncake_master"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    found = shutil.which("mooncake_master")
    if found is not None:
        return found
    raise ServerBinaryNotFoundError(
        "'mooncake_master' not found (neither in the mooncake package nor on PATH); install "
        "it with `pip install 'hicache-async[mooncake]'` (mooncake-transfer-engine-non-cuda) "
        "or run scripts/setup.sh --dev"
    )


class MooncakeMaster(_ManagedServer):
    """A private `mooncake_master` with its HTTP metadata server, all on 127.0.0.1.

    `url` is a `mooncake://` URL for `MooncakeStorage.from_url` that names the master, the
    metadata server, the admin (metrics) server, TCP transport and a loopback local hostname.
    """

    _label = "mooncake-master"

    def __init__(
        self,
        rpc_port: int | None = None,
        *,
        http_port: int | None = None,
        admin_port: int | None = None,
        binary: str | None = None,
        lease_ttl_ms: int = 500,
        extra_args: Sequence[str] = (),
        startup_timeout: float = 20.0,
    ) -> None:
        super().__init__(startup_timeout=startup_timeout)
        self._binary = find_mooncake_master(binary)
        self._requested = (rpc_port, http_port, admin_port)
        self._rpc_port = rpc_port or 0
        self._http_port = http_port or 0
        self._admin_port = admin_port or 0
        self._lease_ttl_ms = lease_ttl_ms
        self._extra_args = list(extra_args)

    @property
    def host(self) -> str:
        return _HOST

    @property
    def rpc_port(self) -> int:
        """The master's RPC port."""
        if not self._rpc_port:
            raise ServerError("mooncake_master is not started")
        return self._rpc_port

    @property
    def address(self) -> str:
        """`127.0.0.1:RPC`, the master as `MooncakeStorage` names it."""
        return f"{_HOST}:{self.rpc_port}"

    @property
    def http_port(self) -> int:
        """The HTTP metadata server's port."""
        self._check_started()
        return self._http_port

    @property
    def admin_port(self) -> int:
        """The admin/metrics HTTP port (`/health`, `/get_all_keys`, `/metrics`)."""
        self._check_started()
        return self._admin_port

    @property
    def metadata_url(self) -> str:
        return f"http://{_HOST}:{self.http_port}/metadata"

    @property
    def admin_url(self) -> str:
        return f"http://{_HOST}:{self.admin_port}"

    @property
    def url(self) -> str:
        """`mooncake://127.0.0.1:RPC?metadata=...&admin=...&protocol=tcp&local_hostname=...`."""
        return (
            f"mooncake://{_HOST}:{self.rpc_port}?metadata={self.metadata_url}"
            f"&admin={self.admin_url}&protocol=tcp&local_hostname={_HOST}"
        )

    def _check_started(self) -> None:
        if not self._rpc_port:
            raise ServerError("mooncake_master is not started")

    def start(self) -> MooncakeMaster:
        super().start()
        return self

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def _ports_fixed(self) -> bool:
        return all(p is not None for p in self._requested)

    def _choose_ports(self) -> None:
        chosen: list[int] = []
        for requested in self._requested:
            port = requested or free_port()
            while port in chosen:
                port = free_port()
            chosen.append(port)
        self._rpc_port, self._http_port, self._admin_port = chosen

    def _command(self) -> list[str]:
        return [
            self._binary,
            f"-rpc_address={_HOST}",
            f"-rpc_port={self._rpc_port}",
            "-enable_http_metadata_server=true",
            f"-http_metadata_server_host={_HOST}",
            f"-http_metadata_server_port={self._http_port}",
            f"-metrics_host={_HOST}",
            f"-metrics_port={self._admin_port}",
            f"-default_kv_lease_ttl={self._lease_ttl_ms}",
            "-logtostderr=true",
            *self._extra_args,
        ]

    def _ready(self) -> bool:
        if not (_port_open(self._rpc_port) and _port_open(self._http_port)):
            return False
        try:
            with urllib.request.urlopen(
                f"http://{_HOST}:{self._admin_port}/health", timeout=1
            ) as response:
                return b'"service_ready":true' in response.read()
        except (OSError, urllib.error.URLError):
            return False
