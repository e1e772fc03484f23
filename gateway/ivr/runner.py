"""The per-call IVR interpreter: the only thing that decides what a call hears.

It walks the script's nodes: speaks (from the prompt cache when the sentence is static, live
through the scheduler when it has variables), gathers DTMF with timeouts and retries, calls the
company's webhook, and ends the call with a transport-neutral outcome (transfer or hang-up).
Time comes from the injected :class:`~gateway.clock.Clock` (gather timeouts and the webhook's
deadline alike), so tests run them in virtual time.

Where it sits: between the call and the speech. The runner picks each sentence, takes it from
the prompt cache when it can (8 kHz PCM, :meth:`~gateway.call.session.Call.play`) or has it
spoken live (:class:`~gateway.speech.Speaker`: a speech-service stream handed to
:meth:`~gateway.call.session.Call.speak`); the call turns either into frames.

Barge-in: while an interruptible ``say`` plays, a key press or the caller starting to speak
stops it exactly like a DTMF barge-in; the digit is kept as type-ahead for the next gather.

Speech gathers (``speech:`` phrases per node, or ``speech: digits``) listen from the moment
their prompt starts until the caller's turn is over (:mod:`gateway.ivr.listening`); keys work
all along and whichever completes first wins: a key pressed while the caller is still speaking
stops the listening. A spoken phrase goes to its node; spoken digits are the gather's answer as
keys would be. What was heard is in the call's trace. When the recogniser fails (its worker
died, it timed out, it is overloaded) the gather says why in the log, prompts again and takes
keys only; the call goes on. The caller's turn is measured from the end of their speech.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from gateway.asr.base import MatchStatus, RecognitionResult
from gateway.asr.grammar import SpeechGrammar
from gateway.bot.agent import BotConfig, BotSession, CallerLeft
from gateway.call.events import (
    CallerHungUp,
    CallEvent,
    Dtmf,
    EndCall,
    PlaybackDone,
    SpeechFailed,
    SpeechStarted,
    TransferTo,
)
from gateway.call.session import Call, Utterance
from gateway.clock import Clock, SystemClock
from gateway.errors import BotError, RecognizerError
from gateway.ivr.cache import PromptCache, PromptKey
from gateway.ivr.listening import SpeechDecision, SpeechInput, SpeechTurn
from gateway.ivr.prompts import ResolvedVoice, prompt_key_for, speaker_identity
from gateway.ivr.script import (
    BUILTIN_VARIABLES,
    Bot,
    Case,
    Gather,
    Node,
    SayItem,
    Script,
    ScriptVoice,
    Sentence,
    Webhook,
    canonical_language,
    render,
    template_variables,
)
from gateway.ivr.trace import CallTrace, Heard, KeyPress, Recognised, Visit, WebhookCall
from gateway.metrics import Metrics
from gateway.speech import Speaker, SpeechVoice
from gateway.text import Reader, Rendering

log = logging.getLogger(__name__)

#: Largest webhook response accepted; anything bigger is treated as a failed webhook.
MAX_WEBHOOK_BYTES = 64 * 1024
#: Longest variable value merged from a webhook (it may be read out; it is never executed).
MAX_VARIABLE_CHARS = 200
#: Nodes visited by one call before the runner gives up (a script loop with no caller input).
MAX_STEPS = 1000
READ_BACK = "I heard {_read_back}. Is that right? Say yes or no, or press 1 for yes, 2 for no."
"""What a gather says back when the recogniser is unsure of spoken digits (English: the speech
gathers that take digits are English for now)."""
_READ_BACK = "_read_back"
CONFIRM_PHRASES: dict[str, list[str]] = {
    "yes": ["yes", "yeah", "yep", "correct", "that's right", "right"],
    "no": ["no", "nope", "wrong", "that's wrong", "not right"],
}
"""What the caller says to a read-back (or presses 1 or 2)."""

#: Keys an answer collects at most (the longest ``digits`` a gather may ask for): a caller
#: pressing keys without end, no terminator coming, still gets an answer, and a bounded one.
MAX_ANSWER_DIGITS = 32


class _CallEnded(Exception):
    """The caller hung up: stop the script."""


@dataclass(frozen=True)
class _Answer:
    """One gather attempt's outcome: keys (or spoken digits), a spoken phrase's node, or a
    recogniser failure."""

    digits: str = ""
    branch: str | None = None
    failed: bool = False
    #: Spoken digits the recogniser is not sure of: read them back before taking them.
    confirm: bool = False



class _Failed(Exception):
    """A step failed (speech, webhook): go to the error node.

    ``logged``: the failure was already logged where it happened (a failed utterance is, by
    the call, with its traceback when it was a bug); the runner then only notes its decision.
    """

    def __init__(self, reason: str, result: str = "failed", *, logged: bool = False) -> None:
        super().__init__(reason)
        #: In a word, for the call's trace ("http 500", "too large").
        self.result = result
        self.logged = logged


@dataclass
class RunnerContext:
    """What every call's runner shares (per gateway, not per call)."""

    script: Script
    cache: PromptCache
    model_fingerprint: str
    voice_identity: str
    #: Live speech in the script's voice (sentences with variables, cache misses).
    speaker: Speaker
    #: The render settings of this gateway's audio (:func:`gateway.ivr.prompts.audio_identity`
    #: of its engine and phone-path conditioning): part of every prompt key.
    audio: str
    clock: Clock = field(default_factory=SystemClock)
    http: httpx.AsyncClient | None = None
    #: WAV files named by ``play`` nodes, loaded and converted to 8 kHz PCM at start-up.
    sounds: dict[str, np.ndarray] = field(default_factory=dict)
    #: Cloned voices a node's ``voice:`` switches to, by name (resolved at start-up).
    clones: dict[str, ResolvedVoice] = field(default_factory=dict)
    #: Where speech gathers' turns are recognised (None: speech gathers take keys only).
    recognizer: SpeechInput | None = None
    metrics: Metrics | None = None
    #: The line this context serves and the version of the lines it belongs to (for the
    #: trace; None outside a gateway: the script tester).
    line: str | None = None
    version: int | None = None
    #: How the line reads its sentences (say-as types, free text, lexicon); None: the script's
    #: own reading (``GATEWAY_SCRIPT``, the script tester).
    reader: Reader | None = None
    #: How bot nodes reach their bots (signing token, trust store); None: unsigned, the
    #: system's trust store.
    bots: BotConfig | None = None

    def key(self, text: str, voice: ScriptVoice | None = None) -> PromptKey:
        """The cache key of ``text`` spoken with ``voice`` (default: the script's)."""
        voice = voice if voice is not None else self.script.voice
        return prompt_key_for(voice, self.model_fingerprint, self.identity(voice), text,
                              self.audio)

    def identity(self, voice: ScriptVoice) -> str:
        """The voice part of a cache key (a clone's includes the hash of its stored prompt)."""
        if voice.clone is None:
            return speaker_identity(voice)
        if voice.clone == self.script.voice.clone:
            return self.voice_identity
        return self.clones[voice.clone].identity

    def speaker_for(self, voice: ScriptVoice) -> Speaker:
        """Live speech in ``voice``: the gateway's speaker for the script's own voice, the same
        speech service in another voice after a node changed it."""
        if voice == self.script.voice:
            return self.speaker
        prompt = self.speaker.voice.prompt
        if voice.clone is not None and voice.clone != self.script.voice.clone:
            prompt = self.clones[voice.clone].prompt
        return self.speaker.with_voice(SpeechVoice(
            speaker=(voice.speaker or "ryan").lower(), language=voice.language,
            instruct=voice.style, seed=self.speaker.voice.seed,
            prompt=prompt if voice.clone is not None else None,
        ))


class IvrRunner:
    """Runs one call through the script."""

    def __init__(self, call: Call, context: RunnerContext, variables: dict[str, str],
                 trace: CallTrace | None = None) -> None:
        self.call = call
        self.ctx = context
        self.script = context.script
        self.clock = context.clock
        #: What the call went through (logged at hang-up; the script tester reads it).
        self.trace = trace if trace is not None else CallTrace(
            call.call_id, self.script.name, call.answered_at, line=context.line,
            version=context.version)
        self.variables: dict[str, str] = {**self.script.variables, **variables}
        #: Who speaks now (a node's ``voice`` or ``set: {language}`` changes it).
        self.voice: ScriptVoice = self.script.voice
        self.variables["language"] = self.voice.language
        self.typeahead: list[str] = []
        self.path: list[str] = []
        self.reader = context.reader if context.reader is not None else self.script.reader()
        # Typed slots already logged as read as written: once per call each.
        self._fell_back: set[str] = set()
        # When the caller's current turn ended (None once an utterance has answered it).
        self._turn_at: float | None = call.answered_at
        self.bot_session: BotSession | None = None

    async def run(self) -> None:
        """Drive the call from ``start`` until it is transferred, hung up, or the caller leaves."""
        node_name: str | None = self.script.start
        try:
            for _ in range(MAX_STEPS):
                if node_name is None:
                    break
                node_name = await self._step(node_name)
            else:
                log.error("call %s: %d steps without end; hanging up", self.call.call_id, MAX_STEPS)
            if self.call.outcome is None and not self.call.ended:
                await self.call.end(EndCall())
        except _CallEnded:
            log.info("call %s: caller left during %s", self.call.call_id, self.path[-1:])
        finally:
            self._finish_trace()

    def _finish_trace(self) -> None:
        trace = self.trace
        trace.ended_at = self.clock.now()
        outcome = self.call.outcome
        if isinstance(outcome, TransferTo):
            trace.outcome, trace.target = "transfer", outcome.target
        elif isinstance(outcome, EndCall):
            trace.outcome = "hangup"
        elif self.call.ended:
            trace.outcome = "caller hung up"
        else:
            trace.outcome = "error"
        # One record per call: what the caller went through, for the author (gateway.logs puts
        # its fields in the JSON line).
        log.info("ivr trace", extra={"data": {"trace": trace.to_record()}})

    # --- nodes --------------------------------------------------------------------------------

    async def _step(self, name: str) -> str | None:
        node = self.script.nodes[name]
        self.path.append(name)
        self.trace.visits.append(Visit(name, self.clock.now()))
        self._arrive(node)
        try:
            if node.say:
                await self._speak(node.say, barge_in=node.barge_in)
            elif node.play is not None:
                await self._play_file(node.play, barge_in=node.barge_in)
            if node.gather is not None:
                return await self._gather(node.gather)
            if node.webhook is not None:
                await self._webhook(name, node.webhook)
                return node.next
            if node.bot is not None:
                await self._bot(name, node.bot)
                return node.next
            if node.branch is not None:
                return self._branch(name, node.branch)
            if node.hours is not None:
                is_open = node.hours.schedule.is_open_at(self.clock.wall())
                self.trace.choices.append((name, "open" if is_open else "closed"))
                return node.hours.open if is_open else node.hours.closed
            if node.transfer is not None:
                await self.call.end(TransferTo(node.transfer))
                return None
            if node.hangup:
                await self.call.end(EndCall())
                return None
            return node.next
        except _Failed as exc:
            target = self._on_error(name)
            log.log(logging.INFO if exc.logged else logging.WARNING,
                    "call %s: node %s failed: %s; %s", self.call.call_id, name, exc,
                    f"going to {target}" if target is not None else "hanging up")
            if target is None:
                await self.call.end(EndCall())
            return target

    def _arrive(self, node: Node) -> None:
        """Apply the node's ``voice`` and ``set`` (before it says anything; the language
        first, so the other values may read it)."""
        voice = node.voice_after(self.voice)
        if voice != self.voice:
            if voice.language != self.voice.language:
                log.info("call %s: language %s -> %s", self.call.call_id, self.voice.language,
                         voice.language)
            self.voice = voice
            self.variables["language"] = voice.language
        for variable, value in (node.assign or {}).items():
            if variable != "language":
                self.variables[variable] = render(value, self.variables)

    def _on_error(self, name: str) -> str | None:
        node = self.script.nodes[name]
        if node.webhook is not None and node.webhook.on_error:
            return node.webhook.on_error
        if node.bot is not None and node.bot.on_error:
            return node.bot.on_error
        error = self.script.error
        # Never loop on a failing error node.
        return error if error is not None and error != name else None

    def _branch(self, name: str, cases: Sequence[Case]) -> str:
        """The first case whose test holds, else the final ``else`` (the loader requires it)."""
        chosen = len(cases) - 1
        for i, case in enumerate(cases[:-1]):
            condition = case.condition
            if condition is not None and condition.evaluate(self.variables):
                chosen = i
                break
        self.trace.choices.append((name, f"case {chosen + 1}: {cases[chosen].when or 'else'}"))
        return cases[chosen].target

    # --- speaking -----------------------------------------------------------------------------

    async def _speak(self, items: Sequence[SayItem], *, barge_in: bool) -> bool:
        """Say ``items`` in order; False if the caller barged in (the rest is skipped)."""
        for item in items:
            voice = self.script.spoken_voice(item, self.voice)
            template = self.script.sentence(item, voice.language)
            # What the engine (and the prompt cache's key) gets: the words, after say-as
            # types, the lexicon and the free-text normaliser.
            rendering = self.reader.sentence(template, self.variables, voice.language)
            self._log_fallbacks(rendering)
            text = rendering.spoken
            if not text.strip():
                continue
            utterance = self._start_utterance(item, template, text, voice, barge_in)
            heard = Heard(self.path[-1] if self.path else "", rendering.written, voice.language,
                          voice.clone or voice.speaker or "", self.clock.now(),
                          cached=utterance.cached, words=text)
            self.trace.heard.append(heard)
            try:
                played = await self._wait_played(utterance, barge_in=barge_in)
            except _CallEnded:
                # A caller who hangs up the moment a prompt ends heard all of it: its render is
                # whole, and the next caller gets it from the cache all the same.
                if utterance.played.is_set():
                    self._after_utterance(text, voice, utterance)
                raise
            if not played:
                heard.interrupted = True
                return False
            self._after_utterance(text, voice, utterance)
        return True

    def _log_fallbacks(self, rendering: Rendering) -> None:
        """A typed value read as written (a backend's "N/A" for a date): logged once per call
        and slot, never a failed utterance."""
        for fallback in rendering.fallbacks:
            if fallback.slot not in self._fell_back:
                self._fell_back.add(fallback.slot)
                log.warning("call %s: %s", self.call.call_id, fallback)

    def _start_utterance(self, item: SayItem, template: str, text: str,
                         voice: ScriptVoice, barge_in: bool) -> Utterance:
        static = not template_variables(template)
        cacheable = static or (isinstance(item, Sentence) and item.cache)
        turn, self._turn_at = self._turn_at, None
        if cacheable:
            pcm = self.ctx.cache.peek(self.ctx.key(text, voice))
            if pcm is not None:
                return self.call.play(pcm, label=text, turn_started_at=turn,
                                      interruptible=barge_in)
        speaker = self.ctx.speaker_for(voice)
        # A cacheable sentence rendered live (a miss) is stored under its voice's seed: it is
        # rendered with that seed, as ahead-of-time renders are, not unseeded.
        cache_voice = replace(speaker.voice, seed=voice.seed) if cacheable else None
        return speaker.say(self.call, text, turn_started_at=turn, capture=cacheable,
                           voice=cache_voice, interruptible=barge_in)

    def _after_utterance(self, text: str, voice: ScriptVoice, utterance: Utterance) -> None:
        # A cacheable sentence rendered live (a cache miss) is stored once complete.
        pcm = utterance.captured_pcm()
        if pcm is not None and len(pcm):
            key = self.ctx.key(text, voice)
            # The next caller plays it from memory at once; the disk write (and its fsync) runs
            # off the event loop, so a slow or hung disk never stalls this replica's calls.
            self.ctx.cache.put(key, pcm, to_disk=False)
            asyncio.get_running_loop().run_in_executor(None, self.ctx.cache.write, key, pcm)

    async def _play_file(self, name: str, *, barge_in: bool) -> bool:
        pcm = self.ctx.sounds.get(name)
        if pcm is None:
            raise _Failed(f"sound {name!r} was not loaded")
        turn, self._turn_at = self._turn_at, None
        utterance = self.call.play(pcm, label=f"file:{name}", turn_started_at=turn,
                                   interruptible=barge_in)
        return await self._wait_played(utterance, barge_in=barge_in)

    async def _wait_played(self, utterance: Utterance, *, barge_in: bool) -> bool:
        """Wait until ``utterance`` has played; handle events meanwhile.

        Returns False on barge-in (the utterance is stopped and cleared). Raises on hang-up
        and on a failed generation.
        """
        while not utterance.played.is_set():
            if utterance.error is not None:
                raise _Failed(utterance.error, logged=True)
            event = await self._next_event(timeout=0.05 if utterance.task is None else None,
                                           utterance=utterance)
            if event is None:
                continue
            if isinstance(event, Dtmf):
                self._key(event.digit)  # in the trace even when it cannot interrupt
            if isinstance(event, Dtmf | SpeechStarted) and barge_in:
                await self.call.barge_in()
                self._turn_at = event.at
                if isinstance(event, Dtmf):
                    self.typeahead.append(event.digit)
                return False
            if isinstance(event, SpeechFailed) and event.utterance_id == utterance.id:
                raise _Failed(event.reason, logged=True)
        return True

    async def _next_event(self, timeout: float | None,
                          utterance: Utterance | None = None) -> CallEvent | None:
        """Next event, with hang-ups turned into :class:`_CallEnded`.

        While an utterance plays, the wait also ends when it finishes (its mark comes back as a
        :class:`PlaybackDone` event) or fails.
        """
        if utterance is not None:
            event = await self._event_unless(utterance.played.wait(), utterance.failed.wait())
            if event is None:
                return None
            if isinstance(event, CallerHungUp) or self.call.ended:
                raise _CallEnded()
            return None if isinstance(event, PlaybackDone) else event
        # Waiting for the caller: marks of earlier (interrupted) audio are not input and must
        # not end the wait early; only the deadline does.
        deadline = None if timeout is None else self.clock.now() + timeout
        while True:
            remaining = None if deadline is None else max(0.0, deadline - self.clock.now())
            if self.trace.on_waiting is not None and self.call.events.empty():
                self.trace.on_waiting()
            got = await self._event_within(remaining)
            if got is None and self.call.on_hold and timeout is not None:
                # A caller who put the IVR on hold is away, not silent: their time to answer
                # stands still, and they get all of it again once back.
                got = await self._event_unless(self.call.wait_resumed())
                if got is None:
                    deadline = self.clock.now() + timeout
                    continue
            if isinstance(got, CallerHungUp) or self.call.ended:
                raise _CallEnded()
            if not isinstance(got, PlaybackDone):
                return got

    async def _event_unless(self, *wake: Awaitable[object]) -> CallEvent | None:
        """The call's next event, or None when one of ``wake`` completes first."""
        getter = asyncio.ensure_future(self.call.events.get())
        waiters = {getter, *(asyncio.ensure_future(w) for w in wake)}
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Also when this task is cancelled (the call ended): no waiter may outlive it.
            for future in waiters:
                if not future.done():
                    future.cancel()
        if getter.done() and not getter.cancelled():
            return getter.result()
        return None

    async def _event_within(self, timeout: float | None) -> CallEvent | None:
        """The call's next event, or ``None`` once ``timeout`` seconds have passed."""
        if timeout is None:
            return await self.call.events.get()
        try:
            return await self.clock.wait_for(self.call.events.get(), timeout)
        except TimeoutError:
            return None

    def _key(self, digit: str) -> None:
        node = self.path[-1] if self.path else ""
        gather = self.script.nodes[node].gather if node in self.script.nodes else None
        shown = "*" if gather is not None and gather.private else digit
        self.trace.key(KeyPress(node, shown, self.clock.now()))

    # --- gathering ----------------------------------------------------------------------------

    async def _gather(self, gather: Gather) -> str | None:
        node = self.path[-1]
        attempt = 0
        grammar = self._speech_grammar(node, gather)
        retry = False
        while True:
            answer = await self._collect(gather, retry=retry, grammar=grammar)
            if answer.failed:
                # The recogniser failed on this turn: say the prompt again and take keys, without
                # using up one of the caller's retries (they did nothing wrong).
                grammar, retry = None, True
                continue
            if answer.confirm and not await self._confirmed(gather, answer.digits):
                answer = _Answer("")
            if answer.branch is not None:
                self.trace.choices.append((node, f"said: {answer.branch}"))
                return answer.branch
            if answer.digits:
                target = gather.branch.get(answer.digits) or gather.branch.get("default")
                if target is not None:
                    self.variables[gather.store] = answer.digits
                    return target
                log.info("call %s: no branch for %r", self.call.call_id,
                         "*" * len(answer.digits) if gather.private else answer.digits)
            attempt += 1
            retry = True
            if attempt > gather.retries:
                return gather.fallback or self.script.error

    def _speech_grammar(self, node: str, gather: Gather) -> SpeechGrammar | None:
        """What this gather listens for now (None: keys only, and why is logged)."""
        if gather.speech is None:
            return None
        language = self.script.speech_language(gather)
        if canonical_language(self.voice.language).lower() != language.lower():
            # The phrases are in another language than the call speaks now: keys only.
            return None
        recognizer = self.ctx.recognizer
        if recognizer is None or not recognizer.running:
            log.info("call %s: %s takes keys only: %s", self.call.call_id, node,
                     "no speech recogniser" if recognizer is None
                     else "the speech recogniser is not running")
            return None
        return self.script.speech_grammar(node)

    async def _collect(self, gather: Gather, *, retry: bool,
                       grammar: SpeechGrammar | None) -> _Answer:
        """Prompt (unless type-ahead already answered) and collect one answer: keys, or with a
        ``grammar`` what the caller says, whichever completes first."""
        turn: SpeechTurn | None = None
        if grammar is not None and not self.typeahead and self.ctx.recognizer is not None:
            listener = self.ctx.recognizer.listener(grammar, encoding=self.call.codec,
                                                    max_speech_s=gather.max_speech)
            turn = SpeechTurn(listener, complete_s=gather.complete_timeout,
                              incomplete_s=gather.incomplete_timeout,
                              max_speech_s=gather.max_speech)
            # From the prompt's start: speech during it barges in and is the answer.
            self.call.listen(listener)
        try:
            return await self._answer(gather, retry, turn)
        except RecognizerError as exc:
            log.warning("call %s: speech recognition failed at %s (%s); taking keys only",
                        self.call.call_id, self.path[-1], exc)
            self._heard_speech(gather, None, failed=str(exc))
            return _Answer(failed=True)
        finally:
            if turn is not None:
                self.call.listen(None)
                turn.close()

    async def _answer(self, gather: Gather, retry: bool, turn: SpeechTurn | None) -> _Answer:
        entered: list[str] = []
        # A caller already talking (over the prompt before, which stopped for them) is answering
        # already, as keys typed ahead are: no prompt over them.
        if not self.typeahead and not (turn is not None and turn.speaking):
            prompt = [*gather.retry_prompt, *gather.prompt] if retry else list(gather.prompt)
            # Gather prompts are always interruptible: keys pressed during them are the answer.
            await self._speak(prompt, barge_in=True)
        timeout = gather.timeout
        no_input_at = self.clock.now() + timeout
        # A deadline the last wait ran to: it has passed, even where the loop's timer fired a
        # clock-resolution early (asyncio runs timers due within it).
        reached: float | None = None
        while True:
            while self.typeahead:
                if turn is not None:
                    # Keys win: what the caller may be saying meanwhile is not the answer.
                    self.call.listen(None)
                    turn.close()
                    turn = None
                digit = self.typeahead.pop(0)
                if gather.terminator is not None and digit == gather.terminator:
                    return _Answer("".join(entered))
                entered.append(digit)
                if len(entered) >= (gather.digits or MAX_ANSWER_DIGITS):
                    return _Answer("".join(entered))
            if turn is not None and not entered:
                now = self.clock.now() if reached is None else max(self.clock.now(), reached)
                decision = turn.poll(now)
                if decision is not None:
                    return self._spoken(gather, decision)
                if not turn.speaking and now >= no_input_at:
                    if not self.call.on_hold:
                        return _Answer("")
                    # On hold: no-input time stands still until the caller is back (as for keys).
                    event, reached = await self._event_unless(self.call.wait_resumed()), None
                    if event is None:
                        no_input_at = self.clock.now() + timeout
                        continue
                    if isinstance(event, CallerHungUp) or self.call.ended:
                        raise _CallEnded()
                else:
                    event, reached = await self._next_speech_event(turn, now, no_input_at)
            else:
                event = await self._next_event(timeout)
                if event is None:
                    # Timed out: what was typed so far is the answer (empty = no input).
                    return _Answer("".join(entered))
            if isinstance(event, Dtmf):
                self._turn_at = event.at
                self._key(event.digit)
                self.typeahead.append(event.digit)
                timeout = gather.inter_digit_timeout

    async def _next_speech_event(self, turn: SpeechTurn, now: float, no_input_at: float
                                 ) -> tuple[CallEvent | None, float | None]:
        """Wait for what moves a listening gather on: a call event, the turn's recognition,
        or its next deadline (before any speech: the no-input timeout). Returns the event (or
        None) and the deadline when the wait ran to it."""
        deadline = turn.deadline(now) if turn.speaking else no_input_at
        if not turn.speaking and self.trace.on_waiting is not None and \
                self.call.events.empty():
            # Only now is the call waiting for the caller (mid-turn it waits for its own
            # end-of-speech timeouts): the script tester says its next step here.
            self.trace.on_waiting()
        getter = asyncio.ensure_future(self.call.events.get())
        waiters: set[asyncio.Future[Any]] = {getter}
        if turn.pending is not None:
            waiters.add(turn.pending)
        wait = asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        reached = None
        try:
            await self.clock.wait_for(wait, None if deadline is None else max(0.0, deadline - now))
        except TimeoutError:
            reached = deadline
        finally:
            if not getter.done():
                getter.cancel()
        if not getter.done() or getter.cancelled():
            return None, reached
        event = getter.result()
        if isinstance(event, CallerHungUp) or self.call.ended:
            raise _CallEnded()
        return event, None

    def _spoken(self, gather: Gather, decision: SpeechDecision) -> _Answer:
        """The answer of a spoken turn (and its trace entry and metrics)."""
        result = decision.result
        self._heard_speech(gather, decision)
        # The next prompt answers the caller's turn, which ended when their speech did.
        self._turn_at = decision.ended_at
        if result.matched:
            if result.branch is not None:
                return _Answer(branch=result.branch)
            return _Answer(result.digits or "", confirm=result.confirm)
        log.info("call %s: %s heard no answer: %s", self.call.call_id, self.path[-1],
                 result.reason or result.status.value)
        return _Answer("")

    async def _confirmed(self, gather: Gather, digits: str) -> bool:
        """Read back spoken digits the recogniser is not sure of; True once the caller says yes
        (or presses 1). A private gather's digits are never said aloud: asked again instead."""
        if gather.private:
            log.info("call %s: unsure of a private spoken answer; asking again",
                     self.call.call_id)
            return False
        grammar = None
        if self.ctx.recognizer is not None and self.ctx.recognizer.running:
            grammar = SpeechGrammar.build(CONFIRM_PHRASES)
        # Spaced, so the voice reads them digit by digit; a variable, so the sentence is
        # rendered live and never stored in the prompt cache.
        self.variables[_READ_BACK] = " ".join(digits)
        question = Gather(prompt=[Sentence(text=READ_BACK)], digits=1, retries=0,
                          timeout=gather.timeout, branch={"1": "yes", "2": "no"},
                          speech=CONFIRM_PHRASES)
        try:
            answer = await self._collect(question, retry=False, grammar=grammar)
        finally:
            self.variables.pop(_READ_BACK, None)
        yes = answer.branch == "yes" or answer.digits == "1"
        log.info("call %s: read back %d spoken digits: %s", self.call.call_id, len(digits),
                 "confirmed" if yes else "not confirmed, asking again")
        return yes

    def _heard_speech(self, gather: Gather, decision: SpeechDecision | None, *,
                      failed: str | None = None) -> None:
        node = self.path[-1] if self.path else ""
        now = self.clock.now()
        metrics = self.ctx.metrics
        if decision is None:
            self.trace.speech.append(Recognised(node, now, "failed", reason=failed))
            if metrics is not None:
                metrics.speech_turns.labels(self.call.transport_name, "failed").inc()
            return
        r: RecognitionResult = decision.result
        said = r.phrase if r.phrase is not None else r.digits
        private = gather.private
        entry = Recognised(
            node, decision.ended_at, r.status.value.replace("_", " "),
            branch=r.branch,
            said="*" * len(said) if private and said else said,
            heard="*" if private and r.transcript else r.transcript,
            confidence=round(r.confidence, 3), speech_s=round(r.audio_s, 2),
            decision_ms=round(1000 * (decision.decided_at - decision.ended_at), 1),
            reason=r.reason, recognitions=decision.recognitions,
        )
        self.trace.speech.append(entry)
        if metrics is not None:
            metrics.speech_turns.labels(self.call.transport_name, r.status.value).inc()
            if r.status is not MatchStatus.NO_SPEECH:
                metrics.speech_decision.labels(self.call.transport_name).observe(
                    decision.decided_at - decision.ended_at)
        log.info("call %s: %s heard %s (%s, %.0f ms after the speech ended, %d recognition%s)",
                 self.call.call_id, node, r.status.value,
                 entry.said if r.matched else repr(entry.heard), entry.decision_ms,
                 decision.recognitions, "" if decision.recognitions == 1 else "s")

    # --- bot ----------------------------------------------------------------------------------

    async def _bot(self, name: str, bot: Bot) -> None:
        """Hand the call to the bot until it sends ``end`` (:mod:`gateway.bot`): its handoff
        data becomes variables; a bot that fails takes the error path."""
        voice = self.voice
        speaker = self.ctx.speaker_for(voice)
        streaming = bot.text_mode == "stream" or (bot.text_mode == "auto" and voice.clone is None)

        def say(item: str, interruptible: bool, turn_at: float | None) -> Utterance | None:
            spoken_voice = self.script.spoken_voice(item, self.voice)
            template = self.script.sentence(item, spoken_voice.language)
            rendering = self.reader.sentence(template, self.variables, spoken_voice.language)
            if not rendering.spoken.strip():
                return None
            self._turn_at = turn_at
            return self._start_utterance(item, template, rendering.spoken, spoken_voice,
                                         interruptible)

        session = BotSession(
            self.call, bot, node=name, speaker=speaker, reader=self.reader,
            language=voice.language, say=say, config=self.ctx.bots or BotConfig(),
            clock=self.clock, variables=self.variables, recognizer=self.ctx.recognizer,
            http=self.ctx.http, metrics=self.ctx.metrics, trace=self.trace,
            turn_at=self._turn_at, streaming=streaming,
            call_type="SIP" if self.call.transport_name == "sip" else "PSTN",
        )
        self._turn_at = None
        #: The latest bot session (tests and the benchmark read what it did).
        self.bot_session = session
        try:
            handoff = await session.run()
        except CallerLeft:
            raise _CallEnded() from None
        except BotError as exc:
            raise _Failed(str(exc), "bot failed") from None
        for builtin in BUILTIN_VARIABLES:
            handoff.pop(builtin, None)
        self.variables.update(handoff)
        self.trace.choices.append((name, f"bot ended: {', '.join(sorted(handoff)) or 'no data'}"))
        # The next node answers the bot's hand-back at once: measured from it.
        self._turn_at = self.clock.now()

    # --- webhook ------------------------------------------------------------------------------

    async def _webhook(self, name: str, hook: Webhook) -> None:
        names = hook.send if hook.send is not None else sorted(self.variables)
        body = {
            "call_id": self.call.call_id,
            "node": name,
            "variables": {k: self.variables.get(k, "") for k in names},
        }
        client = self.ctx.http
        own = client is None
        # The gateway's shared client (gateway.app.webhook_client); only a context built
        # without one (the script tester, unit tests) pays for a client per webhook.
        client = client or httpx.AsyncClient()
        started = self.clock.now()
        call = WebhookCall(name, hook.url, "ok", 0.0)
        self.trace.webhooks.append(call)
        try:
            # httpx's timeout bounds each read, not the whole exchange: a backend trickling a
            # byte a second would hold the call forever. The deadline covers everything, and
            # the body is read in chunks only up to the limit (never buffered whole first).
            async with self.clock.timeout(hook.timeout):
                content = await _post_json(client, hook, body)
            data = json.loads(content)
        except (TimeoutError, httpx.TimeoutException):
            call.result = "timeout"
            raise _Failed(f"webhook {hook.url} timed out after {hook.timeout:g} s") from None
        except _Failed as exc:
            call.result = exc.result
            raise
        except httpx.HTTPError as exc:
            call.result = f"failed: {type(exc).__name__}"
            raise _Failed(f"webhook {hook.url} failed: {exc}") from None
        except (ValueError, RecursionError):
            # RecursionError: a few thousand nested brackets fit in MAX_WEBHOOK_BYTES.
            call.result = "not json"
            raise _Failed(f"webhook {hook.url} did not answer JSON") from None
        finally:
            call.ms = round(1000 * (self.clock.now() - started), 1)
            if own:
                await client.aclose()
            if call.result != "ok" and self.ctx.metrics is not None:
                # "failed: ConnectError" -> "failed": the label stays a short list.
                self.ctx.metrics.webhook_failures.labels(call.result.split(":", 1)[0]).inc()
        if not isinstance(data, dict):
            call.result = "not a json object"
            if self.ctx.metrics is not None:
                self.ctx.metrics.webhook_failures.labels(call.result).inc()
            raise _Failed(f"webhook {hook.url} answered JSON that is not an object")
        merged = _merge_variables(data)
        # The call's own variables are facts of the call, not the backend's to change.
        for builtin in BUILTIN_VARIABLES:
            merged.pop(builtin, None)
        self.variables.update(merged)
        call.set = sorted(merged)
        # The turn that follows a webhook is measured from its answer.
        self._turn_at = self.clock.now()
        log.info("call %s: webhook %s set %s", self.call.call_id, name, sorted(merged))


async def _post_json(client: httpx.AsyncClient, hook: Webhook, body: dict[str, Any]) -> bytes:
    """POST ``body``; the answer's bytes, refused (:class:`_Failed`) past MAX_WEBHOOK_BYTES."""
    async with client.stream("POST", hook.url, json=body, timeout=hook.timeout) as response:
        if response.status_code >= 400:
            raise _Failed(f"webhook {hook.url} answered {response.status_code}",
                          f"http {response.status_code}")
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and (len(declared) > 18 or int(declared) > MAX_WEBHOOK_BYTES):
            raise _Failed(f"webhook {hook.url} answered more than {MAX_WEBHOOK_BYTES} bytes",
                          "too large")
        chunks: list[bytes] = []
        size = 0
        async for chunk in response.aiter_bytes():
            size += len(chunk)
            if size > MAX_WEBHOOK_BYTES:
                raise _Failed(f"webhook {hook.url} answered more than {MAX_WEBHOOK_BYTES} bytes",
                              "too large")
            chunks.append(chunk)
    return b"".join(chunks)


def _merge_variables(data: dict[str, Any]) -> dict[str, str]:
    """Scalar values of a webhook answer as plain-text variables (nested values are ignored)."""
    merged: dict[str, str] = {}
    for key, value in data.items():
        if not isinstance(key, str) or not key.isidentifier():
            continue
        if isinstance(value, bool):
            value = "yes" if value else "no"
        if isinstance(value, (str, int, float)):
            merged[key] = str(value)[:MAX_VARIABLE_CHARS]
    return merged


def load_sound(path: Path) -> np.ndarray:
    """A WAV file as 8 kHz mono int16 (any rate and channel count soundfile reads)."""
    import soundfile as sf
    from scipy.signal import resample_poly

    audio, rate = sf.read(str(path), dtype="float32", always_2d=True)
    mono = audio.mean(axis=1)
    if rate != 8000:
        from math import gcd

        g = gcd(int(rate), 8000)
        mono = resample_poly(mono, 8000 // g, int(rate) // g).astype(np.float32)
    from gateway.audio.g711 import float_to_int16

    return float_to_int16(mono)
