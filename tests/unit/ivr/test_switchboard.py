"""The switchboard and the reloader alone, on a virtual clock (no model, no sockets).

How a call is routed and labelled, and when the reloader reads the files: only once an edit
holds still for an interval, never again for an edit it refused, at once when asked (SIGHUP).
The whole gateway doing the same with calls up is tests/unit/ivr/test_reload.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.clock import VirtualClock
from gateway.ivr.lines import FileStamp, LinePlan, load_lines, single_script
from gateway.ivr.switchboard import Reloader, Switchboard, Version, VersionBuilder
from gateway.metrics import Metrics

SCRIPT = """\
name: {name}
voice: {{speaker: ryan, language: English}}
start: hello
nodes:
  hello:
    say: {text}
    hangup: true
"""


class Builder(VersionBuilder):
    """Builds versions with no runner contexts (the switchboard tests give their own)."""

    def __init__(self) -> None:
        self.built: list[tuple[int, bool]] = []

    async def build(self, plan: LinePlan, number: int, *, background: bool = False) -> Version:
        self.built.append((number, background))
        return Version(number, plan, {})


def _version(plan: LinePlan, number: int = 1) -> Version:
    return Version(number, plan, {name: f"context of {name} v{number}"  # type: ignore[misc]
                                  for name in plan.lines})


def _call(called: str) -> Any:
    return SimpleNamespace(call_id="CA1", parameters={"called": called}, line="default")


def test_a_call_is_labelled_with_its_line_and_an_unlisted_number_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "a.yaml").write_text(SCRIPT.format(name="A", text="Hello from A."))
    (tmp_path / "b.yaml").write_text(SCRIPT.format(name="B", text="Hello from B."))
    lines = tmp_path / "lines.yaml"
    lines.write_text("default: a\nlines:\n  a: {script: a.yaml, numbers: ['+15550002222']}\n"
                     "  b: {script: b.yaml, numbers: ['2000']}\n")
    metrics = Metrics()
    switchboard = Switchboard(_version(load_lines(lines)), metrics)
    caplog.set_level(logging.INFO, logger="gateway.ivr.switchboard")
    for called, label in (("+15550002222", "a"), ("sip:2000@gw", "b"), ("+15559999999", "default")):
        call = _call(called)
        assert callable(switchboard.for_call(call))
        assert call.line == label
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"call CA1: '+15559999999' is on no line of {lines}; the default line "
                        "'a' answers"]
    assert metrics.registry.get_sample_value("gateway_script_version") == 1
    switchboard.install(_version(load_lines(lines), 2))
    assert switchboard.version.number == 2
    assert metrics.registry.get_sample_value("gateway_script_version") == 2
    # One script for every call (GATEWAY_SCRIPT): every call is the default line's, unlogged.
    caplog.clear()
    single = Switchboard(_version(single_script(tmp_path / "a.yaml")))
    call = _call("+15550002222")
    single.for_call(call)
    assert call.line == "default"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.fixture
async def watched(tmp_path: Path) -> AsyncIterator[tuple[Path, VirtualClock, Reloader, Builder,
                                                         Metrics]]:
    script = tmp_path / "a.yaml"
    script.write_text(SCRIPT.format(name="A", text="One."))
    clock, builder, metrics = VirtualClock(), Builder(), Metrics()
    switchboard = Switchboard(_version(single_script(script)), metrics)

    def load(stamps: dict[Path, FileStamp]) -> LinePlan:
        return single_script(script, stamps=stamps)

    reloader = Reloader(load=load, builder=builder, switchboard=switchboard, clock=clock,
                        interval_s=1.0, metrics=metrics)
    task = asyncio.create_task(reloader.run())
    await clock.next_wait(0)
    try:
        yield script, clock, reloader, builder, metrics
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def _tick(clock: VirtualClock, reloader: Reloader) -> None:
    """One interval: the reloader looks at the files once, then waits for the next."""
    waits, checks = clock.waits, reloader.checks
    await clock.advance(1.0)
    await reloader.wait(checks=checks + 1)
    await clock.next_wait(waits)


async def test_an_edit_is_read_once_it_holds_still_and_a_refused_one_is_not_retried(
    watched: tuple[Path, VirtualClock, Reloader, Builder, Metrics],
) -> None:
    script, clock, reloader, builder, metrics = watched
    switchboard = reloader._switchboard
    await _tick(clock, reloader)
    assert reloader.attempts == 0  # nothing changed

    script.write_text(SCRIPT.format(name="A", text="Two, half written"))
    await _tick(clock, reloader)
    script.write_text(SCRIPT.format(name="A", text="Two, now written out."))
    await _tick(clock, reloader)
    assert reloader.attempts == 0  # it changed again: still being written
    await _tick(clock, reloader)
    assert reloader.attempts == 1 and switchboard.version.number == 2
    assert builder.built == [(2, True)]  # rendered behind callers' turns
    assert switchboard.version.plan.lines["default"].script.nodes["hello"].say == [
        "Two, now written out."]

    script.write_text("name: A\nstart: nowhere\nnodes: {}\n")
    await _tick(clock, reloader)
    await _tick(clock, reloader)
    assert reloader.attempts == 2 and switchboard.version.number == 2
    assert metrics.registry.get_sample_value("gateway_script_reload_errors_total") == 1
    for _ in range(3):
        await _tick(clock, reloader)
    assert reloader.attempts == 2  # the refused edit is not tried again...

    script.write_text(SCRIPT.format(name="A", text="Three."))
    await _tick(clock, reloader)
    await _tick(clock, reloader)
    assert reloader.attempts == 3 and switchboard.version.number == 3  # ...the next edit is
    assert [ok for _, ok in reloader.history] == [True, False, True]
    assert metrics.registry.get_sample_value("gateway_script_reloads_total") == 2


async def test_a_request_reloads_at_once_whatever_the_files_say(
    watched: tuple[Path, VirtualClock, Reloader, Builder, Metrics],
) -> None:
    _, clock, reloader, builder, _ = watched
    reloader.request("SIGHUP")
    await reloader.wait(attempts=1)
    assert clock.now() == 0 and builder.built == [(2, True)]
    assert list(reloader.history) == [("SIGHUP", True)]


async def test_a_request_made_before_the_reloader_runs_is_kept(tmp_path: Path) -> None:
    script = tmp_path / "a.yaml"
    script.write_text(SCRIPT.format(name="A", text="One."))
    switchboard = Switchboard(_version(single_script(script)))
    reloader = Reloader(load=lambda stamps: single_script(script, stamps=stamps),
                        builder=Builder(), switchboard=switchboard, clock=VirtualClock(),
                        interval_s=0)
    reloader.request("SIGHUP")
    task = asyncio.create_task(reloader.run())
    try:
        await reloader.wait(attempts=1)
        assert switchboard.version.number == 2
    finally:
        task.cancel()


SPEECH_SCRIPT = """\
name: {name}
voice: {{speaker: ryan, language: English}}
start: menu
nodes:
  menu:
    gather:
      prompt: Say billing, or press 1.
      digits: 1
      branch: {{"1": bye}}
      speech: {{bye: [billing]}}
      fallback: bye
  bye:
    say: Goodbye.
    hangup: true
"""


class _Pool:
    """Stands in for the recogniser pool: what the builder asked of it."""

    name, workers = "fake", 1

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.starts = 0
        self.prepared: list[Any] = []

    async def start(self) -> None:
        from gateway.asr.pool import RecognizerUnavailable

        self.starts += 1
        if self.fail:
            raise RecognizerUnavailable("no recogniser here")

    async def prepare(self, grammar: Any) -> None:
        self.prepared.append(grammar)


def _builder(pool: _Pool) -> VersionBuilder:
    return VersionBuilder(cache=None, speech=None, engine=None,  # type: ignore[arg-type]
                          conditioning=None, clock=VirtualClock(), voices_dir=Path("."),
                          recognizer=pool)  # type: ignore[arg-type]


async def test_the_recogniser_starts_with_the_first_version_that_listens(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A gateway whose scripts have no speech gathers keeps the recogniser's workers down; a
    reload that adds one starts them and compiles its grammar; a recogniser that cannot start
    is logged and the version still serves (its speech gathers take keys)."""
    keys_only = tmp_path / "keys.yaml"
    keys_only.write_text(SCRIPT.format(name="K", text="Hello."))
    spoken = tmp_path / "speech.yaml"
    spoken.write_text(SPEECH_SCRIPT.format(name="S"))
    pool = _Pool()
    builder = _builder(pool)
    await builder.prepare_speech(single_script(keys_only))
    assert pool.starts == 0 and pool.prepared == []
    await builder.prepare_speech(single_script(spoken))
    assert pool.starts == 1 and len(pool.prepared) == 1
    assert pool.prepared[0].branches[0][0] == "bye"

    broken = _Pool(fail=True)
    with caplog.at_level(logging.ERROR, logger="gateway.ivr.switchboard"):
        await _builder(broken).prepare_speech(single_script(spoken))
    assert broken.starts == 1 and broken.prepared == []
    assert "speech gathers take keys only" in caplog.text and "no recogniser here" in caplog.text
