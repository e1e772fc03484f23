"""End of speech -> the recognised branch's first audio, through a real gateway (bench/asr.py).

A real ``gateway serve`` process (the quick start's: tiny model, prompts/demo.yaml, its prompt
cache, the recogniser GATEWAY_ASR names in its worker process) takes calls from the load simulator's
Twilio callers (webhook, Media Stream, 20 ms caller audio in real time). Each turn says
"repeat", "main menu" or "say that again" in one of several flite and espeak-ng voices while the
menu plays: the speech barges in, the gather recognises it, and the menu starts again from the
prompt cache. The caller measures from the end of its speech (the last frame of the recording,
its silence trimmed) to the first frame of the new menu; the baseline is the same menu turn by
key ("9") in the same gateway, measured from the key press. The gateway's own trace says what
it heard, when the speech ended by its detector and how many recognitions each turn cost.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "prompts" / "demo.yaml"

#: What the callers say: the demo menu's "repeat" phrases, in several voices.
PHRASES = ["repeat", "main menu", "say that again"]
VOICES = [("flite", "slt"), ("flite", "kal"), ("flite", "awb"), ("flite", "rms"),
          ("espeak-ng", "en-us"), ("espeak-ng", "en-gb-scotland")]


@dataclass
class GatewayTurns:
    """What the gateway-path run measured."""

    speech_ms: list[float] = field(default_factory=list)  # recognised turns only
    missed: int = 0  # speech turns not recognised as "repeat" (they heard the retry prompt)
    key_ms: list[float] = field(default_factory=list)
    #: From the gateway's trace: detector's end of speech -> decision (ms), recognitions.
    decision_ms: list[float] = field(default_factory=list)
    recognitions: list[int] = field(default_factory=list)
    heard: list[str] = field(default_factory=list)
    load: tuple[float, float, float] = (0.0, 0.0, 0.0)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _recordings(directory: Path) -> list[Path]:
    """One WAV per voice and phrase (synthesised once into ``directory``), voices alternating."""
    import soundfile as sf

    from gateway.asr.synth import SynthVoice, synthesize

    out = []
    for phrase in PHRASES:
        for engine, voice in VOICES:
            path = directory / f"{engine}-{voice}-{phrase.replace(' ', '_')}.wav"
            if not path.exists():
                audio = synthesize(phrase, SynthVoice(engine, voice))  # type: ignore[arg-type]
                level = 10 ** (-20 / 20) / max(float(np.sqrt(np.mean(audio**2))), 1e-9)
                sf.write(path, audio * level, 8000, subtype="PCM_16")
            out.append(path)
    return out


class _Gateway:
    """``gateway serve`` in a subprocess; its JSON log lines collected as they come."""

    def __init__(self, work: Path, asr: str = "auto") -> None:
        self.port = _free_port()
        env = {**os.environ, "GATEWAY_CACHE_DIR": str(work / "prompt-cache"),
               "GATEWAY_LOG_FORMAT": "json", "GATEWAY_MAX_CALLS": "32",
               "GATEWAY_DEVICE": "cpu", "GATEWAY_ASR": asr}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--insecure", "--model", "tiny",
             "--script", str(DEMO), "--port", str(self.port), "--host", "127.0.0.1"],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[dict[str, Any]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            try:
                self.lines.append(json.loads(line))
            except ValueError:
                continue

    def ready(self, timeout_s: float = 900.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the gateway exited ({self.proc.returncode}): "
                                   f"{[e.get('msg') for e in self.lines[-5:]]}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("the gateway did not become ready")

    def traces(self) -> list[dict[str, Any]]:
        return [e["trace"] for e in self.lines if e.get("msg") == "ivr trace"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def measure(turns: int, work: Path | None = None, think_s: float = 0.4,
            asr: str = "auto") -> GatewayTurns:
    """Run ``turns`` speech turns and as many key turns through a real gateway (see module),
    its recogniser chosen by ``asr`` (GATEWAY_ASR)."""
    from gateway.loadsim.runner import LoadConfig, run_level

    work = work or Path(tempfile.gettempdir()) / "qwen3-tts-gateway-bench-asr"
    (work / "speech").mkdir(parents=True, exist_ok=True)
    recordings = _recordings(work / "speech")
    gateway = _Gateway(work, asr)
    out = GatewayTurns()
    try:
        gateway.ready()
        per_call = 10
        for start in range(0, turns, per_call):
            says = [f"say:{recordings[(start + i) % len(recordings)]}"
                    for i in range(min(per_call, turns - start))]
            for digits, speech in ((says, True), (["9"] * len(says), False)):
                before = len(gateway.traces())
                config = LoadConfig(target=gateway.url, digits=digits, think_s=think_s,
                                    listen_s=0.3, duration_s=0.1, turn_timeout_s=15.0,
                                    caller_id="+15550001111")
                level = run_level(config, 1, 0)
                deadline = time.monotonic() + 10
                while len(gateway.traces()) <= before and time.monotonic() < deadline:
                    time.sleep(0.05)
                heard = [h for t in gateway.traces()[before:] for h in t["speech"]]
                call_turns = [t for c in level.calls for t in c.turns if t.kind != "answer"]
                if speech and len(heard) != len(call_turns):
                    # A turn the detector never heard as speech has no trace entry: the
                    # pairing by order below would be off, so the whole call counts as missed.
                    out.missed += len(call_turns)
                    continue
                if not speech:
                    out.key_ms += [t.first_audio_ms for t in call_turns
                                   if t.first_audio_ms is not None]
                    continue
                for i, turn in enumerate(call_turns):
                    entry = heard[i] if i < len(heard) else None
                    if entry is not None:
                        out.heard.append(f"{Path(turn.keys).stem}: {entry['result']} "
                                         f"{entry.get('branch')} ({entry['heard']!r})")
                        out.decision_ms.append(entry["decision_ms"])
                        out.recognitions.append(entry["recognitions"])
                    ok = entry is not None and entry["result"] == "match" and \
                        entry["branch"] == "menu" and turn.first_audio_ms is not None
                    if ok:
                        assert turn.first_audio_ms is not None
                        out.speech_ms.append(turn.first_audio_ms)
                    else:
                        out.missed += 1
        out.load = os.getloadavg()
    finally:
        gateway.stop()
    return out
