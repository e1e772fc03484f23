"""A call handed to a bot: one :class:`BotSession` per visit of a script's ``bot`` node.

The session opens the WebSocket to the bot (:mod:`gateway.bot.connection`), says the node's
welcome greeting meanwhile, sends ``setup``, and from then on carries the conversation both
ways until the bot sends ``end`` (its ``handoffData`` becomes call variables and the script goes
on at the node's ``next``) or fails (the script's error path):

- **The caller -> the bot.** The call listens all along (:meth:`Call.listen
  <gateway.call.session.Call.listen>`); a turn ends after ``end_of_speech`` of silence and its
  transcript goes out as ``prompt``. Keys go out as ``dtmf`` with ``dtmf_detection``.
- **The bot -> the caller.** ``text`` tokens up to ``last`` are one *talk*: read as the line
  reads its sentences, a piece at a time (:class:`~gateway.bot.text.TextFeed`), spoken while the
  bot still writes (:class:`~gateway.bot.talk.TalkStream`). Talks play in order; ``play`` (a
  URL fetched under limits, or a script prompt by name) and ``sendDigits`` (RFC 4733 on SIP,
  in-band tones where the transport carries none) take their turn among them.
- **Barge-in.** Keys or speech, as the talk's ``interruptible`` allows, stop the bot's audio
  (:meth:`Call.barge_in <gateway.call.session.Call.barge_in>`: faded where the gateway owns the
  stream, ``clear`` on Twilio) and the bot gets ``interrupt`` with what the caller had heard:
  the frames that reached them (on Twilio, less what Twilio still held), as the bot's own words
  (:meth:`TalkStream.heard <gateway.bot.talk.TalkStream.heard>`). Queued talks are dropped, and
  so are the interrupted answer's tokens still on their way (the bot's LLM goes on writing
  until it reads ``interrupt``) up to the answer's ``last`` or the caller's next input to the
  bot (a ``prompt``, or the interrupting key's ``dtmf``: whatever comes after may answer it).
  Speech the caller makes over a talk that speech cannot interrupt is not sent
  (ConversationRelay's ``reportInputDuringAgentSpeech: none``).
- **Preemption.** A new talk stops a playing talk marked ``preemptible`` and replaces those
  queued (the bot's "let me check..." gives way to the answer); no ``interrupt`` is sent.
- **Bad messages** get ``error`` back and a log line; the call goes on. A bot that does not
  answer the caller's prompt within ``timeout``, stops for ``timeout`` in the middle of an
  answer, cannot be reached, or closes the socket ends the session with
  :class:`~gateway.errors.BotError`: the runner takes the script's error path.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import math
import re
import secrets
import ssl
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import httpx
import numpy as np
import numpy.typing as npt

from gateway.asr.grammar import SpeechGrammar, language_code
from gateway.audio.dtmf import dtmf_tones
from gateway.bot.connection import BotConnection, OutMessage
from gateway.bot.protocol import (
    BotMessage,
    DtmfOut,
    End,
    ErrorOut,
    Interrupt,
    Language,
    Play,
    Prompt,
    SendDigits,
    Setup,
    Text,
)
from gateway.bot.talk import CHARS_PER_S, TalkStream, TurnStream
from gateway.bot.text import TextFeed
from gateway.call.events import CallerHungUp, CallEvent, Dtmf, SpeechFailed, SpeechStarted
from gateway.call.playout import FRAME_S
from gateway.call.session import Call, Utterance
from gateway.clock import Clock
from gateway.errors import BotError, BotMessageError, RecognizerError
from gateway.ivr.listening import SpeechInput, SpeechTurn
from gateway.ivr.script import LANGUAGES, Bot, bot_language, render
from gateway.ivr.trace import CallTrace, Heard, Recognised
from gateway.metrics import Metrics
from gateway.speech import Speaker
from gateway.text import Reader

__all__ = ["BotConfig", "BotSession", "CallerLeft", "TalkRecord", "handoff_variables"]

log = logging.getLogger(__name__)

#: Longest value a handoff variable keeps (it may be read out; it is never executed).
MAX_VARIABLE_CHARS = 200
#: Messages waiting to go to a bot that does not read them: past this it is taken as gone.
MAX_OUTBOX = 256

#: After a key cuts an answer off, the key goes to the bot once the interrupted answer's tokens
#: have stopped arriving for this long: anything read before then is the old answer, anything
#: after answers the key. Longer than a bot's reaction to ``interrupt``
#: over a local network, short beside the key's own 40-100 ms.
INTERRUPT_QUIET_S = 0.1
#: A BCP 47 tag for prompts' ``lang`` when the conversation's language is named, not tagged.
_DEFAULT_TAGS = {"en": "en-US", "es": "es-ES", "fr": "fr-FR", "de": "de-DE", "it": "it-IT",
                 "pt": "pt-BR", "ja": "ja-JP", "ko": "ko-KR", "zh": "zh-CN", "ru": "ru-RU"}
#: What the built-in recogniser listens for when a bot node gives no hints (its open pass
#: transcribes around them: free-form, within its vocabulary).
_DEFAULT_PHRASES = ("yes", "no", "agent", "help")

Mode = Literal["none", "dtmf", "speech", "any"]


class CallerLeft(Exception):
    """The caller hung up during the bot's conversation."""


@dataclass
class BotConfig:
    """How this gateway reaches bots (one per gateway, built off the event loop)."""

    #: Signs each handshake's ``X-Twilio-Signature`` (the account's auth token); None: unsigned.
    auth_token: str | None = None
    #: ``setup``'s ``accountSid``.
    account_sid: str = ""
    #: Certificate checks for ``wss://`` (None: the system's trust store, loaded per connect).
    ssl_context: ssl.SSLContext | None = None
    #: WebSocket keepalive pings (a bot that stops answering them is gone).
    ping_interval_s: float | None = 20.0
    #: ``play`` of a URL: the largest file fetched, how long a fetch may take, and how many
    #: decoded files are kept (by URL) for the next caller.
    max_play_bytes: int = 8 * 1024 * 1024
    play_timeout_s: float = 10.0
    play_cache_entries: int = 32
    _played: OrderedDict[str, npt.NDArray[np.int16]] = field(default_factory=OrderedDict,
                                                            repr=False)

    def cached_sound(self, url: str) -> npt.NDArray[np.int16] | None:
        pcm = self._played.get(url)
        if pcm is not None:
            self._played.move_to_end(url)
        return pcm

    def keep_sound(self, url: str, pcm: npt.NDArray[np.int16]) -> None:
        self._played[url] = pcm
        while len(self._played) > self.play_cache_entries:
            self._played.popitem(last=False)


@dataclass
class TalkRecord:
    """One talk as it went (tests and the benchmark read these)."""

    kind: str
    text: str = ""
    #: The bot's first token (or message) of this talk, on the call's clock.
    first_token_at: float | None = None
    first_audio_at: float | None = None
    interrupted: bool = False
    preempted: bool = False
    #: What the caller heard when they cut in (as sent in ``interrupt``), and for how long.
    heard: str | None = None
    heard_ms: int | None = None


@dataclass(eq=False)
class _Talk:
    kind: Literal["text", "say", "play", "digits"]
    mode: Mode
    preemptible: bool
    language: str
    record: TalkRecord
    feed: TextFeed | None = None
    stream: TalkStream | None = None
    text: str = ""
    source: str = ""
    loops: int = 1
    pcm: npt.NDArray[np.int16] | None = None
    fetch: asyncio.Task[npt.NDArray[np.int16]] | None = None
    digits: str = ""
    task: asyncio.Task[None] | None = None
    utterance: Utterance | None = None
    turn_at: float | None = None
    heard_entry: Heard | None = None
    played: int = 0
    stopped: bool = False

    def allows(self, by: Literal["dtmf", "speech"]) -> bool:
        return self.mode == "any" or self.mode == by


class BotSession:
    """One visit of a ``bot`` node (see the module docstring)."""

    def __init__(
        self,
        call: Call,
        bot: Bot,
        *,
        node: str,
        speaker: Speaker,
        reader: Reader,
        language: str,
        say: Callable[[str, bool, float | None], Utterance | None],
        config: BotConfig,
        clock: Clock,
        variables: dict[str, str],
        recognizer: SpeechInput | None = None,
        http: httpx.AsyncClient | None = None,
        metrics: Metrics | None = None,
        trace: CallTrace | None = None,
        turn_at: float | None = None,
        streaming: bool = True,
        call_type: str = "PSTN",
    ) -> None:
        """``say`` speaks a whole sentence (the greeting, a prompt the bot plays by name) and
        returns its utterance (from the prompt cache where it was rendered ahead);
        ``turn_at``: when the caller's turn before this node ended (its first audio counts
        from there)."""
        self.call = call
        self.bot = bot
        self.node = node
        self.speaker = speaker
        self.reader = reader
        self.language = language
        self.say = say
        self.config = config
        self.clock = clock
        self.variables = variables
        self.recognizer = recognizer
        self.http = http
        self.metrics = metrics
        self.trace = trace
        self.streaming = streaming
        self.call_type = call_type
        self.lang_tag = _tag(bot.language, language)
        self.transcription_tag = self.lang_tag
        #: Every talk, in the order they were queued.
        self.talks: list[TalkRecord] = []
        #: Prompts sent to the bot (text, when the caller's speech ended, when it was sent).
        self.prompts: list[tuple[str, float, float]] = []
        self._conn = BotConnection(bot.url, auth_token=config.auth_token,
                                   ssl_context=config.ssl_context,
                                   open_timeout=bot.connect_timeout,
                                   ping_interval=config.ping_interval_s)
        self._inbox: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._outbox: asyncio.Queue[OutMessage] = asyncio.Queue(MAX_OUTBOX)
        self._tasks: list[asyncio.Task[Any]] = []
        self._current: _Talk | None = None
        self._queue: deque[_Talk] = deque()
        self._open_text: _Talk | None = None
        self._discarding = False
        # Keys held back until the interrupted answer has stopped arriving (see _pump).
        self._held_digits: list[str] = []
        self._held_wake = asyncio.Event()
        self._turn: SpeechTurn | None = None
        self._turn_ignored = False
        self._turn_at = turn_at
        self._answer_due: float | None = None
        self._token_due: float | None = None
        self._ended: dict[str, str] | None = None
        self._connected = False
        self._grammar: SpeechGrammar | None = None
        self._warned_no_speech = False

    # --- the session ------------------------------------------------------------------------------

    async def run(self) -> dict[str, str]:
        """Carry the conversation until the bot ends it; returns the handoff variables.

        Raises :class:`~gateway.errors.BotError` (the script's error path) or
        :class:`CallerLeft`."""
        outcome = "error"
        self._tasks.append(asyncio.create_task(self._pump(), name=f"bot-{self.call.call_id}"))
        try:
            greeting = self.bot.welcome_greeting
            if greeting:
                record = TalkRecord("say", render(greeting, self.variables),
                                    first_token_at=self.clock.now())
                # The greeting as the script writes it: the prompt cache has it rendered.
                await self._add(_Talk("say", self.bot.welcome_greeting_interruptible, False,
                                      self.language, record, text=greeting,
                                      turn_at=self._turn_at))
                self._turn_at = None
            self._listen()
            while True:
                if self._ended is not None and self._current is None and not self._queue:
                    outcome = "end"
                    return self._ended
                kind, value = await self._next()
                await self._handle(kind, value)
        except CallerLeft:
            outcome = "caller"
            raise
        finally:
            await self._close(outcome)

    async def _close(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.bot_sessions.labels(outcome).inc()
        self.call.listen(None)
        if self._turn is not None:
            self._turn.close()
            self._turn = None
        for task in [*self._tasks, *(t.fetch for t in self._all_talks() if t.fetch),
                     *(t.task for t in self._all_talks() if t.task)]:
            if task is not None and not task.done():
                task.cancel()
        if outcome == "error" and not self.call.ended:
            # The script's error path speaks next: the bot's audio stops here.
            await self._stop_current(silent=True)
        self._finish_heard()
        await self._conn.close(1000 if outcome != "error" else 1011,
                               "session ended" if outcome != "error" else "gateway error")

    def _all_talks(self) -> list[_Talk]:
        return [t for t in (self._current, *self._queue) if t is not None]

    # --- waiting ----------------------------------------------------------------------------------

    async def _pump(self) -> None:
        """Connect, send ``setup`` then whatever waits, and read the bot's messages into the
        inbox; the bot's failure is one ``gone`` item."""
        try:
            await self._conn.connect()
            call = self.call
            parameters = {key: render(value, self.variables)
                          for key, value in self.bot.parameters.items()}
            await self._conn.send(Setup(
                session_id="VX" + secrets.token_hex(16), call_sid=call.call_id,
                from_=call.parameters.get("caller", ""), to=call.parameters.get("called", ""),
                account_sid=self.config.account_sid, call_type=self.call_type,
                custom_parameters=parameters))
            self._count("out", "setup")
            self._connected = True
            writer = asyncio.create_task(self._write(), name=f"bot-out-{call.call_id}")
            self._tasks.append(writer)
            await self._read()
        except BotError as exc:
            await self._inbox.put(("gone", exc))

    async def _read(self) -> None:
        """Read the bot's messages into the inbox, in order. While keys are held (a key cut an
        answer off), a key goes out once no message has come for ``INTERRUPT_QUIET_S``, and a
        ``fenced`` item marks the place in the inbox: what was read before it is the rest of
        the cut-off answer (the bot had not seen ``interrupt`` when it sent it), what comes
        after may answer the key. The fence is placed here, where messages are read, because
        anywhere later a message still on its way through the event loop would land on the
        wrong side of it."""
        receiving: asyncio.Future[Any] | None = None
        try:
            while True:
                if receiving is None:
                    receiving = asyncio.ensure_future(self._conn.receive())
                if self._held_digits:
                    try:
                        await self.clock.wait_for(asyncio.shield(receiving), INTERRUPT_QUIET_S)
                    except TimeoutError:
                        digits, self._held_digits = self._held_digits, []
                        await self._inbox.put(("fenced", None))
                        for digit in digits:
                            self._send(DtmfOut(digit))
                        continue
                else:
                    self._held_wake.clear()
                    wake = asyncio.ensure_future(self._held_wake.wait())
                    try:
                        await asyncio.wait({receiving, wake},
                                           return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        wake.cancel()
                    if not receiving.done():
                        continue  # a key is held: wait for the quiet
                message = receiving.result()
                receiving = None
                await self._inbox.put(("bot", message))
        finally:
            if receiving is not None:
                if receiving.done():
                    if not receiving.cancelled():
                        receiving.exception()  # read here: the session is over (no warning)
                else:
                    receiving.cancel()

    async def _write(self) -> None:
        try:
            while True:
                message = await self._outbox.get()
                await self._conn.send(message)
        except BotError as exc:
            await self._inbox.put(("gone", exc))

    def _send(self, message: OutMessage) -> None:
        """Queue a message for the bot (in order; ``setup`` goes first)."""
        kind = type(message).__name__.lower().removesuffix("out")
        try:
            self._outbox.put_nowait(message)
        except asyncio.QueueFull:
            raise BotError(f"the bot has not read its last {MAX_OUTBOX} messages") from None
        self._count("out", kind)

    async def _next(self) -> tuple[str, Any]:
        """The next thing that moves the session: a bot message, a call event, a recognition,
        or a deadline."""
        now = self.clock.now()
        deadlines = [d for d in (self._answer_due, self._token_due) if d is not None]
        turn = self._turn
        if turn is not None and turn.speaking:
            deadline = turn.deadline(now)
            if deadline is not None:
                deadlines.append(deadline)
        inbox = asyncio.ensure_future(self._inbox.get())
        events = asyncio.ensure_future(self.call.events.get())
        waiters: set[asyncio.Future[Any]] = {inbox, events}
        if turn is not None and turn.pending is not None:
            waiters.add(turn.pending)
        wait = asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        try:
            timeout = max(0.0, min(deadlines) - now) if deadlines else None
            await self.clock.wait_for(wait, timeout)
        except TimeoutError:
            pass
        finally:
            for future in (inbox, events):
                if not future.done():
                    future.cancel()
        # One item per wake: the other stays where it was (a cancelled get takes nothing).
        if events.done() and not events.cancelled():
            if inbox.done() and not inbox.cancelled():
                self._inbox.put_nowait(inbox.result())  # order among the inbox's own kept
            return "event", events.result()
        if inbox.done() and not inbox.cancelled():
            return inbox.result()
        return "tick", None

    async def _handle(self, kind: str, value: Any) -> None:
        now = self.clock.now()
        if kind == "event":
            await self._on_event(value)
        elif kind == "bot":
            self._answer_due = None
            if isinstance(value, BotMessageError):
                self._reject(str(value))
            elif self._ended is not None:
                self._reject("the session has ended (after 'end'); this message is ignored",
                             quiet=True)
            else:
                await self._on_message(value)
        elif kind == "gone":
            if self._ended is None:
                raise value
        elif kind == "fenced":
            # The interrupted answer's tokens have stopped; the held key has gone to the bot.
            self._discarding = False
        elif kind == "fetched":
            self._start_next()
        elif kind == "digits":
            talk = value
            if talk is self._current:
                self._finish_current()
        if self._answer_due is not None and now >= self._answer_due:
            raise BotError(f"the bot did not answer the caller within {self.bot.timeout:g} s")
        if self._token_due is not None and now >= self._token_due:
            raise BotError(f"the bot stopped in the middle of an answer: no token for "
                           f"{self.bot.timeout:g} s")
        self._poll_turn()
        self._check_current()

    # --- the bot's messages -----------------------------------------------------------------------

    async def _on_message(self, message: BotMessage) -> None:
        self._count("in", _type_name(message))
        if isinstance(message, Text):
            await self._on_text(message)
        elif isinstance(message, Play):
            await self._on_play(message)
        elif isinstance(message, SendDigits):
            await self._on_digits(message)
        elif isinstance(message, Language):
            self._on_language(message)
        else:
            assert isinstance(message, End)
            await self._on_end(message)

    def _reject(self, reason: str, *, quiet: bool = False) -> None:
        """Answer a message that cannot be taken with ``error``; the call goes on."""
        log.log(logging.INFO if quiet else logging.WARNING, "call %s: bot message refused: %s",
                self.call.call_id, reason)
        if self.metrics is not None:
            self.metrics.bot_message_errors.inc()
        if self._ended is None or not quiet:
            self._send(ErrorOut(reason))

    async def _on_text(self, message: Text) -> None:
        now = self.clock.now()
        if self._discarding:
            # The rest of an answer the caller cut off: never spoken.
            if message.last:
                self._discarding = False
            return
        talk = self._open_text
        if talk is None:
            if not message.token.strip() and message.last:
                return  # the end of an answer that never began (or was spoken already)
            language = self.language
            if message.lang is not None:
                found = bot_language(message.lang, LANGUAGES)
                if found is None:
                    self._reject(f"text: 'lang' {message.lang!r} is not a language this "
                                 f"voice speaks; speaking {self.language}")
                else:
                    language = found
            mode = self._mode(message.interruptible)
            preemptible = (message.preemptible if message.preemptible is not None
                           else self.bot.preemptible)
            record = TalkRecord("text", first_token_at=now)
            talk = _Talk("text", mode, preemptible, language, record,
                         feed=TextFeed(self.reader, language), turn_at=self._turn_at)
            self._turn_at = None
            talk.stream = TalkStream(self._opener(talk), streaming=self.streaming)
            self._open_text = talk
            await self._add(talk)
        assert talk.feed is not None and talk.stream is not None
        if talk.stopped:
            pieces = []
        else:
            pieces = talk.feed.push(message.token)
            if message.last:
                pieces += talk.feed.finish()
        for piece in pieces:
            talk.stream.add(piece)
        talk.text = talk.feed.written + talk.feed.pending
        if talk.utterance is not None:
            talk.utterance.text = talk.text
        if message.last:
            talk.stream.close()
            self._open_text = None
            self._token_due = None
        else:
            self._token_due = now + self.bot.timeout

    def _opener(self, talk: _Talk) -> Callable[[str, bool], TurnStream]:
        speaker = self.speaker

        def open_turn(text: str, streaming: bool) -> TurnStream:
            utterance = talk.utterance
            assert utterance is not None
            voice = replace(speaker.voice, language=talk.language)
            request = replace(speaker.request(text, self.call.call_id, utterance.id, voice),
                              text_stream=streaming)
            return speaker.speech.stream(request, turn_started_at=utterance.turn_started_at)

        return open_turn

    async def _on_play(self, message: Play) -> None:
        now = self.clock.now()
        mode = self._mode(message.interruptible)
        preemptible = (message.preemptible if message.preemptible is not None
                       else self.bot.preemptible)
        record = TalkRecord("play", message.source, first_token_at=now)
        source = message.source
        talk = _Talk("play", mode, preemptible, self.language, record, source=source,
                     loops=message.loop, turn_at=self._turn_at)
        if source.startswith(("https://", "http://")):
            cached = self.config.cached_sound(source)
            if cached is not None:
                talk.pcm = cached
            else:
                talk.fetch = asyncio.create_task(self._fetch(source))
                talk.fetch.add_done_callback(lambda _: self._inbox.put_nowait(("fetched", talk)))
        elif source in self.bot.prompts:
            talk.kind, talk.text = "say", source
        else:
            self._reject(f"play: {source!r} is neither an http(s) URL nor a prompt this bot may "
                         f"play (its node's 'prompts': {', '.join(self.bot.prompts) or 'none'})")
            return
        self._turn_at = None
        await self._add(talk)

    async def _fetch(self, url: str) -> npt.NDArray[np.int16]:
        """``url``'s audio as 8 kHz PCM: a bounded download, decoded by soundfile (WAV, FLAC,
        OGG, MP3 where libsndfile reads it)."""
        client = self.http or httpx.AsyncClient()
        limit = self.config.max_play_bytes
        try:
            async with self.clock.timeout(self.config.play_timeout_s):
                async with client.stream("GET", url, follow_redirects=True) as response:
                    if response.status_code >= 400:
                        raise BotMessageError(f"play: {url} answered HTTP "
                                              f"{response.status_code}")
                    chunks, size = [], 0
                    async for chunk in response.aiter_bytes():
                        size += len(chunk)
                        if size > limit:
                            raise BotMessageError(f"play: {url} is larger than {limit} bytes")
                        chunks.append(chunk)
        except TimeoutError:
            raise BotMessageError(f"play: fetching {url} took longer than "
                                  f"{self.config.play_timeout_s:g} s") from None
        except httpx.HTTPError as exc:
            raise BotMessageError(f"play: fetching {url} failed: {exc}") from None
        finally:
            if self.http is None:
                await client.aclose()
        try:
            pcm = await asyncio.to_thread(decode_sound, b"".join(chunks))
        except Exception as exc:
            raise BotMessageError(f"play: {url} is not audio this gateway can decode "
                                  f"({type(exc).__name__})") from None
        self.config.keep_sound(url, pcm)
        return pcm

    async def _on_digits(self, message: SendDigits) -> None:
        record = TalkRecord("digits", message.digits, first_token_at=self.clock.now())
        await self._add(_Talk("digits", "none", False, self.language, record,
                              digits=message.digits))

    def _on_language(self, message: Language) -> None:
        if message.tts_language is not None:
            found = bot_language(message.tts_language, LANGUAGES)
            if found is None:
                self._reject(f"language: ttsLanguage {message.tts_language!r} is not a "
                             f"language this voice speaks; still speaking {self.language}")
            else:
                self.language = found
                self.lang_tag = message.tts_language
        if message.transcription_language is not None:
            code = language_code(message.transcription_language)
            known = self._recognizer_languages()
            if code is None or (known is not None and code not in known):
                self._reject(f"language: transcriptionLanguage "
                             f"{message.transcription_language!r} is not one the speech "
                             f"recogniser knows ({', '.join(sorted(known or ())) or 'none'}); "
                             f"still listening for {self.transcription_tag}")
            else:
                self.transcription_tag = message.transcription_language
                self._grammar = None  # the next turn listens in the new language

    async def _on_end(self, message: End) -> None:
        self._ended = handoff_variables(message.handoff_data)
        log.info("call %s: the bot ended its session (handoff %s)", self.call.call_id,
                 sorted(self._ended))
        # Nothing more is heard from the caller: what the bot said last plays to its end.
        self.call.listen(None)
        if self._turn is not None:
            self._turn.close()
            self._turn = None
        talk = self._open_text
        if talk is not None and talk.feed is not None and talk.stream is not None:
            for piece in talk.feed.finish():
                talk.stream.add(piece)
            talk.stream.close()
            self._open_text = None
        self._token_due = self._answer_due = None
        await self._conn.close(1000, "session ended")

    # --- talks ------------------------------------------------------------------------------------

    async def _add(self, talk: _Talk) -> None:
        """Queue a talk: it gives way to nothing, but preemptible talks give way to it."""
        self.talks.append(talk.record)
        current = self._current
        if current is not None and current.preemptible and current is not talk:
            current.record.preempted = True
            await self._stop_current(silent=True)
        for queued in [t for t in self._queue if t.preemptible]:
            queued.record.preempted = True
            self._drop(queued)
        self._queue.append(talk)
        self._start_next()

    def _drop(self, talk: _Talk) -> None:
        if talk in self._queue:
            self._queue.remove(talk)
        talk.stopped = True
        if talk.stream is not None:
            talk.stream.cancel()
        if talk is self._open_text:
            self._open_text = None
            self._token_due = None
            self._discarding = True

    def _start_next(self) -> None:
        call = self.call
        while self._current is None and self._queue and not call.ended:
            talk = self._queue[0]
            if talk.kind == "play" and talk.pcm is None:
                fetch = talk.fetch
                if fetch is None or not fetch.done():
                    return  # its turn comes once fetched
                self._queue.popleft()
                error = fetch.exception() if not fetch.cancelled() else None
                if error is not None or fetch.cancelled():
                    self._reject(str(error) if error else "play: fetch cancelled")
                    continue
                talk.pcm = fetch.result()
            else:
                self._queue.popleft()
            self._current = talk
            self._begin(talk)

    def _begin(self, talk: _Talk) -> None:
        call = self.call
        speech = talk.allows("speech")
        if talk.kind == "text":
            assert talk.stream is not None
            stream = talk.stream
            talk.utterance = call.speak(talk.text or "(bot)", lambda _: stream,
                                        turn_started_at=talk.turn_at, interruptible=speech)
        elif talk.kind == "say":
            text = talk.text
            talk.utterance = self.say(text, speech, talk.turn_at)
            if talk.utterance is None:
                self._reject(f"could not say {text!r}")
                self._current = None
                return
        elif talk.kind == "play":
            assert talk.pcm is not None
            talk.utterance = call.play(talk.pcm, label=f"bot-play:{talk.source}",
                                       turn_started_at=talk.turn_at, interruptible=speech)
        else:
            talk.task = asyncio.create_task(self._send_digits(talk))
            return
        talk.played += 1
        if self.trace is not None and talk.heard_entry is None:
            talk.heard_entry = Heard(self.node, talk.text or talk.source, talk.language,
                                     self.speaker.voice.speaker, self.clock.now(),
                                     cached=talk.utterance.cached)
            self.trace.heard.append(talk.heard_entry)

    async def _send_digits(self, talk: _Talk) -> None:
        try:
            sent = await self.call.send_digits(talk.digits)
            if not sent:
                # No keys out of band on this transport: the keypad's tones, in band.
                pcm = dtmf_tones(talk.digits)
                talk.utterance = self.call.play(pcm, label=f"bot-digits:{talk.digits}")
                await talk.utterance.played.wait()
        finally:
            self._inbox.put_nowait(("digits", talk))

    def _check_current(self) -> None:
        """Move on when the current talk has played (or failed)."""
        talk = self._current
        if talk is None:
            self._start_next()
            return
        utterance = talk.utterance
        if utterance is not None and utterance.first_frame_at is not None and \
                talk.record.first_audio_at is None:
            talk.record.first_audio_at = utterance.first_frame_at
            if self.metrics is not None and talk.record.first_token_at is not None and \
                    talk.kind == "text":
                self.metrics.bot_first_audio.observe(
                    max(0.0, utterance.first_frame_at - talk.record.first_token_at))
        if talk.kind == "digits":
            return  # its task says when it is done
        if utterance is None:
            return
        if utterance.error is not None:
            self._reject(f"speaking failed: {utterance.error}")
            self._finish_current()
        elif utterance.played.is_set():
            if talk.kind == "play" and not talk.stopped and (talk.loops == 0 or
                                                             talk.played < talk.loops):
                self._begin(talk)
                return
            self._finish_current()

    def _finish_current(self) -> None:
        talk, self._current = self._current, None
        if talk is not None:
            self._heard(talk)
        self._start_next()

    def _heard(self, talk: _Talk) -> None:
        if talk.kind == "text":
            talk.record.text = talk.feed.written if talk.feed is not None else talk.text
            if talk.heard_entry is not None and talk.stream is not None:
                talk.heard_entry.text = talk.record.text
                talk.heard_entry.words = "".join(p.spoken for s in talk.stream.segments
                                                 for p in s.pieces)
        if talk.heard_entry is not None:
            talk.heard_entry.interrupted = talk.record.interrupted or talk.record.preempted

    def _finish_heard(self) -> None:
        for talk in self._all_talks():
            self._heard(talk)

    async def _stop_current(self, *, silent: bool) -> tuple[str, int] | None:
        """Stop the current talk's audio (faded); what the caller heard of it, and for how
        many milliseconds. The queue is left as it is."""
        talk = self._current
        if talk is None:
            return None
        call = self.call
        utterance = talk.utterance
        heard_ms = 0
        if utterance is not None and not utterance.done:
            # What reached the caller: frames sent, less what the far end still held unplayed
            # (Twilio plays up to its lead behind us; RTP has nothing in flight).
            unplayed = round(call.playout.unplayed_s() / FRAME_S)
            heard_ms = max(0, utterance.frames_sent - unplayed) * round(FRAME_S * 1000)
            await call.barge_in()
        talk.stopped = True
        if talk.stream is not None:
            talk.stream.cancel()
        if talk.task is not None and not talk.task.done():
            talk.task.cancel()
        if talk is self._open_text:
            self._open_text = None
            self._token_due = None
            self._discarding = True
        heard = ""
        if talk.kind == "text" and talk.stream is not None:
            heard = talk.stream.heard(heard_ms / 1000)
        elif talk.kind == "say":
            heard = _proportion(talk.text, utterance, heard_ms)
        self._current = None
        self._heard(talk)
        if not silent:
            talk.record.heard, talk.record.heard_ms = heard, heard_ms
        return heard, heard_ms

    async def _interrupt(self, by: Literal["dtmf", "speech"]) -> bool:
        """The caller cut the bot off (if the current talk lets ``by``): stop, drop what was
        queued, and tell the bot what was heard."""
        talk = self._current
        if talk is None or not talk.allows(by) or talk.kind == "digits":
            return False
        talk.record.interrupted = True
        stopped = await self._stop_current(silent=False)
        for queued in list(self._queue):
            self._drop(queued)
        heard, heard_ms = stopped or ("", 0)
        self._send(Interrupt(heard, heard_ms))
        if self.metrics is not None:
            self.metrics.bot_interrupts.labels(by).inc()
        log.info("call %s: the caller cut the bot off (%s) after %d ms", self.call.call_id, by,
                 heard_ms)
        return True

    # --- the caller -------------------------------------------------------------------------------

    async def _on_event(self, event: CallEvent) -> None:
        if isinstance(event, CallerHungUp) or self.call.ended:
            raise CallerLeft()
        if isinstance(event, Dtmf):
            self._turn_at = event.at
            interrupted = await self._interrupt("dtmf")
            if self.bot.dtmf_detection and self._ended is None:
                if interrupted or self._held_digits:
                    # Tokens of the cut-off answer may still be on their way: the key goes to
                    # the bot once they have stopped (_read), and what comes after may answer
                    # it (the "fenced" item ends the dropping).
                    self._held_digits.append(event.digit)
                    self._held_wake.set()
                else:
                    self._send(DtmfOut(event.digit))
                    # What the bot sends from now on may answer this key: nothing is dropped.
                    self._discarding = False
        elif isinstance(event, SpeechStarted):
            talk = self._current
            if talk is not None and not talk.allows("speech"):
                # Speech over a talk it cannot interrupt is not the caller's next turn.
                self._turn_ignored = True
            else:
                await self._interrupt("speech")
        elif isinstance(event, SpeechFailed):
            pass  # seen through the utterance's error (_check_current)

    def _listen(self) -> None:
        """Start listening for the caller's next turn."""
        recognizer = self.recognizer
        if recognizer is None or not recognizer.running or self._ended is not None:
            if not self._warned_no_speech and self._ended is None:
                self._warned_no_speech = True
                log.warning("call %s: no speech recogniser for the bot's conversation: the "
                            "caller's keys reach the bot, their words do not",
                            self.call.call_id)
            self._turn = None
            return
        if self._grammar is None:
            self._grammar = self._make_grammar()
        listener = recognizer.listener(self._grammar, encoding=self.call.codec,
                                       max_speech_s=self.bot.max_speech)
        self._turn = SpeechTurn(listener, complete_s=self.bot.end_of_speech,
                                incomplete_s=self.bot.end_of_speech,
                                max_speech_s=self.bot.max_speech)
        self._turn_ignored = False
        self.call.listen(listener)

    def _make_grammar(self) -> SpeechGrammar:
        """What the recogniser listens for: the caller's own words. A neural recogniser
        (Whisper, alone or combined) transcribes them free-form; PocketSphinx alone cannot, and
        its open-vocabulary pass transcribes around phrases instead (the node's hints)."""
        code = language_code(self.transcription_tag) or "en"
        if _transcribes(self.recognizer):
            return SpeechGrammar.free_form(code)
        phrases = self.bot.hints or list(_DEFAULT_PHRASES)
        return SpeechGrammar.build({f"hint{i}": [p] for i, p in enumerate(phrases)},
                                   language=code)

    def _recognizer_languages(self) -> frozenset[str] | None:
        return frozenset({"en"}) if self.recognizer is not None else None

    def _poll_turn(self) -> None:
        turn = self._turn
        if turn is None:
            if self._ended is None and self.recognizer is not None and self.recognizer.running:
                self._listen()
            return
        now = self.clock.now()
        try:
            decision = turn.poll(now)
        except RecognizerError as exc:
            log.warning("call %s: recognising the caller for the bot failed (%s)",
                        self.call.call_id, exc)
            self._record_speech(None, str(exc))
            self.call.listen(None)
            turn.close()
            self._listen()
            return
        if decision is None:
            return
        self.call.listen(None)
        turn.close()
        result = decision.result
        transcript = result.transcript.strip()
        ignored = self._turn_ignored
        self._record_speech(decision, None)
        if transcript and not ignored and self._ended is None:
            self._send(Prompt(transcript, self.transcription_tag, True))
            self.prompts.append((transcript, decision.ended_at, now))
            self._answer_due = now + self.bot.timeout
            self._turn_at = decision.ended_at
            self._discarding = False
        elif ignored and transcript:
            log.info("call %s: the caller spoke over the bot where speech cannot interrupt; "
                     "not sent", self.call.call_id)
        self._listen()

    def _record_speech(self, decision: Any, failed: str | None) -> None:
        if self.trace is None:
            return
        now = self.clock.now()
        if decision is None:
            self.trace.speech.append(Recognised(self.node, now, "failed", reason=failed))
            return
        r = decision.result
        self.trace.speech.append(Recognised(
            self.node, decision.ended_at, "ignored" if self._turn_ignored else "prompt",
            heard=r.transcript, confidence=round(r.confidence, 3), speech_s=round(r.audio_s, 2),
            decision_ms=round(1000 * (decision.decided_at - decision.ended_at), 1),
            recognitions=decision.recognitions))

    # --- helpers ----------------------------------------------------------------------------------

    def _mode(self, interruptible: bool | None) -> Mode:
        """A message's ``interruptible`` over the node's: true is the node's mode (any when the
        node says none), false is none."""
        if interruptible is None:
            return self.bot.interruptible
        if not interruptible:
            return "none"
        return self.bot.interruptible if self.bot.interruptible != "none" else "any"

    def _count(self, direction: str, kind: str) -> None:
        if self.metrics is not None:
            self.metrics.bot_messages.labels(direction, kind).inc()


def _transcribes(recognizer: SpeechInput | None) -> bool:
    """Whether ``recognizer`` writes free-form transcripts: Whisper does, alone or combined
    with PocketSphinx (:mod:`gateway.asr.factory`); PocketSphinx alone does not. Its workers
    report their recogniser by name once started."""
    return "whisper" in getattr(recognizer, "name", "")


def handoff_variables(data: str | None) -> dict[str, str]:
    """``end``'s ``handoffData`` as call variables: the scalar fields of a JSON object (text;
    true/false as yes/no), and ``handoff_data``: the data as sent."""
    out: dict[str, str] = {}
    if data is None:
        return out
    out["handoff_data"] = data[:MAX_VARIABLE_CHARS * 10]
    try:
        parsed = json.loads(data)
    except (ValueError, RecursionError):
        return out
    if not isinstance(parsed, dict):
        return out
    for key, value in parsed.items():
        if not isinstance(key, str) or not key.isidentifier() or key == "handoff_data":
            continue
        if isinstance(value, bool):
            value = "yes" if value else "no"
        if isinstance(value, (str, int, float)) and not (isinstance(value, float)
                                                          and not math.isfinite(value)):
            out[key] = str(value)[:MAX_VARIABLE_CHARS]
    return out


def _tag(configured: str | None, language: str) -> str:
    """The BCP 47 tag prompts carry: the node's when it gives one, else the language's usual."""
    if configured is not None and "-" in configured:
        return configured
    code = language_code(configured or language) or "en"
    return _DEFAULT_TAGS.get(code, code)


def _type_name(message: BotMessage) -> str:
    return {Text: "text", Play: "play", SendDigits: "sendDigits", Language: "language",
            End: "end"}[type(message)]


def _proportion(text: str, utterance: Utterance | None, heard_ms: int) -> str:
    """The words of a whole sentence heard after ``heard_ms``, at the usual speaking rate."""
    if utterance is None or not text:
        return ""
    position = min(len(text), heard_ms / 1000 * CHARS_PER_S)
    ends = [m.end() for m in re.finditer(r"\S+", text) if m.end() <= position]
    return text[:ends[-1]] if ends else ""


def decode_sound(data: bytes) -> npt.NDArray[np.int16]:
    """Audio file bytes (anything soundfile reads) as 8 kHz mono int16."""
    from math import gcd

    import soundfile as sf
    from scipy.signal import resample_poly

    from gateway.audio.g711 import float_to_int16

    audio, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    mono = audio.mean(axis=1)
    if rate != 8000:
        g = gcd(int(rate), 8000)
        mono = resample_poly(mono, 8000 // g, int(rate) // g).astype(np.float32)
    return float_to_int16(mono)
