"""Media-path benchmark: 24 kHz TTS float32 in -> Twilio ``media`` message JSON strings out.

Run from the repository root::

    python bench/media_path.py [--seconds 10] [--rounds 21] [--seed 0]

Compares, per 20 ms frame delivered:

* **A (ours)**: :class:`gateway.audio.PhonePipeline` (stateful chunk-invariant FIR decimator ->
  int16 -> mu-law -> 160-byte frames) + base64 + the message built from a string template;
* **B (baseline)**: ``scipy.signal.resample_poly(chunk, 1, 3)`` on each TTS chunk -> the same
  G.711 encoder and framer (so only resampling and message building differ) -> base64 ->
  ``json.dumps``.

Both get the same ~10 s speech-like signal (harmonic source with a moving f0, syllable envelope,
fricative noise bursts) in TTS-sized chunks: 1920 samples (one 80 ms Qwen3-TTS codec frame), 3840,
and a random chunking. A and B alternate within each round, and alternate which goes first, so
slow phases of a noisy machine hit both; each cell is the median over rounds.

It also measures each path's chunk-boundary error: the 8 kHz float output of the chunked run
against the same method run on the whole signal, as max |error| in dB relative to the signal RMS,
overall and within +/-2 samples of chunk boundaries. The last line is machine-readable:
``RESULT ratio baseline/ours per-frame cost = X.XXx`` (1920-sample chunks, the TTS's own size).
"""

from __future__ import annotations

import argparse
import base64
import gc
import itertools
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
from scipy import signal

try:
    from gateway.audio import Encoder, Framer, PhonePipeline, decimate_24k_to_8k
    from gateway.audio.g711 import ULAW_SILENCE
    from gateway.audio.resample import Decimator24kTo8k
except ImportError:  # not installed: run from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from gateway.audio import Encoder, Framer, PhonePipeline, decimate_24k_to_8k
    from gateway.audio.g711 import ULAW_SILENCE
    from gateway.audio.resample import Decimator24kTo8k

FS_IN = 24_000
STREAM_SID = "MZ" + "0123456789abcdef" * 2
FloatArray = npt.NDArray[np.float32]


def speech_like(seconds: float, seed: int) -> FloatArray:
    """A deterministic stand-in for TTS speech with energy across the whole 0-12 kHz band."""
    rng = np.random.default_rng(seed)
    n = int(seconds * FS_IN)
    t = np.arange(n) / FS_IN
    f0 = 140 + 35 * np.sin(2 * np.pi * 0.7 * t) + 15 * np.sin(2 * np.pi * 2.3 * t + 1.0)
    phase = 2 * np.pi * np.cumsum(f0) / FS_IN
    voiced = np.zeros(n)
    for k in range(1, int(11_500 / f0.max()) + 1):
        # 1/k source tilt with a crude formant bump near 500 Hz and 1.5 kHz.
        fk = k * 140.0
        weight = (1 / k) * (
            1 + 2 * np.exp(-(((fk - 500) / 200) ** 2)) + np.exp(-(((fk - 1500) / 300) ** 2))
        )
        voiced += weight * np.sin(k * phase + rng.uniform(0, 2 * np.pi))
    syllables = np.clip(np.sin(2 * np.pi * 3.5 * t) + 0.3, 0, None) ** 0.7
    fricative = signal.lfilter([1, -0.95], [1], rng.standard_normal(n))  # pre-emphasised noise
    bursts = (np.sin(2 * np.pi * 1.1 * t + 0.5) > 0.85).astype(np.float64)
    x = voiced * syllables + 0.5 * fricative * bursts + 0.003 * rng.standard_normal(n)
    return (0.7 * x / np.max(np.abs(x))).astype(np.float32)


def chunk_sizes(n: int, kind: str, seed: int) -> list[int]:
    if kind == "random":
        rng = np.random.default_rng(seed + 1)
        sizes: list[int] = []
        while sum(sizes) < n:
            sizes.append(int(rng.integers(1, 4000)))
        sizes[-1] -= sum(sizes) - n
        return sizes
    size = int(kind)
    return [size] * (n // size) + ([n % size] if n % size else [])


def split(x: FloatArray, sizes: Sequence[int]) -> list[FloatArray]:
    bounds = [0, *itertools.accumulate(sizes)]
    return [x[a:b] for a, b in itertools.pairwise(bounds)]


# --- the two media paths ------------------------------------------------------------------------

_PREFIX = '{"event":"media","streamSid":"' + STREAM_SID + '","media":{"payload":"'
_SUFFIX = '"}}'


def path_ours(chunks: Sequence[FloatArray], pipe: PhonePipeline) -> list[str]:
    b64 = base64.b64encode
    prefix, suffix = _PREFIX, _SUFFIX
    out: list[str] = []
    for chunk in chunks:
        for frame in pipe.push(chunk):
            out.append(prefix + b64(frame).decode("ascii") + suffix)
    for frame in pipe.flush():
        out.append(prefix + b64(frame).decode("ascii") + suffix)
    return out


def path_baseline(chunks: Sequence[FloatArray], encoder: Encoder, framer: Framer) -> list[str]:
    b64 = base64.b64encode
    dumps = json.dumps
    out: list[str] = []

    def message(frame: bytes) -> str:
        media = {"payload": b64(frame).decode("ascii")}
        return dumps({"event": "media", "streamSid": STREAM_SID, "media": media})

    for chunk in chunks:
        y = signal.resample_poly(chunk, 1, 3)
        for frame in framer.push(encoder.encode(y)):
            out.append(message(frame))
    for frame in framer.flush():
        out.append(message(frame))
    return out


def resample_only_ours(chunks: Sequence[FloatArray], dec: Decimator24kTo8k) -> int:
    produced = sum(dec.push(chunk).shape[0] for chunk in chunks)
    return produced + dec.flush().shape[0]


def resample_only_baseline(chunks: Sequence[FloatArray]) -> int:
    return sum(signal.resample_poly(chunk, 1, 3).shape[0] for chunk in chunks)


# --- measurement --------------------------------------------------------------------------------


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    gc.collect()
    start = time.perf_counter_ns()
    result = fn()
    return (time.perf_counter_ns() - start) / 1e3, result


@dataclass
class Cell:
    path_us: list[float]
    resample_us: list[float]
    frames: int = 0


def boundary_errors(
    chunked: npt.NDArray[np.floating], whole: npt.NDArray[np.floating], boundaries: Sequence[int]
) -> tuple[float, float, int]:
    """(max |err| dB re RMS, max |err| near boundaries dB re RMS, length difference)."""
    n = min(chunked.shape[0], whole.shape[0])
    err = np.abs(chunked[:n].astype(np.float64) - whole[:n].astype(np.float64))
    rms = float(np.sqrt(np.mean(whole.astype(np.float64) ** 2)))
    near = np.zeros(n, dtype=bool)
    for b in boundaries:
        near[max(0, b - 2) : min(n, b + 3)] = True

    def db(value: float) -> float:
        return float("-inf") if value == 0 else 20 * np.log10(value / rms)

    peak = float(err.max()) if n else 0.0
    peak_near = float(err[near].max()) if near.any() else 0.0
    return db(peak), db(peak_near), int(chunked.shape[0] - whole.shape[0])


def errors_ours(x: FloatArray, chunks: Sequence[FloatArray]) -> tuple[float, float, int]:
    dec = Decimator24kTo8k()
    parts = [dec.push(c) for c in chunks] + [dec.flush()]
    # Where each input chunk boundary falls on the 8 kHz output's time axis (output k = input 3k).
    boundaries = [round(b / 3) for b in np.cumsum([c.shape[0] for c in chunks])[:-1]]
    return boundary_errors(np.concatenate(parts), decimate_24k_to_8k(x), boundaries)


def errors_baseline(x: FloatArray, chunks: Sequence[FloatArray]) -> tuple[float, float, int]:
    parts = [signal.resample_poly(c, 1, 3) for c in chunks]
    boundaries = list(np.cumsum([p.shape[0] for p in parts])[:-1])
    return boundary_errors(np.concatenate(parts), signal.resample_poly(x, 1, 3), boundaries)


def check_outputs(ours: list[str], baseline: list[str]) -> None:
    """Both paths must emit well-formed, equally shaped Twilio media messages of 160 bytes."""
    for msgs in (ours, baseline):
        first = json.loads(msgs[0])
        assert set(first) == {"event", "streamSid", "media"} and first["event"] == "media"
        assert len(base64.b64decode(first["media"]["payload"])) == 160
    assert json.loads(ours[0]).keys() == json.loads(baseline[0]).keys()


def fmt_db(value: float) -> str:
    return "exact (-inf)" if value == float("-inf") else f"{value:7.1f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    x = speech_like(args.seconds, args.seed)
    kinds = ["1920", "3840", "random"]
    plans = {k: split(x, chunk_sizes(x.shape[0], k, args.seed)) for k in kinds}
    cells = {(k, p): Cell([], []) for k in kinds for p in ("A", "B")}

    pipe = PhonePipeline("pcmu")
    encoder, framer, dec = Encoder("pcmu"), Framer(ULAW_SILENCE), Decimator24kTo8k()
    for kind in kinds:  # warm-up: scratch buffers, scipy filter design caches, CPU clocks
        check_outputs(path_ours(plans[kind], pipe), path_baseline(plans[kind], encoder, framer))

    for r in range(args.rounds):
        for kind in kinds:
            chunks = plans[kind]
            runs: list[tuple[str, Callable[[], object], Callable[[], object]]] = [
                (
                    "A",
                    lambda c=chunks: path_ours(c, pipe),
                    lambda c=chunks: resample_only_ours(c, dec),
                ),
                (
                    "B",
                    lambda c=chunks: path_baseline(c, encoder, framer),
                    lambda c=chunks: resample_only_baseline(c),
                ),
            ]
            for name, full, resample in runs if r % 2 == 0 else runs[::-1]:
                cell = cells[(kind, name)]
                elapsed, msgs = timed(full)
                assert isinstance(msgs, list)
                cell.frames = len(msgs)
                cell.path_us.append(elapsed / len(msgs))
                elapsed, _ = timed(resample)
                cell.resample_us.append(elapsed / len(msgs))

    rows = []
    ratios: dict[str, float] = {}
    for kind in kinds:
        err_a = errors_ours(x, plans[kind])
        err_b = errors_baseline(x, plans[kind])
        med = {p: statistics.median(cells[(kind, p)].path_us) for p in ("A", "B")}
        ratios[kind] = med["B"] / med["A"]
        for p, err in (("A", err_a), ("B", err_b)):
            cell = cells[(kind, p)]
            q = statistics.quantiles(cell.path_us, n=10)
            rows.append(
                [
                    kind,
                    "A ours" if p == "A" else "B resample_poly",
                    str(len(plans[kind])),
                    str(cell.frames),
                    f"{med[p]:.2f}",
                    f"{q[0]:.2f}-{q[-1]:.2f}",
                    f"{statistics.median(cell.resample_us):.2f}",
                    fmt_db(err[0]),
                    fmt_db(err[1]),
                    f"{err[2]:+d}",
                    f"{ratios[kind]:.2f}x" if p == "B" else "",
                ]
            )

    headers = [
        "chunking",
        "path",
        "chunks",
        "frames",
        "us/frame (median)",
        "p10-p90",
        "resample us/frame",
        "max err dB re RMS",
        "boundary err dB",
        "len diff",
        "B/A",
    ]
    title = (
        f"Media path cost per 20 ms frame: {args.seconds:g} s speech-like signal, "
        f"{args.rounds} interleaved rounds, Python {platform.python_version()}, "
        f"numpy {np.__version__}"
    )
    print_table(title, headers, rows)
    print(
        "A: PhonePipeline (FIR decimator, chunk-invariant) + base64 + string template; "
        "B: resample_poly per chunk + same encoder/framer + base64 + json.dumps."
    )
    print(
        "Errors compare each path's chunked 8 kHz output with the same method on the whole signal."
    )
    print(f"RESULT ratio baseline/ours per-frame cost = {ratios['1920']:.2f}x")
    return 0


def print_table(title: str, headers: list[str], rows: list[list[str]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
        print(title)
        print("  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)))
        for row in rows:
            print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
        return
    table = Table(title=title)
    for h in headers:
        table.add_column(h, justify="left" if h in ("chunking", "path") else "right")
    for row in rows:
        table.add_row(*row)
    Console(width=200).print(table)


if __name__ == "__main__":
    raise SystemExit(main())
