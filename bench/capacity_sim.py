"""Live callers a gateway holds on a simulated device: a real gateway, real callers, a profile.

    python bench/capacity_sim.py                        # anchor profile, 64 callers, and a sweep
    python bench/capacity_sim.py --quick                # shorter levels
    python bench/capacity_sim.py --profile my.json      # a profile the GPU run measured
    python bench/capacity_sim.py --hold both            # adaptive vs fixed start buffer

Each row starts a real gateway (``gateway serve``, no script: every sentence it says is live)
on a simulated device (``GATEWAY_ENGINE=simulated``: the engine core over a device whose
prefill, step and decode take the profile's times, with synthetic speech) and calls it with
the load simulator's ``live`` scenario over Twilio Media Streams (signed webhook, WebSocket,
real-time G.711 playback on the callers' side, gaps counted where the caller hears them). The
sweep scales the anchor profile so that a 64-row step takes 10, 20, 30 and 40 ms.

Reported per row: calls, failures, gaps heard, first audio p50/p95 after the caller's key, the
device's own time for a first chunk (a prefill, a step at the row count reached, a decode:
from the profile) and what the gateway adds to first-audio p95 beyond it, the event loop's lag
(p99, from ``gateway_event_loop_lag_seconds``) and the engine core's host time per step (mean,
``gateway_tts_step_host_seconds``) and the gateway process's CPU per second of call. Every
figure is from a SIMULATED device: the gateway, the
phone path and the callers are real, the device's times are the profile's.

The last line: first-audio p95 at the anchor profile over the device's own first-chunk time
(the gateway's overhead as a ratio; the issue's target is at most 20 ms added).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table

from gateway.tts.simulated import DeviceProfile, load_profile

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _metrics(base: str) -> str:
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
        return str(response.read().decode())


def _histogram(text: str, name: str) -> tuple[list[tuple[float, float]], float, float]:
    """Cumulative buckets ``[(le, count)]``, the sum and the count of a Prometheus histogram."""
    buckets = [(float("inf") if le == "+Inf" else float(le), float(count))
               for le, count in re.findall(rf'^{name}_bucket{{[^}}]*le="([^"]+)"[^}}]*}} (\S+)$',
                                           text, re.M)]
    total = re.search(rf"^{name}_sum(?:{{[^}}]*}})? (\S+)$", text, re.M)
    count = re.search(rf"^{name}_count(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return buckets, float(total.group(1)) if total else 0.0, float(count.group(1)) if count else 0.0


def _quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """The upper bound of the bucket holding quantile ``q`` (a bound, not an interpolation)."""
    if not buckets or buckets[-1][1] == 0:
        return float("nan")
    target = q * buckets[-1][1]
    return next(le for le, count in buckets if count >= target)


def _total(text: str, name: str, **labels: str) -> float:
    """The sum of a counter's samples whose labels include ``labels``."""
    total = 0.0
    for match in re.finditer(rf"^{name}{{([^}}]*)}} (\S+)$", text, re.M):
        if all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            total += float(match.group(2))
    return total


def run_level(profile: DeviceProfile, callers: int, duration: float, workers: int,
              work: Path, adaptive: bool = True) -> dict[str, float | str]:
    path = work / f"{profile.name.replace(' ', '_')}.json"
    path.write_text(profile.to_json())
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "GATEWAY_ENGINE": "simulated", "GATEWAY_DEVICE_PROFILE": str(path),
           "GATEWAY_MAX_CALLS": "1024", "GATEWAY_BATCH_ROWS": "64",
           "GATEWAY_CACHE_DIR": str(work / "cache"), "GATEWAY_LOG_LEVEL": "warning",
           "GATEWAY_START_BUFFER_ADAPTIVE": "true" if adaptive else "false"}
    gateway = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--insecure",
                                "--host", "127.0.0.1", "--port", str(port)], env=env, cwd=REPO,
                               stdout=subprocess.DEVNULL, stderr=open(work / "gateway.log", "w"))
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{base}/readyz", timeout=2) as response:
                    if json.loads(response.read()).get("status") == "ready":
                        break
            except OSError:
                pass
            if gateway.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not start: {work / 'gateway.log'}")
            time.sleep(0.5)
        before = _metrics(base)
        cpu_before = _cpu_s(gateway.pid)
        out = work / "run.json"
        subprocess.run([sys.executable, "-m", "gateway", "loadsim", "run", base,
                        "--scenario", "live", "--concurrency", str(callers),
                        "--duration", str(duration), "--workers", str(workers),
                        "--json", str(out)], env=env, cwd=REPO, check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        after = _metrics(base)
        cpu = _cpu_s(gateway.pid) - cpu_before
        level = json.loads(out.read_text())["levels"][0]
        lag, _s, _n = _histogram(after, "gateway_event_loop_lag_seconds")
        lag0, _s0, _n0 = _histogram(before, "gateway_event_loop_lag_seconds")
        lag_window = [(le, count - dict(lag0).get(le, 0.0)) for le, count in lag]
        _hb, host_sum, host_n = _histogram(after, "gateway_tts_step_host_seconds")
        _hb0, host_sum0, host_n0 = _histogram(before, "gateway_tts_step_host_seconds")
        rows_b, _rows_sum, _rows_n = _histogram(after, "gateway_tts_batch_size")
        steps = host_n - host_n0
        underruns = "gateway_playout_underruns_total"
        return {
            "calls": level["calls"], "errors": level["errors"], "gaps": level["gaps"],
            "gap_ms": level["gap_ms"], "ttfa_p50": level["ttfa_ms"]["p50"],
            "ttfa_p95": level["ttfa_ms"]["p95"],
            "lag_p99_ms": 1000 * _quantile(lag_window, 0.99),
            "host_ms": 1000 * (host_sum - host_sum0) / steps if steps else float("nan"),
            "rows_p99": _quantile(rows_b, 0.99), "withheld": level.get("withheld") or "",
            # The gateway process's CPU per second of call (every thread: loop, core).
            "cpu_ms_per_call_s": 1000 * cpu / (callers * duration),
            # The gateway's own count of the gaps, by cause (engine: the chunk came late from
            # the engine too; playout: it left the engine in time).
            "gw_engine": _total(after, underruns, cause="engine")
            - _total(before, underruns, cause="engine"),
            "gw_playout": _total(after, underruns, cause="playout")
            - _total(before, underruns, cause="playout"),
        }
    finally:
        gateway.send_signal(signal.SIGTERM)
        try:
            gateway.wait(60)
        except subprocess.TimeoutExpired:
            gateway.kill()


def device_first_chunk_ms(profile: DeviceProfile, rows: int) -> float:
    """What the device itself spends before a turn's first chunk exists: its prefill (a
    40-character sentence), a step at ``rows`` rows, a decode of one frame."""
    tokens = profile.prompt_base_tokens + 40 / profile.chars_per_token
    bucket = next(b for b in (1, 2, 4, 8, 16, 32, 48, 64) if b >= min(rows, 64))
    return profile.prefill_ms(int(tokens)) + profile.step_ms(bucket, 256) + profile.decode_ms(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="h200-0.6b-anchors")
    parser.add_argument("--callers", type=int, default=64)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--sweep", default="10,20,30,40",
                        help="64-row step ms of the scaled profiles ('' for none)")
    parser.add_argument("--quick", action="store_true", help="30 s levels")
    parser.add_argument("--hold", choices=["adaptive", "fixed", "both"], default="adaptive",
                        help="the start buffer: adaptive (the default), fixed "
                        "(GATEWAY_START_BUFFER_ADAPTIVE=false), or both, alternating, per level")
    args = parser.parse_args()
    duration = 30.0 if args.quick else args.duration
    base = load_profile(args.profile)
    variants = [base] + [base.scaled((64, float(ms))) for ms in args.sweep.split(",") if ms]
    rows = []
    anchor: dict[str, float | str] = {}
    with tempfile.TemporaryDirectory(prefix="capacity-sim-") as tmp:
        runs = [(p, a) for n, p in enumerate(variants)
                for a in ((True,) if args.hold == "adaptive" else (False,) if args.hold == "fixed"
                          else ((True, False) if n % 2 else (False, True)))]
        for profile, adaptive in runs:
            result = run_level(profile, args.callers, duration, args.workers, Path(tmp), adaptive)
            if profile is base and (adaptive or args.hold == "fixed"):
                anchor = result
            device = device_first_chunk_ms(profile, int(float(result["rows_p99"]) or 1))
            added = float(result["ttfa_p95"]) - device
            rows.append([profile.name, "adaptive" if adaptive else "fixed",
                         f"{profile.step_ms(64, 512):.1f}", str(args.callers),
                         str(result["calls"]), str(result["errors"]), str(result["gaps"]),
                         f"{float(result['gap_ms']):.0f}",
                         f"{float(result['gw_engine']):.0f}/{float(result['gw_playout']):.0f}",
                         f"{float(result['ttfa_p50']):.0f}",
                         f"{float(result['ttfa_p95']):.0f}", f"{device:.0f}", f"{added:.0f}",
                         f"{float(result['lag_p99_ms']):.1f}", f"{float(result['host_ms']):.2f}",
                         f"{float(result['cpu_ms_per_call_s']):.1f}",
                         "withheld" if result["withheld"] else ""])
    print_table(rows, ["profile (SIMULATED device)", "start hold", "64-row step ms", "callers",
                       "calls", "failed", "gaps", "gap ms", "gw engine/playout", "ttfa p50 ms",
                       "p95 ms", "device ms",
                       "gateway adds ms", "loop lag p99 ms", "host ms/step",
                       "gateway CPU ms/call-s", "note"],
                f"live callers on a simulated device ({args.duration if not args.quick else 30:.0f}"
                " s a level; real gateway, real callers)")
    device = device_first_chunk_ms(base, int(float(anchor["rows_p99"]) or 1))
    print(f"RESULT first-audio p95 / device's own first chunk at {args.callers} live callers "
          f"(SIMULATED {base.name}) = {float(anchor['ttfa_p95']) / device:.2f}x "
          f"({float(anchor['ttfa_p95']) - device:.0f} ms added; gaps {anchor['gaps']})")


if __name__ == "__main__":
    main()
