"""Real servers for tests: a private `redis-server`, a Redis Cluster of them and a
`mooncake_master` on loopback.

Each manager picks free ports on 127.0.0.1 (retrying if another process takes one first),
starts the binary, waits until it answers and checks that what answers is the process it
started (not another server already on the port), and stops it again: on `stop()`, on leaving
its `with` block, at interpreter exit, and (on Linux) when the parent process dies, whichever
thread started it. A missing binary raises `ServerBinaryNotFoundError` naming it, so a suite
fails loudly instead of skipping.
"""

from __future__ import annotations

import abc
import atexit
import ctypes
import importlib.util
import os
import queue
import random
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
from concurrent.futures import Future
from pathlib import Path
from types import TracebackType
from typing import Any

from .._extras import install_hint

__all__ = [
    "MooncakeMaster",
    "RedisClusterServer",
    "RedisServer",
    "ServerBinaryNotFoundError",
    "ServerError",
    "find_mooncake_master",
    "free_port",
    "free_ports",
]

_HOST = "127.0.0.1"
_START_ATTEMPTS = 5


class ServerError(RuntimeError):
    """A test server could not be started or did not become ready."""


class ServerBinaryNotFoundError(ServerError, FileNotFoundError):
    """The server's executable is not installed (the message says how to install it)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (callers retry on a race)."""
    return free_ports(1)[0]


#: Where `free_ports` looks first: registered ports below the usual ephemeral range.
_QUIET_PORTS = range(20000, 32768)
#: Not the `random` module's generator: test tools seed that one, which would make every
#: process (xdist workers, a Hypothesis example) pick the same ports.
_PORT_CHOICE = random.SystemRandom()


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports on 127.0.0.1 that were free a moment ago.

    Chosen below the kernel's ephemeral range when it leaves room: a port picked now and
    bound later (by a process still starting, or a later step) is then never taken in
    between by the local port of some outgoing connection, as ports the kernel hands out
    for port 0 can be.
    """
    low = _ephemeral_low()
    quiet = range(_QUIET_PORTS.start, min(_QUIET_PORTS.stop, low))
    held: list[socket.socket] = []
    try:
        tries = 0
        while len(held) < count and len(quiet) >= 4 * count and tries < 64 * count:
            tries += 1
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.bind((_HOST, _PORT_CHOICE.choice(quiet)))
            except OSError:
                sock.close()
                continue
            held.append(sock)
        while len(held) < count:  # no room below the ephemeral range: let the kernel pick
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((_HOST, 0))
            held.append(sock)
        return [int(sock.getsockname()[1]) for sock in held]
    finally:
        for sock in held:
            sock.close()


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default when unknown)."""
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        return int(text.split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection((_HOST, port), timeout=0.5):
            return True
    except OSError:
        return False


def _listening_inodes(port: int) -> set[str] | None:
    """Inodes of the TCP sockets listening on `port` (any address); None without /proc."""
    inodes: set[str] = set()
    found_table = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        found_table = True
        for line in lines:
            fields = line.split()
            # local_address is HEXIP:HEXPORT; state 0A is LISTEN; the inode is field 9.
            if (
                len(fields) > 9
                and fields[3] == "0A"
                and int(fields[1].rsplit(":", 1)[1], 16) == port
            ):
                inodes.add(fields[9])
    return inodes if found_table else None


def _port_owned_by(pid: int, port: int) -> bool | None:
    """Whether process `pid` holds a socket listening on `port`; None when this cannot be
    told (no /proc, or its file descriptors are not readable)."""
    inodes = _listening_inodes(port)
    if inodes is None:
        return None
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:[") and target[8:-1] in inodes:
            return True
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


class _Launcher:
    """One long-lived daemon thread that forks every server.

    PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, not the process: a
    server started from a short-lived thread (`await asyncio.to_thread(server.start)`, whose
    executor is shut down with its loop) would be killed with that thread. Forking from a thread
    that lives as long as the process ties the children to the process.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = (
            queue.SimpleQueue()
        )
        self._pid = -1  # the process the thread runs in: a forked child needs its own

    def _run(self) -> None:
        while True:
            call, future = self._requests.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(call())
                except BaseException as exc:  # handed to the caller, which re-raises it
                    future.set_exception(exc)

    def popen(self, command: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        """`subprocess.Popen(command, **kwargs)`, forked from the launcher thread."""
        with self._lock:
            if self._pid != os.getpid():
                self._requests = queue.SimpleQueue()
                thread = threading.Thread(target=self._run, name="hicache-server-launcher")
                thread.daemon = True
                thread.start()
                self._pid = os.getpid()
        future: Future[subprocess.Popen[bytes]] = Future()
        self._requests.put((lambda: subprocess.Popen(command, **kwargs), future))
        try:
            return future.result()
        except BaseException:
            # Interrupted (KeyboardInterrupt) while the launcher forks: a child started anyway
            # belongs to nobody, so it must not outlive this call.
            if not future.cancel() and future.exception() is None:
                orphan = future.result()
                orphan.kill()
                orphan.wait()
            raise


_LAUNCHER = _Launcher()
# Strong references: a server nobody stops explicitly is still stopped at exit.
_LIVE: set[_ManagedServer] = set()
_LIVE_LOCK = threading.Lock()


def _stop_all() -> None:
    # Only this process's servers: a forked child that exits normally runs this hook too, and
    # would remove the directory of a server its parent still runs.
    with _LIVE_LOCK:
        servers = [server for server in _LIVE if server._starter_pid == os.getpid()]
    for server in servers:
        server.stop()


atexit.register(_stop_all)


class _ManagedServer(abc.ABC):
    """Shared lifecycle: temp dir, process start with retries, readiness wait, cleanup."""

    _label = "server"

    def __init__(self, *, startup_timeout: float) -> None:
        self._startup_timeout = startup_timeout
        self._starter_pid = os.getpid()  # the process whose exit stops it
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
        """Start the server and wait until it answers. Idempotent while running.

        A directory left by `kill()` is removed first. If starting fails or is interrupted
        (KeyboardInterrupt included), the process and its directory are cleaned up.
        """
        if self.running:
            return self
        self._kill()
        self._remove_tmpdir()
        # Registered before the first fork, so that atexit stops a server whose start was cut
        # short by anything that escapes the cleanup below.
        with _LIVE_LOCK:
            self._starter_pid = os.getpid()
            _LIVE.add(self)
        try:
            self._start_attempts()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_attempts(self) -> None:
        self._tmpdir = tempfile.mkdtemp(prefix=f"hicache-{self._label}-")
        self._log_path = Path(self._tmpdir) / f"{self._label}.log"
        last_log = ""
        reason = ""
        attempts = 1 if self._ports_fixed() else _START_ATTEMPTS
        for _ in range(attempts):
            self._choose_ports()
            reason = self._launch_and_wait()
            if not reason:
                return
            last_log = self.log_tail()
            self._kill()
            # A port taken between choosing and binding: choose again.
        raise ServerError(
            f"{self._label} did not become ready after {attempts} attempt(s): {reason}; "
            f"log tail:\n{last_log}"
        )

    def _launch_and_wait(self) -> str:
        """Start one attempt; "" once our process is ready, else why it is not."""
        assert self._log_path is not None
        command = self._command()
        with open(self._log_path, "wb") as log:
            self._process = _LAUNCHER.popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self._tmpdir,
                preexec_fn=_PDEATHSIG,  # only a prctl call in the child, so safe with threads
            )
        process = self._process
        deadline = time.monotonic() + self._startup_timeout
        while time.monotonic() < deadline:
            if process.poll() is not None:
                return f"it exited with status {process.returncode}"
            if self._ready():
                # Something answers; make sure it is the process we started and not another
                # server already on the port (ours then fails to bind and exits).
                foreign = self._foreign_ports(process.pid)
                if process.poll() is not None:
                    return f"it exited with status {process.returncode}"
                if foreign:
                    return f"port(s) {foreign} are served by another process"
                return ""
            time.sleep(0.05)
        return f"no answer within {self._startup_timeout} s"

    @abc.abstractmethod
    def _foreign_ports(self, pid: int) -> list[int]:
        """The ports that answered `_ready()` but are not served by process `pid`."""

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
        """Kill the server abruptly (SIGKILL), as a crash would; keeps its directory (until
        `stop()` or the next `start()`)."""
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

    def _server_pid(self) -> int | None:
        """`process_id` from INFO server, or None if the server does not say."""
        try:
            with socket.create_connection((_HOST, self._port), timeout=1) as sock:
                sock.sendall(b"INFO server\r\n")
                data = b""
                while b"process_id:" not in data or not data.endswith(b"\r\n"):
                    chunk = sock.recv(65536)
                    if not chunk or len(data) > 1 << 20:
                        break
                    data += chunk
        except OSError:
            return None
        for line in data.split(b"\r\n"):
            if line.startswith(b"process_id:"):
                return int(line.split(b":", 1)[1])
        return None

    def _foreign_ports(self, pid: int) -> list[int]:
        answering = self._server_pid()
        if answering is None:  # INFO renamed away by extra_args: ask the kernel instead
            owned = _port_owned_by(pid, self._port)
            return [] if owned is None or owned else [self._port]
        return [] if answering == pid else [self._port]


class RedisClusterServer:
    """A private Redis Cluster on 127.0.0.1: `primaries` `redis-server` nodes (no replicas,
    no persistence), each on a free port in its own directory, joined with
    `redis-cli --cluster create`.

    >>> with RedisClusterServer() as cluster:
    ...     url = cluster.url  # redis://127.0.0.1:PORT/0?cluster=1 (PORT: the first node)

    `start()` returns once every node reports `cluster_state:ok`; `stop()` (or leaving the
    `with` block) stops every node, and so does a failed or interrupted start. Each node is a
    `RedisServer` in `nodes`, so a test can `kill()` or `stop()` one of them; with a short
    `node_timeout` (seconds; Redis's default is 15) the others soon mark it failed and answer
    CLUSTERDOWN for every slot. With `full_coverage=False` (`cluster-require-full-coverage
    no`) they go on serving their own slots instead, and only the failed node's slots are
    refused. With `replicas` each primary gets that many replicas (`replica_nodes`), which
    take over its slots when it fails; `start()` then also waits until each has synced.
    """

    def __init__(
        self,
        primaries: int = 3,
        *,
        replicas: int = 0,
        binary: str = "redis-server",
        cli: str = "redis-cli",
        node_timeout: float | None = None,
        full_coverage: bool = True,
        startup_timeout: float = 20.0,
    ) -> None:
        if primaries < 3:
            # redis-cli refuses to create a cluster of fewer than three primaries.
            raise ServerError(f"a Redis Cluster needs at least 3 primaries, got {primaries}")
        found = shutil.which(cli)
        if found is None:
            raise ServerBinaryNotFoundError(
                f"{cli!r} is not installed or not on PATH; install it with "
                "`apt-get install redis-tools` (or run scripts/setup.sh --dev)"
            )
        self._cli = found
        self._binary = binary
        self._primaries = primaries
        if not isinstance(replicas, int) or replicas < 0:
            raise ServerError(f"replicas must be a whole number >= 0, got {replicas!r}")
        self._replicas = replicas
        self._node_args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        if node_timeout is not None:
            if not node_timeout > 0:
                raise ServerError(f"node_timeout must be positive, got {node_timeout}")
            self._node_args += ["--cluster-node-timeout", str(max(1, round(node_timeout * 1000)))]
        if not isinstance(full_coverage, bool):
            raise ServerError(f"full_coverage must be True or False, got {full_coverage!r}")
        if not full_coverage:
            self._node_args += ["--cluster-require-full-coverage", "no"]
        self._startup_timeout = startup_timeout
        self._nodes: list[RedisServer] = []

    @property
    def nodes(self) -> list[RedisServer]:
        """The primaries, in the order their slot ranges were assigned."""
        if not self._nodes:
            raise ServerError("the redis cluster is not started")
        return list(self._nodes[: self._primaries])

    @property
    def replica_nodes(self) -> list[RedisServer]:
        """The replicas (none unless `replicas` was given)."""
        if not self._nodes:
            raise ServerError("the redis cluster is not started")
        return list(self._nodes[self._primaries :])

    @property
    def host(self) -> str:
        """The address every node listens on (loopback)."""
        return _HOST

    @property
    def port(self) -> int:
        """The first node's port: the seed node of `url`."""
        return self.nodes[0].port

    @property
    def url(self) -> str:
        """`redis://127.0.0.1:PORT/0?cluster=1`, seeded with the first node."""
        return f"redis://{_HOST}:{self.port}/0?cluster=1"

    @property
    def running(self) -> bool:
        """Every node's process is alive."""
        return bool(self._nodes) and all(node.running for node in self._nodes)

    def start(self) -> RedisClusterServer:
        """Start the nodes, create the cluster and wait for `cluster_state:ok` on every node.
        Idempotent while running; on any failure everything started is stopped again."""
        if self.running:
            return self
        self.stop()
        try:
            deadline = time.monotonic() + self._startup_timeout
            for _ in range(self._primaries * (1 + self._replicas)):
                node = RedisServer(
                    binary=self._binary,
                    extra_args=self._node_args,
                    startup_timeout=self._startup_timeout,
                )
                self._nodes.append(node)
                node.start()
            self._create(deadline)
            self._wait_ok(deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def _create(self, deadline: float) -> None:
        command = [
            self._cli,
            "--cluster",
            "create",
            *(f"{_HOST}:{node.port}" for node in self._nodes),
            "--cluster-replicas",
            str(self._replicas),
            "--cluster-yes",
        ]
        try:
            done = subprocess.run(
                command,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=max(deadline - time.monotonic(), 1.0),
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise ServerError(f"redis-cli --cluster create did not finish: {exc}") from None
        if done.returncode != 0:
            output = (done.stdout + done.stderr).decode(errors="replace")[-4000:]
            raise ServerError(
                f"redis-cli --cluster create failed with status {done.returncode}:\n{output}"
            )

    def _wait_ok(self, deadline: float) -> None:
        waiting = list(self._nodes)
        while waiting:
            waiting = [node for node in waiting if not _cluster_ok(node.port)]
            if not waiting:
                break
            if time.monotonic() > deadline:
                ports = [node.port for node in waiting]
                raise ServerError(f"cluster nodes {ports} did not reach cluster_state:ok")
            time.sleep(0.05)
        # A replica that has not synced yet never takes over its primary's slots.
        waiting = self._nodes[self._primaries :]
        while waiting:
            waiting = [node for node in waiting if not _replica_synced(node.port)]
            if not waiting:
                return
            if time.monotonic() > deadline:
                ports = [node.port for node in waiting]
                raise ServerError(f"cluster replicas {ports} did not sync with their primary")
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop every node and remove their directories. Idempotent."""
        nodes, self._nodes = self._nodes, []
        for node in nodes:
            node.stop()

    def __enter__(self) -> RedisClusterServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _reply(port: int, command: bytes, field: bytes, end: bytes) -> bytes:
    """The node on `port`'s reply to `command`, read until it holds `field` and ends with
    `end`; empty if the node cannot be reached."""
    try:
        with socket.create_connection((_HOST, port), timeout=1) as sock:
            sock.sendall(command)
            data = b""
            while field not in data or not data.endswith(end):
                chunk = sock.recv(65536)
                if not chunk or len(data) > 1 << 16:
                    break
                data += chunk
    except OSError:
        return b""
    return data


def _replica_synced(port: int) -> bool:
    """The node on `port` is a replica whose link to its primary is up."""
    data = _reply(port, b"INFO replication\r\n", b"role:", b"\r\n\r\n")
    return b"role:slave" in data and b"master_link_status:up" in data


def _cluster_ok(port: int) -> bool:
    """The node on `port` answers CLUSTER INFO with `cluster_state:ok`."""
    return b"cluster_state:ok" in _reply(port, b"CLUSTER INFO\r\n", b"cluster_state:", b"\r\n")


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
        f"it with `{install_hint('mooncake')}` (mooncake-transfer-engine-non-cuda) "
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
        requested = [port for port in (rpc_port, http_port, admin_port) if port is not None]
        if len(set(requested)) != len(requested):
            raise ValueError(
                f"rpc_port, http_port and admin_port must differ, got {rpc_port}, {http_port} "
                f"and {admin_port}"
            )
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

    def _foreign_ports(self, pid: int) -> list[int]:
        ports = (self._rpc_port, self._http_port, self._admin_port)
        owned = [_port_owned_by(pid, port) for port in ports]
        if None in owned:
            # No /proc: a master that lost a port to another process exits soon after
            # answering; give it that moment, and report every port if it did.
            time.sleep(0.5)
            return [] if self._process is not None and self._process.poll() is None else [*ports]
        return [port for port, ours in zip(ports, owned, strict=True) if not ours]

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
