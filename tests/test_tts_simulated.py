"""The simulated device (gateway/tts/simulated.py): its profile's times, its audio, a gateway on it.

The engine's waits go through an injected sleep here (recorded, not slept) wherever the time
model is what is checked; the gateway test runs it as the gateway does.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import AUTH_TOKEN, VirtualServer, on_virtual_time, serve_virtual
from twilio_client import FakeTwilioCall

from gateway.errors import ConfigError
from gateway.tts.engine import SAMPLES_PER_FRAME, SpeechRequest
from gateway.tts.service import SpeechService
from gateway.tts.simulated import DeviceProfile, SimulatedEngine, load_profile

FAST = DeviceProfile(name="fast", device="test device", model="none", source="a test",
                     step_base_ms=2.0, step_per_row_ms=0.5, step_per_row_key_ms=1.0,
                     prefill_base_ms=3.0, prefill_per_token_ms=0.1, decode_base_ms=1.0,
                     decode_per_row_frame_ms=0.25, max_rows=8)


def test_the_anchor_profile_loads_and_states_its_sources() -> None:
    profile = load_profile("h200-0.6b-anchors")
    assert "estimated" in profile.source and "not measured" in profile.device
    for key in ("step_base_ms", "step_per_row_ms", "step_per_row_key_ms", "prefill_base_ms",
                "decode_base_ms"):
        assert key in profile.notes
    # At 64 rows over 512 positions a step is well inside a frame's 80 ms.
    assert 5 < profile.step_ms(64, 512) < 20


def test_a_profile_file_round_trips_and_a_bad_one_is_a_clear_error(tmp_path: Path) -> None:
    measured = DeviceProfile(name="measured", device="gpu", model="m", source="bench",
                             step_base_ms=0.0, table={1: {256: 5.0, 512: 6.0},
                                                      8: {256: 7.0, 512: 9.0}})
    path = tmp_path / "measured.json"
    path.write_text(measured.to_json())
    loaded = load_profile(str(path))
    assert loaded == measured
    # Measured steps: the smallest bucket and length that hold the call, scaled past the last.
    assert loaded.step_ms(1, 200) == 5.0 and loaded.step_ms(3, 300) == 9.0
    assert loaded.step_ms(16, 512) == 18.0
    with pytest.raises(ConfigError, match=r"h200-0\.6b-anchors"):
        load_profile("no-such-profile")
    path.write_text(json.dumps({"name": "x"}))
    with pytest.raises(ConfigError, match=r"measured\.json"):
        load_profile(str(path))


def test_each_call_waits_as_long_as_the_profile_says() -> None:
    waits: list[float] = []
    engine = SimulatedEngine(FAST, max_rows=8, sleep=waits.append)
    rows = [engine.open(SpeechRequest(text="x" * 40, seed=i, max_frames=4, min_frames=4))
            for i in range(3)]
    assert rows[0].prompt_tokens == 20 + 10
    assert engine.prefill_rows(rows) == 90
    assert waits[-1] == pytest.approx((3.0 + 0.1 * 90) / 1000)
    assert engine.step(rows) == 4  # three rows run at the bucket of four
    # Attended: 30 prompt tokens + 0 frames + 1, rounded to the graph length 256.
    assert waits[-1] == pytest.approx((2.0 + 0.5 * 4 + 1.0 * 4 * 256 / 1000) / 1000)
    audio = engine.next_chunks(rows)  # first chunks: one frame each, decoded together
    assert [len(a) for a in audio if a is not None] == [SAMPLES_PER_FRAME] * 3
    assert waits[-1] == pytest.approx((1.0 + 0.25 * 3) / 1000)
    assert engine.device_s == pytest.approx(sum(waits))
    slower = FAST.scaled((4, 20.0))
    assert slower.step_ms(4, 512) == pytest.approx(20.0)
    assert slower.prefill_ms(10) == pytest.approx(FAST.prefill_ms(10) * 20.0 / FAST.step_ms(4, 512))


def test_its_audio_is_speech_like_continuous_and_the_same_for_the_same_seed() -> None:
    engine = SimulatedEngine(FAST, sleep=lambda _s: None, adaptive_chunks=False)

    def render(seed: int) -> list[np.ndarray]:
        return list(engine.stream(SpeechRequest(text="Hello there.", seed=seed, max_frames=15,
                                                min_frames=15)))

    chunks = render(3)
    assert [len(c) // SAMPLES_PER_FRAME for c in chunks] == [1, 2, 4, 8]
    audio = np.concatenate(chunks)
    rms_db = 20 * np.log10(np.sqrt(np.mean(audio**2)))
    assert -30 < rms_db < -15 and np.abs(audio).max() < 1.0
    # No click at chunk joins: the largest sample step is that of the signal itself.
    steps = np.abs(np.diff(audio))
    joins = np.cumsum([len(c) for c in chunks])[:-1]
    assert steps[joins - 1].max() <= 1.5 * np.percentile(steps, 99.9)
    assert np.array_equal(np.concatenate(render(3)), audio)
    assert not np.array_equal(np.concatenate(render(4)), audio)


async def test_the_engine_core_serves_turns_on_it() -> None:
    engine = SimulatedEngine(FAST, max_rows=4)
    service = SpeechService([engine])
    service.start()
    try:
        streams = [service.stream(SpeechRequest(text=f"Caller {i}.", seed=i, max_frames=6,
                                                min_frames=6)) for i in range(6)]
        async def drain(stream: object) -> list[np.ndarray]:
            return [chunk async for chunk in stream]  # type: ignore[attr-defined]

        outs = await asyncio.gather(*(drain(s) for s in streams))
        assert [sum(len(c) for c in out) for out in outs] == [6 * SAMPLES_PER_FRAME] * 6
        # Each stream was told when its next chunk would come: the profile's step times its
        # frames plus a decode, far less than the 80 ms a frame plays on this fast device.
        etas = [s.next_chunk_eta_s for s in streams]
        assert all(eta is not None for eta in etas[1:])
        assert all(0 < eta < 0.08 for eta in etas if eta is not None)
        assert service.stats.completed == 6 and max(service.stats.step_rows) >= 2
        assert engine.device_s > 0
    finally:
        service.stop()


@pytest.fixture(scope="module")
def simulated_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VirtualServer]:
    with serve_virtual({"engine": "simulated", "device_profile": "h200-0.6b-anchors",
                        "cache_dir": str(tmp_path_factory.mktemp("sim-cache"))}) as live:
        yield live


@on_virtual_time("simulated_gateway")
async def test_a_gateway_on_a_simulated_device_says_so_and_answers_a_call(
    simulated_gateway: VirtualServer,
) -> None:
    async with httpx.AsyncClient(base_url=simulated_gateway.base_url, timeout=10) as client:
        ready = (await client.get("/readyz")).json()
    assert ready["status"] == "ready" and ready["engine"].startswith("SIMULATED")
    async with FakeTwilioCall(simulated_gateway.ws_url, AUTH_TOKEN, call_sid="CA" + "5" * 32,
                              stream_sid="MZ" + "5" * 32) as call:
        await call.start()
        await call.wait_for(lambda: call.events("mark"), timeout=60)
        server_call = simulated_gateway.gateway.registry[call.call_sid]
        await call.send_dtmf("3")
        reply = await call.wait_for(
            lambda: len(server_call.utterances) > 1 and server_call.utterances[1], timeout=30)
        assert "three" in reply.text  # the greeter reads the key back in words
        await call.wait_for(
            lambda: [r for r in call.events("mark") if r.message["mark"]["name"] == reply.id],
            timeout=60)
        assert all(u.frames_sent > 0 for u in server_call.utterances)
        await call.send_stop()


def test_gateway_serve_on_a_simulated_device_needs_no_model_offline(tmp_path: Path) -> None:
    """The command an operator sizes with (bench/capacity_sim.py): no model to check or load,
    even with the hub unreachable."""
    import os
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "GATEWAY_ENGINE": "simulated", "HF_HUB_OFFLINE": "1",
           "GATEWAY_CACHE_DIR": str(tmp_path / "cache")}
    process = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--insecure",
                                "--host", "127.0.0.1", "--port", str(port)], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        ready = None
        while time.monotonic() < deadline and process.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
                    ready = json.loads(r.read())
                    if ready.get("status") == "ready":
                        break
            except OSError:
                time.sleep(0.2)
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        assert ready is not None and ready["engine"].startswith("SIMULATED")
    finally:
        process.terminate()
        process.wait(30)
