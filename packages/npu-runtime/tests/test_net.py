import socket

import pytest

from turnrl.npu_runtime.net import free_port


@pytest.mark.parametrize("host", ["127.0.0.1", ""])
def test_free_port_can_be_bound_again_and_differs_from_a_held_one(host: str) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        port = free_port(host)
        assert port != taken and 1024 <= port < 65536
        with socket.socket() as again:
            again.bind((host, port))  # raises if free_port handed out a bound port
