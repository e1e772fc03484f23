"""Voice agents: what streaming a bot's text into the engine buys, and what the rest costs.

A real ``gateway serve`` (a subprocess: the tiny model on this CPU, then the simulated device
of ``GATEWAY_DEVICE_PROFILE``) runs a lines file whose lines hand calls to a bot over the
ConversationRelay-compatible WebSocket, one line per way of speaking the bot's text:

- ``stream``: each word reaches the running engine turn as soon as it is complete (Qwen3-TTS's
  streaming-text mode, ``text_mode: stream``);
- ``sentence``: a sentence at a time, spoken whole once its end arrived (``text_mode:
  sentence``: what voice-agent platforms do today);
- ``whole``: the bot sends its whole answer in one message once its LLM has finished.

The bot is in this process (a websockets server): on each key it "generates" a 158-character
answer (:data:`ANSWER`) at ``--token-rate`` tokens a second (tokens of at most 4 characters,
an English LLM's) and records when its first token came. The callers are the load simulator's
SIP phones, also in this process, so the caller's first audio (the first speech packet after
the key) and the bot's first token are on one clock. Measured:

1. **The bot's first token -> the caller's first audio**, for the three ways, at 1, 4 and 8
   concurrent agent calls, on each engine. The ratio ``stream / whole`` (and ``stream /
   sentence``) in the same run is the RESULT: the machine is shared, absolute times move.
2. **The caller's end of speech -> the bot's ``prompt``** (the end-of-speech silence plus the
   recogniser: Whisper tiny.en where it is installed), and the round trip to first audio with a
   bot that answers at once.
3. **Interrupt**: the caller's key -> their audio turns silent (the RTP stream), and speech ->
   silent; the ``durationUntilInterruptMs`` the bot is told against what the caller's phone
   really received.
4. **What was heard, in words** (``utteranceUntilInterrupt``): the estimator of
   :mod:`gateway.bot.talk` against speech with known word timings (flite speaks each word of a
   sentence alone; the words laid end to end give each word's end), cut at every 100 ms: the
   words reported against the words whose audio had ended, for a finished answer (its audio's
   length known) and for one still being generated (read at the usual pace).
5. **Text slower than the talker reads it** (:func:`slow_text`, in this process, virtual time):
   the answer's text arriving at multiples of the rate the talker reads it (one text token an
   80 ms frame), released as the bot path releases it: the text underruns, the silence the
   caller hears, and that the codes are those of the text given whole.

    .venv/bin/python bench/bot_relay.py                 # everything (~8 minutes here)
    .venv/bin/python bench/bot_relay.py --quick         # 1 and 4 calls, fewer rounds
    .venv/bin/python bench/bot_relay.py --engines simulated --levels 1,4,8,16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.audio.pacer import Pacer  # noqa: E402
from gateway.clock import SystemClock  # noqa: E402
from gateway.loadsim.agent import tokens  # noqa: E402

#: The bot's answer: a first sentence of 109 characters (35 tokens: 0.9 s of an LLM at 40
#: tokens a second), as an LLM's answers often start, then a short one. A sentence-at-a-time
#: gateway waits for the whole first sentence; a short first sentence would hide the difference.
ANSWER = ("I can see that your last payment of $42.10 arrived on December 3rd, so your "
          "account is completely up to date. Nothing else is due until the end of next month.")

MODES = ("stream", "sentence", "whole")
NUMBERS = {"stream": "3001", "sentence": "3002", "whole": "3003"}

SCRIPT = """name: Bench agent ({mode})
voice: {{speaker: ryan, language: English}}
start: agent
error: sorry
nodes:
  agent:
    bot:
      url: ws://127.0.0.1:{bot_port}/relay
      dtmf_detection: true
      text_mode: {text_mode}
      parameters: {{mode: {mode}}}
      timeout: 20s
      end_of_speech: {eos}s
    next: bye
  bye:
    hangup: true
  sorry:
    hangup: true
"""


def _free_port(kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _pct(values: list[float], p: float) -> float:
    return float(np.percentile(values, p)) if values else float("nan")


# --- the bot -------------------------------------------------------------------------------------


@dataclass
class _Call:
    mode: str = "stream"
    first_tokens: list[float] = field(default_factory=list)
    prompts: list[tuple[float, str]] = field(default_factory=list)
    interrupts: list[tuple[float, dict[str, Any]]] = field(default_factory=list)


class BenchBot:
    """Answers keys with a streamed answer (by the call's mode) and prompts at once."""

    def __init__(self, rate: float, answer: str = ANSWER) -> None:
        self.rate = rate
        self.answer = answer
        self.calls: dict[str, _Call] = {}
        self.port = _free_port()
        self._server: Any = None

    async def start(self) -> None:
        from websockets.asyncio.server import serve

        self._server = await serve(self._session, "127.0.0.1", self.port)

    async def stop(self) -> None:
        self._server.close()
        await self._server.wait_closed()

    def call(self, sip_call_id: str) -> _Call:
        return self.calls[f"sip-{sip_call_id}"]

    async def _session(self, ws: Any) -> None:
        import websockets

        call: _Call | None = None
        task: asyncio.Task[None] | None = None
        try:
            async for raw in ws:
                message = json.loads(raw)
                kind = message["type"]
                now = time.monotonic()
                if kind == "setup":
                    call = self.calls.setdefault(message["callSid"], _Call())
                    call.mode = message["customParameters"].get("mode", "stream")
                elif call is None:
                    continue
                elif kind == "dtmf":
                    # Key 1 asks for an answer; the others only cut the bot off (an answer to
                    # them would start new audio right after the cut, hiding the silence).
                    if message["digit"] == "1":
                        if task is not None:
                            task.cancel()
                        task = asyncio.create_task(self._answer(ws, call, self.rate))
                elif kind == "prompt":
                    call.prompts.append((now, message["voicePrompt"]))
                    if "balance" in message["voicePrompt"].lower():
                        if task is not None:
                            task.cancel()
                        # A bot that answers at once: its whole answer, now.
                        task = asyncio.create_task(self._answer(ws, call, None))
                elif kind == "interrupt":
                    call.interrupts.append((now, message))
                    if task is not None:
                        task.cancel()
        except websockets.ConnectionClosed:
            pass

    async def _answer(self, ws: Any, call: _Call, rate: float | None) -> None:
        pieces = tokens(self.answer)
        start = time.monotonic()
        call.first_tokens.append(start)
        if rate is None:
            await ws.send(json.dumps({"type": "text", "token": self.answer, "last": True}))
            return
        if call.mode == "whole":
            # The LLM writes the whole answer first; then it goes in one message.
            await asyncio.sleep(max(0.0, start + (len(pieces) - 1) / rate - time.monotonic()))
            await ws.send(json.dumps({"type": "text", "token": self.answer, "last": True}))
            return
        # Token i at start + i / rate (the simulator's agent bot keeps its rate the same way).
        pacer = Pacer(SystemClock(), frame_s=1.0 / rate, max_lag_frames=None)
        pacer.start(start)
        for i, piece in enumerate(pieces):
            await pacer.wait()
            await ws.send(json.dumps({"type": "text", "token": piece,
                                      "last": i == len(pieces) - 1}))


# --- the gateway ---------------------------------------------------------------------------------


class Gateway:
    def __init__(self, engine: str, bot_port: int, work: Path, eos_s: float) -> None:
        self.sip_port = _free_port(socket.SOCK_DGRAM)
        self.http_port = _free_port()
        lines: dict[str, Any] = {"default": "stream", "lines": {}}
        for mode in MODES:
            text_mode = "sentence" if mode == "sentence" else "stream"
            (work / f"{mode}.yaml").write_text(SCRIPT.format(
                mode=mode, bot_port=bot_port, text_mode=text_mode, eos=eos_s))
            lines["lines"][mode] = {"script": f"{mode}.yaml", "numbers": [NUMBERS[mode]]}
        (work / "lines.yaml").write_text(json.dumps(lines))
        env = {**os.environ, "GATEWAY_LINES": str(work / "lines.yaml"),
               "GATEWAY_SIP": f"127.0.0.1:{self.sip_port}", "GATEWAY_SIP_ALLOW": "127.0.0.1/32",
               "GATEWAY_RTP_PORTS": "29000-29999", "GATEWAY_MAX_CALLS": "64",
               "GATEWAY_CACHE_DIR": str(work / "cache"), "GATEWAY_DEVICE": "cpu"}
        if engine == "simulated":
            env["GATEWAY_ENGINE"] = "simulated"
        self.log = open(work / f"gateway-{engine}.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--insecure", "--model", "tiny",
             "--host", "127.0.0.1", "--port", str(self.http_port)],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    async def ready(self, timeout_s: float = 900.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient() as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the gateway exited: see {self.log.name}")
                try:
                    if (await client.get(f"http://127.0.0.1:{self.http_port}/readyz")
                            ).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(1.0)
        raise RuntimeError("the gateway did not become ready")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


async def _phone(gateway: Gateway, number: str) -> Any:
    from gateway.loadsim.sip_caller import SipCaller

    phone = SipCaller(caller_id="15550000000")
    await phone.call(("127.0.0.1", gateway.sip_port), user=number)
    return phone


# --- 1. first token -> first audio ---------------------------------------------------------------


async def first_audio(gateway: Gateway, bot: BenchBot, mode: str, calls: int,
                      rounds: int) -> list[float]:
    """Each of ``calls`` callers presses a key ``rounds`` times (the next key cuts the answer
    off); the bot's first token -> the caller's first speech, in ms."""
    phones = await asyncio.gather(*(_phone(gateway, NUMBERS[mode]) for _ in range(calls)))
    out: list[float] = []

    async def caller(phone: Any, offset: float) -> None:
        await asyncio.sleep(0.5 + offset)
        for n in range(1, rounds + 1):
            pressed = await phone.send_dtmf("1")
            deadline = time.monotonic() + 30
            heard = None
            while heard is None and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
                heard = phone.utterance_after(pressed)
            call = bot.call(phone.call_id)
            if heard is not None and len(call.first_tokens) >= n:
                out.append(1000 * (heard - call.first_tokens[n - 1]))
            await asyncio.sleep(1.0)

    try:
        # Callers a little apart, as people are: not all on the same step.
        await asyncio.gather(*(caller(p, i * 0.137) for i, p in enumerate(phones)))
    finally:
        for phone in phones:
            await phone.aclose()
    return out


# --- 2. end of speech -> prompt, and the round trip ----------------------------------------------


def _speech(text: str) -> tuple[list[bytes], float]:
    """``text`` said by flite over the phone line: its 20 ms mu-law frames, and the silence
    after the speech that they end with (seconds)."""
    from gateway.asr.synth import SynthVoice, phone_line, synthesize

    tail = 0.2
    ulaw = phone_line(synthesize(text, SynthVoice("flite", "slt")), lead_s=0.2, tail_s=tail)
    return [ulaw[i:i + 160] for i in range(0, len(ulaw) - 159, 160)], tail


async def round_trip(gateway: Gateway, bot: BenchBot, turns: int) -> list[tuple[float, float]]:
    """(end of speech -> prompt, end of speech -> first audio) in ms, per turn."""
    frames, tail = _speech("what is my balance")
    phone = await _phone(gateway, NUMBERS["stream"])
    out = []
    try:
        await asyncio.sleep(0.5)
        for _ in range(turns):
            ended = await phone.speak(frames) - tail
            call = bot.call(phone.call_id)
            before = len(call.prompts)
            deadline = time.monotonic() + 20
            while len(call.prompts) == before and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            heard = None
            while heard is None and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
                heard = phone.utterance_after(ended)
            if len(call.prompts) > before and heard is not None:
                out.append((1000 * (call.prompts[-1][0] - ended), 1000 * (heard - ended)))
            await asyncio.sleep(1.5)
            await phone.send_dtmf("#")  # cut the answer off before the next turn
            await asyncio.sleep(0.5)
    finally:
        await phone.aclose()
    return out


# --- 3. interrupts -------------------------------------------------------------------------------


def _speech_ms(phone: Any, start: float, end: float) -> float:
    """Milliseconds of audio the phone received in [start, end) that was not digital silence:
    the answer as heard, without the idle fill a slow engine's gaps are padded with (the
    gateway reports the answer's frames, not the time it took)."""
    from bisect import bisect_left

    rtp = phone.rtp
    lo, hi = bisect_left(rtp.arrivals, start), bisect_left(rtp.arrivals, end)
    speech = 1  # RtpReceiveLog.kinds: non-silent audio
    return sum(rtp.sizes[i] for i in range(lo, hi) if rtp.kinds[i] == speech) / 8  # 8 kHz


async def interrupts(gateway: Gateway, bot: BenchBot, turns: int
                     ) -> tuple[list[float], list[float], list[float]]:
    """(key -> silence ms, speech onset -> silence ms, reported - received heard ms: the
    ``durationUntilInterruptMs`` against the answer's audio the phone received)."""
    frames, _ = _speech("wait wait stop")
    lead = 0.2  # phone_line's lead silence before the speech
    phone = await _phone(gateway, NUMBERS["stream"])
    keys, speech, heard_err = [], [], []
    try:
        await asyncio.sleep(0.5)
        for n in range(turns):
            pressed = await phone.send_dtmf("1")  # an answer starts
            start = None
            deadline = time.monotonic() + 30
            while start is None and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
                start = phone.utterance_after(pressed)
            if start is None:
                continue
            await asyncio.sleep(1.2 + 0.1 * n)
            call = bot.call(phone.call_id)
            seen = len(call.interrupts)
            if n % 2 == 0:
                cut = await phone.send_dtmf("2")
            else:
                cut = await phone.speak(frames[:40]) - 0.8 + lead  # onset of the speech
            stopped = None
            while stopped is None and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
                stopped = phone.stream_stopped_after(cut)
            if stopped is None:
                continue
            (keys if n % 2 == 0 else speech).append(1000 * (stopped - cut))
            while len(call.interrupts) == seen and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            if len(call.interrupts) > seen:
                reported = float(call.interrupts[-1][1]["durationUntilInterruptMs"])
                heard_err.append(reported - _speech_ms(phone, start, stopped))
            await asyncio.sleep(1.0)
    finally:
        await phone.aclose()
    return keys, speech, heard_err


# --- 4. what was heard, in words -----------------------------------------------------------------

SENTENCES = [
    "Thanks for waiting. I can see your last payment arrived on time, so your account is up "
    "to date.",
    "Your order ships tomorrow morning and should reach you by Friday afternoon.",
    "I am sorry to hear that. Let me put you through to someone who can help with billing.",
]


def _word_timings(sentence: str) -> tuple[list[str], list[float]]:
    """Each word of ``sentence`` said alone by flite, laid end to end: the words and the time
    each ends (seconds), at 8 kHz."""
    from gateway.asr.synth import SynthVoice, synthesize

    words = sentence.split()
    ends, at = [], 0.0
    for word in words:
        audio = synthesize(re.sub(r"[^\w']", "", word) or word, SynthVoice("flite", "slt"))
        at += len(audio) / 8000
        ends.append(at)
    return words, ends


def estimator_accuracy() -> dict[str, list[int]]:
    """Words reported minus words heard, at every 100 ms of each sentence, for a finished
    answer and for one still being generated (read at the usual pace)."""
    from gateway.bot.talk import Segment, heard_text
    from gateway.bot.text import TextFeed
    from gateway.text import Reader

    errors: dict[str, list[int]] = {"finished": [], "generating": []}
    for sentence in SENTENCES:
        _, ends = _word_timings(sentence)
        feed = TextFeed(Reader(), "English")
        pieces = [p for w in re.findall(r"\s*\S+", sentence) for p in feed.push(w)]
        pieces += feed.finish()
        total = ends[-1]
        for done in (True, False):
            segment = Segment(pieces=pieces, text_done=True, stream=object(),  # type: ignore
                              start_s=0.0, audio_s=total, done=done)
            for t in np.arange(0.1, total, 0.1):
                truth = sum(1 for e in ends if e <= t)
                said = len(heard_text([segment], float(t)).split())
                errors["finished" if done else "generating"].append(said - truth)
    return errors


# --- 5. text slower than the engine reads it -----------------------------------------------------

#: The bot's text rate as a multiple of the rate the talker reads it (one text token a frame).
READ_RATIOS = (2.0, 1.1, 0.9, 0.5, 0.25)


@dataclass
class SlowText:
    ratio: float
    #: Seconds over which the answer's text arrives.
    arrives_s: float
    #: Waits for text (text underruns) of an engine that steps at exactly real time.
    underruns: int = 0
    #: The silence the caller hears: the same for any engine at least as fast as real time
    #: (one that is ahead of playback waits more often, but only text that comes after its
    #: frame is due is heard).
    silence_s: float = 0.0
    same_codes: bool = False


def slow_text(ratios: tuple[float, ...] = READ_RATIOS) -> tuple[float, list[SlowText]]:
    """One streaming turn of :data:`ANSWER` on the tiny model (in this process), its text
    arriving as the bot path releases it (:class:`gateway.bot.text.TextFeed` over LLM-sized
    tokens, numbers and dates held until they are whole) at ``ratio`` times the rate the
    talker reads it. The row needs text token ``f`` for frame ``f``; timed in virtual time, on
    an engine that steps at exactly real time. The caller plays from the first frame; frame
    ``f`` is due ``f`` frames later, later by the silence before it. Also checked: the codes
    are those of the same text given whole (seeded).
    Returns the seconds the talker takes to read the whole text and a row per ratio."""
    import torch

    from gateway.bot.text import TextFeed
    from gateway.text import Reader
    from gateway.tts.batched import BatchedQwenEngine
    from gateway.tts.engine import SAMPLE_RATE, SAMPLES_PER_FRAME, SpeechRequest
    from gateway.tts.qwen import QwenModel, resolve_model

    frame_s = SAMPLES_PER_FRAME / SAMPLE_RATE
    reader = Reader()
    spoken = "".join(p.spoken for p in _pieces(TextFeed(reader, "English"), tokens(ANSWER)))
    engine = BatchedQwenEngine(QwenModel(resolve_model("tiny"), device="cpu"), max_rows=1,
                               record_codes=True, trim_leading_silence=False)

    def request(text: str, frames: int) -> SpeechRequest:
        return SpeechRequest(text=text, seed=42, text_stream=True, min_frames=frames,
                             max_frames=frames)

    with torch.inference_mode():
        probe = engine.open(request(spoken, 1))
        text_tokens = probe.text_tokens
        engine.close(probe)
        frames = text_tokens + 8  # every text token read, and a few frames past the last
        whole = engine.open(request(spoken, frames))
        engine.extend_text(whole, "", True)
        while whole.prefilling:
            engine.prefill(whole)
        while whole.frames < frames and whole.finished is None:
            engine.step([whole])
            engine.drop_pending(whole)
        codes_whole = torch.stack(whole.codes)
        engine.close(whole)
        rows = []
        for ratio in ratios:
            # The whole answer arrives in the time the talker reads it, over ``ratio``.
            result = SlowText(ratio, text_tokens * frame_s / ratio)
            chars_per_s = len(ANSWER) / result.arrives_s
            arrivals: list[tuple[float, str, bool]] = []  # (when, spoken text, last)
            feed, at = TextFeed(reader, "English"), 0.0
            pieces = tokens(ANSWER)
            for i, token in enumerate(pieces):
                at += len(token) / chars_per_s
                last = i == len(pieces) - 1
                out = feed.push(token) + (feed.finish() if last else [])
                arrivals += [(at, p.spoken, last and j == len(out) - 1)
                             for j, p in enumerate(out)]
                if last and not out:
                    arrivals.append((at, "", True))
            start, first, _ = arrivals[0]
            row = engine.open(request(first, frames))
            nxt, avail = 1, start
            made = start - frame_s  # when the engine made its last frame (virtual time)
            while row.prefilling:
                engine.prefill(row)
            while row.frames < frames and row.finished is None:
                # Frame f needs text token f: the pieces up to it, from when they came.
                while row.waiting_for_text:
                    avail = max(avail, arrivals[nxt][0])
                    engine.extend_text(row, arrivals[nxt][1], arrivals[nxt][2])
                    nxt += 1
                if avail > made + frame_s:
                    result.underruns += 1
                made = max(made + frame_s, avail)
                result.silence_s += max(0.0, made - (start + row.frames * frame_s
                                                     + result.silence_s))
                engine.step([row])
                engine.drop_pending(row)
            result.same_codes = torch.equal(torch.stack(row.codes), codes_whole)
            engine.close(row)
            rows.append(result)
    return text_tokens * frame_s, rows


def _pieces(feed: Any, parts: list[str]) -> list[Any]:
    out = [p for part in parts for p in feed.push(part)]
    return out + feed.finish()


# --- the run -------------------------------------------------------------------------------------


@dataclass
class EngineResult:
    engine: str
    first_audio: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    trips: list[tuple[float, float]] = field(default_factory=list)
    keys: list[float] = field(default_factory=list)
    speech: list[float] = field(default_factory=list)
    heard_err: list[float] = field(default_factory=list)
    eos_ms: float = 500.0


async def run_engine(engine: str, levels: list[int], rounds: int, rate: float,
                     work: Path) -> EngineResult:
    bot = BenchBot(rate)
    await bot.start()
    eos = 0.5
    gateway = Gateway(engine, bot.port, work, eos)
    result = EngineResult(engine, eos_ms=eos * 1000)
    try:
        await gateway.ready()
        await first_audio(gateway, bot, "stream", 1, 1)  # warm the path once
        for level in levels:
            for mode in MODES:
                values = await first_audio(gateway, bot, mode, level, rounds)
                result.first_audio[(mode, level)] = values
                print(f"  {engine:9s} {mode:8s} x{level}: "
                      f"p50 {_pct(values, 50):7.0f} ms  ({len(values)} turns)", flush=True)
        result.trips = await round_trip(gateway, bot, 4)
        result.keys, result.speech, result.heard_err = await interrupts(gateway, bot, 6)
    finally:
        gateway.stop()
        await bot.stop()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", default="tiny,simulated")
    parser.add_argument("--levels", default="1,4,8")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--token-rate", type=float, default=40.0)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    levels = [1, 4] if args.quick else [int(x) for x in args.levels.split(",")]
    rounds = 2 if args.quick else args.rounds
    print(f"bot: {len(ANSWER)}-character answer, {len(tokens(ANSWER))} tokens "
          f"at {args.token_rate:g} tokens/s; callers: SIP phones; levels {levels}", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for engine in args.engines.split(","):
            work = Path(tmp) / engine
            work.mkdir()
            results.append(asyncio.run(run_engine(engine, levels, rounds, args.token_rate,
                                                  work)))
    accuracy = estimator_accuracy()
    read_s, slow = slow_text((2.0, 0.9, 0.5) if args.quick else READ_RATIOS)
    print()
    print("1. the bot's first token -> the caller's first audio, ms (p50 / p95)")
    print(f"{'engine':10s} {'calls':>5s} " + " ".join(f"{m:>17s}" for m in MODES)
          + f" {'stream/whole':>13s} {'stream/sentence':>16s}")
    ratios: dict[str, list[str]] = {}
    for r in results:
        for level in levels:
            cells = []
            for mode in MODES:
                v = r.first_audio.get((mode, level), [])
                cells.append(f"{_pct(v, 50):8.0f} /{_pct(v, 95):7.0f}")
            s50 = _pct(r.first_audio.get(("stream", level), []), 50)
            w50 = _pct(r.first_audio.get(("whole", level), []), 50)
            n50 = _pct(r.first_audio.get(("sentence", level), []), 50)
            ratio_w, ratio_s = s50 / w50, s50 / n50
            ratios.setdefault(r.engine, []).append(f"x{level} {ratio_w:.2f}")
            print(f"{r.engine:10s} {level:5d} " + " ".join(f"{c:>17s}" for c in cells)
                  + f" {ratio_w:13.2f} {ratio_s:16.2f}")
    print()
    print("2. the caller's end of speech -> (ms)     prompt p50   first audio p50 (bot at once)")
    for r in results:
        prompts = [p for p, _ in r.trips]
        firsts = [f for _, f in r.trips]
        eos = r.eos_ms
        print(f"{r.engine:10s} {len(r.trips)} turns: {_pct(prompts, 50):21.0f} "
              f"{_pct(firsts, 50):16.0f}   (of which end-of-speech silence {eos:.0f}; "
              f"recogniser {_pct(prompts, 50) - eos:.0f})")
    print()
    print("3. interrupt: -> silence at the caller, ms (p50 / max); duration reported - received")
    for r in results:
        print(f"{r.engine:10s} ({len(r.keys)} keys, {len(r.speech)} speech, "
              f"{len(r.heard_err)} reports)")
        worst_key, worst_speech = (max(v, default=float("nan")) for v in (r.keys, r.speech))
        print(f"{r.engine:10s} key {_pct(r.keys, 50):5.0f} / {worst_key:4.0f}"
              f"   speech onset {_pct(r.speech, 50):5.0f} / {worst_speech:4.0f}   heard ms error "
              f"{_pct(r.heard_err, 50):+5.0f} (p50), {_pct([abs(e) for e in r.heard_err], 95):.0f}"
              " (|p95|)")
    print()
    print("4. utteranceUntilInterrupt against speech with known word timings (words reported "
          "- heard)")
    summary = []
    for kind, errs in accuracy.items():
        exact = sum(1 for e in errs if e == 0) / len(errs)
        within = sum(1 for e in errs if abs(e) <= 1) / len(errs)
        print(f"{kind:10s} {len(errs)} cuts: exact {exact:.0%}, within one word {within:.0%}, "
              f"mean {statistics.mean(errs):+.2f} words")
        summary.append(f"{kind} within 1 word {within:.0%}")
    print()
    print(f"5. the bot's text slower than the talker reads it ({read_s:.1f} s for this answer "
          "on the tiny model, one text token a frame)")
    print(f"{'text rate':>10s} {'arrives in':>10s} {'underruns':>9s} {'silence':>8s} "
          f"{'codes as whole':>14s}")
    for r in slow:
        print(f"{r.ratio:9.2f}x {r.arrives_s:9.1f}s {r.underruns:9d} {r.silence_s:7.2f}s "
              f"{'same' if r.same_codes else 'DIFFERENT':>14s}")
    print()
    print("RESULT first token -> first audio, stream/whole p50 ratio: "
          + "; ".join(f"{engine} {', '.join(v)}" for engine, v in ratios.items())
          + "; " + "; ".join(summary) + "; text at "
          + ", ".join(f"{r.ratio:g}x reading: {r.silence_s:.1f} s silent" for r in slow))


if __name__ == "__main__":
    main()
