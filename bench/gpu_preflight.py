"""Stage 0 of the one-shot GPU run: is everything there, and does the graph path start?

    python bench/gpu_preflight.py --device cuda        # on the lent GPU (bench/gpu_batching.sh)
    python bench/gpu_preflight.py --device cpu         # DRY_RUN: the same, through the stand-in

In order, each step printed as it passes, the first failure ending the run with one line that
says what failed (exit 1):

1. versions: Python, torch and its CUDA, transformers, qwen-tts, faster-qwen3-tts; the GPU and
   its driver (nvidia-smi), or, on the CPU, the capture stand-in;
2. imports of everything the later stages load (qwen_tts and its audio stack, the gateway's
   engine, service and phone path);
3. the tiny checkpoint on the device with graphs on: build, load, warm-up (every step and
   codec graph captured), ten batched steps of two rows with their batched codec decodes, audio
   of the right length and finite, nothing captured after warm-up.

It finishes well within 60 s on a GPU (the tiny model) and in seconds more on the CPU.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T0 = time.monotonic()


def step(message: str) -> None:
    print(f"preflight [{time.monotonic() - T0:5.1f} s] {message}", flush=True)


def fail(message: str) -> None:
    print(f"preflight FAILED [{time.monotonic() - T0:5.1f} s]: {message}", flush=True)
    sys.exit(1)


def versions(device: str) -> None:
    import torch

    parts = [f"python {platform.python_version()}", f"torch {torch.__version__} (CUDA "
             f"{torch.version.cuda})"]
    for name, dist in (("transformers", "transformers"), ("qwen_tts", "qwen-tts"),
                       ("faster_qwen3_tts", "faster-qwen3-tts"), ("numpy", "numpy")):
        try:
            importlib.import_module(name)
        except Exception as exc:
            fail(f"cannot import {name}: {type(exc).__name__}: {exc}")
        try:
            parts.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            parts.append(f"{dist} (no metadata)")
    step("versions: " + ", ".join(parts))
    if device.startswith("cuda"):
        from gateway.tts.device import cuda_unavailable_reason

        reason = cuda_unavailable_reason()
        if reason is not None:
            fail(reason)
        smi = shutil.which("nvidia-smi")
        if smi:
            out = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version",
                                  "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=20)
            step(f"gpu: {out.stdout.strip() or out.stderr.strip()}")
        else:
            step(f"gpu: {torch.cuda.get_device_name(0)} (no nvidia-smi)")
    else:
        step("device: cpu (dry run: graph mode through the capture stand-in)")


def imports() -> None:
    for name in ("soundfile", "librosa", "scipy.signal", "gateway.tts.batched",
                 "gateway.tts.service", "gateway.tts.graphs", "gateway.tts.tiny",
                 "gateway.audio.framer", "gateway.metrics"):
        try:
            importlib.import_module(name)
        except Exception as exc:
            fail(f"cannot import {name}: {type(exc).__name__}: {exc} (carry its wheel: "
                 "bench/gpu_wheels.sh)")
    step("imports: the engine, the phone path and qwen-tts's audio stack")


def tiny_graphs(device: str, workdir: Path) -> None:
    import numpy as np
    import torch

    from gateway.tts.batched import BatchedQwenEngine
    from gateway.tts.engine import SAMPLES_PER_FRAME, SpeechRequest
    from gateway.tts.qwen import QwenModel
    from gateway.tts.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint(workdir / "tiny")
    shared = QwenModel(str(path), device=device, dtype="float32")
    step(f"tiny checkpoint built and loaded on {shared.device}")
    engine = BatchedQwenEngine(shared, max_rows=4, max_seq_len=256, cuda_graphs=True)
    engine.warmup()
    if engine.captures == 0 or len(engine._graphs) != engine.captures:
        fail(f"warm-up captured {engine.captures} graphs")
    captured = engine.captures
    step(f"warm-up: {engine.captures} graphs captured in {engine.capture_s:.2f} s "
         f"({engine.graph_mode})")
    rows = [engine.open(SpeechRequest(text=text, seed=i, max_frames=10, min_frames=10))
            for i, text in enumerate(["Press one for billing.", "Please hold."])]
    engine.prefill_rows(rows)
    t = time.perf_counter()
    audio: list[np.ndarray] = []
    for _ in range(10):
        engine.step(rows)
        # Every due chunk of both rows in one batched decode (a codec graph replayed).
        audio += [a for a in engine.next_chunks(rows) if a is not None]
    if engine.on_cuda:
        torch.cuda.synchronize()
    per_step = (time.perf_counter() - t) / 10
    samples = sum(len(a) for a in audio)
    if samples != 2 * 10 * SAMPLES_PER_FRAME:
        fail(f"ten steps of two rows decoded {samples} samples, not {20 * SAMPLES_PER_FRAME}")
    if not all(np.isfinite(a).all() for a in audio):
        fail("the decoded audio is not finite")
    if engine.captures != captured:
        fail("a graph was captured after warm-up")
    for row in rows:
        engine.close(row)
    step(f"ten batched steps of 2 rows with their decodes ({1000 * per_step:.2f} ms a step, "
         f"{samples} samples): ok")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    versions(args.device)
    imports()
    with tempfile.TemporaryDirectory(prefix="preflight-") as tmp:
        tiny_graphs(args.device, Path(tmp))
    step("all checks passed")


if __name__ == "__main__":
    main()
