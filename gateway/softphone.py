"""``gateway call``: a softphone in the terminal, for hearing a gateway the way a caller does.

It places one call the way the network does, on the load simulator's callers:

- **Twilio** (``http://host:port``): POST the number's voice webhook with Twilio's form (signed
  with ``--auth-token`` / ``GATEWAY_TWILIO_AUTH_TOKEN`` when given), open the ``<Stream>`` its
  TwiML names, echo marks once their audio has played, and when the gateway ends the stream
  request the ``<Connect action>`` and say what it answered (a transfer, a hang-up)
  (:mod:`gateway.loadsim.twilio_caller`).
- **SIP** (``sip:host:port`` or ``host:port``): an INVITE with an SDP offer, RTP both ways, keys
  as RFC 4733 events, BYE (:mod:`gateway.loadsim.sip_caller`).

What it hears goes to a WAV file always (``-o``, 8 kHz 16-bit, on the caller's timeline:
silence where nothing played, a barge-in's ``clear`` drops what had not played yet) and to the
speakers when there are any (``sounddevice`` with PortAudio and an output device; otherwise one
line says why and the WAV is all). Keys come from standard input: on a terminal each key
pressed is sent at once (0-9 * # A-D; ``s`` says the next ``--say``; ``q`` hangs up); from a
pipe each line is keys (``417029#``), ``say: PHRASE`` (spoken with espeak-ng or flite),
``say:FILE.wav``, ``wait SECONDS`` or ``hangup``. The end of a pipe does not hang up: the call
goes on until the gateway ends it, ``q``/Ctrl-C, or ``--max-duration``.

The call's events are printed as they happen, one line each, with seconds since dialling.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from gateway.errors import GatewayError

__all__ = ["CallOptions", "Keyboard", "Playout", "Speakers", "is_twilio_target", "place_call",
           "speak_text"]

RATE = 8000
#: Quiet on the caller's timeline that separates two utterances (a new "audio" event).
UTTERANCE_GAP_S = 0.25
#: Pause between the keys of one typed line, as a person presses them.
KEY_GAP_S = 0.1
KEYS = frozenset("0123456789*#ABCD")


@dataclass
class CallOptions:
    """One call's settings (``gateway call``'s options)."""

    target: str
    to: str = "+15550002222"
    caller: str = "+15550000000"
    output: Path = Path("call.wav")
    auth_token: str | None = None
    speakers: bool = True
    say: list[str] = field(default_factory=list)
    max_duration_s: float = 600.0
    timeout_s: float = 15.0


def is_twilio_target(target: str) -> bool:
    """``http(s)://`` is a gateway's Twilio webhooks; anything else its SIP endpoint."""
    return target.startswith(("http://", "https://"))


def sip_address(target: str) -> tuple[str, int]:
    """``sip:host:port``, ``host:port`` or ``host`` (port 5060) as an address."""
    rest = target.removeprefix("sip:")
    rest = rest.split("@", 1)[1] if "@" in rest else rest
    host, _, port = rest.rpartition(":") if ":" in rest else (rest, "", "5060")
    if not host or not port.isdigit():
        raise GatewayError(f"cannot read the SIP target {target!r}: write host:port")
    return host, int(port)


# --- what the caller hears ----------------------------------------------------------------------


class Playout:
    """The caller's audio timeline (sans-I/O): what a phone plays, sample by sample.

    Audio arriving at ``at`` plays once everything before it has played, or at ``at`` when that
    is later (the silence in between is what the caller heard: nothing). ``clear(at)`` drops
    what had not played by then, as Twilio does on a barge-in. ``on_utterance`` is told the
    timeline second at which speech starts after at least :data:`UTTERANCE_GAP_S` of quiet.
    """

    def __init__(self, t0: float, on_utterance: Callable[[float], None] | None = None) -> None:
        self.t0 = t0
        self._pcm = bytearray()  # int16 little-endian
        self._last_speech_end: float | None = None
        self.on_utterance = on_utterance

    @property
    def seconds(self) -> float:
        return len(self._pcm) / 2 / RATE

    def add(self, at: float, ulaw: bytes) -> tuple[int, np.ndarray]:
        """Place mu-law ``ulaw`` that arrived at ``at``; returns (start sample, its PCM)."""
        from gateway.audio.g711 import ulaw_decode
        from gateway.loadsim.sip_caller import is_silent

        pos = max(0, round((at - self.t0) * RATE))
        now = len(self._pcm) // 2
        if pos > now:
            self._pcm += bytes(2 * (pos - now))
            now = pos
        pcm = ulaw_decode(ulaw).astype("<i2")
        self._pcm += pcm.tobytes()
        start_s, end_s = now / RATE, now / RATE + len(pcm) / RATE
        if not is_silent(ulaw):
            last = self._last_speech_end
            if (last is None or start_s - last >= UTTERANCE_GAP_S) and self.on_utterance:
                self.on_utterance(start_s)
            self._last_speech_end = end_s
        return now, pcm

    def clear(self, at: float) -> float:
        """Drop what had not played by ``at``; returns the seconds dropped."""
        pos = max(0, round((at - self.t0) * RATE))
        dropped = max(0, len(self._pcm) // 2 - pos)
        if dropped:
            del self._pcm[2 * pos:]
            if self._last_speech_end is not None:
                self._last_speech_end = min(self._last_speech_end, pos / RATE)
        return dropped / RATE

    def audio(self) -> np.ndarray:
        return np.frombuffer(bytes(self._pcm), dtype="<i2").astype(np.int16)

    def write(self, path: Path) -> None:
        import soundfile as sf

        path.parent.mkdir(parents=True, exist_ok=True)
        sf.write(str(path), self.audio(), RATE, subtype="PCM_16", format="WAV")


class Speakers:
    """The default output device, fed as audio arrives (sounddevice / PortAudio).

    :meth:`open` returns None and a reason when there is no way to play: the library or
    PortAudio missing, no output device, a device that refuses 8 kHz mono.
    """

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._buffer = bytearray()
        self._lock = threading.Lock()

    @classmethod
    def open(cls) -> tuple[Speakers | None, str]:
        try:
            import sounddevice as sd
        except ImportError:
            return None, "sounddevice is not installed (pip install sounddevice)"
        except OSError as exc:  # the library is there, PortAudio is not
            return None, f"PortAudio is missing ({exc})"
        try:
            device = sd.query_devices(kind="output")
            speakers = cls(None)
            stream = sd.RawOutputStream(samplerate=RATE, channels=1, dtype="int16",
                                        callback=speakers._callback)
            stream.start()
        except Exception as exc:  # sd.PortAudioError, ValueError: no device, no 8 kHz
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return None, f"no audio output device ({text})"
        speakers._stream = stream
        name = device.get("name", "default") if isinstance(device, dict) else "default"
        return speakers, f"playing to {name}"

    def _callback(self, outdata: Any, frames: int, time_info: Any, status: Any) -> None:
        need = 2 * frames
        with self._lock:
            chunk = bytes(self._buffer[:need])
            del self._buffer[:need]
        outdata[:] = chunk + bytes(need - len(chunk))

    def write(self, pcm: np.ndarray) -> None:
        with self._lock:
            self._buffer += pcm.astype("<i2").tobytes()

    def flush(self) -> None:
        with self._lock:
            self._buffer.clear()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._stream.stop()
            self._stream.close()


# --- caller speech ------------------------------------------------------------------------------


def speak_text(text: str) -> tuple[bytes, ...]:
    """``text`` spoken by a local TTS (espeak-ng, else flite) as 20 ms mu-law frames."""
    from gateway.loadsim.speech import SAY, speech_frames

    with tempfile.TemporaryDirectory(prefix="gateway-call-") as tmp:
        wav = Path(tmp) / "speech.wav"
        if shutil.which("espeak-ng"):
            argv = ["espeak-ng", "-v", "en-us", "-w", str(wav), text]
        elif shutil.which("flite"):
            argv = ["flite", "-voice", "slt", "-t", text, "-o", str(wav)]
        else:
            raise GatewayError("saying a phrase needs espeak-ng or flite on the PATH "
                               "(or say a recording: say:FILE.wav)")
        done = subprocess.run(argv, capture_output=True, timeout=30, check=False)
        if done.returncode != 0 or not wav.exists():
            raise GatewayError(f"{argv[0]} failed: {done.stderr.decode(errors='replace')[:200]}")
        frames = speech_frames(SAY + str(wav))
        speech_frames.cache_clear()  # the file is gone
        return frames


def speech_for(entry: str) -> tuple[str, tuple[bytes, ...]]:
    """A ``say:`` entry (``say:FILE.wav`` or ``say: a phrase``, or a bare phrase or file) as
    (what it is, frames)."""
    from gateway.loadsim.speech import SAY, speech_frames

    what = entry.removeprefix(SAY).strip()
    if what.lower().endswith(".wav"):
        return what, speech_frames(SAY + what)
    return f'"{what}"', speak_text(what)


# --- the keyboard -------------------------------------------------------------------------------


class Keyboard:
    """Standard input as a stream of commands: ``("key", "5")``, ``("say", entry)``,
    ``("wait", "1.5")``, ``("hangup", "")``, and ``("eof", "")`` once at its end.

    A terminal is read key by key (cbreak mode: no Enter needed, Ctrl-C still interrupts); a
    pipe or file line by line.
    """

    def __init__(self, fd: int = 0) -> None:
        self.fd = fd
        self.queue: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
        self.tty = os.isatty(fd)
        self._saved: Any = None
        self._partial = b""
        self._done = False

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self.tty:
            import termios
            import tty

            self._saved = termios.tcgetattr(self.fd)
            tty.setcbreak(self.fd)
        try:
            loop.add_reader(self.fd, self._readable)
        except (OSError, ValueError, NotImplementedError):
            # A regular file cannot be polled: read it at once.
            self._feed(os.read(self.fd, 1 << 20))
            self._feed(b"")

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(self.fd)
        if self._saved is not None:
            import termios

            termios.tcsetattr(self.fd, termios.TCSADRAIN, self._saved)
            self._saved = None

    def _readable(self) -> None:
        try:
            data = os.read(self.fd, 4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        self._feed(data)
        if not data:
            asyncio.get_running_loop().remove_reader(self.fd)

    def _feed(self, data: bytes) -> None:
        if self._done:
            return
        if not data:
            if self._partial.strip():
                self._line(self._partial.decode(errors="replace"))
            self._done = True
            self.queue.put_nowait(("eof", ""))
            return
        if self.tty:
            for char in data.decode(errors="replace"):
                if char.upper() in KEYS:
                    self.queue.put_nowait(("key", char.upper()))
                elif char in "qQ\x04":
                    self.queue.put_nowait(("hangup", ""))
                elif char in "sS":
                    self.queue.put_nowait(("say", ""))
            return
        self._partial += data
        *lines, self._partial = self._partial.split(b"\n")
        for line in lines:
            self._line(line.decode(errors="replace"))

    def _line(self, line: str) -> None:
        text = line.strip()
        if not text:
            return
        lower = text.lower()
        if lower.startswith("say"):
            self.queue.put_nowait(("say", text[3:].lstrip(" :")))
        elif lower.startswith("wait"):
            self.queue.put_nowait(("wait", text[4:].strip()))
        elif lower in ("hangup", "hang up", "q", "quit"):
            self.queue.put_nowait(("hangup", ""))
        else:
            for char in text:
                if char.upper() in KEYS:
                    self.queue.put_nowait(("key", char.upper()))


# --- the call -----------------------------------------------------------------------------------


class _Screen:
    """The call's events, one line each, seconds since dialling first."""

    def __init__(self, out: IO[str], t0: float) -> None:
        self.out = out
        self.t0 = t0

    def event(self, text: str, at: float | None = None) -> None:
        at = time.monotonic() if at is None else at
        self.out.write(f"{at - self.t0:7.2f}  {text}\n")
        self.out.flush()


class _Phone:
    """What both transports share: the timeline, the speakers, the screen, the commands."""

    def __init__(self, options: CallOptions, out: IO[str]) -> None:
        self.options = options
        self.t0 = time.monotonic()
        self.screen = _Screen(out, self.t0)
        self.playout = Playout(self.t0, on_utterance=self._utterance)
        self.speakers: Speakers | None = None
        self.hangup = asyncio.Event()
        self.says = list(options.say)
        self.ended_by = ""

    def _utterance(self, timeline_s: float) -> None:
        self.screen.event(f"▶ speech (plays at {timeline_s:.2f} s)")

    def heard(self, at: float, ulaw: bytes) -> tuple[int, np.ndarray]:
        start, pcm = self.playout.add(at, ulaw)
        if self.speakers is not None:
            self.speakers.write(pcm)
        return start, pcm

    def cleared(self, at: float) -> None:
        dropped = self.playout.clear(at)
        if self.speakers is not None:
            self.speakers.flush()
        self.screen.event(f"✂ clear: barge-in, {dropped:.2f} s not played", at)

    def open_speakers(self) -> None:
        if not self.options.speakers:
            return
        self.speakers, note = Speakers.open()
        if self.speakers is None:
            self.screen.event(f"speakers: {note}; writing {self.options.output} only")
        else:
            self.screen.event(f"speakers: {note}")

    async def commands(self, keyboard: Keyboard, press: Callable[[str], Any],
                       speak: Callable[[tuple[bytes, ...]], Any]) -> None:
        """Run what standard input says until it asks to hang up."""
        while True:
            kind, value = await keyboard.queue.get()
            if kind == "hangup":
                self.ended_by = "you hung up"
                self.hangup.set()
                return
            if kind == "eof":
                continue  # keep listening: the gateway, q or --max-duration ends the call
            if kind == "key":
                await press(value)
                self.screen.event(f"key {value} sent")
                if not keyboard.tty:
                    await asyncio.sleep(KEY_GAP_S)
            elif kind == "wait":
                try:
                    await asyncio.sleep(max(0.0, float(value)))
                except ValueError:
                    self.screen.event(f"wait {value!r}: not a number of seconds")
            elif kind == "say":
                entry = value or (self.says.pop(0) if self.says else "")
                if not entry:
                    self.screen.event("nothing to say: pass --say PHRASE or --say FILE.wav")
                    continue
                if not value:
                    self.says.append(entry)  # cycle through --say
                try:
                    what, frames = await asyncio.to_thread(speech_for, entry)
                except GatewayError as exc:
                    self.screen.event(f"cannot say {entry!r}: {exc}")
                    continue
                self.screen.event(f"saying {what} ({len(frames) * 0.02:.1f} s)")
                await speak(frames)
                self.screen.event("done speaking")

    def finish(self) -> None:
        if self.speakers is not None:
            self.speakers.close()
        self.playout.write(self.options.output)
        audio = self.playout.audio()
        loud = float(np.count_nonzero(np.abs(audio.astype(np.int32)) > 128)) / RATE
        self.screen.event(f"call ended ({self.ended_by or 'ended'}) after "
                          f"{time.monotonic() - self.t0:.1f} s; {self.playout.seconds:.1f} s on "
                          f"the line ({loud:.1f} s of sound) written to {self.options.output}")


async def _run_input(phone: _Phone, press: Callable[[str], Any],
                     speak: Callable[[tuple[bytes, ...]], Any], gone: Callable[[], bool]) -> None:
    """Commands from stdin until the gateway ends the call, the caller hangs up, or time is up."""
    keyboard = Keyboard()
    keyboard.start()
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError):
        loop.add_signal_handler(signal.SIGINT, phone.hangup.set)
    commands = asyncio.create_task(phone.commands(keyboard, press, speak))
    deadline = time.monotonic() + phone.options.max_duration_s
    try:
        while not phone.hangup.is_set() and not gone():
            if time.monotonic() >= deadline:
                phone.ended_by = f"--max-duration {phone.options.max_duration_s:g} s"
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(phone.hangup.wait(), 0.05)
        if phone.hangup.is_set() and not phone.ended_by:
            phone.ended_by = "you hung up"
    finally:
        commands.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await commands
        keyboard.stop()
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.remove_signal_handler(signal.SIGINT)


async def _twilio(options: CallOptions, phone: _Phone) -> int:
    import httpx

    from gateway.loadsim.twilio_caller import (
        DialError,
        Ticker,
        TwilioCaller,
        after_stream,
        describe,
        dial,
    )
    from gateway.loadsim.twiml import Busy

    base = options.target.rstrip("/")
    voice_url = f"{base}/twilio/voice"
    call_sid = "CA" + uuid.uuid4().hex
    screen = phone.screen
    screen.event(f"dialling {options.to} from {options.caller}: POST {voice_url} ({call_sid})")
    async with httpx.AsyncClient(timeout=options.timeout_s) as http:
        try:
            answer = await dial(http, voice_url, call_sid, options.auth_token, options.caller,
                                options.to)
        except DialError as exc:
            screen.event(f"call failed: {exc}")
            return 1
        if isinstance(answer, Busy):
            screen.event(f"busy: the gateway refused the call ({answer.message})")
            return 1
        screen.event(f"answered: <Connect><Stream> {answer.url}")
        ticker = Ticker()
        ticker.start()
        # Twilio: the gateway ends each utterance with a mark (or a clear on barge-in), and
        # sends it ahead of real time, so an utterance starts with the first media after one.
        phone.playout.on_utterance = None
        boundary = [True]

        def on_event(kind: str, at: float, data: bytes | str) -> None:
            if kind == "media":
                assert isinstance(data, bytes)
                start, _ = phone.heard(at, data)
                if boundary[0]:
                    boundary[0] = False
                    screen.event(f"▶ utterance (plays at {start / 8000:.2f} s)", at)
            elif kind == "mark":
                boundary[0] = True
                screen.event(f"■ mark {data!s}: the gateway sent that utterance whole", at)
            elif kind == "clear":
                boundary[0] = True
                phone.cleared(at)

        caller = TwilioCaller(answer.url, answer.parameters, options.auth_token, call_sid,
                              ticker, on_event=on_event)
        try:
            try:
                await caller.connect(timeout_s=options.timeout_s)
            except Exception as exc:
                screen.event(f"call failed: the stream did not open: {describe(exc)}")
                return 1
            screen.event("stream open: you are on the line (keys 0-9 * #; q hangs up)")
            phone.open_speakers()
            await _run_input(phone, caller.press, caller.speak,
                             lambda: caller.heard.closed_at is not None)
        finally:
            await caller.hangup()
            await ticker.stop()
        heard = caller.heard
        if heard.closed_by_gateway:
            code = heard.close_code
            how = f"{code} {heard.close_reason}".strip()
            screen.event(f"the gateway ended the stream ({how})", heard.closed_at)
            phone.ended_by = phone.ended_by or "the gateway ended it"
            if answer.action:
                try:
                    after = await after_stream(http, answer, call_sid, options.auth_token,
                                               options.caller, options.to)
                except DialError as exc:
                    screen.event(f"<Connect action>: {exc}")
                    return 1
                if after.transfer_to:
                    screen.event(f"transfer: <Dial> {after.transfer_to}")
                    phone.ended_by = f"transferred to {after.transfer_to}"
                else:
                    screen.event("hang-up: <Hangup/>")
                    phone.ended_by = "the gateway hung up"
        return 0


async def _sip(options: CallOptions, phone: _Phone) -> int:
    from gateway.loadsim.sip_caller import CallFailed, CallTimeout, SipCaller
    from gateway.sip.sdp import SdpError

    host, port = sip_address(options.target)
    screen = phone.screen
    user = options.to.replace(" ", "")
    screen.event(f"dialling sip:{user}@{host}:{port} from {options.caller}: INVITE")
    def on_audio(at: float, payload: bytes, marker: bool) -> None:
        phone.heard(at, payload)

    caller = SipCaller(caller_id=options.caller.replace(" ", "") or "softphone",
                       on_audio=on_audio)
    try:
        try:
            await caller.call((host, port), user=user, timeout_s=options.timeout_s)
        except CallFailed as exc:
            screen.event(f"{'refused' if exc.refused else 'call failed'}: SIP {exc.status} "
                         f"{exc.reason}")
            return 1
        except (CallTimeout, SdpError, OSError) as exc:
            screen.event(f"call failed: {exc}")
            return 1
        screen.event(f"answered: 200 OK after {caller.setup_ms or 0:.0f} ms, RTP to "
                     f"{caller.remote_rtp[0] if caller.remote_rtp else '?'}:"
                     f"{caller.remote_rtp[1] if caller.remote_rtp else '?'} "
                     "(keys 0-9 * #; q hangs up)")
        phone.open_speakers()
        seen_transfer = [False]

        def gone() -> bool:
            if caller.transferred_to and not seen_transfer[0]:
                seen_transfer[0] = True
                screen.event(f"transfer: REFER to {caller.transferred_to} (a softphone "
                             "cannot follow it; the gateway ends the call)")
                phone.ended_by = f"transferred to {caller.transferred_to}"
            return caller.remote_hangup_at is not None

        await _run_input(phone, caller.send_dtmf, caller.speak, gone)
        if caller.remote_hangup_at is not None:
            screen.event("hang-up: the gateway sent BYE", caller.remote_hangup_at)
            phone.ended_by = phone.ended_by or "the gateway hung up"
        else:
            status = await caller.hangup()
            screen.event(f"BYE sent: {status or 'no answer'}")
    finally:
        await caller.aclose()
    return 0


async def place_call(options: CallOptions, out: IO[str] | None = None) -> int:
    """Place the call, run it until it ends, write the WAV; the exit code (1: not connected)."""
    # Imported before the clock starts: the event times are the call's, not the imports'.
    import gateway.loadsim.sip_caller
    import gateway.loadsim.twilio_caller  # noqa: F401

    phone = _Phone(options, out or sys.stdout)
    try:
        if is_twilio_target(options.target):
            return await _twilio(options, phone)
        return await _sip(options, phone)
    finally:
        phone.finish()
