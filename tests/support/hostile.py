"""Hostile clients for the connection-guard tests: many raw sockets that send a few bytes (or
none) and are then watched for the proxy's EOF, and what such clients cost the proxy process
(RSS, sockets it holds to the broker), read from ``/proc`` (Linux only).

Every wait here is bounded by a deadline; nothing polls without one.
"""

from __future__ import annotations

import resource
import selectors
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from proxy.app import procnet

TCP_ESTABLISHED = "01"


def raise_open_files_limit(wanted: int) -> int:
    """Raises this process's soft RLIMIT_NOFILE towards ``wanted`` (at most the hard limit);
    returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (VmRSS in /proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def settled_rss(pid: int, timeout_s: float = 3.0, step_s: float = 0.1, tolerance_bytes: int = 256 * 1024) -> int:
    """RSS of ``pid`` once two readings ``step_s`` apart differ by at most ``tolerance_bytes``
    (or the last reading when ``timeout_s`` runs out)."""
    deadline = time.monotonic() + timeout_s
    last = rss_bytes(pid)
    while time.monotonic() < deadline:
        time.sleep(step_s)
        now = rss_bytes(pid)
        if abs(now - last) <= tolerance_bytes:
            return now
        last = now
    return last


def sockets_to_port(pid: int, port: int) -> int:
    """Established TCP sockets held by ``pid`` whose peer listens on ``port``."""
    inodes = procnet.socket_inodes(pid)
    return sum(1 for _, remote, state, inode in procnet.tcp_sockets()
               if state == TCP_ESTABLISHED and remote[1] == port and inode in inodes)


def connect_many(address: tuple[str, int], n: int, payload: bytes = b"", source_ip: str | None = None,
                 timeout_s: float = 10.0, opened_at: dict | None = None) -> list[socket.socket]:
    """``n`` connections to ``address`` (from ``source_ip`` when given), each sent ``payload``
    (nothing when empty); the sockets are returned non-blocking. ``opened_at``: filled with
    {socket: monotonic instant its connect returned}."""
    socks = []
    deadline = time.monotonic() + timeout_s
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.settimeout(max(deadline - time.monotonic(), 0.1))
            if source_ip is not None:
                s.bind((source_ip, 0))
            s.connect(address)
            if opened_at is not None:
                opened_at[s] = time.monotonic()
            if payload:
                s.sendall(payload)
            s.setblocking(False)
    except BaseException:
        close_all(socks)
        raise
    return socks


def close_all(socks) -> None:
    for s in socks:
        try:
            s.close()
        except OSError:
            pass


@dataclass
class Watched:
    """What became of one watched socket: when it saw EOF (None: not yet) and the bytes the
    proxy sent on it before that."""

    opened_at: float
    eof_at: float | None = None
    received: bytearray = field(default_factory=bytearray)

    @property
    def lived_s(self) -> float | None:
        return None if self.eof_at is None else self.eof_at - self.opened_at


def watch_eof(socks, timeout_s: float, opened_at: float | dict | None = None) -> dict[socket.socket, Watched]:
    """Reads every socket in ``socks`` (non-blocking) until each has seen EOF or a reset, or
    ``timeout_s`` has passed; returns what each saw. ``opened_at``: one instant for all, or
    {socket: instant} (default: now)."""
    start = time.monotonic()
    seen = {}
    for s in socks:
        at = opened_at.get(s, start) if isinstance(opened_at, dict) else (opened_at if opened_at is not None else start)
        seen[s] = Watched(opened_at=at)
    selector = selectors.DefaultSelector()
    try:
        for s in socks:
            s.setblocking(False)
            selector.register(s, selectors.EVENT_READ)
        open_left = len(socks)
        deadline = start + timeout_s
        while open_left and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=max(deadline - time.monotonic(), 0)):
                s = key.fileobj
                try:
                    data = s.recv(65536)
                except BlockingIOError:
                    continue
                except (ConnectionResetError, ConnectionAbortedError):
                    data = b""
                if data:
                    seen[s].received += data
                    continue
                seen[s].eof_at = time.monotonic()
                selector.unregister(s)
                open_left -= 1
    finally:
        selector.close()
    return seen


def push(socks, nbytes_each: int, timeout_s: float, chunk_bytes: int = 65536) -> dict[socket.socket, int]:
    """Sends up to ``nbytes_each`` zero bytes on every socket (non-blocking: a socket whose
    peer stops reading is left alone until it can take more) until each has sent them all or
    ``timeout_s`` has passed; returns {socket: bytes sent}."""
    chunk = bytes(chunk_bytes)
    sent = {s: 0 for s in socks}
    deadline = time.monotonic() + timeout_s
    selector = selectors.DefaultSelector()
    try:
        for s in socks:
            s.setblocking(False)
            selector.register(s, selectors.EVENT_WRITE)
        left = len(socks)
        while left and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=max(deadline - time.monotonic(), 0)):
                s = key.fileobj
                try:
                    sent[s] += s.send(chunk[: min(chunk_bytes, nbytes_each - sent[s])])
                except BlockingIOError:
                    continue
                except OSError:  # closed by the peer: it takes no more
                    selector.unregister(s)
                    left -= 1
                    continue
                if sent[s] >= nbytes_each:
                    selector.unregister(s)
                    left -= 1
    finally:
        selector.close()
    return sent
