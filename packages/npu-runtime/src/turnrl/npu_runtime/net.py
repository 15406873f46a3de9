"""Ports for servers and rendezvous that turnrl starts on this machine, and the ports a
process listens on."""

from __future__ import annotations

import contextlib
import os
import socket
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
