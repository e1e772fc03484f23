"""The IVR runner in virtual time: real engine (tiny model), in-memory transport, fake clock.

The transport here records what a caller would receive and reports each mark as played as soon
as it is sent (playback itself is the playout's business, tested in test_call_playout.py and
over real sockets in test_ivr_e2e.py). Gather timeouts and webhook deadlines run on
:class:`clocks.VirtualClock` (the test advances it), so a 5 s timeout costs nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from gateway.audio.condition import Conditioning
from gateway.call import (
    Call,
    CallerHungUp,
    CallOutcome,
    EndCall,
    PlaybackDone,
    PlayoutPolicy,
    SpeechStarted,
    TransferTo,
)
from gateway.ivr.cache import PromptCache
from gateway.ivr.prompts import ResolvedVoice, audio_identity, render_missing, resolve_voice
from gateway.ivr.runner import IvrRunner, RunnerContext
from gateway.ivr.script import Script, load_script, parse_script
from gateway.speech import Speaker, SpeechVoice
from gateway.tts.batched import BatchedQwenEngine
from gateway.tts.engine import Engine, SpeechRequest
from gateway.tts.service import SpeechService
from tests.support.clocks import VirtualClock
from tests.support.paths import DEMO_SCRIPT
from tests.support.transports import MemoryTransport

DEMO = DEMO_SCRIPT


#: A far end that plays everything at once: all frames go out now, every mark echoes back.
INSTANT = PlayoutPolicy(lead_s=3600.0, max_frames_per_send=1000, far_end_marks=True,
                        buffer_frames=10**6)

_open_calls: list[Call] = []
_open_runners: list[asyncio.Task[None]] = []


@pytest.fixture(autouse=True)
async def _close_calls() -> AsyncIterator[None]:
    yield
    # A runner a test leaves mid-call is stopped here. Left pending in the session's loop, it
    # is reachable from nothing: the garbage collector destroys it during some later test,
    # and its trace record lands in that test's log.
    while _open_runners:
        task = _open_runners.pop()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    while _open_calls:
        await _open_calls.pop().close()


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> BatchedQwenEngine:
    engine = BatchedQwenEngine(str(tiny_model_dir), device="cpu", max_rows=4)
    engine.warmup()
    return engine


@pytest.fixture
async def speech(engine: Engine) -> AsyncIterator[SpeechService]:
    service = SpeechService([engine])
    service.start()
    yield service
    service.stop()


@pytest.fixture(scope="module")
def demo(monkeypatch_module: pytest.MonkeyPatch) -> Script:
    monkeypatch_module.setenv("ACME_BACKEND_URL", "http://backend.test")
    return load_script(DEMO)


@pytest.fixture(scope="module")
def demo_cache(demo_cache_dir: Path) -> PromptCache:
    """The demo's static prompts, pre-rendered once per run by ``gateway script render``."""
    return PromptCache(demo_cache_dir)


@pytest.fixture(scope="module")
def monkeypatch_module() -> Any:
    with pytest.MonkeyPatch.context() as patch:
        yield patch


class Harness:
    """A call running the script, driven by the test."""

    def __init__(
        self,
        script: Script,
        speech: SpeechService,
        engine: Engine,
        backend: Callable[[httpx.Request], httpx.Response] | None = None,
        cache: PromptCache | None = None,
        voice: ResolvedVoice | None = None,
        transport: MemoryTransport | None = None,
    ) -> None:
        self.script = script
        self.voice = voice if voice is not None else resolve_voice(script)
        self.clock = VirtualClock()
        self.transport = transport if transport is not None else MemoryTransport()
        # The phone path of a gateway on default settings: what `gateway script render`
        # (the demo cache) conditions with, so the keys match and are true.
        self.conditioning = Conditioning()
        self.call = Call("CA" + "7" * 32, self.transport, self.clock, transport_name="twilio",
                         conditioning=self.conditioning)
        self.call.start()
        _open_calls.append(self.call)
        self.transport.call = self.call
        self.cache = cache if cache is not None else PromptCache(None)
        self.requests: list[dict[str, Any]] = []

        def handler(request: httpx.Request) -> httpx.Response:
            self.requests.append(json.loads(request.content))
            assert backend is not None, "unexpected webhook"
            return backend(request)

        self.context = RunnerContext(
            script=script,
            cache=self.cache,
            model_fingerprint=engine.fingerprint,
            voice_identity=self.voice.identity,
            speaker=Speaker(speech, SpeechVoice(prompt=self.voice.prompt)),
            audio=audio_identity(engine, self.conditioning),
            clock=self.clock,
            http=httpx.AsyncClient(transport=httpx.MockTransport(handler)),
        )
        self.speech = speech
        self.runner = IvrRunner(
            self.call,
            self.context,
            {"caller": "+15550001111", "called": "+15550002222", "call_id": self.call.call_id},
        )
        self.task: asyncio.Task[None] | None = None
        self._waits_seen = 0

    async def start(self, prerender: bool = True) -> None:
        if prerender:
            await render_missing(
                self.script,
                self.cache,
                self.speech,
                self.context.model_fingerprint,
                self.voice,
                self.conditioning,
            )
        self.task = asyncio.create_task(self.runner.run())
        _open_runners.append(self.task)

    async def waiting_for_input(self, timeout: float = 60) -> None:
        """Until the runner sits in a *new* gather timeout (everything before it has played)."""
        assert self.task is not None
        waiting = asyncio.ensure_future(self.clock.next_wait(self._waits_seen))
        done, _ = await asyncio.wait({waiting, self.task}, timeout=timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        assert waiting in done, f"not waiting; path {self.runner.path}"
        self._waits_seen = self.clock.waits

    async def first_frame(self, index: int = 0, timeout: float = 60) -> None:
        """Until utterance ``index`` has sent its first frame (generated live: real time)."""
        for _ in range(1000):  # the runner creates its utterances without waiting
            if len(self.call.utterances) > index:
                break
            await asyncio.sleep(0)
        await asyncio.wait_for(self.call.utterances[index].started.wait(), timeout)

    async def press(self, keys: str) -> None:
        for key in keys:
            self.call.dtmf(key)
            for _ in range(3):
                await asyncio.sleep(0)
        # Waits started while the keys were consumed are not the next prompt's.
        self._waits_seen = self.clock.waits

    async def finished(self, timeout: float = 60) -> None:
        assert self.task is not None
        await asyncio.wait_for(self.task, timeout)

    def spoken(self) -> list[str]:
        return [u.text for u in self.call.utterances]


def balance_backend(request: httpx.Request) -> httpx.Response:
    return httpx.Response(
        200, json={"first_name": "Dana", "balance": "42.10", "due_date": "March 3"}
    )


async def test_menu_account_lookup_and_goodbye(
    demo: Script, speech: SpeechService, demo_cache: PromptCache, engine: Engine
) -> None:
    h = Harness(demo, speech, engine, backend=balance_backend, cache=demo_cache)
    await h.start()
    await h.waiting_for_input()
    assert h.runner.path == ["welcome", "menu"]
    assert h.spoken()[:3] == [demo.prompts["welcome"], "Para español, oprima 8.",
                              demo.sentence("main_menu")]
    # Static prompts came from the cache: no generation for them.
    assert all(u.cached for u in h.call.utterances)
    await h.press("1")
    await h.waiting_for_input()
    await h.press("123456#")
    await h.waiting_for_input()
    assert h.runner.path[-5:] == ["account", "lookup", "route", "balance", "anything_else"]
    assert h.requests == [
        {
            "call_id": h.call.call_id,
            "node": "lookup",
            "variables": {"account_number": "123456", "caller": "+15550001111"},
        }
    ]
    live = [u for u in h.call.utterances if not u.cached]
    # The engine gets the words: the account read back digit by digit, the balance as money,
    # the due date as a date (prompts/demo.yaml's say-as types).
    assert [u.text for u in live] == [
        "Thanks, Dana. Your balance on account one two three four five six is forty-two "
        "dollars, ten cents, due on March third."
    ]
    # Hang up by saying nothing: one retry, then the fallback says goodbye and hangs up.
    await h.clock.advance(6)
    await h.waiting_for_input()
    await h.clock.advance(6)
    await h.finished()
    assert h.runner.path[-1] == "goodbye" and isinstance(h.transport.outcome, EndCall)


async def test_no_input_retries_then_falls_back_to_the_agent(
    demo: Script, speech: SpeechService, demo_cache: PromptCache, engine: Engine
) -> None:
    h = Harness(demo, speech, engine, cache=demo_cache)
    await h.start()
    for _ in range(3):  # the first try and two retries, 5 s each, in virtual time
        await h.waiting_for_input()
        await h.clock.advance(5)
    await h.finished()
    retry = demo.sentence("not_understood")
    assert h.spoken().count(retry) == 2
    assert h.runner.path == ["welcome", "menu", "agent"]
    assert h.transport.outcome == TransferTo("+15555550100")


async def test_a_gather_waits_out_a_hold_and_gives_the_caller_their_full_time_back(
    demo: Script, speech: SpeechService, demo_cache: PromptCache, engine: Engine
) -> None:
    """A SIP caller who puts the IVR on hold mid-menu is away, not silent: the menu's 5 s
    no-input timeout stands still for the whole hold, and restarts in full when they are
    back (it used to run on, so they came back to a retry, or to the fallback)."""
    h = Harness(demo, speech, engine, cache=demo_cache)
    await h.start()
    await h.waiting_for_input()
    retry = demo.sentence("not_understood")
    h.call.hold(True)
    await h.clock.advance(30)
    assert h.spoken().count(retry) == 0 and h.runner.path == ["welcome", "menu"]
    h.call.hold(False)
    await h.waiting_for_input()  # the wait starts again, whole
    await h.clock.advance(4.5)
    assert h.spoken().count(retry) == 0
    await h.clock.advance(1)
    await h.waiting_for_input()
    assert h.spoken().count(retry) == 1
    await h.press("2")
    await h.finished()
    assert h.transport.outcome == TransferTo("+15555550100")


async def test_invalid_key_counts_as_a_retry(
    demo: Script, speech: SpeechService, demo_cache: PromptCache, engine: Engine
) -> None:
    h = Harness(demo, speech, engine, cache=demo_cache)
    await h.start()
    await h.waiting_for_input()
    await h.press("7")
    await h.waiting_for_input()
    assert h.spoken()[-2:] == [demo.sentence("not_understood"), demo.sentence("main_menu")]
    await h.press("2")
    await h.finished()
    assert h.transport.outcome == TransferTo("+15555550100")


async def test_keys_pressed_during_a_prompt_barge_in_and_count_as_the_answer(
    demo: Script, speech: SpeechService, engine: Engine, demo_cache: PromptCache
) -> None:
    h = Harness(demo, speech, engine)
    # No pre-rendering: the greeting is generated live, so it is long enough to interrupt.
    await h.start(prerender=False)
    await h.first_frame()
    await h.press("2")  # during the greeting: stops it; the menu takes "2" as its answer
    await h.finished()
    assert ("clear", None) in h.transport.log
    assert h.call.utterances[0].interrupted
    assert h.runner.path == ["welcome", "menu", "agent"]
    assert demo.sentence("main_menu") not in h.spoken()  # the answer came before the prompt


async def test_caller_speech_barges_in_like_a_key(
    demo: Script, speech: SpeechService, demo_cache: PromptCache, engine: Engine
) -> None:
    h = Harness(demo, speech, engine)
    await h.start(prerender=False)
    await h.first_frame()
    h.call.deliver(SpeechStarted(at=h.clock.now()))
    await h.waiting_for_input()
    assert h.call.utterances[0].interrupted and ("clear", None) in h.transport.log
    assert h.runner.path == ["welcome", "menu"]


@pytest.mark.parametrize("failure", ["timeout", "http-500", "not-json", "huge", "not-object"])
async def test_webhook_failures_go_to_its_error_node(
    demo: Script, speech: SpeechService, demo_cache: PromptCache, engine: Engine, failure: str
) -> None:
    def backend(request: httpx.Request) -> httpx.Response:
        if failure == "timeout":
            raise httpx.ReadTimeout("too slow", request=request)
        if failure == "http-500":
            return httpx.Response(500, text="boom")
        if failure == "not-json":
            return httpx.Response(200, text="<html>")
        if failure == "huge":
            return httpx.Response(200, json={"x": "y" * 100_000})
        return httpx.Response(200, json=["a", "list"])

    h = Harness(demo, speech, engine, backend=backend, cache=demo_cache)
    await h.start()
    await h.waiting_for_input()
    await h.press("1")
    await h.waiting_for_input()
    await h.press("123456#")
    await h.finished()
    assert h.runner.path[-2:] == ["lookup", "sorry"]
    assert h.transport.outcome == TransferTo("+15555550100")


async def test_webhook_values_are_read_as_text_never_as_templates(
    demo: Script, speech: SpeechService, engine: Engine, demo_cache: PromptCache
) -> None:
    def backend(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            200,
            json={
                "first_name": "{caller}",
                "balance": "{0.__class__}",
                "due_date": "tomorrow",
                "nested": {"x": 1},
            },
        )

    h = Harness(demo, speech, engine, backend=backend, cache=demo_cache)
    await h.start()
    await h.waiting_for_input()
    await h.press("1")
    await h.waiting_for_input()
    await h.press("123456#")
    await h.waiting_for_input()
    live = [u.text for u in h.call.utterances if not u.cached]
    # Neither is of its say-as type: each is read as written (never interpreted), and said.
    assert live == ["Thanks, {caller}. Your balance on account one two three four five six is "
                    "{0.__class__}, due on tomorrow."]
    assert "nested" not in h.runner.variables
    h.call.deliver(CallerHungUp(at=h.clock.now()))
    await h.finished()


async def test_hang_up_during_a_gather_stops_the_script(
    demo: Script, speech: SpeechService, demo_cache: PromptCache, engine: Engine
) -> None:
    h = Harness(demo, speech, engine, cache=demo_cache)
    await h.start()
    await h.waiting_for_input()
    h.call.deliver(CallerHungUp(at=h.clock.now()))
    await h.finished()
    assert h.transport.outcome is None and h.runner.path == ["welcome", "menu"]


async def test_a_cache_miss_is_rendered_live_then_stored(
    speech: SpeechService, engine: Engine
) -> None:
    script = parse_script(
        "name: t\nvoice: {speaker: ryan}\nstart: a\nnodes:\n"
        "  a: {say: 'Hello there.', next: b}\n"
        "  b: {say: {text: 'Hi {caller}.', cache: true}, hangup: true}\n"
    )
    h = Harness(script, speech, engine)
    await h.start(prerender=False)
    await h.finished()
    assert [u.cached for u in h.call.utterances] == [False, False]
    first = h.cache.peek(h.context.key("Hello there."))
    personal = h.cache.peek(h.context.key("Hi +15550001111."))
    assert first is not None and personal is not None and len(first) > 1000
    # The next call plays both from the cache.
    h2 = Harness(script, speech, engine)
    h2.cache = h.cache
    h2.context.cache = h.cache
    await h2.start(prerender=False)
    await h2.finished()
    assert [u.cached for u in h2.call.utterances] == [True, True]
    assert np.array_equal(h2.cache.peek(h2.context.key("Hello there.")), first)  # type: ignore[arg-type]


class HangsUpAtTheMark(MemoryTransport):
    """The caller hangs up the moment a prompt's mark comes back: both reach the call before
    its runner wakes."""

    async def send_mark(self, name: str) -> None:
        self.log.append(("mark", name))
        call = self.call
        assert call is not None

        def played_then_gone() -> None:
            call.playback_done(name)
            call.deliver(CallerHungUp(at=call.clock.now()))

        asyncio.get_running_loop().call_soon(played_then_gone)


async def test_a_miss_heard_to_the_end_is_stored_when_the_caller_hangs_up_right_then(
    speech: SpeechService, engine: Engine
) -> None:
    # Seen under load in test_faults: the caller heard the whole prompt and hung up, and the
    # next caller got a miss (the runner took the hang-up before storing the render).
    script = parse_script(
        "name: t\nvoice: {speaker: ryan}\nstart: a\nnodes:\n"
        "  a: {say: 'Hello there.', next: b}\n"
        "  b: {say: 'Goodbye.', hangup: true}\n"
    )
    h = Harness(script, speech, engine, transport=HangsUpAtTheMark())
    await h.start(prerender=False)
    await h.finished()
    assert h.spoken() == ["Hello there."] and h.call.utterances[0].played.is_set()
    assert h.cache.peek(h.context.key("Hello there.")) is not None


async def test_a_sentence_rendered_live_for_the_cache_had_the_seed_its_key_names(
    speech: SpeechService, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The key of a live-rendered miss used to say seed 0 (the script's) for audio generated
    with no seed at all: a key must identify its audio."""
    script = parse_script(
        "name: t\nvoice: {speaker: ryan, seed: 7}\nstart: a\nnodes:\n"
        "  a: {say: 'Hello there.', next: b}\n"
        "  b: {say: {text: 'Hi {caller}.', cache: true}, next: c}\n"
        "  c: {say: 'Bye {caller}.', hangup: true}\n"
    )
    h = Harness(script, speech, engine)
    # The requests each utterance was generated from (a finished utterance lets go of its
    # stream once the next one starts).
    requests: dict[str, SpeechRequest] = {}
    stream = speech.stream

    def recording(request: SpeechRequest, **kwargs: Any) -> Any:
        requests[request.tags["utterance"]] = request
        return stream(request, **kwargs)

    monkeypatch.setattr(speech, "stream", recording)
    await h.start(prerender=False)
    await h.finished()
    hello, hi, bye = h.call.utterances
    for utterance in (hello, hi):
        key = h.context.key(utterance.text)
        assert key.seed == 7 and h.cache.peek(key) is not None
        assert requests[utterance.id].seed == key.seed
    # Live speech that is never cached keeps the call's voice (unseeded here).
    assert requests[bye.id].seed is None
    assert h.cache.peek(h.context.key(bye.text)) is None


# --- a registered cloned voice (Base model) ---------------------------------------------------


@pytest.fixture(scope="module")
def clone_setup(tiny_base_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    import soundfile as sf

    from gateway.ivr.voices import VoiceRegistry

    folder = tmp_path_factory.mktemp("voices")
    t = np.arange(3 * 16000) / 16000
    clip = (0.3 * np.sin(2 * np.pi * 140 * t) * (1 + np.sin(2 * np.pi * 3 * t))).astype(np.float32)
    sf.write(str(folder / "ref.wav"), clip, 16000)
    registry = VoiceRegistry(folder / "registry")
    registry.add(
        "anna", folder / "ref.wav", "Hello, this is Anna.", base_model=str(tiny_base_model_dir)
    )
    engine = BatchedQwenEngine(str(tiny_base_model_dir), device="cpu", max_rows=4)
    return registry, engine, folder


async def test_a_script_speaks_with_a_registered_cloned_voice(clone_setup: Any) -> None:
    registry, engine, folder = clone_setup
    script = parse_script(
        "name: t\nvoice: {clone: anna}\nstart: a\nnodes:\n"
        "  a: {say: 'Welcome back.', next: b}\n"
        "  b: {say: 'Your code is {call_id}.', hangup: true}\n",
        voice_exists=registry.exists,
    )
    voice = resolve_voice(script, registry.directory)
    assert voice.prompt is not None and voice.identity.startswith("clone:anna:")
    service = SpeechService([engine])
    service.start()
    try:
        h = Harness(script, service, engine, voice=voice)
        await h.start()  # renders 'Welcome back.' with the cloned voice into the cache
        await h.finished()
        assert [u.cached for u in h.call.utterances] == [True, False]
        assert all(u.frames_sent > 0 and u.error is None for u in h.call.utterances)
        key = h.context.key("Welcome back.")
        assert h.cache.peek(key) is not None
        # Re-registering the voice (another clip text) changes its identity: its prompts miss.
        registry.add("anna", folder / "ref.wav", "Hi, Anna here.", base_model=engine.model_id)
        again = resolve_voice(script, registry.directory)
        assert again.identity != voice.identity
        h2 = Harness(script, service, engine, voice=again, cache=h.cache)
        assert h.cache.peek(h2.context.key("Welcome back.")) is None
    finally:
        service.stop()


def test_a_cloned_voice_needs_a_base_model(engine: BatchedQwenEngine, clone_setup: Any) -> None:
    from gateway.errors import EngineError
    from gateway.tts.engine import SpeechRequest

    registry, base_engine, _ = clone_setup
    script = parse_script(
        "name: t\nvoice: {clone: anna}\nstart: a\nnodes:\n  a: {say: 'Hi.', hangup: true}\n",
        voice_exists=registry.exists,
    )
    prompt = resolve_voice(script, registry.directory).prompt
    with pytest.raises(EngineError, match="needs a Base model"):
        engine.stream(SpeechRequest(text="Hi.", voice_prompt=prompt))
    with pytest.raises(EngineError, match="speaks only with a registered cloned voice"):
        base_engine.stream(SpeechRequest(text="Hi."))


async def test_play_node_converts_a_wav_on_load(
    tmp_path: Path, speech: SpeechService, engine: Engine
) -> None:
    import soundfile as sf

    from gateway.ivr.runner import load_sound

    t = np.arange(44100) / 44100  # 1 s, 44.1 kHz stereo
    stereo = np.stack([np.sin(2 * np.pi * 440 * t), np.sin(2 * np.pi * 660 * t)], axis=1)
    sf.write(str(tmp_path / "chime.wav"), (0.3 * stereo).astype(np.float32), 44100)
    (tmp_path / "t.yaml").write_text(
        "name: t\nvoice: {speaker: ryan}\nstart: a\nnodes:\n  a: {play: chime.wav, hangup: true}\n"
    )
    script = load_script(tmp_path / "t.yaml")
    pcm = load_sound(tmp_path / "chime.wav")
    assert pcm.dtype == np.int16 and len(pcm) == 8000
    h = Harness(script, speech, engine)
    h.context.sounds["chime.wav"] = pcm
    await h.start(prerender=False)
    await h.finished()
    played = h.call.utterances[0]
    assert played.cached and played.frames_sent == 50  # 1 s = 50 frames of 20 ms


async def test_keys_during_a_non_interruptible_prompt_are_ignored(
    speech: SpeechService, engine: Engine
) -> None:
    script = parse_script(
        "name: t\nvoice: {speaker: ryan}\nstart: a\nnodes:\n"
        "  a: {say: 'Please listen to this notice.', barge_in: false, next: b}\n"
        "  b:\n    gather: {prompt: 'Press 1.', digits: 1, branch: {'1': c}, fallback: c}\n"
        "  c: {hangup: true}\n"
    )
    h = Harness(script, speech, engine)
    await h.start(prerender=False)
    await h.first_frame()
    await h.press("1")
    await h.waiting_for_input()
    assert not h.call.utterances[0].interrupted and ("clear", None) not in h.transport.log
    assert h.runner.path == ["a", "b"]  # the key was not taken as the gather's answer
    await h.press("1")
    await h.finished()
    assert h.runner.path == ["a", "b", "c"]


async def test_a_stale_mark_does_not_end_a_gather_early(
    demo: Script, speech: SpeechService, engine: Engine, demo_cache: PromptCache
) -> None:
    """Twilio echoes the marks of cleared audio; they are not input and must not count as the
    end of the caller's typing (found by the cross-transport scenario suite)."""
    h = Harness(demo, speech, engine, backend=balance_backend, cache=demo_cache)
    await h.start()
    await h.waiting_for_input()
    await h.press("1")
    await h.waiting_for_input()
    await h.press("12")
    h.call.deliver(PlaybackDone("an-earlier-utterance", at=h.clock.now()))
    await h.press("3456#")
    await h.waiting_for_input()
    assert h.runner.variables["account_number"] == "123456"
    h.call.deliver(CallerHungUp(at=h.clock.now()))
    await h.finished()


# --- branches on data -------------------------------------------------------------------------

ROUTED = """name: t
voice: {speaker: ryan}
start: lookup
nodes:
  lookup:
    webhook: {url: 'http://backend.test/x', sets: [status, balance], on_error: agent}
    next: route
  route:
    branch:
      - if: status == "overdue" and balance > 100
        goto: collections
      - if: status in ["closed", "suspended"]
        goto: closed
      - else: agent
  collections: {transfer: "+15555550101"}
  closed: {hangup: true}
  agent: {transfer: "+15555550100"}
"""


@pytest.mark.parametrize(
    ("answer", "path", "outcome"),
    [
        ({"status": "overdue", "balance": 250}, "collections", TransferTo("+15555550101")),
        ({"status": "overdue", "balance": "99.99"}, "agent", TransferTo("+15555550100")),
        ({"status": "overdue", "balance": "unknown"}, "agent", TransferTo("+15555550100")),
        ({"status": "suspended"}, "closed", EndCall()),
        ({}, "agent", TransferTo("+15555550100")),
    ],
)
async def test_a_webhook_answer_decides_where_the_call_goes(
    speech: SpeechService, engine: Engine, answer: dict[str, Any], path: str,
    outcome: CallOutcome,
) -> None:
    script = parse_script(ROUTED)
    h = Harness(script, speech, engine, backend=lambda request: httpx.Response(200, json=answer))
    await h.start(prerender=False)
    await h.finished()
    assert h.runner.path == ["lookup", "route", path]
    assert h.transport.outcome == outcome


# --- business hours ---------------------------------------------------------------------------

OFFICE_HOURS = """name: t
voice: {speaker: ryan}
start: office
nodes:
  office:
    hours:
      timezone: America/New_York
      weekly: {mon-fri: "08:00-18:00"}
      holidays: [2025-07-04]
      open: agent
      closed: shut
  agent: {transfer: "+15555550100"}
  shut: {hangup: true}
"""


@pytest.mark.parametrize(
    ("local_time", "path"),
    [
        ("2025-07-03T09:00:00-04:00", "agent"),  # Thursday morning
        ("2025-07-03T18:30:00-04:00", "shut"),  # Thursday evening
        ("2025-07-04T09:00:00-04:00", "shut"),  # Independence Day
        ("2025-07-03T13:00:00+00:00", "agent"),  # 09:00 in New York
    ],
)
async def test_an_hours_node_routes_by_the_injected_clock(
    speech: SpeechService, engine: Engine, local_time: str, path: str
) -> None:
    from datetime import datetime

    h = Harness(parse_script(OFFICE_HOURS), speech, engine)
    h.clock.set_wall(datetime.fromisoformat(local_time).timestamp())
    await h.start(prerender=False)
    await h.finished()
    assert h.runner.path == ["office", path]


# --- language and voice changes ---------------------------------------------------------------

BILINGUAL = """name: t
voice: {speaker: ryan}
start: menu
prompts:
  menu_text: Press 2 for Spanish, 3 for Serena.
  bye: Goodbye.
  thanks: Thanks, {caller}.
translations:
  Spanish:
    bye: Adiós.
    thanks: Gracias, {caller}.
nodes:
  menu:
    gather: {prompt: menu_text, digits: 1, retries: 0, branch: {"2": spanish, "3": serena},
             fallback: done}
  spanish:
    set: {language: spanish, chosen: "{language} then"}
    next: done
  serena:
    voice: {speaker: serena}
    next: done
  done:
    say: [bye, thanks]
    hangup: true
"""


@pytest.fixture(scope="module")
def bilingual_cache() -> PromptCache:
    """BILINGUAL's fixed sentences, rendered by the first call that needs them: each case below
    takes another branch of the same script, and its cached sentences are the same."""
    return PromptCache(None)


@pytest.mark.parametrize(
    ("key", "language", "speaker", "bye"),
    [("2", "Spanish", "ryan", "Adiós."), ("3", "English", "serena", "Goodbye."),
     ("1", "English", "ryan", "Goodbye.")],
)
async def test_a_node_changes_the_calls_language_or_voice_and_the_cache_keys_follow(
    speech: SpeechService, engine: Engine, monkeypatch: pytest.MonkeyPatch,
    bilingual_cache: PromptCache, key: str, language: str, speaker: str, bye: str,
) -> None:

    requests: list[SpeechRequest] = []
    original = Speaker.request

    def recording(self: Speaker, text: str, call_id: str, utterance_id: str,
                  voice: SpeechVoice | None = None) -> SpeechRequest:
        request = original(self, text, call_id, utterance_id, voice)
        requests.append(request)
        return request

    monkeypatch.setattr(Speaker, "request", recording)
    script = parse_script(BILINGUAL)
    # Every fixed sentence in every voice and language a node may speak it in.
    assert {(text, v.language, v.speaker) for text, v in script.static_renders()} == {
        ("Press 2 for Spanish, 3 for Serena.", "English", "ryan"),
        ("Goodbye.", "English", "ryan"), ("Adiós.", "Spanish", "ryan"),
        ("Goodbye.", "English", "serena"),
    }
    h = Harness(script, speech, engine, cache=bilingual_cache)
    await h.start()
    await h.waiting_for_input()
    await h.press(key)
    await h.finished()
    voice = h.runner.voice
    assert (voice.language, voice.speaker) == (language, speaker)
    assert h.runner.variables["language"] == language
    said = h.call.utterances[-2:]
    assert [u.text for u in said] == [bye, ("Gracias" if language == "Spanish" else "Thanks")
                                      + ", +15550001111."]
    # The fixed sentence came from the cache under the new voice's key...
    assert said[0].cached and h.cache.peek(h.context.key(bye, voice)) is not None
    # ...and the live one was generated in it.
    live = [r for r in requests if r.text == said[1].text]
    assert [(r.language, r.speaker) for r in live] == [(language, speaker)]
    if key == "2":
        assert h.runner.variables["chosen"] == "Spanish then"
        assert h.context.key("Adiós.", voice).language == "Spanish"


# --- the per-call trace -----------------------------------------------------------------------


def _trace_records(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [r.data["trace"] for r in caplog.records if r.getMessage() == "ivr trace"]  # type: ignore[attr-defined]


async def test_each_call_logs_one_trace_record_at_hang_up(
    demo: Script, speech: SpeechService, demo_cache: PromptCache, engine: Engine,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="gateway.ivr.runner")
    h = Harness(demo, speech, engine, backend=balance_backend, cache=demo_cache)
    await h.start()
    await h.waiting_for_input()
    await h.clock.advance(2)  # the caller takes 2 s to answer the menu
    await h.press("1")
    await h.waiting_for_input()
    await h.press("123456#")
    await h.waiting_for_input()
    await h.press("3")
    await h.finished()
    (trace,) = _trace_records(caplog)
    json.dumps(trace)  # plain data, as the JSON log line carries it
    assert trace["call_id"] == h.call.call_id and trace["script"] == demo.name
    assert trace["path"] == ["welcome", "menu", "account", "lookup", "route", "balance",
                             "anything_else", "goodbye"]
    assert [k["key"] for k in trace["keys"]] == list("1123456#3")
    assert [k["node"] for k in trace["keys"]][:2] == ["menu", "account"]
    assert trace["keys"][0]["at"] == pytest.approx(2.0)
    (hook,) = trace["webhooks"]
    assert hook["node"] == "lookup" and hook["result"] == "ok"
    assert hook["set"] == ["balance", "due_date", "first_name"] and hook["ms"] >= 0
    assert {"node": "route", "chose": "case 2: else"} in trace["choices"]
    heard = trace["heard"]
    assert heard[0] == {"node": "welcome", "text": "Thank you for calling Acme Energy.",
                        "language": "English", "voice": "ryan", "at": 0.0, "cached": True,
                        "interrupted": False, "words": "Thank you for calling Acme Energy."}
    assert heard[1]["language"] == "Spanish"
    live = next(h for h in heard if h["node"] == "balance")
    assert live["text"].startswith("Thanks, Dana.") and not live["cached"]
    # The sentence as written (its values as the backend sent them) and the words spoken.
    assert "is 42.10, due on March 3." in live["text"]
    assert "is forty-two dollars, ten cents, due on March third." in live["words"]
    times = [v["at"] for v in trace["visits"]]
    assert times == sorted(times) and times[2] >= 2.0
    assert trace["outcome"] == "hangup" and trace["target"] is None
    assert trace["duration_s"] >= 2.0


async def test_a_trace_records_failed_webhooks_transfers_and_private_keys(
    speech: SpeechService, engine: Engine, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="gateway.ivr.runner")
    script = parse_script(
        "name: t\nvoice: {speaker: ryan}\nstart: pin\nnodes:\n"
        "  pin:\n    gather: {digits: 4, private: true, store: pin, branch: {default: check},"
        " fallback: agent}\n"
        "  check:\n    webhook: {url: 'http://backend.test/pin', on_error: agent}\n"
        "    next: agent\n"
        "  agent: {transfer: '+15555550100'}\n"
    )
    h = Harness(script, speech, engine, backend=lambda r: httpx.Response(503, text="down"))
    await h.start(prerender=False)
    await h.waiting_for_input()
    await h.press("4321")
    await h.finished()
    (trace,) = _trace_records(caplog)
    assert [k["key"] for k in trace["keys"]] == ["*"] * 4
    assert "4321" not in json.dumps(trace)
    assert [(w["node"], w["result"]) for w in trace["webhooks"]] == [("check", "http 503")]
    assert trace["outcome"] == "transfer" and trace["target"] == "+15555550100"
    assert trace["path"] == ["pin", "check", "agent"]


async def test_a_caller_pressing_keys_without_end_gets_a_bounded_answer_and_trace(
    speech: SpeechService, engine: Engine, caplog: pytest.LogCaptureFixture,
) -> None:
    """300 keys during a notice that plays to its end, then 40 into a gather that waits for a
    '#' that never comes: the answer ends at 32 digits (the longest a gather may ask for), and
    the trace keeps its first 256 keys and counts the rest. Both grew with every key."""
    from gateway.ivr.runner import MAX_ANSWER_DIGITS
    from gateway.ivr.trace import MAX_KEYS

    caplog.set_level("INFO", logger="gateway.ivr.runner")
    script = parse_script(
        "name: t\nvoice: {speaker: ryan}\nstart: a\nnodes:\n"
        "  a: {say: 'Please listen to this notice.', barge_in: false, next: b}\n"
        "  b:\n    gather: {terminator: '#', store: n, branch: {default: c}, fallback: c}\n"
        "  c: {hangup: true}\n"
    )
    h = Harness(script, speech, engine)
    await h.start(prerender=False)
    await h.first_frame()
    await h.press("1" * 300)
    await h.waiting_for_input()
    await h.press("2" * 40)
    await h.finished()
    assert h.runner.variables["n"] == "2" * MAX_ANSWER_DIGITS
    assert h.runner.path == ["a", "b", "c"]
    (trace,) = _trace_records(caplog)
    assert len(trace["keys"]) == MAX_KEYS
    assert trace["keys_dropped"] == 300 + MAX_ANSWER_DIGITS - MAX_KEYS


async def test_a_caller_hanging_up_is_in_the_trace(
    demo: Script, speech: SpeechService, demo_cache: PromptCache, engine: Engine,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="gateway.ivr.runner")
    h = Harness(demo, speech, engine, cache=demo_cache)
    await h.start()
    await h.waiting_for_input()
    h.call.deliver(CallerHungUp(at=h.clock.now()))
    await h.finished()
    (trace,) = _trace_records(caplog)
    assert trace["outcome"] == "caller hung up" and trace["path"] == ["welcome", "menu"]
