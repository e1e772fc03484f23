"""100,000 hostile datagrams each through the SIP parser, the SDP parser, the RTP / RFC 4733
decoders and the UAS state machine, in one run.

Seeds are real messages: every ``<send>`` of the SIPp scenarios in tests/sipp (rendered the
way SIPp fills its ``[keywords]``), the golden captures in tests/golden/sip (baresip, RFC 4475
torture cases), RTP that :class:`RtpSender` produces, RFC 4733 key presses. A seeded mutation
fuzzer (hypothesis' per-example bookkeeping would cost minutes for 400k examples) flips, inserts,
deletes and truncates bytes, duplicates / drops / swaps lines, replaces header values, and mixes
in random bytes. What is checked, per datagram:

- parsers: the result is a parsed value that round-trips, or the module's one documented error
  with an allowed status; nothing else escapes;
- the UAS core (:meth:`UasCore.receive` / ``tick`` / ``answer`` / ``hangup`` / ``refer`` in
  virtual time): never raises; everything it sends parses as SIP (an answer to a malformed
  request may lack, or repeat the defects of, only the From/To/Call-ID/CSeq its request got
  wrong: RFC 4475 3.1.2.18 wants it answered anyway); a datagram from a disallowed
  address changes no state and gets at most a stateless 403; active calls never exceed the
  budget its admission question enforces (``MAX_CALLS``); the response cache stays under its
  bound; once every call is hung up and the timers have run out, no dialog, transaction or
  cached response is left.

``SIP_FUZZ_CASES`` / ``SIP_FUZZ_SEED`` change the run.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import os
import random
import re
import time
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from test_sip_message import assert_round_trips

from gateway.sip import uas as uas_module
from gateway.sip.message import (
    SipParseError,
    SipRequest,
    SipResponse,
    parse_message,
    response_to,
    stamp_via,
)
from gateway.sip.rtp import (
    DtmfReceiver,
    RtpError,
    RtpPacket,
    RtpReceiverStats,
    RtpSender,
    TelephoneEvent,
)
from gateway.sip.sdp import SdpError, SessionDescription, negotiate, parse_sdp
from gateway.sip.uas import (
    CallAnswered,
    CallConfirmed,
    CallEnded,
    Dropped,
    IncomingCall,
    MediaChanged,
    Refused,
    SendTo,
    TransferDone,
    UasConfig,
    UasCore,
)

CASES = int(os.environ.get("SIP_FUZZ_CASES", "100000"))
SEED = int(os.environ.get("SIP_FUZZ_SEED", "5060"))

HERE = Path(__file__).parent
GOLDEN_SIP = [p.read_bytes() for p in sorted((HERE / "golden" / "sip").glob("*.sip"))]

ALLOWED = ("127.0.0.1", 5062)
STRANGERS = [("127.0.0.2", 5062), ("192.0.2.66", 5060), ("::1", 5060), ("not-an-ip", 1)]
GATEWAY = ("127.0.0.1", 5080)


# --- seeds ------------------------------------------------------------------------------------


def _sipp_values(n: int, peer_tag: str = "") -> dict[str, str]:
    call_id = f"{n}-4242@127.0.0.1"
    via = f"Via: SIP/2.0/UDP {GATEWAY[0]}:{GATEWAY[1]};branch=z9hG4bK-gw{n}"
    return {
        "remote_ip": GATEWAY[0], "remote_port": str(GATEWAY[1]), "transport": "UDP",
        "local_ip": ALLOWED[0], "local_port": str(ALLOWED[1]), "local_ip_type": "4",
        "media_ip": ALLOWED[0], "media_ip_type": "4", "media_port": "16000",
        "call_id": call_id, "call_number": str(n), "pid": "4242",
        "branch": f"z9hG4bK-{n}-a", "branch-2": f"z9hG4bK-{n}-b", "branch-3": f"z9hG4bK-{n}-c",
        "branch-5": f"z9hG4bK-{n}-e",
        "next_url": f"sip:ivr@{GATEWAY[0]}:{GATEWAY[1]}",
        "routes": "Route: <sip:127.0.0.1:5070;lr>",
        "peer_tag_param": f";tag={peer_tag}" if peer_tag else "",
        "last_Via:": via, "last_From:": f"From: <sip:ivr@{GATEWAY[0]}>;tag={peer_tag or 'gw'}",
        "last_To:": f"To: sipp <sip:sipp@{ALLOWED[0]}>;tag=4242SIPpTag00{n}",
        "last_Call-ID:": f"Call-ID: {call_id}", "last_CSeq:": "CSeq: 2 BYE",
    }


def _sipp_templates() -> list[str]:
    """Every message the SIPp scenarios send, with their [keywords] still in."""
    templates = []
    for path in sorted((HERE / "sipp").glob("*.xml")):
        for send in ET.parse(path).getroot().iter("send"):
            lines = [line.strip() for line in (send.text or "").strip("\n").splitlines()]
            while lines and not lines[0]:
                lines.pop(0)
            templates.append("\r\n".join(lines).rstrip("\r\n") + "\r\n")
    return templates


SIPP_TEMPLATES = _sipp_templates()
_KEYWORD = re.compile(r"\[([A-Za-z_\-:0-9]+)\]")


def render(template: str, n: int, peer_tag: str = "") -> bytes:
    """Fill a SIPp template as SIPp would ([len] = body length)."""
    values = _sipp_values(n, peer_tag)
    text = _KEYWORD.sub(lambda m: values.get(m.group(1), m.group(0)), template)
    head, sep, body = text.partition("\r\n\r\n")
    # SIPp drops header lines whose keywords rendered empty.
    head = "\r\n".join(line for line in head.split("\r\n") if line.strip())
    if not sep:
        return (text.rstrip("\r\n") + "\r\n\r\n").encode()
    return (head.replace("[len]", str(len(body.encode()))) + sep + body).encode()


SIPP_MESSAGES = [render(t, i) for i, t in enumerate(SIPP_TEMPLATES)]
SIP_SEEDS = GOLDEN_SIP + SIPP_MESSAGES


def _body(message: bytes) -> bytes:
    return message.partition(b"\r\n\r\n")[2]


SDP_SEEDS = [b for b in (_body(m) for m in SIP_SEEDS) if b.startswith(b"v=0")] + [
    b"v=0\r\no=- 1 1 IN IP4 192.0.2.7\r\ns=-\r\nc=IN IP4 192.0.2.7\r\nt=0 0\r\n"
    b"m=video 5000 RTP/AVP 96\r\na=rtpmap:96 H264/90000\r\n"
    b"m=audio 6000 RTP/AVP 8 0 101\r\na=rtpmap:101 telephone-event/8000\r\na=fmtp:101 0-16\r\n"
    b"a=ptime:30\r\na=sendonly\r\n",
    b"v=0\no=- 2 2 IN IP6 ::1\ns=-\nc=IN IP6 ::1\nt=0 0\nm=audio 7000 RTP/AVP 0\na=inactive\n",
    b"v=0\r\no=- 3 3 IN IP4 0.0.0.0\r\ns=-\r\nc=IN IP4 0.0.0.0\r\nt=0 0\r\n"
    b"m=audio 8000 RTP/SAVP 0\r\nm=audio 8002 RTP/AVP 18 8\r\nc=IN IP4 224.2.1.1/127/3\r\n",
]

_INSERTS = [b"\r\n", b"\n", b" ", b"\t", b":", b";", b",", b'"', b"\\", b"<", b">", b"=", b"/",
            b"\x00", b"\xff", b"\xc3", b"\xed\xa0\x80", b"SIP/2.0", b"\r\n ", b"\r\n\r\n",
            b"9999999999999", b"4294967296", b"-1", b"%00", b";tag=", b";branch=", b"@",
            b"sip:", b"Content-Length: 99999\r\n", b"Via: SIP/2.0/UDP x;branch=z9hG4bKdup\r\n",
            b"To: <sip:a@b>;tag=dup\r\n", b"CSeq: 1 ACK\r\n", b"a=sendonly\r\n",
            b"m=audio 0 RTP/AVP 0\r\n", b"c=IN IP4 host.invalid\r\n", b"c=IN IP6 ::1\r\n"]
_VALUES = [b"", b" ", b"x" * 300, b"\xff\xfe", b"sip:" + b"a" * 9000, b"<>", b'"', b"0",
           b"4294967295 INVITE", b"SIP/2.0/TCP [::1]:99999", b";;;;", b"\t", "é".encode()]


def mutate(rng: random.Random, data: bytes) -> bytes:
    """One to six byte-, line- or value-level mutations of ``data``."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 6)):
        op = rng.random()
        pos = rng.randrange(len(out) + 1)
        if op < 0.18 and out:
            out[min(pos, len(out) - 1)] = rng.randrange(256)
        elif op < 0.40:
            out[pos:pos] = rng.choice(_INSERTS) if rng.random() < 0.8 else rng.randbytes(
                rng.randint(1, 8))
        elif op < 0.55:
            del out[pos : pos + rng.randint(1, 24)]
        elif op < 0.62:
            del out[pos:]
        else:
            lines = bytes(out).split(b"\n")
            i = rng.randrange(len(lines))
            kind = rng.random()
            if kind < 0.3:
                lines.insert(i, lines[rng.randrange(len(lines))])
            elif kind < 0.55 and len(lines) > 1:
                del lines[i]
            elif kind < 0.7:
                j = rng.randrange(len(lines))
                lines[i], lines[j] = lines[j], lines[i]
            else:
                name, colon, _ = lines[i].partition(b":")
                if colon:
                    lines[i] = name + b": " + rng.choice(_VALUES) + b"\r"
            out = bytearray(b"\n".join(lines))
    return bytes(out)


@dataclass
class Tally:
    """Outcomes of one fuzz run."""

    cases: int = 0
    accepted: Counter[str] = field(default_factory=Counter)
    rejected: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def fail(self, what: str, data: bytes | str = b"") -> None:
        if len(self.failures) < 50:
            self.failures.append(f"{what} <- {data[:200]!r}")

    def report(self, name: str, elapsed: float) -> str:
        accepted, rejected = sum(self.accepted.values()), sum(self.rejected.values())
        return (f"{name}: {self.cases} datagrams in {elapsed:.1f} s = "
                f"{self.cases / elapsed:,.0f}/s; accepted {accepted} "
                f"({100 * accepted / max(1, self.cases):.1f}%) {dict(self.accepted)}; "
                f"rejected {rejected} {dict(self.rejected)}")


def _timed(run: Callable[[], Tally], name: str) -> Tally:
    # CPU time of this process is the budget: wall time on a shared 2-core box says more about
    # the neighbours than about this code.
    t0, c0 = time.perf_counter(), time.process_time()
    tally = run()
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(f"\n{tally.report(name, elapsed)} ({cpu:.1f} CPU s = {tally.cases / cpu:,.0f}/CPU s)")
    assert not tally.failures, tally.failures[:5]
    assert tally.cases == CASES
    if CASES >= 100_000:
        assert cpu < 30, f"{name} took {cpu:.1f} CPU s"
    return tally


# --- SIP parser -------------------------------------------------------------------------------


def check_sip(data: bytes) -> str:
    """Parse one datagram; an accepted message must be fully usable. Returns the outcome."""
    try:
        message = parse_message(data)
    except SipParseError as exc:
        assert exc.status in (0, 400, 413, 414, 505), exc.status
        assert str(exc)
        return str(exc.status)
    # Accessors, round trip, a response to it and Via stamping all work on what was accepted.
    assert message.call_id and message.cseq[1]
    _ = (message.from_tag, message.to_tag, message.top_via_branch, message.via)
    assert_round_trips(message)
    if isinstance(message, SipRequest):
        stamp_via(message, "192.0.2.1", 5060)
        response = response_to(message, 200, to_tag="t")
        assert parse_message(response.serialize()).to_tag in ("t", message.to_tag)
    return type(message).__name__


def fuzz_sip_parser(cases: int, seed: int, check: Callable[[bytes], str] = check_sip) -> Tally:
    rng = random.Random(seed)
    tally = Tally()
    for _ in range(cases):
        roll = rng.random()
        if roll < 0.08:
            data = rng.randbytes(rng.randint(0, 600))
        elif roll < 0.12:
            data = rng.choice(SIP_SEEDS)
        else:
            data = mutate(rng, rng.choice(SIP_SEEDS))
        tally.cases += 1
        try:
            outcome = check(data)
        except AssertionError as exc:
            tally.fail(f"invariant: {exc}", data)
            continue
        except Exception as exc:
            tally.fail(f"escaped {type(exc).__name__}: {exc}", data)
            continue
        (tally.accepted if outcome.startswith("Sip") else tally.rejected)[outcome] += 1
    return tally


@pytest.mark.slow
def test_sip_parser_takes_100k_hostile_datagrams() -> None:
    tally = _timed(lambda: fuzz_sip_parser(CASES, SEED), "SIP parser")
    assert set(tally.accepted) == {"SipRequest", "SipResponse"}
    assert {"0", "400", "505"} <= set(tally.rejected)
    assert 0.05 < sum(tally.accepted.values()) / CASES < 0.95


def test_the_sip_harness_reports_an_escaping_exception() -> None:
    def leaky(data: bytes) -> str:
        if b"\xff" in data:
            raise IndexError("planted")
        return check_sip(data)

    tally = fuzz_sip_parser(3000, SEED, check=leaky)
    assert any("escaped IndexError" in f for f in tally.failures)


# --- SDP --------------------------------------------------------------------------------------


def check_sdp(data: bytes, tally: Tally) -> None:
    try:
        offer = parse_sdp(data)
    except SdpError as exc:
        if exc.status not in (400, 413, 488) or not exc.message:
            tally.fail(f"SdpError status {exc.status}", data)
        tally.rejected[f"parse {exc.status}"] += 1
        return
    if not isinstance(offer, SessionDescription):
        tally.fail(f"parse_sdp returned {type(offer)}", data)
        return
    try:
        answer = negotiate(offer, local_ip="127.0.0.1", local_port=20000, session_id=1)
    except SdpError as exc:
        if exc.status not in (400, 488):
            tally.fail(f"negotiate SdpError status {exc.status}", data)
        tally.rejected[f"negotiate {exc.status}"] += 1
        return
    again = parse_sdp(answer.sdp)
    audio = [m for m in again.media if m.port]
    if (answer.codec.upper() not in ("PCMU", "PCMA") or len(audio) != 1
            or audio[0].port != 20000 or not 0 <= answer.remote_rtp[1] <= 65535):
        tally.fail(f"bad answer {answer}", data)
    try:
        # Where RTP goes must be an address the call's IPv4 socket can send to, never a name.
        reachable = ipaddress.ip_address(answer.remote_rtp[0]).version == 4
    except ValueError:
        reachable = False
    if not reachable:
        tally.fail(f"answered an offer whose media address is {answer.remote_rtp[0][:60]!r}",
                   data)
    tally.accepted[answer.codec.upper()] += 1


def fuzz_sdp(cases: int, seed: int) -> Tally:
    rng = random.Random(seed)
    tally = Tally()
    for _ in range(cases):
        roll = rng.random()
        if roll < 0.05:
            data = rng.randbytes(rng.randint(0, 300))
        elif roll < 0.10:
            data = rng.choice(SDP_SEEDS)
        else:
            data = mutate(rng, rng.choice(SDP_SEEDS))
        tally.cases += 1
        try:
            check_sdp(data, tally)
        except Exception as exc:
            tally.fail(f"escaped {type(exc).__name__}: {exc}", data)
    return tally


def test_sdp_parser_and_negotiation_take_100k_hostile_bodies() -> None:
    tally = _timed(lambda: fuzz_sdp(CASES, SEED), "SDP parse+negotiate")
    assert {"PCMU", "PCMA"} <= set(tally.accepted)
    assert {"parse 400", "negotiate 488"} <= set(tally.rejected)
    assert 0.05 < sum(tally.accepted.values()) / CASES < 0.95


# --- RTP and RFC 4733 -------------------------------------------------------------------------


def _rtp_seeds() -> list[bytes]:
    rng = random.Random(1)
    seeds = []
    for pt in (0, 8):
        sender = RtpSender(pt, rng=rng)
        seeds += [sender.packet(bytes([0xFF if pt == 0 else 0xD5]) * 160) for _ in range(3)]
    dtmf = RtpSender(101, rng=rng)
    for duration, end in ((0, False), (400, False), (800, True), (800, True)):
        seeds.append(dtmf.packet(TelephoneEvent(5, end, 10, duration).serialize()))
    seeds.append(RtpPacket(0, 1, 2, 3, b"\x7f" * 160, True, [1, 2, 3], (0xBEDE, b"\x10abc"),
                           4).serialize())
    seeds.append(RtpPacket(101, 65535, 2**32 - 1, 7, TelephoneEvent(11, True, 63, 65535)
                           .serialize()).serialize())
    return seeds


RTP_SEEDS = _rtp_seeds()


def fuzz_rtp(cases: int, seed: int) -> Tally:
    rng = random.Random(seed)
    tally = Tally()
    dtmf, stats = DtmfReceiver(payload_type=101), RtpReceiverStats()
    arrival = 0.0
    for _ in range(cases):
        roll = rng.random()
        if roll < 0.1:
            data = rng.randbytes(rng.randint(0, 200))
        elif roll < 0.2:
            data = rng.choice(RTP_SEEDS)
        else:
            data = bytearray(rng.choice(RTP_SEEDS))
            for _ in range(rng.randint(1, 4)):
                op = rng.random()
                if op < 0.5 and data:
                    # The header is where the structure is: flip bits there most often.
                    i = rng.randrange(min(len(data), 20)) if rng.random() < 0.7 else \
                        rng.randrange(len(data))
                    data[i] ^= 1 << rng.randrange(8)
                elif op < 0.7:
                    del data[rng.randrange(len(data) + 1):]
                elif op < 0.85 and data:
                    data[-1] = rng.choice([0, 1, 3, 4, 12, 200, 255])
                else:
                    pos = rng.randrange(len(data) + 1)
                    data[pos:pos] = rng.randbytes(rng.randint(1, 8))
            data = bytes(data)
        tally.cases += 1
        arrival += rng.uniform(0, 0.04)
        try:
            packet = RtpPacket.parse(data)
        except RtpError as exc:
            tally.rejected["RtpError"] += 1
            if not str(exc):
                tally.fail("RtpError without a message", data)
            continue
        except Exception as exc:
            tally.fail(f"RtpPacket.parse escaped {type(exc).__name__}: {exc}", data)
            continue
        try:
            if RtpPacket.parse(packet.serialize()) != packet:
                tally.fail("RTP packet does not round-trip", data)
            stats.update(packet, arrival)
            if not (math.isfinite(stats.jitter) and stats.jitter >= 0
                    and 0 <= stats.duplicates <= max(stats.received, 0) + 1
                    and 0 <= stats.max_seq <= 0xFFFF):
                tally.fail(f"receiver stats out of range: {vars(stats)}", data)
            digit = dtmf.feed(packet)
        except RtpError:
            tally.rejected["telephone-event"] += 1
            continue
        except Exception as exc:
            tally.fail(f"RTP receive path escaped {type(exc).__name__}: {exc}", data)
            continue
        tally.accepted["digit" if digit is not None else f"pt{packet.payload_type}"
                       if packet.payload_type in (0, 8, 101) else "other"] += 1
    return tally


def test_rtp_and_rfc4733_decoders_take_100k_hostile_packets() -> None:
    tally = _timed(lambda: fuzz_rtp(CASES, SEED), "RTP/RFC 4733")
    assert {"pt0", "pt8", "digit", "other"} <= set(tally.accepted)
    assert tally.rejected["RtpError"] > CASES // 20 and tally.rejected["telephone-event"] > 0


# --- the UAS core -----------------------------------------------------------------------------

EFFECT_TYPES = (SendTo, IncomingCall, CallAnswered, CallConfirmed, MediaChanged, CallEnded,
                TransferDone, Dropped, Refused)


@dataclass
class UasRun:
    """One core driven in virtual time, with everything it did."""

    core: UasCore
    tally: Tally
    rng: random.Random
    now: float = 0.0
    max_dialogs: int = 0
    max_responses: int = 0
    calls: int = 0

    def apply(self, effects: list[Any], data: bytes, source: tuple[str, int]) -> None:
        core, rng = self.core, self.rng
        for effect in effects:
            if not isinstance(effect, EFFECT_TYPES):
                self.tally.fail(f"untyped effect {effect!r}", data)
            elif isinstance(effect, SendTo):
                try:
                    parse_message(effect.data)
                except SipParseError as exc:
                    if not answers_a_malformed_request(effect.data, data):
                        self.tally.fail(f"the core sent unparseable SIP ({exc})", effect.data)
            elif isinstance(effect, IncomingCall):
                self.calls += 1
                roll = rng.random()
                if roll < 0.85:
                    self.apply(core.answer(effect.key, "127.0.0.1", 20000, self.now), data,
                               source)
                elif roll < 0.95:
                    self.apply(core.reject(effect.key, 503, self.now), data, source)
        if core.active_calls > MAX_CALLS:
            self.tally.fail(f"{core.active_calls} active calls > max {MAX_CALLS}", data)
        self.max_dialogs = max(self.max_dialogs, len(core.dialogs))
        self.max_responses = max(self.max_responses, len(core._responses))

    def datagram(self) -> tuple[bytes, tuple[str, int]]:
        """A datagram aimed at the core's current dialogs, mutated or not, or junk."""
        rng, core = self.rng, self.core
        dialogs = list(core.dialogs.values())
        roll = rng.random()
        if roll < 0.45:
            # A SIPp message of a live call (right Call-ID and tags) or of a new one.
            if dialogs and rng.random() < 0.7:
                dialog = rng.choice(dialogs)
                match = re.match(r"([0-9]+)-4242@", dialog.call_id)
                n = int(match.group(1)) if match else 0
                data = render(rng.choice(SIPP_TEMPLATES), n, dialog.local_tag)
            else:
                data = render(rng.choice(SIPP_TEMPLATES), rng.randrange(10_000))
            if rng.random() < 0.5:
                data = mutate(rng, data)
        elif roll < 0.55 and dialogs:
            # A response to one of our own requests (BYE, REFER), possibly mangled.
            dialog = rng.choice(dialogs)
            pending = list(dialog.client.items())
            if pending:
                _, (_, retransmit) = rng.choice(pending)
                request = parse_message(retransmit.data)
                assert isinstance(request, SipRequest)
                status = rng.choice([100, 180, 200, 202, 403, 481, 500, 603])
                from gateway.sip.message import response_to

                data = response_to(request, status, to_tag="peer").serialize()
                if rng.random() < 0.3:
                    data = mutate(rng, data)
            else:
                data = mutate(rng, rng.choice(GOLDEN_SIP))
        elif roll < 0.85:
            data = mutate(rng, rng.choice(SIP_SEEDS))
        elif roll < 0.95:
            data = rng.randbytes(rng.randint(0, 400))
        else:
            data = rng.choice([b"\r\n\r\n", b"\r\n", b"", b"\x00" * 4])
        source = ALLOWED if rng.random() < 0.85 else rng.choice(STRANGERS)
        return data, source

    def step(self) -> None:
        core, rng = self.core, self.rng
        data, source = self.datagram()
        self.now += rng.expovariate(1 / 0.3)
        stranger = source != ALLOWED
        if stranger:
            before = (len(core.dialogs), dict(core._responses),
                      [d.state for d in core.dialogs.values()])
        try:
            effects = core.receive(data, source, self.now)
        except Exception as exc:
            self.tally.fail(f"receive escaped {type(exc).__name__}: {exc}", data)
            return
        kinds = Counter(type(e).__name__ for e in effects)
        if stranger:
            try:
                message: SipRequest | SipResponse | None = parse_message(data)
            except SipParseError:
                message = None
            after = (len(core.dialogs), dict(core._responses),
                     [d.state for d in core.dialogs.values()])
            sent = [_parsed(e.data) for e in effects if isinstance(e, SendTo)]
            # A malformed request (message None) gets nothing at all from a stranger's view.
            if not isinstance(message, SipResponse) and (
                    after != before or kinds["IncomingCall"] or any(
                        not isinstance(r, SipResponse) or r.status != 403 for r in sent)):
                self.tally.fail(f"a stranger changed state or got more than a 403: {kinds}",
                                data)
        label = ("stranger " if stranger else "") + (
            "dropped" if kinds["Dropped"] else "incoming" if kinds["IncomingCall"]
            else "answered" if kinds["SendTo"] else "silent")
        (self.tally.accepted if kinds["SendTo"] or kinds["IncomingCall"]
         else self.tally.rejected)[label] += 1
        self.apply(effects, data, source)
        try:
            if rng.random() < 0.02 and core.dialogs:
                key = rng.choice(list(core.dialogs))
                action = rng.choice(["hangup", "refer", "refer-sip"])
                if action == "hangup":
                    self.apply(core.hangup(key, self.now), data, source)
                else:
                    target = "+15551234567" if action == "refer" else "sip:agent@pbx.test"
                    self.apply(core.refer(key, target, self.now), data, source)
            self.apply(core.tick(self.now), data, source)
        except Exception as exc:
            self.tally.fail(f"command/tick escaped {type(exc).__name__}: {exc}", data)

    def wind_down(self) -> None:
        """Hang every call up and let every timer run out: nothing may be left."""
        core = self.core
        for key in list(core.dialogs):
            self.apply(core.hangup(key, self.now), b"<hangup>", ALLOWED)
        for _ in range(3):
            self.now += 2 * core.timeout
            self.apply(core.tick(self.now), b"<tick>", ALLOWED)
        leftovers = (len(core.dialogs), len(core._responses), core.next_deadline())
        if leftovers != (0, 0, None):
            self.tally.fail(f"state left after wind-down: dialogs, responses, deadline = "
                            f"{leftovers}")


def _parsed(data: bytes) -> SipRequest | SipResponse | None:
    try:
        return parse_message(data)
    except SipParseError:
        return None


#: The header fields a response copies from its request (RFC 3261 8.2.6.2), Via apart.
_COPIED = (b"from:", b"to:", b"call-id:", b"cseq:")
_GOOD_COPIES = [b"From: <sip:a@b>;tag=1", b"To: <sip:c@d>;tag=2", b"Call-ID: x@y",
                b"CSeq: 1 INVITE"]


def answers_a_malformed_request(response: bytes, request: bytes) -> bool:
    """``response`` is a 4xx/5xx to a ``request`` the parser rejected with that status, and
    everything in it but the From/To/Call-ID/CSeq copied from that request is valid SIP."""
    try:
        parse_message(request)
        return False
    except SipParseError as exc:
        status = exc.status
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    if not status or not lines[0].startswith(f"SIP/2.0 {status} ".encode()):
        return False
    ours = [line for line in lines[1:] if not line.lower().startswith(_COPIED)]
    try:
        parse_message(b"\r\n".join([lines[0], *ours, *_GOOD_COPIES]) + b"\r\n\r\n" + body)
    except SipParseError:
        return False
    return True


#: The budget the fuzzed core's admission question gives it (the gateway's Admission's place).
MAX_CALLS = 4


def _budgeted_core(max_calls: int, config: UasConfig | None = None) -> UasCore:
    """A core whose admission, like the replica's, refuses once ``max_calls`` calls are up."""
    core: UasCore | None = None

    def refusal() -> str | None:
        assert core is not None
        return "at_capacity" if core.active_calls >= max_calls else None

    if config is None:
        config = UasConfig(local_ip=GATEWAY[0], local_port=GATEWAY[1], allow=["127.0.0.1/32"],
                           t1=0.5)
    core = UasCore(config, admission=refusal)
    return core


def fuzz_uas(cases: int, seed: int, session: int = 2000) -> tuple[Tally, list[UasRun]]:
    rng = random.Random(seed)
    tally = Tally()
    runs: list[UasRun] = []
    while tally.cases < cases:
        core = _budgeted_core(MAX_CALLS)
        run = UasRun(core, tally, rng)
        for _ in range(min(session, cases - tally.cases)):
            tally.cases += 1
            run.step()
        run.wind_down()
        runs.append(run)
    return tally, runs


@pytest.mark.slow
def test_uas_core_takes_100k_hostile_datagrams_with_bounded_state(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Thousands of "no ACK" warnings are expected here; capturing them would only cost time.
    caplog.set_level(logging.ERROR, logger="gateway.sip.uas")
    runs: list[UasRun] = []

    def run() -> Tally:
        tally, found = fuzz_uas(CASES, SEED)
        runs.extend(found)
        return tally

    tally = _timed(run, "UAS core")
    calls = sum(r.calls for r in runs)
    max_dialogs = max(r.max_dialogs for r in runs)
    max_responses = max(r.max_responses for r in runs)
    print(f"UAS core: {len(runs)} sessions, {calls} calls offered, at most {max_dialogs} dialogs "
          f"and {max_responses} cached responses at once; virtual time "
          f"{sum(r.now for r in runs) / 3600:.1f} h")
    assert calls > CASES // 100
    assert {"incoming", "answered", "dropped", "stranger answered"} <= set(
        tally.accepted) | set(tally.rejected)
    # Dialogs: the calls (MAX_CALLS) plus ended ones waiting out their BYE's transaction.
    assert max_dialogs <= MAX_CALLS + 64
    assert max_responses <= uas_module.MAX_CACHED_RESPONSES


def test_the_uas_harness_reports_a_stranger_that_gets_state() -> None:
    class Leaky(UasConfig):
        def allowed(self, ip: str) -> bool:
            return True  # planted: the allow-list lets everyone in

    rng = random.Random(SEED)
    tally = Tally()
    core = _budgeted_core(MAX_CALLS, Leaky(local_ip=GATEWAY[0], local_port=GATEWAY[1],
                                           allow=["127.0.0.1/32"]))
    run = UasRun(core, tally, rng)
    for _ in range(3000):
        tally.cases += 1
        run.step()
    assert any("stranger" in f for f in tally.failures)


def test_the_uas_harness_lets_through_only_what_a_malformed_request_lacked() -> None:
    no_call_id = (b"INVITE sip:ivr@h SIP/2.0\r\nVia: SIP/2.0/UDP 127.0.0.1;branch=z9hG4bK1\r\n"
                  b"From: <sip:a@b>;tag=1\r\nTo: <sip:ivr@h>\r\nCSeq: 1 INVITE\r\n\r\n")
    answer = (b"SIP/2.0 400 Bad Request (missing Call-ID)\r\n"
              b"Via: SIP/2.0/UDP 127.0.0.1;branch=z9hG4bK1\r\nFrom: <sip:a@b>;tag=1\r\n"
              b"To: <sip:ivr@h>;tag=2\r\nCSeq: 1 INVITE\r\nContent-Length: 0\r\n\r\n")
    assert answers_a_malformed_request(answer, no_call_id)
    # What the core writes itself must still be valid: its Via, its status line.
    assert not answers_a_malformed_request(answer.replace(b"UDP 127.0.0.1", b"UDP"), no_call_id)
    assert not answers_a_malformed_request(answer.replace(b" 400 ", b" 200 "), no_call_id)
    # And only for a request that was malformed.
    whole = no_call_id.replace(b"CSeq", b"Call-ID: c@h\r\nCSeq")
    assert not answers_a_malformed_request(answer, whole)


@pytest.mark.parametrize("index", range(len(SIPP_TEMPLATES)))
def test_every_rendered_sipp_message_parses(index: int) -> None:
    # The seeds are real: SIPp's messages, rendered as SIPp renders them, are valid SIP.
    message = parse_message(render(SIPP_TEMPLATES[index], 7, "gwtag"))
    assert isinstance(message, SipRequest | SipResponse)
