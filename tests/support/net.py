"""Free loopback ports and sockets for servers and peers the tests start."""

from __future__ import annotations

import socket


def free_socket() -> socket.socket:
    """A TCP socket bound to an ephemeral port of 127.0.0.1 (not listening yet): a
    server started on it has its port before it starts."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def free_port(kind: int = socket.SOCK_DGRAM, host: str = "127.0.0.1") -> int:
    """A port free on ``host`` a moment ago (for a peer that binds it itself: SIPp, baresip,
    a gateway process)."""
    with socket.socket(socket.AF_INET, kind) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
