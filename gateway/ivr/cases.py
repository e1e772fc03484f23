"""Script tests: scripted callers through the real IVR runner, no model, no network.

``gateway script test SCRIPT CASES.yaml`` runs each case of a case file (see
``prompts/demo.cases.yaml``) as a call: the runner walks the script exactly as in production,
on a virtual clock (a 5 s gather timeout costs nothing), with every sentence "played" at once as
a 20 ms silence (it checks the flow, not the audio), webhooks answered from the case file and,
for business hours, the time of day the case gives::

    cases:
      - name: an overdue account goes to collections
        at: 2025-06-16T10:00:00-04:00   # the wall clock (needed if the script has hours)
        caller: "+15550001111"          # optional; "called" too
        webhooks:                       # node -> its answer: a JSON object, "timeout", an HTTP
          lookup: {first_name: Dana, balance: "80.00", status: overdue}   # status, or a list
        steps:                          # what the caller does, each when the call waits for
          - press: "1"                  # them: keys (several at once are typed quickly)
          - say: "one two three four five six"   # speech, to a gather that listens for it
          - press: "#"
          - wait: 10s                   # silence (timeouts fire)
          - hangup                      # the caller hangs up
        path: [welcome, menu, account, lookup, route, collections]
        says: [welcome, ...]            # sentences, or prompt names (in the language spoken,
                                        # filled in with the call's variables at its end)
        hears: [welcome, ...]           # the words the caller hears: after say-as types, the
                                        # lexicon and the free-text normaliser
        outcome: {transfer: "+15555550101"}   # or hangup, or caller hangup

Once the steps run out the caller stays silent until the call ends. ``path``, ``says``,
``hears`` and ``outcome`` are each optional and exact; a failure says where the call diverged.
``says`` checks the sentences as written, their values filled in (``Your balance is 456.10``);
``hears`` the words the engine speaks (``Your balance is four hundred and fifty-six dollars,
ten cents``), read the way the script (or, with ``gateway script test --line``, a line of a
lines file) reads them.

A ``say`` step is heard as its words: a speech gather recognises exactly the phrase (or digit
string) it says, anything else as out of the menu (the recogniser's accuracy is
``bench/asr.py``'s business, not a script test's); the turn ends by the gather's own timeouts.
Said where no gather listens, it only barges in.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal

import httpx
import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
)

from gateway.asr.base import Encoding, MatchStatus, RecognitionResult
from gateway.asr.grammar import SpeechGrammar, match, phrase_words
from gateway.asr.pool import SpeechListener
from gateway.audio.g711 import Codec
from gateway.call.events import CallerHungUp, CallOutcome, SpeechPaused, SpeechStarted
from gateway.call.playout import PlayoutPolicy
from gateway.call.session import Call, Utterance
from gateway.clock import VirtualClock
from gateway.ivr.cache import PromptCache
from gateway.ivr.prompts import resolve_voice
from gateway.ivr.runner import IvrRunner, RunnerContext
from gateway.ivr.script import (
    Diagnostic,
    ScriptError,
    Seconds,
    _key_position,
    _Map,
    _position,
    _schema_message,
    read_yaml,
    render,
)
from gateway.ivr.script import Script as IvrScript
from gateway.ivr.trace import CallTrace
from gateway.speech import Speaker, SpeechVoice
from gateway.text import Reader

__all__ = [
    "INSTANT",
    "CaseFile",
    "CaseResult",
    "InstantTransport",
    "SilentSpeaker",
    "load_cases",
    "run_case",
    "run_cases",
]

#: Virtual seconds a case may last before it counts as stuck (a loop with no way out).
MAX_CALL_S = 3600.0
#: Real seconds the runner may take to reach its next wait (it never should, with no model).
STALL_S = 10.0


# --- the case file ----------------------------------------------------------------------------


class Press(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    press: str

    @field_validator("press", mode="before")
    @classmethod
    def _keys(cls, value: Any) -> Any:
        value = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
        if not isinstance(value, str) or not value or any(c not in "0123456789*#ABCD"
                                                          for c in value):
            raise ValueError(f"'{value}' is not keypad keys (0-9, *, #, A-D)")
        return value


class Wait(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    wait: Seconds


class Say(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    say: str = Field(min_length=1)


def _step_kind(value: Any) -> str | None:
    if value == "hangup":
        return "hangup"
    if isinstance(value, dict):
        for kind in ("press", "wait", "say"):
            if kind in value:
                return kind
        return None
    for kind, model in (("press", Press), ("wait", Wait), ("say", Say)):
        if isinstance(value, model):
            return kind
    return None


Step = Annotated[
    Annotated[Press, Tag("press")] | Annotated[Wait, Tag("wait")]
    | Annotated[Say, Tag("say")] | Annotated[Literal["hangup"], Tag("hangup")],
    Discriminator(_step_kind, custom_error_type="step",
                  custom_error_message='a step is {press: "1"}, {say: "agent"}, {wait: 5s} '
                                       'or hangup'),
]


class Transfer(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    transfer: str


Outcome = Annotated[
    Annotated[Literal["hangup", "caller hangup"], Tag("end")]
    | Annotated[Transfer, Tag("transfer")],
    Discriminator(lambda v: "end" if isinstance(v, str) else "transfer"),
]
#: A webhook's answer: a JSON object, "timeout", an HTTP status, or one of those per call.
Reply = dict[str, Any] | Literal["timeout"] | Annotated[int, Field(ge=100, le=599)]


class Case(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    at: datetime | None = None
    caller: str = "+15550001111"
    called: str = "+15550002222"
    webhooks: dict[str, Reply | list[Reply]] = Field(default_factory=dict)
    steps: list[Step] = Field(default_factory=list)
    path: list[str] | None = None
    says: list[str] | None = None
    hears: list[str] | None = None
    outcome: Outcome | None = None

    @field_validator("at")
    @classmethod
    def _aware(cls, value: datetime | None) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("give the time with its UTC offset: 2025-06-16T10:00:00-04:00")
        return value


class CaseFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    cases: list[Case] = Field(min_length=1)

    #: Where each case starts in the file (line, column), for messages.
    positions: list[tuple[int, int]] = Field(default_factory=list, exclude=True)
    label: str = Field("<cases>", exclude=True)


def load_cases(path: str | Path, script: IvrScript) -> CaseFile:
    """Load a case file and check it against ``script``; raise :class:`ScriptError` listing
    every problem as ``file:line:column``."""
    path = Path(path)
    label = str(path)
    problems: list[Diagnostic] = []

    def report(pos: tuple[int, int], message: str) -> None:
        problems.append(Diagnostic(label, pos[0], pos[1], message))

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ScriptError([Diagnostic(label, 1, 1, f"cannot read the cases: {exc}")]) from None
    tree, duplicates = read_yaml(text, label, what="a case file")
    problems.extend(duplicates)
    if not isinstance(tree, _Map):
        raise ScriptError([Diagnostic(label, 1, 1, "a case file is a mapping with 'cases'")])
    try:
        cases = CaseFile.model_validate(tree)
    except ValidationError as exc:
        for error in exc.errors(include_url=False, include_input=False):
            # Union members named in locations are not YAML keys.
            loc = [p for p in error["loc"] if not (isinstance(p, str) and (
                p in ("end", "transfer", "str", "int") or p.startswith(
                    ("literal[", "dict[", "list[", "function-"))))]
            # A tagged step names its tag, then its field of the same name.
            loc = [p for i, p in enumerate(loc) if i == 0 or p != loc[i - 1]]
            where = (_key_position(tree, loc) if error.get("type") == "extra_forbidden"
                     else _position(tree, loc))
            report(where, _schema_message(loc, error))
        raise ScriptError(problems) from None
    has_hours = any(node.hours is not None for node in script.nodes.values())
    webhook_nodes = {name for name, node in script.nodes.items() if node.webhook is not None}
    for i, case in enumerate(cases.cases):
        if has_hours and case.at is None:
            report(_position(tree, ("cases", i)), f"case '{case.name}': the script has business "
                   "hours, so give the time of the call: 'at: 2025-06-16T10:00:00-04:00'")
        for node in case.webhooks:
            if node not in webhook_nodes:
                report(_key_position(tree, ("cases", i, "webhooks", node)),
                       f"case '{case.name}': '{node}' is not a webhook node (webhook nodes: "
                       f"{', '.join(sorted(webhook_nodes)) or 'none'})")
        for j, name in enumerate(case.path or []):
            if name not in script.nodes:
                report(_position(tree, ("cases", i, "path", j)),
                       f"case '{case.name}': '{name}' is not a node of the script")
    if problems:
        raise ScriptError(problems)
    positions = [_position(tree, ("cases", i)) for i in range(len(cases.cases))]
    return cases.model_copy(update={"positions": positions, "label": label})


# --- running a case ---------------------------------------------------------------------------


#: The far end of a tested call plays everything at once and echoes every mark.
INSTANT = PlayoutPolicy(lead_s=3600.0, max_frames_per_send=1000, far_end_marks=True,
                         buffer_frames=10**6)
_SILENCE = np.zeros(160, dtype=np.int16)


class InstantTransport:
    """The far end of a tested call: plays everything at once, echoes every mark, keeps the
    outcome."""

    codec: Codec = "pcmu"
    playout = INSTANT

    def __init__(self) -> None:
        self.call: Call | None = None
        self.outcome: CallOutcome | None = None

    async def send_frames(self, frames: list[bytes]) -> None:
        pass

    async def send_mark(self, name: str) -> None:
        assert self.call is not None
        asyncio.get_running_loop().call_soon(self.call.playback_done, name)

    async def clear(self) -> None:
        pass

    async def end(self, outcome: CallOutcome) -> None:
        self.outcome = outcome

    def abort(self, reason: str) -> None:
        raise RuntimeError(f"the tested call was aborted: {reason}")


class SilentSpeaker(Speaker):
    """Every sentence is 20 ms of silence: the flow is under test, not the voice."""

    def __init__(self, voice: SpeechVoice | None = None) -> None:  # no speech service
        self.voice = voice or SpeechVoice()

    def with_voice(self, voice: SpeechVoice) -> Speaker:
        return SilentSpeaker(voice)

    def say(self, call: Call, text: str, *, turn_started_at: float | None = None,
            capture: bool = False, voice: SpeechVoice | None = None,
            interruptible: bool = False) -> Utterance:
        return call.play(_SILENCE, label=text, turn_started_at=turn_started_at,
                         interruptible=interruptible)


class _Backend:
    """Answers a case's webhooks from the case file."""

    def __init__(self, script: IvrScript, replies: dict[str, Any]) -> None:
        self.by_url = {node.webhook.url: name for name, node in script.nodes.items()
                       if node.webhook is not None}
        self.replies = {name: list(r) if isinstance(r, list) else [r]
                        for name, r in replies.items()}
        self.calls: dict[str, int] = {}
        self.problems: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        node = str(body.get("node") or self.by_url.get(str(request.url), "?"))
        replies = self.replies.get(node)
        n = self.calls.get(node, 0)
        self.calls[node] = n + 1
        if not replies:
            self.problems.append(f"node '{node}' called its webhook, but the case gives it no "
                                 "answer (add it under 'webhooks:'); it failed")
            return httpx.Response(599, text="no answer in the case file")
        reply = replies[min(n, len(replies) - 1)]
        if reply == "timeout":
            raise httpx.ReadTimeout("timeout (from the case file)", request=request)
        if isinstance(reply, int):
            return httpx.Response(reply, text="from the case file")
        return httpx.Response(200, json=reply)


class _HeardAsWritten:
    """The tester's recogniser: what a ``say`` step says is what it hears, word for word."""

    running = True

    def __init__(self) -> None:
        self.said = ""

    def listener(self, grammar: SpeechGrammar, *, encoding: Encoding = "pcmu",
                 max_speech_s: float = 10.0) -> SpeechListener:
        return SpeechListener(self._recognize, grammar, encoding=encoding,
                              max_speech_s=max_speech_s)

    async def _recognize(self, pcm: np.ndarray, grammar: SpeechGrammar) -> RecognitionResult:
        words = phrase_words(self.said)
        heard = " ".join(words)
        found = match(grammar, words)
        if found is None:
            return RecognitionResult(MatchStatus.NO_MATCH, transcript=heard,
                                     reason=f"heard {heard!r}, which is not in the menu")
        return RecognitionResult(MatchStatus.MATCH, branch=found.branch, phrase=found.phrase,
                                 digits=found.digits, transcript=heard, confidence=1.0)


#: How long a ``say`` step takes to say, per word (a caller's pace).
_SECONDS_PER_WORD = 0.35
#: Bound on the timer steps a spoken turn may take to be decided.
_SAY_STEPS = 1000


@dataclass
class CaseResult:
    """What a case did, and where it departed from what it expected."""

    case: Case
    position: tuple[int, int]
    trace: CallTrace
    failures: list[str] = field(default_factory=list)
    #: The call's variables when it ended (a prompt name in ``says`` is filled in with them).
    variables: dict[str, str] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not self.failures


def _outcome_text(trace: CallTrace) -> str:
    if trace.outcome == "transfer":
        return f"transfer to {trace.target}"
    return {"hangup": "hang-up", "caller hung up": "the caller hanging up"}.get(
        trace.outcome or "", trace.outcome or "nothing")


def _expected_outcome(outcome: Outcome) -> str:
    if isinstance(outcome, Transfer):
        return f"transfer to {outcome.transfer}"
    return "hang-up" if outcome == "hangup" else "the caller hanging up"


def _step_text(step: Step) -> str:
    if isinstance(step, Press):
        return f"press {step.press}"
    if isinstance(step, Say):
        return f"say {step.say!r}"
    if isinstance(step, Wait):
        return f"wait {step.wait:g} s"
    return "hang up"


async def run_case(script: IvrScript, case: Case, position: tuple[int, int] = (1, 1),
                   fingerprint: str = "script-test", reader: Reader | None = None
                   ) -> CaseResult:
    """Run one case through the real runner on a virtual clock; compare what happened.

    ``reader``: how the line under test reads its sentences (default: the script's own)."""
    reader = reader if reader is not None else script.reader()
    wall = case.at.timestamp() if case.at is not None else 1_750_000_000.0
    clock = VirtualClock(wall_start=wall)
    transport = InstantTransport()
    call = Call("CT" + "0" * 32, transport, clock, transport_name="test")
    transport.call = call
    call.start()
    backend = _Backend(script, case.webhooks)
    http = httpx.AsyncClient(transport=httpx.MockTransport(backend))
    heard = _HeardAsWritten()
    context = RunnerContext(
        script=script, cache=PromptCache(None), model_fingerprint=fingerprint,
        voice_identity=_identity(script), speaker=SilentSpeaker(), audio="silence",
        clock=clock, http=http,
        sounds={node.play: _SILENCE for node in script.nodes.values() if node.play is not None},
        recognizer=heard, reader=reader,
    )
    waiting = asyncio.Event()
    trace = CallTrace(call.call_id, script.name, call.answered_at, on_waiting=waiting.set)
    runner = IvrRunner(call, context, {"caller": case.caller, "called": case.called,
                                       "call_id": call.call_id}, trace=trace)
    result = CaseResult(case, position, trace)
    task = asyncio.create_task(runner.run())

    async def turn() -> bool:
        """Until the call waits for the caller (True) or has ended (False)."""
        waiter = asyncio.ensure_future(waiting.wait())
        done, _ = await asyncio.wait({waiter, task}, timeout=STALL_S,
                                     return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if not done:
            raise RuntimeError("the runner stopped moving without waiting for the caller")
        waiting.clear()
        return waiter in done and not task.done()

    try:
        for i, step in enumerate(case.steps):
            if not await turn():
                left = ", ".join(_step_text(s) for s in case.steps[i:])
                result.failures.append(f"the call ended at '{trace.path[-1]}' with steps left "
                                       f"({left})")
                break
            if isinstance(step, Press):
                for key in step.press:
                    call.dtmf(key)
            elif isinstance(step, Wait):
                await clock.advance(step.wait)
            elif isinstance(step, Say):
                await _say(call, clock, heard, step.say)
            else:
                call.deliver(CallerHungUp(at=clock.now()))
        # The caller says nothing more: let time run until the call ends.
        while not task.done():
            if not await turn():
                break
            deadline = clock.next_deadline()
            if deadline is None or clock.now() > MAX_CALL_S:
                result.failures.append(f"the call never ended (still waiting in "
                                       f"'{trace.path[-1]}' after {clock.now():g} s)")
                break
            await clock.advance(max(0.0, deadline - clock.now()))
    finally:
        if not task.done():
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await call.close()
        await http.aclose()
    result.failures[:0] = backend.problems
    result.variables = dict(runner.variables)
    _compare(script, case, result, reader)
    return result


async def _say(call: Call, clock: VirtualClock, heard: _HeardAsWritten, text: str) -> None:
    """The caller says ``text``: the speech starts now (barging in on a prompt), lasts its
    words' time, then a pause begins that the listening gather, if any, ends the turn with."""
    heard.said = text
    listener = call.listener
    speech = listener if isinstance(listener, SpeechListener) else None
    now = clock.now()
    if speech is not None:
        speech.speech_started(now)
    call.deliver(SpeechStarted(at=now))
    await clock.advance(_SECONDS_PER_WORD * max(1, len(phrase_words(text))))
    if speech is None or call.listener is not speech:
        return
    speech.feed(_SILENCE.tobytes())
    now = clock.now()
    speech.speech_paused(now)
    call.deliver(SpeechPaused(now, at=now))
    # The caller is silent now, waiting for an answer: let the gather's end-of-speech timeouts
    # run out until it decides (it stops listening then).
    for _ in range(_SAY_STEPS):
        for _ in range(5):
            await asyncio.sleep(0)
        if call.listener is not speech:
            return
        deadline = clock.next_deadline()
        if deadline is not None:
            await clock.advance(max(0.0, deadline - clock.now()))
    raise RuntimeError(f"the gather never decided what {text!r} was")


def _identity(script: IvrScript) -> str:
    if script.voice.clone is not None:
        # A cloned voice needs no registry here: nothing is rendered.
        return f"clone:{script.voice.clone}"
    return resolve_voice(script).identity


def _compare(script: IvrScript, case: Case, result: CaseResult, reader: Reader) -> None:
    trace = result.trace
    path = trace.path
    if case.path is not None and case.path != path:
        i = next((i for i, (a, b) in enumerate(zip(case.path, path, strict=False)) if a != b),
                 min(len(case.path), len(path)))
        if i < len(case.path) and i < len(path):
            what = f"expected '{case.path[i]}', the call went to '{path[i]}'"
        elif i < len(case.path):
            what = f"expected '{case.path[i]}' next, but the call ended there"
        else:
            what = f"expected the call to end there, but it went on to '{path[i]}'"
        after = f" (after '{path[i - 1]}'{_why(trace, path[i - 1])})" if i > 0 else ""
        result.failures.append(f"path diverged at node {i + 1}{after}: {what}\n"
                               f"    expected: {' > '.join(case.path)}\n"
                               f"    actual:   {' > '.join(path)}")
    for expectations, words in ((case.says, False), (case.hears, True)):
        if expectations is not None:
            _compare_sentences(script, expectations, words, result, reader)
    if case.outcome is not None:
        wanted = _expected_outcome(case.outcome)
        if wanted != _outcome_text(trace):
            result.failures.append(f"outcome: expected {wanted}, got {_outcome_text(trace)}")


def _compare_sentences(script: IvrScript, expectations: list[str], words: bool,
                       result: CaseResult, reader: Reader) -> None:
    """``says`` (``words`` False): the sentences as written; ``hears``: the words spoken. A
    prompt name stands for its text in the language it was said in, with the call's variables
    at its end."""
    heard = result.trace.heard
    label = "the words of sentence" if words else "sentence"
    for i in range(max(len(expectations), len(heard))):
        expected = expectations[i] if i < len(expectations) else None
        got = heard[i] if i < len(heard) else None
        wanted = expected
        if expected is not None and expected in script.prompts:
            language = got.language if got else script.voice.language
            template = script.sentence(expected, language)
            wanted = (reader.sentence(template, result.variables, language).spoken if words
                      else render(template, result.variables))
        actual = None if got is None else got.words if words else got.text
        if got is not None and wanted == actual:
            continue
        if got is None:
            result.failures.append(f"{label} {i + 1}: expected \"{wanted}\", but nothing "
                                   "more was said")
        elif wanted is None:
            result.failures.append(f"{label} {i + 1}: said \"{actual}\" (at '{got.node}'), "
                                   "which the case does not expect")
        else:
            result.failures.append(f"{label} {i + 1} (at '{got.node}', {got.language}): "
                                   f"expected \"{wanted}\", heard \"{actual}\"")
        break


def _why(trace: CallTrace, node: str) -> str:
    """What decided the way out of ``node`` (for a divergence message)."""
    notes = [chose for name, chose in trace.choices if name == node]
    keys = "".join(k.key for k in trace.keys if k.node == node)
    hooks = [w.result for w in trace.webhooks if w.node == node]
    parts = []
    if keys:
        parts.append(f"keys {keys}")
    if hooks:
        parts.append(f"webhook {hooks[-1]}")
    if notes:
        parts.append(notes[-1])
    return f": {'; '.join(parts)}" if parts else ""


async def run_cases(script: IvrScript, cases: CaseFile,
                    reader: Reader | None = None) -> list[CaseResult]:
    """Every case of ``cases``, one after the other (``reader`` as in :func:`run_case`)."""
    return [await run_case(script, case, pos, reader=reader)
            for case, pos in zip(cases.cases, cases.positions, strict=True)]


def report(results: list[CaseResult], label: str, echo: Callable[[str], None]) -> int:
    """Print a line per case (and what failed); return how many failed."""
    failed = 0
    for result in results:
        line, column = result.position
        where = f"{label}:{line}:{column}"
        if result.passed:
            echo(f"{where}: PASS {result.case.name} ({len(result.trace.path)} nodes, "
                 f"{len(result.trace.heard)} sentences, {_outcome_text(result.trace)})")
            continue
        failed += 1
        echo(f"{where}: FAIL {result.case.name}")
        for failure in result.failures:
            echo(f"  {failure}")
    return failed
