"""Speech menus: accuracy, rejection, digits and CPU of both recognisers (PocketSphinx, the
built-in one, and Whisper, the neural one), and the end of speech -> first audio through a
real gateway.

    python bench/asr.py              # test half, both recognisers, + the gateway path (~40 min)
    python bench/asr.py --dev        # also the dev half the recognisers were tuned on
    python bench/asr.py --quick      # test half, 2 voices, clean + 20 dB noise, 20 gateway turns
    python bench/asr.py --sweep      # with --dev: accuracy / false accepts per confidence threshold
    python bench/asr.py --no-gateway # the corpus only
    python bench/asr.py --recognizer whisper   # one of them (pocketsphinx, whisper, both)

The corpus (bench/asr_corpus.py) is synthesised here with flite and espeak-ng and passed
through the 8 kHz G.711 mu-law path. Every utterance is recognised through a RecognizerPool
(worker processes, as the gateway runs it). PocketSphinx runs as shipped and as its grammar
pass alone (no rejection), the baseline; Whisper runs as shipped (its thresholds,
``gateway.asr.whisper.THRESHOLDS``, were chosen on the dev half by replaying
``gateway.asr.whisper.decide`` over each utterance's evidence). ``combined`` is
PocketSphinx first and Whisper only for the turns PocketSphinx did not match (computed from
the two runs: what a gather that combined them would answer, and how many turns would pay for
both; the gateway's ``combined`` recogniser, GATEWAY_ASR's default where Whisper's model is,
does this for menus and gives digit strings to Whisper alone).

Accuracy (per split and line condition):
  in-menu     phrase said -> its branch (wrong branch or no match are both errors)
  FA          out-of-menu sentences accepted as any branch (false accepts)
  noise FA    noise-only turns (hiss, hum, crackle, breathing) accepted as anything
  near FA     near-miss single words ("building" for billing) accepted
  digits      6-digit strings recognised exactly (taken as certain, or read back to the caller
              to confirm: Whisper reads back the strings it is not sure of)
  read back   6-digit strings read back for confirmation (right or wrong)
  wrong       6-digit strings taken as another string without a read-back (what would reach
              the backend wrongly; a wrong string read back is the caller's to refuse)
  digits FA   sentences, and 5- or 7-digit strings, accepted as a digit string in a digits gather

RESULT lines report the test half over the target conditions (stress conditions are shown
but left out). The ``ceiling`` line counts the test-half phrases and digit strings that either
PocketSphinx pass (the grammar pass alone, or the open pass's words) heard right: what a perfect
choice between the two passes would score, so no rejection rule over them can do better.
CPU is CPU time inside the workers (thread time for PocketSphinx, process time for Whisper,
whose CTranslate2 computes in its own threads); "callers per core" is audio seconds
per CPU second: how many callers, all speaking at once, one core keeps up with (one
recognition per utterance; the gateway recognises each pause of a turn, see the gateway-path
table for recognitions per turn).

The gateway path (bench/asr_gateway.py): a real `gateway serve` (tiny model, the demo script,
its prompt cache) with each recogniser, and the load simulator's Twilio callers saying the
menu's "repeat" phrases while the menu plays; end of the caller's speech -> the restarted menu's
first frame, against the same menu turn by key ("9") in the same gateway as the baseline.
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

from asr_corpus import CONDITIONS, GRAMMARS, Utterance, render, utterances
from rich.console import Console
from rich.table import Table

from gateway.asr.base import RecognitionResult
from gateway.asr.grammar import Match, match
from gateway.asr.pool import RecognizerFactory, RecognizerPool
from gateway.asr.sphinx import MIN_CONFIDENCE, PocketSphinxRecognizer

TARGETS = {"in-menu": 0.95, "FA": 0.05, "digits": 0.90, "wrong": 0.01}
#: End of speech -> the recognised branch's first audio (cached prompt), p95, ms.
LATENCY_TARGET_MS = {"pocketsphinx": 300.0, "whisper": 600.0, "combined": 600.0}
COLUMNS = ["in-menu", "FA", "noise FA", "near FA", "digits", "read back", "wrong", "digits FA"]
_NAMES = {"in": "in-menu", "out": "FA", "noise": "noise FA", "near": "near FA",
          "digits": "digits", "digits_out": "digits FA", "digits_len": "digits FA"}


class Thresholds:
    """Confidence floors applied to results recognised with none (phrases, digit strings)."""

    def __init__(self, phrases: float, digits: float) -> None:
        self.phrases, self.digits = phrases, digits

    def accepted(self, r: RecognitionResult) -> bool:
        floor = self.digits if r.digits is not None else self.phrases
        return r.matched and r.confidence >= floor


def _answers(u: Utterance, heard: RecognitionResult | Match) -> bool:
    """``heard`` (a result, or a grammar match of a transcript) is ``u``'s right answer."""
    return (heard.digits if u.kind == "digits" else heard.branch) == u.expected


def _correct(u: Utterance, r: RecognitionResult, th: Thresholds) -> bool:
    return th.accepted(r) and _answers(u, r)


def _rates(pairs: Iterable[tuple[Utterance, RecognitionResult]],
           th: Thresholds) -> dict[str, tuple[int, int]]:
    """Per metric: (hits, total). in-menu/digits hits are correct; wrong counts digit strings
    taken as another string; FA hits are accepts."""
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for u, r in pairs:
        m = out[_NAMES[u.kind]]
        m[1] += 1
        if u.kind in ("in", "digits"):
            m[0] += _correct(u, r, th)
            if u.kind == "digits":
                wrong, read_back = out["wrong"], out["read back"]
                wrong[1] += 1
                wrong[0] += th.accepted(r) and not r.confirm and not _answers(u, r)
                read_back[1] += 1
                read_back[0] += th.accepted(r) and r.confirm
        else:
            m[0] += th.accepted(r)
    return {k: (v[0], v[1]) for k, v in out.items()}


def _ceiling(items: list[Utterance], shipped: list[RecognitionResult],
             baseline: list[RecognitionResult]) -> dict[str, tuple[int, int]]:
    """Test-half phrases and digit strings that the grammar pass (the baseline) or the open
    pass (the words the shipped recogniser heard) got right: no rejection rule over these two
    passes can score more, so it bounds what tuning the rule can reach."""
    out = {"in-menu": [0, 0], "digits": [0, 0]}
    none = Thresholds(0.0, 0.0)
    for u, r, b in zip(items, shipped, baseline, strict=True):
        if u.split != "test" or u.condition.stress or u.kind not in ("in", "digits"):
            continue
        heard = match(GRAMMARS[u.grammar], r.transcript.split())
        cell = out["digits" if u.kind == "digits" else "in-menu"]
        cell[0] += (heard is not None and _answers(u, heard)) or _correct(u, b, none)
        cell[1] += 1
    return {k: (v[0], v[1]) for k, v in out.items()}


def _fmt(hits_total: tuple[int, int] | None) -> str:
    if hits_total is None or hits_total[1] == 0:
        return "-"
    h, t = hits_total
    return f"{100 * h / t:.1f}% ({h}/{t})"


def _table(title: str, rows: list[tuple[str, dict[str, tuple[int, int]]]]) -> Table:
    table = Table(title=title)
    table.add_column("split / condition")
    for c in COLUMNS:
        table.add_column(c, justify="right")
    for name, rates in rows:
        table.add_row(name, *(_fmt(rates.get(c)) for c in COLUMNS))
    return table


def _pct(rates: dict[str, tuple[int, int]], key: str) -> float:
    h, t = rates.get(key, (0, 0))
    return 100 * h / t if t else float("nan")


def _fa(rates: dict[str, tuple[int, int]]) -> tuple[int, int]:
    """Out-of-menu sentences and noise-only turns routed anywhere: the FA target's count."""
    out, noise = rates.get("FA", (0, 0)), rates.get("noise FA", (0, 0))
    return out[0] + noise[0], out[1] + noise[1]


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


def _whisper_factory(threads: int) -> RecognizerFactory:
    from gateway.asr.whisper import WhisperRecognizer

    return functools.partial(WhisperRecognizer, cpu_threads=threads)


def _shipped_thresholds(name: str) -> Thresholds:
    # Whisper applies its own (its results are as the gateway gets them).
    return Thresholds(0.0, 0.0) if name == "whisper" else Thresholds(MIN_CONFIDENCE,
                                                                      MIN_CONFIDENCE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="test half, 2 voices, 2 conditions")
    parser.add_argument("--dev", action="store_true", help="also the dev half")
    parser.add_argument("--sweep", action="store_true", help="threshold sweep on the dev half")
    parser.add_argument("--recognizer", choices=["both", "pocketsphinx", "whisper"],
                        default="both")
    parser.add_argument("--workers", type=int, default=2,
                        help="PocketSphinx worker processes (Whisper: 1 worker, --threads)")
    parser.add_argument("--threads", type=int, default=2, help="Whisper's CPU threads")
    parser.add_argument("--errors", action="store_true", help="list every error")
    parser.add_argument("--no-gateway", action="store_true", help="skip the gateway path")
    parser.add_argument("--turns", type=int, default=60,
                        help="speech turns (and as many key turns) through the gateway")
    args = parser.parse_args(argv)
    console = Console(width=170)

    items = utterances(("dev", "test") if args.dev and not args.quick else ("test",),
                       quick=args.quick)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(4) as ex:  # synthesisers are subprocesses: threads overlap them
        audio = list(ex.map(render, items))
    audio_s = sum(len(a) for a in audio) / 8000
    console.print(f"corpus: {len(items)} utterances, {audio_s:.0f} s of audio, synthesised in "
                  f"{time.perf_counter() - t0:.0f} s")

    runs: list[tuple[str, str, RecognizerFactory, int]] = []
    if args.recognizer in ("both", "pocketsphinx"):
        runs += [("pocketsphinx", "shipped",
                  functools.partial(PocketSphinxRecognizer, min_confidence=0.0), args.workers),
                 ("pocketsphinx", "grammar only",
                  functools.partial(PocketSphinxRecognizer, rejection=False), args.workers)]
    if args.recognizer in ("both", "whisper"):
        runs.append(("whisper", "shipped", _whisper_factory(args.threads), 1))

    async def run_all() -> tuple[dict[tuple[str, str], list[RecognitionResult]],
                                 dict[str, list[float]]]:
        results: dict[tuple[str, str], list[RecognitionResult]] = {}
        latency: dict[str, list[float]] = {}
        for name, label, factory, workers in runs:
            pool = RecognizerPool(factory, workers=workers, timeout_s=60.0,
                                  max_pending=4 * workers)
            await pool.start()
            for g in GRAMMARS.values():
                await pool.prepare(g)
            start = time.perf_counter()

            def progress(n: int, label: str = f"{name} {label}", start: float = start) -> None:
                if n % 200 == 0 or n == len(items):
                    console.print(f"  {label}: {n}/{len(items)} "
                                  f"({time.perf_counter() - start:.0f} s)")

            results[name, label] = await _run(pool, items, audio, progress)
            if label == "shipped":
                # End of speech -> result, one turn at a time (what a caller waits for),
                # including the hop to the worker process.
                lat = []
                for i in range(0, len(items), max(1, len(items) // 60)):
                    t = time.perf_counter()
                    await pool.recognize(audio[i], GRAMMARS[items[i].grammar])
                    lat.append(time.perf_counter() - t)
                latency[name] = lat
            await pool.close()
        return results, latency

    results, latency = asyncio.run(run_all())
    summary: dict[str, dict[str, tuple[int, int]]] = {}
    for name in ("pocketsphinx", "whisper"):
        if (name, "shipped") in results:
            summary[name] = _report(console, args, name, items, results, latency[name],
                                    audio_s)
    if "pocketsphinx" in summary and "whisper" in summary:
        _combined(console, items, results)
    if not args.no_gateway:
        names = [*summary, *(["combined"] if len(summary) == 2 else [])]
        for name in names:
            _gateway_path(console, 20 if args.quick else args.turns, name)
    return 0


def _report(console: Console, args: argparse.Namespace, name: str, items: list[Utterance],
            results: dict[tuple[str, str], list[RecognitionResult]], latency: list[float],
            audio_s: float) -> dict[str, tuple[int, int]]:
    shipped = results[name, "shipped"]
    th = _shipped_thresholds(name)
    rows = []
    for split in ("dev", "test"):
        for cond in CONDITIONS:
            pairs = [(u, r) for u, r in zip(items, shipped, strict=True)
                     if u.split == split and u.condition == cond]
            if pairs:
                label = f"{split} / {cond.name}" + (" (stress)" if cond.stress else "")
                rows.append((label, _rates(pairs, th)))
        target = [(u, r) for u, r in zip(items, shipped, strict=True)
                  if u.split == split and not u.condition.stress]
        if target:
            rows.append((f"{split} / all target conditions", _rates(target, th)))
    console.print(_table(f"{name} (thresholds: phrases {th.phrases:g}, digits {th.digits:g})",
                         rows))
    if name == "pocketsphinx":
        baseline = results[name, "grammar only"]
        base_rows = []
        for split in ("dev", "test"):
            target = [(u, r) for u, r in zip(items, baseline, strict=True)
                      if u.split == split and not u.condition.stress]
            if target:
                base_rows.append((f"{split} / all target conditions",
                                  _rates(target, Thresholds(0.0, 0.0))))
        console.print(_table("baseline: PocketSphinx's grammar pass alone (no rejection)",
                             base_rows))

    by_voice: dict[str, list[tuple[Utterance, RecognitionResult]]] = defaultdict(list)
    for u, r in zip(items, shipped, strict=True):
        if u.split == "test" and not u.condition.stress:
            by_voice[u.who].append((u, r))
    console.print(_table(f"{name}: test half by voice (target conditions)",
                         [(v, _rates(p, th)) for v, p in by_voice.items()]))

    if args.sweep and name == "pocketsphinx":
        dev = [(u, r) for u, r in zip(items, shipped, strict=True)
               if u.split == "dev" and not u.condition.stress]
        sweep = Table(title=f"{name}, dev half: confidence threshold sweep")
        for c in ("threshold", *COLUMNS):
            sweep.add_column(c, justify="right")
        for floor in (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95):
            rates = _rates(dev, Thresholds(floor, floor))
            sweep.add_row(f"{floor:.2f}", *(_fmt(rates.get(c)) for c in COLUMNS))
        console.print(sweep)

    if args.errors:
        for u, r in zip(items, shipped, strict=True):
            ok = (_correct(u, r, th) if u.kind in ("in", "digits") else not th.accepted(r))
            if not ok:
                effects = f" [{u.effects.label}]" if u.effects is not None else ""
                console.print(f"  {name} {u.split} {u.kind:10s} {u.who:28s} "
                              f"{u.condition.name:12s} {u.text!r:42s} -> {r.status.value} "
                              f"{r.branch or r.digits} ({r.confidence:.2f}) heard "
                              f"{r.transcript!r}{effects}", markup=False, highlight=False,
                              soft_wrap=True)

    if name == "pocketsphinx":
        ceiling = _ceiling(items, shipped, results[name, "grammar only"])
        console.print("ceiling, test half (target conditions): an utterance either pass heard "
                      "right, as an oracle choosing between the passes with no false accepts "
                      "would score: " + ", ".join(f"{k} {_fmt(v)}" for k, v in ceiling.items()),
                      markup=False, highlight=False, soft_wrap=True)

    cpu = sum(r.cpu_s for r in shipped)
    per_audio = cpu / audio_s
    per_turn = statistics.median(r.cpu_s for r in shipped) * 1000
    extra = ""
    if name == "pocketsphinx":
        cpu_base = sum(r.cpu_s for r in results[name, "grammar only"])
        extra = f", grammar pass alone {cpu_base:.1f} s"
    console.print(f"{name} CPU: {cpu:.1f} s{extra}, for {audio_s:.0f} s of audio; per turn p50 "
                  f"{per_turn:.0f} ms")
    lat = sorted(latency)
    p95 = lat[min(len(lat) - 1, round(0.95 * (len(lat) - 1)))]
    console.print(f"{name} end of speech -> result (one turn at a time, via a worker process): "
                  f"p50 {statistics.median(lat) * 1000:.0f} ms, p95 {p95 * 1000:.0f} ms "
                  f"over {len(lat)} turns")

    test = _rates([(u, r) for u, r in zip(items, shipped, strict=True)
                   if u.split == "test" and not u.condition.stress], th)
    fa_hits, fa_total = _fa(test)
    fa = 100 * fa_hits / fa_total if fa_total else float("nan")
    met = (_pct(test, "in-menu") >= 100 * TARGETS["in-menu"] and fa <= 100 * TARGETS["FA"]
           and _pct(test, "digits") >= 100 * TARGETS["digits"]
           and _pct(test, "wrong") <= 100 * TARGETS["wrong"])
    console.print(
        f"RESULT asr accuracy {name} (test half, target conditions): in-menu "
        f"{_pct(test, 'in-menu'):.1f}% (target >= 95%), false accepts {fa:.1f}% of out-of-menu "
        f"speech and noise (target <= 5%; noise alone {_pct(test, 'noise FA'):.1f}%), "
        f"6-digit exact {_pct(test, 'digits'):.1f}% (target >= 90%; "
        f"{_pct(test, 'read back'):.1f}% read back to confirm), wrong 6-digit strings "
        f"taken unconfirmed {_pct(test, 'wrong'):.1f}% (target <= 1%), near-miss accepts "
        f"{_pct(test, 'near FA'):.1f}%, digits-gather false accepts "
        f"{_pct(test, 'digits FA'):.1f}%: {'targets met' if met else 'TARGETS NOT MET'}",
        markup=False, highlight=False, soft_wrap=True)
    base = ""
    if name == "pocketsphinx":
        base = f"; rejection costs {cpu / cpu_base:.2f}x the grammar pass alone"
    console.print(
        f"RESULT asr cost {name}: {per_audio:.3f} CPU s per audio s = {1 / per_audio:.1f} "
        f"speaking callers per core{base}", markup=False, highlight=False, soft_wrap=True)
    return test


def _combined(console: Console, items: list[Utterance],
              results: dict[tuple[str, str], list[RecognitionResult]]) -> None:
    """PocketSphinx first; Whisper for the turns PocketSphinx did not take (module doc)."""
    sphinx, whisper = results["pocketsphinx", "shipped"], results["whisper", "shipped"]
    ts, tw = _shipped_thresholds("pocketsphinx"), _shipped_thresholds("whisper")
    pairs, both = [], 0
    for u, s, w in zip(items, sphinx, whisper, strict=True):
        if u.split != "test" or u.condition.stress:
            continue
        if ts.accepted(s):
            pairs.append((u, s))
        else:
            both += 1
            pairs.append((u, w if tw.accepted(w) else s))
    rates = _rates(pairs, Thresholds(0.0, 0.0))
    console.print(_table("combined: PocketSphinx, then Whisper when PocketSphinx did not match "
                         "(test half, target conditions)", [("test", rates)]))
    fa_hits, fa_total = _fa(rates)
    console.print(
        f"RESULT asr combined (test half, target conditions): in-menu "
        f"{_pct(rates, 'in-menu'):.1f}%, false accepts {100 * fa_hits / max(1, fa_total):.1f}%, "
        f"6-digit exact {_pct(rates, 'digits'):.1f}%, wrong 6-digit strings "
        f"{_pct(rates, 'wrong'):.1f}%; {100 * both / max(1, len(pairs)):.0f}% of turns pay for "
        "both recognisers", markup=False, highlight=False, soft_wrap=True)


def _gateway_path(console: Console, turns: int, asr: str) -> None:
    from asr_gateway import measure

    console.print(f"gateway path ({asr}): {turns} speech turns and {turns} key turns through a "
                  "real gateway (starting it; the first run renders the demo's prompts)")
    out = measure(turns, asr=asr)

    def p(values: list[float], q: float) -> float:
        return float(np.percentile(values, q)) if values else float("nan")

    table = Table(title=f"{asr}: end of the caller's turn -> first frame of the answer "
                        "(cached menu)")
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
            console.print(f"  not 'repeat': {line}", markup=False, highlight=False, soft_wrap=True)
    p95, base = p(out.speech_ms, 95), p(out.key_ms, 95)
    target = LATENCY_TARGET_MS[asr]
    met = p95 <= target
    console.print(
        f"RESULT asr gateway path {asr}: end of speech -> recognised branch's first audio p95 "
        f"{p95:.1f} ms (target <= {target:.0f} ms: "
        f"{'met' if met else 'NOT MET'}), p50 {p(out.speech_ms, 50):.0f} ms; "
        f"{p95 / base:.1f}x the key turn's p95 {base:.0f} ms in the same gateway; "
        f"{len(out.speech_ms)} recognised of {len(out.speech_ms) + out.missed} speech turns",
        markup=False, highlight=False, soft_wrap=True)


if __name__ == "__main__":
    raise SystemExit(main())
