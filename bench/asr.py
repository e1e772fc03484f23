"""Speech menus: accuracy, rejection, digits and CPU cost of the built-in recogniser.

    python bench/asr.py            # dev + test halves, all line conditions (~10 min, 2 cores)
    python bench/asr.py --quick    # test half, 2 voices, clean + 20 dB noise (~1.5 min)
    python bench/asr.py --sweep    # also: accuracy / false accepts per confidence threshold

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
but left out). CPU is thread CPU time inside the workers; "callers per core" is audio seconds
per CPU second: how many callers, all speaking at once, one core keeps up with.
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

from asr_corpus import CONDITIONS, GRAMMARS, Utterance, utterances  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from gateway.asr.base import RecognitionResult  # noqa: E402
from gateway.asr.pool import RecognizerPool  # noqa: E402
from gateway.asr.sphinx import MIN_CONFIDENCE, PocketSphinxRecognizer  # noqa: E402
from gateway.asr.synth import phone_line, synthesize  # noqa: E402
from gateway.audio.g711 import ulaw_decode  # noqa: E402

TARGETS = {"in-menu": 0.95, "FA": 0.05, "digits": 0.90}


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


def _correct(u: Utterance, r: RecognitionResult, threshold: float) -> bool:
    if not _accepted(r, threshold):
        return False
    return (r.digits if u.kind == "digits" else r.branch) == u.expected


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
    parser.add_argument("--sweep", action="store_true", help="threshold sweep on the dev half")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--errors", action="store_true", help="list every error")
    args = parser.parse_args(argv)
    console = Console(width=140)

    items = utterances(("test",) if args.quick else ("dev", "test"), quick=args.quick)
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

            def progress(n: int, label: str = label) -> None:
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

    cpu = sum(r.cpu_s for r in shipped)
    cpu_base = sum(r.cpu_s for r in baseline)
    per_audio = cpu / audio_s
    console.print(f"CPU: shipped {cpu:.1f} s, grammar pass alone {cpu_base:.1f} s, for "
                  f"{audio_s:.0f} s of audio; per turn p50 {statistics.median(r.cpu_s for r in shipped) * 1000:.0f} ms")
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
