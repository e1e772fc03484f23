"""The batched engine core's policy: state in, a plan out (vLLM v1's ``Scheduler`` shape).

A pure scheduler: no threads, no torch, no clock of its own. The core's loop
(:mod:`gateway.tts.core`) asks it, once per iteration and in this order, what to do, does it,
and tells it what it measured:

1. :meth:`Scheduler.admit` -- **reap and admit.** Turns whose consumer stopped (hang-up,
   barge-in, abandoned by the service) leave, and so does a turn whose consumer took nothing for
   ``consumer_stall_s`` (it is cancelled). While rows are free, waiting turns take them in
   deadline order (the caller's turn time plus the first-audio budget).
2. :meth:`Scheduler.plan_prefill` -- **prefill, first priority, bounded.** Newcomers' prompts go
   through the talker between steps, most urgent first. How much runs is bounded by the playing
   rows' slack: a row's lead (audio delivered but not yet played) minus what its next chunk still
   needs (a measured step per missing frame, and its decode). At least one chunk runs per
   iteration, so a newcomer is never starved; a burst of newcomers whose prompts are one chunk
   each is prefilled together when the budget allows, so every one of them gets its first frame
   from the same step.
3. :meth:`Scheduler.plan_step` -- **who advances.** Every ready row, except rows that sit this
   step out: a streaming-text row that has read all the text it has (a text underrun: it would
   read padding), a row whose consumer holds ``max_backlog`` chunks it has not taken
   (backpressure), and
   a row more than ``ahead_high_s`` ahead of playback while another turn waits for its first audio
   or is about to run dry (until its lead is down to ``ahead_low_s``). Then the order rows' due
   chunks are decoded in: turns waiting for first audio first, then by lead.
4. :meth:`Scheduler.stepped`, :meth:`Scheduler.prefilled`, :meth:`Scheduler.decoded` -- the
   measured costs the next plans use (moving averages: step seconds per batch bucket, prefill
   seconds per prompt token, decode seconds per call); :meth:`Scheduler.next_chunk_eta` -- when
   a turn's next chunk should come, for the phone path's start buffer.

What the scheduler reads of a turn is two narrow views, so that it can be driven by values in
tests: the consumer's side (:class:`TurnSink`: lead, backlog, whether it stopped) and the
engine's row (:class:`RowView`: ready, finished, prompt tokens, frames to the next chunk). It is
unit-tested on virtual time (tests/test_tts_scheduler_policy.py).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "Admission",
    "Costs",
    "PrefillPlan",
    "RowView",
    "Scheduler",
    "SchedulerConfig",
    "StepPlan",
    "Turn",
    "TurnSink",
]


class TurnSink(Protocol):
    """The consumer's side of a turn, as the scheduler reads it (a snapshot per call)."""

    @property
    def stopping(self) -> bool:
        """The consumer wants no more audio (cancelled, or failed by the service)."""

    @property
    def cancelled(self) -> bool:
        """Stopped by its consumer (hang-up, barge-in), as opposed to failed by the service."""

    @property
    def playing(self) -> bool:
        """Its first chunk was delivered."""

    @property
    def backlog(self) -> int:
        """Chunks delivered that the consumer has not taken yet."""

    def lead(self, now: float) -> float:
        """Seconds of delivered audio not yet played (0 before the first chunk)."""


class RowView(Protocol):
    """The engine's row of a turn, as the scheduler reads it."""

    ready: bool
    finished: str | None
    prefilled: int

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def prefilling(self) -> bool: ...

    @property
    def frames_to_chunk(self) -> int: ...

    @property
    def waiting_for_text(self) -> bool: ...


@dataclass(eq=False)
class Turn:
    """One turn the core owns: its consumer, its deadline and, once admitted, its row."""

    sink: TurnSink
    deadline: float
    #: Anything the core keeps with the turn (its request, its call id for logs).
    payload: Any = None
    #: The engine row once opened (None while waiting, or after its row was lost).
    row: RowView | None = None
    #: Started over once already after a failed step (a second failure fails it).
    restarted: bool = False
    #: Sitting out for an urgent turn (hysteresis between ahead_high_s and ahead_low_s).
    paused: bool = False
    #: Since when it has waited on its consumer (None: not waiting).
    blocked_since: float | None = None
    #: Sitting out because its streamed text has not arrived (a text underrun under way).
    text_wait: bool = False

    @property
    def waiting_for_first_audio(self) -> bool:
        return not self.sink.playing


@dataclass(frozen=True)
class SchedulerConfig:
    """The policy's knobs (see the module docstring)."""

    max_rows: int
    #: Prompt tokens per prefill chunk (0: whole prompts), fixed per engine.
    prefill_chunk: int = 0
    ahead_low_s: float = 0.5
    ahead_high_s: float = 1.0
    #: A row sits out while its consumer holds this many chunks it has not taken.
    max_backlog: int = 2
    #: A consumer that takes nothing for this long has abandoned its turn: it is cancelled.
    consumer_stall_s: float = 30.0
    #: Margin kept between the slack estimate and the next step when budgeting prefill work.
    prefill_safety_s: float = 0.02

    def __post_init__(self) -> None:
        if self.max_rows < 1:
            raise ValueError("max_rows must be >= 1")
        if not 0 <= self.ahead_low_s <= self.ahead_high_s:
            raise ValueError("need 0 <= ahead_low_s <= ahead_high_s")
        if self.max_backlog < 1:
            raise ValueError("max_backlog must be >= 1")


@dataclass
class Costs:
    """Measured costs, as moving averages (the newest measurement weighs 0.3)."""

    #: Seconds per step, by the batch size it ran at.
    step_s: dict[int, float] = field(default_factory=dict)
    #: Seconds per prompt token through the talker (None until a prefill was measured).
    prefill_s_per_token: float | None = None
    #: Seconds per decode call.
    decode_s: float = 0.0

    def step_for(self, rows: int) -> float:
        """The measured step time of the smallest bucket that holds ``rows`` (else the
        largest measured; 0 before any step)."""
        for size in sorted(self.step_s):
            if size >= rows:
                return self.step_s[size]
        return self.step_s[max(self.step_s)] if self.step_s else 0.0


@dataclass
class Admission:
    """What :meth:`Scheduler.admit` decided."""

    #: Running turns that leave now, each with whether its consumer cancelled it (else it was
    #: failed or abandoned by the service).
    leave: list[tuple[Turn, bool]] = field(default_factory=list)
    #: Queued turns whose consumer stopped before they got a row.
    dropped: list[Turn] = field(default_factory=list)
    #: Turns whose consumer stalled: cancel them (they leave at the next admit).
    stalled: list[Turn] = field(default_factory=list)
    #: Turns that took a free row: open their rows.
    admit: list[Turn] = field(default_factory=list)


@dataclass
class PrefillPlan:
    """What :meth:`Scheduler.plan_prefill` decided: a group prefilled in one call, then chunks
    of one turn each, in this order."""

    together: list[Turn] = field(default_factory=list)
    #: ``(turn, tokens)``: run the turn's next prefill chunk of ``tokens`` tokens.
    chunks: list[tuple[Turn, int]] = field(default_factory=list)
    #: Seconds the playing rows can spare (inf while nobody is playing).
    budget_s: float = math.inf

    def __bool__(self) -> bool:
        return bool(self.together or self.chunks)


@dataclass
class StepPlan:
    """What :meth:`Scheduler.plan_step` decided."""

    #: Turns whose rows advance this step.
    rows: list[Turn] = field(default_factory=list)
    #: Turns sitting out, by reason, and rows still prefilling.
    backpressure: int = 0
    urgency: int = 0
    prefilling: int = 0
    #: Streaming-text turns that read all their text so far and wait for more.
    text: int = 0
    #: Newly started waits: backpressure waits, urgency pauses and text underruns (for the
    #: counters).
    new_backpressure_waits: int = 0
    new_pauses: int = 0
    new_text_underruns: int = 0
    #: Turns whose consumer must wake the core when it takes a chunk (they sit out for it).
    blocked: list[Turn] = field(default_factory=list)
    #: The order due chunks are decoded in (first-audio turns first, then by lead).
    decode: list[Turn] = field(default_factory=list)


class Scheduler:
    """The policy of one engine core: a waiting queue by deadline and the running turns."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.costs = Costs()
        self.running: list[Turn] = []
        self._waiting: list[tuple[float, int, Turn]] = []
        self._seq = itertools.count()

    # --- the queue ------------------------------------------------------------------------------

    def add(self, turn: Turn) -> None:
        """Queue ``turn`` by its deadline (ties: first come, first served)."""
        heapq.heappush(self._waiting, (turn.deadline, next(self._seq), turn))

    @property
    def waiting(self) -> int:
        """Queued turns whose consumer still wants them."""
        return sum(1 for _, _, turn in self._waiting if not turn.sink.stopping)

    def take_waiting(self) -> list[Turn]:
        """Empty the queue (its turns go elsewhere or fail), most urgent first."""
        turns = [turn for _, _, turn in sorted(self._waiting, key=lambda e: e[:2])]
        self._waiting.clear()
        return turns

    def remove(self, turn: Turn) -> None:
        """``turn`` leaves the running set (finished, failed or left)."""
        if turn in self.running:
            self.running.remove(turn)

    # --- 1. reap and admit --------------------------------------------------------------------

    def admit(self, now: float, free_rows: int) -> Admission:
        """Who leaves, who stalled, and which waiting turns take the ``free_rows`` rows.

        Turns that leave are taken off the running set here; stopped turns still queued are
        dropped from the queue (``dropped``, never admitted).
        """
        config = self.config
        out = Admission()
        for turn in list(self.running):
            sink = turn.sink
            if (turn.blocked_since is not None and not sink.stopping
                    and now - turn.blocked_since > config.consumer_stall_s):
                out.stalled.append(turn)
            elif sink.stopping:
                self.running.remove(turn)
                out.leave.append((turn, sink.cancelled))
        free = free_rows - sum(1 for t in self.running if t.row is None)
        while self._waiting and (free > 0 or self._waiting[0][2].sink.stopping):
            _, _, turn = heapq.heappop(self._waiting)
            if turn.sink.stopping:
                out.dropped.append(turn)
                continue
            self.running.append(turn)
            out.admit.append(turn)
            free -= 1
        return out

    # --- 2. prefill ---------------------------------------------------------------------------

    def plan_prefill(self, now: float, *, together: bool = True) -> PrefillPlan:
        """The prefill work that fits the playing rows' slack (at least one chunk)."""
        config = self.config
        costs = self.costs
        pending = sorted((t for t in self.running if t.row is not None and t.row.prefilling
                          and not t.sink.stopping), key=lambda t: t.deadline)
        if not pending:
            return PrefillPlan()
        step = costs.step_for(sum(1 for t in self.running if t.row is not None))
        slacks = [t.sink.lead(now) - max(1, t.row.frames_to_chunk) * step - costs.decode_s
                  for t in self.running
                  if t.row is not None and t.row.ready and t.row.finished is None
                  and t.sink.playing]
        budget = (min(slacks) - config.prefill_safety_s) if slacks else math.inf
        plan = PrefillPlan(budget_s=budget)
        rate = costs.prefill_s_per_token
        spent = 0.0
        if together:
            tokens = 0
            for turn in pending:
                row = turn.row
                assert row is not None
                if row.prefilled or (config.prefill_chunk > 0
                                     and row.prompt_tokens > config.prefill_chunk):
                    break
                estimate = rate * (tokens + row.prompt_tokens) if rate is not None else 0.0
                if plan.together and estimate > budget:
                    break
                plan.together.append(turn)
                tokens += row.prompt_tokens
            if len(plan.together) < 2:
                plan.together = []
            else:
                spent = rate * tokens if rate is not None else 0.0
        ran = bool(plan.together)
        grouped = {id(t) for t in plan.together}
        for turn in pending:
            if id(turn) in grouped:
                continue
            row = turn.row
            assert row is not None
            left = row.prompt_tokens - row.prefilled
            while left > 0:
                tokens = left if config.prefill_chunk <= 0 else min(config.prefill_chunk, left)
                estimate = rate * tokens if rate is not None else 0.0
                if ran and spent + estimate > budget:
                    return plan
                plan.chunks.append((turn, tokens))
                spent += estimate
                ran = True
                left -= tokens
        return plan

    # --- 3. the step ----------------------------------------------------------------------------

    def plan_step(self, now: float) -> StepPlan:
        """The rows that advance this step (the others sit it out, for reasons counted) and
        the order due chunks are decoded in."""
        config = self.config
        plan = StepPlan()
        live = [t for t in self.running if not t.sink.stopping]
        ready = [t for t in live if t.row is not None and t.row.ready and t.row.finished is None]
        waiting_first = any(t.waiting_for_first_audio for t in live)
        leads = {id(t): t.sink.lead(now) for t in ready}
        # Rows already playing that are about to run out: far-ahead rows make room for them.
        at_risk = [t for t in ready if t.sink.playing and leads[id(t)] < config.ahead_low_s]
        for turn in ready:
            assert turn.row is not None
            if turn.row.waiting_for_text:
                # Stepping it would read padding where its next word belongs.
                if not turn.text_wait:
                    turn.text_wait = True
                    plan.new_text_underruns += 1
                plan.text += 1
                continue
            turn.text_wait = False
            if turn.sink.backlog >= config.max_backlog:
                if turn.blocked_since is None:
                    turn.blocked_since = now
                    plan.new_backpressure_waits += 1
                plan.blocked.append(turn)
                plan.backpressure += 1
                continue
            turn.blocked_since = None
            lead = leads[id(turn)]
            others_need = waiting_first or any(o is not turn for o in at_risk)
            if turn.paused and (not others_need or lead <= config.ahead_low_s):
                turn.paused = False
            elif not turn.paused and others_need and lead > config.ahead_high_s:
                turn.paused = True
                plan.new_pauses += 1
            if turn.paused:
                plan.urgency += 1
                continue
            plan.rows.append(turn)
        plan.prefilling = sum(1 for t in self.running if t.row is not None and t.row.prefilling)
        decodable = [t for t in live if t.row is not None and t.row.ready]
        plan.decode = sorted(decodable, key=lambda t: (not t.waiting_for_first_audio,
                                                       t.sink.lead(now)))
        return plan

    # --- 4. measured costs ----------------------------------------------------------------------

    def stepped(self, bucket: int, seconds: float) -> None:
        """A step ran at batch size ``bucket`` in ``seconds``."""
        previous = self.costs.step_s.get(bucket)
        self.costs.step_s[bucket] = seconds if previous is None else (
            0.7 * previous + 0.3 * seconds)

    def prefilled(self, tokens: int, seconds: float) -> None:
        """A prefill call of ``tokens`` prompt tokens took ``seconds``."""
        if tokens <= 0:
            return
        per_token = seconds / tokens
        rate = self.costs.prefill_s_per_token
        self.costs.prefill_s_per_token = per_token if rate is None else (
            0.7 * rate + 0.3 * per_token)

    def decoded(self, seconds: float) -> None:
        """A decode call took ``seconds``."""
        self.costs.decode_s = 0.7 * self.costs.decode_s + 0.3 * seconds

    def next_chunk_eta(self, frames_to_chunk: int) -> float | None:
        """In how many seconds a running turn's next chunk, ``frames_to_chunk`` frames away,
        should come: its frames at the measured step time for the rows running, then a decode
        (None before a step and a decode were measured: no estimate beats a zero). The phone
        path's start buffer reads it off a turn's first chunk, through the turn's stream, which
        adds what it measured of such estimates' errors (:class:`gateway.tts.stream.EtaMargin`).
        """
        costs = self.costs
        if not costs.step_s or costs.decode_s <= 0:
            return None
        return frames_to_chunk * costs.step_for(len(self.running)) + costs.decode_s

    # --- waiting ----------------------------------------------------------------------------------

    def work_appeared(self, free_rows: int) -> bool:
        """Something to do that no one woke the core for: a waiting turn for a free row, or a
        blocked turn whose consumer took its chunks."""
        if self._waiting and free_rows > 0:
            return True
        return any(t.blocked_since is not None and t.sink.backlog < self.config.max_backlog
                   for t in self.running)

    def idle_timeout(self, now: float) -> float:
        """How long nothing changes by itself: until a paused row's lead falls to
        ``ahead_low_s`` (consumers, cancels and new turns wake the core sooner)."""
        waits = [max(0.005, t.sink.lead(now) - self.config.ahead_low_s)
                 for t in self.running if t.paused]
        if any(t.blocked_since is not None for t in self.running):
            waits.append(1.0)  # re-check the consumer-stall limit now and then
        return min(waits, default=0.05)

    def restart(self, turns: Sequence[Turn]) -> None:
        """After a failed step: ``turns`` lost their rows and start over (once)."""
        for turn in turns:
            turn.row = None
            turn.restarted = True
            turn.paused = False
            turn.blocked_since = None
