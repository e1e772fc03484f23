"""Malformed SIP requests get an answer over real UDP wherever RFC 3261 allows one.

A request the endpoint cannot accept is answered with the parser's status (400, 505, 414) and
a reason naming the problem (RFC 3261 8.2.6.1, 16.3; RFC 4475 3.1.2.18 expects a 400 even for
a request missing its Call-ID, From and To), so the peer stops retransmitting instead of
trying for 32 s. Answerable means the response can be routed: a request (not an ACK, not a
response) from an allowed source whose Via header fields parse (18.2.2, 17.1.3). Anything else
gets silence.

The endpoint is the real :class:`~gateway.sip.endpoint.SipEndpoint` on an ephemeral port of
127.0.0.1 (its call lifecycle has no engine behind it: no mangled INVITE here carries an SDP
offer, so none becomes a call); the peers are plain UDP sockets. Silence is shown without
sleeping: UDP on loopback keeps order and the endpoint answers each datagram as it arrives, so
once an OPTIONS sent after the junk has its 200, the junk had its chance.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.call import Admission, CallLifecycle, CallRegistry
from gateway.clock import SystemClock
from gateway.metrics import Metrics
from gateway.readiness import Readiness
from gateway.sip.endpoint import SipEndpoint
from gateway.sip.message import SipParseError, SipResponse, parse_message
from gateway.sip.uas import UasConfig

#: A fresh branch per datagram: responses are matched to what was sent by it.
_branches = iter(range(1, 10**9))


class _NoDialogs:
    def for_call(self, call: Any) -> Any:
        raise AssertionError("no mangled INVITE here may become a call")


class Peer(asyncio.DatagramProtocol):
    """A UDP SIP peer: sends datagrams, files responses by their top Via branch."""

    def __init__(self) -> None:
        self.responses: dict[str, list[SipResponse | _RawResponse]] = {}
        self.unmatched: list[bytes] = []
        self.arrived = asyncio.Event()
        self.transport: asyncio.DatagramTransport | None = None
        self.addr: tuple[str, int] = ("", 0)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.addr = transport.get_extra_info("sockname")[:2]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        response: SipResponse | _RawResponse
        try:
            message = parse_message(data)
            assert isinstance(message, SipResponse)
            response, branch = message, message.top_via_branch
        except SipParseError:
            # A response to a broken request may lack what the request lacked (a Call-ID):
            # our strict parser refuses it, a UAC's transaction layer matches it by its Via.
            response, branch = _RawResponse(data), _raw_branch(data)
        if branch is None:
            self.unmatched.append(data)
        else:
            self.responses.setdefault(branch, []).append(response)
        self.arrived.set()

    async def answer(self, branch: str, timeout: float = 5.0) -> SipResponse | _RawResponse | None:
        """The first response whose top Via carries ``branch`` (None after ``timeout``)."""
        async def first() -> SipResponse | _RawResponse:
            while branch not in self.responses:
                self.arrived.clear()
                await self.arrived.wait()
            return self.responses[branch][0]

        try:
            return await asyncio.wait_for(first(), timeout)
        except TimeoutError:
            return None


class _RawResponse:
    """A response our strict parser refuses (it lacks what its request lacked)."""

    def __init__(self, data: bytes) -> None:
        start = data.split(b"\r\n", 1)[0].decode("utf-8", "replace")
        _, code, reason = [*start.split(" ", 2), "", ""][:3]
        self.status = int(code) if code.isdigit() else 0
        self.reason = reason
        self.data = data


def _raw_branch(data: bytes) -> str | None:
    for line in data.split(b"\r\n"):
        if line.lower().startswith(b"via:") and b"branch=" in line:
            return line.split(b"branch=", 1)[1].split(b";", 1)[0].decode("latin-1").strip()
    return None


@pytest.fixture
async def sip() -> AsyncIterator[tuple[SipEndpoint, tuple[str, int]]]:
    clock = SystemClock()
    metrics = Metrics()
    readiness = Readiness(metrics, clock)
    readiness.mark_ready("test")
    lifecycle = CallLifecycle(admission=Admission(4, readiness, clock, metrics),
                              registry=CallRegistry(metrics), readiness=readiness,
                              dialogs=_NoDialogs(), clock=clock, metrics=metrics)
    endpoint = SipEndpoint(lifecycle, UasConfig(local_ip="127.0.0.1", local_port=0,
                                                allow=["127.0.0.1/32"]),
                           metrics=metrics, rtp_ports=range(27000, 27100))
    addr = await endpoint.start("127.0.0.1", 0)
    try:
        yield endpoint, addr
    finally:
        await endpoint.stop()


async def _peer(ip: str = "127.0.0.1") -> Peer:
    loop = asyncio.get_running_loop()
    _, peer = await loop.create_datagram_endpoint(Peer, local_addr=(ip, 0))
    return peer


def invite(peer: Peer, branch: str, *, method: str = "INVITE") -> list[bytes]:
    """A well-formed INVITE (no SDP offer) as lines without their CRLF; the Via comes first."""
    host, port = peer.addr
    return [
        f"{method} sip:ivr@127.0.0.1 SIP/2.0".encode(),
        f"Via: SIP/2.0/UDP {host}:{port};branch={branch};rport".encode(),
        b"Max-Forwards: 70",
        f"From: <sip:caller@{host}>;tag=caller-{branch[-6:]}".encode(),
        b"To: <sip:ivr@127.0.0.1>",
        f"Call-ID: {branch}@{host}".encode(),
        f"CSeq: 1 {method}".encode(),
        f"Contact: <sip:caller@{host}:{port}>".encode(),
        b"Content-Length: 0",
    ]


def datagram(lines: list[bytes], body: bytes = b"") -> bytes:
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def _branch() -> str:
    return f"z9hG4bK-mangled-{next(_branches)}"


def _without(lines: list[bytes], name: bytes) -> list[bytes]:
    return [line for line in lines if not line.lower().startswith(name.lower() + b":")]


def _replace(lines: list[bytes], name: bytes, value: bytes) -> list[bytes]:
    return [name + b": " + value if line.lower().startswith(name.lower() + b":") else line
            for line in lines]


#: (id, how the INVITE is mangled, the status, words its reason must contain)
ANSWERED: list[tuple[str, Any, int, str]] = [
    ("no Call-ID", lambda ls: datagram(_without(ls, b"Call-ID")), 400, "Call-ID"),
    ("no From", lambda ls: datagram(_without(ls, b"From")), 400, "From"),
    ("no To", lambda ls: datagram(_without(ls, b"To")), 400, "To"),
    ("no CSeq", lambda ls: datagram(_without(ls, b"CSeq")), 400, "CSeq"),
    ("no Call-ID, From or To (RFC 4475 3.1.2.18)",
     lambda ls: datagram(_without(_without(_without(ls, b"Call-ID"), b"From"), b"To")), 400,
     "Call-ID"),
    ("CSeq method differs", lambda ls: datagram(_replace(ls, b"CSeq", b"1 OPTIONS")), 400,
     "CSeq method"),
    ("CSeq not a number", lambda ls: datagram(_replace(ls, b"CSeq", b"one INVITE")), 400,
     "CSeq"),
    ("two Call-IDs", lambda ls: datagram([*ls, b"i: second@host"]), 400, "more than one Call-ID"),
    ("Max-Forwards out of range", lambda ls: datagram(_replace(ls, b"Max-Forwards", b"300")),
     400, "Max-Forwards"),
    ("a header line without a colon", lambda ls: datagram([*ls, b"NoColonHere"]), 400,
     "malformed header field"),
    ("a header line that is not UTF-8", lambda ls: datagram([*ls, b"Subject: caf\xe9"]), 400,
     "UTF-8"),
    ("a NUL in a header", lambda ls: datagram([*ls, b"Subject: a\x00b"]), 400,
     "control character"),
    ("an empty From tag", lambda ls: datagram(_replace(ls, b"From", b"<sip:c@h>;tag")), 400,
     "tag"),
    ("Content-Length past the end", lambda ls: datagram(_replace(ls, b"Content-Length", b"99")),
     400, "Content-Length"),
    ("two Content-Lengths", lambda ls: datagram([*ls, b"l: 5"], b"hello"), 400, "Content-Length"),
    ("SIP/3.0", lambda ls: datagram([ls[0].replace(b"SIP/2.0", b"SIP/3.0"), *ls[1:]]), 505,
     "SIP/3.0"),
    ("a Request-URI that is no URI",
     lambda ls: datagram([b"INVITE not-a-uri SIP/2.0", *ls[1:]]), 400, "Request-URI"),
    ("a Request-URI over 8 KB",
     lambda ls: datagram([b"INVITE sip:" + b"a" * 9000 + b"@127.0.0.1 SIP/2.0", *ls[1:]]), 414,
     "limit"),
    ("headers not ended by an empty line", lambda ls: b"\r\n".join(ls), 400, "empty line"),
]


@pytest.mark.parametrize(("mangle", "status", "words"),
                         [pytest.param(m, s, w, id=i) for i, m, s, w in ANSWERED])
async def test_a_mangled_invite_gets_its_status_and_the_reason(
        sip: tuple[SipEndpoint, tuple[str, int]], mangle: Any, status: int, words: str) -> None:
    endpoint, addr = sip
    peer = await _peer()
    assert peer.transport is not None
    branch = _branch()
    peer.transport.sendto(mangle(invite(peer, branch)), addr)
    response = await peer.answer(branch)
    assert response is not None, "no answer: the peer would retransmit for 32 s"
    assert response.status == status
    assert words in response.reason, response.reason
    data = response.data if isinstance(response, _RawResponse) else response.serialize()
    # Routed back like any response: our Via, stamped with where the request came from
    # (RFC 3261 18.2.1, RFC 3581), and a To tag on the final response (8.2.6.2).
    assert f"rport={peer.addr[1]}".encode() in data and b"received=127.0.0.1" in data
    to = next((line for line in data.split(b"\r\n") if line.startswith(b"To:")), None)
    assert to is None or b";tag=" in to
    assert not endpoint.core.dialogs  # stateless: nothing kept for it
    peer.transport.close()


#: Requests no response can be sent to, or that must never get one.
SILENT: list[tuple[str, Any]] = [
    ("an ACK without Call-ID (ACKs are never answered, 17.1.1.1)",
     lambda p, b: datagram(_without(invite(p, b, method="ACK"), b"Call-ID"))),
    ("no Via: nowhere to send a response (18.2.2)",
     lambda p, b: datagram([*_without(invite(p, b), b"Via"), f"Call-ID: x{b}".encode()])),
    ("a Via that does not parse",
     lambda p, b: datagram(_replace(invite(p, b), b"Via", f"garbage;branch={b}".encode()))),
    ("a malformed response (responses are never answered)",
     lambda p, b: f"SIP/2.0 200 OK\r\nVia: SIP/2.0/UDP 127.0.0.1;branch={b}\r\n\r\n".encode()),
    ("not SIP at all", lambda p, b: f"hello {b}\r\n\r\n".encode()),
]


@pytest.mark.parametrize("mangle", [pytest.param(m, id=i) for i, m in SILENT])
async def test_what_cannot_be_routed_or_must_not_be_answered_gets_silence(
        sip: tuple[SipEndpoint, tuple[str, int]], mangle: Any) -> None:
    _, addr = sip
    peer = await _peer()
    assert peer.transport is not None
    branch = _branch()
    peer.transport.sendto(mangle(peer, branch), addr)
    await _ping(peer, addr)
    assert branch not in peer.responses and not peer.unmatched
    peer.transport.close()


async def test_a_stranger_gets_no_answer_to_a_mangled_request(
        sip: tuple[SipEndpoint, tuple[str, int]]) -> None:
    endpoint, addr = sip
    stranger = await _peer("127.0.0.2")  # outside the allow-list
    assert stranger.transport is not None
    branch = _branch()
    stranger.transport.sendto(datagram(_without(invite(stranger, branch), b"Call-ID")), addr)
    # A well-formed request from the stranger afterwards gets its stateless 403 (the ordering
    # check that the mangled one, sent first, got nothing).
    follow = _branch()
    stranger.transport.sendto(datagram(invite(stranger, follow, method="OPTIONS")), addr)
    refused = await stranger.answer(follow)
    assert refused is not None and refused.status == 403
    assert branch not in stranger.responses
    assert endpoint.core.stats["rejected_source"] == 2
    stranger.transport.close()


async def _ping(peer: Peer, addr: tuple[str, int]) -> None:
    assert peer.transport is not None
    branch = _branch()
    peer.transport.sendto(datagram(invite(peer, branch, method="OPTIONS")), addr)
    pong = await peer.answer(branch)
    assert pong is not None and pong.status == 200


# --- 200 seeded mangles -----------------------------------------------------------------------

_HOSTILE_VALUES = [b"", b" ", b"x" * 300, b"\xff\xfe", b"<>", b'"', b"0", b"4294967295 INVITE",
                   b";;;;", b"\t", "é".encode(), b"sip:" + b"a" * 500, b"a\x00b", b"1 ACK"]
_HOSTILE_BYTES = [0x00, 0x01, 0x0D, 0x0A, 0x20, 0x09, 0x3A, 0x3B, 0x22, 0x3C, 0xFF, 0xC3, 0x7F]


def mangle(rng: random.Random, lines: list[bytes]) -> bytes:
    """One to three line-level mangles of an INVITE's lines after its Via (line 1), and maybe
    of its Request-Line's URI, method case or version."""
    lines = list(lines)
    for _ in range(rng.randint(1, 3)):
        if len(lines) < 3:
            break
        i = rng.randrange(2, len(lines))
        op = rng.random()
        if op < 0.2:
            del lines[i]
        elif op < 0.35:
            lines.insert(i, lines[rng.randrange(2, len(lines))])
        elif op < 0.6:
            name, colon, _ = lines[i].partition(b":")
            lines[i] = (name if colon else b"X-Junk") + b": " + rng.choice(_HOSTILE_VALUES)
        elif op < 0.8:
            line = bytearray(lines[i])
            at = rng.randrange(len(line) + 1)
            line[at:at] = bytes([rng.choice(_HOSTILE_BYTES)])
            lines[i] = bytes(line)
        elif op < 0.9:
            lines.insert(i, rng.randbytes(rng.randint(1, 12)))
        else:
            first = lines[0]
            choice = rng.random()
            if choice < 0.4:
                first = first.replace(b"SIP/2.0", rng.choice([b"SIP/3.0", b"SIP/2", b"sip/2.0"]))
            elif choice < 0.7:
                first = first.replace(b"sip:ivr@127.0.0.1", rng.choice([b"nouri", b"sip:", b"<x>"]))
            else:
                first = first.replace(b"INVITE", b"invite", 1)
            lines[0] = first
    body = b"" if rng.random() < 0.8 else rng.randbytes(rng.randint(1, 40))
    return datagram(lines, body) if rng.random() < 0.9 else b"\r\n".join(lines)


def routable(data: bytes, via: bytes) -> bool:
    """The test's own reading of RFC 3261: a request (not an ACK) whose Via header field is
    intact, in the header section, and not extended by a continuation line can be answered."""
    head = data.split(b"\r\n\r\n", 1)[0]
    lines = head.split(b"\n")
    first = lines[0].rstrip(b"\r").split(b" ")
    if len(first) < 3 or first[0].upper() == b"ACK" or not first[-1].upper().startswith(b"SIP/"):
        return False
    if len(lines) < 2 or lines[1].rstrip(b"\r") != via:
        return False
    return len(lines) < 3 or lines[2][:1] not in (b" ", b"\t")


async def test_200_mangled_invites_each_get_an_answer_where_one_can_be_routed(
        sip: tuple[SipEndpoint, tuple[str, int]]) -> None:
    endpoint, addr = sip
    peer = await _peer()
    assert peer.transport is not None
    rng = random.Random(3261)
    sent: list[tuple[str, bytes]] = []
    for n in range(200):
        branch = _branch()
        lines = invite(peer, branch)
        data = mangle(rng, lines)
        if routable(data, lines[1]):
            sent.append((branch, data))
        peer.transport.sendto(data, addr)
        if n % 10 == 9:
            # A socket buffer holds only so many datagrams: wait for the endpoint to catch up
            # (the OPTIONS behind them is answered once it has read them all).
            await _ping(peer, addr)
    unanswered = [data for branch, data in sent if branch not in peer.responses]
    statuses = sorted({r.status for branch, _ in sent for r in peer.responses.get(branch, [])})
    print(f"\n{len(sent)} of 200 mangled INVITEs routable; statuses {statuses}; "
          f"{len(unanswered)} unanswered")
    assert len(sent) >= 150  # the mangles are mostly below the Via, as intended
    assert not unanswered, unanswered[:3]
    assert not endpoint.core.dialogs and not endpoint.media
