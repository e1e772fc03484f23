"""Hostile IVR content: scripts that try to break the validator, and backends and variables that
try to break a running call.

What tests/unit/ivr/test_script.py and tests/unit/ivr/test_runner.py already cover is not
repeated (simple template injections in one sentence; a webhook that is not JSON, answers 500,
a 100 KB body through a mocked transport, or times out). Here:

- validation: a 1 MB sentence, format-string tricks (attribute and index access, conversions,
  giant width specs, stray braces), YAML nested thousands deep, a billion-laughs alias bomb,
  a 5,000-node chain: each refused with a diagnostic (or accepted) in bounded time, never a
  traceback;
- run time, against a real TCP backend: a response that trickles in a byte at a time (each
  read well inside httpx's per-read timeout), a 100 MB body, an endless chunked body, a JSON
  nesting bomb: each fails the webhook within its timeout, having read at most 64 KiB, and the
  call goes to the error node;
- run time, in the script: node cycles end after MAX_STEPS; variables from the transport or the
  backend are inserted as at most 200 characters of plain text, never re-interpreted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from gateway.call import Call, CallerHungUp, EndCall, TransferTo
from gateway.clock import SystemClock
from gateway.ivr import runner as runner_module
from gateway.ivr.cache import PromptCache
from gateway.ivr.prompts import audio_identity, resolve_voice
from gateway.ivr.runner import MAX_WEBHOOK_BYTES, IvrRunner, RunnerContext
from gateway.ivr.script import MAX_VALUE_CHARS, Script, ScriptError, parse_script
from gateway.speech import Speaker, SpeechVoice
from gateway.tts.batched import BatchedQwenEngine
from gateway.tts.service import SpeechService
from tests.support.transports import MemoryTransport

HEAD = "name: t\nvoice: {speaker: ryan, language: English}\n"


def _diagnostics(text: str) -> tuple[list[str], float]:
    """Validation messages for ``text`` and the CPU seconds validation took (this thread's: on
    a shared machine the wall clock also counts other processes' turns on the cores)."""
    t0 = time.thread_time()
    try:
        parse_script(text, "t.yaml")
    except ScriptError as exc:
        return [d.message for d in exc.diagnostics], time.thread_time() - t0
    return [], time.thread_time() - t0


# --- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sentence", "expected"),
    [
        ("{0.__init__}", "not a simple variable"),
        ("{name.__class__.__mro__}", "not a simple variable"),
        ("{name[0]}", "not a simple variable"),
        ("{name!r}", "not a simple variable"),
        ("{name:>999999999}", "not a simple variable"),
        ("{}", "not a simple variable"),
        ("Hello {", "Single '{'"),
        ("Hello }", "Single '}'"),
        ("{{name}", "Single '}'"),
        ("{__class__}", "nothing sets it"),
        ("{__globals__}", "nothing sets it"),
    ],
)
def test_template_tricks_in_a_sentence_are_refused_at_validation(
    sentence: str, expected: str
) -> None:
    script = HEAD + (f"start: a\nnodes:\n  a:\n    say: {json.dumps(sentence)}\n"
                     "    hangup: true\n")
    messages, _ = _diagnostics(script)
    assert any(expected in m for m in messages), messages


def test_a_one_megabyte_sentence_is_refused_quickly() -> None:
    messages, took = _diagnostics(HEAD + "start: a\nnodes:\n  a:\n    say: \"" + "Hi. " * 250_000
                                  + "\"\n    hangup: true\n")
    print(f"\n1 MB sentence: refused in {1000 * took:.0f} ms of CPU")
    assert any("too long for one utterance" in m for m in messages) and took < 5


@pytest.mark.parametrize("depth", [1_000, 50_000])
def test_yaml_nested_thousands_deep_is_a_diagnostic_not_a_traceback(depth: int) -> None:
    for nested in ("[" * depth + "]" * depth, "{a: " * depth + "1" + "}" * depth):
        messages, took = _diagnostics(HEAD + "start: a\nnodes: " + nested + "\n")
        assert took < 10
        assert messages == ["YAML nested too deeply: a script is a few levels of mappings and "
                            "lists"], messages


def test_a_billion_laughs_alias_bomb_is_bounded() -> None:
    # Nine levels of nine aliases: 9**9 strings if anything expanded it.
    lines = ['a0: &a0 "lol"']
    for level in range(1, 10):
        lines.append(f"a{level}: &a{level} [" + ", ".join([f"*a{level - 1}"] * 9) + "]")
    # The anchors sit in 'variables'; a node says the deepest one.
    text = (HEAD + "start: a\nvariables:\n" + "\n".join("  " + line for line in lines)
            + "\nnodes:\n  a:\n    say: *a9\n    hangup: true\n")
    messages, took = _diagnostics(text)
    print(f"\nbillion laughs: {len(messages)} diagnostics in {1000 * took:.0f} ms")
    assert len(messages) < 100 and took < 5
    assert any("variables.a1" in m for m in messages), messages[:3]


def test_a_five_thousand_node_chain_validates_in_bounded_time() -> None:
    nodes = "".join(f"  n{i}: {{next: n{i + 1}}}\n" for i in range(4999))
    messages, took = _diagnostics(HEAD + "start: n0\nnodes:\n" + nodes
                                  + "  n4999: {hangup: true}\n")
    print(f"\n5,000-node chain: validated in {1000 * took:.0f} ms")
    assert messages == [] and took < 20


# --- run time ---------------------------------------------------------------------------------


@pytest.fixture
async def speech(tiny_engine: BatchedQwenEngine) -> AsyncIterator[SpeechService]:
    service = SpeechService([tiny_engine])
    service.start()
    yield service
    service.stop()


def _runner(script: Script, speech: SpeechService, engine: BatchedQwenEngine,
            variables: dict[str, str] | None = None) -> tuple[IvrRunner, MemoryTransport]:
    voice = resolve_voice(script)
    transport = MemoryTransport()
    clock = SystemClock()  # real time: these tests time a real backend's misbehaviour
    call = Call("CA" + "8" * 32, transport, clock, transport_name="twilio")
    call.start()
    transport.call = call
    context = RunnerContext(script=script, cache=PromptCache(None),
                            model_fingerprint=engine.fingerprint, voice_identity=voice.identity,
                            speaker=Speaker(speech, SpeechVoice(prompt=voice.prompt)),
                            audio=audio_identity(engine, None), clock=clock,
                            http=httpx.AsyncClient())
    base = {"caller": "+15550001111", "called": "+15550002222", "call_id": call.call_id}
    return IvrRunner(call, context, {**base, **(variables or {})}), transport


@contextlib.asynccontextmanager
async def hostile_backend(mode: str) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """A raw TCP 'company backend' that misbehaves; yields its URL and what it did."""
    stats: dict[str, Any] = {"sent": 0, "closed_after_s": None, "closed": asyncio.Event()}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        t0 = time.monotonic()
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next((line.split(b":")[1] for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length")), b"0"))
        await reader.readexactly(length)
        try:
            if mode == "trickle":
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 1000\r\n\r\n")
                body = (b'{"name": "' + b"x" * 980 + b'"}').ljust(1000)
                for byte in body:
                    writer.write(bytes([byte]))
                    await writer.drain()
                    stats["sent"] += 1
                    await asyncio.sleep(0.2)  # well inside httpx's per-read timeout
            elif mode in ("huge", "chunked"):
                if mode == "huge":
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: 100000000\r\n\r\n")
                else:
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Transfer-Encoding: chunked\r\n\r\n")
                block = b'{"k": "' + b"v" * 65000
                while stats["sent"] < 100_000_000:
                    writer.write(block if mode == "huge" else b"%x\r\n%s\r\n" % (len(block),
                                                                                   block))
                    await writer.drain()
                    stats["sent"] += len(block)
            else:  # a JSON nesting bomb under the size limit
                body = b"[" * 30_000 + b"]" * 30_000
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
                stats["sent"] += len(body)
                await reader.read()
        except ConnectionError:
            pass
        finally:
            stats["closed_after_s"] = time.monotonic() - t0
            stats["closed"].set()
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/hook", stats
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 2)


def _webhook_script(url: str) -> Script:
    return parse_script(
        HEAD + "start: lookup\nerror: failed\nnodes:\n"
        f"  lookup:\n    webhook: {{url: '{url}', timeout: 1s, sets: [name]}}\n    next: done\n"
        "  done: {hangup: true}\n"
        "  failed: {transfer: '+15555550100'}\n")


@pytest.mark.parametrize("mode", ["trickle", "huge", "chunked", "nesting bomb"])
async def test_a_hostile_backend_fails_the_webhook_in_time_and_bounded(
    speech: SpeechService, tiny_engine: BatchedQwenEngine, mode: str
) -> None:
    async with hostile_backend(mode) as (url, stats):
        runner, transport = _runner(_webhook_script(url), speech, tiny_engine)
        t0 = time.monotonic()
        await asyncio.wait_for(runner.run(), 30)
        took = time.monotonic() - t0
        await runner.call.close()
        assert runner.ctx.http is not None
        await runner.ctx.http.aclose()  # drop the pooled connection, if any
        await asyncio.wait_for(stats["closed"].wait(), 10)  # the backend notices the hang-up
    print(f"\nbackend {mode}: webhook failed after {1000 * took:.0f} ms; the backend had sent "
          f"{stats['sent']:,} bytes")
    assert runner.path == ["lookup", "failed"]
    assert transport.outcome == TransferTo("+15555550100")
    assert took < 1.0 + 1.0  # the webhook's 1 s timeout bounds the whole exchange
    # Whatever the backend pushed, the gateway stopped reading past the limit (the rest sat in
    # socket buffers, a few MB at most).
    assert stats["sent"] < 16 * 1024 * 1024
    assert "name" not in runner.variables


async def test_a_node_cycle_without_input_ends_after_max_steps(
    speech: SpeechService, tiny_engine: BatchedQwenEngine
) -> None:
    script = parse_script(HEAD + "start: a\nnodes:\n  a: {next: b}\n  b: {next: a}\n")
    runner, transport = _runner(script, speech, tiny_engine)
    t0 = time.monotonic()
    await asyncio.wait_for(runner.run(), 30)
    await runner.call.close()
    print(f"\na <-> b cycle: {len(runner.path)} steps in {1000 * (time.monotonic() - t0):.0f} ms")
    assert len(runner.path) == runner_module.MAX_STEPS
    assert transport.outcome == EndCall()


async def _first_utterance(runner: IvrRunner) -> str:
    task = asyncio.create_task(runner.run())
    transport = runner.call.transport
    assert isinstance(transport, MemoryTransport)
    try:
        sending = asyncio.ensure_future(transport.sending.wait())
        done, _ = await asyncio.wait({sending, task}, timeout=30,
                                     return_when=asyncio.FIRST_COMPLETED)
        sending.cancel()
        assert sending in done, runner.path
        return runner.call.utterances[0].text
    finally:
        runner.call.deliver(CallerHungUp(at=runner.clock.now()))
        await asyncio.wait_for(task, 30)
        await runner.call.close()


async def test_a_huge_caller_id_from_the_transport_is_cut_to_plain_text(
    speech: SpeechService, tiny_engine: BatchedQwenEngine
) -> None:
    script = parse_script(HEAD + "start: a\nnodes:\n  a:\n    say: 'You are calling from {caller}.'"
                          "\n    hangup: true\n")
    hostile = "{called}" + "9" * 60_000
    runner, _ = _runner(script, speech, tiny_engine, {"caller": hostile})
    text = await _first_utterance(runner)
    assert text == "You are calling from " + hostile[:MAX_VALUE_CHARS] + "."


async def test_backend_values_with_dunder_names_and_format_strings_stay_plain_text(
    speech: SpeechService, tiny_engine: BatchedQwenEngine
) -> None:
    answer = {"__class__": "{0.__init__.__globals__}", "name": "N" * 5_000,
              "deep": [[[[1]]]], "1bad": "x", "a b": "y", "__init__": {"x": 1}}

    def backend(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=answer)

    script = parse_script(
        HEAD + "start: lookup\nerror: bye\nnodes:\n"
        "  lookup:\n    webhook: {url: 'http://backend.test/x', sets: [name, __class__]}\n"
        "    next: greet\n"
        "  greet:\n    say: 'Hi {name}, {__class__}.'\n    hangup: true\n"
        "  bye: {hangup: true}\n")
    runner, _ = _runner(script, speech, tiny_engine)
    runner.ctx.http = httpx.AsyncClient(transport=httpx.MockTransport(backend))
    text = await _first_utterance(runner)
    assert text == "Hi " + "N" * MAX_VALUE_CHARS + ", {0.__init__.__globals__}."
    assert not {"deep", "1bad", "a b", "__init__"} & set(runner.variables)


def test_the_webhook_limit_is_what_the_backend_tests_assume() -> None:
    # The bound the backend tests check against: 64 KiB, far below what they push.
    assert MAX_WEBHOOK_BYTES == 64 * 1024
