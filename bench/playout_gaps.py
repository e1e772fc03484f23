"""Gaps callers hear in live speech, with and without the start buffer, through real gateways.

Two ``gateway serve`` processes (tiny model on this CPU, no script: every sentence live, the
load simulator's ``live`` scenario) differ in one setting: ``before`` holds no live utterance
back (``GATEWAY_TWILIO_START_BUFFER_MS=-1`` and ``GATEWAY_SIP_START_BUFFER_MS=-1``, what the
gateway did before the start buffer), ``after`` runs the defaults. Each level (1, 2, 4 and 8
concurrent callers) runs against one and then the other, in alternating order, in this one
process, so both see the same machine.

Per level and gateway it prints what the callers heard (the simulator's playback models:
gaps and their silence, first audio p50/p95 from the caller's turn) beside what the gateway
counted itself: ``gateway_playout_underruns_total`` by cause (``engine``: the chunk that ended
the gap came late from the engine too; ``playout``: it left the engine with lead to spare) and
the engine's own ``gateway_tts_underruns_total``. The simulator's lateness is printed too: a
simulator that runs late stamps frames late and hears gaps that were never sent.

    .venv/bin/python bench/playout_gaps.py                      # 1,2,4,8 callers, 40 s each
    .venv/bin/python bench/playout_gaps.py --quick              # 1,2,4 callers, 15 s each
    .venv/bin/python bench/playout_gaps.py --transport sip --levels 1,2
    .venv/bin/python bench/playout_gaps.py --before-ref main   # before = that commit's code

With ``--before-ref`` the ``before`` gateway runs the code of that git commit (exported to a
temporary directory), not this code with the start buffer off: the comparison then covers
everything that changed in between (the limiter's look-ahead too). A commit without the
gateway's own underrun counters shows ``-`` for them.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VARIANTS = {"before": "-1", "after": None}


def _free_port(kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _Gateway:
    """``gateway serve`` in a subprocess; its log kept for the end of the run."""

    def __init__(self, name: str, start_buffer_ms: str | None, work: Path, rtp: str,
                 source: Path = ROOT) -> None:
        self.name = name
        self.port = _free_port()
        self.sip_port = _free_port(socket.SOCK_DGRAM)
        env = {**os.environ, "GATEWAY_MAX_CALLS": "32", "GATEWAY_DEVICE": "cpu",
               "GATEWAY_SIP": f"127.0.0.1:{self.sip_port}", "GATEWAY_RTP_PORTS": rtp}
        if start_buffer_ms is not None:
            env["GATEWAY_TWILIO_START_BUFFER_MS"] = start_buffer_ms
            env["GATEWAY_SIP_START_BUFFER_MS"] = start_buffer_ms
        self.log = open(work / f"gateway-{name}.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--insecure", "--model", "tiny",
             "--port", str(self.port), "--host", "127.0.0.1"],
            cwd=source, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ready(self, timeout_s: float = 900.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the {self.name} gateway exited ({self.proc.returncode}); "
                                   f"see {self.log.name}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the {self.name} gateway did not become ready")

    def counters(self) -> dict[str, float]:
        """The underrun counters of its /metrics."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            if family.name == "gateway_playout_underruns":
                out["counted"] = 1.0  # this gateway counts the gaps itself
            for sample in family.samples:
                if sample.name == "gateway_tts_underruns_total":
                    out["engine_underruns"] = out.get("engine_underruns", 0.0) + sample.value
                elif sample.name in ("gateway_playout_start_hold_seconds_sum",
                                     "gateway_playout_start_hold_seconds_count"):
                    key = "hold_" + sample.name.rsplit("_", 1)[1]
                    out[key] = out.get(key, 0.0) + sample.value
                elif sample.name in ("gateway_playout_underruns_total",
                                     "gateway_playout_underrun_seconds_total"):
                    kind = "n" if sample.name.endswith("underruns_total") else "s"
                    key = f"playout_{kind}_{sample.labels['cause']}"
                    out[key] = out.get(key, 0.0) + sample.value
        return out

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@dataclass
class Row:
    callers: int
    variant: str
    calls: int
    turns: int
    errors: int
    gaps: int
    gap_ms: float
    ttfa_p50: float | None
    ttfa_p95: float | None
    late_p99: float | None
    gateway: dict[str, float]


def _run(gateway: _Gateway, transport: str, callers: int, duration_s: float,
         index: int) -> Row:
    from gateway.loadsim.runner import LoadConfig, run_level

    target = gateway.url if transport == "twilio" else f"127.0.0.1:{gateway.sip_port}"
    config = LoadConfig(target=target, transport=transport, http=gateway.url, scenario="live",
                        digits=["9"], think_s=1.0, listen_s=1.0, duration_s=duration_s,
                        turn_timeout_s=30.0, seed=index)
    before = gateway.counters()
    level = run_level(config, callers, index)
    after = gateway.counters()
    delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
    delta["counted"] = after.get("counted", 0.0)
    summary = level.summary()
    return Row(callers, gateway.name, summary["calls"], summary["turns"], summary["errors"],
               summary["gaps"], summary["gap_ms"], summary["ttfa_ms"]["p50"],
               summary["ttfa_ms"]["p95"], summary["lateness_ms"]["p99"], delta)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _hold_ms(counters: dict[str, float]) -> float | None:
    """Mean start-buffer hold of the level's live utterances."""
    count = counters.get("hold_count", 0.0)
    return 1000 * counters.get("hold_sum", 0.0) / count if count else None


def _table(rows: list[Row]) -> None:
    head = (f"{'callers':>7} {'gateway':>7} {'calls':>5} {'turns':>5} {'err':>3} "
            f"{'gaps heard':>10} {'silence ms':>10} {'gw: engine':>10} {'gw: playout':>11} "
            f"{'engine urun':>11} {'hold ms':>7} {'ttfa p50':>8} {'ttfa p95':>8} "
            f"{'sim late p99':>12}")
    print(head)
    print("-" * len(head))
    for r in rows:
        g = r.gateway
        engine = playout = "-"
        if g.get("counted"):
            engine = (f"{g.get('playout_n_engine', 0):.0f}/"
                      f"{1000 * g.get('playout_s_engine', 0):.0f}ms")
            playout = (f"{g.get('playout_n_playout', 0):.0f}/"
                       f"{1000 * g.get('playout_s_playout', 0):.0f}ms")
        print(f"{r.callers:>7} {r.variant:>7} {r.calls:>5} {r.turns:>5} {r.errors:>3} "
              f"{r.gaps:>10} {r.gap_ms:>10.0f} {engine:>10} {playout:>11} "
              f"{g.get('engine_underruns', 0):>11.0f} {_ms(_hold_ms(g)):>7} {_ms(r.ttfa_p50):>8} "
              f"{_ms(r.ttfa_p95):>8} {_ms(r.late_p99):>12}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--levels", default="1,2,4,8", help="concurrent callers per level")
    parser.add_argument("--duration", type=float, default=40.0, help="seconds per level")
    parser.add_argument("--transport", default="twilio", choices=["twilio", "sip"])
    parser.add_argument("--quick", action="store_true", help="1,2,4 callers, 15 s each")
    parser.add_argument("--before-ref", default=None,
                        help="run the before gateway from this git commit's code")
    args = parser.parse_args(argv)
    levels = [1, 2, 4] if args.quick else [int(x) for x in args.levels.split(",")]
    duration = 15.0 if args.quick else args.duration
    work = Path(tempfile.mkdtemp(prefix="bench-playout-"))
    sources = {"before": ROOT, "after": ROOT}
    if args.before_ref:
        # ``python -m gateway`` imports the package from its working directory first.
        sources["before"] = work / "before-src"
        sources["before"].mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.before_ref, "gateway"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(sources["before"])], input=archive, check=True)
    gateways = {name: _Gateway(name, value, work, rtp, sources[name])
                for (name, value), rtp in zip(VARIANTS.items(), ["22000-22999", "23000-23999"],
                                              strict=True)}
    rows: list[Row] = []
    started = time.monotonic()
    try:
        for gateway in gateways.values():
            gateway.ready()
        load = os.getloadavg()
        what = (f"before = {args.before_ref}" if args.before_ref
                else "before = this code, start buffer off")
        print(f"{what}; tiny model on CPU ({os.cpu_count()} cores, load {load[0]:.1f}), "
              f"{args.transport}, live scenario (greeting + one key per call), "
              f"{duration:g} s per level; gateway logs in {work}")
        for index, callers in enumerate(levels):
            order = ["before", "after"] if index % 2 == 0 else ["after", "before"]
            for name in order:
                row = _run(gateways[name], args.transport, callers, duration, index)
                rows.append(row)
                print(f"  x{callers} {name}: {row.gaps} gaps ({row.gap_ms:.0f} ms), first audio "
                      f"p50 {_ms(row.ttfa_p50)} ms, p95 {_ms(row.ttfa_p95)} ms", flush=True)
    finally:
        for gateway in gateways.values():
            gateway.stop()
    rows.sort(key=lambda r: (r.callers, r.variant != "before"))
    print()
    _table(rows)
    by: dict[str, dict[int, Row]] = {"before": {}, "after": {}}
    for r in rows:
        by[r.variant][r.callers] = r
    gaps = {v: sum(r.gaps for r in by[v].values()) for v in by}
    silence = {v: sum(r.gap_ms for r in by[v].values()) for v in by}
    playout = {v: (f"{sum(r.gateway.get('playout_n_playout', 0) for r in by[v].values()):.0f}"
                   if all(r.gateway.get("counted") for r in by[v].values()) else "-")
               for v in by}
    holds = [r.gateway for r in by["after"].values()]
    held = sum(g.get("hold_sum", 0.0) for g in holds)
    count = sum(g.get("hold_count", 0.0) for g in holds)
    hold = f"{1000 * held / count:.0f} ms" if count else "n/a"
    ratio = f"{gaps['after'] / gaps['before']:.2f}" if gaps["before"] else "n/a"
    load = os.getloadavg()
    print(f"\n{time.monotonic() - started:.0f} s in all; load average now {load[0]:.1f}")
    print(f"RESULT playout_gaps ({args.transport}, live, {','.join(map(str, levels))} callers): "
          f"gaps heard {gaps['after']} with the start buffer vs {gaps['before']} without "
          f"(ratio {ratio}; silence {silence['after']:.0f} vs {silence['before']:.0f} ms; "
          f"the gateway's own count of gaps whose chunk left the engine on time "
          f"{playout['after']} vs {playout['before']}); the start buffer held live "
          f"utterances {hold} on average (part of their first audio)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
