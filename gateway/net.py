"""Listening sockets, bound before anything else starts.

``gateway serve`` binds every socket it listens on (HTTP, and SIP when configured) before it
reads the script, opens the prompt cache or starts loading the model, and hands them to the
server. A port that cannot be bound (in use, an address that is not this host's, a privileged
port) then stops start-up with one line that names the setting to change
(:class:`~gateway.errors.ConfigError`), and there is nothing to stop behind it: no model-loading
thread (a thread cannot be cancelled, and the interpreter waits for it at exit), no task, no
half-started server. Left to uvicorn, the HTTP bind happened after the app's lifespan had started
the model load, and failed with uvicorn's own message and a process that lingered until the
load finished.
"""

from __future__ import annotations

import socket
from typing import Literal

from gateway.errors import ConfigError

__all__ = ["bind"]


def bind(host: str, port: int, *, kind: Literal["tcp", "udp"], what: str,
         variable: str) -> socket.socket:
    """A socket bound to ``host:port`` (non-blocking), or a :class:`ConfigError` like
    ``cannot bind the HTTP server to tcp 0.0.0.0:8080 (GATEWAY_PORT): Address already in use``.

    ``what`` names the listener and ``variable`` the setting(s) that chose the address. A TCP
    socket is bound, not listening: the server calls ``listen()`` when it starts serving.
    """
    sock_type = socket.SOCK_STREAM if kind == "tcp" else socket.SOCK_DGRAM

    def failed(exc: OSError) -> ConfigError:
        return ConfigError(f"cannot bind the {what} to {kind} {host}:{port} ({variable}): "
                           f"{exc.strerror or exc}")

    try:
        family, sock_type, proto, _, address = socket.getaddrinfo(
            host or None, port, type=sock_type, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, sock_type, proto)
    except OSError as exc:
        raise failed(exc) from None
    try:
        if kind == "tcp":
            # What uvicorn does: a restarted gateway can bind over its predecessor's
            # TIME_WAIT connections; a port another process listens on still fails (Linux).
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise failed(exc) from None
    sock.setblocking(False)
    return sock
