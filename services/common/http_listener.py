"""The listening socket and base URL of an embedded uvicorn server (checkpoint, health).

The socket is bound before uvicorn starts, so port 0 works and the real address is known at
once; uvicorn serves on it (`serve(sockets=[...])`)."""

from __future__ import annotations

import socket


def bind_listener(host: str, port: int, *, backlog: int) -> socket.socket:
    """A TCP socket listening on `host:port` (IPv6 when `host` has a colon); closed on error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def http_url(host: str, port: int) -> str:
    """`http://host:port`, with an IPv6 host in brackets."""
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"
