"""Graceful drain on SIGTERM, with real calls in flight on both transports.

The gateway runs as its own process (``python -m gateway serve``), as in a container, and gets
a real SIGTERM: ``/readyz`` must turn 503 at once, new calls must be refused (Twilio: the busy
message then hang-up; SIP: 503 to INVITE and OPTIONS), active calls must carry on (a DTMF still
gets its spoken answer; the SIP caller's own BYE is answered), and the process must exit 0
once the last call ends, or when the grace period is over.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from tests.support import local_http
from tests.support.gateway_process import GatewayProcess
from tests.support.metrics import metric
from tests.support.sip_peers import run_sipp
from tests.support.twilio_client import FakeTwilioCall
from tests.support.waiting import until_in_thread

pytestmark = pytest.mark.slow


def _sip_options(port: int, timeout: float = 3.0) -> int:
    """Send one OPTIONS over UDP; the status code of the answer."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.settimeout(timeout)
        local = sock.getsockname()[1]
        branch = "z9hG4bK" + uuid.uuid4().hex[:12]
        message = (
            f"OPTIONS sip:ivr@127.0.0.1:{port} SIP/2.0\r\n"
            f"Via: SIP/2.0/UDP 127.0.0.1:{local};branch={branch}\r\n"
            f"From: <sip:probe@127.0.0.1>;tag={uuid.uuid4().hex[:8]}\r\n"
            f"To: <sip:ivr@127.0.0.1:{port}>\r\n"
            f"Call-ID: {uuid.uuid4().hex}\r\n"
            "CSeq: 1 OPTIONS\r\nMax-Forwards: 70\r\nContent-Length: 0\r\n\r\n"
        )
        sock.sendto(message.encode(), ("127.0.0.1", port))
        data, _ = sock.recvfrom(65536)
        return int(data.split(b" ", 2)[1])


def _active_calls(gateway: GatewayProcess) -> float:
    return metric(gateway.base_url, "gateway_calls_active", default=0.0)


def _call(gateway: GatewayProcess, n: int) -> FakeTwilioCall:
    return FakeTwilioCall(gateway.ws_url, "unused", call_sid=f"CA{n:032d}",
                          stream_sid=f"MZ{n:032d}", sign=False, playback_speed=4)


async def test_sigterm_drains_active_calls_and_refuses_new_ones(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    gateway = GatewayProcess(tiny_model_dir, tmp_path, sip=True,
                             env={"GATEWAY_DRAIN_GRACE_S": "60"})
    timeline: list[tuple[float, str]] = []
    with gateway:
        await asyncio.to_thread(gateway.wait_ready)
        async with _call(gateway, 1) as call:
            await call.start()
            await call.wait_for(lambda: call.events("media"), timeout=60)
            # A SIP call that stays up 8 s, then hangs up itself (its BYE must get 200).
            sip: dict[str, Any] = {}
            sipp = threading.Thread(target=lambda: sip.update(result=run_sipp(
                "hold_open.xml", ("127.0.0.1", gateway.sip_port or 0), workdir=tmp_path,
                timeout_s=60)))
            sipp.start()
            await until_in_thread(lambda: _active_calls(gateway) == 2, 20, "two active calls")

            t0 = time.monotonic()
            gateway.signal(signal.SIGTERM)
            timeline.append((0.0, "SIGTERM"))

            await until_in_thread(
                lambda: local_http.get(f"{gateway.base_url}/readyz", timeout=2).status_code == 503,
                5, "/readyz 503")
            timeline.append((time.monotonic() - t0, "/readyz 503"))
            ready = local_http.get(f"{gateway.base_url}/readyz", timeout=2).json()
            assert ready["status"] == "draining"

            # A new Twilio call: the busy message, then hang-up; no stream.
            twiml = local_http.post(f"{gateway.base_url}/twilio/voice",
                                    data={"CallSid": "CA" + "9" * 32, "From": "+15550001111"},
                                    timeout=5)
            root = ET.fromstring(twiml.text)
            assert [child.tag for child in root] == ["Say", "Hangup"], twiml.text
            assert "busy" in (root[0].text or "")
            timeline.append((time.monotonic() - t0, "new Twilio call: busy TwiML"))
            # A new SIP call and a proxy's probe: 503.
            assert gateway.sip_port is not None
            assert await asyncio.to_thread(_sip_options, gateway.sip_port) == 503
            refused = await asyncio.to_thread(
                run_sipp, "draining.xml", ("127.0.0.1", gateway.sip_port), workdir=tmp_path)
            assert refused.ok, refused.stdout[-2000:]
            timeline.append((time.monotonic() - t0, "SIP OPTIONS 503, new INVITE 503"))

            # The call in flight carries on: a key press still gets its spoken answer.
            before = len(call.events("media"))
            pressed = await call.send_dtmf("7")
            await call.wait_for(lambda: len(call.events("media")) > before + 5, timeout=30)
            timeline.append((time.monotonic() - t0, "active Twilio call answered a DTMF"))
            assert gateway.proc is not None and gateway.proc.poll() is None
            assert not call.closed.is_set()
            answer_at = next(r.at for r in call.events("media")[before:] if r.at >= pressed)
            assert answer_at > pressed

            await asyncio.to_thread(sipp.join, 60)
            assert sip["result"].ok, sip["result"].stdout[-3000:]  # BYE answered: not cut
            timeline.append((time.monotonic() - t0, "SIP call ended by its caller"))
            assert gateway.proc.poll() is None  # the Twilio call is still up
            await call.send_stop()
            ended = time.monotonic()
            timeline.append((ended - t0, "Twilio call ended by its caller"))

        code = await asyncio.to_thread(gateway.wait_exit, 20)
        exited = time.monotonic()
        timeline.append((exited - t0, f"process exited {code}"))
    print("\ndrain timeline:\n" + "\n".join(f"  t={t:6.2f} s  {what}" for t, what in timeline))
    assert code == 0, gateway.log()
    assert exited - ended < 3.0, "the process should exit right after its last call"
    log = gateway.log()
    assert "draining" in log and "drained" in log


async def test_grace_period_over_hangs_up_and_exits(tiny_model_dir: Path, tmp_path: Path) -> None:
    grace = 2.0
    gateway = GatewayProcess(tiny_model_dir, tmp_path, env={"GATEWAY_DRAIN_GRACE_S": str(grace),
                                                            "GATEWAY_LOG_FORMAT": "json"})
    with gateway:
        await asyncio.to_thread(gateway.wait_ready)
        async with _call(gateway, 2) as call:
            await call.start()
            await call.wait_for(lambda: call.events("media"), timeout=60)
            t0 = time.monotonic()
            gateway.signal(signal.SIGTERM)
            await asyncio.wait_for(call.closed.wait(), grace + 10)
            cut = time.monotonic() - t0
        code = await asyncio.to_thread(gateway.wait_exit, 20)
        exited = time.monotonic() - t0
    print(f"\ngrace {grace} s: call hung up at t={cut:.2f} s, process exited {code} at "
          f"t={exited:.2f} s")
    assert code == 0, gateway.log()
    assert grace - 0.1 <= cut <= grace + 2.0
    assert call.close_code == 1000  # a hang-up, not a crash
    # JSON logs: every record is one object; the call's records carry its id.
    records = [json.loads(line) for line in gateway.log_path.read_text().splitlines()
               if line.startswith("{")]
    assert any(r["msg"].startswith("drain grace over: hanging up 1 call") for r in records)
    call_records = [r for r in records if r.get("call_id") == call.call_sid]
    assert any("stream" in r["msg"] and "started" in r["msg"] for r in call_records)
    assert any(r["logger"] == "uvicorn.error" for r in records)  # uvicorn's too


async def test_second_signal_stops_at_once(tiny_model_dir: Path, tmp_path: Path) -> None:
    # Started as a container starts it (`python -m gateway serve`, not forked from the tests'
    # zygote), so the interpreter's own shutdown is part of what exits cleanly.
    gateway = GatewayProcess(tiny_model_dir, tmp_path, env={"GATEWAY_DRAIN_GRACE_S": "60"},
                             exec_=True)
    with gateway:
        await asyncio.to_thread(gateway.wait_ready)
        async with _call(gateway, 3) as call:
            await call.start()
            await call.wait_for(lambda: call.events("media"), timeout=60)
            gateway.signal(signal.SIGTERM)
            await until_in_thread(
                lambda: local_http.get(f"{gateway.base_url}/readyz", timeout=2).status_code == 503,
                5, "/readyz 503")
            assert gateway.proc is not None and gateway.proc.poll() is None  # draining
            t0 = time.monotonic()
            gateway.signal(signal.SIGTERM)
            code = await asyncio.to_thread(gateway.wait_exit, 15)
            stopped = time.monotonic() - t0
            log = gateway.log()
    print(f"\nsecond SIGTERM: exited in {stopped:.2f} s")
    assert stopped < 8.0
    # Stopped cleanly: the application's shutdown ran (uvicorn's force exit skipped it, and the
    # cancelled lifespan logged a traceback).
    assert code == 0 and "Traceback" not in log, log
    assert "Application shutdown complete" in log, log
