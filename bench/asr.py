"""Speech menus: accuracy, rejection, digits and CPU of the built-in recogniser, and the end of
speech -> first audio through a real gateway.

    python bench/asr.py              # test half, all line conditions, + the gateway path (~15 min)
    python bench/asr.py --dev        # also the dev half the recogniser was tuned on
    python bench/asr.py --quick      # test half, 2 voices, clean + 20 dB noise, 20 gateway turns
    python bench/asr.py --sweep      # with --dev: accuracy / false accepts per confidence threshold
    python bench/asr.py --no-gateway # the corpus only

The corpus (bench/asr_corpus.py) is synthesised here with flite and espeak-ng and passed
through the 8 kHz G.711 mu-law path. Every utterance is recognised through a RecognizerPool
(worker processes, as the gateway runs it) by the shipped recogniser and by the grammar pass
alone (no rejection), the baseline, in the same run.

Accuracy (per split and line condition):
  in-menu     phrase said -> its branch (wrong branch or no match are both errors)
  FA          out-of-menu sentences accepted as any branch (false accepts)
  near FA     near-miss single words ("building" for billing) accepted
  digits      6-digit strings recognised exactly
  digits FA   sentences accepted as a digit string in a digits gather

RESULT lines report the test half over the target conditions (stress conditions are shown
but left out). The ``ceiling`` line counts the test-half phrases and digit strings that either
pass (the grammar pass alone, or the open pass's words) heard right: what a perfect choice
between the two passes would score, so no rejection rule over them can do better.
CPU is thread CPU time inside the workers; "callers per core" is audio seconds
per CPU second: how many callers, all speaking at once, one core keeps up with (one
recognition per utterance; the gateway recognises each pause of a turn, see the gateway-path
table for recognitions per turn).

The gateway path (bench/asr_gateway.py): a real `gateway serve` (tiny model, the demo script,
its prompt cache) and the load simulator's Twilio callers saying the menu's "repeat" phrases
while the menu plays; end of the caller's speech -> the restarted menu's first frame, against
the same menu turn by key ("9") in the same gateway as the baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from asr_corpus import CONDITIONS, GRAMMARS, Utterance, utterances
from rich.console import Console
from rich.table import Table

from gateway.asr.base import RecognitionResult
from gateway.asr.grammar import Match, match
from gateway.asr.pool import RecognizerPool
from gateway.asr.sphinx import MIN_CONFIDENCE, PocketSphinxRecognizer
from gateway.asr.synth import phone_line, synthesize
from gateway.audio.g711 import ulaw_decode

TARGETS = {"in-menu": 0.95, "FA": 0.05, "digits": 0.90}
#: End of speech -> the recognised branch's first audio (cached prompt), p95, ms.
LATENCY_TARGET_MS = 300.0


def _audio(u: Utterance) -> np.ndarray:
    mu = phone_line(synthesize(u.text, u.voice), level_dbfs=u.condition.level_dbfs,
                    snr_db=u.condition.snr_db, seed=u.seed)
    return ulaw_decode(mu)


async def _run(pool: RecognizerPool, items: list[Utterance], audio: list[np.ndarray],
               progress: Callable[[int], None]) -> list[RecognitionResult]:
    sem = asyncio.Semaphore(pool.workers * 2)
    done = 0

    async def one(i: int) -> RecognitionResult:
        nonlocal done
        async with sem:
            r = await pool.recognize(audio[i], GRAMMARS[items[i].grammar])
        done += 1
        progress(done)
        return r

    return list(await asyncio.gather(*(one(i) for i in range(len(items)))))


def _accepted(r: RecognitionResult, threshold: float) -> bool:
    return r.matched and r.confidence >= threshold


def _answers(u: Utterance, heard: RecognitionResult | Match) -> bool:
    """``heard`` (a result, or a grammar match of a transcript) is ``u``'s right answer."""
    return (heard.digits if u.kind == "digits" else heard.branch) == u.expected


def _correct(u: Utterance, r: RecognitionResult, threshold: float) -> bool:
    return _accepted(r, threshold) and _answers(u, r)


def _rates(pairs: Iterable[tuple[Utterance, RecognitionResult]],
           threshold: float) -> dict[str, tuple[int, int]]:
    """Per metric: (hits, total). in-menu/digits hits are correct; FA hits are accepts."""
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    names = {"in": "in-menu", "out": "FA", "near": "near FA", "digits": "digits",
             "digits_out": "digits FA"}
    for u, r in pairs:
        m = out[names[u.kind]]
        m[1] += 1
        m[0] += _correct(u, r, threshold) if u.kind in ("in", "digits") else _accepted(r,
                                                                                     threshold)
    return {k: (v[0], v[1]) for k, v in out.items()}


def _ceiling(items: list[Utterance], shipped: list[RecognitionResult],
             baseline: list[RecognitionResult]) -> dict[str, tuple[int, int]]:
    """Test-half phrases and digit strings that the grammar pass (the baseline) or the open
    pass (the words the shipped recogniser heard) got right: no rejection rule over these two
    passes can score more, so it bounds what tuning the rule can reach."""
    out = {"in-menu": [0, 0], "digits": [0, 0]}
    for u, r, b in zip(items, shipped, baseline, strict=True):
        if u.split != "test" or u.condition.stress or u.kind not in ("in", "digits"):
            continue
        heard = match(GRAMMARS[u.grammar], r.transcript.split())
        cell = out["digits" if u.kind == "digits" else "in-menu"]
        cell[0] += (heard is not None and _answers(u, heard)) or _correct(u, b, 0.0)
        cell[1] += 1
    return {k: (v[0], v[1]) for k, v in out.items()}


def _fmt(hits_total: tuple[int, int] | None) -> str:
    if hits_total is None or hits_total[1] == 0:
        return "-"
    h, t = hits_total
    return f"{100 * h / t:.1f}% ({h}/{t})"


def _table(title: str, rows: list[tuple[str, dict[str, tuple[int, int]]]]) -> Table:
    table = Table(title=title)
    cols = ["in-menu", "FA", "near FA", "digits", "digits FA"]
    table.add_column("split / condition")
    for c in cols:
        table.add_column(c, justify="right")
    for name, rates in rows:
        table.add_row(name, *(_fmt(rates.get(c)) for c in cols))
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="test half, 2 voices, 2 conditions")
    parser.add_argument("--dev", action="store_true", help="also the dev half")
    parser.add_argument("--sweep", action="store_true", help="threshold sweep on the dev half")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--errors", action="store_true", help="list every error")
    parser.add_argument("--no-gateway", action="store_true", help="skip the gateway path")
    parser.add_argument("--turns", type=int, default=60,
                        help="speech turns (and as many key turns) through the gateway")
    args = parser.parse_args(argv)
    console = Console(width=140)

    items = utterances(("dev", "test") if args.dev and not args.quick else ("test",),
                       quick=args.quick)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(4) as ex:  # synthesisers are subprocesses: threads overlap them
        audio = list(ex.map(_audio, items))
    audio_s = sum(len(a) for a in audio) / 8000
    console.print(f"corpus: {len(items)} utterances, {audio_s:.0f} s of audio, synthesised in "
                  f"{time.perf_counter() - t0:.0f} s")

    async def run_all() -> tuple[list[RecognitionResult], list[RecognitionResult], list[float]]:
        results = {}
        for label, factory in (
            ("shipped", functools.partial(PocketSphinxRecognizer, min_confidence=0.0)),
            ("grammar only", functools.partial(PocketSphinxRecognizer, rejection=False)),
        ):
            pool = RecognizerPool(factory, workers=args.workers, timeout_s=60.0,
                                  max_pending=4 * args.workers)
            await pool.start()
            for g in GRAMMARS.values():
                await pool.prepare(g)
            start = time.perf_counter()

            def progress(n: int, label: str = label, start: float = start) -> None:
                if n % 100 == 0 or n == len(items):
                    console.print(f"  {label}: {n}/{len(items)} "
                                  f"({time.perf_counter() - start:.0f} s)")

            results[label] = await _run(pool, items, audio, progress)
            if label == "shipped":
                # End of speech -> result, one turn at a time (what a caller waits for),
                # including the hop to the worker process.
                latency = []
                for i in range(0, len(items), max(1, len(items) // 60)):
                    t = time.perf_counter()
                    await pool.recognize(audio[i], GRAMMARS[items[i].grammar])
                    latency.append(time.perf_counter() - t)
            await pool.close()
        return results["shipped"], results["grammar only"], latency

    shipped, baseline, latency = asyncio.run(run_all())

    rows = []
    for split in ("dev", "test"):
        for cond in CONDITIONS:
            pairs = [(u, r) for u, r in zip(items, shipped, strict=True)
                     if u.split == split and u.condition == cond]
            if pairs:
                name = f"{split} / {cond.name}" + (" (stress)" if cond.stress else "")
                rows.append((name, _rates(pairs, MIN_CONFIDENCE)))
        target = [(u, r) for u, r in zip(items, shipped, strict=True)
                  if u.split == split and not u.condition.stress]
        if target:
            rows.append((f"{split} / all target conditions", _rates(target, MIN_CONFIDENCE)))
    console.print(_table(f"shipped recogniser (grammar + open pass, min confidence "
                         f"{MIN_CONFIDENCE:g})", rows))
    base_rows = []
    for split in ("dev", "test"):
        target = [(u, r) for u, r in zip(items, baseline, strict=True)
                  if u.split == split and not u.condition.stress]
        if target:
            base_rows.append((f"{split} / all target conditions", _rates(target, 0.0)))
    console.print(_table("baseline: grammar pass alone (no rejection)", base_rows))

    by_voice: dict[str, list[tuple[Utterance, RecognitionResult]]] = defaultdict(list)
    for u, r in zip(items, shipped, strict=True):
        if u.split == "test" and not u.condition.stress:
            by_voice[u.voice.label].append((u, r))
    console.print(_table("test half by voice (target conditions)",
                         [(v, _rates(p, MIN_CONFIDENCE)) for v, p in by_voice.items()]))

    if args.sweep:
        dev = [(u, r) for u, r in zip(items, shipped, strict=True)
               if u.split == "dev" and not u.condition.stress]
        sweep = Table(title="dev half: confidence threshold sweep")
        for c in ("threshold", "in-menu", "FA", "near FA", "digits", "digits FA"):
            sweep.add_column(c, justify="right")
        for th in (0.0, 0.2, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95):
            rates = _rates(dev, th)
            sweep.add_row(f"{th:.2f}", *(_fmt(rates.get(c)) for c in
                                         ("in-menu", "FA", "near FA", "digits", "digits FA")))
        console.print(sweep)

    if args.errors:
        for u, r in zip(items, shipped, strict=True):
            ok = (_correct(u, r, MIN_CONFIDENCE) if u.kind in ("in", "digits")
                  else not _accepted(r, MIN_CONFIDENCE))
            if not ok:
                console.print(f"  {u.split} {u.kind:10s} {u.voice.label:26s} "
                              f"{u.condition.name:11s} {u.text!r:42s} -> {r.status.value} "
                              f"{r.branch or r.digits} ({r.confidence:.2f}) heard "
                              f"{r.transcript!r}", markup=False, highlight=False)

    ceiling = _ceiling(items, shipped, baseline)
    console.print("ceiling, test half (target conditions): an utterance either pass heard right, "
                  "as an oracle choosing between the passes with no false accepts would score: "
                  + ", ".join(f"{k} {_fmt(v)}" for k, v in ceiling.items()),
                  markup=False, highlight=False)

    cpu = sum(r.cpu_s for r in shipped)
    cpu_base = sum(r.cpu_s for r in baseline)
    per_audio = cpu / audio_s
    per_turn = statistics.median(r.cpu_s for r in shipped) * 1000
    console.print(f"CPU: shipped {cpu:.1f} s, grammar pass alone {cpu_base:.1f} s, for "
                  f"{audio_s:.0f} s of audio; per turn p50 {per_turn:.0f} ms")
    lat = sorted(latency)
    p95 = lat[min(len(lat) - 1, round(0.95 * (len(lat) - 1)))]
    console.print(f"end of speech -> result (one turn at a time, via a worker process): "
                  f"p50 {statistics.median(lat) * 1000:.0f} ms, p95 {p95 * 1000:.0f} ms "
                  f"over {len(lat)} turns")

    test = _rates([(u, r) for u, r in zip(items, shipped, strict=True)
                   if u.split == "test" and not u.condition.stress], MIN_CONFIDENCE)

    def pct(key: str) -> float:
        h, t = test[key]
        return 100 * h / t

    met = (pct("in-menu") >= 100 * TARGETS["in-menu"] and pct("FA") <= 100 * TARGETS["FA"]
           and pct("digits") >= 100 * TARGETS["digits"])
    console.print(
        f"RESULT asr accuracy (test half, target conditions): in-menu {pct('in-menu'):.1f}% "
        f"(target >= 95%), false accepts {pct('FA'):.1f}% (target <= 5%), 6-digit exact "
        f"{pct('digits'):.1f}% (target >= 90%), near-miss accepts {pct('near FA'):.1f}%, "
        f"digits-gather false accepts {pct('digits FA'):.1f}%: "
        f"{'targets met' if met else 'TARGETS NOT MET'}", markup=False, highlight=False)
    console.print(
        f"RESULT asr cost: {per_audio:.3f} CPU s per audio s = {1 / per_audio:.1f} speaking "
        f"callers per core; rejection costs {cpu / cpu_base:.2f}x the grammar pass alone",
        markup=False, highlight=False)
    if not args.no_gateway:
        _gateway_path(console, 20 if args.quick else args.turns)
    return 0


def _gateway_path(console: Console, turns: int) -> None:
    from asr_gateway import measure

    console.print(f"gateway path: {turns} speech turns and {turns} key turns through a real "
                  "gateway (starting it; the first run renders the demo's prompts)")
    out = measure(turns)

    def p(values: list[float], q: float) -> float:
        return float(np.percentile(values, q)) if values else float("nan")

    table = Table(title="end of the caller's turn -> first frame of the answer (cached menu)")
    for c in ("turn", "n", "p50 ms", "p95 ms", "max ms"):
        table.add_column(c, justify="right")
    table.add_row("speech (recognised)", str(len(out.speech_ms)), f"{p(out.speech_ms, 50):.0f}",
                  f"{p(out.speech_ms, 95):.0f}", f"{max(out.speech_ms, default=float('nan')):.0f}")
    table.add_row("key 9 (baseline)", str(len(out.key_ms)), f"{p(out.key_ms, 50):.0f}",
                  f"{p(out.key_ms, 95):.0f}", f"{max(out.key_ms, default=float('nan')):.0f}")
    table.add_row("gateway: detector's end of speech -> decision", str(len(out.decision_ms)),
                  f"{p(out.decision_ms, 50):.0f}", f"{p(out.decision_ms, 95):.0f}",
                  f"{max(out.decision_ms, default=float('nan')):.0f}")
    console.print(table)
    recog = out.recognitions
    console.print(f"recognitions per turn: mean {np.mean(recog) if recog else float('nan'):.2f}, "
                  f"max {max(recog, default=0)}; speech turns not recognised as 'repeat': "
                  f"{out.missed} of {out.missed + len(out.speech_ms)}; load average "
                  f"{out.load[0]:.1f} / {out.load[1]:.1f} / {out.load[2]:.1f}")
    for line in out.heard:
        if not line.split(": ", 1)[1].startswith("match menu"):
            console.print(f"  not 'repeat': {line}", markup=False, highlight=False)
    p95, base = p(out.speech_ms, 95), p(out.key_ms, 95)
    met = p95 <= LATENCY_TARGET_MS
    console.print(
        f"RESULT asr gateway path: end of speech -> recognised branch's first audio p95 "
        f"{p95:.1f} ms (target <= {LATENCY_TARGET_MS:.0f} ms: "
        f"{'met' if met else 'NOT MET'}), p50 {p(out.speech_ms, 50):.0f} ms; "
        f"{p95 / base:.1f}x the key turn's p95 {base:.0f} ms in the same gateway; "
        f"{len(out.speech_ms)} recognised of {len(out.speech_ms) + out.missed} speech turns",
        markup=False, highlight=False)


if __name__ == "__main__":
    raise SystemExit(main())
