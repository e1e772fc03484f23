"""A slot's attention-mask table: faster-qwen3-tts's per-position build against ours.

    python bench/mask_table.py                  # tiny checkpoint, CPU
    python bench/mask_table.py --device cuda

Every slot engine (``SlotEngine``) precomputes one attention mask per talker position at its
start, at every rebuild after a failure, and when a turn's padding changes. faster-qwen3-tts
builds the table with one ``transformers`` ``create_causal_mask`` call per position;
:func:`gateway.tts.qwen.build_mask_table` builds the same table in one vectorised step (and
checks three positions against the library). The cost depends on the table's size
(``max_seq_len``: 1,024 on a CPU, 2,048 on a GPU) and not on the weights, so the tiny
checkpoint stands in for the full-size model. Both builds run on the same graph, alternating,
three rounds each, with and without a padding mask (a slot's first turn builds it with the
turn's mask, which costs the library 8x more). The last line is library time / ours at the
GPU default size.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from faster_qwen3_tts.talker_graph import TalkerGraph
from slot_engine import SlotEngine, build_mask_table

from gateway.tts.qwen import QwenModel
from gateway.tts.tiny import build_tiny_checkpoint


def _timed(build: object, graph: object, mask: torch.Tensor | None) -> float:
    t = time.perf_counter()
    build(graph, mask)  # type: ignore[operator]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = QwenModel(str(build_tiny_checkpoint(Path(tmp) / "tiny")), device=args.device)
        rows = []
        for size in (1024, 2048):
            graph = SlotEngine(model, max_seq_len=size)._wrapper.talker_graph
            graph._init_cache_layers()
            # A slot's first turn builds the table with the turn's padding mask (all ones when
            # nothing is padded); graph capture builds it without one.
            for padding in (False, True):
                mask = torch.ones(1, size, dtype=torch.long, device=model.device) if padding \
                    else None

                def fail(_: object) -> None:
                    raise AssertionError("fell back to the library")

                def ours(g: object, m: torch.Tensor | None) -> None:
                    build_mask_table(g, m, fallback=fail)

                library, fast = [], []
                for _ in range(args.rounds):
                    library.append(_timed(TalkerGraph._build_attention_masks, graph, mask))
                    fast.append(_timed(ours, graph, mask))
                rows.append((size, padding, statistics.median(library), statistics.median(fast)))
    print(f"{'max_seq_len':>11} | {'padding mask':>12} | {'library (s)':>11} | {'ours (s)':>9} | "
          f"{'ratio':>6}")
    for size, padding, lib, fast in rows:
        print(f"{size:>11} | {'yes' if padding else 'no':>12} | {lib:>11.3f} | {fast:>9.4f} | "
              f"{lib / fast:>5.0f}x")
    total_lib = sum(r[2] for r in rows if r[0] == 2048)
    total_fast = sum(r[3] for r in rows if r[0] == 2048)
    print(f"mask tables at max_seq_len 2048 (with and without padding): library / ours = "
          f"{total_lib / total_fast:.0f}x")


if __name__ == "__main__":
    main()
