"""Hostile SIP and RTP over real UDP sockets against a real gateway.

The gateway runs the demo IVR (tiny model on CPU, prompts from the pre-rendered cache) with its
SIP endpoint on 127.0.0.1, allowing only 127.0.0.1/32 and at most 4 calls. Attackers are plain
UDP sockets: on 127.0.0.1 (an allowed trunk gone wild, or a spoofed one) and on 127.0.0.2 (a
scanner from a disallowed address). What is measured:

- an INVITE flood: how many calls get up (the cap), how fast the rest are refused, and the most
  dialogs / media sessions / calls / cached responses the endpoint ever held;
- a flood of OPTIONS with fresh branches: the response cache stays at its bound;
- a sipvicious-style sweep from a disallowed address: 403 or silence, and no state at all;
- a second INVITE reusing a live call's Call-ID: refused, and no second media session leaks;
- a BYE without a To tag (scanners send them): 481, no traceback;
- RTP from an unexpected source, before and after the stream latches: no audio, no DTMF.
"""

from __future__ import annotations

import logging
import select
import socket
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.sip import uas as uas_module
from gateway.sip.message import SipParseError, SipResponse, parse_message
from gateway.sip.rtp import RtpPacket, RtpSender, TelephoneEvent
from gateway.sip.sdp import parse_sdp
from tests.support.paths import DEMO_SCRIPT
from tests.support.servers import LiveServer, serve
from tests.support.waiting import wait_until as _wait

MAX_CALLS = 4
ATTACKER_IP = "127.0.0.2"


@pytest.fixture(scope="module")
def sip_live(tiny_model_dir: Path, demo_cache_dir: Path) -> Iterator[LiveServer]:
    with serve(
        {
            "model": str(tiny_model_dir),
            "script": str(DEMO_SCRIPT),
            "cache_dir": str(demo_cache_dir),
            "sip": "127.0.0.1:0",
            "sip_allow": "127.0.0.1/32",
            "max_calls": MAX_CALLS,
            # No ACK ends a call after 64*T1 = 6.4 s instead of 32 s.
            "sip_t1_ms": 100,
            "rtp_ports": "25000-25199",
        }
    ) as live:
        yield live


def _endpoint(live: LiveServer) -> Any:
    endpoint = live.gateway.sip
    assert endpoint is not None and endpoint.local_addr is not None
    return endpoint


def _idle(live: LiveServer) -> None:
    endpoint = _endpoint(live)
    _wait(lambda: not endpoint.media and not live.gateway.registry
          and endpoint.core.active_calls == 0)


class Udp:
    """A SIP or RTP peer: one UDP socket, what it received and when."""

    def __init__(self, ip: str = "127.0.0.1") -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((ip, 0))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.addr: tuple[str, int] = self.sock.getsockname()
        self.received: list[tuple[float, bytes, tuple[str, int]]] = []
        self._parsed: list[tuple[float, SipResponse]] = []
        self._parsed_upto = 0

    def send(self, data: bytes, target: tuple[str, int]) -> None:
        self.sock.sendto(data, target)

    def pump(self, seconds: float) -> None:
        """Receive for ``seconds``."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([self.sock], [], [], left)
            if ready:
                data, addr = self.sock.recvfrom(65536)
                self.received.append((time.monotonic(), data, addr))

    def responses(self) -> list[tuple[float, SipResponse]]:
        """The SIP responses received so far (parsed once each)."""
        for at, data, _ in self.received[self._parsed_upto:]:
            try:
                message = parse_message(data)
            except SipParseError:
                continue
            if isinstance(message, SipResponse):
                self._parsed.append((at, message))
        self._parsed_upto = len(self.received)
        return list(self._parsed)

    def wait_for(self, predicate: Callable[[list[tuple[float, SipResponse]]], Any],
                 timeout: float = 10) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = predicate(self.responses())
            if result:
                return result
            self.pump(0.02)
        raise AssertionError(f"no such response; got {[r.status for _, r in self.responses()]}")

    def close(self) -> None:
        self.sock.close()


def sdp(rtp_port: int, address: str = "127.0.0.1") -> str:
    return (f"v=0\r\no=- 1 1 IN IP4 {address}\r\ns=-\r\nc=IN IP4 {address}\r\nt=0 0\r\n"
            f"m=audio {rtp_port} RTP/AVP 0 101\r\na=rtpmap:0 PCMU/8000\r\n"
            "a=rtpmap:101 telephone-event/8000\r\na=fmtp:101 0-15\r\na=ptime:20\r\n")


def request(method: str, peer: Udp, target: tuple[str, int], call_id: str, branch: str, *,
            cseq: int = 1, to_tag: str | None = None, body: str = "",
            extra: str = "", from_tag: str = "atk") -> bytes:
    ctype = "Content-Type: application/sdp\r\n" if body else ""
    to = f"<sip:ivr@{target[0]}:{target[1]}>" + (f";tag={to_tag}" if to_tag else "")
    return (
        f"{method} sip:ivr@{target[0]}:{target[1]} SIP/2.0\r\n"
        f"Via: SIP/2.0/UDP {peer.addr[0]}:{peer.addr[1]};branch=z9hG4bK-{branch};rport\r\n"
        f"Max-Forwards: 70\r\nFrom: <sip:caller@{peer.addr[0]}>;tag={from_tag}\r\nTo: {to}\r\n"
        f"Call-ID: {call_id}\r\nCSeq: {cseq} {method}\r\n"
        f"Contact: <sip:caller@{peer.addr[0]}:{peer.addr[1]}>\r\n{extra}{ctype}"
        f"Content-Length: {len(body)}\r\n\r\n{body}"
    ).encode()


def final(responses: list[tuple[float, SipResponse]], call_id: str,
          method: str = "INVITE") -> tuple[float, SipResponse] | None:
    return next(((at, r) for at, r in responses if r.status >= 200 and r.call_id == call_id
                 and r.cseq[1] == method), None)


# --- floods -----------------------------------------------------------------------------------


def test_an_invite_flood_gets_the_call_cap_and_prompt_refusals_with_bounded_state(
    sip_live: LiveServer,
) -> None:
    endpoint = _endpoint(sip_live)
    target = endpoint.local_addr
    _idle(sip_live)
    caller, media_sink = Udp(), Udp()
    n = 200
    sent_at: dict[str, float] = {}
    peaks = {"dialogs": 0, "active": 0, "media": 0, "calls": 0, "responses": 0}

    def sample() -> None:
        core = endpoint.core
        for name, value in (("dialogs", len(core.dialogs)), ("active", core.active_calls),
                            ("media", len(endpoint.media)),
                            ("calls", len(sip_live.gateway.registry)),
                            ("responses", len(core._responses))):
            peaks[name] = max(peaks[name], value)

    invites: dict[str, bytes] = {}
    retransmitted = 0
    try:
        for i in range(n):
            call_id = f"flood-{i}@atk"
            invites[call_id] = request("INVITE", caller, target, call_id, f"f{i}",
                                       body=sdp(media_sink.addr[1]))
            caller.send(invites[call_id], target)
            sent_at[call_id] = time.monotonic()
            if i % 20 == 0:
                caller.pump(0)
                sample()
        # Like any UAC over UDP, retransmit what got no answer at all after T1 (Timer A, RFC
        # 3261 17.1.1.2): a burst this size overflows the gateway's socket buffer in the kernel.
        deadline = time.monotonic() + 20
        next_retransmit = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            caller.pump(0.05)
            sample()
            responses = caller.responses()
            if all(final(responses, cid) for cid in sent_at):
                break
            if time.monotonic() >= next_retransmit:
                heard = {r.call_id for _, r in responses}
                for cid in set(sent_at) - heard:
                    caller.send(invites[cid], target)
                    retransmitted += 1
                next_retransmit = time.monotonic() + 0.5
        responses = caller.responses()
        finals = {cid: final(responses, cid) for cid in sent_at}
        missing = [cid for cid, f in finals.items() if f is None]
        assert not missing, f"{len(missing)} INVITEs never got a final response"
        by_status: dict[int, list[float]] = {}
        for cid, found in finals.items():
            assert found is not None
            at, response = found
            by_status.setdefault(response.status, []).append(1000 * (at - sent_at[cid]))
        refused = by_status.get(486, [])
        p95 = statistics.quantiles(refused, n=20)[-1]
        print(f"\nINVITE flood x{n}: {len(by_status.get(200, []))} answered, {len(refused)} "
              f"refused 486 after p50 {statistics.median(refused):.1f} ms, p95 {p95:.1f} ms, max "
              f"{max(refused):.1f} ms from the first send ({retransmitted} retransmissions of "
              f"INVITEs the kernel dropped); peak state {peaks}")
        assert sorted(by_status) == [200, 486]
        assert len(by_status[200]) == MAX_CALLS
        assert statistics.median(refused) < 250 and max(refused) < 5000
        assert peaks["active"] <= MAX_CALLS and peaks["media"] <= MAX_CALLS
        assert peaks["calls"] <= MAX_CALLS and peaks["dialogs"] <= MAX_CALLS
        # Hang the answered calls up: everything they held goes.
        for cid, found in finals.items():
            assert found is not None
            if found[1].status == 200:
                tag = found[1].to_tag
                caller.send(request("ACK", caller, target, cid, f"a{cid}", to_tag=tag), target)
                caller.send(request("BYE", caller, target, cid, f"b{cid}", cseq=2, to_tag=tag),
                            target)
        caller.wait_for(lambda rs: sum(1 for _, r in rs if r.cseq[1] == "BYE" and r.status == 200)
                        == MAX_CALLS)
        _idle(sip_live)
    finally:
        caller.close()
        media_sink.close()


def test_an_options_flood_with_fresh_branches_keeps_the_response_cache_bounded(
    sip_live: LiveServer,
) -> None:
    endpoint = _endpoint(sip_live)
    target, core = endpoint.local_addr, endpoint.core
    cap = uas_module.MAX_CACHED_RESPONSES
    peer = Udp()
    n = cap + 1500
    # This gateway runs T1 = 100 ms (responses live 6.4 s); give them the RFC's 32 s so the
    # flood can fill the cache at whatever rate this machine answers.
    timeout, core.timeout = core.timeout, 64 * uas_module.T1
    t0 = time.monotonic()
    try:
        for burst in range(0, n, 100):
            for i in range(burst, min(n, burst + 100)):
                peer.send(request("OPTIONS", peer, target, f"opt-{i}@atk", f"o{i}"), target)
            # Let the gateway answer each burst: the kernel would drop a 5,000-datagram burst.
            upto = min(n, burst + 100)
            peer.wait_for(lambda rs, upto=upto: len(rs) >= upto, timeout=20)
        elapsed = time.monotonic() - t0
        held = len(core._responses)
        held_bytes = sum(len(data) for _, data, _ in core._responses.values())
        print(f"\nOPTIONS flood x{n} with fresh branches: answered in {elapsed:.1f} s "
              f"({n / elapsed:,.0f}/s); response cache {held} entries, {held_bytes / 1024:.0f} KiB "
              f"(bound {cap})")
        assert all(r.status == 200 for _, r in peer.responses())
        assert held == cap  # full, and not one more
    finally:
        core.timeout = timeout
        peer.close()


# --- strangers --------------------------------------------------------------------------------


def test_a_sweep_from_a_disallowed_address_gets_403_or_silence_and_leaves_no_state(
    sip_live: LiveServer,
) -> None:
    endpoint = _endpoint(sip_live)
    target, core = endpoint.local_addr, endpoint.core
    scanner, sink = Udp(ATTACKER_IP), Udp(ATTACKER_IP)
    before = (len(core.dialogs), dict(core._responses), len(endpoint.media),
              len(sip_live.gateway.registry), core.stats["rejected_source"])
    scan_ua = "User-Agent: friendly-scanner\r\n"
    sweep: list[bytes] = []
    for ext in range(100, 150):
        cid = f"scan-{ext}@atk"
        sweep += [
            request("OPTIONS", scanner, target, cid, f"s{ext}o", extra=scan_ua),
            request("INVITE", scanner, target, cid, f"s{ext}i", extra=scan_ua,
                    body=sdp(sink.addr[1], ATTACKER_IP)),
            request("REGISTER", scanner, target, cid, f"s{ext}r", extra=scan_ua),
            request("BYE", scanner, target, cid, f"s{ext}b", extra=scan_ua),
            request("CANCEL", scanner, target, cid, f"s{ext}i", extra=scan_ua),
            request("ACK", scanner, target, cid, f"s{ext}i", extra=scan_ua),
        ]
    answerable = sum(1 for d in sweep if not d.startswith(b"ACK"))
    try:
        # In bursts of one extension's six requests: a 300-datagram burst would only measure the
        # kernel dropping what overflows the gateway's socket buffer.
        for start in range(0, len(sweep), 6):
            group = sweep[start : start + 6]
            for data in group:
                scanner.send(data, target)
            upto = sum(1 for d in sweep[: start + 6] if not d.startswith(b"ACK"))
            scanner.wait_for(lambda rs, upto=upto: len(rs) >= upto, timeout=20)
        scanner.pump(0.3)  # nothing more may come (ACKs get no answer)
        statuses = [r.status for _, r in scanner.responses()]
        after = (len(core.dialogs), dict(core._responses), len(endpoint.media),
                 len(sip_live.gateway.registry), core.stats["rejected_source"])
        print(f"\nsweep from {ATTACKER_IP}: {len(sweep)} requests -> {len(statuses)} responses "
              f"{sorted(set(statuses))}; dialogs/cached responses/media/calls "
              f"{before[0]}/{len(before[1])}/{before[2]}/{before[3]} -> "
              f"{after[0]}/{len(after[1])}/{after[2]}/{after[3]}")
        assert statuses == [403] * answerable
        assert after[:4] == before[:4]
        assert after[4] - before[4] == len(sweep)
        sink.pump(0.2)
        assert not sink.received  # no RTP was ever aimed at the scanner
    finally:
        scanner.close()
        sink.close()


# --- protocol abuse from an allowed address ---------------------------------------------------


def test_a_second_invite_with_a_live_call_id_is_refused_and_leaks_nothing(
    sip_live: LiveServer,
) -> None:
    endpoint = _endpoint(sip_live)
    target = endpoint.local_addr
    _idle(sip_live)
    caller, rtp = Udp(), Udp()
    try:
        cid = "dup-call@atk"
        caller.send(request("INVITE", caller, target, cid, "d1", body=sdp(rtp.addr[1])), target)
        _, ok = caller.wait_for(lambda rs: final(rs, cid))
        assert ok.status == 200
        media = _wait(lambda: next(iter(endpoint.media.values()), None))
        call = _wait(lambda: media.call)
        playout = call.playout._task  # the call's RTP pacing
        # Same Call-ID and From tag, a new branch and CSeq, no To tag: not a retransmission.
        caller.send(request("INVITE", caller, target, cid, "d2", cseq=2, body=sdp(rtp.addr[1])),
                    target)
        second = caller.wait_for(lambda rs: [r for _, r in rs if r.cseq == (2, "INVITE")
                                             and r.status >= 200])
        # Another From tag under the same Call-ID: a second dialog would collide in the call
        # table ("sip-<Call-ID>") all the same.
        caller.send(request("INVITE", caller, target, cid, "d3", body=sdp(rtp.addr[1]),
                            from_tag="other"), target)
        third = caller.wait_for(lambda rs: [r for _, r in rs if r.headers.get("From", "")
                                            .endswith("tag=other") and r.status >= 200])
        caller.pump(0.3)
        print(f"\nsecond INVITE on a live Call-ID: {second[0].status}, another From tag: "
              f"{third[0].status}; media sessions {len(endpoint.media)}, "
              f"calls {len(sip_live.gateway.registry)}")
        assert second[0].status == 482 and third[0].status == 482
        assert list(endpoint.media.values()) == [media] and len(sip_live.gateway.registry) == 1
        # A retransmission of the first INVITE still gets its 200 (never a second call).
        caller.send(request("INVITE", caller, target, cid, "d1", body=sdp(rtp.addr[1])), target)
        caller.pump(0.3)
        assert len(endpoint.media) == 1
        tag = ok.to_tag
        caller.send(request("ACK", caller, target, cid, "d1", to_tag=tag), target)
        caller.send(request("BYE", caller, target, cid, "d4", cseq=3, to_tag=tag), target)
        caller.wait_for(lambda rs: final(rs, cid, "BYE"))
        _idle(sip_live)
        assert playout is not None and playout.done()
    finally:
        caller.close()
        rtp.close()


def test_a_bye_without_a_to_tag_gets_481_and_no_traceback(
    sip_live: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    endpoint = _endpoint(sip_live)
    target = endpoint.local_addr
    peer = Udp()
    caplog.set_level(logging.WARNING)
    try:
        for i in range(20):
            peer.send(request("BYE", peer, target, f"stray-{i}@atk", f"sb{i}"), target)
        peer.wait_for(lambda rs: len(rs) >= 20)
        assert [r.status for _, r in peer.responses()] == [481] * 20
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert not errors, [r.getMessage() for r in errors]
        # The endpoint is unharmed: an OPTIONS still gets its 200.
        peer.send(request("OPTIONS", peer, target, "after@atk", "sb-o"), target)
        peer.wait_for(lambda rs: final(rs, "after@atk", "OPTIONS"))
    finally:
        peer.close()


def test_an_offer_with_a_host_name_for_media_is_refused(sip_live: LiveServer) -> None:
    endpoint = _endpoint(sip_live)
    target = endpoint.local_addr
    _idle(sip_live)
    peer = Udp()
    try:
        for i, address in enumerate(["media.invalid", "localhost", "::1"]):
            body = sdp(16000, address).replace("IN IP4 ::1", "IN IP6 ::1")
            cid = f"named-{i}@atk"
            peer.send(request("INVITE", peer, target, cid, f"n{i}", body=body), target)
            _, response = peer.wait_for(lambda rs, cid=cid: final(rs, cid))
            # Resolving would block or, on uvloop, make every RTP send raise: the call would be
            # silent forever. 488 before anything is allocated instead.
            assert response.status == 488, (address, response.status)
        assert not endpoint.media and not sip_live.gateway.registry
    finally:
        peer.close()


# --- RTP --------------------------------------------------------------------------------------


def _dtmf_packets(sender: RtpSender, digit_event: int) -> list[bytes]:
    """One key press: start, update, and the triplicated end (RFC 4733 2.5.1.4)."""
    packets = []
    timestamp = sender.timestamp
    for duration, end in ((160, False), (320, False), (480, True), (480, True), (480, True)):
        packet = RtpPacket(101, sender.sequence, timestamp, sender.ssrc,
                           TelephoneEvent(digit_event, end, 10, duration).serialize())
        sender.sequence = (sender.sequence + 1) & 0xFFFF
        packets.append(packet.serialize())
    sender.timestamp = (timestamp + 800) & 0xFFFFFFFF
    return packets


def test_rtp_from_an_unexpected_source_cannot_inject_audio_or_keys(sip_live: LiveServer) -> None:
    endpoint = _endpoint(sip_live)
    target = endpoint.local_addr
    _idle(sip_live)
    caller, caller_rtp = Udp(), Udp()
    stranger, neighbour = Udp(ATTACKER_IP), Udp()  # another host; another port of the caller's
    try:
        cid = "rtp-victim@atk"
        caller.send(request("INVITE", caller, target, cid, "r1", body=sdp(caller_rtp.addr[1])),
                    target)
        _, ok = caller.wait_for(lambda rs: final(rs, cid))
        assert ok.status == 200
        gateway_rtp = ("127.0.0.1", next(m.port for m in parse_sdp(ok.body).media if m.port))
        caller.send(request("ACK", caller, target, cid, "r1", to_tag=ok.to_tag), target)
        media = _wait(lambda: next(iter(endpoint.media.values()), None))

        # 1. Before the caller's RTP arrives: keys from another host, garbage from another port
        #    of the caller's own address.
        evil = RtpSender(101)
        for packet in _dtmf_packets(evil, 2) * 4:
            stranger.send(packet, gateway_rtp)
        for _ in range(10):
            neighbour.send(b"\x00" * 40, gateway_rtp)
        _wait(lambda: media.stats.ignored_source >= 20 and media.stats.malformed >= 10)
        assert not media._latched and list(media.stats.digits) == []

        # 2. The caller's audio latches the stream to its address...
        audio = RtpSender(0)
        for _ in range(10):
            caller_rtp.send(audio.packet(b"\xff" * 160), gateway_rtp)
        _wait(lambda: media._latched)
        assert media.remote == caller_rtp.addr

        # 3. ...after which neither the other host nor the other port gets in, valid RTP or not.
        ignored = media.stats.ignored_source
        for packet in _dtmf_packets(evil, 2) * 2:
            stranger.send(packet, gateway_rtp)
            neighbour.send(packet, gateway_rtp)
        for _ in range(10):
            neighbour.send(audio.packet(b"\x00" * 160), gateway_rtp)
        _wait(lambda: media.stats.ignored_source >= ignored + 30)

        # 4. The caller's own key press still works.
        for packet in _dtmf_packets(audio, 9):
            caller_rtp.send(packet, gateway_rtp)
        _wait(lambda: media.stats.digits)
        time_for_more = time.monotonic() + 0.3
        while time.monotonic() < time_for_more:
            caller_rtp.pump(0.05)
        stranger.pump(0.1)
        neighbour.pump(0.1)
        print(f"\nRTP injection: ignored {media.stats.ignored_source} packets from other "
              f"sources, {media.stats.malformed} malformed; digits {media.stats.digits}; our RTP "
              f"went to the caller {len(caller_rtp.received)}x, to the others "
              f"{len(stranger.received) + len(neighbour.received)}x")
        assert list(media.stats.digits) == ["9"]
        assert caller_rtp.received and not stranger.received and not neighbour.received
        caller.send(request("BYE", caller, target, cid, "r2", cseq=2, to_tag=ok.to_tag), target)
        caller.wait_for(lambda rs: final(rs, cid, "BYE"))
        _idle(sip_live)
    finally:
        for peer in (caller, caller_rtp, stranger, neighbour):
            peer.close()
