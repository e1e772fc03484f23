"""``gateway loadsim``: run simulated callers, search capacity, merge results.

Exit code 1 when an SLO given with ``--slo`` is missed, so a deployment pipeline can gate on it.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from gateway.errors import GatewayError
from gateway.loadsim.model import Level, evaluate, latency_bound, parse_slo
from gateway.loadsim.runner import LoadConfig, levels_from_document, result_document, run_level

loadsim_app = typer.Typer(no_args_is_help=True,
                          help="Call-load simulator: how many callers one gateway holds.")

_console = Console(stderr=True)


def _config(target: str, transport: str, scenario: str, digits: str, think: float,
            listen: float, duration: float, workers: int, auth_token: str | None, rate: float,
            ramp_from: int | None, turn_timeout: float, refuse_fraction: float) -> LoadConfig:
    if transport not in ("twilio", "sip"):
        raise GatewayError("--transport must be twilio or sip")
    if scenario not in ("menu", "barge-in", "hangup"):
        raise GatewayError("--scenario must be menu, barge-in or hangup")
    token = auth_token if auth_token is not None else os.environ.get("GATEWAY_TWILIO_AUTH_TOKEN")
    pattern = "rate" if rate > 0 else "ramp" if ramp_from is not None else "concurrency"
    return LoadConfig(target=target, transport=transport, auth_token=token or None,
                      scenario=scenario, digits=[d for d in digits.split(",") if d],
                      think_s=think, listen_s=listen, duration_s=duration, workers=workers,
                      pattern=pattern, rate=rate, ramp_from=ramp_from or 1,
                      turn_timeout_s=turn_timeout, refuse_fraction=refuse_fraction)


def _progress_printer() -> Any:
    """A live status line on a terminal (one line every 5 s when stderr is not a terminal)."""
    last = [0.0]
    interactive = _console.is_terminal

    def show(state: dict[str, Any]) -> None:
        every = 0.5 if interactive else 5.0
        if time.monotonic() - last[0] < every:
            return
        last[0] = time.monotonic()
        p95 = state["ttfa_p95"]
        line = (f"level {state['level']} x{state['concurrency']}  {state['elapsed']:5.1f} s  "
                f"active {state['active']:3d}  done {state['done']:4d}  "
                f"errors {state['errors']:3d}  ttfa p95 "
                f"{'-' if p95 is None else f'{p95:.0f} ms'}  "
                f"sim lateness {state['lateness_ms']:.1f} ms")
        if interactive:
            _console.file.write("\r" + line.ljust(100))
            _console.file.flush()
        else:
            _console.print(line, highlight=False)

    return show


def _finish(document: dict[str, Any], json_out: Path | None, html_out: Path | None) -> None:
    from gateway.loadsim.report import render_report, render_summary_table

    _console.print()
    Console().print(render_summary_table(document))
    lateness = document["meta"]["simulator_lateness_ms"]
    if lateness["p99"] is not None:
        Console().print(f"simulator's own lateness: p50 {lateness['p50']:.2f} ms, "
                        f"p99 {lateness['p99']:.2f} ms, max {lateness['max']:.2f} ms")
    if json_out is not None:
        json_out.write_text(json.dumps(document))
        Console().print(f"samples: {json_out}")
    if html_out is not None:
        render_report(document, html_out)
        Console().print(f"report: {html_out}")


Common = dict[str, Any]

TargetArg = Annotated[str, typer.Argument(
    help="Gateway: http://host:port (Twilio transport) or host:port of its SIP endpoint.")]
TransportOpt = Annotated[str, typer.Option(help="twilio or sip.")]
ScenarioOpt = Annotated[str, typer.Option(help="menu, barge-in or hangup.")]
DigitsOpt = Annotated[str, typer.Option(
    help="Keys per turn, comma-separated (menu scenario), e.g. '1,123456#,3'.")]
ThinkOpt = Annotated[float, typer.Option(help="Seconds after a prompt starts before pressing.")]
ListenOpt = Annotated[float, typer.Option(help="Seconds to listen after the last keys.")]
DurationOpt = Annotated[float, typer.Option(help="Seconds per level.")]
WorkersOpt = Annotated[int, typer.Option(help="Processes sharing the callers (one per core).")]
TokenOpt = Annotated[str | None, typer.Option(
    help="Twilio auth token to sign with [GATEWAY_TWILIO_AUTH_TOKEN].")]
SloOpt = Annotated[str | None, typer.Option(help="e.g. 'ttfa_p95<200ms,gaps=0,errors=0'.")]
JsonOpt = Annotated[Path | None, typer.Option("--json", help="Write every sample here.")]
HtmlOpt = Annotated[Path | None, typer.Option("--html", help="Write the HTML report here.")]
TimeoutOpt = Annotated[float, typer.Option(help="Seconds a turn may wait for audio.")]
RefuseOpt = Annotated[float, typer.Option(
    help="Withhold latency figures when the simulator's p99 lateness exceeds this fraction "
         "of the first-audio p50.")]


@loadsim_app.command("run")
def run(target: TargetArg, concurrency: Annotated[int, typer.Option(help="Callers at once.")] = 10,
        rate: Annotated[float, typer.Option(help="Calls per second (Poisson) instead.")] = 0.0,
        ramp_from: Annotated[int | None, typer.Option(
            help="Ramp from this many callers up to --concurrency over --duration.")] = None,
        transport: TransportOpt = "twilio", scenario: ScenarioOpt = "menu",
        digits: DigitsOpt = "9", think: ThinkOpt = 1.0, listen: ListenOpt = 1.0,
        duration: DurationOpt = 20.0, workers: WorkersOpt = 1, auth_token: TokenOpt = None,
        slo: SloOpt = None, json_out: JsonOpt = None, html_out: HtmlOpt = None,
        turn_timeout: TimeoutOpt = 15.0, refuse_fraction: RefuseOpt = 0.25) -> None:
    """Run one load level and report what callers felt."""
    config = _config(target, transport, scenario, digits, think, listen, duration, workers,
                     auth_token, rate, ramp_from, turn_timeout, refuse_fraction)
    clauses = parse_slo(slo) if slo else None
    started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    t0 = time.monotonic()
    level = run_level(config, concurrency, 0, _progress_printer())
    passed = None
    lines: list[str] = []
    if clauses is not None:
        level.slo_bound_ms = latency_bound(clauses)
        passed, lines = evaluate(clauses, level.summary())
    document = result_document(config, [level], started, time.monotonic() - t0, slo, passed,
                               [passed])
    _finish(document, json_out, html_out)
    for line in lines:
        Console().print(f"SLO {line}")
    if passed is False:
        raise GatewayError(f"SLO missed: {slo}")


@loadsim_app.command("capacity")
def capacity(target: TargetArg, slo: Annotated[str, typer.Option(
                 help="What a level must meet, e.g. 'ttfa_p95<200ms,gaps=0'.")],
             start: Annotated[int, typer.Option(help="First concurrency level.")] = 1,
             max_level: Annotated[int, typer.Option("--max", help="Stop here.")] = 256,
             step: Annotated[str, typer.Option(help="x2 (double) or +N (add N).")] = "x2",
             transport: TransportOpt = "twilio", scenario: ScenarioOpt = "menu",
             digits: DigitsOpt = "9", think: ThinkOpt = 1.0, listen: ListenOpt = 1.0,
             duration: DurationOpt = 15.0, workers: WorkersOpt = 1,
             auth_token: TokenOpt = None, json_out: JsonOpt = None, html_out: HtmlOpt = None,
             turn_timeout: TimeoutOpt = 15.0, refuse_fraction: RefuseOpt = 0.25) -> None:
    """Raise concurrency until the SLO breaks; report the last level that met it."""
    config = _config(target, transport, scenario, digits, think, listen, duration, workers,
                     auth_token, 0.0, None, turn_timeout, refuse_fraction)
    clauses = parse_slo(slo)
    started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    t0 = time.monotonic()
    levels: list[Level] = []
    verdicts: list[bool | None] = []
    best: int | None = None
    concurrency = start
    index = 0
    while concurrency <= max_level:
        level = run_level(config, concurrency, index, _progress_printer())
        level.slo_bound_ms = latency_bound(clauses)
        passed, lines = evaluate(clauses, level.summary())
        levels.append(level)
        verdicts.append(passed)
        _console.print()
        Console().print(f"x{concurrency}: {'met' if passed else 'MISSED'} ({'; '.join(lines)})")
        if not passed:
            break
        best = concurrency
        index += 1
        concurrency = concurrency * 2 if step == "x2" else concurrency + int(step.lstrip("+"))
    document = result_document(config, levels, started, time.monotonic() - t0, slo,
                               best is not None, verdicts)
    document["meta"]["capacity"] = best
    _finish(document, json_out, html_out)
    if best is None:
        raise GatewayError(f"not even {start} concurrent call(s) meet {slo}")
    Console().print(f"capacity: {best} concurrent calls meet {slo}")


@loadsim_app.command("merge")
def merge(files: Annotated[list[Path], typer.Argument(help="Result files (--json outputs).")],
          output: Annotated[Path, typer.Option("-o", "--output", help="Merged result file.")],
          html_out: HtmlOpt = None, slo: SloOpt = None) -> None:
    """Combine result files from several hosts into one (levels by index, concurrency summed)."""
    documents = [json.loads(path.read_text()) for path in files]
    merged: dict[int, Level] = {}
    for document in documents:
        for index, level in enumerate(levels_from_document(document)):
            target = merged.setdefault(index, Level(0, [], []))
            target.concurrency += level.concurrency
            target.calls.extend(level.calls)
            target.lateness_ms.extend(level.lateness_ms)
    config = LoadConfig(target=",".join(d["meta"]["target"] for d in documents),
                        transport=documents[0]["meta"]["transport"],
                        scenario=documents[0]["meta"]["scenario"],
                        workers=sum(d["meta"].get("workers", 1) for d in documents))
    levels = [merged[i] for i in sorted(merged)]
    verdicts: list[bool | None] = [None] * len(levels)
    passed = None
    if slo:
        clauses = parse_slo(slo)
        for lv in levels:
            lv.slo_bound_ms = latency_bound(clauses)
        verdicts = [evaluate(clauses, lv.summary())[0] for lv in levels]
        passed = all(v for v in verdicts)
    document = result_document(config, levels, documents[0]["meta"]["started"],
                               max(d["meta"]["duration_s"] for d in documents), slo, passed,
                               verdicts)
    _finish(document, output, html_out)
    if passed is False:
        raise GatewayError(f"SLO missed: {slo}")
