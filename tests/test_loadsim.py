"""The load simulator against a real gateway, and against planted faults it must detect."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from conftest import AUTH_TOKEN, DEMO_SCRIPT, LiveServer, serve
from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import Response

from gateway.cli import main
from gateway.loadsim.model import evaluate, parse_slo
from gateway.loadsim.runner import LoadConfig, run_level
from gateway.tts.qwen import QwenEngine


@pytest.fixture(scope="module")
def gateway(tiny_model_dir: Path, demo_cache_dir: Path) -> Iterator[LiveServer]:
    with serve(
        {"model": str(tiny_model_dir), "script": str(DEMO_SCRIPT), "cache_dir": str(demo_cache_dir),
         # Sizing runs past the replica's call budget on purpose.
         "max_calls": 500}
    ) as live:
        yield live


def test_twenty_callers_against_the_real_gateway_finish_clean_with_a_report(
    gateway: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    samples, report = tmp_path / "run.json", tmp_path / "run.html"
    code = main(
        [
            "loadsim",
            "run",
            gateway.base_url,
            "--concurrency",
            "20",
            "--duration",
            "6",
            "--digits",
            "9,9",
            "--think",
            "0.5",
            "--listen",
            "0.5",
            "--auth-token",
            AUTH_TOKEN,
            "--json",
            str(samples),
            "--html",
            str(report),
            "--slo",
            "errors=0,timeouts=0,gaps=0",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    document = json.loads(samples.read_text())
    level = document["levels"][0]
    assert level["calls"] >= 20 and level["errors"] == 0 and level["timeouts"] == 0
    assert level["ttfa_ms"]["p50"] is not None and level["gaps"] == 0
    turns = [t for c in document["calls"] for t in c["turns"]]
    assert {t["kind"] for t in turns} >= {"answer", "barge_in"}
    assert all(t["first_audio_ms"] is not None for t in turns)
    barge = [t["barge_in_ms"] for t in turns if t["kind"] == "barge_in"]
    assert barge and all(b is not None and b < 500 for b in barge)
    lateness = document["meta"]["simulator_lateness_ms"]
    print(
        f"\n20 callers: first audio p50 {level['ttfa_ms']['p50']:.1f} ms, "
        f"p95 {level['ttfa_ms']['p95']:.1f} ms; simulator lateness p99 {lateness['p99']:.2f} ms"
    )
    html = report.read_text()
    assert html.count("<svg") >= 4 and "http://" not in html.replace(gateway.base_url, "")


def test_an_slo_that_is_missed_exits_nonzero(
    gateway: LiveServer, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "loadsim",
            "run",
            gateway.base_url,
            "--concurrency",
            "2",
            "--duration",
            "2",
            "--digits",
            "9",
            "--think",
            "0.3",
            "--listen",
            "0.2",
            "--auth-token",
            AUTH_TOKEN,
            "--slo",
            "ttfa_p50<0.001ms",
        ]
    )
    assert code == 1
    assert "SLO missed" in capsys.readouterr().err


def test_slo_parsing() -> None:
    clauses = parse_slo("ttfa_p95<200ms, gaps=0, errors<=0, ttfa_p99<1s")
    assert [c.metric for c in clauses] == ["ttfa_p95", "gaps", "errors", "ttfa_p99"]
    assert clauses[3].value == 1000
    summary = {"ttfa_ms": {"p95": 150.0, "p99": 900.0}, "gaps": 0, "errors": 0, "refused": None}
    assert evaluate(clauses, summary)[0]
    summary["gaps"] = 3
    passed, lines = evaluate(clauses, summary)
    assert not passed and any("gaps = 0: 3 MISSED" in line for line in lines)
    for bad in ("ttfa_p95 ~ 200", "latency<3ms", ""):
        with pytest.raises(Exception, match="SLO"):
            parse_slo(bad)


# --- planted faults ---------------------------------------------------------------------------


@contextlib.contextmanager
def fault_server(behaviour: str) -> Iterator[str]:
    """A deliberately broken Media Streams server: ``stutter`` delays frames mid-prompt,
    ``deaf`` never answers a key. Its voice webhook answers like the gateway's."""
    app = FastAPI()

    @app.post("/twilio/voice")
    async def voice(request: Request) -> Response:
        url = f"ws://{request.headers['host']}/twilio/media"
        return Response(f'<?xml version="1.0" encoding="UTF-8"?><Response><Connect>'
                        f'<Stream url="{url}" /></Connect></Response>',
                        media_type="application/xml")

    @app.websocket("/twilio/media")
    async def media(websocket: WebSocket) -> None:
        await websocket.accept()
        stream_sid = ""
        frame = base64.b64encode(b"\x10" * 160).decode()

        async def send(frames: int) -> None:
            payload = base64.b64encode(b"\x10" * 160 * frames).decode()
            await websocket.send_text(
                json.dumps(
                    {"event": "media", "streamSid": stream_sid, "media": {"payload": payload}}
                )
            )

        try:
            while True:
                message = json.loads(await websocket.receive_text())
                if message["event"] == "start":
                    stream_sid = message["start"]["streamSid"]
                    # 0.4 s of audio, then nothing for 0.6 s (the listener runs dry), then more.
                    await send(20)
                    if behaviour == "stutter":
                        await asyncio.sleep(1.0)
                        await send(20)
                    await websocket.send_text(
                        json.dumps(
                            {"event": "mark", "streamSid": stream_sid, "mark": {"name": "m1"}}
                        )
                    )
                elif message["event"] == "dtmf" and behaviour != "deaf":
                    await send(10)
                elif message["event"] == "stop":
                    break
        except Exception:  # the client went away
            pass
        del frame

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def _config(target: str, **overrides: Any) -> LoadConfig:
    values: dict[str, Any] = dict(
        target=target,
        auth_token=None,
        digits=["5"],
        think_s=1.5,
        listen_s=0.3,
        duration_s=0.1,
        turn_timeout_s=2.0,
    )
    values.update(overrides)
    return LoadConfig(**values)


def test_a_server_that_delays_frames_shows_gaps() -> None:
    with fault_server("stutter") as url:
        level = run_level(_config(url, digits=[], listen_s=1.5), 1, 0)
    summary = level.summary()
    assert summary["gaps"] >= 1 and 500 <= summary["gap_ms"] <= 800, summary
    assert summary["errors"] == 0


def test_a_server_that_never_answers_a_turn_shows_a_timeout() -> None:
    with fault_server("deaf") as url:
        level = run_level(_config(url), 1, 0)
    summary = level.summary()
    assert summary["timeouts"] == 1 and summary["errors"] == 1
    # Which turn, after what, how long the caller waited.
    assert level.calls[0].error == "no audio within 2 s after pressing 5 (turn 2)"


class _SlowEngine(QwenEngine):
    """The real engine, with a planted delay before the first chunk of every utterance."""

    delay_s = 0.0

    def stream(self, request, should_stop=None):  # type: ignore[no-untyped-def]
        inner = super().stream(request, should_stop)

        def slowed():  # type: ignore[no-untyped-def]
            time.sleep(self.delay_s)
            yield from inner

        return slowed()


def test_a_slowed_engine_raises_first_audio_latency_accordingly(tiny_model_dir: Path) -> None:
    """No script: every key gets a live sentence, so first audio includes the engine."""
    engines: list[_SlowEngine] = []

    def factory(settings):  # type: ignore[no-untyped-def]
        engines.append(_SlowEngine(str(tiny_model_dir), device="cpu"))
        return engines

    config = dict(
        digits=["5", "6"],
        think_s=0.8,
        listen_s=0.8,
        duration_s=0.1,
        turn_timeout_s=10.0,
        auth_token=AUTH_TOKEN,
    )
    with serve({"model": str(tiny_model_dir)}, factory) as live:

        def dtmf_ttfa() -> float:
            level = run_level(_config(live.base_url, **config), 1, 0)
            values = [
                t.first_audio_ms
                for c in level.calls
                for t in c.turns
                if t.kind != "answer" and t.first_audio_ms is not None
            ]
            assert values and not level.summary()["errors"], level.summary()
            return sorted(values)[len(values) // 2]

        baseline = dtmf_ttfa()
        engines[0].delay_s = 0.4
        slowed = dtmf_ttfa()
    print(f"\nfirst audio after a key: {baseline:.0f} ms, with +400 ms planted: {slowed:.0f} ms")
    assert 300 <= slowed - baseline <= 600


@pytest.mark.parametrize("pattern", ["rate", "ramp"])
def test_arrival_patterns(gateway: LiveServer, pattern: str) -> None:
    config = LoadConfig(
        target=gateway.base_url,
        auth_token=AUTH_TOKEN,
        digits=["9"],
        think_s=0.3,
        listen_s=0.2,
        duration_s=2.0,
        pattern=pattern,
        rate=4.0,
        ramp_from=1,
        seed=7,
    )
    level = run_level(config, 4, 0)
    summary = level.summary()
    assert summary["errors"] == 0 and summary["calls"] >= 3, summary
    starts = sorted(c.started_s for c in level.calls)
    if pattern == "ramp":
        # 1 caller at first, 4 by the end: calls start spread over the run, not all at once.
        assert starts[1] - starts[0] > 0.2
    else:
        assert starts[-1] - starts[0] > 0.5  # Poisson arrivals over the 2 s


def test_workers_split_the_callers_and_merge_combines_hosts(
    gateway: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = []
    for host in ("a", "b"):
        path = tmp_path / f"{host}.json"
        code = main(
            [
                "loadsim",
                "run",
                gateway.base_url,
                "--concurrency",
                "4",
                "--workers",
                "2",
                "--duration",
                "2",
                "--digits",
                "9",
                "--think",
                "0.3",
                "--listen",
                "0.2",
                "--auth-token",
                AUTH_TOKEN,
                "--json",
                str(path),
            ]
        )
        assert code == 0
        document = json.loads(path.read_text())
        assert document["meta"]["workers"] == 2
        assert {c["id"].split("-")[0] for c in document["calls"]} == {"w0", "w1"}
        files.append(path)
    merged = tmp_path / "merged.json"
    html = tmp_path / "merged.html"
    code = main(
        [
            "loadsim",
            "merge",
            *map(str, files),
            "-o",
            str(merged),
            "--html",
            str(html),
            "--slo",
            "errors=0",
        ]
    )
    assert code == 0
    document = json.loads(merged.read_text())
    single = [json.loads(f.read_text()) for f in files]
    assert document["levels"][0]["concurrency"] == 8
    assert len(document["calls"]) == sum(len(d["calls"]) for d in single)
    assert html.exists() and "<svg" in html.read_text()
