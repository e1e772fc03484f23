"""X-Twilio-Signature validation for the voice webhooks and the Media Streams upgrade.

Twilio signs the full URL it requested (plus, for form POSTs, the sorted form parameters) with
the account's auth token (https://www.twilio.com/docs/usage/security#validating-requests). Behind
a load balancer the URL the gateway sees is not the one Twilio requested, so the public base URL
comes from configuration (``GATEWAY_PUBLIC_URL``). For the WebSocket upgrade Twilio signs the
``wss://`` URL of the ``<Stream>`` with no parameters.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from starlette.datastructures import URL
from starlette.requests import HTTPConnection
from twilio.request_validator import RequestValidator, get_signature_algorithm

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "x-twilio-signature"
#: Present when the account signs with HMAC-SHA256 instead of HMAC-SHA1.
SETTINGS_HEADER = "x-twilio-webhooks-signature-settings"


class SignatureChecker:
    """Validates X-Twilio-Signature against the public URL of each request."""

    def __init__(self, auth_token: str | None, public_url: str | None) -> None:
        self._validator = RequestValidator(auth_token) if auth_token else None
        self.public_url = public_url
        self._warned = False

    @property
    def enabled(self) -> bool:
        return self._validator is not None

    def public_http_url(self, conn: HTTPConnection) -> str:
        """The https:// URL Twilio requested for ``conn`` (configured base + path + query)."""
        return self._public(conn, websocket=False)

    def public_ws_url(self, conn: HTTPConnection) -> str:
        """The wss:// URL Twilio requested for the WebSocket upgrade ``conn``."""
        return self._public(conn, websocket=True)

    def base_url(self, conn: HTTPConnection) -> str:
        """Public base URL (scheme://host[/prefix]) without a trailing slash."""
        if self.public_url:
            return self.public_url
        if not self._warned:
            log.warning(
                "GATEWAY_PUBLIC_URL is not set: deriving public URLs from request headers; "
                "set it when running behind a load balancer or proxy"
            )
            self._warned = True
        headers = conn.headers
        scheme = headers.get("x-forwarded-proto", conn.url.scheme).split(",")[0].strip()
        scheme = {"ws": "http", "wss": "https"}.get(scheme, scheme)
        host = headers.get("x-forwarded-host", headers.get("host", conn.url.netloc))
        return f"{scheme}://{host.split(',')[0].strip()}"

    def _public(self, conn: HTTPConnection, *, websocket: bool) -> str:
        base = self.base_url(conn)
        if websocket:
            base = "wss" + base[len("https") :] if base.startswith("https") else "ws" + base[4:]
        prefix = urlsplit(base).path
        url: URL = conn.url
        path = url.path
        if prefix and path.startswith(prefix):
            path = path[len(prefix) :]
        query = f"?{url.query}" if url.query else ""
        return base + path + query

    def check(self, conn: HTTPConnection, params: Mapping[str, Any], *, websocket: bool) -> bool:
        """True if the request carries a valid signature (always True when disabled).

        ``params`` is the form (a Starlette ``FormData`` keeps repeated keys, which Twilio
        signs too) or an empty mapping for the WebSocket upgrade.
        """
        if self._validator is None:
            return True
        signature = conn.headers.get(SIGNATURE_HEADER, "")
        if not signature:
            return False
        url = self.public_ws_url(conn) if websocket else self.public_http_url(conn)
        algorithm = get_signature_algorithm(conn.headers.get(SETTINGS_HEADER))
        return bool(self._validator.validate(url, params, signature, algorithm))
