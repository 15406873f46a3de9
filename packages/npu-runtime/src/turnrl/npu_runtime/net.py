"""Ports for servers and rendezvous that turnrl starts on this machine, the ports a process
listens on, and a port held down for fault injection."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago ("" for every interface).

    Another process may take it before it is bound again, so servers started on it should
    fail loudly when the port is taken (they do: aiohttp, vLLM and torch's store all raise).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def listening_ports(pid: int) -> list[int]:
    """The TCP ports process ``pid`` listens on (Linux ``/proc``; empty where unreadable)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    inodes = set()
    for fd in fds:
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


@contextlib.contextmanager
def port_held(port: int, host: str = "127.0.0.1", wait: float = 5.0) -> Iterator[None]:
    """Take ``port`` while the block runs, closing every connection to it at once (clients
    see a connection error, as from a dead server), so a server started on it meanwhile
    cannot bind it: a fault injector for tests and benchmarks (a server that is down and
    cannot come back). Waits up to ``wait`` seconds for a dying process to let it go.

    Raises:
        OSError: the port stayed taken.
    """
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT sockets
    deadline = time.monotonic() + wait
    while True:
        try:
            holder.bind((host, port))
            break
        except OSError:
            if time.monotonic() > deadline:
                holder.close()
                raise
            time.sleep(0.05)
    holder.listen(64)

    def refuse() -> None:
        with contextlib.suppress(OSError):
            while True:
                holder.accept()[0].close()

    threading.Thread(target=refuse, name=f"port-held-{port}", daemon=True).start()
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            holder.shutdown(socket.SHUT_RDWR)
        holder.close()
