"""Many lines on one gateway, and scripts changed while calls are up (the real app, real sockets).

One gateway (tiny model, virtual time, Twilio and SIP) serves a lines file in a temporary
directory: the demo as the customer-service line (and the default), and a small outage line
whose script the tests rewrite. The prompt cache starts as a copy of the demo's, with the outage
line rendered by ``gateway script render LINES`` exactly as an operator would.

Reloads are waited for on the reloader's attempt counter (with a real-time limit), never by
sleeping: the gateway polls the files on its injected clock, which is the loop's virtual time.
The last test sends a real SIGHUP to a gateway process.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import re
import shutil
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gateway.call import EndCall
from gateway.call.session import Call, Utterance
from gateway.cli import main
from tests.support.clocks import LoopClock
from tests.support.gateway_process import GatewayProcess
from tests.support.metrics import metric
from tests.support.paths import REPO
from tests.support.servers import AUTH_TOKEN, VirtualServer, on_virtual_time, serve_virtual
from tests.support.twilio_client import FakeTwilioCall
from tests.support.waiting import until, wait_until

ROOT = REPO
DEMO = ROOT / "prompts" / "demo.yaml"

OUTAGES = """\
name: Outage line
voice: {{speaker: serena, language: English}}
start: welcome
prompts:
  welcome: Outage line, version {v}.
  status: Version {v} status. Goodbye.
nodes:
  welcome:
    say: welcome
    next: menu
  menu:
    gather:
      prompt: Version {v} menu, press 1.
      digits: 1
      timeout: 600s
      branch: {{"1": status}}
      fallback: status
  status:
    say: status
    hangup: true
"""

LINES = """\
default: customer-service
lines:
  customer-service:
    script: {demo}
    numbers: ["+1 555 000 2222", ivr]
  outages:
    script: outages.yaml
    numbers: [{numbers}]
"""


def _lines(numbers: str = '"+1 555 000 3333", "2000"') -> str:
    return LINES.format(demo=DEMO, numbers=numbers)


@dataclass
class Rig:
    live: VirtualServer
    root: Path
    cache: Path
    render_output: str
    renders_at_start: float

    def run(self, coroutine: Any, *, realtime: bool = False) -> Any:
        """For :func:`conftest.on_virtual_time`: in the gateway's loop."""
        return self.live.run(coroutine, realtime=realtime)


def _sample(live: VirtualServer, name: str, **labels: str) -> float:
    return live.gateway.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture(scope="module")
def rig(tiny_model_dir: Path, demo_cache_dir: Path,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    root = tmp_path_factory.mktemp("lines")
    cache = root / "cache"
    shutil.copytree(demo_cache_dir, cache)
    (root / "outages.yaml").write_text(OUTAGES.format(v="one"))
    (root / "lines.yaml").write_text(_lines())
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["script", "render", str(root / "lines.yaml"), "--model", str(tiny_model_dir),
                     "--device", "cpu", "--cache-dir", str(cache)])
    assert code == 0, out.getvalue()
    with serve_virtual({"model": str(tiny_model_dir), "lines": str(root / "lines.yaml"),
                        "cache_dir": str(cache), "reload_interval_s": 1, "max_calls": 32,
                        "sip": "127.0.0.1:0", "sip_allow": "127.0.0.1/32",
                        "rtp_ports": "28000-28199"}) as live:
        renders = _sample(live, "gateway_prompt_render_seconds_count")
        yield Rig(live, root, cache, out.getvalue(), renders)


# --- helpers ----------------------------------------------------------------------------------




async def _reloaded(live: VirtualServer, attempts: int) -> None:
    """Until the gateway's reloader has finished ``attempts`` reloads (installed or refused)."""
    reloader = live.gateway.reloader
    assert reloader is not None
    waiter = asyncio.ensure_future(reloader.wait(attempts=attempts))
    try:
        await until(waiter.done, 120, f"reload attempt {attempts}")
    finally:
        waiter.cancel()


class TwilioCall:
    """A caller over the Media Stream, and the server's side of its call."""

    def __init__(self, live: VirtualServer, n: int, to: str) -> None:
        self.live = live
        self.to = to
        self.fake = FakeTwilioCall(live.ws_url, AUTH_TOKEN, call_sid=f"CA{n:032d}",
                                   stream_sid=f"MZ{n:032d}", playback_speed=20)
        self.server: Call | None = None

    async def start(self) -> TwilioCall:
        await self.fake.connect()
        await self.fake.start({"From": "+15550001111", "To": self.to})
        self.server = await self.fake.wait_for(
            lambda: self.live.gateway.registry.get(self.fake.call_sid), timeout=30)
        return self

    async def heard(self, text: str, after: int = 0) -> Utterance:
        """Until the caller has heard ``text`` to its end (its mark came back)."""
        assert self.server is not None
        server = self.server

        def find() -> Utterance | None:
            return next((u for u in server.utterances[after:]
                         if text in u.text and u.played.is_set()), None)

        try:
            return await self.fake.wait_for(find, timeout=60)
        except TimeoutError:
            said = [(u.text, u.played.is_set()) for u in server.utterances]
            raise AssertionError(f"never heard {text!r}; heard {said}") from None

    async def ended(self) -> None:
        await self.fake.wait_for(lambda: self.fake.closed.is_set(), timeout=30)

    async def close(self) -> None:
        await self.fake.close()


# --- routing ----------------------------------------------------------------------------------


def test_script_render_takes_the_lines_file_and_the_gateway_starts_with_every_prompt(
    rig: Rig,
) -> None:
    """The CLI rendered the outage line's sentences (the demo's were cached already) under the
    keys the gateway then looks up: it started without rendering anything."""
    match = re.search(r"(\d+) already cached, (\d+) rendered", rig.render_output)
    assert match is not None, rig.render_output
    demo_renders = len(rig.live.gateway.plan.lines["customer-service"].script.static_renders())  # type: ignore[union-attr]
    assert (int(match.group(1)), int(match.group(2))) == (demo_renders, 3)
    assert rig.renders_at_start == 0
    assert rig.live.gateway.switchboard is not None
    assert rig.live.gateway.switchboard.version.number == 1
    assert _sample(rig.live, "gateway_script_version") == 1


@on_virtual_time("rig")
async def test_each_number_reaches_its_lines_script_over_twilio_and_sip(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    from gateway.loadsim.sip_caller import SipCaller

    live = rig.live
    caplog.set_level(logging.INFO, logger="gateway")
    calls = [TwilioCall(live, 1, "+15550003333"), TwilioCall(live, 2, "+1 (555) 000-2222"),
             TwilioCall(live, 3, "+15559999999")]
    try:
        for call in calls:
            await call.start()
        await calls[0].heard("Outage line, version one.")
        for call in calls[1:]:
            greeting = await call.heard("Thank you for calling Acme Energy.")
            assert greeting.cached
        assert [c.server.line for c in calls] == ["outages", "customer-service", "default"]  # type: ignore[union-attr]
    finally:
        for call in calls:
            await call.close()
    unlisted = [r.getMessage() for r in caplog.records if "is on no line" in r.getMessage()]
    assert unlisted == [f"call {calls[2].fake.call_sid}: '+15559999999' is on no line of "
                        f"{rig.root / 'lines.yaml'}; the default line 'customer-service' "
                        "answers"]

    # SIP: the Request-URI user picks the line (an extension here).
    endpoint = live.gateway.sip
    assert endpoint is not None and endpoint.local_addr is not None
    for user, line, text in (("2000", "outages", "Outage line, version one."),
                             ("ivr", "customer-service", "Thank you for calling Acme Energy.")):
        before = set(live.gateway.registry.items())
        phone = SipCaller(caller_id="tester", clock=LoopClock(asyncio.get_running_loop()))
        try:
            await phone.call(endpoint.local_addr, user=user)
            server = await until(lambda b=before: next(
                (c for k, c in live.gateway.registry.items() if (k, c) not in b), None), 60)
            assert server.line == line
            await until(lambda s=server, t=text: any(t in u.text and u.first_frame_at
                                                      for u in s.utterances), 60, text)
            await phone.hangup()
        finally:
            await phone.aclose()
    await until(lambda: not live.gateway.registry, 60, "every call gone")
    for transport, line, count in (("twilio", "outages", 1), ("twilio", "customer-service", 1),
                                   ("twilio", "default", 1), ("sip", "outages", 1),
                                   ("sip", "customer-service", 1)):
        assert _sample(live, "gateway_calls_total", transport=transport, line=line) == count
    # The per-call trace names the line and the version the call ran.
    traces = [r.data["trace"] for r in caplog.records if r.getMessage() == "ivr trace"]  # type: ignore[attr-defined]
    outage = next(t for t in traces if t["call_id"] == calls[0].fake.call_sid)
    assert (outage["line"], outage["version"], outage["script"]) == (
        "outages", 1, "Outage line")


# --- reloads ----------------------------------------------------------------------------------


@on_virtual_time("rig")
async def test_a_reload_with_calls_up_lets_each_call_finish_on_its_version(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    """Three calls are in the outage line's menu when its script is rewritten: the new version
    is validated and its sentences rendered before it takes a call; the three finish on the
    old one, a new call gets the new one. Then an invalid edit is refused (located errors in
    the log, the error counter) and the new version keeps serving; fixing it and editing the
    lines file installs a third."""
    live = rig.live
    gateway = live.gateway
    switchboard, cache = gateway.switchboard, gateway.cache
    assert switchboard is not None and cache is not None
    caplog.set_level(logging.INFO, logger="gateway")
    outages = rig.root / "outages.yaml"
    attempts = gateway.reloader.attempts  # type: ignore[union-attr]
    renders = _sample(live, "gateway_prompt_render_seconds_count")

    # What each new version had in the cache when it was installed.
    missing_at_install: list[list[str]] = []
    install = switchboard.install

    def checked_install(version: Any) -> None:
        context = version.contexts["outages"]
        missing_at_install.append([text for text, voice in context.script.static_renders()
                                   if cache.get(context.key(text, voice)) is None])
        install(version)

    switchboard.install = checked_install  # type: ignore[method-assign]
    old = [TwilioCall(live, 10 + i, "+15550003333") for i in range(3)]
    new: list[TwilioCall] = []
    try:
        for call in old:
            await call.start()
        for call in old:
            await call.heard("Version one menu, press 1.")

        outages.write_text(OUTAGES.format(v="two"))
        await _reloaded(live, attempts + 1)
        assert switchboard.version.number == 2 and missing_at_install == [[]]
        assert _sample(live, "gateway_prompt_render_seconds_count") == renders + 3
        assert _sample(live, "gateway_script_reloads_total") == 1
        assert _sample(live, "gateway_script_version") == 2

        call = await TwilioCall(live, 20, "+15550003333").start()
        new.append(call)
        greeting = await call.heard("Outage line, version two.")
        assert greeting.cached  # rendered before the version took its first call
        await call.heard("Version two menu, press 1.")
        for caller in (*old, call):
            await caller.fake.send_dtmf("1")
        for caller in old:
            goodbye = await caller.heard("Version one status. Goodbye.")
            assert goodbye.cached
            await caller.ended()
            assert isinstance(caller.server.outcome, EndCall)  # type: ignore[union-attr]
            assert caller.fake.close_code == 1000
        await call.heard("Version two status. Goodbye.")
        await call.ended()

        # An invalid edit: refused, located, counted; version 2 keeps serving.
        outages.write_text(OUTAGES.format(v="three").replace('"1": status', '"1": stauts'))
        await _reloaded(live, attempts + 2)
        assert switchboard.version.number == 2
        assert _sample(live, "gateway_script_reload_errors_total") == 1
        logged = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        located = re.escape(str(outages)) + r":16:21: error: node 'menu' sends '1' to 'stauts'"
        assert any(re.match(located, m) for m in logged), logged
        assert "reload refused: 1 error(s); version 2 keeps serving" in logged
        call = await TwilioCall(live, 21, "+15550003333").start()
        new.append(call)
        await call.heard("Outage line, version two.")

        # Fixed, and the lines file gives the outage line one more number: version 3, nothing
        # to render (version 2's sentences are cached).
        renders = _sample(live, "gateway_prompt_render_seconds_count")
        outages.write_text(OUTAGES.format(v="two"))
        (rig.root / "lines.yaml").write_text(_lines('"+1 555 000 3333", "2000", "+15550004444"'))
        await _reloaded(live, attempts + 3)
        assert switchboard.version.number == 3 and missing_at_install[-1] == []
        assert _sample(live, "gateway_prompt_render_seconds_count") == renders
        call = await TwilioCall(live, 22, "+15550004444").start()
        new.append(call)
        await call.heard("Outage line, version two.")
        assert call.server is not None and call.server.line == "outages"
        assert _sample(live, "gateway_calls_refused_total", transport="twilio",
                       reason="at_capacity") == 0
    finally:
        switchboard.install = install  # type: ignore[method-assign]
        for caller in (*old, *new):
            await caller.close()
    assert [ok for _, ok in list(gateway.reloader.history)[-3:]] == [True, False, True]  # type: ignore[union-attr]


# --- SIGHUP -----------------------------------------------------------------------------------


def _metric(process: GatewayProcess, name: str) -> float:
    return metric(process.base_url, name, default=0.0)


def _wait_metric(process: GatewayProcess, name: str, value: float, timeout: float = 120) -> None:
    """Until another process's /metrics shows ``name`` >= ``value`` (polled: nothing to wait
    on in this process), failing at once with its log if it exits."""
    def reached() -> bool:
        assert process.proc is not None and process.proc.poll() is None, process.log()
        return _metric(process, name) >= value

    wait_until(reached, timeout, f"{name} >= {value:g}")


@pytest.mark.slow  # a signal to a gateway process, on real time
def test_sighup_reloads_the_lines_of_a_gateway_process(rig: Rig, tiny_model_dir: Path,
                                                       tmp_path: Path) -> None:
    """``gateway serve`` with polling off (GATEWAY_RELOAD_INTERVAL_S=0): a SIGHUP reloads an
    edit; a SIGHUP after an invalid edit is refused with located errors in the log."""
    (tmp_path / "outages.yaml").write_text(OUTAGES.format(v="one"))
    (tmp_path / "lines.yaml").write_text(_lines())
    cache = tmp_path / "cache"
    shutil.copytree(rig.cache, cache)
    # Lazy rendering and no speech detector: this test is about the signal, and the process
    # starts sooner (rendering before a version serves is the in-process test's).
    env = {"GATEWAY_LINES": str(tmp_path / "lines.yaml"), "GATEWAY_CACHE_DIR": str(cache),
           "GATEWAY_RELOAD_INTERVAL_S": "0", "GATEWAY_RENDER_LAZILY": "1",
           "GATEWAY_BARGE_IN_ON_SPEECH": "0"}
    with GatewayProcess(tiny_model_dir, tmp_path, env) as process:
        process.wait_ready()
        (tmp_path / "outages.yaml").write_text(OUTAGES.format(v="four"))
        process.signal(signal.SIGHUP)
        _wait_metric(process, "gateway_script_reloads_total", 1)
        assert _metric(process, "gateway_script_version") == 2
        (tmp_path / "outages.yaml").write_text("name: Outage line\nstart: nowhere\nnodes: {}\n")
        process.signal(signal.SIGHUP)
        _wait_metric(process, "gateway_script_reload_errors_total", 1)
        assert _metric(process, "gateway_script_version") == 2
        process.signal(signal.SIGTERM)
        assert process.wait_exit(60) == 0
    log = process.log()
    assert "reloading" in log and "(SIGHUP)" in log
    assert f"{tmp_path / 'outages.yaml'}:1:1: error: 'voice' is required here" in log, log
    assert "reload refused" in log
