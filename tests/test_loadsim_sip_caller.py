"""The load simulator's SIP caller (gateway.loadsim.sip_caller), built on gateway.sip.

Against a real peer (baresip auto-answering on loopback, tests/sip_peers.py) for what a phone
sees; against a scripted UDP peer for the exact RFC 3261 timers and RTP/RFC 4733 wire format;
and sans-I/O for the receive analysis (jitter, loss, speech timing, the playout model) and the
pacing measurement on a virtual clock.
"""

from __future__ import annotations

import asyncio
import itertools
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sip_peers import Baresip

from gateway.audio.g711 import ulaw_encode
from gateway.loadsim.sip_caller import (
    FRAME_SAMPLES,
    CallFailed,
    CallTimeout,
    FramePacer,
    RtpReceiveLog,
    SipCaller,
    is_silent,
    read_answer,
)
from gateway.sip.message import SipParseError, SipResponse, parse_message
from gateway.sip.rtp import RtpError, RtpPacket, seq_diff, ts_diff
from gateway.sip.sdp import SdpError

T = TypeVar("T")
RATE = 8000


def tone(seconds: float, hz: float = 1000.0, amplitude: int = 8000) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    return (amplitude * np.sin(2 * np.pi * hz * t)).astype(np.int16)


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * RATE), dtype=np.int16)


def bursts_wav() -> np.ndarray:
    """baresip's microphone: 0.6 s silence, 0.4 s tone, 0.6 s silence, 0.4 s tone, silence."""
    return np.concatenate([silence(0.6), tone(0.4), silence(0.6), tone(0.4), silence(8.0)])


def ulaw_frames(pcm: np.ndarray) -> list[bytes]:
    codes = ulaw_encode(pcm)
    return [codes[i : i + FRAME_SAMPLES] for i in range(0, len(codes), FRAME_SAMPLES)]


async def until(probe: Callable[[], T | None], timeout: float, what: str) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value is not None:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def event(phone: Baresip, kind: str, timeout: float = 5) -> dict[str, Any]:
    return await asyncio.to_thread(phone.wait_event, kind, timeout)


# --- against baresip ------------------------------------------------------------------------------


async def test_call_to_baresip_measures_setup_speech_dtmf_and_hangup(tmp_path: Path) -> None:
    with Baresip(tmp_path, microphone=bursts_wav()) as phone:
        caller = SipCaller()
        try:
            await caller.call(("127.0.0.1", phone.sip_port), user="tester", timeout_s=5)
            assert caller.status == 200
            assert caller.answered_at is not None and caller.setup_ms is not None
            assert 0 < caller.setup_ms < 1000
            assert caller.invite_retransmits == 0
            assert caller.answer is not None and caller.answer.event_pt == 101
            await event(phone, "CALL_ESTABLISHED")
            caller.play(ulaw_frames(tone(0.5, hz=440)))  # what baresip should hear from us

            answered = caller.answered_at
            first = await until(lambda: caller.first_audio_after(answered), 3, "first burst")
            # baresip's file starts with 0.6 s of silence when the call is established.
            assert 0.4 < first - answered < 1.2
            stopped = await until(lambda: caller.stream_stopped_after(first), 3, "burst end")
            assert 0.3 < stopped - first < 0.5  # a 0.4 s burst
            second = await until(lambda: caller.first_audio_after(stopped), 3, "second burst")
            assert 0.5 < second - stopped < 0.7  # 0.6 s of silence between bursts
            burst = caller.playout(first - 0.001, stopped)
            assert burst.start == first
            assert 18 <= burst.packets <= 23 and burst.lost == 0
            assert caller.gaps(first - 0.001, stopped) == (burst.gaps, burst.gap_ms)
            print(f"\nfirst burst playout: {burst}")

            pressed = await caller.send_dtmf("5")
            assert first < pressed < time.monotonic()
            assert (await event(phone, "CALL_DTMF_START"))["param"] == "5"
            await event(phone, "CALL_DTMF_END")

            assert await caller.hangup() == 200
            assert caller.hangup_ms is not None and caller.hangup_ms < 500
            await event(phone, "CALL_CLOSED")

            assert caller.rtp.packets > 50 and caller.rtp.audio_packets == caller.rtp.packets
            assert caller.rtp.lost == 0 and caller.loss_pct == 0
            assert 0 <= caller.jitter_ms < 10
            assert caller.rtp.sources == [(caller.answer.address, caller.answer.port)]
            assert caller.packets_sent > 50
            lateness = caller.pacing
            assert len(lateness) >= caller.packets_sent
            assert min(lateness.lateness_ms) >= 0
            assert lateness.percentile(50) < 5
            print(
                f"send lateness over {len(lateness)} packets: mean {lateness.mean_ms:.2f} ms, "
                f"p50 {lateness.percentile(50):.2f}, p99 {lateness.percentile(99):.2f}, "
                f"max {lateness.max_ms:.2f}; {lateness.histogram()}; "
                f"rx jitter {caller.rtp.jitter_ms:.2f} ms, setup {caller.setup_ms:.1f} ms"
            )
            assert caller.errors == []
        finally:
            await caller.aclose()
    heard = phone.recording().astype(np.float64)
    assert np.abs(heard).max() > 4000  # our 440 Hz tone reached baresip


async def test_baresip_hangs_up_first(tmp_path: Path) -> None:
    with Baresip(tmp_path, seconds_of_audio=10) as phone:
        async with SipCaller() as caller:
            await caller.call(("127.0.0.1", phone.sip_port), user="tester", timeout_s=5)
            await event(phone, "CALL_ESTABLISHED")
            await asyncio.sleep(0.2)
            asked = time.monotonic()
            phone.hangup()
            hung_up = await until(lambda: caller.remote_hangup_at, 3, "baresip's BYE")
            assert 0 < hung_up - asked < 1
            await event(phone, "CALL_CLOSED")
            sent = caller.packets_sent
            await asyncio.sleep(0.1)
            assert caller.packets_sent == sent  # our media stopped with the BYE
            assert await caller.hangup() is None  # nothing left to end
            assert caller.requests_received == {"BYE": 1}
            assert caller.errors == []


async def test_refer_is_accepted_and_reported_failed_options_answered(tmp_path: Path) -> None:
    with Baresip(tmp_path, seconds_of_audio=10) as phone:
        async with SipCaller() as caller:
            await caller.call(("127.0.0.1", phone.sip_port), user="tester", timeout_s=5)
            await event(phone, "CALL_ESTABLISHED")
            assert caller.local_sip is not None
            phone.command("options", f"sip:loadsim@127.0.0.1:{caller.local_sip[1]}")
            await until(lambda: caller.requests_received.get("OPTIONS"), 3, "OPTIONS")
            phone.command("transfer", "sip:agent@127.0.0.1:5099")
            failed = await event(phone, "TRANSFER_FAILED")
            assert failed["param"] == "503 Service Unavailable"  # our NOTIFY's sipfrag
            assert caller.transferred_to == "sip:agent@127.0.0.1:5099"
            assert caller.errors == []


async def test_rejected_call_fails_clearly_and_is_acked(tmp_path: Path) -> None:
    with Baresip(tmp_path) as phone:
        async with SipCaller() as caller:
            with pytest.raises(CallFailed) as failed:
                await caller.call(("127.0.0.1", phone.sip_port), user="nobody", timeout_s=5)
            assert failed.value.status == caller.status == 404
            await asyncio.sleep(1.2)  # baresip retransmits its 404 at +0.5 s unless ACKed
            assert caller.final_retransmits == 0, caller.errors
            assert caller.errors == []


# --- against a scripted peer: exact timers and wire format ----------------------------------------


class Udp(asyncio.DatagramProtocol):
    """A test-side UDP socket on 127.0.0.1 with an arrival-timestamped receive queue."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[tuple[bytes, tuple[str, int], float]] = asyncio.Queue()
        self.transport: asyncio.DatagramTransport | None = None

    @classmethod
    async def open(cls) -> Udp:
        loop = asyncio.get_running_loop()
        _, proto = await loop.create_datagram_endpoint(cls, local_addr=("127.0.0.1", 0))
        return proto

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.queue.put_nowait((data, addr, time.monotonic()))

    @property
    def port(self) -> int:
        assert self.transport is not None
        return int(self.transport.get_extra_info("sockname")[1])

    async def recv(self, timeout: float = 3) -> tuple[bytes, tuple[str, int], float]:
        return await asyncio.wait_for(self.queue.get(), timeout)

    def send(self, data: bytes, addr: tuple[str, int]) -> None:
        assert self.transport is not None
        self.transport.sendto(data, addr)

    def close(self) -> None:
        assert self.transport is not None
        self.transport.close()


def parse_sip(data: bytes) -> tuple[str, dict[str, list[str]], bytes]:
    """The test's own minimal reading of what the caller sent (not the module's parser)."""
    head, _, body = data.partition(b"\r\n\r\n")
    start, *lines = head.decode().split("\r\n")
    headers: dict[str, list[str]] = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers.setdefault(name.strip().lower(), []).append(value.strip())
    return start, headers, body


def reply(
    request: dict[str, list[str]],
    status: str,
    *,
    to_tag: str | None = None,
    extra: tuple[str, ...] = (),
    body: bytes = b"",
) -> bytes:
    to = request["to"][0] + (f";tag={to_tag}" if to_tag and "tag=" not in request["to"][0] else "")
    lines = [f"SIP/2.0 {status}", *(f"Via: {via}" for via in request["via"])]
    lines += [f"From: {request['from'][0]}", f"To: {to}", f"Call-ID: {request['call-id'][0]}"]
    lines += [f"CSeq: {request['cseq'][0]}", *extra, f"Content-Length: {len(body)}", "", ""]
    return "\r\n".join(lines).encode() + body


def answer_sdp(port: int) -> bytes:
    return (
        "v=0\r\no=peer 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
        f"m=audio {port} RTP/AVP 0 101\r\na=rtpmap:0 PCMU/8000\r\n"
        "a=rtpmap:101 telephone-event/8000\r\na=fmtp:101 0-15\r\na=ptime:20\r\na=sendrecv\r\n"
    ).encode()


def rtp_fields(data: bytes) -> tuple[bool, int, int, int, int, bytes]:
    b0, b1, seq, ts, ssrc = struct.unpack_from("!BBHII", data)
    assert b0 == 0x80
    return bool(b1 & 0x80), b1 & 0x7F, seq, ts, ssrc, data[12:]


async def test_timers_acks_rtp_and_dtmf_on_the_wire() -> None:
    uas, media = await Udp.open(), await Udp.open()
    caller = SipCaller(t1=0.2)  # Timer A: +0.2 s, +0.6 s, +1.4 s... (T1 = 500 ms by default)
    try:
        call = asyncio.create_task(caller.call(("127.0.0.1", uas.port), user="ivr", timeout_s=8))
        invites = [await uas.recv() for _ in range(3)]  # unanswered
        times = [t for _, _, t in invites]
        assert 0.18 < times[1] - times[0] < 0.26 and 0.38 < times[2] - times[1] < 0.46
        start, invite, offer = parse_sip(invites[0][0])
        assert start == f"INVITE sip:ivr@127.0.0.1:{uas.port} SIP/2.0"
        assert {parse_sip(data)[1]["via"][0] for data, _, _ in invites} == {invite["via"][0]}
        assert invite["cseq"] == ["1 INVITE"] and "tag=" in invite["from"][0]
        sdp = offer.decode()
        for line in ("m=audio", "RTP/AVP 0 101", "a=rtpmap:0 PCMU/8000", "a=fmtp:101 0-15"):
            assert line in sdp
        assert "a=rtpmap:101 telephone-event/8000" in sdp and "a=ptime:20" in sdp
        assert "a=sendrecv" in sdp
        source = invites[0][1]

        uas.send(reply(invite, "100 Trying"), source)
        uas.send(reply(invite, "180 Ringing", to_tag="peer1"), source)
        with pytest.raises(TimeoutError):
            await uas.recv(1.0)  # no retransmission (due at +1.4 s) once a provisional arrived
        contact = f"Contact: <sip:ivr@127.0.0.1:{uas.port}>"
        ok = reply(
            invite,
            "200 OK",
            to_tag="peer1",
            extra=(contact, "Content-Type: application/sdp"),
            body=answer_sdp(media.port),
        )
        uas.send(ok, source)
        ack1, _, _ = await uas.recv()
        await call
        ack_start, ack, _ = parse_sip(ack1)
        assert ack_start == f"ACK sip:ivr@127.0.0.1:{uas.port} SIP/2.0"
        assert ack["cseq"] == ["1 ACK"] and "tag=peer1" in ack["to"][0]
        assert ack["via"][0] != invite["via"][0]  # a 2xx ACK is its own transaction
        assert caller.status == 200 and caller.provisional == [100, 180]
        assert caller.invite_retransmits == 2
        assert caller.setup_ms is not None and 1500 < caller.setup_ms < 2500
        uas.send(ok, source)  # a retransmitted 200: the same ACK again
        assert (await uas.recv())[0] == ack1
        assert caller.final_retransmits == 1

        packets = [rtp_fields((await media.recv())[0]) for _ in range(10)]
        assert [p[0] for p in packets] == [True] + [False] * 9  # marker on the first only
        assert {p[1] for p in packets} == {0} and len({p[4] for p in packets}) == 1
        assert all(seq_diff(b[2], a[2]) == 1 for a, b in itertools.pairwise(packets))
        assert all(ts_diff(b[3], a[3]) == 160 for a, b in itertools.pairwise(packets))
        assert all(p[5] == b"\xff" * 160 for p in packets)

        while not media.queue.empty():
            media.queue.get_nowait()
        dtmf = asyncio.create_task(caller.send_dtmf("7", duration_ms=100))
        seen: list[tuple[bool, int, int, int, int, bytes]] = []
        while sum(1 for p in seen if p[1] == 101 and p[5][1] & 0x80) < 3:
            seen.append(rtp_fields((await media.recv())[0]))
        seen.append(rtp_fields((await media.recv())[0]))  # the audio that resumes
        pressed = await dtmf
        first = next(i for i, p in enumerate(seen) if p[1] == 101)
        events, resumed = seen[first:-1], seen[-1]
        assert events[0][0] and not any(p[0] for p in events[1:])  # marker on the start only
        assert all(p[1] == 101 for p in events) and resumed[1] == 0  # audio paused meanwhile
        assert {p[3] for p in events} == {events[0][3]}  # the event's start timestamp
        payloads = [struct.unpack("!BBH", p[5]) for p in events]
        assert [code for code, _, _ in payloads] == [7] * 7
        assert [flags >> 7 for _, flags, _ in payloads] == [0, 0, 0, 0, 1, 1, 1]
        assert [duration for _, _, duration in payloads] == [160, 320, 480, 640, 800, 800, 800]
        assert all(seq_diff(b[2], a[2]) == 1 for a, b in itertools.pairwise(seen))
        assert ts_diff(resumed[3], events[0][3]) == 7 * 160
        assert caller.dtmf_sent == [("7", pressed)]

        # RTP towards the caller is logged with its source.
        assert caller.local_rtp is not None
        speech = ulaw_encode(tone(0.02))
        for n in range(5):
            media.send(
                RtpPacket(0, 100 + n, 1000 + 160 * n, 42, speech).serialize(), caller.local_rtp
            )
        await until(lambda: caller.rtp.packets == 5 or None, 2, "our RTP at the caller")
        assert caller.rtp.sources == [("127.0.0.1", media.port)] and caller.rtp.lost == 0
        assert caller.first_audio_after(0) == caller.rtp.arrivals[0]

        hangup = asyncio.create_task(caller.hangup())
        bye1, _, t1 = await uas.recv()
        bye2, _, t2 = await uas.recv()  # unanswered: Timer E retransmits after T1
        assert bye1 == bye2 and 0.18 < t2 - t1 < 0.26
        bye_start, bye, _ = parse_sip(bye1)
        assert bye_start == f"BYE sip:ivr@127.0.0.1:{uas.port} SIP/2.0"
        assert bye["cseq"] == ["2 BYE"] and "tag=peer1" in bye["to"][0]
        uas.send(reply(bye, "200 OK"), source)
        assert await hangup == 200 and caller.hangup_status == 200
        while not media.queue.empty():
            media.queue.get_nowait()
        with pytest.raises(TimeoutError):
            await media.recv(0.1)  # our media stopped with the BYE
        assert caller.errors == []
    finally:
        await caller.aclose()
        uas.close()
        media.close()


async def test_setup_timeout_after_ringing_cancels_and_acks_the_487() -> None:
    uas = await Udp.open()
    caller = SipCaller()
    try:
        call = asyncio.create_task(caller.call(("127.0.0.1", uas.port), user="ivr", timeout_s=1))
        data, source, _ = await uas.recv()
        _, invite, _ = parse_sip(data)
        uas.send(reply(invite, "180 Ringing", to_tag="ring"), source)
        cancel_start, cancel, _ = parse_sip((await uas.recv(2))[0])
        assert cancel_start == f"CANCEL sip:ivr@127.0.0.1:{uas.port} SIP/2.0"
        assert cancel["via"] == invite["via"] and cancel["cseq"] == ["1 CANCEL"]
        uas.send(reply(cancel, "200 OK", to_tag="ring"), source)
        uas.send(reply(invite, "487 Request Terminated", to_tag="ring"), source)
        ack_start, ack, _ = parse_sip((await uas.recv())[0])
        # RFC 3261 17.1.1.3: same branch as the INVITE, the response's To tag.
        assert ack_start.startswith("ACK ") and ack["via"] == invite["via"]
        assert ack["cseq"] == ["1 ACK"] and "tag=ring" in ack["to"][0]
        with pytest.raises(CallTimeout):
            await call
        assert caller.status == 487 and caller.provisional == [180]
    finally:
        await caller.aclose()
        uas.close()


# --- sans-I/O: receive analysis ------------------------------------------------------------------

LOUD = ulaw_encode(tone(0.02))
QUIET = b"\xff" * 160


def feed(log: RtpReceiveLog, arrivals: list[float], payloads: list[bytes], **kw: Any) -> None:
    seq0 = kw.get("seq0", 65530)  # wraps during the run
    ts0 = kw.get("ts0", 2**32 - 800)
    for n, (arrival, payload) in enumerate(zip(arrivals, payloads, strict=True)):
        packet = RtpPacket(0, (seq0 + n) % 65536, (ts0 + 160 * n) % 2**32, 7, payload)
        log.record(packet.serialize(), ("127.0.0.1", 4000), arrival)


def test_jitter_and_loss_follow_rfc_3550() -> None:
    steady = RtpReceiveLog()
    feed(steady, [10 + 0.02 * n for n in range(100)], [QUIET] * 100)
    assert steady.jitter_ms == pytest.approx(0, abs=1e-6) and steady.lost == 0

    wobbly = RtpReceiveLog()
    feed(wobbly, [10 + 0.02 * n + (0.004 if n % 2 else 0) for n in range(400)], [QUIET] * 400)
    assert wobbly.jitter_ms == pytest.approx(4, rel=0.05)  # |D| = 4 ms on every packet

    lossy = RtpReceiveLog()
    for n in [*range(0, 10), *range(13, 20)]:  # 3 missing, across the 16-bit wrap
        packet = RtpPacket(0, (65530 + n) % 65536, 160 * n, 9, QUIET)
        lossy.record(packet.serialize(), ("127.0.0.1", 4000), 1 + 0.02 * n)
    assert lossy.lost == 3 and lossy.streams()[0].expected == 20


def test_first_audio_and_stream_stop_detection() -> None:
    log = RtpReceiveLog()
    # 10 silent, 20 loud, 3 silent (a 60 ms pause: not a stop), 10 loud, 20 silent.
    kinds = [QUIET] * 10 + [LOUD] * 20 + [QUIET] * 3 + [LOUD] * 10 + [QUIET] * 20
    arrivals = [100 + 0.02 * n for n in range(len(kinds))]
    feed(log, arrivals, kinds)
    first = log.first_audio_after(100)
    assert first is not None and first == pytest.approx(100.2)
    assert log.stream_stopped_after(first) == pytest.approx(100 + 0.02 * 43)
    assert log.first_audio_after(100 + 0.02 * 43) is None
    # Undecided while the silence is shorter than 100 ms, unless the observer's clock says so.
    assert log.stream_stopped_after(first, hold_s=1.0) is None
    assert log.stream_stopped_after(first, now=200, hold_s=1.0) == pytest.approx(100.86)

    stops = RtpReceiveLog()  # RTP itself stops after speech: stopped when the next was due
    feed(stops, [5 + 0.02 * n for n in range(10)], [LOUD] * 10)
    assert stops.stream_stopped_after(5, now=5.25) is None
    assert stops.stream_stopped_after(5, now=5.4) == pytest.approx(5.2)

    assert is_silent(b"\xff\x7f\xf0\x70" * 40) and not is_silent(b"\xff" * 159 + b"\xef")


def test_playout_model_counts_stalls_not_jitter_or_loss() -> None:
    log = RtpReceiveLog()
    payloads = [QUIET] * 5 + [LOUD] * 40
    arrivals = [50 + 0.02 * n for n in range(45)]
    arrivals[10] += 0.035  # jitter inside the 40 ms buffer: no gap
    for n in range(20, 45):
        arrivals[n] += 0.150  # a 150 ms stall at packet 20 ...
    for n in range(21, 25):
        arrivals[n] = arrivals[20] + 0.001 * (n - 20)  # ... then a burst that catches up
    feed(log, arrivals, payloads)
    stats = log.playout(50, 60)
    assert stats.start == pytest.approx(50.1)  # the clock starts at the first speech
    assert stats.gaps == 1 and stats.gap_ms == pytest.approx(110, abs=0.01)  # 150 - 40 buffer
    assert stats.max_gap_ms == pytest.approx(110, abs=0.01)
    assert stats.packets == 40 and stats.lost == 0 and stats.discarded == 0
    # The window's end is exclusive; a window of silence has no utterance.
    assert log.playout(50, 50.1).start is None

    holes = RtpReceiveLog()
    rows: list[tuple[int, float, int, int]] = []  # (seq, arrival, pt, ts)
    for n in range(20):
        if n in (5, 6):
            continue  # lost: concealed, not a gap
        rows.append((n, 0.02 * n, 0, 160 * n))
    rows.insert(8, (3, 0.185, 0, 480))  # a late duplicate: discarded
    rows += [(20 + k, 0.4 + 0.02 * k, 101, 3200) for k in range(5)]  # DTMF shares seq
    rows += [(25 + k, 0.5 + 0.02 * k, 0, 4000 + 160 * k) for k in range(5)]
    for seq, arrival, pt, ts in rows:
        payload = LOUD if pt == 0 else b"\x05\x0a\x00\xa0"
        holes.record(RtpPacket(pt, seq, ts, 3, payload).serialize(), ("h", 1), 10 + arrival)
    stats = holes.playout(10, 11)
    assert (stats.gaps, stats.lost, stats.discarded, stats.packets) == (0, 2, 1, 23)
    assert holes.lost == 1  # RFC 3550 A.3: expected - received, so the duplicate offsets one


def test_idle_fill_inside_an_utterance_is_a_dropout_the_caller_hears() -> None:
    """The gateway fills a beat it has nothing for with 0xFF: on time, but silence. Between two
    audio packets that is a gap (as long as the fill lasted); after the last one it is the
    utterance's end; quiet audio (a codec's noise floor) is audio, not fill."""
    log = RtpReceiveLog()
    hush = b"\xff\x7f\xfe\x7e" * 40  # near-silence of both signs: quiet audio, not fill
    payloads = [LOUD] * 5 + [QUIET] * 3 + [LOUD] * 5 + [hush] * 2 + [LOUD] * 3 + [QUIET] * 20
    feed(log, [20 + 0.02 * n for n in range(len(payloads))], payloads)
    stats = log.playout(20, 30)
    assert stats.gaps == 1 and stats.gap_ms == pytest.approx(60, abs=0.01)
    assert stats.max_gap_ms == pytest.approx(60, abs=0.01)
    assert list(log.fills[:9]) == [0] * 5 + [1] * 3 + [0]
    # Fill that also came late is one gap, as long as both: 2 beats of fill, then a stall.
    late = RtpReceiveLog()
    arrivals = [40 + 0.02 * n for n in range(12)]
    for n in range(6, 12):
        arrivals[n] += 0.1  # a 100 ms stall at the fill's second packet (40 ms buffered)
    feed(late, arrivals, [LOUD] * 5 + [QUIET] * 2 + [LOUD] * 5)
    stats = late.playout(40, 41)
    assert stats.gaps == 1 and stats.gap_ms == pytest.approx(40 + 60, abs=0.01)


# --- sans-I/O: pacing ---------------------------------------------------------------------------


async def test_pacer_measures_lateness_against_fixed_deadlines() -> None:
    now = [1000.0]
    overshoot = iter([0.0, 0.0012, 0.0, 0.025, 0.0003, 0.0, 0.0])
    slept: list[float] = []

    async def sleep(delay: float) -> None:
        slept.append(delay)
        now[0] += delay + next(overshoot)

    pacer = FramePacer(clock=lambda: now[0], sleep=sleep)
    pacer.start()
    woke = [await pacer.next() for _ in range(8)]
    lateness = list(pacer.stats.lateness_ms)
    # deadline n is 1000 + 0.02 n; the 25 ms stall makes deadline 5 already due (5 ms late).
    assert lateness == pytest.approx([0, 0, 1.2, 0, 25, 5, 0.3, 0], abs=1e-6)
    assert woke[-1] == pytest.approx(1000 + 0.02 * 7)  # no drift after the stall
    assert len(slept) == 6
    assert pacer.stats.histogram((1, 10)) == [("<1ms", 5), ("1-10ms", 2), (">=10ms", 1)]
    assert pacer.stats.max_ms == pytest.approx(25)
    assert pacer.stats.percentile(50) == 0  # nearest rank: the 4th of 8
    assert pacer.stats.percentile(75) == pytest.approx(1.2)
    assert pacer.stats.percentile(100) == pytest.approx(25)


# --- the gateway's parsers, as the phone uses them ------------------------------------------------


def test_sip_parser_reads_compact_folded_headers_and_round_trips() -> None:
    data = (
        b"SIP/2.0 200 OK\r\nv: SIP/2.0/UDP 127.0.0.1:5000;branch=z9hG4bKx,\r\n"
        b" SIP/2.0/UDP 10.0.0.1;branch=z9hG4bKy\r\nf: <sip:a@b>;tag=1\r\n"
        b't: "Bob, Jr" <sip:b@c;lr>;tag=2\r\ni: abc\r\nCSeq: 7 INVITE\r\n'
        b"Record-Route: <sip:p1;lr>, <sip:p2;lr>\r\nl: 4\r\n\r\nbodyEXTRA"
    )
    message = parse_message(data)
    assert isinstance(message, SipResponse)
    assert message.status == 200 and message.cseq == (7, "INVITE") and message.body == b"body"
    assert len(message.headers.get_all("via")) == 2
    assert message.headers.get_all("record-route") == ["<sip:p1;lr>", "<sip:p2;lr>"]
    again = parse_message(message.serialize())
    assert again.serialize() == message.serialize() and again.body == b"body"
    for bad in (b"SIP/2.0 20 OK\r\n\r\n", b"HELLO\r\n\r\n", b"INVITE x SIP/2.0\r\nVia: a\r\n\r\n"):
        with pytest.raises(SipParseError):
            parse_message(bad)


def test_sdp_answer_and_rtp_parsers() -> None:
    answer = read_answer(answer_sdp(4000).replace(b"a=sendrecv", b"a=sendonly"))
    assert (answer.address, answer.port, answer.audio_pt, answer.event_pt) == (
        "127.0.0.1",
        4000,
        0,
        101,
    )
    assert answer.direction == "sendonly" and answer.ptime == 20
    with pytest.raises(SdpError, match="rejected"):
        read_answer(answer_sdp(0))
    # CSRC, header extension and padding are skipped.
    data = bytes([0xB1, 0x80, 0, 5, 0, 0, 0, 9, 0, 0, 0, 1]) + b"\0\0\0\2"
    data += b"\xbe\xde\x00\x01" + b"\1\2\3\4" + b"\xaa\xbb" + b"\0\0\3"
    packet = RtpPacket.parse(data)
    assert (packet.marker, packet.payload_type, packet.sequence, packet.payload) == (
        True,
        0,
        5,
        b"\xaa\xbb",
    )
    with pytest.raises(RtpError):
        RtpPacket.parse(data[:-1] + b"\x40")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_parsers_accept_or_reject_any_bytes(data: bytes) -> None:
    for parse, error in (
        (parse_message, SipParseError),
        (read_answer, SdpError),
        (RtpPacket.parse, RtpError),
        (lambda d: RtpReceiveLog().record(d, ("127.0.0.1", 1), 0.0), RtpError),
    ):
        try:
            parse(data)
        except error:
            pass
