"""Continuous batching: the batched stepping loop against the slot engine, in one process.

    python bench/batching.py            # full run (~25 min on 2 cores; ~12 GB RAM)
    python bench/batching.py --quick    # ~5 min: 0.6B at 1 and 8 turns, fewer frames

Part 1, generation on the full-size 0.6B architecture (the published config, random weights:
cost depends on the shapes, not the weights; built once into ``--model``), every turn forced to
a fixed number of codec frames, all turns submitted at once: aggregate codec frames generated
per second (talker + code predictor, prompts included) by the batched engine (one step for all
rows) and by today's slot engine (one batch-1 engine and thread per turn over the same
weights), alternating rounds, plus the cost per frame of one turn alone. The codec decode is
the same per-row incremental decode for both; its cost per frame is its own column, and a
batched decode of the rows' chunks is measured against decoding them one by one.

Part 2, the tiny checkpoint through the real scheduler (phone pipeline included): first audio
(submission to the first 20 ms mu-law frame) p50/p95, gaps and audio seconds per wall second
at 1, 2, 4, 8 and 16 concurrent live turns, batched vs slots.

The last line is the batched/slots ratio of aggregate frames per second at 8 turns.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from common import SPEAKERS, TEXTS, pct, print_table, run_callers
from slot_engine import SlotEngine, SlotService, _never

from gateway.tts.batch_sampling import DEFAULT_SAMPLING, kcap_for
from gateway.tts.batched import BatchedQwenEngine, bucket_for, kv_len_for
from gateway.tts.codec_stream import StreamingCodecDecoder
from gateway.tts.engine import SpeechRequest
from gateway.tts.qwen import QwenModel
from gateway.tts.service import SpeechService


@dataclass
class Gen:
    """One generation round: ``turns`` fixed-length turns submitted at once."""

    frames: int
    wall_s: float
    prefill_s: float
    #: Seconds per frame of the frame loop alone (one turn: the per-frame cost).
    loop_s_per_frame: float
    #: CPU seconds the process used (every thread): on a shared machine the kernel shares
    #: cores per thread, so 16 slot threads take more of them than one batched thread; frames
    #: per CPU second compare the engines without that bias.
    cpu_s: float = float("nan")

    @property
    def fps(self) -> float:
        return self.frames / self.wall_s

    @property
    def per_cpu_s(self) -> float:
        return self.frames / self.cpu_s


def request(i: int, frames: int) -> SpeechRequest:
    return SpeechRequest(text=TEXTS[i % len(TEXTS)], speaker=SPEAKERS[i % len(SPEAKERS)],
                         seed=i, max_frames=frames, min_frames=frames)


def gen_batched(engine: BatchedQwenEngine, turns: int, frames: int) -> Gen:
    """All turns admitted at once, prefilled together, then stepped together to the end."""
    c0 = time.process_time()
    t0 = time.perf_counter()
    rows = [engine.open(request(i, frames)) for i in range(turns)]
    # As the loop prefills a burst with nobody playing yet: all of it in one call.
    while prefilling := [row for row in rows if row.prefilling]:
        engine.prefill_rows(prefilling)
    t1 = time.perf_counter()
    steps = 0
    while live := [row for row in rows if row.finished is None]:
        engine.step(live)
        steps += 1
        for row in rows:
            assert row.output is not None
            engine.drop_pending(row)  # the codec is measured on its own
    t2 = time.perf_counter()
    for row in rows:
        engine.close(row)
    return Gen(turns * frames, t2 - t0, t1 - t0, (t2 - t1) / steps, time.process_time() - c0)


def gen_slots(slots: list[SlotEngine], turns: int, frames: int) -> Gen:
    """One thread per turn, each a batch-1 slot engine, as the slot scheduler runs them."""
    timings: list[tuple[float, float]] = []

    def work(engine: SlotEngine, i: int) -> None:
        with torch.inference_mode():
            req = request(i, frames)
            t = time.perf_counter()
            prefill = engine._prefill(req, None)
            p = time.perf_counter()
            for _ in engine._generate_codes(req, prefill, frames, _never):
                pass
            timings.append((p - t, time.perf_counter() - p))

    threads = [threading.Thread(target=work, args=(slots[i], i)) for i in range(turns)]
    c0 = time.process_time()
    t0 = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    prefill = max(t[0] for t in timings)
    return Gen(turns * frames, wall, prefill, statistics.mean(t[1] for t in timings) / frames,
               cpu)


def codec_costs(shared: QwenModel, frames: int, rows: int) -> tuple[float, float, float]:
    """Per-row incremental decode ms/frame over one turn's chunk schedule; then ms per row of
    decoding ``rows`` rows' 8-frame chunks one by one vs in one batched forward."""
    decoder = shared.base.model.speech_tokenizer.model.decoder
    sizes, left = [], frames
    for size in (1, 2, 4):
        sizes.append(min(size, left))
        left -= sizes[-1]
    while left > 0:
        sizes.append(min(8, left))
        left -= sizes[-1]
    codes = torch.randint(0, 2048, (frames, 16))
    with torch.inference_mode():
        stream = StreamingCodecDecoder(decoder)
        stream.decode(codes[:1])
        stream.reset()
        t = time.perf_counter()
        start = 0
        for size in sizes:
            stream.decode(codes[start : start + size])
            start += size
        per_frame = (time.perf_counter() - t) / frames
        chunk = torch.randint(0, 2048, (rows, 16, 8))
        decoder(chunk[:1])
        t = time.perf_counter()
        for r in range(rows):
            decoder(chunk[r : r + 1])
        one_by_one = (time.perf_counter() - t) / rows
        t = time.perf_counter()
        decoder(chunk)
        batched = (time.perf_counter() - t) / rows
    return 1000 * per_frame, 1000 * one_by_one, 1000 * batched


def part_full_size(args: argparse.Namespace) -> float:
    model_dir = Path(args.model).expanduser()
    if not (model_dir / "model.safetensors").exists():
        from gateway.tts.tiny import build_random_checkpoint

        t = time.monotonic()
        build_random_checkpoint(model_dir, size="0.6B")
        print(f"built the random 0.6B checkpoint at {model_dir} in {time.monotonic() - t:.0f} s")
    levels = ([int(x) for x in args.levels.split(",")] if args.levels
              else [1, 8] if args.quick else [1, 8, 16])
    if 1 not in levels or 8 not in levels:
        raise SystemExit("--levels must include 1 and 8")
    frames = args.frames or (8 if args.quick else 24)
    rounds = 1 if args.quick else args.rounds
    t = time.monotonic()
    shared = QwenModel(str(model_dir), device="cpu", cpu_linear=args.cpu_linear)
    batched = BatchedQwenEngine(shared, max_rows=max(levels), max_seq_len=args.max_seq_len)
    slots = [SlotEngine(shared, max_seq_len=args.max_seq_len) for _ in range(max(levels))]
    # First-use costs (lazy cache set-up, mask tables) before anything is timed.
    gen_batched(batched, 1, 2)
    for slot in slots:
        with torch.inference_mode():
            req = request(0, 2)
            for _ in slot._generate_codes(req, slot._prefill(req, None), 2, _never):
                pass
    print(f"0.6B random weights on CPU ({torch.get_num_threads()} threads, talker linears on "
          f"{shared.cpu_linear} kernels, both engines): loaded and warmed in "
          f"{time.monotonic() - t:.0f} s; {frames} frames per turn, {rounds} round(s), "
          f"max_seq_len {args.max_seq_len}")

    results: dict[int, dict[str, list[Gen]]] = {n: {"batched": [], "slots": []} for n in levels}
    for _ in range(rounds):
        for n in levels:
            results[n]["batched"].append(gen_batched(batched, n, frames))
            gc.collect()
            results[n]["slots"].append(gen_slots(slots, n, frames))
            gc.collect()
    codec_ms, one_ms, batch_ms = codec_costs(shared, frames, 8)
    alone_s, together_s = prefill_costs(batched, 8, rounds=1 if args.quick else 3)
    padded_s, exact_s = padding_costs(batched, 5, rounds=2 if args.quick else 4)

    rows, ratios = [], {}
    for n in levels:
        b = statistics.median(g.fps for g in results[n]["batched"])
        s = statistics.median(g.fps for g in results[n]["slots"])
        ratios[n] = b / s
        b_prefill = statistics.median(g.prefill_s for g in results[n]["batched"])
        s_prefill = statistics.median(g.prefill_s for g in results[n]["slots"])
        with_codec_b = 1 / (1 / b + codec_ms / 1000)
        with_codec_s = 1 / (1 / s + codec_ms / 1000)
        # The frame loop alone (prompts done): n rows per step vs n threads' frames.
        steady_b = n / statistics.median(g.loop_s_per_frame for g in results[n]["batched"])
        steady_s = n / statistics.median(g.loop_s_per_frame for g in results[n]["slots"])
        cpu_b = statistics.median(g.per_cpu_s for g in results[n]["batched"])
        cpu_s = statistics.median(g.per_cpu_s for g in results[n]["slots"])
        rows.append([str(n), f"{b:.2f}", f"{s:.2f}", f"{b / s:.2f}x", f"{cpu_b / cpu_s:.2f}x",
                     f"{b_prefill:.2f}", f"{s_prefill:.2f}", f"{steady_b / steady_s:.2f}x",
                     f"{codec_ms:.0f}", f"{with_codec_b:.2f}", f"{with_codec_s:.2f}"])
    print_table(rows, ["turns", "batched frames/s", "slots frames/s", "batched/slots",
                       "per CPU-s", "batched prefill s", "slots prefill s", "frame loop only",
                       "codec ms/frame", "batched fps + codec", "slots fps + codec"],
                "0.6B generation (talker + code predictor, prompts included), all turns at "
                "once, fixed length")
    one_b = statistics.median(g.loop_s_per_frame for g in results[1]["batched"])
    one_s = statistics.median(g.loop_s_per_frame for g in results[1]["slots"])
    print(f"one turn alone, per frame: batched {1000 * one_b:.0f} ms, slots {1000 * one_s:.0f} "
          f"ms -> batched/slots cost {one_b / one_s:.2f}x")
    print(f"codec decode of 8 rows' 8-frame chunks: {one_ms:.0f} ms per row one by one, "
          f"{batch_ms:.0f} ms per row in one batched forward ({one_ms / batch_ms:.2f}x)")
    print(f"prefill of 8 prompts ({sum(len(TEXTS[i % len(TEXTS)]) for i in range(8))} "
          f"characters): {alone_s:.2f} s one by one, {together_s:.2f} s in one forward "
          f"({alone_s / together_s:.2f}x)")
    print(f"one eager step of 5 rows: {1000 * padded_s:.0f} ms run at bucket "
          f"{bucket_for(5, batched._cap)} (padded, as before), {1000 * exact_s:.0f} ms run as 5 "
          f"({padded_s / exact_s:.2f}x)")
    del batched, slots, shared
    gc.collect()
    return ratios[8]


def prefill_costs(engine: BatchedQwenEngine, turns: int, rounds: int) -> tuple[float, float]:
    """Seconds to prefill ``turns`` prompts one by one and in one ``prefill_rows`` call
    (alternating rounds, medians)."""
    alone, together = [], []
    for _ in range(rounds):
        for mode, times in (("alone", alone), ("together", together)):
            rows = [engine.open(request(i, 2)) for i in range(turns)]
            t = time.perf_counter()
            if mode == "alone":
                for row in rows:
                    while row.prefilling:
                        engine.prefill(row)
            else:
                engine.prefill_rows(rows)
            times.append(time.perf_counter() - t)
            for row in rows:
                engine.close(row)
    return statistics.median(alone), statistics.median(together)


def padding_costs(engine: BatchedQwenEngine, live: int, rounds: int) -> tuple[float, float]:
    """Seconds of one eager step body for ``live`` rows run at their batch bucket (the padded
    step the CPU ran before) and at exactly ``live`` rows (alternating rounds, medians).

    It times the step body itself with no row active, as a capture warm-up does: the same
    matrix products and attention over the same positions, committing nothing."""
    bucket = bucket_for(live, engine._cap)
    kv_len = kv_len_for(96, engine.max_seq_len, on_cuda=False)  # a prompt and a few frames
    tk = kcap_for([DEFAULT_SAMPLING.top_k], engine.vocab)
    pk = kcap_for([DEFAULT_SAMPLING.predictor_top_k], engine._pred_vocab)
    padded, exact = [], []
    with torch.inference_mode():
        engine._active.zero_()
        engine._step_body(bucket, kv_len, tk, pk)  # first use of these shapes
        for _ in range(rounds):
            for nb, times in ((bucket, padded), (live, exact)):
                t = time.perf_counter()
                engine._step_body(nb, kv_len, tk, pk)
                times.append(time.perf_counter() - t)
    return statistics.median(padded), statistics.median(exact)


def part_tiny(args: argparse.Namespace) -> None:
    from gateway.tts.qwen import resolve_model

    levels = [1, 2, 4, 8, 16]
    frames = 30 if args.quick else 40
    model = QwenModel(resolve_model("tiny"), device="cpu")
    batched = BatchedQwenEngine(model, max_rows=max(levels))
    batched.warmup()
    slots = [SlotEngine(model) for _ in range(max(levels))]
    for slot in slots:
        slot.warmup()

    async def level(engines: list, n: int) -> tuple[list, float, Any]:  # type: ignore[type-arg]
        service = (SpeechService(engines, first_audio_budget_s=0.2) if engines[0] is batched
                   else SlotService(engines))
        service.start()
        try:
            turns, audio_per_wall = await run_callers(service, n, n if args.quick else 2 * n,
                                                      frames)
            return turns, audio_per_wall, service.stats
        finally:
            service.stop()

    rows = []
    for n in levels:
        for kind, engines in (("batched", [batched]), ("slots", slots[:n])):
            turns, audio_per_wall, stats = asyncio.run(level(engines, n))
            firsts = [1000 * t.first_frame_s for t in turns]
            # What a running row waits between two of its frames (prefills included), and
            # what one prefill chunk costs: the stall a newcomer can impose.
            interval = (f"{1000 * pct(stats.step_interval_s, 50):.0f} / "
                        f"{1000 * pct(stats.step_interval_s, 99):.0f} / "
                        f"{1000 * max(stats.step_interval_s):.0f}"
                        if stats.step_interval_s else "-")
            prefill = (f"{1000 * pct(stats.prefill_s, 50):.1f} / "
                       f"{1000 * max(stats.prefill_s):.1f}" if stats.prefill_s else "-")
            rows.append([str(n), kind, str(len(turns)), f"{pct(firsts, 50):.1f}",
                         f"{pct(firsts, 95):.1f}", str(sum(t.gaps for t in turns)),
                         f"{1000 * sum(t.gap_s for t in turns):.0f}", f"{audio_per_wall:.2f}",
                         interval, prefill])
    print_table(rows, ["live turns", "engine", "turns", "first audio p50 ms", "p95 ms", "gaps",
                       "gap ms", "audio s / wall s", "step interval p50/p99/max ms",
                       "prefill p50/max ms"],
                f"Tiny model through the scheduler ({frames} frames = {0.08 * frames:.1f} s "
                "per turn)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    parser.add_argument("--model", default=str(cache / "qwen3-tts-gateway" / "random-0.6B"),
                        help="full-size 0.6B checkpoint dir (random weights built if missing)")
    parser.add_argument("--quick", action="store_true", help="fewer levels and frames (~5 min)")
    parser.add_argument("--frames", type=int, default=0, help="codec frames per 0.6B turn")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (full run)")
    parser.add_argument("--levels", default="", help="0.6B turn counts, e.g. 1,8 (must hold "
                        "1 and 8; default 1,8,16, --quick 1,8)")
    parser.add_argument("--max-seq-len", type=int, default=None,
                        help="static KV positions per turn, both engines (default: theirs)")
    parser.add_argument("--cpu-linear", choices=("onednn", "mkl"), default="onednn",
                        help="the talker's CPU linear kernels, shared by both engines (default: "
                        "the product's, oneDNN over prepacked weights; mkl: torch's default)")
    parser.add_argument("--skip-tiny", action="store_true")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads (default: torch's, one per core)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    if not args.skip_tiny:
        part_tiny(args)
    ratio = part_full_size(args)
    print(f"RESULT batched/slots frames-per-second at 8 turns = {ratio:.2f}x")


if __name__ == "__main__":
    main()
