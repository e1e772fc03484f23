"""What the load simulator measures, how it aggregates, and the SLO it checks.

Every placed call ends one of three ways, counted apart everywhere (tables, plots, the SLO):

- *completed*: the scenario ran to its end;
- *refused*: the gateway said "not now" - the busy TwiML (``<Say>`` + ``<Hangup/>``) from the
  voice webhook, a Media Stream closed 1013 ("try again later"), SIP 486/503/600. A refusal is
  the gateway protecting the calls it has; it is not a failure, but it says the offered load is
  more than it takes;
- *failed*: something broke, and :attr:`CallRecord.error` says what, precisely enough to group
  on: the WebSocket close code and reason, the SIP status, which turn timed out.

The JSON document these classes serialise to is the simulator's result file (one per run, one
per worker process, mergeable across hosts) and the input of :mod:`gateway.loadsim.report`.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from gateway.errors import GatewayError
from gateway.loadsim.emodel import estimate

#: Mouth-to-ear delay the E-model is given on top of the network: one 20 ms packet plus the
#: 40 ms jitter buffer the simulated phone plays out through.
PACKETISATION_MS = 20.0
JITTER_BUFFER_MS = 40.0
#: The latency the simulator's own lateness is compared with when no SLO gives one: the
#: first-audio bound callers notice (the SLOs in docs/sizing.md use it). A 2 ms timing error cannot
#: change what a caller feels about a 3 ms prompt, and it cannot flip a 200 ms verdict.
DEFAULT_LATENCY_BOUND_MS = 200.0


class SloError(GatewayError):
    """An SLO expression that cannot be understood."""


@dataclass
class Turn:
    """One caller turn and what the caller felt after it."""

    kind: str  # answer | dtmf | barge_in | speech
    at_s: float  # since the run started
    first_audio_ms: float | None = None
    gaps: int = 0
    gap_ms: float = 0.0
    barge_in_ms: float | None = None
    timed_out: bool = False
    #: The keys pressed in this turn ("" for the answer).
    keys: str = ""
    #: Characters of the live sentence that answered this turn, once heard to its end (the
    #: ``live`` scenario); 0 when unknown or cached.
    chars: int = 0
    #: ``agent`` scenario: the bot's first token of its answer -> the caller's first audio.
    token_audio_ms: float | None = None


@dataclass
class CallRecord:
    """One simulated call: completed, refused (``refused`` says how) or failed (``error``)."""

    id: str
    level: int
    transport: str = "twilio"
    setup_ms: float | None = None
    #: Why the call failed, in words stable enough to group calls on (no per-call ids).
    error: str | None = None
    #: How the gateway refused the call (busy TwiML, close 1013, SIP 486/503/600).
    refused: str | None = None
    #: The gateway ended the call before the caller's scenario was over.
    dropped: bool = False
    turns: list[Turn] = field(default_factory=list)
    jitter_ms: float | None = None
    loss_pct: float | None = None
    mark_rtt_ms: list[float] = field(default_factory=list)
    audio_ms: float = 0.0
    started_s: float = 0.0
    ended_s: float = 0.0
    #: Where the gateway transferred the call (TwiML <Dial> after the stream, SIP REFER).
    transferred_to: str | None = None
    #: The call's id on the wire (Twilio CallSid, SIP Call-ID): what the gateway logs it as.
    call_id: str | None = None

    @property
    def outcome(self) -> str:
        """``completed``, ``refused`` or ``failed``."""
        if self.error:
            return "failed"
        return "refused" if self.refused else "completed"

    def fail(self, cause: str) -> None:
        """Record why the call failed, unless an earlier cause was already recorded."""
        if self.error is None and self.refused is None:
            self.error = cause

    def refuse(self, how: str) -> None:
        """Record that the gateway refused the call (unless it had already failed)."""
        if self.error is None and self.refused is None:
            self.refused = how

    @property
    def gap_ms(self) -> float:
        return sum(t.gap_ms for t in self.turns)

    @property
    def gaps(self) -> int:
        return sum(t.gaps for t in self.turns)

    def emodel(self) -> tuple[float, float] | None:
        """(R-factor, MOS) from the call's one-way delay and effective loss (gaps as loss)."""
        if self.audio_ms <= 0:
            return None
        loss = self.loss_pct if self.loss_pct is not None else 0.0
        loss = max(loss, 100.0 * self.gap_ms / max(self.audio_ms, 1.0))
        delay = PACKETISATION_MS + JITTER_BUFFER_MS + (self.jitter_ms or 0.0) * 2
        result = estimate(delay, min(loss, 100.0))
        return result.r, result.mos

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CallRecord:
        """Read a call back (fields this version does not know, from other versions, are
        dropped)."""
        known = {f.name for f in fields(Turn)}
        turns = [Turn(**{k: v for k, v in t.items() if k in known})
                 for t in data.get("turns", [])]
        names = {f.name for f in fields(cls)} - {"turns"}
        return cls(**{k: v for k, v in data.items() if k in names}, turns=turns)


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None, "p99": None, "max": None}
    arr = np.asarray(values, dtype=float)
    return {"p50": float(np.percentile(arr, 50)), "p95": float(np.percentile(arr, 95)),
            "p99": float(np.percentile(arr, 99)), "max": float(arr.max())}


def _grouped(causes: list[str]) -> dict[str, int]:
    return dict(Counter(causes).most_common())


@dataclass
class Level:
    """Aggregates of every call placed at one load level."""

    concurrency: int
    calls: list[CallRecord]
    lateness_ms: list[float] = field(default_factory=list)
    #: Withhold latency figures when the simulator's own p99 lateness exceeds this fraction of
    #: the p50 first-audio latency it measured...
    withhold_fraction: float = 0.25
    #: ...or of the tightest latency bound of the SLO being checked (without one,
    #: :data:`DEFAULT_LATENCY_BOUND_MS`), whichever is larger: a 2 ms timing error cannot flip a
    #: verdict on "p95 < 200 ms" even if the figure itself is only 5 ms. Cached prompts answer
    #: in milliseconds, so comparing with the p50 alone withheld every cached run.
    slo_bound_ms: float | None = None
    #: Wall-clock seconds the level ran (first dial to the last call's end).
    duration_s: float | None = None
    #: How load was offered: concurrency (callers redial), rate (Poisson arrivals) or ramp.
    pattern: str = "concurrency"
    #: What the gateway's own /metrics counted during the level (turns by source, refusals),
    #: when it could be read.
    gateway: dict[str, float] | None = None
    #: The speech the level meant to measure: ``cached`` (prompts from the cache) or ``live``.
    speech: str | None = None
    #: The gateway it ran against, when a document holds levels of several.
    target: str | None = None
    #: The load offered, as people read it: "×20" callers, "5/s" arrivals, "×1→20" a ramp.
    offered: str | None = None

    def gateway_failures(self) -> dict[str, int]:
        """Turns the gateway's own /metrics say it failed during the level, by cause."""
        failures = {key.removeprefix("failed:"): round(value)
                    for key, value in (self.gateway or {}).items()
                    if key.startswith("failed:") and value >= 0.5}
        return dict(sorted(failures.items(), key=lambda item: -item[1]))

    def summary(self) -> dict[str, Any]:
        firsts = [t.first_audio_ms for c in self.calls for t in c.turns
                  if t.first_audio_ms is not None]
        timeouts = sum(1 for c in self.calls for t in c.turns if t.timed_out)
        barges = [t.barge_in_ms for c in self.calls for t in c.turns if t.barge_in_ms is not None]
        models = [m for m in (c.emodel() for c in self.calls) if m is not None]
        lateness = percentiles(self.lateness_ms)
        ttfa = percentiles(firsts)
        withheld = None
        reference = ttfa["p50"]
        bound = self.slo_bound_ms if self.slo_bound_ms is not None else DEFAULT_LATENCY_BOUND_MS
        if reference is not None:
            reference = max(reference, bound)
        if lateness["p99"] is not None and reference is not None and \
                lateness["p99"] > self.withhold_fraction * reference:
            what = ("the first-audio p50" if reference == ttfa["p50"] else
                    "the SLO's latency bound" if self.slo_bound_ms is not None else
                    "the default latency bound")
            withheld = (f"simulator lateness p99 {lateness['p99']:.1f} ms is more than "
                        f"{self.withhold_fraction:.0%} of {what} {reference:.1f} ms: "
                        "latency figures withheld; run with more --workers or on another host")
        refused = [c.refused for c in self.calls if c.refused and not c.error]
        failed = [c.error for c in self.calls if c.error]
        gateway_failed = self.gateway_failures()
        placed = len(self.calls)
        characters = sum(t.chars for c in self.calls for t in c.turns)
        duration = self.duration_s
        return {
            "concurrency": self.concurrency,
            "pattern": self.pattern,
            "duration_s": duration,
            "calls": placed,
            "completed": placed - len(refused) - len(failed),
            "refused": len(refused),
            "refused_pct": 100.0 * len(refused) / placed if placed else 0.0,
            "refused_by": _grouped(refused),
            # Failures: calls that broke, and turns the gateway reports it failed.
            "errors": len(failed) + sum(gateway_failed.values()),
            "failed_calls": len(failed),
            "failures_by": _grouped(failed) | {f"gateway: {cause}": n
                                               for cause, n in gateway_failed.items()},
            "gateway_failures_by": gateway_failed,
            "placed_per_s": placed / duration if duration else None,
            "turns": sum(len(c.turns) for c in self.calls),
            "dropped": sum(1 for c in self.calls if c.dropped),
            "timeouts": timeouts,
            "ttfa_ms": ttfa,
            "barge_in_ms": percentiles(barges),
            "setup_ms": percentiles([c.setup_ms for c in self.calls if c.setup_ms is not None]),
            "gaps": sum(c.gaps for c in self.calls),
            "gap_ms": float(sum(c.gap_ms for c in self.calls)),
            "jitter_ms": percentiles([c.jitter_ms for c in self.calls if c.jitter_ms is not None]),
            "mos": float(np.mean([m[1] for m in models])) if models else None,
            "r_factor": float(np.mean([m[0] for m in models])) if models else None,
            "token_audio_ms": percentiles([t.token_audio_ms for c in self.calls
                                           for t in c.turns if t.token_audio_ms is not None]),
            "characters": characters,
            "characters_per_s": characters / duration if characters and duration else None,
            "gateway": self.gateway,
            "speech": self.speech,
            "target": self.target,
            "offered": self.offered or f"×{self.concurrency}",
            "lateness_ms": lateness,
            "withheld": withheld,
        }


# --- SLO --------------------------------------------------------------------------------------

_CLAUSE = re.compile(r"^\s*(\w+)\s*(<=|>=|<|>|=)\s*([0-9.]+)\s*(ms|s|%)?\s*$")
_METRICS = {
    "ttfa_p50": ("ttfa_ms", "p50"), "ttfa_p95": ("ttfa_ms", "p95"),
    "ttfa_p99": ("ttfa_ms", "p99"), "barge_p95": ("barge_in_ms", "p95"),
    "token_p95": ("token_audio_ms", "p95"),
    "setup_p95": ("setup_ms", "p95"), "gaps": ("gaps", None), "gap_ms": ("gap_ms", None),
    # errors and failed are the same count: calls that broke (refusals are not among them).
    "errors": ("errors", None), "failed": ("errors", None), "timeouts": ("timeouts", None),
    "dropped": ("dropped", None), "mos": ("mos", None),
    "refused": ("refused", None), "refused_pct": ("refused_pct", None),
}


@dataclass(frozen=True)
class Clause:
    metric: str
    op: str
    value: float

    def check(self, summary: dict[str, Any]) -> tuple[bool, float | None]:
        key, sub = _METRICS[self.metric]
        actual = summary[key][sub] if sub else summary[key]
        if actual is None:
            return False, None
        ok = {"<": actual < self.value, "<=": actual <= self.value, ">": actual > self.value,
              ">=": actual >= self.value, "=": actual == self.value}[self.op]
        return ok, float(actual)


def parse_slo(text: str) -> list[Clause]:
    """``"ttfa_p95<200ms,gaps=0"`` -> clauses (times in ms; ``s`` converts)."""
    clauses = []
    for part in text.split(","):
        if not part.strip():
            continue
        match = _CLAUSE.match(part)
        if not match:
            raise SloError(f"cannot read SLO clause {part.strip()!r}: write e.g. ttfa_p95<200ms")
        metric, op, number, unit = match.groups()
        if metric not in _METRICS:
            raise SloError(f"unknown SLO metric {metric!r}; known: {', '.join(sorted(_METRICS))}")
        value = float(number) * (1000 if unit == "s" else 1)
        clauses.append(Clause(metric, op, value))
    if not clauses:
        raise SloError("empty SLO")
    return clauses


def latency_bound(clauses: list[Clause]) -> float | None:
    """The tightest upper bound an SLO puts on a latency (ms), if any."""
    bounds = [c.value for c in clauses
              if c.metric.startswith(("ttfa", "barge", "setup")) and c.op in ("<", "<=")]
    return min(bounds) if bounds else None


def evaluate(clauses: list[Clause], summary: dict[str, Any]) -> tuple[bool, list[str]]:
    """Whether a level meets every clause, with a line per clause."""
    lines = []
    passed = True
    if summary.get("withheld") and any(c.metric.startswith(("ttfa", "barge", "setup"))
                                       for c in clauses):
        return False, [f"withheld: {summary['withheld']}"]
    for clause in clauses:
        ok, actual = clause.check(summary)
        passed &= ok
        shown = "n/a" if actual is None else f"{actual:g}"
        lines.append(f"{clause.metric} {clause.op} {clause.value:g}: {shown} "
                     f"{'ok' if ok else 'MISSED'}")
    return passed, lines
