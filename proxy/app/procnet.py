"""Who owns a TCP socket, from ``/proc`` (Linux only).

``/proc/net/tcp`` and ``/proc/net/tcp6`` list every TCP socket of this network namespace with
its local and remote address, state and inode; ``/proc/<pid>/fd/*`` link to ``socket:[inode]``
for the sockets a process holds.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from subprocess import Popen
from typing import AnyStr

TCP_LISTEN = "0A"
_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")


def _decode_address(field: str) -> tuple[str, int]:
    """``0100007F:1F90`` -> ("127.0.0.1", 8080); IPv6 and IPv4-mapped forms too."""
    host_hex, port_hex = field.rsplit(":", 1)
    raw = bytes.fromhex(host_hex)
    # The kernel prints each 32-bit word of the address in host byte order.
    words = struct.unpack("=" + "I" * (len(raw) // 4), raw)
    packed = struct.pack(">" + "I" * len(words), *words)
    if len(packed) == 4:
        host = socket.inet_ntop(socket.AF_INET, packed)
    else:
        addr = ipaddress.IPv6Address(packed)
        host = str(addr.ipv4_mapped) if addr.ipv4_mapped else str(addr)
    return host, int(port_hex, 16)


def tcp_sockets() -> Iterator[tuple[tuple[str, int], tuple[str, int], str, str]]:
    """Yields (local, remote, state, inode) for every TCP socket, IPv4 and IPv6."""
    for table in _TABLES:
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10:
                continue
            yield _decode_address(fields[1]), _decode_address(fields[2]), fields[3], fields[9]


def listening_inodes(port: int) -> set[str]:
    """Inodes of the sockets listening on ``port`` (any address)."""
    return {inode for local, _, state, inode in tcp_sockets() if state == TCP_LISTEN and local[1] == port}


def connection_inode(local: tuple[str, int], remote: tuple[str, int]) -> str | None:
    """Inode of the socket whose local end is ``local`` and whose peer is ``remote``."""
    for sock_local, sock_remote, state, inode in tcp_sockets():
        if sock_local == local and sock_remote == remote and state != TCP_LISTEN and inode != "0":
            return inode
    return None


def socket_inodes(pid: int) -> set[str]:
    """Inodes of every socket ``pid`` holds open."""
    found: set[str] = set()
    fd_dir = f"/proc/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"{fd_dir}/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(target[8:-1])
    return found


def owner_of(inode: str, candidate_pids: Iterable[int] = ()) -> int | None:
    """The pid holding socket ``inode``: the candidates first, then every process visible."""
    for pid in candidate_pids:
        if inode in socket_inodes(pid):
            return pid
    for name in os.listdir("/proc"):
        if name.isdigit() and inode in socket_inodes(int(name)):
            return int(name)
    return None


def wait_serving(process: Popen[AnyStr], port: int, answers: Callable[[], bool], what: str,
                 timeout_s: float) -> str | None:
    """None once ``process`` (a Popen) holds the socket listening on ``port`` and ``answers()``
    is true; else why not: it exited, another process holds the port, or the time ran out."""
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return f"{what} exited with code {process.returncode}"
        listening = listening_inodes(port)
        if listening:
            if not listening & socket_inodes(process.pid):
                return "port held by another process"
            if answers():
                return None
        # A child binding its port raises no event we could wait on: back off briefly.
        time.sleep(delay)
        delay = min(delay * 2, 0.1)
    return f"not ready after {timeout_s} s"

