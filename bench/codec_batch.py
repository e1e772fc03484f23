"""Batched codec decode vs one row at a time: milliseconds per row and operations per chunk.

    python bench/codec_batch.py                 # full-size 12 Hz codec, random weights, CPU
    python bench/codec_batch.py --device cuda

Every row due a chunk is decoded either one row at a time (the incremental
``StreamingCodecDecoder``, one per row, as the engine did) or all together in one call
(``BatchedCodecDecoder``), in the same process, alternating rounds. Rows carry a history first
(a few chunks already decoded) so their state is real. Reported per row count and chunk size:
milliseconds per row each way and operator calls (what a GPU launches as kernels, and what a
graph of the call replays) per decoded chunk. The last line is per-row time / batched time at
16 rows of 4-frame chunks.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table

from gateway.tts.codec_batch import BatchedCodecDecoder
from gateway.tts.codec_stream import StreamingCodecDecoder
from gateway.tts.tiny import codec_config


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", default="8,16")
    parser.add_argument("--frames", default="1,4,8")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))

    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import (
        Qwen3TTSTokenizerV2Model,
    )

    torch.manual_seed(0)
    decoder = Qwen3TTSTokenizerV2Model(codec_config(tiny=False)).eval().to(args.device).decoder
    params = sum(p.numel() for p in decoder.parameters()) / 1e6
    table = []
    ratio_16x4 = float("nan")
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            history = torch.randint(0, 2048, (rows, 6, 16), device=args.device)
            singles = [StreamingCodecDecoder(decoder) for _ in range(rows)]
            batched = BatchedCodecDecoder(decoder, slots=rows)
            index = torch.arange(rows, device=args.device)
            for r, single in enumerate(singles):
                single.decode(history[r])
            batched.decode(index, history)
            for n in (int(f) for f in args.frames.split(",")):
                per_row, together = [], []
                for _ in range(args.rounds):
                    codes = torch.randint(0, 2048, (rows, n, 16), device=args.device)
                    _sync(args.device)
                    t0 = time.perf_counter()
                    for r, single in enumerate(singles):
                        single.decode(codes[r])  # ends with its own copy to the host
                    _sync(args.device)
                    per_row.append((time.perf_counter() - t0) / rows)
                    t0 = time.perf_counter()
                    batched.decode(index, codes).float().cpu()  # one copy for every row
                    _sync(args.device)
                    together.append((time.perf_counter() - t0) / rows)
                codes = torch.randint(0, 2048, (rows, n, 16), device=args.device)
                one, all_rows = _Count(), _Count()
                with one:
                    singles[0].decode(codes[0])
                with all_rows:
                    batched.decode(index, codes)
                a, b = 1000 * statistics.median(per_row), 1000 * statistics.median(together)
                # The ratio is taken round by round (the two ways ran back to back, under the
                # same load) and its median reported: a shared machine's load moves between
                # rounds far more than within one.
                ratio = statistics.median(x / y for x, y in zip(per_row, together, strict=True))
                if rows == 16 and n == 4:
                    ratio_16x4 = ratio
                table.append([str(rows), str(n), f"{a:.1f}", f"{b:.1f}", f"{ratio:.2f}",
                              str(one.ops), f"{all_rows.ops / rows:.0f}"])
    print_table(table, ["rows", "frames/chunk", "per-row ms/row", "batched ms/row",
                        "ratio (median of rounds)",
                        "ops per chunk (per row)", "ops per chunk (batched)"],
                f"full-size codec decoder ({params:.0f}M params) on {args.device}, median of "
                f"{args.rounds} rounds")
    print(f"RESULT per-row / batched decode time per row at 16 rows of 4-frame chunks = "
          f"{ratio_16x4:.2f}x")


if __name__ == "__main__":
    main()
