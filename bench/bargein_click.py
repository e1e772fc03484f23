"""Barge-in click benchmark: what the caller hears where a prompt is cut, before and after the fade.

Run from the repository root::

    python bench/bargein_click.py [--cuts 400] [--seed 0]

A speech-like prompt (``bench/media_path.py``'s generator) goes through the call's phone path
(conditioning, 8 kHz, mu-law, 20 ms frames) and is cut by a barge-in at ``--cuts`` random
frames. For each cut, two streams as the caller's phone decodes them:

* **before**: the prompt ends at the frame boundary, silence follows (the old behaviour);
* **after**: the next frame is sent faded out by :func:`gateway.audio.condition.fade_out_frame`
  (what the RTP playout sends on a barge-in), then silence.

Two figures per cut, both relative to the uninterrupted prompt at the same place (ratios, so
neither the machine nor the loudness matters):

* **step**: the sample-to-sample step at the cut, over the RMS step of the prompt within 10 ms
  of it (about 1: the waveform goes on as it was; a cut to silence steps by the whole sample);
* **splatter**: energy above 3 kHz in a 10 ms Hann window centred on the cut, over the same in
  the uninterrupted prompt (a click adds broadband energy; above 1 is energy the prompt did not
  have).

The last line: ``RESULT ratio before/after mean step at the cut = X.XXx``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

try:
    from gateway.audio.condition import Conditioning, fade_out_frame
    from gateway.audio.framer import PhonePipeline
    from gateway.audio.g711 import ulaw_decode
except ImportError:  # not installed: run from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from gateway.audio.condition import Conditioning, fade_out_frame
    from gateway.audio.framer import PhonePipeline
    from gateway.audio.g711 import ulaw_decode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from media_path import speech_like

FRAME = 160


def band_energy(x: np.ndarray, low_hz: float = 3000.0) -> float:
    window = np.hanning(len(x))
    spectrum = np.abs(np.fft.rfft(x * window)) ** 2
    freqs = np.fft.rfftfreq(len(x), 1 / 8000)
    return float(spectrum[freqs >= low_hz].sum())


def measure(heard: np.ndarray, prompt: np.ndarray, cut: int) -> tuple[float, float]:
    own_step = np.sqrt(np.mean(np.diff(prompt[cut - 80:cut + 80]) ** 2))
    step = abs(heard[cut] - heard[cut - 1]) / own_step
    splatter = band_energy(heard[cut - 40:cut + 40]) / band_energy(prompt[cut - 40:cut + 40])
    return float(step), float(splatter)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cuts", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    pipeline = PhonePipeline("pcmu", conditioner=Conditioning().new())
    audio = speech_like(12.0, args.seed)
    frames = pipeline.push(audio) + pipeline.flush()
    prompt = ulaw_decode(b"".join(frames)).astype(np.float64)
    level = np.sqrt(np.mean(prompt ** 2))

    rng = np.random.default_rng(args.seed + 1)
    silence = bytes([0xFF]) * FRAME
    before: list[tuple[float, float]] = []
    after: list[tuple[float, float]] = []
    candidates = [i for i in range(10, len(frames) - 12)
                  if np.sqrt(np.mean(prompt[i * FRAME - 80:i * FRAME + 80] ** 2)) > 0.1 * level]
    for index in rng.choice(candidates, size=args.cuts):
        heard = frames[:index]
        cut = index * FRAME
        hard = ulaw_decode(b"".join([*heard, silence, silence])).astype(np.float64)
        soft = ulaw_decode(b"".join([*heard, fade_out_frame(frames[index], "pcmu"), silence])
                           ).astype(np.float64)
        before.append(measure(hard, prompt, cut))
        after.append(measure(soft, prompt, cut))

    b, a = np.array(before), np.array(after)
    print(f"barge-in cut in a speech-like prompt, {args.cuts} random cuts where it is audible "
          "(mu-law, 8 kHz)")
    print(f"{'':24}{'step mean':>11}{'step p95':>10}{'splatter mean':>15}{'splatter p95':>14}")
    for name, m in (("before (cut to silence)", b), ("after (20 ms fade-out)", a)):
        print(f"{name:24}{m[:, 0].mean():11.2f}{np.percentile(m[:, 0], 95):10.2f}"
              f"{m[:, 1].mean():15.3f}{np.percentile(m[:, 1], 95):14.3f}")
    print(f"RESULT ratio before/after mean step at the cut = {b[:, 0].mean() / a[:, 0].mean():.2f}x"
          f" (splatter {b[:, 1].mean() / a[:, 1].mean():.1f}x)")


if __name__ == "__main__":
    main()
