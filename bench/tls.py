"""TLS for the benchmark: certificates made at the start of a run, the clients' side of it.

The certificates are made with trustme (a test dependency): one CA and a server certificate
for 127.0.0.1 and localhost (ECDSA P-256, trustme's default), written as PEM files into the
run's workdir. The TLS byte pump and the proxy both present that certificate; every client
(confluent-kafka, the raw sockets of the round trips and of the memory test) trusts the CA and
checks the name.
"""

from __future__ import annotations

import functools
import socket
import ssl
import struct
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BenchPki:
    ca_file: str  # what clients trust
    cert_file: str  # the server's chain, leaf first
    key_file: str


def make_pki(directory: Path) -> BenchPki:
    import trustme

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA(organization_name="kqp bench CA")
    leaf = ca.issue_cert("127.0.0.1", "localhost", common_name="bench")
    ca_file, cert_file, key_file = directory / "ca.pem", directory / "server.pem", directory / "server.key"
    ca_file.write_bytes(ca.cert_pem.bytes())
    cert_file.write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
    key_file.write_bytes(leaf.private_key_pem.bytes())
    return BenchPki(str(ca_file), str(cert_file), str(key_file))


@functools.cache
def client_context(ca_file: str) -> ssl.SSLContext:
    """Python's client defaults (TLS 1.2 at least, hostname checked) trusting ``ca_file``."""
    return ssl.create_default_context(cafile=ca_file)


def connect(address: tuple[str, int], ca_file: str | None = None, timeout: float = 30.0,
            nodelay: bool = True) -> socket.socket:
    """A TCP connection (TCP_NODELAY unless told otherwise); with ``ca_file``, TLS on it, the
    handshake done."""
    s = socket.create_connection(address, timeout=timeout)
    if nodelay:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if ca_file is None:
        return s
    try:
        return client_context(ca_file).wrap_socket(s, server_hostname=address[0])
    except BaseException:
        s.close()
        raise


def confluent_config(ca_file: str | None) -> dict:
    """What librdkafka needs to reach a TLS listener (nothing for plaintext)."""
    if ca_file is None:
        return {}
    return {"security.protocol": "SSL", "ssl.ca.location": ca_file}


def api_versions_ping(address: tuple[str, int], ca_file: str, timeout_s: float = 1.0) -> bool:
    """proxy.app.local_broker.api_versions_ping over TLS: True when ApiVersions v0 is answered."""
    from kafka.protocol.metadata import ApiVersionsRequest, ApiVersionsResponse

    request = ApiVersionsRequest[0]()
    request.with_header(correlation_id=4242, client_id="kafka-quota-proxy-probe")
    try:
        with connect(address, ca_file, timeout=timeout_s) as s:
            s.sendall(bytes(request.encode(header=True, framed=True)))
            head = _recv(s, 4)
            (size,) = struct.unpack(">i", head)
            frame = _recv(s, size)
    except (OSError, ConnectionError):
        return False
    if struct.unpack(">i", frame[:4])[0] != 4242:
        return False
    response = ApiVersionsResponse.decode(frame[4:], version=0)
    return response.error_code == 0 and bool(response.api_keys)


def _recv(s: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = s.recv(n - len(out))  # an SSLSocket takes no MSG_WAITALL
        if not chunk:
            raise ConnectionError("peer closed")
        out += chunk
    return bytes(out)
