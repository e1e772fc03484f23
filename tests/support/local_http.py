"""HTTP requests to the suite's servers on loopback, without a TLS set-up per request.

``httpx.get(url)`` builds a client for the one request, and every client builds an SSL context
from the CA bundle (~36 ms of CPU) even for an ``http://`` URL; the suite polls ``/readyz`` and
``/metrics`` about a thousand times. These share one client (httpx: "It can be shared between
threads") that keeps no connection alive between requests, so each request still opens its own
connection, as ``httpx.get`` does: a test of draining or of connection limits sees the same
traffic.
"""

from __future__ import annotations

from typing import Any

import httpx

_client = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))


def get(url: str, **kwargs: Any) -> httpx.Response:
    """``httpx.get`` on the shared client (same keyword arguments)."""
    return _client.get(url, **kwargs)


def post(url: str, **kwargs: Any) -> httpx.Response:
    """``httpx.post`` on the shared client (same keyword arguments)."""
    return _client.post(url, **kwargs)
