"""Ports for servers and rendezvous that turnrl starts on this machine."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago ("" for every interface).

    Another process may take it before it is bound again, so servers started on it should
    fail loudly when the port is taken (they do: aiohttp, vLLM and torch's store all raise).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
