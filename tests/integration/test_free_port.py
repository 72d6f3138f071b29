"""`free_port`: the port it hands out stays reserved for the child that binds it, on real sockets
and a real gRPC server."""

from __future__ import annotations

import socket
from concurrent import futures

import grpc

from fthsdp.deploy.processes import free_port


def _listen_reusing(port: int) -> socket.socket:
    """What every server here does: SO_REUSEADDR, bind, listen."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(1)
    return sock


def test_a_handed_out_port_is_bound_by_a_server_at_once() -> None:
    port = free_port()
    with _listen_reusing(port) as server, socket.create_connection(("127.0.0.1", port)) as c:
        peer, _ = server.accept()
        with peer:
            c.sendall(b"x")
            assert peer.recv(1) == b"x"


def test_a_grpc_server_binds_a_handed_out_port() -> None:
    port = free_port()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    try:
        assert server.add_insecure_port(f"127.0.0.1:{port}") == port
        server.start()
    finally:
        server.stop(grace=None)


def test_handed_out_ports_are_neither_repeated_nor_picked_by_the_kernel_meanwhile() -> None:
    """The race the reservation closes: a port merely reported free came back from the next
    `bind(0)` (another launcher's pick, a client's source port) before its child bound it."""
    handed = [free_port() for _ in range(200)]
    assert len(set(handed)) == len(handed)
    picked: set[int] = set()
    for _ in range(2000):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            picked.add(sock.getsockname()[1])
    # With 200 of ~28,000 ephemeral ports merely released, 2,000 picks hit ~14 of them.
    assert picked.isdisjoint(handed)
