"""Raw-socket Kafka requests for tests that must control every byte."""

from __future__ import annotations

import socket
import struct

from kafka.protocol.metadata import ApiVersionsRequest, ApiVersionsResponse


def request_bytes(request, correlation_id: int, client_id: str = "wire-test") -> bytes:
    request.with_header(correlation_id=correlation_id, client_id=client_id)
    return bytes(request.encode(header=True, framed=True))


def read_frame(sock: socket.socket) -> bytes | None:
    """One response frame without its size prefix, or None when the peer closed."""
    head = _recv_exact(sock, 4)
    if head is None:
        return None
    return _recv_exact(sock, struct.unpack(">i", head)[0])


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def is_closed(sock: socket.socket, timeout_s: float = 5.0) -> bool:
    """True when the peer closes the connection within ``timeout_s`` (no data expected)."""
    sock.settimeout(timeout_s)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def api_versions_v0(correlation_id: int) -> bytes:
    """ApiVersions v0 with client id "kqp", framed: the smallest request every Kafka server
    answers (and, in plaintext, what a TLS port must not answer)."""
    return request_bytes(ApiVersionsRequest[0](), correlation_id, client_id="kqp")


def api_versions_round_trip(sock: socket.socket, correlation_id: int = 7) -> int:
    """Sends ApiVersions v0 on ``sock`` (plain or TLS) and returns the correlation id of the
    answer, read whole; ConnectionError when the peer closed before answering."""
    sock.sendall(api_versions_v0(correlation_id))
    frame = read_frame(sock)
    if frame is None:
        raise ConnectionError("closed")
    return struct.unpack(">i", frame[:4])[0]


def api_versions(address: tuple[str, int], version: int = 3, correlation_id: int = 7):
    """One ApiVersions round trip on a fresh connection; returns the decoded response."""
    with socket.create_connection(address, timeout=10) as s:
        req = ApiVersionsRequest[version]()
        if version >= 3:
            req = ApiVersionsRequest[version](client_software_name="wire", client_software_version="1")
        s.sendall(request_bytes(req, correlation_id))
        frame = read_frame(s)
        assert frame is not None, "connection closed before the ApiVersions response"
        assert struct.unpack(">i", frame[:4])[0] == correlation_id
        return ApiVersionsResponse.decode(frame[4:], version=version)
