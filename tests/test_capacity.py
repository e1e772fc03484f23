"""One call budget per replica (GATEWAY_MAX_CALLS), enforced on both transports.

Twilio calls are admitted by the voice webhook, which holds a place until the Media Stream
connects; a caller beyond the budget hears the busy message and is hung up. A stream that
arrives without the webhook (TwiML served elsewhere) is admitted on its own, or closed with
1013 (and its after-stream says the busy message). SIP asks the same admission: an INVITE
beyond the budget gets 486, and an INVITE that is still ringing (GATEWAY_SIP_ANSWER_DELAY_MS)
holds its seat against Twilio callers too.
"""

from __future__ import annotations

import asyncio
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import local_http
import pytest
from clocks import until
from conftest import AUTH_TOKEN, LiveServer, serve
from sip_peers import run_sipp
from twilio.request_validator import RequestValidator
from twilio_client import FakeTwilioCall

from gateway.sip.message import SipResponse, parse_message

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def small(tiny_model_dir: Path) -> Iterator[LiveServer]:
    # A 30 s ring before answering: an INVITE stays between INVITE and answer until the test
    # CANCELs it (none of these tests lets a SIP call be answered).
    with serve({"model": str(tiny_model_dir), "max_calls": 2, "sip": "127.0.0.1:0",
                "sip_allow": "127.0.0.1/32", "sip_t1_ms": 100, "sip_answer_delay_ms": 30000,
                "rtp_ports": "25000-25099"}) as live:
        yield live


def _post(live: LiveServer, path: str, call_sid: str) -> ET.Element:
    url = f"{live.base_url}{path}"
    form = {"CallSid": call_sid, "From": "+15550001111", "To": "+15550002222"}
    signature = RequestValidator(AUTH_TOKEN).compute_signature(url, form)
    response = local_http.post(url, data=form, headers={"X-Twilio-Signature": signature},
                               timeout=10)
    assert response.status_code == 200
    return ET.fromstring(response.text)


def _voice(live: LiveServer, call_sid: str) -> ET.Element:
    return _post(live, "/twilio/voice", call_sid)


def _refused(live: LiveServer, reason: str) -> float:
    return live.gateway.metrics.calls_refused.labels("twilio", reason)._value.get()


def _call(live: LiveServer, n: int) -> FakeTwilioCall:
    return FakeTwilioCall(live.ws_url, AUTH_TOKEN, call_sid=f"CA{n:032d}",
                          stream_sid=f"MZ{n:032d}", playback_speed=20)


async def test_the_budget_is_shared_by_webhook_reservations_streams_and_sip(
    small: LiveServer, tmp_path: Path
) -> None:
    gateway = small.gateway
    first, second, third = (f"CA{n:032d}" for n in (1, 2, 3))
    assert _voice(small, first).find("Connect") is not None
    assert _voice(small, second).find("Connect") is not None
    # Two places held: the third caller is told and hung up, with no stream.
    busy = _voice(small, third)
    assert [child.tag for child in busy] == ["Say", "Hangup"]
    assert busy[0].text == gateway.settings.busy_message
    assert _refused(small, "at_capacity") == 1
    # SIP sees the budget taken by the reservations: 486.
    assert gateway.sip is not None and gateway.sip.local_addr is not None
    sip_target = gateway.sip.local_addr
    result = run_sipp("busy.xml", sip_target, workdir=tmp_path)
    assert result.ok, result.stdout[-2000:]

    async with _call(small, 1) as a, _call(small, 2) as b:
        await a.start()
        await b.start()
        await a.wait_for(lambda: a.events("media"), timeout=60)
        await b.wait_for(lambda: b.events("media"), timeout=60)
        assert gateway.registry.count("twilio") == 2 and not gateway.admission.reservations()
        # A stream nobody's webhook admitted, with the replica full: closed, try again later.
        async with _call(small, 4) as stray:
            await stray.start(stream_media=False)
            await stray.wait_for(lambda: stray.closed.is_set(), timeout=10)
            assert stray.close_code == 1013
        assert gateway.registry.count() == 2
        # Twilio then asks what next: the busy message, as if the webhook had refused.
        after = _post(small, "/twilio/after-stream", stray.call_sid)
        assert [(child.tag, child.text) for child in after] == [
            ("Say", gateway.settings.busy_message), ("Hangup", None)]
    # Both calls over: room again, for SIP too.
    await b.wait_for(lambda: gateway.registry.count() == 0, timeout=10)
    options = run_sipp("options.xml", sip_target, workdir=tmp_path)
    assert options.ok, options.stdout[-2000:]
    assert gateway.admission.free() == 2

    # What an operator scrapes: turns and first audio split by transport and source, refusals
    # by reason, the drain flag, GPU memory (0 here: no CUDA).
    metrics = local_http.get(f"{small.base_url}/metrics", timeout=5).text
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
               for line in metrics.splitlines() if line and not line.startswith("#")}
    # (No lines configured: every call is the default line's.)
    assert samples['gateway_turns_total{line="default",source="live",transport="twilio"}'] == 2
    assert samples['gateway_first_audio_seconds_count{line="default",source="live",'
                   'transport="twilio"}'] == 2
    assert samples['gateway_calls_refused_total{reason="at_capacity",transport="twilio"}'] == 2
    assert samples["gateway_draining"] == 0
    assert samples['gateway_gpu_memory_bytes{kind="allocated"}'] == 0


class RingingPhone:
    """A SIP phone on a UDP socket of 127.0.0.1 that INVITEs and, while it rings, CANCELs
    (RFC 3261 9.1: same Request-URI, Call-ID, From, To and Via branch as the INVITE; the
    INVITE then ends 487 and is ACKed, 17.1.1.3)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.call_id = uuid.uuid4().hex
        self.branch = "z9hG4bK" + uuid.uuid4().hex[:16]
        self.responses: asyncio.Queue[SipResponse] = asyncio.Queue()
        self._transport: asyncio.DatagramTransport | None = None
        self.port = 0
        self.to_tag: str | None = None
        #: The first response to the INVITE (:meth:`invite`).
        self.answer: SipResponse | None = None

    async def __aenter__(self) -> RingingPhone:
        loop = asyncio.get_running_loop()
        phone = self

        class Protocol(asyncio.DatagramProtocol):
            def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
                message = parse_message(data)
                if isinstance(message, SipResponse):
                    phone.responses.put_nowait(message)

        transport, _ = await loop.create_datagram_endpoint(Protocol,
                                                           local_addr=("127.0.0.1", 0))
        self._transport = transport
        self.port = transport.get_extra_info("sockname")[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._transport is not None:
            self._transport.close()

    def _request(self, method: str, cseq_method: str, body: str = "",
                 to_tag: str | None = None) -> bytes:
        host, port = self.target
        to = f"<sip:ivr@{host}:{port}>" + (f";tag={to_tag}" if to_tag else "")
        extra = (f"Contact: <sip:phone@127.0.0.1:{self.port}>\r\n"
                 "Content-Type: application/sdp\r\n" if body else "")
        return (f"{method} sip:ivr@{host}:{port} SIP/2.0\r\n"
                f"Via: SIP/2.0/UDP 127.0.0.1:{self.port};branch={self.branch};rport\r\n"
                f"Max-Forwards: 70\r\nFrom: <sip:phone@127.0.0.1>;tag=phone-{self.call_id[:8]}\r\n"
                f"To: {to}\r\nCall-ID: {self.call_id}\r\nCSeq: 1 {cseq_method}\r\n{extra}"
                f"Content-Length: {len(body)}\r\n\r\n{body}").encode()

    async def response(self, timeout: float = 10) -> SipResponse:
        return await asyncio.wait_for(self.responses.get(), timeout)

    async def invite(self) -> int:
        """Send the INVITE; the first response's status (100 Trying while it rings, or a final
        refusal such as 486 to :meth:`ack`)."""
        sdp = ("v=0\r\no=- 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
               f"m=audio {self.port + 1} RTP/AVP 0 101\r\na=rtpmap:0 PCMU/8000\r\n"
               "a=rtpmap:101 telephone-event/8000\r\na=fmtp:101 0-15\r\na=ptime:20\r\n")
        assert self._transport is not None
        self._transport.sendto(self._request("INVITE", "INVITE", sdp), self.target)
        response = await self.response()
        self.to_tag = response.to_tag
        self.answer = response
        return response.status

    def ack(self, status: int) -> None:
        """ACK a final non-2xx answer to the INVITE (17.1.1.3), so it is not retransmitted."""
        assert self._transport is not None and status >= 300
        self._transport.sendto(self._request("ACK", "INVITE", to_tag=self.to_tag), self.target)

    async def cancel(self) -> list[int]:
        """CANCEL the ringing INVITE; the statuses that follow (200 for the CANCEL, 487 for
        the INVITE, in either order), the 487 ACKed."""
        assert self._transport is not None
        self._transport.sendto(self._request("CANCEL", "CANCEL"), self.target)
        finals = []
        while len(finals) < 2:
            response = await self.response()
            if response.status >= 200:
                finals.append(response)
        for response in finals:
            if response.status == 487:
                self.to_tag = response.to_tag
                self.ack(487)
        return sorted(response.status for response in finals)


async def test_sip_calls_still_ringing_hold_seats_against_twilio_callers(
    small: LiveServer,
) -> None:
    """Between INVITE and answer (the 30 s ring) a SIP call holds its seat: with two ringing
    the Twilio webhook answers busy and a stream is refused; a CANCEL gives the seat back to
    Twilio, whose call then holds it against the next INVITE (486). Both transports together
    never exceed GATEWAY_MAX_CALLS."""
    gateway = small.gateway
    assert gateway.sip is not None and gateway.sip.local_addr is not None
    target = gateway.sip.local_addr
    admission = gateway.admission
    async with RingingPhone(target) as one, RingingPhone(target) as two:
        assert await one.invite() == 100 and await two.invite() == 100
        assert admission.seats("sip") == 2 and gateway.registry.count() == 0  # ringing only
        busy = _voice(small, f"CA{50:032d}")
        assert [child.tag for child in busy] == ["Say", "Hangup"]
        async with _call(small, 51) as stray:
            await stray.start(stream_media=False)
            await stray.wait_for(lambda: stray.closed.is_set(), timeout=10)
            assert stray.close_code == 1013
        assert await one.cancel() == [200, 487]
        await stray.wait_for(lambda: admission.seats("sip") == 1, timeout=10)
        assert _voice(small, f"CA{52:032d}").find("Connect") is not None
        async with _call(small, 52) as twilio_call:
            await twilio_call.start()
            await twilio_call.wait_for(lambda: gateway.registry.count("twilio") == 1, timeout=30)
            assert admission.seats() == 2
            async with RingingPhone(target) as three:
                refused = await three.invite()  # one ringing + one Twilio call: full
                assert refused == 486
                three.ack(refused)
            assert admission.seats() == 2
            assert await two.cancel() == [200, 487]
        await twilio_call.wait_for(lambda: admission.seats() == 0, timeout=10)


# Reservations lapsing and the order of refusal reasons are tested on a virtual clock in
# tests/test_call_lifecycle.py (a 30 s reservation there costs no real time).


async def test_sip_is_admitted_by_the_replicas_one_budget_alone(small: LiveServer) -> None:
    """One gate: the budget an operator (or the load simulator) sets on the replica's
    admission is the whole SIP budget. The SIP core once also refused at the
    ``GATEWAY_MAX_CALLS`` it was started with, so raising the budget at run time still turned
    the third INVITE away. A refusal is a 486 with Retry-After, counted once."""
    gateway = small.gateway
    assert gateway.sip is not None and gateway.sip.local_addr is not None
    target = gateway.sip.local_addr
    admission = gateway.admission
    refused = gateway.metrics.calls_refused.labels("sip", "at_capacity")
    saved = admission.max_calls
    admission.max_calls = 3
    try:
        async with RingingPhone(target) as one, RingingPhone(target) as two, \
                RingingPhone(target) as three, RingingPhone(target) as four:
            assert [await phone.invite() for phone in (one, two, three)] == [100, 100, 100]
            assert admission.seats("sip") == 3
            before = refused._value.get()
            assert await four.invite() == 486
            assert four.answer is not None and four.answer.headers.get("Retry-After") == "5"
            four.ack(486)
            assert refused._value.get() == before + 1
            for phone in (one, two, three):
                assert await phone.cancel() == [200, 487]
        await until(lambda: admission.seats() == 0, timeout=10, what="the seats given back")
    finally:
        admission.max_calls = saved
