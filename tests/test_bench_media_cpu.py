"""``bench/media_cpu.py``'s baseline gateway still runs on today's modules.

The benchmark swaps the old per-frame functions into the live gateway modules, so a change of
an internal signature breaks the baseline silently: once, every baseline call died on a
TypeError in its first speech window and the figures compared against calls that never
completed. This runs those functions (restored afterwards) on the real detector and protocol.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

import gateway.app as app_module
import gateway.call.frames as call_frames
import gateway.call.inbound as inbound
import gateway.call.session as session
import gateway.twilio.protocol as protocol
from gateway.audio.g711 import ulaw_encode
from gateway.config import Settings

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).parent / "golden" / "twilio"


def _bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location("media_cpu", ROOT / "bench" / "media_cpu.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "media_cpu", module)  # its dataclasses look it up
    spec.loader.exec_module(module)
    return module


def test_the_benchmarks_old_per_frame_path_runs_on_todays_modules(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Everything _install_baseline replaces comes back after the test.
    for owner, name in ((app_module, "_detectors"), (inbound.InboundRate, "allow"),
                        (protocol.MediaStreamProtocol, "receive"),
                        (session.Call, "inbound_audio")):
        monkeypatch.setattr(owner, name, getattr(owner, name))
    monkeypatch.setattr(call_frames.PromptFrames, "frames", call_frames.PromptFrames.frames)
    _bench(monkeypatch)._install_baseline()

    # The old detector: the model on every window, line noise and a loud tone alike.
    factory = app_module._detectors(Settings())
    assert factory is not None
    detector = factory("pcmu")
    rng = np.random.default_rng(0)
    noise = ulaw_encode(rng.normal(0, 100, 8000).astype(np.int16))
    tone = ulaw_encode((16000 * np.sin(2 * np.pi * 300 * np.arange(8000) / 8000)).astype(np.int16))
    for audio in (noise, tone):
        for at in range(0, len(audio), 160):
            detector.push(audio[at:at + 160])
    assert detector.model_windows == 2 * 8000 // 256  # every 32 ms window (256 samples)

    # The old message path: pydantic for every message, media included.
    stream = protocol.MediaStreamProtocol()
    stream.receive((GOLDEN / "connected.json").read_text())
    stream.receive((GOLDEN / "start.json").read_text())
    media = stream.receive((GOLDEN / "media.json").read_text())
    assert isinstance(media, protocol.Media)
    payload = json.loads((GOLDEN / "media.json").read_text())["media"]["payload"]
    assert media.audio == base64.b64decode(payload)

    # Prompts encoded on every play; no inbound cap.
    cache = call_frames.PromptFrames()
    pcm = np.zeros(800, np.int16)
    frames = cache.frames(pcm, "pcmu")
    assert len(frames) == 5 and all(len(f) == 160 for f in frames)
    assert cache.frames(pcm, "pcmu") is not frames and len(cache) == 0
    bucket = inbound.InboundRate(1.0, 1.0)  # one message of burst: the second would be over
    assert bucket.allow(0.0) and bucket.allow(0.0)
