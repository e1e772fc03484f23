"""Gateway CPU per call-second of media on cached-prompt calls: the old per-frame path vs today's.

Run from the repository root (``pip install -e '.[loadsim]'``)::

    python bench/media_cpu.py [--levels 64,96] [--seconds 20] [--rounds 2]
                              [--digits 9,9,9,9,9] [--think 2] [--line-noise-dbfs -50]
                              [--baseline old-path|legacy-ws]

What it measures: how much CPU the gateway *process* spends (user + system time of all its
threads, from ``/proc/<pid>/stat``) per second of call its callers had, while every prompt comes
from the prompt cache: the media path (inbound messages, the speech detector, pacing and sending
the prompts' frames), with the calls' set-up in the share their length gives it.

Two gateway processes run side by side, both from this checkout (the tiny model on CPU, the
demo IVR, its prompts pre-rendered into a cache first):

* **new**: the gateway as it is;
* **baseline**: the same gateway with the old per-frame functions swapped in. They are kept here
  (:func:`_install_baseline`): every inbound Twilio ``media`` message validated by pydantic and
  copied into a model (``validate_json`` + ``model_copy``); the speech detector fed every frame of
  every call whether or not anything interruptible plays, its model run on every 32 ms window,
  each frame decoded on its own; a cached prompt encoded to G.711 afresh on every play; no cap
  on the inbound rate. With ``--baseline legacy-ws`` the baseline is instead today's gateway on
  uvicorn's legacy WebSocket protocol (``ws="websockets"``), so the switch to the Sans-I/O one
  (:data:`gateway.http_limits.WS_PROTOCOL`) is measured on its own.

The load simulator's Twilio callers (in this process) call each gateway in turn, level after
level, round after round (a noisy phase of this shared machine hits both): the demo menu, ``9``
(the menu again) pressed ``--think`` seconds after each prompt starts, for ``--digits`` turns.
Their inbound audio is line noise at ``--line-noise-dbfs`` (a real line is never digital
silence). Each cell is the median over rounds. A level where a gateway could not keep up (calls
not completed: its event loop saturated) gives a floor, not a cost, and is left out of the
ratio. The last line is ``RESULT new path X.XX ms CPU per call-second at <levels> (baseline
<old-path|legacy-ws> Y.YY ms at <levels both kept up>), Z.ZZx less``.

The figure includes what no code of ours does: delivering each WebSocket message to the app
(uvicorn, websockets, Starlette). The bench measures that first, as a floor: a bare Starlette
endpoint that only receives, on uvicorn as the gateway runs it, fed the same 50 messages a
second per stream at each level.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without an install
    sys.path.insert(0, str(ROOT))

DEMO = ROOT / "prompts" / "demo.yaml"
VARIANTS = ("baseline", "new")


# --- the old per-frame path (the baseline gateway runs with these) ----------------------------


def _install_baseline() -> None:
    """Swap the old per-frame functions into the gateway modules (before the app is built)."""
    import binascii

    from pydantic import Field, TypeAdapter, ValidationError

    import gateway.app as app_module
    import gateway.call.frames as call_frames
    import gateway.call.inbound as inbound
    import gateway.call.session as session
    import gateway.twilio.protocol as protocol
    from gateway.audio.framer import Framer
    from gateway.audio.g711 import alaw_encode, codec_silence, ulaw_encode
    from gateway.audio.vad import SpeechStartDetector
    from gateway.call.events import SpeechStarted
    from gateway.errors import InvalidMessage, MessageTooLarge, UnsupportedData
    from gateway.twilio.protocol import (
        Connected,
        Dtmf,
        Mark,
        MediaPayload,
        Start,
        Stop,
        _describe,
        _Wire,
    )

    class OldMedia(_Wire):  # the pydantic model every media message used to become
        event: Literal["media"]
        sequenceNumber: str = ""
        media: MediaPayload
        streamSid: str
        audio: bytes = b""

    union = Annotated[
        Connected | Start | OldMedia | Dtmf | Mark | Stop, Field(discriminator="event")]
    inbound_adapter: TypeAdapter[Any] = TypeAdapter(union)

    def receive(self: protocol.MediaStreamProtocol, data: str | bytes) -> Any:
        if isinstance(data, bytes):
            raise UnsupportedData("binary frame: Twilio Media Streams sends JSON text only")
        if len(data) > self.max_message_bytes or (
            len(data) * 4 > self.max_message_bytes
            and len(data.encode("utf-8", "surrogatepass")) > self.max_message_bytes
        ):
            raise MessageTooLarge(f"message larger than {self.max_message_bytes} bytes")
        try:
            message = inbound_adapter.validate_json(data)
        except ValidationError as exc:
            raise InvalidMessage(_describe(exc, data)) from None
        if isinstance(message, OldMedia):
            try:
                audio = binascii.a2b_base64(message.media.payload, strict_mode=True)
            except (binascii.Error, ValueError) as exc:
                raise InvalidMessage(f"media payload is not valid base64: {exc}") from None
            message = message.model_copy(update={"audio": audio})
        elif isinstance(message, Dtmf) and message.dtmf.digit not in protocol._DTMF_DIGITS:
            raise InvalidMessage(f"dtmf digit {message.dtmf.digit[:8]!r} is not a DTMF key")
        message = self._advance(message)
        if isinstance(message, OldMedia):
            # The session dispatches today's event type; the conversion costs ~0.4 us.
            payload = message.media
            return protocol.Media(message.streamSid, message.audio, message.sequenceNumber,
                                  payload.track, payload.chunk, payload.timestamp)
        return message

    protocol.MediaStreamProtocol.receive = receive  # type: ignore[method-assign]

    def inbound_audio(self: session.Call, payload: bytes | bytearray | memoryview,
                      now: float | None = None) -> None:
        if now is None:
            now = self.clock.now()
        self.inactivity.touch(now)
        detector = self._detector
        if detector is not None and detector.push(payload):  # every frame, always listening
            self.deliver(SpeechStarted(at=now))

    session.Call.inbound_audio = inbound_audio  # type: ignore[method-assign]

    class OldDetector(SpeechStartDetector):
        """The model on every window, each 20 ms frame decoded into its input on its own."""

        __slots__ = ("_fill",)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, skip_quiet=False, **kwargs)
            self._fill = 0

        def push(self, frame: bytes | bytearray | memoryview) -> bool:
            codes = np.frombuffer(frame, dtype=np.uint8)
            n = codes.shape[0]
            base = self.samples
            self.samples += n
            started = False
            pos = 0
            while pos < n:
                take = min(self._window - self._fill, n - pos)
                start = self._context + self._fill
                np.take(self._table, codes[pos:pos + take],
                        out=self._x[0, start:start + take], mode="clip")
                self._fill += take
                pos += take
                if self._fill == self._window:
                    self._fill = 0
                    if self._step(base + pos):  # the window ends at this sample
                        started = True
                        self.last_event_sample = base + pos
            return started

    def detectors(settings: Any) -> Any:
        def detector(codec: Any) -> OldDetector:
            return OldDetector(min_speech_ms=settings.vad_min_speech_ms,
                               threshold=settings.vad_threshold, codec=codec)

        return detector if settings.barge_in_on_speech else None

    app_module._detectors = detectors

    def frames(self: Any, pcm: np.ndarray, codec: Any) -> list[bytes]:  # encoded every play
        encoded = ulaw_encode(pcm) if codec == "pcmu" else alaw_encode(pcm)
        framer = Framer(codec_silence(codec))
        return framer.push(encoded) + framer.flush()

    call_frames.PromptFrames.frames = frames  # type: ignore[method-assign]
    inbound.InboundRate.allow = lambda self, now: True  # type: ignore[method-assign]


def _serve_floor(port: int) -> int:
    """A bare Starlette WebSocket endpoint that only receives, on uvicorn as the gateway runs it
    (``--serve floor``): what delivering one message to an app costs before any code of ours."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.routing import WebSocketRoute
    from starlette.websockets import WebSocket

    from gateway.http_limits import WS_PROTOCOL

    async def media(websocket: WebSocket) -> None:
        await websocket.accept()
        while (await websocket.receive())["type"] != "websocket.disconnect":
            pass

    app = Starlette(routes=[WebSocketRoute("/twilio/media", media)])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning",
                ws_per_message_deflate=False, ws=WS_PROTOCOL)
    return 0


async def _stream(port: int, connections: int, seconds: float, payload: str) -> int:
    """``connections`` streams of compact Twilio media messages at 50 a second each."""
    import asyncio

    import websockets

    text = ('{"event":"media","sequenceNumber":"1","media":{"track":"inbound","chunk":"1",'
            '"timestamp":"20","payload":"' + payload + '"},"streamSid":"MZ' + "0" * 32 + '"}')
    sent = 0

    async def one() -> None:
        nonlocal sent
        async with websockets.connect(f"ws://127.0.0.1:{port}/twilio/media",
                                      compression=None) as ws:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            for i in range(round(seconds * 50)):
                await ws.send(text)
                sent += 1
                await asyncio.sleep(max(0.0, t0 + (i + 1) * 0.02 - loop.time()))

    await asyncio.gather(*(one() for _ in range(connections)))
    return sent


def _floor(port: int, levels: list[int], seconds: float, payload: str, log: Path,
           ) -> dict[int, float]:
    """Microseconds of server CPU per message of the bare endpoint, per level."""
    import asyncio

    process = subprocess.Popen([sys.executable, __file__, "--serve", "floor", "--port",
                                str(port)], stdout=log.open("wb"), stderr=subprocess.STDOUT)
    server = Gateway("floor", port, process)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(server.base + "/", timeout=1):
                    break
            except urllib.error.HTTPError:
                break  # 404: it is up
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("the bare endpoint did not start") from None
                time.sleep(0.2)
        per_message = {}
        for concurrency in levels:
            cpu0 = server.cpu_s()
            sent = asyncio.run(_stream(port, concurrency, seconds, payload))
            time.sleep(0.5)
            per_message[concurrency] = 1e6 * (server.cpu_s() - cpu0) / sent
            print(f"framework floor ×{concurrency}: {per_message[concurrency]:.0f} us of server "
                  f"CPU per message ({sent} messages)", flush=True)
        return per_message
    finally:
        process.terminate()
        process.wait(30)


def _serve(variant: str, port: int, model: str, cache_dir: str, baseline: str = "old-path"
           ) -> int:
    """The gateway process of one variant (``--serve``)."""
    if variant == "floor":
        return _serve_floor(port)
    if variant == "baseline" and baseline == "legacy-ws":
        import gateway.http_limits

        gateway.http_limits.WS_PROTOCOL = "websockets"  # read by server_limits at start-up
    elif variant == "baseline":
        _install_baseline()
    from gateway.cli import main

    return main(["serve", "--insecure", "--model", model, "--device", "cpu", "--script",
                 str(DEMO), "--host", "127.0.0.1", "--port", str(port)])


# --- driving and measuring --------------------------------------------------------------------


@dataclass
class Gateway:
    variant: str
    port: int
    process: subprocess.Popen[bytes]
    idle_ms_per_s: float = 0.0

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Cell:
    calls: list[int] = field(default_factory=list)
    call_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)

    @property
    def ms_per_call_s(self) -> list[float]:
        return [1000 * c / s for c, s in zip(self.cpu_s, self.call_s, strict=True)]


def _start(variant: str, port: int, model: str, cache_dir: str, log: Path, baseline: str,
           ) -> Gateway:
    env = dict(os.environ, GATEWAY_MAX_CALLS="1024", GATEWAY_CACHE_DIR=cache_dir,
               GATEWAY_LOG_LEVEL="warning")
    out = log.open("wb")
    process = subprocess.Popen(
        [sys.executable, __file__, "--serve", variant, "--port", str(port), "--model", model,
         "--cache-dir", cache_dir, "--baseline", baseline],
        env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    return Gateway(variant, port, process)


def _wait_ready(gateway: Gateway, log: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if gateway.process.poll() is not None:
            raise SystemExit(f"{gateway.variant} gateway exited:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(gateway.base + "/readyz", timeout=2) as response:
                if json.load(response).get("status") == "ready":
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{gateway.variant} gateway not ready in {timeout_s:.0f} s")


def _line_noise(dbfs: float) -> str:
    """One 20 ms mu-law frame of white noise at ``dbfs`` RMS, base64 (what callers send)."""
    from gateway.audio.g711 import ulaw_encode

    rng = np.random.default_rng(0)
    noise = rng.standard_normal(160) * 32768 * 10 ** (dbfs / 20)
    return base64.b64encode(ulaw_encode(np.clip(noise, -32768, 32767).astype(np.int16))).decode()


def _level(gateway: Gateway, concurrency: int, args: argparse.Namespace, index: int,
           ) -> tuple[int, float, float, int]:
    """One level against ``gateway``: (calls, call-seconds, CPU seconds, failed calls)."""
    from gateway.loadsim.runner import LoadConfig, run_level

    config = LoadConfig(target=gateway.base, digits=args.digits.split(","), think_s=args.think,
                        listen_s=1.0, duration_s=args.seconds, turn_timeout_s=15.0)
    cpu0 = gateway.cpu_s()
    level = run_level(config, concurrency, index)
    cpu = gateway.cpu_s() - cpu0
    call_s = sum(max(0.0, c.ended_s - c.started_s) for c in level.calls)
    failed = sum(1 for c in level.calls if c.outcome != "completed")
    return len(level.calls), call_s, cpu, failed


def _prepare(args: argparse.Namespace, work: Path) -> tuple[str, str]:
    from gateway.cli import main

    model = args.model_dir or str(work / "tiny")
    cache = args.cache_dir or str(work / "cache")
    if not Path(model, "config.json").exists():
        from gateway.tts.tiny import build_tiny_checkpoint

        build_tiny_checkpoint(Path(model))
    code = main(["prompts", "render", str(DEMO), "--model", model, "--device", "cpu",
                 "--cache-dir", cache])
    if code != 0:
        raise SystemExit("rendering the demo prompts failed")
    return model, cache


def _table(cells: dict[tuple[int, str], Cell], levels: list[int]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="gateway CPU per call-second, cached-prompt calls (median of rounds)")
    for header in ("level", "path", "calls", "call-s", "CPU s", "ms CPU / call-s",
                   "per round", "not completed"):
        table.add_column(header, justify="right")
    for concurrency in levels:
        for variant in VARIANTS:
            cell = cells[(concurrency, variant)]
            table.add_row(
                f"×{concurrency}", variant, f"{statistics.median(cell.calls):.0f}",
                f"{statistics.median(cell.call_s):.0f}", f"{statistics.median(cell.cpu_s):.2f}",
                f"{statistics.median(cell.ms_per_call_s):.2f}",
                " ".join(f"{x:.2f}" for x in cell.ms_per_call_s), f"{sum(cell.failed)}")
    Console(width=140).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", default="32,64,96", help="concurrent callers per level")
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds per level")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--digits", default="9,9,9,9,9", help="keys, one per turn")
    parser.add_argument("--think", type=float, default=2.0,
                        help="seconds after a prompt starts before the next key")
    parser.add_argument("--line-noise-dbfs", type=float, default=-50.0)
    parser.add_argument("--model-dir", help="a tiny checkpoint to reuse")
    parser.add_argument("--cache-dir", help="a prompt cache to reuse (rendered if incomplete)")
    parser.add_argument("--port", type=int, default=18700)
    parser.add_argument("--baseline", choices=("old-path", "legacy-ws"), default="old-path",
                        help="old-path: the old per-frame functions; legacy-ws: today's gateway "
                             "on uvicorn's legacy WebSocket protocol")
    parser.add_argument("--serve", choices=(*VARIANTS, "floor"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        sys.exit(_serve(args.serve, args.port, args.model_dir, args.cache_dir, args.baseline))

    import gateway.loadsim.twilio_caller as twilio_caller

    payload = _line_noise(args.line_noise_dbfs)
    twilio_caller._SILENCE = payload  # type: ignore[attr-defined]
    levels = [int(x) for x in args.levels.split(",")]
    with tempfile.TemporaryDirectory(prefix="media-cpu-") as tmp:
        work = Path(tmp)
        floor = _floor(args.port + 10, levels, args.seconds, payload, work / "floor.log")
        model, cache = _prepare(args, work)
        gateways = {variant: _start(variant, args.port + i, model, cache, work / f"{variant}.log",
                                    args.baseline)
                    for i, variant in enumerate(VARIANTS)}
        try:
            for gateway in gateways.values():
                _wait_ready(gateway, work / f"{gateway.variant}.log")
            for gateway in gateways.values():
                cpu0, t0 = gateway.cpu_s(), time.monotonic()
                time.sleep(3.0)
                gateway.idle_ms_per_s = 1000 * (gateway.cpu_s() - cpu0) / (time.monotonic() - t0)
            print("idle gateway CPU: " + ", ".join(
                f"{g.variant} {g.idle_ms_per_s:.1f} ms/s" for g in gateways.values()))
            cells = {(c, v): Cell() for c in levels for v in VARIANTS}
            index = 0
            for round_ in range(args.rounds):
                for concurrency in levels:
                    order = VARIANTS if (round_ + index) % 2 == 0 else VARIANTS[::-1]
                    for variant in order:
                        calls, call_s, cpu, failed = _level(gateways[variant], concurrency, args,
                                                            index)
                        index += 1
                        cell = cells[(concurrency, variant)]
                        cell.calls.append(calls)
                        cell.call_s.append(call_s)
                        cell.cpu_s.append(cpu)
                        cell.failed.append(failed)
                        print(f"round {round_ + 1} ×{concurrency} {variant}: {calls} calls, "
                              f"{call_s:.0f} call-s, {cpu:.2f} CPU s = "
                              f"{1000 * cpu / max(call_s, 1e-9):.2f} ms/call-s, "
                              f"{failed} not completed", flush=True)
        finally:
            for gateway in gateways.values():
                gateway.process.terminate()
            for gateway in gateways.values():
                try:
                    gateway.process.wait(30)
                except subprocess.TimeoutExpired:
                    gateway.process.kill()
    _table(cells, levels)
    print("framework floor (uvicorn + websockets + Starlette delivering 50 messages/s, no app "
          "code): " + ", ".join(f"×{c} {floor[c]:.0f} us/message = {floor[c] * 50 / 1000:.2f} "
                                f"ms per call-second" for c in levels))

    def median(level: int, variant: str) -> float:
        return statistics.median(cells[(level, variant)].ms_per_call_s)

    # A gateway whose loop cannot keep up does less than its calls need (turns time out, calls
    # fail): its CPU per call-second is then a floor, not its cost. Ratios count only levels
    # that both paths carried to the end.
    kept_up = [c for c in levels
               if not any(sum(cells[(c, v)].failed) for v in VARIANTS)] or levels
    saturated = [c for c in levels if c not in kept_up]
    print("ratio baseline/new per level: " + ", ".join(
        f"×{c} {median(c, 'baseline') / median(c, 'new'):.2f}x"
        + (" (calls not completed: baseline saturated)" if c in saturated else "")
        for c in levels))
    new = statistics.median(median(c, "new") for c in levels)
    old = statistics.median(median(c, "baseline") for c in kept_up)
    ratio = statistics.median(median(c, "baseline") / median(c, "new") for c in kept_up)
    print(f"RESULT new path {new:.2f} ms CPU per call-second at "
          f"{', '.join(f'×{c}' for c in levels)} (baseline {args.baseline} {old:.2f} ms at "
          f"{', '.join(f'×{c}' for c in kept_up)}), {ratio:.2f}x less")


if __name__ == "__main__":
    main()
