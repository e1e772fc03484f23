"""SIP media over real UDP on virtual time: hold, the send queue's bound, an RTP flood, digits.

The real :class:`~gateway.sip.endpoint.SipEndpoint` (127.0.0.1, ephemeral SIP port) answers the
load simulator's phone (its own SIP, SDP and RTP stack) inside a
:class:`virtual_time.VirtualTimeLoop`: phone, endpoint and the call's playout share virtual
time, so a 3 s hold passes in milliseconds and RTP timing is exact. The dialog plays a known
prompt (noise, so that every 20 ms frame is distinct) and waits: what the phone receives is
compared frame by frame with what was played.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

from gateway.audio.g711 import ulaw_encode
from gateway.call import Admission, Call, CallerHungUp, CallLifecycle, CallRegistry, Utterance
from gateway.call.inbound import BURST, MAX_RATE, InboundCap
from gateway.loadsim.sip_caller import CallFailed, SipCaller
from gateway.metrics import Metrics
from gateway.readiness import Readiness
from gateway.sip.digest import DigestAuthenticator
from gateway.sip.endpoint import MAX_DIGITS, RTP_PLAYOUT, SipEndpoint, SipMedia
from gateway.sip.rtp import RtpPacket, seq_diff, ts_diff
from gateway.sip.uas import UasConfig
from tests.support.clocks import LoopClock
from tests.support.servers import virtual_loop
from tests.support.waiting import until as _poll


def _prompt(seconds: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (6000 * rng.standard_normal(round(seconds * 8000))).astype(np.int16)


def _frames(pcm: np.ndarray) -> list[bytes]:
    data = ulaw_encode(pcm)
    return [data[i:i + 160] for i in range(0, len(data), 160)]


class Playing:
    """The dialog: play ``pcm`` once, then wait for the hang-up."""

    def __init__(self, pcm: np.ndarray) -> None:
        self.pcm = pcm
        self.calls: list[Call] = []
        self.utterances: list[Utterance] = []

    def for_call(self, call: Call) -> Any:
        self.calls.append(call)
        return self.run

    async def run(self, call: Call) -> None:
        self.utterances.append(call.play(self.pcm, label="prompt"))
        while not isinstance(await call.events.get(), CallerHungUp):
            pass


Scenario = Callable[[SipEndpoint, Metrics, Playing], Awaitable[None]]


def _run(scenario: Scenario, pcm: np.ndarray, ports: range, inbound: InboundCap | None = None,
         **options: Any) -> None:
    """Run ``scenario`` against a fresh endpoint whose calls play ``pcm``, on virtual time
    (``inbound``: the lifecycle's inbound cap; ``options``: more of :class:`SipEndpoint`'s
    keyword arguments)."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        clock = LoopClock(loop)
        metrics = Metrics()
        readiness = Readiness(metrics, clock)
        readiness.mark_ready("test")
        dialog = Playing(pcm)
        lifecycle = CallLifecycle(admission=Admission(4, readiness, clock, metrics),
                                  registry=CallRegistry(metrics), readiness=readiness,
                                  dialogs=dialog, clock=clock, metrics=metrics,
                                  inbound=inbound)
        endpoint = SipEndpoint(lifecycle, UasConfig(local_ip="127.0.0.1", local_port=0,
                                                    allow=["127.0.0.1/32"], t1=0.1),
                               metrics=metrics, rtp_ports=ports, **options)
        await endpoint.start("127.0.0.1", 0)
        try:
            await scenario(endpoint, metrics, dialog)
        finally:
            await endpoint.stop()
            await lifecycle.close_all()

    with virtual_loop() as loop:
        loop.run_until_complete(main())




def until(predicate: Callable[[], Any], timeout: float = 20.0) -> Awaitable[Any]:
    """:func:`clocks.until` every 10 ms of loop time (the RTP tests count frames)."""
    return _poll(predicate, timeout, every=0.01)


def _capture(phone: SipCaller) -> list[tuple[float, RtpPacket]]:
    """Every RTP packet the phone receives, with its arrival time."""
    packets: list[tuple[float, RtpPacket]] = []
    record = phone.rtp.record

    def capture(data: bytes, source: tuple[str, int], arrival: float) -> None:
        packets.append((arrival, RtpPacket.parse(data)))
        record(data, source, arrival)

    phone.rtp.record = capture  # type: ignore[method-assign]
    return packets


def _heard_all(packets: list[tuple[float, RtpPacket]], frames: list[bytes]) -> bool:
    payloads = [p.payload for _, p in packets]
    return frames[0] in payloads and len(payloads) >= payloads.index(frames[0]) + len(frames)


def _media(endpoint: SipEndpoint) -> SipMedia:
    return next(iter(endpoint.media.values()))


def test_on_hold_nothing_is_lost_nor_played_and_rtp_time_runs_on() -> None:
    """A caller holds 1 s into a 4 s prompt for 3 s, then resumes. Before, the queued frames
    were discarded and reported as played (the IVR went on as if the caller had heard the
    prompt), and the timestamp stood still across the hold. Now: nothing is sent nor reported
    while held; on resume the caller hears the rest of the prompt, every frame of it in order;
    the first packet after the hold carries the next sequence number, the marker bit and a
    timestamp advanced by the time the hold took (RFC 3550 5.1, RFC 3551 4.1)."""
    pcm = _prompt(4.0)
    frames = _frames(pcm)

    async def scenario(endpoint: SipEndpoint, metrics: Metrics, dialog: Playing) -> None:
        assert endpoint.local_addr is not None
        loop = asyncio.get_running_loop()
        async with SipCaller(clock=LoopClock(loop), t1=0.1) as phone:
            packets = _capture(phone)
            await phone.call(endpoint.local_addr, user="ivr")
            prompt = await until(lambda: dialog.utterances and dialog.utterances[0])
            await until(prompt.started.is_set)
            await asyncio.sleep(1.0)  # the caller hears a second of it
            assert await phone.hold() == 200
            media = _media(endpoint)
            assert media.on_hold
            heard, released = len(packets), prompt.frames_sent
            assert 40 <= released <= 60
            await asyncio.sleep(3.0)  # on hold
            assert len(packets) == heard, "RTP sent while on hold"
            assert not prompt.played.is_set(), "reported as played while the caller held"
            assert prompt.frames_sent == released
            assert await phone.resume() == 200
            await asyncio.wait_for(prompt.played.wait(), 10)
            assert prompt.frames_sent == len(frames) and not prompt.interrupted
            await until(lambda: _heard_all(packets, frames))  # the last packet's flight

        payloads = [p.payload for _, p in packets]
        start = payloads.index(frames[0])
        assert payloads[start:start + len(frames)] == frames, "the caller missed audio"
        # The packet stream, silence before and after the prompt included: every packet the next
        # in sequence, 20 ms of timestamp after its predecessor, except across the hold.
        before, after = packets[heard - 1], packets[heard]
        for (_, a), (_, b) in itertools.pairwise(packets):
            assert seq_diff(b.sequence, a.sequence) == 1
            if b is not after[1]:
                assert ts_diff(b.timestamp, a.timestamp) == 160 and not b.marker
        assert after[1].marker
        held_s = after[0] - before[0]
        stamped_s = ts_diff(after[1].timestamp, before[1].timestamp) / 8000
        print(f"\nhold: {held_s:.3f} s between packets, timestamp advanced {stamped_s:.3f} s")
        # Virtual time: the handshakes take none, so a resume that lands on the pacer's 20 ms
        # grid gives exactly the 3 s the caller held, and never less.
        assert 3.0 <= held_s < 3.2
        assert abs(stamped_s - held_s) <= 0.021  # within a frame of the sampling clock

    _run(scenario, pcm, range(27400, 27420))


def test_a_whole_prompt_is_fed_to_the_wire_as_it_plays_not_queued() -> None:
    """A 10 s cached prompt used to be queued whole (500 frames) in the call's RTP send queue;
    now no more than a second of it is queued ahead of the wire at any time, and the caller
    still gets every frame, in order, one per 20 ms."""
    pcm = _prompt(10.0, seed=1)
    frames = _frames(pcm)

    async def scenario(endpoint: SipEndpoint, metrics: Metrics, dialog: Playing) -> None:
        assert endpoint.local_addr is not None
        loop = asyncio.get_running_loop()
        async with SipCaller(clock=LoopClock(loop), t1=0.1) as phone:
            packets = _capture(phone)
            await phone.call(endpoint.local_addr, user="ivr")
            prompt = await until(lambda: dialog.utterances and dialog.utterances[0])
            call = dialog.calls[0]
            most = 0
            while not prompt.played.is_set():
                most = max(most, call.playout.buffered)
                await asyncio.sleep(0.02)
            print(f"\n10 s prompt over RTP: at most {most} frames queued "
                  f"(bound {RTP_PLAYOUT.buffer_frames})")
            assert 0 < most <= RTP_PLAYOUT.buffer_frames
            await until(lambda: _heard_all(packets, frames))  # the last packet's flight
        payloads = [p.payload for _, p in packets]
        start = payloads.index(frames[0])
        assert payloads[start:start + len(frames)] == frames
        arrivals = [at for at, _ in packets[start:start + len(frames)]]
        assert np.allclose(np.diff(arrivals), 0.02, atol=0.002)

    _run(scenario, pcm, range(27420, 27440))


@pytest.mark.parametrize(("rate", "burst"), [(MAX_RATE, BURST), (60.0, 50.0)],
                         ids=["default cap", "configured cap"])
def test_an_rtp_flood_is_dropped_unread_and_counted_and_a_normal_stream_never_is(
        rate: float, burst: float) -> None:
    """The phone's own 50 packets a second for 5 s: nothing dropped. Then 3,000 packets at once
    from its RTP socket: at most the burst allowance and the cap's rate get through to the
    call, the rest are dropped before parsing and counted; the call goes on. The cap is the
    endpoint's (``GATEWAY_INBOUND_MEDIA_RATE`` / ``_BURST``), the defaults or lower ones."""
    async def scenario(endpoint: SipEndpoint, metrics: Metrics, dialog: Playing) -> None:
        assert endpoint.local_addr is not None
        loop = asyncio.get_running_loop()
        async with SipCaller(clock=LoopClock(loop), t1=0.1) as phone:
            await phone.call(endpoint.local_addr, user="ivr")
            media = await until(lambda: endpoint.media and _media(endpoint))
            await asyncio.sleep(5.0)
            assert media.stats.received >= 240 and media.stats.flooded == 0
            transport, remote = phone._rtp_transport, phone.remote_rtp
            assert transport is not None and remote is not None
            flood = RtpPacket(0, 1, 1, 0x1234, b"\xff" * 160).serialize()
            received, t0 = media.stats.received, loop.time()
            for sent in range(1, 31):
                # In bursts the kernel's receive buffer holds; each read before the next.
                for _ in range(100):
                    transport.sendto(flood, remote)
                await until(lambda sent=sent: media.stats.received + media.stats.flooded
                             >= received + 100 * sent)
            elapsed = loop.time() - t0
            through = media.stats.received - received
            dropped = metrics.registry.get_sample_value(
                "gateway_inbound_media_dropped_total", {"transport": "sip"})
            print(f"\nRTP flood: {media.stats.flooded} dropped, {through} through in "
                  f"{elapsed:.2f} s of loop time")
            assert (media.rate.rate, media.rate.burst) == (rate, burst)
            assert dropped == media.stats.flooded >= 3000 - burst - rate * elapsed
            assert through <= burst + rate * elapsed + 1
            assert not dialog.calls[0].ended and endpoint.media

    _run(scenario, _prompt(0.2), range(27440, 27460), inbound=InboundCap(rate, burst))


def test_a_call_keeps_its_latest_digits_and_counts_them_all() -> None:
    """A caller pressing keys for the whole call: the RTP statistics keep the latest
    :data:`MAX_DIGITS` (they used to keep every one) and count all of them."""
    keys = "0123456789*#" * 6

    async def scenario(endpoint: SipEndpoint, metrics: Metrics, dialog: Playing) -> None:
        assert endpoint.local_addr is not None
        loop = asyncio.get_running_loop()
        async with SipCaller(clock=LoopClock(loop), t1=0.1) as phone:
            await phone.call(endpoint.local_addr, user="ivr")
            media = await until(lambda: endpoint.media and _media(endpoint))
            for key in keys:
                await phone.send_dtmf(key, duration_ms=60)
            await until(lambda: media.stats.digits_received == len(keys))
            assert list(media.stats.digits) == list(keys[-MAX_DIGITS:])

    _run(scenario, _prompt(0.2), range(27460, 27480))


def test_a_gateway_that_asks_for_credentials_gets_them_from_the_phone() -> None:
    """Digest over real UDP (RFC 3261 22.2): the endpoint challenges the INVITE with 401, the
    phone ACKs it and sends the INVITE again with credentials; without any, the 401 fails the
    call, clearly."""

    async def scenario(endpoint: SipEndpoint, metrics: Metrics, dialog: Playing) -> None:
        assert endpoint.local_addr is not None
        loop = asyncio.get_running_loop()
        clock = LoopClock(loop)
        endpoint.core.config.authenticator = DigestAuthenticator("ivr", {"trunk": "s3cret"},
                                                                 b"k" * 32)
        async with SipCaller(clock=clock, t1=0.1) as stranger:
            with pytest.raises(CallFailed) as failed:
                await stranger.call(endpoint.local_addr, user="ivr")
            assert (failed.value.status, failed.value.reason) == (401, "Unauthorized")
            assert not failed.value.refused and stranger.errors == []
        async with SipCaller(clock=clock, t1=0.1, username="trunk", password="s3cret") as phone:
            await phone.call(endpoint.local_addr, user="ivr")
            assert phone.status == 200 and phone.errors == []
            await until(lambda: dialog.utterances)
            assert await phone.hangup() == 200
        assert endpoint.core.stats["challenged"] == 2

    _run(scenario, _prompt(1.0), range(27480, 27500))
