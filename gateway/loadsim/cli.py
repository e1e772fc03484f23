"""``gateway loadsim``: run simulated callers, search capacity, merge results.

The simulator is an optional extra (``pip install '.[loadsim]'``): this module imports only
what the gateway itself needs, and each command checks for the extra's libraries first.
Exit code 1 when an SLO given with ``--slo`` is missed, so a deployment pipeline can gate on it.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import importlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from gateway.errors import GatewayError
from gateway.loadsim.model import Clause, Level, evaluate, latency_bound, parse_slo
from gateway.loadsim.runner import (
    SCENARIOS,
    LoadConfig,
    budget_warning,
    levels_from_document,
    probe_readyz,
    result_document,
    run_level,
)
from gateway.loadsim.speech import is_speech, speech_frames

loadsim_app = typer.Typer(no_args_is_help=True,
                          help="Call-load simulator: how many callers one gateway holds.")

_console = Console(stderr=True)

#: The libraries of the [loadsim] extra (module name -> distribution).
EXTRA_MODULES = {"jinja2": "jinja2", "matplotlib": "matplotlib"}


def require_extra() -> None:
    """Fail with the install command when the [loadsim] extra is not installed."""
    missing = []
    for module, dist in EXTRA_MODULES.items():
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(dist)
    if missing:
        raise GatewayError(
            "the load simulator is an optional extra and needs "
            f"{', '.join(missing)}: pip install 'qwen3-tts-ivr-gateway[loadsim]' "
            "(in a checkout: pip install -e '.[loadsim]')")


def _config(target: str, transport: str, scenario: str, digits: str, think: float,
            listen: float, duration: float, workers: int, auth_token: str | None, rate: float,
            ramp_from: int | None, turn_timeout: float, withhold_fraction: float,
            backoff: float, http: str | None, greeting: str | None, to: str | None = None,
            caller: str | None = None, jitter: float = 0.5, seed: int = 0,
            bot_port: int = 8765, token_rate: float = 30.0, answer: str | None = None,
            bot_delay: float = 0.0) -> LoadConfig:
    require_extra()
    if transport not in ("twilio", "sip"):
        raise GatewayError("--transport must be twilio or sip")
    if scenario not in SCENARIOS:
        raise GatewayError(f"--scenario must be one of {', '.join(SCENARIOS)}")
    if backoff < 0:
        raise GatewayError("--backoff must be 0 or more seconds")
    if not 0 <= jitter <= 1:
        raise GatewayError("--jitter must be between 0 and 1")
    if scenario == "agent":
        if workers != 1:
            raise GatewayError("--scenario agent runs its bot in the simulator's process, "
                               "beside its callers: --workers 1")
        if token_rate <= 0:
            raise GatewayError("--token-rate must be positive")
    token = auth_token if auth_token is not None else os.environ.get("GATEWAY_TWILIO_AUTH_TOKEN")
    pattern = "rate" if rate > 0 else "ramp" if ramp_from is not None else "concurrency"
    for turn in digits.split(","):
        if is_speech(turn):
            speech_frames(turn)  # a recording that cannot be read stops the run here
    config = LoadConfig(target=target, transport=transport, auth_token=token or None,
                        scenario=scenario, digits=[d for d in digits.split(",") if d],
                        think_s=think, listen_s=listen, duration_s=duration, workers=workers,
                        pattern=pattern, rate=rate, ramp_from=ramp_from or 1,
                        turn_timeout_s=turn_timeout, withhold_fraction=withhold_fraction,
                        backoff_s=backoff, http=http, greeting=greeting, jitter=jitter,
                        seed=seed, bot_port=bot_port, token_rate=token_rate, answer=answer,
                        bot_delay_s=bot_delay)
    if to:
        config.called = to
    if caller:
        config.caller_id = caller
    return config


def progress_line(state: dict[str, Any], width: int) -> str:
    """One status line, cut to ``width - 1`` columns so a terminal never wraps it."""
    p95 = state["ttfa_p95"]
    offered = state.get("offered") or f"×{state['concurrency']}"
    line = (f"{offered} {state['elapsed']:5.1f}s  active {state['active']}  "
            f"placed {state['placed']}  refused {state['refused']}  failed {state['failed']}  "
            f"p95 {'-' if p95 is None else f'{p95:,.0f}ms'}  "
            f"late {state['lateness_ms']:.1f}ms")
    return line[: max(1, width - 1)]


def _progress_printer(console: Console | None = None) -> Callable[[dict[str, Any]], None]:
    """A live status line on a terminal (one line every 5 s when stderr is not a terminal)."""
    console = console or _console
    last = [0.0]
    interactive = console.is_terminal

    def show(state: dict[str, Any]) -> None:
        every = 0.5 if interactive else 5.0
        if time.monotonic() - last[0] < every:
            return
        last[0] = time.monotonic()
        line = progress_line(state, console.width)
        if interactive:
            # Overwrite in place: pad to the line's width, never past the terminal's.
            console.file.write("\r" + line.ljust(console.width - 1))
            console.file.flush()
        else:
            console.print(line, highlight=False, soft_wrap=True)

    return show


def _warn(warnings: list[str], text: str | None) -> None:
    if text and text not in warnings:
        warnings.append(text)
        _console.print(f"[yellow]warning:[/] {text}", highlight=False)


def _speech_check(config: LoadConfig, level: Level) -> str | None:
    """A warning when the gateway's own counters say the turns were not the speech the
    scenario meant to measure (read from /metrics: gateway_turns_total{source})."""
    gateway = level.gateway or {}
    live, cached = gateway.get("turns_live", 0.0), gateway.get("turns_cached", 0.0)
    total = live + cached
    if total <= 0:
        return None
    if config.scenario == "agent":
        return None  # the bot's answers are live, its greeting a cached prompt
    if config.scenario == "live" and cached > 0:
        return (f"x{level.concurrency}: {cached:.0f} of {total:.0f} turns came from the prompt "
                "cache (gateway_turns_total): this gateway runs a script; measure live speech "
                "against a gateway without --script")
    if config.scenario != "live" and live > 0.1 * total:
        return (f"x{level.concurrency}: {live:.0f} of {total:.0f} turns were generated live "
                "(gateway_turns_total): these figures are not cached-speech figures")
    return None


def _refusal_note(levels: list[Level]) -> str | None:
    refused = sum(lv.summary()["refused"] for lv in levels)
    placed = sum(len(lv.calls) for lv in levels)
    if not refused:
        return None
    then = ("each arrival tried once (--rate)" if all(lv.pattern == "rate" for lv in levels)
            else "refused callers redialled after --backoff")
    return (f"{refused} of {placed} placed calls were refused by the gateway (busy): not "
            f"failures, but the offered load is more than it takes; {then}")


def _finish(document: dict[str, Any], json_out: Path | None, html_out: Path | None) -> None:
    from gateway.loadsim.report import render_breakdown, render_report, render_summary_table

    _console.print()
    out = Console()
    out.print(render_summary_table(document))
    breakdown = render_breakdown(document)
    if breakdown is not None:
        out.print(breakdown)
    lateness = document["meta"]["simulator_lateness_ms"]
    if lateness["p99"] is not None:
        out.print(f"simulator's own lateness: p50 {lateness['p50']:.2f} ms, "
                  f"p99 {lateness['p99']:.2f} ms, max {lateness['max']:.2f} ms")
    if json_out is not None:
        json_out.write_text(json.dumps(document))
        out.print(f"samples: {json_out}")
    if html_out is not None:
        render_report(document, html_out)
        out.print(f"report: {html_out}")


TargetArg = Annotated[str, typer.Argument(
    help="Gateway: http://host:port (Twilio transport) or host:port of its SIP endpoint.")]
TransportOpt = Annotated[str, typer.Option(help="twilio or sip.")]
ScenarioOpt = Annotated[str, typer.Option(
    help="menu, barge-in, hangup, live (every turn a live sentence: run it against a "
         "gateway without --script), or agent (a bot node: the simulator is the bot, "
         "streaming --token-rate tokens a second).")]
BotPortOpt = Annotated[int, typer.Option(
    help="agent: the port the simulator's bot listens on (the gateway's bot node's URL).")]
TokenRateOpt = Annotated[float, typer.Option(help="agent: the bot's tokens per second.")]
AnswerOpt = Annotated[str | None, typer.Option(
    help="agent: what the bot answers each turn (default: two sentences, 166 characters).")]
BotDelayOpt = Annotated[float, typer.Option(
    help="agent: seconds from a caller's key to the bot's first token (an LLM's time).")]
DigitsOpt = Annotated[str, typer.Option(
    help="Keys per turn, comma-separated, e.g. '1,123456#,3' (live: one key per turn); "
         "say:FILE.wav says that recording instead (e.g. say:agent.wav,3).")]
ThinkOpt = Annotated[float, typer.Option(help="Seconds after a prompt starts before pressing.")]
ListenOpt = Annotated[float, typer.Option(help="Seconds to listen after the last keys.")]
DurationOpt = Annotated[float, typer.Option(help="Seconds per level.")]
WorkersOpt = Annotated[int, typer.Option(help="Processes sharing the callers (one per core).")]
TokenOpt = Annotated[str | None, typer.Option(
    help="Twilio auth token to sign with [GATEWAY_TWILIO_AUTH_TOKEN].")]
SloOpt = Annotated[str | None, typer.Option(
    help="e.g. 'ttfa_p95<200ms,gaps=0,errors=0,refused=0'.")]
JsonOpt = Annotated[Path | None, typer.Option("--json", help="Write every sample here.")]
HtmlOpt = Annotated[Path | None, typer.Option("--html", help="Write the HTML report here.")]
TimeoutOpt = Annotated[float, typer.Option(help="Seconds a turn may wait for audio.")]
WithholdOpt = Annotated[float, typer.Option(
    help="Withhold latency figures when the simulator's p99 lateness exceeds this fraction "
         "of the first-audio p50 or of the SLO's latency bound (default 200 ms), the larger.")]
BackoffOpt = Annotated[float, typer.Option(
    help="Mean seconds a refused or failed caller waits before dialling again (0.5x-1.5x).")]
HttpOpt = Annotated[str | None, typer.Option(
    help="The gateway's HTTP base URL for /readyz and /metrics (default: a Twilio target).")]
GreetingOpt = Annotated[str | None, typer.Option(
    help="live: the gateway's GATEWAY_GREETING, if not the default (its characters count).")]
ToOpt = Annotated[str | None, typer.Option(
    "--to", help="The number dialled: picks a line of a lines file [+15550009999].")]
FromOpt = Annotated[str | None, typer.Option("--from", help="The callers' number.")]
JitterOpt = Annotated[float, typer.Option(
    help="Spread of think times (x[1-j, 1+j]) and of the callers' first dial, 0-1.")]
SeedOpt = Annotated[int, typer.Option(help="Seed of the callers' timing.")]


def _level(config: LoadConfig, concurrency: int, index: int,
           warnings: list[str]) -> Level:
    _warn(warnings, budget_warning(probe_readyz(config.http_base()), concurrency))
    level = run_level(config, concurrency, index, _progress_printer())
    level.speech = "live" if config.scenario in ("live", "agent") else "cached"
    level.target = config.target
    _console.print()
    _warn(warnings, _speech_check(config, level))
    return level


@loadsim_app.command("run")
def run(target: TargetArg, concurrency: Annotated[int, typer.Option(help="Callers at once.")] = 10,
        rate: Annotated[float, typer.Option(help="Calls per second (Poisson) instead.")] = 0.0,
        ramp_from: Annotated[int | None, typer.Option(
            help="Ramp from this many callers up to --concurrency over --duration.")] = None,
        transport: TransportOpt = "twilio", scenario: ScenarioOpt = "menu",
        digits: DigitsOpt = "9", think: ThinkOpt = 1.0, listen: ListenOpt = 1.0,
        duration: DurationOpt = 20.0, workers: WorkersOpt = 1, auth_token: TokenOpt = None,
        slo: SloOpt = None, json_out: JsonOpt = None, html_out: HtmlOpt = None,
        turn_timeout: TimeoutOpt = 15.0, withhold_fraction: WithholdOpt = 0.25,
        backoff: BackoffOpt = 5.0, http: HttpOpt = None, greeting: GreetingOpt = None,
        to: ToOpt = None, caller: FromOpt = None, jitter: JitterOpt = 0.5,
        seed: SeedOpt = 0, bot_port: BotPortOpt = 8765, token_rate: TokenRateOpt = 30.0,
        answer: AnswerOpt = None, bot_delay: BotDelayOpt = 0.0) -> None:
    """Run one load level and report what callers felt."""
    config = _config(target, transport, scenario, digits, think, listen, duration, workers,
                     auth_token, rate, ramp_from, turn_timeout, withhold_fraction, backoff,
                     http, greeting, to, caller, jitter, seed, bot_port, token_rate, answer,
                     bot_delay)
    clauses = parse_slo(slo) if slo else None
    started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    t0 = time.monotonic()
    warnings: list[str] = []
    level = _level(config, concurrency, 0, warnings)
    _warn(warnings, _refusal_note([level]))
    passed = None
    lines: list[str] = []
    if clauses is not None:
        level.slo_bound_ms = latency_bound(clauses)
        passed, lines = evaluate(clauses, level.summary())
    document = result_document(config, [level], started, time.monotonic() - t0, slo, passed,
                               [passed], warnings)
    _finish(document, json_out, html_out)
    for line in lines:
        Console().print(f"SLO {line}")
    if passed is False:
        raise GatewayError(f"SLO missed: {slo}")


def capacity_clauses(slo: str) -> list[Clause]:
    """The SLO a capacity level must meet: as given, plus ``refused=0`` unless it says how
    many refusals it allows (a level the gateway turns callers away at is not one it holds)."""
    clauses = parse_slo(slo)
    if not any(c.metric in ("refused", "refused_pct") for c in clauses):
        clauses.append(Clause("refused", "=", 0.0))
    return clauses


def search(config: LoadConfig, clauses: list[Clause], start: int, max_level: int, step: str,
           first_index: int, warnings: list[str]
           ) -> tuple[list[Level], list[bool | None], int | None]:
    """Raise concurrency from ``start`` until the SLO breaks; levels, verdicts, the best."""
    levels: list[Level] = []
    verdicts: list[bool | None] = []
    best: int | None = None
    concurrency = start
    while concurrency <= max_level:
        level = _level(config, concurrency, first_index + len(levels), warnings)
        level.slo_bound_ms = latency_bound(clauses)
        passed, lines = evaluate(clauses, level.summary())
        levels.append(level)
        verdicts.append(passed)
        Console().print(f"{level.speech} x{concurrency}: {'met' if passed else 'MISSED'} "
                        f"({'; '.join(lines)})", highlight=False)
        if not passed:
            break
        best = concurrency
        concurrency = concurrency * 2 if step == "x2" else concurrency + int(step.lstrip("+"))
    return levels, verdicts, best


def cost_per_million(hourly_cost: float, characters_per_s: float | None) -> float | None:
    """Dollars per million characters synthesised, for a machine at ``hourly_cost`` $/h."""
    if not characters_per_s:
        return None
    return hourly_cost / 3600.0 / characters_per_s * 1e6


@loadsim_app.command("capacity")
def capacity(target: TargetArg, slo: Annotated[str, typer.Option(
                 help="What a level must meet, e.g. 'ttfa_p95<200ms,gaps=0,errors=0' "
                      "(refused=0 is implied).")],
             start: Annotated[int, typer.Option(help="First concurrency level.")] = 1,
             max_level: Annotated[int, typer.Option("--max", help="Stop here.")] = 256,
             step: Annotated[str, typer.Option(help="x2 (double) or +N (add N).")] = "x2",
             live: Annotated[str | None, typer.Option(
                 "--live", help="Also search live-speech capacity (the live scenario) against "
                                "this gateway (one without --script).")] = None,
             hourly_cost: Annotated[float | None, typer.Option(
                 help="The gateway machine's price in $/hour: report $ per million "
                      "characters at the live capacity.")] = None,
             transport: TransportOpt = "twilio", scenario: ScenarioOpt = "menu",
             digits: DigitsOpt = "9", think: ThinkOpt = 1.0, listen: ListenOpt = 1.0,
             duration: DurationOpt = 15.0, workers: WorkersOpt = 1,
             auth_token: TokenOpt = None, json_out: JsonOpt = None, html_out: HtmlOpt = None,
             turn_timeout: TimeoutOpt = 15.0, withhold_fraction: WithholdOpt = 0.25,
             backoff: BackoffOpt = 5.0, http: HttpOpt = None,
             greeting: GreetingOpt = None, to: ToOpt = None, caller: FromOpt = None,
             jitter: JitterOpt = 0.5, seed: SeedOpt = 0, bot_port: BotPortOpt = 8765,
             token_rate: TokenRateOpt = 30.0, answer: AnswerOpt = None,
             bot_delay: BotDelayOpt = 0.0) -> None:
    """Raise concurrency until the SLO breaks; report the calls per gateway machine that met
    it, for cached speech (TARGET, --scenario) and, with --live, for live speech."""
    if not (step == "x2" or (step.startswith("+") and step[1:].isdigit() and int(step[1:]))):
        raise GatewayError("--step must be x2 or +N")
    config = _config(target, transport, scenario, digits, think, listen, duration, workers,
                     auth_token, 0.0, None, turn_timeout, withhold_fraction, backoff, http,
                     greeting, to, caller, jitter, seed, bot_port, token_rate, answer,
                     bot_delay)
    clauses = capacity_clauses(slo)
    started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    t0 = time.monotonic()
    warnings: list[str] = []
    searches = [config]
    if live is not None and config.scenario != "live":
        searches.append(dataclasses.replace(config, target=live, scenario="live", http=None))
    levels: list[Level] = []
    verdicts: list[bool | None] = []
    results: dict[str, dict[str, Any]] = {}
    for search_config in searches:
        found, passed, best = search(search_config, clauses, start, max_level, step,
                                     len(levels), warnings)
        levels += found
        verdicts += passed
        speech = "live" if search_config.scenario in ("live", "agent") else "cached"
        at_best = next((lv.summary() for lv in found if lv.concurrency == best), None)
        chars = at_best["characters_per_s"] if at_best else None
        results[speech] = {
            "concurrency": best, "target": search_config.target,
            "scenario": search_config.scenario, "characters_per_s": chars,
            "hourly_cost": hourly_cost,
            "cost_per_million_chars": (cost_per_million(hourly_cost, chars)
                                       if hourly_cost is not None else None),
        }
    _warn(warnings, _refusal_note(levels))
    everything_met = all(r["concurrency"] is not None for r in results.values())
    implied = "" if len(clauses) == len(parse_slo(slo)) else ",refused=0"
    document = result_document(config, levels, started, time.monotonic() - t0, slo + implied,
                               everything_met, verdicts, warnings)
    document["meta"]["capacity"] = results
    _finish(document, json_out, html_out)
    out = Console()
    out.print(f"capacity per gateway machine at {slo} (refused=0):", highlight=False)
    for line in capacity_lines(results):
        out.print(f"  {line}", highlight=False)
    missing = [speech for speech, r in results.items() if r["concurrency"] is None]
    if missing:
        raise GatewayError(f"not even {start} concurrent call(s) meet {slo} for "
                           f"{' and '.join(missing)} speech")


def money(value: float) -> str:
    """Dollars as people write them: cents when that is exact, else the digits given."""
    return f"${value:,.2f}" if round(value, 2) == value else f"${value:,.4g}"


def capacity_lines(results: dict[str, dict[str, Any]]) -> list[str]:
    """The capacity report in words: per speech, the calls and where they were measured, then
    the engine's throughput and price at that level."""
    lines = []
    for speech, r in results.items():
        best = r["concurrency"]
        calls = "none" if best is None else f"{best} concurrent call{'s' if best != 1 else ''}"
        lines.append(f"{speech} speech: {calls} ({r['scenario']} → {r['target']})")
        detail = []
        if r["characters_per_s"]:
            detail.append(f"{r['characters_per_s']:,.1f} characters/s synthesised")
        if r["cost_per_million_chars"] is not None:
            detail.append(f"at {money(r['hourly_cost'])}/hour: "
                          f"{money(round(r['cost_per_million_chars'], 2))} per million "
                          "characters")
        if detail:
            lines.append("  " + "; ".join(detail))
    return lines


def _merged_offered(so_far: str | None, level: Level) -> str | None:
    """Hosts' offered loads add up: callers to callers, arrival rates to arrival rates."""
    if level.pattern != "rate" or not (level.offered or "").endswith("/s"):
        return None  # the summed concurrency says it
    rate = float((level.offered or "0/s")[:-2])
    before = float(so_far[:-2]) if so_far and so_far.endswith("/s") else 0.0
    return f"{before + rate:g}/s"


@loadsim_app.command("merge")
def merge(files: Annotated[list[Path], typer.Argument(help="Result files (--json outputs).")],
          output: Annotated[Path, typer.Option("-o", "--output", help="Merged result file.")],
          html_out: HtmlOpt = None, slo: SloOpt = None) -> None:
    """Combine result files from several hosts into one (levels by index, concurrency summed)."""
    require_extra()
    documents = [json.loads(path.read_text()) for path in files]
    merged: dict[int, Level] = {}
    for document in documents:
        for index, level in enumerate(levels_from_document(document)):
            target = merged.setdefault(index, Level(0, [], [], pattern=level.pattern))
            target.concurrency += level.concurrency
            target.calls.extend(level.calls)
            target.lateness_ms.extend(level.lateness_ms)
            # Hosts run side by side: the level lasted as long as the longest of them.
            target.duration_s = max(target.duration_s or 0.0, level.duration_s or 0.0) or None
            target.offered = _merged_offered(target.offered, level)
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
    warnings = [w for d in documents for w in d["meta"].get("warnings", [])]
    document = result_document(config, levels, documents[0]["meta"]["started"],
                               max(d["meta"]["duration_s"] for d in documents), slo, passed,
                               verdicts, warnings)
    _finish(document, output, html_out)
    if passed is False:
        raise GatewayError(f"SLO missed: {slo}")
