import os
import socket

import pytest

from turnrl.npu_runtime.net import free_port, listening_ports, port_held


@pytest.mark.parametrize("host", ["127.0.0.1", ""])
def test_free_port_can_be_bound_again_and_differs_from_a_held_one(host: str) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        port = free_port(host)
        assert port != taken and 1024 <= port < 65536
        with socket.socket() as again:
            again.bind((host, port))  # raises if free_port handed out a bound port


def test_a_held_port_refuses_clients_and_servers_then_is_free_again() -> None:
    port = free_port()
    with port_held(port):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
            client.settimeout(5)
            assert client.recv(1) == b""  # closed at once, no answer
        with socket.socket() as server, pytest.raises(OSError):
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(("127.0.0.1", port))
            server.listen()
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen()
        assert port in listening_ports(os.getpid())
