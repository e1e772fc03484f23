"""Measure a device profile for the simulated engine: step, prefill and decode times of the real
batched engine, written as the JSON ``GATEWAY_DEVICE_PROFILE`` takes.

    python bench/device_profile.py --device cuda --model /tmp/random-0.6B --out h200-0.6b.json
    python bench/device_profile.py --device cpu --model tiny --out /tmp/cpu-tiny.json  # dry run

The GPU run (``bench/gpu_batching.sh``) runs it as its ``profile`` stage, so every lent GPU
leaves a measured profile behind; ``bench/capacity_sim.py --profile FILE`` then sizes a gateway
on that device. What is measured, with graphs on (captured at warm-up, as the gateway runs):

- the step: one graph replay per batch bucket and attended length (the same kernels whatever
  rows are active), timed over several replays after a synchronising warm-up;
- prefill: batched prompt forwards of 1, 4 and 16 prompts of a fixed length, fitted as a base
  per call plus a cost per prompt token;
- decode: codec graph replays of 1, 4 and 8 frames at 1, 8 and 32 rows, fitted as a base per
  call plus a cost per row-frame.
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch

from gateway.tts.batched import BatchedQwenEngine, batch_buckets
from gateway.tts.engine import SpeechRequest
from gateway.tts.qwen import QwenModel
from gateway.tts.simulated import DeviceProfile


def _timed(fn: object, repeats: int, on_cuda: bool) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` runs (synchronised on CUDA)."""
    samples = []
    for _ in range(repeats):
        if on_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        if on_cuda:
            torch.cuda.synchronize()
        samples.append(1000 * (time.perf_counter() - t0))
    return statistics.median(samples)


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares base and slope of ``ms = base + slope * x`` (both clipped at 0)."""
    x = np.array([p[0] for p in points])
    y = np.array([p[1] for p in points])
    slope, base = np.polyfit(x, y, 1) if len(set(x)) > 1 else (0.0, float(y.mean()))
    return max(0.0, float(base)), max(0.0, float(slope))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--build-random", choices=["0.6B", "1.7B"])
    parser.add_argument("--max-rows", type=int, default=64)
    parser.add_argument("--max-seq-len", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--name", default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.build_random and not (Path(args.model) / "model.safetensors").exists():
        from gateway.tts.tiny import build_random_checkpoint

        build_random_checkpoint(args.model, size=args.build_random, device=args.device)
    shared = QwenModel(args.model, device=args.device)
    engine = BatchedQwenEngine(shared, max_rows=args.max_rows, max_seq_len=args.max_seq_len,
                               cuda_graphs=True, trim_leading_silence=False)
    engine.warmup()
    on_cuda = engine.on_cuda
    hardware = torch.cuda.get_device_name(0) if on_cuda else "CPU (graph stand-in)"
    table: dict[int, dict[int, float]] = {}
    with torch.inference_mode():
        for bucket in batch_buckets(engine._cap):
            for kv_len in engine.kv_lengths():
                graph = engine._replayer(bucket, kv_len, engine._tk, engine._pk)
                table.setdefault(bucket, {})[kv_len] = _timed(graph.replay, args.repeats,
                                                              on_cuda)
        prefill: list[tuple[float, float]] = []
        for count in (1, 4, 16):
            count = min(count, engine.free_rows)
            rows = [engine.open(SpeechRequest(text="Thank you for calling, please hold.",
                                              seed=i)) for i in range(count)]
            tokens = sum(row.prompt_tokens for row in rows)
            t0 = time.perf_counter()
            engine.prefill_rows(rows)
            if on_cuda:
                torch.cuda.synchronize()
            prefill.append((tokens, 1000 * (time.perf_counter() - t0)))
            for row in rows:
                engine.close(row)
        decode: list[tuple[float, float]] = []
        for rows_n in (1, 8, 32):
            bucket = next(b for b in batch_buckets(engine._cap) if b >= min(rows_n, engine._cap))
            for n in (1, 4, 8):
                if engine._codec is None or n > engine._max_chunk:
                    continue
                engine._codec_index[:bucket].fill_(engine._codec.scratch)
                graph = engine._codec_replayer(n, bucket)
                decode.append((bucket * n, _timed(graph.replay, args.repeats, on_cuda)))
    prefill_base, prefill_token = _fit(prefill)
    decode_base, decode_frame = _fit(decode)
    short = hardware.split()[-1].lower() if on_cuda else "cpu-standin"
    name = args.name or f"measured-{short}-{shared.model_size}"
    profile = DeviceProfile(
        name=name, device=f"{hardware} (measured {date.today()})",
        model=f"Qwen3-TTS {shared.model_size} ({shared.model_id}), {engine.graph_mode}",
        source=f"measured by bench/device_profile.py on {hardware}, {date.today()}",
        step_base_ms=0.0, prefill_base_ms=prefill_base, prefill_per_token_ms=prefill_token,
        decode_base_ms=decode_base, decode_per_row_frame_ms=decode_frame,
        max_rows=engine.max_rows, table=table,
        notes={"table": "step ms by batch bucket and attended length: median graph replay",
               "prefill": f"least squares over {prefill} (tokens, ms)",
               "decode": f"least squares over {decode} (row-frames, ms)"},
    )
    args.out.write_text(profile.to_json())
    rows64 = max(table)
    print(f"profile {name}: step at {rows64} rows {table[rows64]} ms; prefill {prefill_base:.2f} "
          f"+ {prefill_token:.4f}/token ms; decode {decode_base:.2f} + {decode_frame:.4f}"
          f"/row-frame ms -> {args.out}")


if __name__ == "__main__":
    main()
