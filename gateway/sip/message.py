"""SIP messages, sans-I/O (RFC 3261 sections 7, 8.2.6, 18, 20 and 25).

:func:`parse_message` turns one datagram into a :class:`SipRequest` or :class:`SipResponse`;
both serialize back with :meth:`SipRequest.serialize` / :meth:`SipResponse.serialize`. The
helpers parse the header values the transaction and dialog layers need (:func:`parse_name_addr`,
:func:`parse_via`, :func:`parse_cseq`), build responses (:func:`response_to`, :func:`stamp_via`)
and requests (:func:`build_request`), and route requests inside a dialog (:func:`dialog_route`,
:func:`uri_hostport`). Nothing here touches a socket or a clock.

Exception tree (all under :class:`gateway.errors.GatewayError`):

- :class:`SipParseError`: the bytes are not an acceptable SIP message. :attr:`~SipParseError.status`
  is the response a UAS should send (400 malformed, 413 too large, 414 Request-URI too long,
  505 wrong SIP version), or 0 when no response is possible: not a SIP start line, a response
  (responses are never answered), or an ACK (RFC 3261 17.1.1.1: ACK gets no response).
  :attr:`~SipParseError.request` carries what could be parsed of a request, so the endpoint
  can build that response with :func:`response_to`.
    - :class:`SipKeepalive`: a CRLF keepalive (RFC 5626 section 3.5.1); status 0, ignore it.

Programming errors (building a header with CR/LF in it, a status outside 100-699) raise
:class:`ValueError`: they are bugs in the caller, never a reaction to the network.
"""

from __future__ import annotations

import functools
import ipaddress
import re
import secrets
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from gateway.errors import GatewayError

__all__ = [
    "REASON_PHRASES",
    "Headers",
    "NameAddr",
    "SipKeepalive",
    "SipMessage",
    "SipParseError",
    "SipRequest",
    "SipResponse",
    "Via",
    "build_request",
    "dialog_route",
    "new_branch",
    "new_call_id",
    "new_tag",
    "parse_cseq",
    "parse_message",
    "parse_name_addr",
    "parse_via",
    "reason_phrase",
    "response_to",
    "stamp_via",
    "uri_hostport",
]


class SipParseError(GatewayError):
    """A SIP message (or header value) that cannot be accepted.

    ``status`` is the response a UAS should send if it can (400, 413, 414, 505), or 0 when no
    response is possible or allowed; ``request`` is what could be read of the request (its
    method and the header fields that are well-formed on their own) whenever ``status`` is
    set, for building that response; whether it can be routed (a usable Via) is the UAS's call.
    """

    def __init__(self, status: int, message: str, *, request: SipRequest | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.request = request


class SipKeepalive(SipParseError):
    """A CRLF keepalive ping or pong (RFC 5626 section 3.5.1); to be ignored silently."""

    def __init__(self) -> None:
        super().__init__(0, "CRLF keepalive (RFC 5626 section 3.5.1)")


# --- lexical building blocks (RFC 3261 section 25.1) ------------------------------------------

#: RFC 3261 25.1: token = 1*(alphanum / "-" / "." / "!" / "%" / "*" / "_" / "+" / "`" / "'" / "~")
_TOKEN = r"[A-Za-z0-9\-.!%*_+`'~]+"
_TOKEN_RE = re.compile(_TOKEN)
_WS = " \t"
# Control characters other than HTAB: never legal unescaped in a SIP header (RFC 3261 25.1
# TEXT-UTF8char is %x21-7E / UTF8-NONASCII, plus LWS). They are refused even inside quoted-pairs
# (a deliberate deviation from RFC 4475 3.1.1.2): NUL/BEL/DEL in a header only ever hurt logs.
_CTL_RE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
# The same over a whole header section: LF, and CR before LF, end lines; any other is a control.
_HEAD_CTL_RE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]|\r(?!\n)")
# RFC 3986 3.1 scheme, then anything but whitespace, quotes and angle brackets.
_URI_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*:[^\s<>\"]+")
# A generic-param value that is not a quoted-string: token / host (IPv6 too) / anything that is
# not a separator. Kept permissive so unknown parameters survive a round trip.
_PVALUE_RE = re.compile(r"[^\s;,\"<>=]+")
_CSEQ_RE = re.compile(r"[ \t]*([0-9]{1,10})[ \t]+(" + _TOKEN + r")[ \t]*")
_VIA_RE = re.compile(
    r"[ \t]*(" + _TOKEN + r")[ \t]*/[ \t]*(" + _TOKEN + r")[ \t]*/[ \t]*(" + _TOKEN + r")[ \t]+"
    r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9\-.]+)(?:[ \t]*:[ \t]*([0-9]{1,5}))?"
)
_DIGITS_RE = re.compile(r"[0-9]{1,10}")
_VERSION_RE = re.compile(r"SIP/[0-9]+\.[0-9]+", re.IGNORECASE)
_BLANK_LINE_RE = re.compile(rb"\r?\n\r?\n")

#: RFC 3261 8.1.1: the header fields every request must carry (Max-Forwards is let off, as
#: RFC 3261 16.6 proxies add it and old UAs omit it).
MANDATORY_HEADERS = ("To", "From", "CSeq", "Call-ID", "Via")

#: RFC 3261 7.3.3 compact forms, plus the later extensions' (RFC 3265, 3515, 3892, 4028).
_COMPACT = {
    "i": "Call-ID",
    "m": "Contact",
    "e": "Content-Encoding",
    "l": "Content-Length",
    "c": "Content-Type",
    "f": "From",
    "s": "Subject",
    "k": "Supported",
    "t": "To",
    "v": "Via",
    "o": "Event",
    "r": "Refer-To",
    "b": "Referred-By",
    "u": "Allow-Events",
    "x": "Session-Expires",
}
_KNOWN_NAMES = (
    "Accept", "Accept-Encoding", "Accept-Language", "Alert-Info", "Allow", "Allow-Events",
    "Authentication-Info", "Authorization", "Call-ID", "Call-Info", "Contact",
    "Content-Disposition", "Content-Encoding", "Content-Language", "Content-Length",
    "Content-Type", "CSeq", "Date", "Error-Info", "Event", "Expires", "From", "In-Reply-To",
    "Max-Forwards", "Min-Expires", "Min-SE", "MIME-Version", "Organization",
    "P-Asserted-Identity", "Priority", "Privacy", "Proxy-Authenticate", "Proxy-Authorization",
    "Proxy-Require", "RAck", "Reason", "Record-Route", "Refer-To", "Referred-By", "Replaces",
    "Reply-To", "Require", "Retry-After", "Route", "RSeq", "Server", "Session-Expires",
    "Subject", "Subscription-State", "Supported", "Timestamp", "To", "Unsupported",
    "User-Agent", "Via", "Warning", "WWW-Authenticate",
)
_CANONICAL = {name.lower(): name for name in _KNOWN_NAMES}
# Header fields whose value is a comma-separated list (RFC 3261 7.3.1: "multiple header field
# rows ... if and only if the entire field-value for that header field is defined as a
# comma-separated list"). Authorization and friends are NOT: their commas separate parameters.
_LIST_HEADERS = frozenset(
    name.lower()
    for name in (
        "Via", "Route", "Record-Route", "Contact", "Allow", "Supported", "Require",
        "Proxy-Require", "Unsupported", "Allow-Events", "Accept", "Accept-Encoding",
        "Accept-Language", "Content-Encoding",
    )
)

#: RFC 3261 section 21 reason phrases (plus RFC 3262/3265/3891/4028/6665 additions).
REASON_PHRASES: dict[int, str] = {
    100: "Trying",
    180: "Ringing",
    181: "Call Is Being Forwarded",
    182: "Queued",
    183: "Session Progress",
    200: "OK",
    202: "Accepted",
    300: "Multiple Choices",
    301: "Moved Permanently",
    302: "Moved Temporarily",
    305: "Use Proxy",
    380: "Alternative Service",
    400: "Bad Request",
    401: "Unauthorized",
    402: "Payment Required",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    406: "Not Acceptable",
    407: "Proxy Authentication Required",
    408: "Request Timeout",
    410: "Gone",
    413: "Request Entity Too Large",
    414: "Request-URI Too Long",
    415: "Unsupported Media Type",
    416: "Unsupported URI Scheme",
    420: "Bad Extension",
    421: "Extension Required",
    422: "Session Interval Too Small",
    423: "Interval Too Brief",
    480: "Temporarily Unavailable",
    481: "Call/Transaction Does Not Exist",
    482: "Loop Detected",
    483: "Too Many Hops",
    484: "Address Incomplete",
    485: "Ambiguous",
    486: "Busy Here",
    487: "Request Terminated",
    488: "Not Acceptable Here",
    489: "Bad Event",
    491: "Request Pending",
    493: "Undecipherable",
    500: "Server Internal Error",
    501: "Not Implemented",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Server Time-out",
    505: "Version Not Supported",
    513: "Message Too Large",
    600: "Busy Everywhere",
    603: "Decline",
    604: "Does Not Exist Anywhere",
    606: "Not Acceptable",
}
_CLASS_PHRASES = {
    1: "Provisional", 2: "Success", 3: "Redirection", 4: "Client Error", 5: "Server Error",
    6: "Global Failure",
}


def reason_phrase(status: int) -> str:
    """The default reason phrase for ``status`` (RFC 3261 21), or its class's name."""
    return REASON_PHRASES.get(status) or _CLASS_PHRASES.get(status // 100, "Unknown")


def _request_like(line: bytes) -> bool:
    """Loose shape of a Request-Line (``word SP ... SP SIP/...``): tells a malformed request,
    which deserves a 400, from garbage, which deserves silence. Linear time on purpose."""
    head, sep, tail = line.rstrip(b" ").partition(b" ")
    if not sep or not head:
        return False
    middle, sep, version = tail.rpartition(b" ")
    return bool(sep) and bool(middle.strip(b" ")) and version[:4].upper() == b"SIP/"


def _short(text: str, limit: int = 60) -> str:
    """``repr`` of ``text`` cut to ``limit`` characters, for error messages."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _check_value(value: str, what: str) -> None:
    if _CTL_RE.search(value):
        raise ValueError(f"{what} contains a control character or line break: {_short(value)}")


# --- headers -----------------------------------------------------------------------------------


def _split_list(value: str) -> list[str]:
    """Split a comma-separated header value, keeping commas inside quotes and ``<...>``."""
    if '"' not in value and "<" not in value:
        # The common case (a Via, an Allow list, one bare URI): nothing can hide a comma.
        return [part for raw in value.split(",") if (part := raw.strip(_WS))]
    parts: list[str] = []
    start = 0
    in_quote = in_angle = False
    i, n = 0, len(value)
    while i < n:
        c = value[i]
        if in_quote:
            if c == "\\":
                i += 1
            elif c == '"':
                in_quote = False
        elif in_angle:
            if c == ">":
                in_angle = False
        elif c == '"':
            in_quote = True
        elif c == "<":
            in_angle = True
        elif c == ",":
            part = value[start:i].strip(_WS)
            if part:
                parts.append(part)
            start = i + 1
        i += 1
    part = value[start:].strip(_WS)
    if part:
        parts.append(part)
    return parts


@functools.lru_cache(maxsize=1024)
def _canonical(name: str) -> str:
    # Cached: a message's dozen header names are looked up many times each, and the names
    # that occur are few (a peer inventing new ones only churns this bounded cache).
    lower = name.lower()
    if len(lower) == 1:
        return _COMPACT.get(lower, name)
    return _CANONICAL.get(lower, name)


@functools.lru_cache(maxsize=1024)
def _key(name: str) -> str:
    # The lookup key of a header name: its canonical spelling, lower-cased (cached as above).
    return _canonical(name).lower()


#: (name, lookup key) of each mandatory header field.
_MANDATORY_KEYS = tuple((name, _key(name)) for name in MANDATORY_HEADERS)


class Headers:
    """Ordered, case-insensitive multi-map of SIP header fields (RFC 3261 7.3).

    Names are stored canonically: compact forms expand (``i`` -> ``Call-ID``, RFC 3261 7.3.3)
    and well-known names take their RFC spelling (``call-id`` -> ``Call-ID``); unknown names
    keep the case they arrived in. Iteration yields ``(name, value)`` per header field row, in
    order; :meth:`get_all` splits comma-separated list headers (Via, Route, Contact, ...).
    """

    __slots__ = ("_fields",)

    def __init__(self, fields: Iterable[tuple[str, str]] = ()) -> None:
        # (lookup key, canonical name, value) per row: the key is computed once per row, not on
        # every lookup (a parsed message is asked for its dozen fields many times each).
        self._fields: list[tuple[str, str, str]] = []
        for name, value in fields:
            self.add(name, value)

    @staticmethod
    def canonical(name: str) -> str:
        """The canonical spelling of a header name (compact forms expanded)."""
        return _canonical(name)

    def _append(self, name: str, value: str) -> None:
        # Parser fast path: the name is a token and the value is clean already.
        canonical = _canonical(name)
        self._fields.append((_key(name), canonical, value))

    def add(self, name: str, value: str) -> None:
        """Append a header field row (after any existing ones of that name)."""
        if not _TOKEN_RE.fullmatch(name):
            raise ValueError(f"header name is not a token: {_short(name)}")
        _check_value(value, f"value of {name}")
        self._fields.append((_key(name), _canonical(name), value.strip(_WS)))

    def set(self, name: str, value: str) -> None:
        """Replace every row of ``name`` by one, at the position of the first (else append)."""
        if not _TOKEN_RE.fullmatch(name):
            raise ValueError(f"header name is not a token: {_short(name)}")
        _check_value(value, f"value of {name}")
        key = _key(name)
        row = (key, _canonical(name), value.strip(_WS))
        new: list[tuple[str, str, str]] = []
        placed = False
        for old in self._fields:
            if old[0] == key:
                if not placed:
                    new.append(row)
                    placed = True
            else:
                new.append(old)
        if not placed:
            new.append(row)
        self._fields = new

    def remove(self, name: str) -> None:
        """Remove every row of ``name`` (no error if there is none)."""
        key = _key(name)
        self._fields = [row for row in self._fields if row[0] != key]

    def get(self, name: str, default: str | None = None) -> str | None:
        """The first value of ``name``: for list headers, the first list element."""
        key = _key(name)
        for row_key, _, value in self._fields:
            if row_key == key:
                if key in _LIST_HEADERS:
                    parts = _split_list(value)
                    if not parts:
                        continue
                    return parts[0]
                return value
        return default

    def get_all(self, name: str) -> list[str]:
        """Every value of ``name`` in order; list headers' comma-joined values are split."""
        key = _key(name)
        values: list[str] = []
        for row_key, _, value in self._fields:
            if row_key == key:
                if key in _LIST_HEADERS:
                    values.extend(_split_list(value))
                else:
                    values.append(value)
        return values

    def rows(self, name: str) -> list[str]:
        """The raw header field rows of ``name``, unsplit, in order."""
        key = _key(name)
        return [value for row_key, _, value in self._fields if row_key == key]

    def _replace_value(self, index: int, value: str) -> None:
        # Row ``index`` keeps its name and takes ``value`` (already clean).
        key, name, _ = self._fields[index]
        self._fields[index] = (key, name, value)

    def copy(self) -> Headers:
        """A shallow copy (values are immutable strings)."""
        new = Headers()
        new._fields = list(self._fields)
        return new

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        key = _key(name)
        return any(row[0] == key for row in self._fields)

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter([(name, value) for _, name, value in self._fields])

    def __len__(self) -> int:
        return len(self._fields)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Headers):
            return NotImplemented
        return [(k, v) for k, _, v in self._fields] == [(k, v) for k, _, v in other._fields]

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Headers({[(name, value) for _, name, value in self._fields]!r})"


# --- header value helpers ----------------------------------------------------------------------


def _skip_ws(s: str, i: int) -> int:
    n = len(s)
    while i < n and s[i] in _WS:
        i += 1
    return i


def _parse_quoted(s: str, i: int, what: str) -> tuple[str, int]:
    """Parse the quoted-string at ``s[i] == '"'``; return its unescaped text and the end index."""
    out: list[str] = []
    j, n = i + 1, len(s)
    while j < n:
        c = s[j]
        if c == "\\":
            if j + 1 >= n:
                break
            out.append(s[j + 1])  # RFC 3261 25.1 quoted-pair
            j += 2
        elif c == '"':
            return "".join(out), j + 1
        else:
            out.append(c)
            j += 1
    raise SipParseError(400, f"unterminated quoted string in {what}")


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _parse_params(s: str, i: int, what: str) -> dict[str, str | None]:
    """Parse ``*( SEMI generic-param )`` from ``s[i:]`` to the end (RFC 3261 25.1)."""
    params: dict[str, str | None] = {}
    n = len(s)
    while True:
        i = _skip_ws(s, i)
        if i >= n:
            return params
        if s[i] != ";":
            raise SipParseError(400, f"unexpected {s[i]!r} in {what}: {_short(s)}")
        i = _skip_ws(s, i + 1)
        m = _TOKEN_RE.match(s, i)
        if m is None:
            raise SipParseError(400, f"empty or malformed parameter name in {what}: {_short(s)}")
        name = m.group().lower()
        i = _skip_ws(s, m.end())
        value: str | None = None
        if i < n and s[i] == "=":
            i = _skip_ws(s, i + 1)
            if i < n and s[i] == '"':
                value, i = _parse_quoted(s, i, what)
            else:
                m = _PVALUE_RE.match(s, i)
                if m is None:
                    raise SipParseError(400, f"parameter {name!r} in {what} has no value")
                value = m.group()
                i = m.end()
        if name in params:
            raise SipParseError(400, f"duplicate parameter {name!r} in {what}")
        params[name] = value


def _format_params(params: dict[str, str | None]) -> str:
    out: list[str] = []
    for name, value in params.items():
        if value is None:
            out.append(f";{name}")
        elif value and _PVALUE_RE.fullmatch(value):
            out.append(f";{name}={value}")
        else:
            out.append(f";{name}={_quote(value)}")
    return "".join(out)


@dataclass
class NameAddr:
    """A From/To/Contact/Route value (RFC 3261 20.10, 25.1 name-addr / addr-spec).

    ``display`` is the unescaped display name (None when absent); ``params`` are the *header*
    parameters (``tag``, ``expires``, ...), names lower-cased, ``None`` for a bare flag.
    """

    display: str | None
    uri: str
    params: dict[str, str | None] = field(default_factory=dict)

    @classmethod
    def parse(cls, value: str) -> NameAddr:
        """Same as :func:`parse_name_addr`."""
        return parse_name_addr(value)

    @property
    def tag(self) -> str | None:
        """The ``tag`` parameter (RFC 3261 19.3), or None."""
        return self.params.get("tag")

    def serialize(self) -> str:
        """Always the bracketed name-addr form, so URI parameters can never be misread."""
        display = f"{_quote(self.display)} " if self.display is not None else ""
        return f"{display}<{self.uri}>{_format_params(self.params)}"

    __str__ = serialize


def parse_name_addr(value: str) -> NameAddr:
    """Parse ``"Display" <uri>;params``, ``Display <uri>``, ``<uri>`` or a bare ``uri;params``.

    RFC 3261 20.10: with a bare addr-spec, everything after the first ``;`` is a header
    parameter, and the URI may not contain ``,``, ``?`` or ``;``. Raises SipParseError(400).
    """
    s = value.strip(_WS)
    what = "name-addr"
    display: str | None = None
    if s.startswith('"'):
        display, i = _parse_quoted(s, 0, what)
        i = _skip_ws(s, i)
        if i >= len(s) or s[i] != "<":
            raise SipParseError(400, f"expected <URI> after the display name: {_short(s)}")
        lt = i
    else:
        lt = s.find("<")
    if lt >= 0:
        if display is None:
            words = s[:lt].split()
            for word in words:
                if not _TOKEN_RE.fullmatch(word):
                    raise SipParseError(
                        400, f"unquoted display name must be tokens: {_short(s[:lt])}"
                    )
            display = " ".join(words) if words else None
        gt = s.find(">", lt + 1)
        if gt < 0:
            raise SipParseError(400, f"unterminated <URI>: {_short(s)}")
        uri = s[lt + 1 : gt]
        rest = gt + 1
    else:
        semi = s.find(";")
        uri = (s if semi < 0 else s[:semi]).strip(_WS)
        rest = len(s) if semi < 0 else semi
        if "," in uri or "?" in uri:
            raise SipParseError(400, f"a URI with ',' or '?' must be in <>: {_short(uri)}")
    if not _URI_RE.fullmatch(uri):
        raise SipParseError(400, f"malformed URI: {_short(uri)}")
    params = _parse_params(s, rest, what)
    return NameAddr(display, uri, params)


@dataclass
class Via:
    """One via-parm (RFC 3261 20.42): ``SIP/2.0/<transport> <host>[:<port>];params``.

    ``host`` keeps IPv6 brackets; ``params`` names are lower-cased, ``None`` for a bare flag
    (``rport`` in a request, RFC 3581).
    """

    transport: str
    host: str
    port: int | None = None
    params: dict[str, str | None] = field(default_factory=dict)

    @classmethod
    def parse(cls, value: str) -> Via:
        """Same as :func:`parse_via`."""
        return parse_via(value)

    @property
    def branch(self) -> str | None:
        """The ``branch`` parameter (RFC 3261 8.1.1.7), or None."""
        return self.params.get("branch")

    @property
    def received(self) -> str | None:
        """The ``received`` parameter (RFC 3261 18.2.1), or None."""
        return self.params.get("received")

    @property
    def rport(self) -> int | None:
        """The filled-in ``rport`` value (RFC 3581), or None when absent or still empty."""
        value = self.params.get("rport")
        return int(value) if value else None

    @property
    def has_rport(self) -> bool:
        """Whether the client asked for symmetric response routing (RFC 3581 ``rport``)."""
        return "rport" in self.params

    @property
    def sent_by(self) -> tuple[str, int | None]:
        """``(host, port)`` with IPv6 brackets removed."""
        return self.host.strip("[]"), self.port

    def serialize(self) -> str:
        """The via-parm text, ``SIP/2.0/UDP host:port;params``."""
        port = f":{self.port}" if self.port is not None else ""
        return f"SIP/2.0/{self.transport} {self.host}{port}{_format_params(self.params)}"

    __str__ = serialize


def parse_via(value: str) -> Via:
    """Parse one via-parm (not a comma-joined list; use ``Headers.get_all("Via")`` first).

    LWS is allowed around the ``/`` of sent-protocol and around ``;`` and ``=`` (RFC 3261
    25.1 SLASH, SEMI, EQUAL). Raises SipParseError(400).
    """
    m = _VIA_RE.match(value)
    if m is None:
        raise SipParseError(400, f"malformed Via: {_short(value)}")
    name, version, transport, host, port_text = m.groups()
    if name.upper() != "SIP" or version != "2.0":
        raise SipParseError(400, f"Via sent-protocol is not SIP/2.0: {_short(value)}")
    port: int | None = None
    if port_text is not None:
        port = int(port_text)
        if not 0 < port < 65536:
            raise SipParseError(400, f"Via port out of range: {_short(value)}")
    params = _parse_params(value, m.end(), "Via")
    if "branch" in params and not params["branch"]:
        raise SipParseError(400, "Via branch parameter has no value")
    rport = params.get("rport")
    if rport is not None and not (_DIGITS_RE.fullmatch(rport) and 0 < int(rport) < 65536):
        raise SipParseError(400, f"Via rport is not a port number: {rport!r}")
    return Via(transport.upper(), host, port, params)


def parse_cseq(value: str) -> tuple[int, str]:
    """Parse ``CSeq: <number> <method>`` (RFC 3261 20.16); the number must fit 32 bits."""
    m = _CSEQ_RE.fullmatch(value)
    if m is None:
        raise SipParseError(400, f"malformed CSeq: {_short(value)}")
    number = int(m.group(1))
    if number > 0xFFFFFFFF:
        raise SipParseError(400, f"CSeq number {number} does not fit 32 bits (RFC 3261 8.1.1.5)")
    return number, m.group(2)


def dialog_route(remote_target: str, route_set: list[str]) -> tuple[str, list[str]]:
    """Request-URI and Route values of a request inside a dialog (RFC 3261 12.2.1.1).

    ``route_set`` is the dialog's (12.1.1, 12.1.2); the next hop is always its first entry.
    A loose router (``;lr``, every current proxy) leaves the remote target in the Request-URI;
    a strict one wants itself there and the target as the last Route.
    """
    if not route_set:
        return remote_target, []
    try:
        first = parse_name_addr(route_set[0])
    except SipParseError:
        return remote_target, list(route_set)
    uri_params = {p.split("=", 1)[0].strip().lower() for p in first.uri.split(";")[1:]}
    if "lr" in uri_params:
        return remote_target, list(route_set)
    return first.uri, [*route_set[1:], f"<{remote_target}>"]


def uri_hostport(uri: str) -> tuple[str, int]:
    """Host and port (default 5060) of a SIP URI such as ``sip:user@127.0.0.1:5062;lr``:
    where a request to it goes over UDP (RFC 3263 without DNS: the host is an address)."""
    rest = uri.split(":", 1)[1] if uri.lower().startswith(("sip:", "sips:")) else uri
    rest = rest.split(";", 1)[0].split("?", 1)[0].rpartition("@")[2]
    if rest.startswith("["):
        host, _, port = rest[1:].partition("]")
        port = port.lstrip(":")
    else:
        host, _, port = rest.partition(":")
    if not host or (port and not (port.isascii() and port.isdigit() and 0 < int(port) < 65536)):
        raise SipParseError(400, f"no host:port in URI {_short(uri)}")
    return host, int(port) if port else 5060


def new_tag() -> str:
    """A fresh From/To tag: 64 random bits (RFC 3261 19.3 asks for at least 32)."""
    return secrets.token_hex(8)


def new_branch() -> str:
    """A fresh Via branch with the RFC 3261 8.1.1.7 magic cookie ``z9hG4bK``."""
    return "z9hG4bK" + secrets.token_hex(12)


def new_call_id(host: str) -> str:
    """A fresh, globally unique Call-ID ``<random>@<host>`` (RFC 3261 8.1.1.4)."""
    word = secrets.token_hex(16)
    return f"{word}@{host}" if host else word


# --- messages ----------------------------------------------------------------------------------


def _serialize(start_line: str, headers: Headers, body: bytes) -> bytes:
    _check_value(start_line, "start line")
    lines = [start_line]
    wrote_length = False
    for name, value in headers:
        if name.lower() == "content-length":
            # RFC 3261 20.14: always written, always the real body length; one row only.
            if wrote_length:
                continue
            value = str(len(body))
            wrote_length = True
        lines.append(f"{name}: {value}")
    if not wrote_length:
        lines.append(f"Content-Length: {len(body)}")
    lines.append("")
    lines.append("")
    return "\r\n".join(lines).encode("utf-8") + body


class SipMessage:
    """What requests and responses share: the header accessors the transaction layer needs."""

    headers: Headers
    body: bytes

    def _require(self, name: str) -> str:
        value = self.headers.get(name)
        if value is None:
            raise SipParseError(400, f"missing {name} header field")
        return value

    @property
    def call_id(self) -> str:
        """The Call-ID (RFC 3261 20.8)."""
        return self._require("Call-ID")

    @property
    def cseq(self) -> tuple[int, str]:
        """``(number, method)`` from CSeq (RFC 3261 20.16)."""
        return parse_cseq(self._require("CSeq"))

    def _tag(self, name: str) -> str | None:
        params = parse_name_addr(self._require(name)).params
        if "tag" in params and not params["tag"]:
            raise SipParseError(400, f"{name} tag parameter has no value")
        return params.get("tag")

    @property
    def from_tag(self) -> str | None:
        """The From tag (RFC 3261 8.1.1.3); None only from an RFC 2543 peer."""
        return self._tag("From")

    @property
    def to_tag(self) -> str | None:
        """The To tag; None outside a dialog (RFC 3261 8.1.1.2)."""
        return self._tag("To")

    @property
    def via(self) -> list[Via]:
        """Every Via, topmost first."""
        return [parse_via(value) for value in self.headers.get_all("Via")]

    @property
    def top_via(self) -> Via:
        """The topmost Via (RFC 3261 8.2.6.2, 18.2.1)."""
        return parse_via(self._require("Via"))

    @property
    def top_via_branch(self) -> str | None:
        """The top Via's branch; None only from an RFC 2543 peer (RFC 3261 17.2.3)."""
        return self.top_via.branch

    @property
    def content_type(self) -> str | None:
        """The media type of the body, lower-cased, without parameters."""
        value = self.headers.get("Content-Type")
        return value.split(";", 1)[0].strip(_WS).lower() if value else None


@dataclass(eq=True)
class SipRequest(SipMessage):
    """A SIP request (RFC 3261 7.1)."""

    method: str
    uri: str
    headers: Headers
    body: bytes = b""

    @classmethod
    def parse(cls, data: bytes, **limits: int) -> SipRequest:
        """Parse a datagram that must hold a request (see :func:`parse_message`)."""
        message = parse_message(data, **limits)
        if not isinstance(message, SipRequest):
            raise SipParseError(0, "expected a SIP request, got a response")
        return message

    def serialize(self) -> bytes:
        """Wire bytes: CRLF line ends, Content-Length always matching the body."""
        return _serialize(f"{self.method} {self.uri} SIP/2.0", self.headers, self.body)

    __bytes__ = serialize


@dataclass(eq=True)
class SipResponse(SipMessage):
    """A SIP response (RFC 3261 7.2)."""

    status: int
    reason: str
    headers: Headers
    body: bytes = b""

    @classmethod
    def parse(cls, data: bytes, **limits: int) -> SipResponse:
        """Parse a datagram that must hold a response (see :func:`parse_message`)."""
        message = parse_message(data, **limits)
        if not isinstance(message, SipResponse):
            raise SipParseError(0, "expected a SIP response, got a request")
        return message

    def serialize(self) -> bytes:
        """Wire bytes: CRLF line ends, Content-Length always matching the body."""
        return _serialize(f"SIP/2.0 {self.status} {self.reason}", self.headers, self.body)

    __bytes__ = serialize


# --- the parser --------------------------------------------------------------------------------


def parse_message(
    data: bytes, *, max_size: int = 65535, max_headers: int = 100, max_line: int = 8192
) -> SipRequest | SipResponse:
    """Parse one SIP message from a datagram (RFC 3261 section 7, 18.3).

    Tolerates bare-LF line ends and leading CRLFs (RFC 3261 7.5), unfolds continuation lines
    (7.3.1), honours Content-Length (a longer datagram is cut to it; a shorter one is a 400;
    without one the rest of the datagram is the body, 18.3). Raises :class:`SipParseError`
    whose ``status`` says which response a UAS should send, or :class:`SipKeepalive`.
    """
    data = bytes(data)
    stripped = data.lstrip(b"\r\n")
    if not stripped:
        if data:
            raise SipKeepalive()
        raise SipParseError(0, "empty datagram")

    # Classify the start line first: it decides whether any error can be answered at all.
    eol = stripped.find(b"\n", 0, max_line + 2)
    first = stripped[: eol if eol >= 0 else max_line + 2]
    if first.endswith(b"\r"):
        first = first[:-1]
    is_response = first[:4].upper() == b"SIP/"
    request_like = not is_response and _request_like(first)
    method = first.split(b" ", 1)[0].decode("latin-1") if request_like else ""
    # RFC 3261 17.1.1.1 / 17.2.3: ACK and responses are never answered.
    answerable = request_like and method != "ACK"

    def fail(status: int, message: str, request: SipRequest | None = None) -> SipParseError:
        if request is None and answerable and status:
            # Rejected before its header fields were all read: what can be read of them may
            # still say where the 400 goes (a Via), so the peer is answered, not left to
            # retransmit for 32 s (RFC 3261 8.2.6.1, 17.2.1).
            request = _salvage(stripped, max_line, max_headers)
        return SipParseError(status if answerable else 0, message, request=request)

    if len(first) > max_line:
        # Too long to classify by shape: a token then SP is taken as a request (RFC 3261 21.4.12
        # 414 is the answer for a Request-URI we will not read).
        word = first.split(b" ", 1)
        looks_request = (
            not is_response
            and len(word) == 2
            and word[0] != b"ACK"
            and _TOKEN_RE.fullmatch(word[0].decode("latin-1")) is not None
        )
        raise SipParseError(
            414 if looks_request else 0, f"start line is over the {max_line}-byte limit",
            request=_salvage(stripped, max_line, max_headers) if looks_request else None,
        )
    if not is_response and not request_like:
        raise SipParseError(0, f"not a SIP message: first line is {_short(repr(first)[2:-1])}")
    if len(data) > max_size:
        raise fail(413, f"message is {len(data)} bytes; the limit is {max_size}")

    # Header section ends at the first empty line (RFC 3261 7). A message without one that
    # still ends in a line break is taken as having no body.
    m = _BLANK_LINE_RE.search(stripped)
    if m is not None:
        head, raw_body = stripped[: m.start()], stripped[m.end() :]
    elif stripped.endswith(b"\n"):
        head, raw_body = stripped.rstrip(b"\r\n"), b""
    else:
        raise fail(400, "header section is not terminated by an empty line")

    lines = _fast_lines(head, max_line)
    if lines is None:
        lines = _checked_lines(head, max_line, fail)
    start_line, header_lines = lines[0], lines[1:]

    # Unfold (RFC 3261 7.3.1): a line starting with SP/HTAB continues the previous field.
    # Only a head with a line break before SP/HTAB has one (most have none: no loop then).
    logical: list[str]
    if b"\n " in head or b"\n\t" in head:
        logical = []
        for number, line in enumerate(header_lines, 2):
            if line[:1] in (" ", "\t"):
                if not logical:
                    raise fail(
                        400, f"line {number} is a continuation line with nothing to continue")
                logical[-1] = logical[-1].rstrip(_WS) + " " + line.strip(_WS)
            else:
                if len(logical) >= max_headers:
                    raise fail(400, f"more than {max_headers} header fields")
                logical.append(line)
    elif len(header_lines) > max_headers:
        raise fail(400, f"more than {max_headers} header fields")
    else:
        logical = header_lines

    headers = Headers()
    for field_line in logical:
        name, colon, value = field_line.partition(":")
        name = name.rstrip(_WS)
        if not colon or not _TOKEN_RE.fullmatch(name):
            raise fail(400, f"malformed header field: {_short(field_line)}")
        headers._append(name, value.strip(_WS))

    if is_response:
        return _finish_response(start_line, headers, raw_body)
    return _finish_request(start_line, headers, raw_body, fail)


def _fast_lines(head: bytes, max_line: int) -> list[str] | None:
    """The header section's lines when it is clean (the common case), else None.

    Clean: short enough that no line can pass ``max_line``, valid UTF-8 as a whole (so each line
    is: LF never occurs inside a multi-byte sequence), and no control character but a CR that
    ends a line. :func:`_checked_lines` accepts exactly these heads with the same lines, and
    says which line is wrong in any other: the slow path runs only for a message it rejects or
    one over ``max_line`` bytes.
    """
    if len(head) > max_line:
        return None
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if _HEAD_CTL_RE.search(text) is not None:
        return None
    return text.replace("\r\n", "\n").split("\n")


def _checked_lines(head: bytes, max_line: int, fail: _Fail) -> list[str]:
    """The header section's lines, line by line: raises ``fail`` naming the first bad one."""
    raw_lines = head.split(b"\n")
    lines: list[str] = []
    for number, raw in enumerate(raw_lines, 1):
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        if len(raw) > max_line:
            raise fail(400, f"line {number} is {len(raw)} bytes; the limit is {max_line}")
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise fail(
                400,
                f"line {number} is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column "
                f"{exc.start + 1})",
            ) from None
        ctl = _CTL_RE.search(line)
        if ctl is not None:
            raise fail(
                400, f"control character 0x{ord(ctl.group()):02x} in line {number}"
            )
        lines.append(line)
    return lines


def _salvage(data: bytes, max_line: int, max_headers: int) -> SipRequest:
    """What can be read of a request the parser rejected early, to answer it with.

    The method (the start line's first word) and every header field line that is well-formed
    on its own; lines that are not (too long, not UTF-8, control characters, no ``name:``) are
    skipped, with their continuation lines. Values stay free of CR, LF and controls, so they
    can be copied into the response as they are. The Request-URI is left empty: a response
    never repeats it.
    """
    m = _BLANK_LINE_RE.search(data)
    lines = (data[: m.start()] if m is not None else data).split(b"\n")
    method = lines[0].split(b" ", 1)[0].decode("latin-1")
    headers = Headers()
    kept = False  # whether the previous line was kept (a continuation line extends it)
    for raw in lines[1:]:
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        try:
            line = raw.decode("utf-8") if len(raw) <= max_line else ""
        except UnicodeDecodeError:
            line = ""
        if not line or _CTL_RE.search(line):
            kept = False
            continue
        if line[:1] in (" ", "\t"):
            if kept:
                last = len(headers) - 1
                value = headers._fields[last][2]
                headers._replace_value(last, value.rstrip(_WS) + " " + line.strip(_WS))
            continue
        colon = line.find(":")
        name = line[:colon].rstrip(_WS) if colon > 0 else ""
        kept = _TOKEN_RE.fullmatch(name) is not None
        if kept:
            if len(headers) >= max_headers:
                break
            headers._append(name, line[colon + 1 :].strip(_WS))
    return SipRequest(method, "", headers)


def _body(headers: Headers, raw_body: bytes, fail_: _Fail, partial: SipRequest | None) -> bytes:
    """Apply Content-Length (RFC 3261 18.3, 20.14) to what follows the empty line."""
    values = headers.get_all("Content-Length")
    if not values:
        return raw_body
    if len(set(values)) > 1:
        raise fail_(400, f"conflicting Content-Length values: {values}", partial)
    if not _DIGITS_RE.fullmatch(values[0]):
        raise fail_(400, f"malformed Content-Length: {_short(values[0])}", partial)
    length = int(values[0])
    if length > len(raw_body):
        raise fail_(
            400, f"body is {len(raw_body)} bytes, shorter than Content-Length {length}", partial
        )
    return raw_body[:length]


class _Fail(Protocol):
    """Signature of the parser's error factory (status, message, partial request)."""

    def __call__(
        self, status: int, message: str, request: SipRequest | None = None
    ) -> SipParseError: ...


def _check_common(
    headers: Headers, fail_: _Fail, partial: SipRequest | None
) -> tuple[int, str]:
    """Mandatory header fields and the syntax of those the transaction layer relies on.

    Returns the CSeq. Every datagram a UAS takes passes here: the header rows are grouped by
    name once instead of being scanned for each field asked about."""
    rows: dict[str, list[str]] = {}
    for key, _, value in headers._fields:
        group = rows.get(key)
        if group is None:
            rows[key] = [value]
        else:
            group.append(value)
    vias = [part for value in rows.get("via", ()) for part in _split_list(value)]
    missing = [name for name, key in _MANDATORY_KEYS
               if not (vias if key == "via" else key in rows)]
    if missing:
        raise fail_(400, f"missing mandatory header field(s): {', '.join(missing)}", partial)
    for name, key in _MANDATORY_KEYS:
        if key != "via" and len(rows[key]) > 1:
            raise fail_(400, f"more than one {name} header field", partial)
    try:
        for name, key in (("From", "from"), ("To", "to")):
            params = parse_name_addr(rows[key][0]).params
            if "tag" in params and not params["tag"]:
                raise SipParseError(400, f"{name} tag parameter has no value")
        for value in vias:
            parse_via(value)
        cseq = parse_cseq(rows["cseq"][0])
    except SipParseError as exc:
        raise fail_(400, exc.message, partial) from None
    call_id = rows["call-id"][0]
    if not call_id or " " in call_id or "\t" in call_id:
        raise fail_(400, f"malformed Call-ID: {_short(call_id)}", partial)
    for max_forwards in rows.get("max-forwards", ()):
        if not (_DIGITS_RE.fullmatch(max_forwards) and int(max_forwards) <= 255):
            # RFC 3261 20.22: 0-255; RFC 4475 3.1.2.3 sends 300 expecting a 400.
            raise fail_(400, f"malformed Max-Forwards: {_short(max_forwards)}", partial)
    return cseq


def _finish_request(
    start_line: str, headers: Headers, raw_body: bytes, fail_: _Fail
) -> SipRequest:
    parts = start_line.split(" ")
    # RFC 3261 7.1: Method SP Request-URI SP SIP-Version, single SPs (RFC 4475 3.1.2.8/3.1.2.9).
    if len(parts) != 3 or not all(parts):
        raise fail_(400, f"malformed Request-Line: {_short(start_line)}")
    method, uri, version = parts
    if not _TOKEN_RE.fullmatch(method):
        raise fail_(400, f"method is not a token: {_short(method)}")
    if not _URI_RE.fullmatch(uri):
        raise fail_(400, f"malformed Request-URI: {_short(uri)}")
    partial = SipRequest(method, uri, headers)
    # RFC 3261 7.1: the version is case-insensitive on receipt.
    if not _VERSION_RE.fullmatch(version):
        raise fail_(400, f"malformed SIP-Version: {_short(version)}", partial)
    if version.upper() != "SIP/2.0":
        raise fail_(505, f"SIP version {version} is not supported", partial)
    _, cseq_method = _check_common(headers, fail_, partial)
    if cseq_method != method:
        # RFC 3261 8.1.1.5 (method names are case-sensitive); RFC 4475 3.1.2.16.
        raise fail_(
            400, f"CSeq method {cseq_method} does not match request method {method}", partial
        )
    body = _body(headers, raw_body, fail_, partial)
    return SipRequest(method, uri, headers, body)


def _response_fail(status: int, message: str, request: SipRequest | None = None) -> SipParseError:
    return SipParseError(0, message)


def _finish_response(start_line: str, headers: Headers, raw_body: bytes) -> SipResponse:
    # RFC 3261 7.2: SIP-Version SP Status-Code SP Reason-Phrase (reason may be empty).
    parts = start_line.split(" ", 2)
    if len(parts) < 2 or parts[0].upper() != "SIP/2.0":
        raise SipParseError(0, f"malformed or unsupported Status-Line: {_short(start_line)}")
    code_text = parts[1]
    if not re.fullmatch(r"[1-6][0-9][0-9]", code_text):
        raise SipParseError(0, f"status code out of range 100-699: {_short(code_text)}")
    reason = parts[2] if len(parts) > 2 else ""
    _check_common(headers, _response_fail, None)
    body = _body(headers, raw_body, _response_fail, None)
    return SipResponse(int(code_text), reason, headers, body)


# --- building responses and requests -----------------------------------------------------------


def _is_ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def stamp_via(request: SipRequest, ip: str, port: int) -> None:
    """Record the packet's source on the top Via, in place (RFC 3261 18.2.1, RFC 3581 4).

    Adds ``received=<ip>`` when the sent-by host is a name or a different address, and
    whenever ``rport`` is present; fills an empty ``rport`` with the source port.
    """
    for index, (key, _, value) in enumerate(request.headers._fields):
        if key != "via":
            continue
        parts = _split_list(value)
        if not parts:
            continue
        top = parse_via(parts[0])
        source = _is_ip(ip)
        if top.has_rport and top.rport is None:
            top.params["rport"] = str(port)
            top.params["received"] = ip
        elif source is None or _is_ip(top.host) != source:
            top.params["received"] = ip
        parts[0] = top.serialize()
        request.headers._replace_value(index, ", ".join(parts))
        return
    raise SipParseError(400, "missing Via header field")


def response_to(
    request: SipRequest,
    status: int,
    reason: str | None = None,
    *,
    to_tag: str | None = None,
    headers: Iterable[tuple[str, str]] = (),
    body: bytes = b"",
    content_type: str | None = None,
) -> SipResponse:
    """Build a response to ``request`` (RFC 3261 8.2.6.2).

    Copies every Via row in order (stamp the request with :func:`stamp_via` first), From,
    To (adding ``to_tag`` unless the To already has a tag), Call-ID and CSeq; Record-Route for
    101-299 (RFC 3261 12.1.1, dialog-establishing responses); Timestamp for 100 (8.2.6.1).
    Then ``headers``, then Content-Type. Header fields the request lacks are skipped, so a
    partially parsed request (``SipParseError.request``) can still be answered.
    """
    if not 100 <= status <= 699:
        raise ValueError(f"status {status} is outside 100-699")
    out = Headers()
    source = request.headers
    for value in source.rows("Via"):
        out._append("Via", value)
    from_ = source.get("From")
    if from_ is not None:
        out._append("From", from_)
    to = source.get("To")
    if to is not None:
        if to_tag is not None:
            _check_value(to_tag, "to_tag")
            try:
                has_tag = "tag" in parse_name_addr(to).params
            except SipParseError:
                has_tag = True  # never glue a tag onto a value we cannot read
            if not has_tag:
                to = f"{to};tag={to_tag}"
        out._append("To", to)
    for name in ("Call-ID", "CSeq"):
        copied = source.get(name)
        if copied is not None:
            out._append(name, copied)
    if 101 <= status < 300:
        for value in source.rows("Record-Route"):
            out._append("Record-Route", value)
    if status == 100 and "Timestamp" in source:
        out._append("Timestamp", source.get("Timestamp") or "")
    for name, value in headers:
        out.add(name, value)
    if content_type is not None:
        out.set("Content-Type", content_type)
    return SipResponse(status, reason if reason is not None else reason_phrase(status), out, body)


def build_request(
    method: str,
    uri: str,
    *,
    call_id: str,
    from_: str,
    to: str,
    cseq: int,
    via_host: str,
    via_port: int,
    branch: str | None = None,
    contact: str | None = None,
    headers: Iterable[tuple[str, str]] = (),
    body: bytes = b"",
    content_type: str | None = None,
    max_forwards: int = 70,
    transport: str = "UDP",
) -> SipRequest:
    """Build a request: a UAC's INVITE (RFC 3261 8.1.1), or one either side sends in a dialog
    (BYE, REFER, re-INVITE, NOTIFY; 12.2.1.1).

    The Via carries a fresh magic-cookie branch (unless given) and ``rport`` (RFC 3581);
    ``from_``/``to``/``contact`` are full header values (with tags).
    """
    if not _TOKEN_RE.fullmatch(method):
        raise ValueError(f"method is not a token: {_short(method)}")
    if not _URI_RE.fullmatch(uri):
        raise ValueError(f"malformed Request-URI: {_short(uri)}")
    if not 0 <= cseq <= 0xFFFFFFFF:
        raise ValueError(f"CSeq {cseq} does not fit 32 bits")
    host = f"[{via_host}]" if ":" in via_host and not via_host.startswith("[") else via_host
    out = Headers()
    out.add("Via", f"SIP/2.0/{transport.upper()} {host}:{via_port};branch="
            f"{branch or new_branch()};rport")
    out.add("Max-Forwards", str(max_forwards))
    out.add("From", from_)
    out.add("To", to)
    out.add("Call-ID", call_id)
    out.add("CSeq", f"{cseq} {method}")
    if contact is not None:
        out.add("Contact", contact)
    for name, value in headers:
        out.add(name, value)
    if content_type is not None:
        out.set("Content-Type", content_type)
    return SipRequest(method, uri, out, body)
