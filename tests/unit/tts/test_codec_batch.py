"""Batched codec decode (gateway/tts/codec_batch.py) against the per-row incremental decoder.

Rows with different histories (utterances of different lengths, past the transformer's sliding
window), decoded together in calls grouped by chunk size, give each row the audio its own
per-row decoder gives, within float tolerance relative to the signal.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from gateway.tts.codec_batch import SAMPLES_PER_FRAME, BatchedCodecDecoder
from gateway.tts.codec_stream import StreamingCodecDecoder
from gateway.tts.graphs import StandInGraph, capture
from gateway.tts.qwen import QwenModel


@pytest.fixture(scope="module")
def decoder(tiny_model_dir: Path) -> object:
    return QwenModel(str(tiny_model_dir), device="cpu").base.model.speech_tokenizer.model.decoder


def _codes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 2048, (n, 16), generator=torch.Generator().manual_seed(seed))


def _per_row(decoder: object, codes: torch.Tensor, plan: list[int],
             prime: torch.Tensor | None = None) -> np.ndarray:
    stream = StreamingCodecDecoder(decoder)
    if prime is not None:
        stream.prime(prime)
    out, at = [], 0
    for n in plan:
        out.append(stream.decode(codes[at : at + n]))
        at += n
    return np.concatenate(out)


def _close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    peak = float(np.abs(want).max())
    assert peak > 1e-3
    assert float(np.abs(got - want).max()) <= 2e-4 * peak


def test_rows_decoded_together_get_their_per_row_audio(decoder: object) -> None:
    window = int(decoder.pre_transformer.config.sliding_window)  # type: ignore[attr-defined]
    # Three rows with their own chunk plans; the third runs well past the sliding window.
    plans = [[1, 2, 4, 8, 8, 7], [3] * 7, [8] * ((2 * window) // 8) + [4]]
    utterances = [_codes(sum(plan), seed) for seed, plan in enumerate(plans)]
    batched = BatchedCodecDecoder(decoder, slots=4)
    got: list[list[np.ndarray]] = [[], [], []]
    at, step = [0, 0, 0], [0, 0, 0]
    while any(step[r] < len(plans[r]) for r in range(3)):
        groups: dict[int, list[int]] = {}
        for r in range(3):
            if step[r] < len(plans[r]):
                groups.setdefault(plans[r][step[r]], []).append(r)
        for n, rows in groups.items():
            audio = batched.decode(torch.tensor(rows),
                                   torch.stack([utterances[r][at[r] : at[r] + n] for r in rows]))
            assert audio.shape == (len(rows), n * SAMPLES_PER_FRAME)
            for j, r in enumerate(rows):
                got[r].append(audio[j].numpy())
                at[r] += n
                step[r] += 1
    for r in range(3):
        _close(np.concatenate(got[r]), _per_row(decoder, utterances[r], plans[r]))
    assert batched.position[:3].tolist() == [sum(plan) for plan in plans]


def test_a_reset_slot_starts_over_and_a_primed_slot_continues_its_reference(
    decoder: object,
) -> None:
    batched = BatchedCodecDecoder(decoder, slots=2)
    codes = _codes(12, 7)
    batched.decode(torch.tensor([0]), _codes(30, 8)[None])  # a previous utterance in slot 0
    batched.reset(0)
    first = batched.decode(torch.tensor([0]), codes[None]).numpy()[0]
    _close(first, _per_row(decoder, codes, [12]))
    # A cloned voice: the reference clip's frames (longer than the window) decoded and dropped.
    reference = _codes(100, 9)
    batched.reset(1)
    batched.decode(torch.tensor([1]), reference[None])
    primed = np.concatenate([batched.decode(torch.tensor([1]), codes[i : i + 4][None]).numpy()[0]
                             for i in (0, 4, 8)])
    _close(primed, _per_row(decoder, codes, [4, 4, 4], prime=reference))


def test_padding_rows_decode_into_the_scratch_slot_without_touching_real_rows(
    decoder: object,
) -> None:
    batched = BatchedCodecDecoder(decoder, slots=2)
    codes = _codes(6, 3)
    scratch = batched.scratch
    out = batched.decode(torch.tensor([0, scratch, scratch]),
                         torch.stack([codes[:3], _codes(3, 4), _codes(3, 5)]))
    again = batched.decode(torch.tensor([0]), codes[3:][None])
    _close(np.concatenate([out[0].numpy(), again[0].numpy()]), _per_row(decoder, codes, [3, 3]))
    assert int(batched.position[1]) == 0  # slot 1 untouched


def test_a_captured_decode_replays_through_the_static_buffers(decoder: object) -> None:
    """Graph mode: the decode of a (chunk size, bucket) captured once and replayed with new
    slots and codes written into its static inputs (the capture stand-in on the CPU)."""
    batched = BatchedCodecDecoder(decoder, slots=2)
    index = torch.zeros(2, dtype=torch.long)
    pending = torch.zeros(3, 4, 16, dtype=torch.long)
    out = torch.zeros(2, 4 * SAMPLES_PER_FRAME)

    def run() -> None:
        codes = pending.index_select(0, index)[:, :4]
        out.copy_(batched.decode(index, codes))

    static = [*decoder.parameters(), *decoder.buffers(),  # type: ignore[attr-defined]
              *batched.tensors(), index, pending, out]
    with torch.inference_mode():
        index.fill_(batched.scratch)  # warm-ups and capture touch only the scratch slot
        graph = capture(run, "cpu", warmup=1, static=static)
    assert isinstance(graph, StandInGraph)
    a, b = _codes(8, 11), _codes(8, 12)
    got: list[list[np.ndarray]] = [[], []]
    for start in (0, 4):
        with torch.inference_mode():
            index.copy_(torch.tensor([0, 1]))
            pending[0, :4] = a[start : start + 4]
            pending[1, :4] = b[start : start + 4]
        graph.replay()
        got[0].append(out[0].numpy().copy())
        got[1].append(out[1].numpy().copy())
    _close(np.concatenate(got[0]), _per_row(decoder, a, [4, 4]))
    _close(np.concatenate(got[1]), _per_row(decoder, b, [4, 4]))


@pytest.mark.gpu
def test_the_engines_codec_graphs_on_cuda_give_the_per_row_audio(tiny_model_dir: Path) -> None:
    """The true CUDA path: the engine's codec graphs (every chunk size and bucket captured at
    warm-up) replayed for two rows give each row its per-row decoder's audio."""
    from gateway.tts.batched import BatchedQwenEngine
    from gateway.tts.engine import SpeechRequest

    shared = QwenModel(str(tiny_model_dir), device="cuda", dtype="float32")
    engine = BatchedQwenEngine(shared, max_rows=2, max_seq_len=256, record_codes=True,
                               adaptive_chunks=False)
    engine.warmup()
    assert len(engine._codec_graphs) == 8 * 2  # chunk sizes 1..8 x buckets 1, 2
    rows = [engine.open(SpeechRequest(text=t, seed=i, max_frames=7, min_frames=7))
            for i, t in enumerate(["Press one.", "Please hold."])]
    engine.prefill_rows(rows)
    audio: list[list[np.ndarray]] = [[], []]
    while any(row.finished is None for row in rows):
        engine.step([row for row in rows if row.finished is None])
        for i, chunk in enumerate(engine.next_chunks(rows)):
            if chunk is not None:
                audio[i].append(chunk)
    decoder = shared.base.model.speech_tokenizer.model.decoder
    for i, row in enumerate(rows):
        plan = [int(c.shape[0]) for c in row.chunks]
        reference = _per_row(decoder, torch.cat(row.chunks).to("cuda"), plan)
        _close(np.concatenate(audio[i]), reference)
