"""Codec decode cost per streamed chunk: 25-frame windowed re-decode vs incremental decode.

    python bench/codec_decode.py              # full-size 12 Hz codec, random weights, CPU
    python bench/codec_decode.py --device cuda

The full-size Qwen3-TTS-Tokenizer-12Hz decoder is built from its published configuration with
random weights (cost depends on the shapes, not the weights). The same codec frames are decoded
chunk by chunk following the engine's default schedule (1, 2, 4, 8, 8, ...) both ways, in the same
process, alternating rounds. The last line is windowed / incremental total decode time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from gateway.tts.codec_stream import StreamingCodecDecoder
from gateway.tts.qwen import CODEC_LEFT_CONTEXT
from gateway.tts.tiny import codec_config


def windowed(decoder: torch.nn.Module, codes: torch.Tensor, sizes: list[int]) -> list[float]:
    times, start = [], 0
    for n in sizes:
        t = time.perf_counter()
        window = codes[max(0, start - CODEC_LEFT_CONTEXT) : start + n]
        decoder(window.T.unsqueeze(0))
        _sync()
        times.append(time.perf_counter() - t)
        start += n
    return times


def incremental(decoder: torch.nn.Module, codes: torch.Tensor, sizes: list[int]) -> list[float]:
    stream = StreamingCodecDecoder(decoder)
    times, start = [], 0
    for n in sizes:
        t = time.perf_counter()
        stream.decode(codes[start : start + n])
        _sync()
        times.append(time.perf_counter() - t)
        start += n
    return times


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--chunks", type=int, default=9, help="chunks per utterance")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import (
        Qwen3TTSTokenizerV2Model,
    )

    torch.manual_seed(0)
    model = Qwen3TTSTokenizerV2Model(codec_config(tiny=False)).eval().to(args.device)
    decoder = model.decoder
    params = sum(p.numel() for p in decoder.parameters()) / 1e6
    sizes = [1, 2, 4] + [8] * (args.chunks - 3)
    codes = torch.randint(0, 2048, (sum(sizes), 16), device=args.device)

    per_round: dict[str, list[list[float]]] = {"windowed": [], "incremental": []}
    with torch.inference_mode():
        incremental(decoder, codes, sizes[:2])  # warm-up
        for _ in range(args.rounds):
            per_round["windowed"].append(windowed(decoder, codes, sizes))
            per_round["incremental"].append(incremental(decoder, codes, sizes))

    def median_chunk(kind: str, i: int) -> float:
        return 1000 * statistics.median(r[i] for r in per_round[kind])

    print(f"full-size codec decoder ({params:.0f}M params) on {args.device}, "
          f"median of {args.rounds} alternating rounds")
    print(f"{'chunk':>5} {'frames':>6} {'window frames':>13} {'windowed ms':>12} "
          f"{'incremental ms':>15} {'ratio':>6}")
    start = 0
    for i, n in enumerate(sizes):
        w, inc = median_chunk("windowed", i), median_chunk("incremental", i)
        window = min(start, CODEC_LEFT_CONTEXT) + n
        print(f"{i + 1:>5} {n:>6} {window:>13} {w:>12.1f} {inc:>15.1f} {w / inc:>6.2f}")
        start += n
    total_w = float(np.median([sum(r) for r in per_round["windowed"]]))
    total_i = float(np.median([sum(r) for r in per_round["incremental"]]))
    audio_s = sum(sizes) * 0.08
    print(f"utterance of {audio_s:.2f} s: windowed {1000 * total_w:.0f} ms, "
          f"incremental {1000 * total_i:.0f} ms of decode")
    print(f"RESULT windowed/incremental decode time = {total_w / total_i:.2f}x")


if __name__ == "__main__":
    main()
