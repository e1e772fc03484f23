"""What one call went through: the nodes it visited, what it heard, the keys, what it said,
the webhooks.

The IVR runner fills a :class:`CallTrace` as the call goes; at hang-up it is logged as one
structured record (``ivr trace``; under ``GATEWAY_LOG_FORMAT=json`` a ``trace`` object in the
line), so an author can see what a caller went through without reading interleaved log lines.
``gateway script test`` checks the same trace against what a case expects.

Times are seconds since the call was answered, on the runner's clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["MAX_KEYS", "CallTrace", "Heard", "KeyPress", "Recognised", "Visit", "WebhookCall"]

#: Keys a trace records (a caller could press keys for the whole call).
MAX_KEYS = 256


@dataclass
class Visit:
    node: str
    at: float


@dataclass
class Heard:
    """A sentence the caller was played (rendered: variables filled in)."""

    node: str
    text: str
    language: str
    voice: str
    at: float
    cached: bool = False
    #: The caller barged in before it finished.
    interrupted: bool = False
    #: The words the engine said (after say-as types, the lexicon and the free-text
    #: normaliser; ``text`` is the sentence as written, its values filled in).
    words: str = ""


@dataclass
class KeyPress:
    node: str
    key: str
    at: float


@dataclass
class Recognised:
    """What a speech gather heard in one caller turn, and what it made of it."""

    node: str
    #: When the caller stopped speaking.
    at: float
    #: "match", "no match", "no speech", or "failed" (the recogniser failed: keys only).
    result: str
    #: The node a phrase chose, or None.
    branch: str | None = None
    #: The phrase as the author wrote it, or the digit string ('*'s in a private gather).
    said: str | None = None
    #: What the recogniser heard (its open-vocabulary transcript; '*' in a private gather).
    heard: str = ""
    confidence: float = 0.0
    #: Seconds of speech recognised, and end of speech -> decision in milliseconds.
    speech_s: float = 0.0
    decision_ms: float = 0.0
    #: Why it was no match or failed, in words.
    reason: str | None = None
    #: Recognitions run for the turn (one per pause that got one: what it cost).
    recognitions: int = 0


@dataclass
class WebhookCall:
    node: str
    url: str
    #: "ok", "timeout", "http 500", "not json", ...
    result: str
    ms: float
    #: Names of the variables it set (values stay out of logs: they are the customer's data).
    set: list[str] = field(default_factory=list)


@dataclass
class CallTrace:
    """The record of one call through a script."""

    call_id: str
    script: str
    started_at: float
    visits: list[Visit] = field(default_factory=list)
    heard: list[Heard] = field(default_factory=list)
    #: The first :data:`MAX_KEYS` keys (``keys_dropped`` counts the rest).
    keys: list[KeyPress] = field(default_factory=list)
    keys_dropped: int = 0
    #: What speech gathers heard (one per recognised turn: bounded by the gathers visited).
    speech: list[Recognised] = field(default_factory=list)
    webhooks: list[WebhookCall] = field(default_factory=list)
    #: (node, what it chose): a branch's case, "open"/"closed", a gather's answer kind.
    choices: list[tuple[str, str]] = field(default_factory=list)
    #: "transfer", "hangup", "caller hung up", "error"
    outcome: str | None = None
    #: The transfer target, when there is one.
    target: str | None = None
    ended_at: float | None = None
    #: The line that answered (its name, ``default`` for an unlisted number) and the version of
    #: the lines and scripts the call ran on (a reload installs the next one).
    line: str | None = None
    version: int | None = None
    #: Called each time the runner starts waiting for the caller with nothing queued (the
    #: script tester presses the next key then).
    on_waiting: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    @property
    def path(self) -> list[str]:
        return [visit.node for visit in self.visits]

    def key(self, press: KeyPress) -> None:
        """Record a key, up to :data:`MAX_KEYS` of them (a trace is bounded however long the
        call and however many keys its caller presses)."""
        if len(self.keys) < MAX_KEYS:
            self.keys.append(press)
        else:
            self.keys_dropped += 1

    def to_record(self) -> dict[str, Any]:
        """The trace as plain JSON-able data (the structured log record)."""
        # Field by field: asdict() of the whole trace would deep-copy on_waiting's target (an
        # asyncio.Event, its loop with it).
        record: dict[str, Any] = {"call_id": self.call_id, "script": self.script,
                                  "path": self.path}
        if self.line is not None:
            record["line"], record["version"] = self.line, self.version
        for part in ("visits", "heard", "keys", "speech", "webhooks"):
            record[part] = [asdict(entry) for entry in getattr(self, part)]
        if self.keys_dropped:
            record["keys_dropped"] = self.keys_dropped
        record["outcome"], record["target"] = self.outcome, self.target
        record["choices"] = [{"node": n, "chose": c} for n, c in self.choices]
        record["duration_s"] = (round(self.ended_at - self.started_at, 3)
                                if self.ended_at is not None else None)
        for part in ("visits", "heard", "keys", "speech"):
            for entry in record[part]:
                entry["at"] = round(entry["at"] - self.started_at, 3)
        return record
