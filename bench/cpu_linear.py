"""The talker's linear layers on the CPU: torch's default (MKL ``sgemm``) against oneDNN over
prepacked weights (:mod:`gateway.tts.cpu_linear`), at the row counts the engines run.

    python bench/cpu_linear.py            # ~1 min on 2 cores
    python bench/cpu_linear.py --layers 4 # fewer distinct layers (less memory, more caching)

One transformer layer of the published 0.6B talker and code predictor is seven products (q
1024->2048, k and v 1024->1024, o 2048->1024, gate and up 1024->3072, down 3072->1024).
``--layers`` distinct copies of it are run in turn so the weights come from memory, as in a
real step (28 talker layers and 5 predictor layers per frame), not from the cache. Rows: 1 (a
slot engine, a batched step of one turn), 8 and 16 (a batched step), 70 (one prompt's prefill)
and 560 (eight prompts prefilled together). Both kernels alternate, medians of ``--rounds``.
It also checks the two agree to 1e-5, and at which shapes a row's result depends on the rows
beside it.
The last line is the gain at 8 rows, the batched step of the issue's benchmark.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from common import print_table

from gateway.tts.cpu_linear import PackedLinear, available

#: (in, out) of one talker / code-predictor layer's seven products (0.6B shapes).
LAYER = ((1024, 2048), (1024, 1024), (1024, 1024), (2048, 1024),
         (1024, 3072), (1024, 3072), (3072, 1024))


def _timed(layers: Sequence[Callable[[torch.Tensor], torch.Tensor]],
           xs: Sequence[torch.Tensor]) -> float:
    t = time.perf_counter()
    for layer, x in zip(layers, xs, strict=True):
        layer(x)
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12, help="distinct layers run in turn")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads (default: torch's, one per core)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not available():
        raise SystemExit("this torch build has no oneDNN linear ops")
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        layers = [torch.nn.Linear(i, o, bias=False) for _ in range(args.layers) for i, o in LAYER]
        for layer in layers:
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=generator) * 0.03)
        packed = [PackedLinear(layer) for layer in layers]
        rows, gains = [], {}
        for m in (1, 8, 16, 70, 560):
            inputs = {i: torch.randn(m, i, generator=generator) for i in {i for i, _ in LAYER}}
            xs = [inputs[layer.in_features] for layer in layers]
            rounds = args.rounds if m <= 70 else max(1, args.rounds // 2)
            _timed(layers, xs), _timed(packed, xs)  # first use of these shapes
            mkl, onednn = [], []
            for _ in range(rounds):
                mkl.append(_timed(layers, xs))
                onednn.append(_timed(packed, xs))
            a, b = statistics.median(mkl) / args.layers, statistics.median(onednn) / args.layers
            gains[m] = a / b
            worst = max(float((p(x) - lay(x)).abs().max() / lay(x).abs().max())
                        for lay, p, x in zip(layers[:7], packed[:7], xs[:7], strict=True))
            rows.append([str(m), f"{1000 * a:.2f}", f"{1000 * b:.2f}", f"{a / b:.2f}x",
                         f"{worst:.1e}"])
        # Does a row's result depend on the rows beside it? Per shape: a lone row against the
        # same row among 2, 8 and 16; and the first two rows among 2 against among 8 and 16.
        alone: dict[str, list[str]] = {"MKL": [], "oneDNN": []}
        shared: dict[str, list[str]] = {"MKL": [], "oneDNN": []}
        for lay, p in zip(layers[:7], packed[:7], strict=True):
            x = torch.randn(16, lay.in_features, generator=generator)
            for name, f in (("MKL", lay), ("oneDNN", p)):
                if all(torch.equal(f(x[:m])[:1], f(x[:1])) for m in (2, 8, 16)):
                    alone[name].append(f"{lay.in_features}x{lay.out_features}")
                if all(torch.equal(f(x[:m])[:2], f(x[:2])) for m in (8, 16)):
                    shared[name].append(f"{lay.in_features}x{lay.out_features}")
    print_table(rows, ["rows", "MKL ms/layer", "oneDNN prepacked ms/layer", "gain",
                       "max relative difference"],
                f"One 0.6B transformer layer's seven products, fp32, {torch.get_num_threads()} "
                f"threads, {args.layers} distinct layers in turn")
    for name in ("MKL", "oneDNN"):
        print(f"{name}: a lone row gets the same bits as among 2-16 rows at "
              f"{len(alone[name])} of 7 shapes ({', '.join(alone[name]) or 'none'}); 2 rows as "
              f"among 8-16 at {len(shared[name])} of 7")
    assert all(float(r[4]) <= 1e-5 for r in rows), "the kernels disagree"
    print(f"RESULT oneDNN prepacked / MKL linear speed at 8 rows = {gains[8]:.2f}x")


if __name__ == "__main__":
    main()
