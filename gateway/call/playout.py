"""Outbound audio of one call: a bounded buffer of 20 ms frames released on a monotonic schedule.

Pacing and backpressure are written once, here, for every transport. What differs between
transports is a :class:`PlayoutPolicy` the adapter declares:

- **RTP (SIP)**: nothing is buffered at the far end beyond its jitter buffer, so frames are
  released one per 20 ms beat (``lead_s = 0``) and silence fills the beats with nothing to say
  (continuous RTP keeps NAT bindings and the far end's media timers alive; a gap would also be
  heard as a click). A mark counts as played once the frame before it has been sent.
- **Twilio Media Streams**: Twilio buffers whatever it is sent and plays it in real time, so
  frames go out in batches up to ``lead_s`` ahead of the caller's playback (not a whole 20 s
  prompt: a caller who barges in after a second would have cost the rest, and a few hundred
  calls bursting whole prompts would starve everything else). Twilio echoes each mark once the
  audio before it has played; an echo moves the playback estimate forward.

Frame ``k`` of a run may be released ``lead_s`` before it is due at ``origin + k * frame_s``:
the schedule is a :class:`gateway.audio.pacer.Pacer` (deadlines by multiplication from one
anchor, so neither sleep overshoot nor float summation error accumulates: STYLE.md rule 5). A
stream with keep-alive silence that falls more than ``max_lag_frames`` behind (a stalled event
loop) re-anchors by the pacer's lag rule instead of bursting audio a jitter buffer would drop;
one without keep-alive re-anchors whenever the far end has played everything it was sent.

Backpressure: at most ``buffer_frames`` frames are buffered here. :meth:`Playout.push` of a
longer list (a whole cached prompt) queues what fits and waits for the rest until the buffer has
drained to half (so the producer wakes once per half-buffer, not once per 20 ms frame); live
speech is pulled from the speech service no faster than it can be played.

Start buffer (:attr:`PlayoutPolicy.start_buffer_s`): the first frame of a live utterance (one
begun with ``live=True``: its frames come from a speech stream as they are generated) is held
until it would play no earlier than the source's playback origin (the ``not_before`` its
producer passes to :meth:`Playout.push`) plus the policy's start buffer. The source (the speech
service) counts its lead from a listener who starts playing at its first chunk; the phone path
hands on less than it was given (the limiter's look-ahead, the resampler's delay and the
framer's partial frame wait for the next chunk, and trimmed leading silence is never sent), so a
caller who started at the first frame would be that much ahead of the source's listener and run
dry whenever a chunk arrives with less lead than the phone path holds (the stutter every live
utterance used to start with: 40 ms of an 80 ms first chunk sent, the next chunk 43-71 ms
later). Holding the start by exactly that deficit puts the caller's buffer level with the
source's lead at every later chunk; the start buffer is the margin on top (delivery jitter
between the engine thread, the event loop and the transport). The hold ends at once when the
utterance is complete (all its frames queued: a short sentence, a cached prompt that arrives
whole), never lasts more than ``max_start_hold_s``, and never applies mid-utterance: once an
utterance's first frame is out, its frames go as they come.

Underruns (:attr:`Playout.underruns`): a gap the caller hears in the middle of an utterance, as
the playout sees it. Twilio: the far end had played everything sent before the next frame of
the same utterance went. RTP: the far end is a phone with a fixed jitter buffer
(:attr:`PlayoutPolicy.far_end_buffer_s`, the load simulator's model of it): it starts playing an
utterance that long after its first frame went and needs each beat by then; a beat sent later
(a stalled event loop) or sent as silence while the utterance waited for audio is a gap, the
phone's schedule slipping by it. Reported to ``on_underrun`` with the utterance, the silence's
length and whether the utterance was starved (nothing of it queued here: it waited for its
source) rather than sent late (its audio was here, the event loop was not).

Hold (:attr:`Playout.paused`): nothing is released, so nothing is reported as played; what is
buffered stays, and the caller hears it from where it stopped once the call is resumed.

Barge-in (:meth:`Playout.interrupt`, STYLE.md rule 7): buffered audio is dropped and the far end
told to clear. Where the gateway owns what plays next (``fade_on_interrupt``, lead 0), the next
frame is first sent faded out (:func:`~gateway.audio.condition.fade_out_frame`) so the cut is
not a click.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from gateway.aio import cancel_and_wait
from gateway.audio.condition import fade_out_frame
from gateway.audio.pacer import FRAME_S, Pacer
from gateway.call.events import Codec
from gateway.clock import Clock

log = logging.getLogger(__name__)

__all__ = ["FrameSink", "Playout", "PlayoutPolicy", "Speaker", "start_buffer_setting"]

#: Slack when comparing a clock reading with a deadline computed from it (float rounding).
_EPS = 1e-6
#: Silence shorter than this between two frames of an utterance is not counted as an underrun
#: (the load simulator's caller models use the same tolerance).
UNDERRUN_TOLERANCE_S = 0.001


@dataclass(frozen=True)
class PlayoutPolicy:
    """How a transport's far end plays audio (declared by each transport adapter)."""

    #: Frames may be released this long before the caller would hear them.
    lead_s: float = 0.0
    #: Most frames per :meth:`FrameSink.send_frames` call (one message or packet).
    max_frames_per_send: int = 1
    #: Wait until this many frames may go before sending (fewer, larger messages); a far end
    #: that has played everything gets what there is at once.
    min_frames_per_send: int = 1
    #: Send codec silence on beats with nothing to play (RTP); otherwise send nothing.
    keepalive: bool = False
    #: A keep-alive stream this many frames behind re-anchors (RTP jitter buffers hold 40-100 ms).
    max_lag_frames: int = 5
    #: The far end reports marks (Twilio echoes them); otherwise a mark counts as played once the
    #: frame before it has been sent.
    far_end_marks: bool = False
    #: Fade the next frame out on barge-in. Only where the gateway owns what plays next
    #: (``lead_s == 0``): a far end that buffers audio has its own playback position.
    fade_on_interrupt: bool = False
    #: Most frames buffered here (beyond what the far end holds): :meth:`Playout.push` waits.
    buffer_frames: int = 100
    #: Start buffer of a live utterance (module docstring): its first frame is held until it
    #: would play this long after its source's playback origin. None: no hold (every frame goes
    #: as soon as it is queued, as before the start buffer existed; for comparison).
    start_buffer_s: float | None = None
    #: The start buffer takes off the lead the engine says its next chunk will leave
    #: (:attr:`gateway.tts.stream.SpeechStream.next_chunk_eta_s`): a device far faster than
    #: real time holds nothing. False: the fixed hold, whatever the engine says.
    start_buffer_adapts: bool = True
    #: The longest a first frame is held, counted from when it was queued (a source whose
    #: origin lies far back, hundreds of ms of trimmed silence, costs at most this).
    max_start_hold_s: float = 0.25
    #: With keep-alive (RTP): the far end's jitter buffer as underruns are counted (a phone's
    #: fixed buffer; adaptive ones hold 40-100 ms). Counting only: nothing waits for it.
    far_end_buffer_s: float = 0.04

    def __post_init__(self) -> None:
        if self.fade_on_interrupt and self.lead_s > 0:
            raise ValueError("fade_on_interrupt needs lead_s == 0: the far end plays its buffer")
        if not 1 <= self.min_frames_per_send <= self.max_frames_per_send:
            raise ValueError("need 1 <= min_frames_per_send <= max_frames_per_send")
        if self.buffer_frames < 2:
            raise ValueError("buffer_frames must be at least 2")
        if self.start_buffer_s is not None and not 0 <= self.start_buffer_s <= 1:
            raise ValueError("start_buffer_s must be None or within [0, 1] s")
        if self.max_start_hold_s < 0:
            raise ValueError("max_start_hold_s must be >= 0")

    def first_release_at(self, queued_at: float, not_before: float | None,
                         unplayed_s: float) -> float:
        """When the first frame of a live utterance may be released (never held: ``-inf``).

        ``queued_at``: when that frame was queued; ``not_before``: its source's playback origin
        (None: unknown, taken as ``queued_at``); ``unplayed_s``: audio already at the far end
        that plays before it (an earlier utterance's tail), which counts towards the hold.
        """
        if self.start_buffer_s is None:
            return -math.inf
        origin = queued_at if not_before is None else not_before
        at = origin + self.start_buffer_s - unplayed_s
        return min(at, queued_at + self.max_start_hold_s)


def start_buffer_setting(ms: int) -> float | None:
    """A ``GATEWAY_*_START_BUFFER_MS`` setting as :attr:`PlayoutPolicy.start_buffer_s`: seconds,
    or None (no hold) for a negative value."""
    return ms / 1000 if ms >= 0 else None


class FrameSink(Protocol):
    """The part of a transport adapter the playout drives."""

    codec: Codec

    async def send_frames(self, frames: list[bytes]) -> None:
        """Send whole 20 ms G.711 frames, in order (one message or packet)."""

    async def send_mark(self, name: str) -> None:
        """Ask the far end to report ``name`` once what was sent before it has played."""

    async def clear(self) -> None:
        """The far end drops what it has buffered (Twilio ``clear``; RTP: a new talkspurt)."""


class Speaker(Protocol):
    """Whose frames these are: the playout reports their release (an utterance)."""

    def frames_released(self, count: int, at: float) -> None: ...


class _Start:
    """Frames after this one belong to ``speaker``; a live utterance's first is held (the start
    buffer) until ``first_release_at`` says, or until the utterance is ``complete``."""

    __slots__ = ("complete", "live", "not_before", "queued_at", "speaker")

    def __init__(self, speaker: Speaker, live: bool) -> None:
        self.speaker = speaker
        self.live = live
        #: The source's playback origin (the producer's latest word on it).
        self.not_before: float | None = None
        #: When the utterance's first frame was queued.
        self.queued_at: float | None = None
        #: Every frame of the utterance is queued (its end, or the next utterance, follows).
        self.complete = False


class _Mark:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class _Clear:
    """Tell the far end to clear once the frames before this have gone (after a fade)."""

    __slots__ = ()


_Entry = bytes | _Start | _Mark | _Clear


class Playout:
    """One call's outbound frames: buffer, pace, release, mark, interrupt."""

    def __init__(
        self,
        sink: FrameSink,
        clock: Clock,
        policy: PlayoutPolicy,
        *,
        silence: bytes,
        on_played: Callable[[str], None],
        on_failure: Callable[[BaseException], None] | None = None,
        on_underrun: Callable[[Speaker, float, bool], None] | None = None,
    ) -> None:
        self._sink = sink
        self._clock = clock
        self.policy = policy
        self._silence = silence
        self._on_played = on_played
        self._on_failure = on_failure
        self._on_underrun = on_underrun
        self._lead_frames = policy.lead_s / FRAME_S
        self._buffer: collections.deque[_Entry] = collections.deque()
        #: Frames in the buffer (control entries not counted).
        self.buffered = 0
        self._speaker: Speaker | None = None
        # The latest utterance begun (the producer's pushes update its start), and the one whose
        # first frame waits at the head (the start buffer's hold).
        self._open: _Start | None = None
        self._starting: _Start | None = None
        # The utterance whose frames are going out (first frame released, end not yet reached),
        # and since when it has had nothing at the far end (an underrun in progress).
        self._playing: Speaker | None = None
        self._dry_since: float | None = None
        # RTP: the far end's playback of the utterance going out (its jitter buffer's schedule:
        # beat k is needed at origin + k frames; it slips where a beat came late), and the
        # silence sent since its last audio.
        self._far = Pacer(clock, FRAME_S, max_lag_frames=None)
        self._dry_s = 0.0
        # The send schedule: the run's anchor and the frames released in it.
        self._pacer = Pacer(clock, FRAME_S, policy.max_lag_frames)
        # Twilio: where each outstanding mark sits in the current run (frames released before it).
        self._mark_at: dict[str, int] = {}
        self._wake = asyncio.Event()
        self._space = asyncio.Event()
        self._space.set()
        # A waiting producer is woken once the buffer is down to this.
        self._low = policy.buffer_frames // 2
        # Bumped by interrupt(): a push still under way stops queueing its (dropped) audio.
        self._epoch = 0
        self._task: asyncio.Task[None] | None = None
        self._paused = False
        self._resumed = asyncio.Event()
        self._resumed.set()
        #: Frames released since the call began (audio, fades and keep-alive silence).
        self.frames_released = 0
        #: Barge-in fades sent.
        self.fades = 0
        #: Underruns (module docstring) since the call began, and their silence in seconds.
        self.underruns = 0
        self.underrun_s = 0.0

    # --- producer side ------------------------------------------------------------------------

    def begin(self, speaker: Speaker, *, live: bool = False) -> None:
        """Frames pushed from now on belong to ``speaker`` (it hears when they are released).

        ``live``: they come from a source as it generates them (a speech stream), so the first
        is held for the policy's start buffer (module docstring); a prompt played from memory
        (``live=False``) is all in hand and starts at once.
        """
        self._close_open()
        entry = _Start(speaker, live)
        self._open = entry
        self._buffer.append(entry)
        self._wake.set()

    def end(self) -> None:
        """Every frame of the utterance begun last is queued: its start is held no longer."""
        self._close_open()

    def _close_open(self) -> None:
        entry, self._open = self._open, None
        if entry is not None and not entry.complete:
            entry.complete = True
            if entry is self._starting:
                self._wake.set()

    async def push(self, frames: list[bytes], *, not_before: float | None = None) -> None:
        """Queue ``frames`` in order, never more than ``buffer_frames`` at a time: waits for
        room (backpressure on the producer). Returns once the last one is queued, or at once
        after an :meth:`interrupt` (what was not queued yet is dropped with the rest).

        ``not_before``: the source's playback origin for a live utterance (module docstring):
        the time from which its source counts the lead of what it has handed on, moved later by
        the audio the producer holds back or dropped. Only its latest value before the first
        frame is released counts.
        """
        entry = self._open
        if entry is not None and frames:
            if not_before is not None:
                entry.not_before = not_before
            if entry.queued_at is None:
                entry.queued_at = self._clock.now()
        bound = self.policy.buffer_frames
        epoch = self._epoch
        start, count = 0, len(frames)
        while start < count:
            room = bound - self.buffered
            if room <= 0:
                self._space.clear()
                await self._space.wait()
                if self._epoch != epoch:
                    return
                continue
            end = min(count, start + room)
            self._buffer.extend(frames[start:end] if start or end < count else frames)
            self.buffered += end - start
            start = end
            self._wake.set()

    def mark(self, name: str) -> None:
        """Report ``name`` as played once every frame queued before it has played (it ends
        the utterance begun last: see :meth:`end`)."""
        self._close_open()
        self._buffer.append(_Mark(name))
        self._wake.set()

    async def interrupt(self) -> None:
        """Barge-in: drop what is buffered, fade out where we own the stream, clear the far end.

        Marks still in the buffer are dropped with their audio: their utterances were not heard.
        """
        fade: bytes | None = None
        if self.policy.fade_on_interrupt:
            fade = next((e for e in self._buffer if isinstance(e, bytes)), None)
        self._buffer.clear()
        self.buffered = 0
        self._speaker = None
        self._open = self._starting = None
        self._end_playing()
        self._epoch += 1
        self._space.set()
        self._mark_at.clear()
        if fade is not None:
            self._buffer.append(fade_out_frame(fade, self._sink.codec))
            self._buffer.append(_Clear())
            self.fades += 1
            self._wake.set()
            return
        if not self.policy.keepalive:
            self._pacer.stop()  # the far end's buffer is empty: the next frame plays now
            self._wake.set()
        await self._sink.clear()

    def far_end_played(self, name: str) -> None:
        """The far end echoed mark ``name``: everything sent before it has been played."""
        position = self._mark_at.pop(name, None)
        if position is None or not self._pacer.anchored:
            return
        # Only ever move the estimate forward: a mark says playback is at least this far along
        # (it may have arrived late), so the lead can shrink on it but never grow.
        self._pacer.played_at(position, self._clock.now())

    # --- state --------------------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        """On hold: nothing is released (nor reported as played); the buffer waits."""
        return self._paused

    @paused.setter
    def paused(self, value: bool) -> None:
        if value == self._paused:
            return
        self._paused = value
        if value:
            self._resumed.clear()
            self._end_playing()  # the silence of a hold is the caller's, not an underrun
        else:
            if self.policy.keepalive:
                # We own the stream: it starts again now, the next frame due at once, not where
                # the schedule before the hold would have put it.
                self._pacer.stop()
            self._resumed.set()
            self._wake.set()

    def unplayed_s(self) -> float:
        """Seconds released to the far end and not yet played there, as far as we can tell."""
        pacer = self._pacer
        if not pacer.anchored:
            return 0.0
        return max(0.0, pacer.lead_s(self._clock.now()))

    @property
    def idle(self) -> bool:
        """Nothing buffered here."""
        return not self._buffer

    # --- the release loop ---------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="playout")

    async def close(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task, log=log, what="playout")

    async def _run(self) -> None:
        try:
            await self._loop()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("playout failed")
            if self._on_failure is not None:
                self._on_failure(exc)

    async def _loop(self) -> None:
        policy = self.policy
        clock = self._clock
        pacer = self._pacer
        while True:
            if self._paused:
                await self._resumed.wait()
                continue
            if not self._buffer and not policy.keepalive:
                self._wake.clear()
                await self._wake.wait()
                continue
            now = clock.now()
            self._anchor(now)
            # Handle control entries at the head at once: they take no time on the wire.
            head = self._buffer[0] if self._buffer else None
            if head is not None and not isinstance(head, bytes):
                self._buffer.popleft()
                await self._control(head)
                continue
            # The start buffer: a live utterance's first frame waits (module docstring).
            hold_until = self._hold_until(now) if head is not None else None
            if hold_until is not None and not policy.keepalive:
                self._wake.clear()  # woken early when the utterance turns out complete
                with contextlib.suppress(TimeoutError):
                    await clock.wait_for(self._wake.wait(), hold_until - now)
                continue
            room = pacer.room(now, self._lead_frames)
            # Batch while the far end has audio to play (fewer messages), but never hold back a
            # short tail: what is buffered now is all there is to send.
            want = 1
            if pacer.frames > pacer.elapsed(now) + _EPS:
                want = max(1, min(policy.min_frames_per_send, self.buffered))
            if room < want:
                due = pacer.due(want - 1, self._lead_frames)
                if policy.keepalive:
                    await clock.sleep(due - now)  # the next beat; nothing moves it earlier
                else:
                    # A barge-in empties the far end's buffer: the next prompt must not wait
                    # for room that the cleared audio was taking.
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await clock.wait_for(self._wake.wait(), due - now)
                continue
            # On a held beat (RTP) silence goes out, as on any beat with nothing to say.
            frames = [] if hold_until is not None else self._take(
                min(room, policy.max_frames_per_send))
            speaker = self._speaker
            if not frames:
                if not policy.keepalive:
                    continue
                frames = [self._silence]
                speaker = None  # keep-alive silence is nobody's audio
            if policy.keepalive:
                self._beat(speaker, now)
            elif speaker is not None:
                self._started(speaker, now)
            await self._sink.send_frames(frames)
            pacer.sent(len(frames))
            self.frames_released += len(frames)
            if speaker is not None:
                # Stamped once the transport has taken the frames: what the caller waits for.
                speaker.frames_released(len(frames), clock.now())

    def _hold_until(self, now: float) -> float | None:
        """While the head frame is a live utterance's first and its start buffer is not full:
        until when it waits (None: no hold)."""
        start = self._starting
        if start is None:
            return None
        if start.complete or start.queued_at is None:
            self._starting = None
            return None
        at = self.policy.first_release_at(start.queued_at, start.not_before, self.unplayed_s())
        if at <= now + _EPS:
            self._starting = None
            return None
        return at

    def _started(self, speaker: Speaker, now: float) -> None:
        """Twilio: frames of ``speaker`` go out now: its first ones, or ones ending an
        underrun (the far end ran dry at ``_dry_since``)."""
        self._starting = None
        if self._playing is not speaker:
            self._playing, self._dry_since = speaker, None
            return
        dry_since, self._dry_since = self._dry_since, None
        if dry_since is not None:
            self._underrun(speaker, now - dry_since, starved=True)

    def _beat(self, speaker: Speaker | None, now: float) -> None:
        """RTP: a beat goes out now, ``speaker``'s frame or silence (None); a phone with a fixed
        jitter buffer would hear a gap where it comes late or silent mid-utterance."""
        if speaker is not None and self._playing is not speaker:
            # The utterance's first frame: the phone plays it a jitter buffer from now.
            self._starting = None
            self._playing = speaker
            far = self._far
            far.start(now + self.policy.far_end_buffer_s)
            far.sent(1)
            self._dry_s = 0.0
            return
        playing = self._playing
        if playing is None:
            return
        far = self._far
        stall = now - far.due()
        far.sent(1)
        if stall > _EPS:
            far.slip(stall)  # the phone played nothing meanwhile: its clock slips
        else:
            stall = 0.0
        if speaker is None:
            self._dry_s += stall + FRAME_S
            return
        dry, self._dry_s = self._dry_s, 0.0
        self._underrun(playing, dry + stall, starved=dry > 0)

    def _underrun(self, speaker: Speaker, silence: float, *, starved: bool) -> None:
        if silence > UNDERRUN_TOLERANCE_S:
            self.underruns += 1
            self.underrun_s += silence
            if self._on_underrun is not None:
                self._on_underrun(speaker, silence, starved)

    def _end_playing(self) -> None:
        self._playing = None
        self._dry_since = None
        self._dry_s = 0.0

    def _anchor(self, now: float) -> None:
        pacer = self._pacer
        if not pacer.anchored:
            pacer.start(now)
            return
        if self.policy.keepalive:
            pacer.catch_up(now)
        elif pacer.lead_s(now) <= 0.0:
            # The far end has played everything: playback restarts with the next frame. Mid-
            # utterance that is an underrun, silent since the last frame finished playing.
            if self._playing is not None and self._dry_since is None:
                self._dry_since = pacer.due()
            pacer.start(now)
            self._mark_at.clear()  # their positions were in the old run, all played by now

    def _take(self, limit: int) -> list[bytes]:
        buffer = self._buffer
        frames: list[bytes] = []
        while buffer and len(frames) < limit:
            entry = buffer[0]
            if not isinstance(entry, bytes):
                break
            frames.append(entry)
            buffer.popleft()
        if frames:
            # A fade frame after interrupt() was never counted in ``buffered``.
            self.buffered = max(0, self.buffered - len(frames))
            if self.buffered <= self._low:
                self._space.set()
        return frames

    async def _control(self, entry: _Start | _Mark | _Clear) -> None:
        # Whatever the entry, the utterance going out has reached its end (its mark, the next
        # utterance, a barge-in's clear): silence from here on is not an underrun.
        self._end_playing()
        if isinstance(entry, _Start):
            self._speaker = entry.speaker
            self._starting = entry if entry.live else None
        elif isinstance(entry, _Mark):
            if self.policy.far_end_marks:
                self._mark_at[entry.name] = self._pacer.frames
                await self._sink.send_mark(entry.name)
            else:
                self._on_played(entry.name)
        else:
            await self._sink.clear()
