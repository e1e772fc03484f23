"""Stateless HTTP Digest authentication for SIP requests, sans-I/O (RFC 3261 22, RFC 2617,
RFC 8760 for SHA-256).

:class:`DigestAuthenticator` issues challenges whose nonce carries its own issue time and an
HMAC over it (keyed by a server secret), so any nonce it issued can be checked later without
remembering it, and expires after ``nonce_ttl_s``. A correct response on an expired nonce is
reported *stale* (RFC 2617 3.2.1): challenge again with ``stale=true`` and the client retries
without asking the user. Time comes from the injected :class:`~gateway.clock.Clock` (its
wall clock, :meth:`~gateway.clock.Clock.wall`).

Limits: only ``qop=auth`` (no ``auth-int``), no ``-sess`` algorithms; replay of a still-valid
nonce is not detected (stateless by design; the SIP transaction layer absorbs retransmissions).

Nothing here raises on hostile input: :meth:`DigestAuthenticator.check` returns a
:class:`DigestResult` saying why a request was refused; misconfiguration raises
:class:`ValueError` at construction.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

from gateway.clock import Clock, SystemClock
from gateway.sip.message import SipRequest

__all__ = ["ALGORITHMS", "DigestAuthenticator", "DigestResult", "parse_credentials"]

#: RFC 8760 2.1 algorithm names, as sent in ``algorithm=``, to their hash.
ALGORITHMS: dict[str, str] = {"MD5": "md5", "SHA-256": "sha256"}

_TOKEN_RE = re.compile(r"[A-Za-z0-9\-.!%*_+`'~]+")
_VALUE_RE = re.compile(r"[^\s,\"]+")
_SCHEME_RE = re.compile(r"[ \t]*([A-Za-z0-9\-]+)[ \t]+(.*)", re.DOTALL)
_NC_RE = re.compile(r"[0-9A-Fa-f]{8}")
_HEX_RE = re.compile(r"[0-9a-f]+")
_NONCE_TIME_RE = re.compile(r"[0-9a-f]{1,16}")


@dataclass(frozen=True)
class DigestResult:
    """The outcome of :meth:`DigestAuthenticator.check`.

    ``username`` is set only on success; ``stale`` means the credentials were right but the
    nonce expired (answer with a fresh ``stale=true`` challenge); ``reason`` is for logs.
    """

    username: str | None
    stale: bool = False
    reason: str = ""


def parse_credentials(value: str) -> dict[str, str] | None:
    """Parse ``Digest name=value, name="quoted", ...`` (RFC 2617 3.2.2) into lower-cased names.

    Returns None for another scheme or any syntax error (never raises).
    """
    m = _SCHEME_RE.fullmatch(value)
    if m is None or m.group(1).lower() != "digest":
        return None
    s = m.group(2)
    params: dict[str, str] = {}
    i, n = 0, len(s)
    while True:
        while i < n and s[i] in " \t":
            i += 1
        name_match = _TOKEN_RE.match(s, i)
        if name_match is None:
            return None
        name = name_match.group().lower()
        i = name_match.end()
        while i < n and s[i] in " \t":
            i += 1
        if i >= n or s[i] != "=":
            return None
        i += 1
        while i < n and s[i] in " \t":
            i += 1
        if i < n and s[i] == '"':
            out: list[str] = []
            i += 1
            while i < n and s[i] != '"':
                if s[i] == "\\" and i + 1 < n:
                    i += 1
                out.append(s[i])
                i += 1
            if i >= n:
                return None
            i += 1
            param = "".join(out)
        else:
            value_match = _VALUE_RE.match(s, i)
            if value_match is None:
                return None
            param = value_match.group()
            i = value_match.end()
        if name in params:
            return None
        params[name] = param
        while i < n and s[i] in " \t":
            i += 1
        if i >= n:
            return params
        if s[i] != ",":
            return None
        i += 1


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _hash(algorithm: str, text: str) -> str:
    digest = hashlib.new(ALGORITHMS[algorithm], text.encode("utf-8"), usedforsecurity=False)
    return digest.hexdigest()


def _algorithm(name: str) -> str | None:
    for known in ALGORITHMS:
        if known.lower() == name.lower():
            return known
    return None


class DigestAuthenticator:
    """Challenges and verifies SIP digest credentials against a username -> password table.

    ``secret`` keys the nonce HMAC (at least 16 bytes); ``clock``'s wall time stamps nonces and
    ages them (default: real time).
    """

    def __init__(
        self,
        realm: str,
        users: Mapping[str, str],
        secret: bytes,
        nonce_ttl_s: float = 300,
        clock: Clock | None = None,
        *,
        algorithm: str = "MD5",
    ) -> None:
        if len(secret) < 16:
            raise ValueError("digest secret must be at least 16 bytes")
        if _algorithm(algorithm) is None:
            raise ValueError(f"unsupported digest algorithm {algorithm!r}; use MD5 or SHA-256")
        if not realm or any(c in realm for c in "\r\n\x00"):
            raise ValueError("digest realm must be a non-empty single-line string")
        self.realm = realm
        self.users = dict(users)
        self.nonce_ttl_s = nonce_ttl_s
        self.algorithm = _algorithm(algorithm) or "MD5"
        self._secret = bytes(secret)
        self._clock = clock if clock is not None else SystemClock()

    # --- nonces -------------------------------------------------------------------------------

    def _mac(self, stamp: str, salt: str, algorithm: str) -> str:
        message = f"{stamp}.{salt}.{self.realm}.{algorithm}".encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()[:32]

    def _new_nonce(self, algorithm: str) -> str:
        # <issue time, hex>.<salt>.<HMAC(secret, time.salt.realm.algorithm)>: self-verifying.
        stamp = f"{int(self._clock.wall()):x}"
        salt = secrets.token_hex(8)
        return f"{stamp}.{salt}.{self._mac(stamp, salt, algorithm)}"

    def _nonce_time(self, nonce: str, algorithm: str) -> int | None:
        """The nonce's issue time if we issued it for ``algorithm``; None if forged/tampered."""
        parts = nonce.split(".")
        if len(parts) != 3 or not _NONCE_TIME_RE.fullmatch(parts[0]):
            return None
        stamp, salt, mac = parts
        if not hmac.compare_digest(self._mac(stamp, salt, algorithm), mac):
            return None
        return int(stamp, 16)

    # --- challenges ---------------------------------------------------------------------------

    def challenge(self, *, algorithm: str | None = None, stale: bool = False) -> tuple[str, str]:
        """A ``WWW-Authenticate`` / ``Proxy-Authenticate`` value and its nonce (RFC 2617 3.2.1)."""
        name = _algorithm(algorithm) if algorithm is not None else self.algorithm
        if name is None:
            raise ValueError(f"unsupported digest algorithm {algorithm!r}; use MD5 or SHA-256")
        nonce = self._new_nonce(name)
        value = (
            f"Digest realm={_quote(self.realm)}, nonce={_quote(nonce)}, "
            f'algorithm={name}, qop="auth"'
        )
        if stale:
            value += ", stale=true"
        return value, nonce

    def challenge_header(self, *, algorithm: str | None = None, stale: bool = False) -> str:
        """The header value of :meth:`challenge` alone."""
        return self.challenge(algorithm=algorithm, stale=stale)[0]

    # --- verification -------------------------------------------------------------------------

    def check(self, request: SipRequest, header_name: str = "Authorization") -> DigestResult:
        """Check every ``header_name`` row for our realm; success, stale, or why not."""
        outcome = DigestResult(None, reason=f"no {header_name} for realm {self.realm!r}")
        for value in request.headers.get_all(header_name):
            result = self._check_one(request, value)
            if result is None:
                continue
            if result.username is not None:
                return result
            if result.stale or not outcome.stale:
                outcome = result
        return outcome

    def verify(self, request: SipRequest, header_name: str = "Authorization") -> str | None:
        """The authenticated username, or None (see :meth:`check` for stale/why)."""
        return self.check(request, header_name).username

    def _check_one(self, request: SipRequest, value: str) -> DigestResult | None:
        creds = parse_credentials(value)
        if creds is None:
            return DigestResult(None, reason="malformed credentials")
        if creds.get("realm") != self.realm:
            return None  # credentials for another realm (RFC 3261 22.3): not ours to judge
        missing = [k for k in ("username", "nonce", "uri", "response") if k not in creds]
        if missing:
            return DigestResult(None, reason=f"credentials lack {', '.join(missing)}")
        algorithm = _algorithm(creds.get("algorithm", "MD5"))
        if algorithm is None:
            return DigestResult(None, reason=f"unsupported algorithm {creds['algorithm']!r}")
        issued = self._nonce_time(creds["nonce"], algorithm)
        if issued is None:
            return DigestResult(None, reason="nonce was not issued by us")
        username = creds["username"]
        password = self.users.get(username)
        if password is None:
            return DigestResult(None, reason=f"unknown user {username!r}")
        if creds["uri"] != request.uri:
            # RFC 2617 3.2.2.5: the digest-uri must be the Request-URI.
            return DigestResult(None, reason="digest uri does not match the Request-URI")

        ha1 = _hash(algorithm, f"{username}:{self.realm}:{password}")
        ha2 = _hash(algorithm, f"{request.method}:{creds['uri']}")
        qop = creds.get("qop")
        if qop is None:
            # RFC 2069 compatibility (RFC 2617 3.2.2.1 without qop).
            expected = _hash(algorithm, f"{ha1}:{creds['nonce']}:{ha2}")
        elif qop.lower() == "auth":
            nc, cnonce = creds.get("nc", ""), creds.get("cnonce", "")
            if not _NC_RE.fullmatch(nc) or not cnonce:
                return DigestResult(None, reason="qop=auth without a valid nc and cnonce")
            expected = _hash(algorithm, f"{ha1}:{creds['nonce']}:{nc}:{cnonce}:auth:{ha2}")
        else:
            return DigestResult(None, reason=f"unsupported qop {qop!r}")
        response = creds["response"].lower()
        if not _HEX_RE.fullmatch(response) or not hmac.compare_digest(expected, response):
            return DigestResult(None, reason="wrong response (password or digest)")

        age = self._clock.wall() - issued
        if age > self.nonce_ttl_s:
            return DigestResult(None, stale=True, reason="nonce expired")
        if age < -self.nonce_ttl_s:
            return DigestResult(None, reason="nonce issued in the future")
        return DigestResult(username)
