"""A real broker that speaks TLS: Tansu (plaintext only) behind stunnel4 (Debian's TLS terminator).

Tansu 0.6.0 cannot serve TLS (its ``--cert`` and ``--key`` options conflict, and with either alone
the listener stays plaintext), so stunnel listens on ``bootstrap``, terminates TLS with the given
server certificate (optionally requiring a client certificate signed by ``verify_client_ca``) and
relays each connection in plaintext to Tansu's real port, ``plain_bootstrap``. Tansu advertises
stunnel's address, so a client that bootstraps through ``bootstrap`` only ever reaches the broker
over TLS.

Ports: stunnel cannot report a port-0 bind, so, as in :mod:`proxy.app.local_broker`, a candidate port
is read back from a socket bound to port 0; the candidate is held (bound, not listening) while
Tansu starts advertising it, so Tansu cannot pick it for itself, then released and given to
stunnel. stunnel's own process must hold the listening socket (``/proc``); if stunnel exited or
someone else took the port, both are stopped and another candidate is tried. Readiness is an
ApiVersions round trip over TLS through stunnel.

stunnel runs in the foreground as our child (``foreground = yes``, no pid file), logs to stderr,
which goes to a file in a temporary directory (its tail is in every failure message), and is
stopped through its ``Popen`` (SIGTERM, then SIGKILL), never by name.
"""

from __future__ import annotations

import shutil
import socket
import ssl
import struct
import subprocess
import tempfile
from pathlib import Path
from typing import BinaryIO, Protocol

from kafka.protocol.metadata import ApiVersionsRequest, ApiVersionsResponse

from proxy.app import procnet
from proxy.app.local_broker import LocalTansu


class CertAndKey(Protocol):
    """What :class:`tests.support.certs.Pem` is: paths of a PEM certificate chain and its key."""

    @property
    def cert(self) -> str: ...

    @property
    def key(self) -> str: ...


def stunnel_binary() -> str:
    """``stunnel4`` (Debian's name; ``stunnel`` is a symlink to it) from ``PATH``."""
    for name in ("stunnel4", "stunnel"):
        path = shutil.which(name)
        if path:
            return path
    raise FileNotFoundError("stunnel4 is not installed: apt-get install stunnel4 (make test does this as root)")


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    return data


def tls_api_versions_ping(host: str, port: int, client: CertAndKey | None = None, timeout_s: float = 1.0) -> bool:
    """True when ``host:port`` completes a TLS handshake and answers ApiVersions v0 with no error.

    The server certificate is not verified (this only asks whether the broker is up; the tests
    verify it with their own clients); ``client`` is presented when given."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    if client is not None:
        ctx.load_cert_chain(client.cert, client.key)
    request = ApiVersionsRequest[0]()
    request.with_header(correlation_id=4243, client_id="kafka-quota-proxy-tls-probe")
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as raw:
            with ctx.wrap_socket(raw, server_hostname=host) as s:
                s.sendall(bytes(request.encode(header=True, framed=True)))
                head = _recv_exact(s, 4)
                if len(head) != 4:
                    return False
                (size,) = struct.unpack(">i", head)
                frame = _recv_exact(s, size)
    except (OSError, ValueError):  # ssl.SSLError is an OSError
        return False
    if len(frame) != size or struct.unpack(">i", frame[:4])[0] != 4243:
        return False
    response = ApiVersionsResponse.decode(frame[4:], version=0)
    return response.error_code == 0 and bool(response.api_keys)


class TlsTansu:
    """Tansu behind stunnel: ``bootstrap`` is TLS, ``plain_bootstrap`` is Tansu's real port.

    ``server`` is the certificate stunnel presents (e.g. ``TestPki.server``, valid for
    127.0.0.1 and localhost). With ``verify_client_ca`` (a PEM CA file) stunnel requires a client
    certificate signed by it and refuses the connection otherwise; the readiness probe then
    presents ``probe_client`` (e.g. ``pki.client("probe", "probe")``), which is required.
    """

    def __init__(self, server: CertAndKey, verify_client_ca: str | None = None,
                 probe_client: CertAndKey | None = None, host: str = "127.0.0.1") -> None:
        if verify_client_ca is not None and probe_client is None:
            raise ValueError("verify_client_ca needs probe_client: a client certificate the readiness probe presents")
        self.server = server
        self.verify_client_ca = verify_client_ca
        self.probe_client = probe_client
        self.host = host
        self.port = 0  # stunnel's TLS port
        self.broker: LocalTansu | None = None
        self.process: subprocess.Popen[bytes] | None = None  # stunnel
        self._dir = Path(tempfile.mkdtemp(prefix="tls-tansu-"))
        self.config_path = self._dir / "stunnel.conf"
        self.log_path = self._dir / "stunnel.log"
        self._log: BinaryIO | None = None

    # -- addresses ---------------------------------------------------------------------------

    @property
    def bootstrap(self) -> str:
        """stunnel's address: TLS, and the only address Tansu advertises."""
        return f"{self.host}:{self.port}"

    @property
    def plain_bootstrap(self) -> str:
        """Tansu's real, plaintext address (bypasses TLS; for checks and setup only)."""
        if self.broker is None:
            raise RuntimeError("TlsTansu is not running")
        return self.broker.bootstrap

    @property
    def stunnel_pid(self) -> int:
        if self.process is None:
            raise RuntimeError("stunnel is not running")
        return self.process.pid

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, timeout_s: float = 20.0, attempts: int = 5) -> TlsTansu:
        binary = stunnel_binary()
        self._dir.mkdir(exist_ok=True)
        try:
            return self._start(binary, timeout_s, attempts)
        except BaseException:
            self.stop()
            raise

    def _start(self, binary: str, timeout_s: float, attempts: int) -> TlsTansu:
        failures = []
        for _ in range(attempts):
            # Hold the candidate while Tansu picks its own port, so Tansu cannot pick this one.
            holder = socket.socket()
            try:
                holder.bind((self.host, 0))
                port = holder.getsockname()[1]
                self.broker = LocalTansu(host=self.host, advertised_port=port).start()
            finally:
                holder.close()
            self._write_config(port, self.broker.port)
            self._start_stunnel(binary)
            outcome = self._wait_ready(port, timeout_s)
            if outcome is None:
                self.port = port
                return self
            failures.append(f"port {port}: {outcome}")
            tail = self.log_tail()
            self._stop_processes()
            if tail:
                failures.append(f"--- stunnel log tail ---\n{tail}")
            if "Configuration failed" in tail:
                break  # a bad certificate or key, say: another port would not help
        raise RuntimeError("Tansu behind stunnel did not start: " + "\n".join(failures))

    def _write_config(self, port: int, tansu_port: int) -> None:
        lines = [
            "foreground = yes",  # our child, stopped through its Popen
            "pid =",  # no pid file
            "syslog = no",  # log to stderr only, which is the log file
            "debug = notice",
            "",
            "[kafka]",
            f"accept = {self.host}:{port}",
            f"connect = {self.host}:{tansu_port}",
            f"cert = {self.server.cert}",
            f"key = {self.server.key}",
            # Close at once when either side does (the default waits 60 s for a close_notify).
            "TIMEOUTclose = 0",
        ]
        if self.verify_client_ca is not None:
            lines += [f"CAfile = {self.verify_client_ca}", "verifyChain = yes", "requireCert = yes"]
        self.config_path.write_text("\n".join(lines) + "\n")

    def _start_stunnel(self, binary: str) -> None:
        if self._log is not None:
            self._log.close()
        self._log = open(self.log_path, "wb")  # one attempt's log at a time
        self.process = subprocess.Popen(
            [binary, str(self.config_path)],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, cwd=self._dir,
        )

    def _wait_ready(self, port: int, timeout_s: float) -> str | None:
        """None when stunnel's own process listens on ``port`` and ApiVersions over TLS works."""
        assert self.process is not None
        return procnet.wait_serving(self.process, port, lambda: tls_api_versions_ping(self.host, port,
                                                                                      self.probe_client),
                                    "stunnel", timeout_s)

    def log_tail(self, max_bytes: int = 4000) -> str:
        """The end of stunnel's log (its connections, handshake failures, startup errors)."""
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-max_bytes:].decode(errors="replace")

    def _stop_processes(self) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)
        broker, self.broker = self.broker, None
        if broker is not None:
            broker.stop()

    def _cleanup(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
        shutil.rmtree(self._dir, ignore_errors=True)

    def stop(self) -> None:
        self._stop_processes()
        self._cleanup()

    def __enter__(self) -> TlsTansu:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["TlsTansu", "stunnel_binary", "tls_api_versions_ping"]
