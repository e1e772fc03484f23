"""The batched engine on CPU with the tiny checkpoint: per-row identity, sampling, caches, seam.

The identity tests drive the engine directly (no threads), so which turns share which steps is
exact: turns join and leave at chosen frames, sit steps out, and run in batches of 1 to 8.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from gateway import heap
from gateway.errors import EngineError
from gateway.tts import cpu_linear
from gateway.tts.batch_cache import RowKVCache
from gateway.tts.batch_sampling import (
    BatchDraws,
    RowDraws,
    kcap_for,
    penalise_repeats,
    sample_rows,
)
from gateway.tts.batched import (
    BatchedQwenEngine,
    BatchRow,
    batch_buckets,
    bucket_for,
    kv_len_for,
)
from gateway.tts.engine import SAMPLES_PER_FRAME, Sampling, SpeechRequest
from gateway.tts.graphs import StandInGraph
from gateway.tts.qwen import QwenModel
from gateway.tts.tiny import TINY_MAX_NEW_TOKENS

TEXTS = ["Press one for billing.", "Your balance is ten dollars.", "Please hold.",
         "Goodbye, and thanks for calling us today.", "A", "Seven seven seven.",
         "Transfer me to an agent, please.", "Account number?"]
SPEAKERS = ["ryan", "vivian", "serena", "aiden", "dylan", "eric", "sohee", "ono_anna"]


@pytest.fixture(scope="module")
def shared(tiny_model_dir: Path) -> QwenModel:
    return QwenModel(str(tiny_model_dir), device="cpu")


@pytest.fixture(scope="module")
def engine(shared: QwenModel) -> BatchedQwenEngine:
    return BatchedQwenEngine(shared, max_rows=8, record_codes=True, record_logits=True,
                             trim_leading_silence=False)


def _requests(sampling: Sampling | None, frames: int = 10) -> list[SpeechRequest]:
    # Fixed lengths (frames + 2i): the random model would otherwise stop at random points.
    return [SpeechRequest(text=TEXTS[i], speaker=SPEAKERS[i], seed=100 + i,
                          max_frames=frames + 2 * i, min_frames=frames + 2 * i,
                          sampling=sampling) for i in range(8)]


def _drive(engine: BatchedQwenEngine, plan: list[tuple[int, SpeechRequest]],
           sit_out: Callable[[int, int], bool] = lambda _turn, _step: False,
           decode: bool = False, together: bool = False) -> dict[int, BatchRow]:
    """Run turns that join at given steps; ``sit_out(turn, step)`` holds a row back a step.

    With ``together`` the turns joining at one step are prefilled by one ``prefill_rows``
    call (one forward), as the loop prefills a burst. Returns every turn's finished row
    (codes and logits recorded; with ``decode`` the codec runs too and each chunk's codes
    are recorded)."""
    pending = sorted(enumerate(plan), key=lambda item: item[1][0])
    live: dict[int, BatchRow] = {}
    done: dict[int, BatchRow] = {}
    step = 0
    while pending or live:
        joining: dict[int, BatchRow] = {}
        while pending and pending[0][1][0] <= step:
            turn, (_join, request) = pending.pop(0)
            joining[turn] = engine.open(request)
        if together and len(joining) > 1:
            engine.prefill_rows(list(joining.values()))
        for row in joining.values():
            while row.prefilling:
                engine.prefill(row)
        live.update(joining)
        advancing = [row for turn, row in live.items()
                     if row.finished is None and not sit_out(turn, step)]
        engine.step(advancing)
        for turn, row in list(live.items()):
            assert row.output is not None
            if not decode:
                engine.drop_pending(row)
            while engine.next_chunk(row) is not None and row.finished is not None:
                pass
            if row.finished is not None and not row.output.pending:
                engine.close(row)
                done[turn] = live.pop(turn)
        step += 1
    assert not engine.rows
    return done


def _codes(row: BatchRow) -> torch.Tensor:
    return torch.stack(row.codes)


def _first_divergence(a: torch.Tensor, b: torch.Tensor) -> int | None:
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).any(dim=1).nonzero()
    if len(differ):
        return int(differ[0])
    return None if len(a) == len(b) else n


def _draw(seed: int, step: int, index: int) -> float:
    """The uniform a row drew for ``index`` (0-14: codebooks 1-15, 15: the next talker token)
    at its ``step``-th frame: one draw at prefill, then 16 per frame."""
    draws = RowDraws(seed)
    draws.take(1)
    for _ in range(step):
        draws.take(16)
    return float(draws.take(16)[index])


def _sample(logits: torch.Tensor, u: float, temperature: float, top_k: int, top_p: float) -> int:
    return int(sample_rows(logits[None], torch.tensor([u]), torch.tensor([temperature]),
                           torch.tensor([top_k]), torch.tensor([top_p]),
                           kcap_for([top_k], logits.shape[-1]))[0])


def _relative_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    finite = torch.isfinite(a)
    assert torch.equal(finite, torch.isfinite(b))
    scale = max(1.0, float(a[finite].abs().max()))
    return float((a[finite] - b[finite]).abs().max()) / scale


def _decisions(row: BatchRow) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Every sampling decision after the prefill, in order: (frame, codebook, logits)."""
    for frame in range(len(row.codes)):
        for codebook in range(1, 16):
            yield frame, codebook, row.predictor_logits[frame][codebook - 1]
        if frame + 1 < len(row.codes):
            yield frame + 1, 0, row.logits[frame]


def _explain(solo: BatchRow, mixed: BatchRow, greedy: bool) -> tuple[float, str | None]:
    """Compare two runs of one turn decision by decision.

    Returns the worst relative logit difference up to the first differing code, and a
    description of that code if the runs diverged. A divergence must be explained: the logits
    agree within 1e-4, the same draw applied to each run's logits gives each run's code, and
    the decision was balanced on an edge that float32 noise can tip: the two codes' logits are
    within 1e-4 (their order in the sorted candidates swapped; greedy: a tie for the top), or
    the draw lies within 1e-4 of a boundary of the sampled distribution.
    """
    s = solo.sampling
    worst = 0.0
    for (frame, codebook, la), (_f, _c, lb) in zip(_decisions(solo), _decisions(mixed),
                                                   strict=False):
        la, lb = la.cpu(), lb.cpu()
        worst = max(worst, _relative_diff(la, lb))
        a, b = int(solo.codes[frame][codebook]), int(mixed.codes[frame][codebook])
        if a == b:
            continue
        assert worst < 1e-4
        settings = ((s.temperature, s.top_k, s.top_p) if codebook == 0 else
                    (s.predictor_temperature, s.predictor_top_k, s.predictor_top_p))
        tie = abs(float(la[a] - la[b])) <= 1e-4 * max(1.0, float(la[a].abs()))
        if greedy:
            assert tie, (frame, codebook, float(la[a]), float(la[b]))
            how = "tie for the top"
        else:
            u = _draw(solo.seed, frame - 1 if codebook == 0 else frame,
                      15 if codebook == 0 else codebook - 1)
            assert _sample(la, u, *settings) == a and _sample(lb, u, *settings) == b
            edge = _sample(la, u - 1e-4, *settings) != _sample(la, u + 1e-4, *settings)
            assert tie or edge, (frame, codebook, u)
            how = "order swap of equal logits" if tie else "draw on a distribution boundary"
        return worst, (f"frame {frame} codebook {codebook}: {a} alone, {b} batched "
                       f"(logits {float(la[a]):.7f} / {float(la[b]):.7f}: {how})")
    assert len(solo.codes) == len(mixed.codes)
    return worst, None


@pytest.mark.parametrize("sampling", [Sampling.greedy(), None], ids=["greedy", "seeded"])
def test_a_turn_gives_the_same_codes_alone_and_sharing_steps_with_up_to_seven_others(
    engine: BatchedQwenEngine, sampling: Sampling | None
) -> None:
    """Identity up to float32: batched GEMMs sum in another order than batch-1 ones (MKL and
    cuBLAS pick kernels by shape), so logits differ in the last bits. Codes are identical unless
    such noise tips a sample sitting on a distribution boundary; every divergence is checked
    to be exactly that (see _explain), and the logits agree within 1e-4 of the solo run."""
    requests = _requests(sampling)
    solo = {i: _drive(engine, [(0, r)])[0] for i, r in enumerate(requests)}
    # Joining every 2 steps with lengths 10..24, so each turn shares steps with 0 to 7 others
    # in batches of every size; turns 3 and 5 also sit steps out while the others advance.
    mixed = _drive(engine, [(2 * i, r) for i, r in enumerate(requests)],
                   sit_out=lambda turn, step: (turn, step % 5) in ((3, 1), (5, 3)))
    for i in range(8):
        assert len(solo[i].codes) == requests[i].max_frames
    _assert_as_solo(solo, mixed, greedy=sampling is not None)


def _assert_as_solo(solo: dict[int, BatchRow], shared: dict[int, BatchRow], greedy: bool,
                    ) -> None:
    """Every turn gave its solo codes, or diverged on an explained float32 edge (_explain);
    logits within 1e-4 of the solo run; divergences are rare edge cases, not the rule."""
    worst, diverged = 0.0, []
    for i in sorted(solo):
        diff, where = _explain(solo[i], shared[i], greedy=greedy)
        worst = max(worst, diff)
        if where is not None:
            diverged.append(f"turn {i} {where}")
    identical = len(solo) - len(diverged)
    print(f"\n{identical}/{len(solo)} turns identical to their solo run; max relative logit "
          f"difference {worst:.1e}; explained divergences: {diverged or 'none'}")
    assert worst < 1e-4
    assert identical >= len(solo) - 2


@pytest.mark.parametrize("sampling", [Sampling.greedy(), None], ids=["greedy", "seeded"])
def test_a_burst_prefilled_in_one_forward_gives_each_turn_its_solo_codes(
    engine: BatchedQwenEngine, sampling: Sampling | None
) -> None:
    """Eight prompts of different lengths and speakers, padded on the right to the longest and
    run through the talker together (four joining at step 0, four at step 3, while the first
    four generate), then stepping together: each turn gives its solo codes, up to the same
    float32 edges as any shared step (see the test above)."""
    requests = _requests(sampling)
    solo = {i: _drive(engine, [(0, r)])[0] for i, r in enumerate(requests)}
    assert len({row.prompt_tokens for row in solo.values()}) >= 4, "prompts of many lengths"
    forwards = _count_talker_forwards(engine)
    burst = _drive(engine, [(0 if i < 4 else 3, r) for i, r in enumerate(requests)],
                   together=True)
    # Two prefill forwards of four prompts each (plus one forward per step).
    assert forwards.batches.count(4) == 2 and forwards.tokens_over_one == 2
    for i in range(8):
        assert len(burst[i].codes) == requests[i].max_frames
    _assert_as_solo(solo, burst, greedy=sampling is not None)


@pytest.fixture(scope="module")
def packed_engine(tiny_model_dir: Path) -> Iterator[BatchedQwenEngine]:
    """The batched engine over a tiny model whose talker linears all run on oneDNN: the tiny
    transformer layers are below the size the product packs (only its output heads reach
    it), so the test lowers it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_linear, "MIN_WEIGHTS", 0)
        model = QwenModel(str(tiny_model_dir), device="cpu")
    assert model.cpu_linear == "onednn"
    assert not any(type(m) is torch.nn.Linear for m in model.base.model.talker.modules())
    yield BatchedQwenEngine(model, max_rows=8, record_codes=True, record_logits=True,
                            trim_leading_silence=False)


@pytest.mark.parametrize("sampling", [Sampling.greedy(), None], ids=["greedy", "seeded"])
def test_on_onednn_linears_a_turn_gives_its_solo_codes_sharing_steps_with_seven_others(
    packed_engine: BatchedQwenEngine, sampling: Sampling | None
) -> None:
    """The identity test above, every talker and predictor linear on prepacked oneDNN (the
    kernels the CPU runs the published shapes on). Where the tiny model's products give a row
    the same bits at any row count (AVX2 and AVX-512 do at these small shapes), every turn
    gives exactly its solo logits; MKL's kernels give ~4e-7. Elsewhere the float32 bound of
    the test above applies."""
    requests = _requests(sampling)
    solo = {i: _drive(packed_engine, [(0, r)])[0] for i, r in enumerate(requests)}
    mixed = _drive(packed_engine, [(2 * i, r) for i, r in enumerate(requests)],
                   sit_out=lambda turn, step: (turn, step % 5) in ((3, 1), (5, 3)))
    worst = 0.0
    for i in range(8):
        assert len(mixed[i].codes) == requests[i].max_frames
        diff, where = _explain(solo[i], mixed[i], greedy=sampling is not None)
        worst = max(worst, diff)
        assert where is None, f"turn {i} {where}"
    print(f"\nmax relative logit difference from the solo runs: {worst:.1e}")
    assert worst == 0.0 if _rows_independent(packed_engine) else worst <= 1e-6


def _rows_independent(engine: BatchedQwenEngine) -> bool:
    """Whether this CPU's oneDNN gives a row the same bits alone and among 8 rows at every
    shape of ``engine``'s packed linears: a property of the CPU, probed on the raw ops with
    fresh weights, so a layer that stopped using them still fails the test."""
    generator = torch.Generator().manual_seed(5)
    ops = torch.ops.mkldnn
    shapes = {(m.in_features, m.out_features) for m in engine._talker.modules()
              if isinstance(m, cpu_linear.PackedLinear)}
    with torch.inference_mode():
        for inputs, outputs in shapes:
            weight = ops._reorder_linear_weight(
                torch.randn(outputs, inputs, generator=generator), None)
            x = torch.randn(8, inputs, generator=generator)
            if not torch.equal(ops._linear_pointwise(x, weight, None, "none", [], "")[:1],
                               ops._linear_pointwise(x[:1], weight, None, "none", [], "")):
                return False
    return True


class _Forwards:
    """The talker forwards an engine ran: the batch size of each, and how many took more
    than one token per row (prefills)."""

    def __init__(self) -> None:
        self.batches: list[int] = []
        self.tokens_over_one = 0

    def __call__(self, _module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        embeds = kwargs["inputs_embeds"]
        if embeds.shape[1] > 1:
            self.batches.append(int(embeds.shape[0]))
            self.tokens_over_one += 1


#: Forward hooks a test put on the module-scoped engine's talker; removed after each test.
_HOOKS: list[Any] = []


def _count_talker_forwards(engine: BatchedQwenEngine) -> _Forwards:
    forwards = _Forwards()
    _HOOKS.append(engine._talker.model.register_forward_pre_hook(forwards, with_kwargs=True))
    return forwards


@pytest.fixture(autouse=True)
def _remove_hooks() -> Iterator[None]:
    yield
    while _HOOKS:
        _HOOKS.pop().remove()


def test_rows_prefilled_together_hold_the_state_and_cache_of_their_solo_prefill(
    tiny_engine_rows: BatchedQwenEngine,
) -> None:
    engine = tiny_engine_rows
    requests = _requests(Sampling.greedy(), frames=4)[:5]
    solo = []
    for request in requests:
        row = engine.open(request)
        engine.prefill(row)
        assert row.ready
        solo.append((int(engine._token[row.index]), engine._past_hidden[row.index].clone(),
                     [k[row.index, :, : row.length].clone() for k in engine._kv.keys],
                     row.length))
        engine.close(row)
    rows = [engine.open(r) for r in requests]
    assert engine.prefill_rows(rows) == sum(row.prompt_tokens for row in rows)
    for row, (token, hidden, keys, length) in zip(rows, solo, strict=True):
        assert row.ready and row.prefilled == row.prompt_tokens and row.length == length
        assert int(engine._token[row.index]) == token
        assert _relative_diff(hidden, engine._past_hidden[row.index]) < 1e-5
        for layer, solo_keys in enumerate(keys):
            assert _relative_diff(solo_keys, engine._kv.keys[layer][row.index, :, :length]) < 1e-5


def test_a_failed_prefill_together_changes_no_row_and_each_row_can_then_go_alone(
    tiny_engine_rows: BatchedQwenEngine,
) -> None:
    engine = tiny_engine_rows
    rows = [engine.open(r) for r in _requests(None, frames=4)[:3]]

    def fail_batched(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        if kwargs["inputs_embeds"].shape[0] > 1:
            raise RuntimeError("out of memory (injected)")

    _HOOKS.append(engine._talker.model.register_forward_pre_hook(fail_batched, with_kwargs=True))
    with pytest.raises(RuntimeError, match="injected"):
        engine.prefill_rows(rows)
    for row in rows:
        assert row.prefilling and row.prefilled == 0 and row.prefill_cache is None
        engine.prefill(row)
        assert row.ready


def test_rows_with_chunked_prompts_are_prefilled_one_chunk_each(shared: QwenModel) -> None:
    engine = BatchedQwenEngine(shared, max_rows=4, trim_leading_silence=False, prefill_chunk=3)
    rows = [engine.open(r) for r in _requests(None, frames=4)[:3]]
    assert all(row.prompt_tokens > 3 for row in rows)
    assert engine.prefill_rows(rows) == 9
    assert [row.prefilled for row in rows] == [3, 3, 3] and not any(row.ready for row in rows)


def test_a_seeded_turn_is_reproducible_and_its_generator_is_its_own(
    engine: BatchedQwenEngine,
) -> None:
    base = SpeechRequest(text="Your balance is ten dollars.", seed=7, max_frames=10)
    first = _codes(_drive(engine, [(0, base)])[0])
    # Two turns with the same seed side by side draw from separate generators: both equal the
    # solo turn (the process-wide generator would have interleaved their draws).
    pair = _drive(engine, [(0, base), (0, base)])
    assert torch.equal(_codes(pair[0]), first) and torch.equal(_codes(pair[1]), first)
    other = _codes(_drive(engine, [(0, SpeechRequest(text=base.text, seed=8, max_frames=10))])[0])
    assert not torch.equal(first, other)
    torch.manual_seed(0)
    before = torch.rand(1)
    torch.manual_seed(0)
    _drive(engine, [(0, base)])
    assert torch.equal(torch.rand(1), before), "the global RNG was touched"


def test_each_row_samples_with_its_own_settings(engine: BatchedQwenEngine) -> None:
    greedy = SpeechRequest(text="Press one.", seed=1, max_frames=8, sampling=Sampling.greedy())
    hot = SpeechRequest(text="Press one.", seed=1, max_frames=8,
                        sampling=Sampling(temperature=1.5, top_k=0, top_p=0.95))
    alone = [_codes(_drive(engine, [(0, r)])[0]) for r in (greedy, hot)]
    together = _drive(engine, [(0, greedy), (0, hot)])
    assert torch.equal(_codes(together[0]), alone[0])
    assert torch.equal(_codes(together[1]), alone[1])
    assert not torch.equal(alone[0], alone[1])
    with pytest.raises(EngineError, match="top_p"):
        engine.stream(SpeechRequest(text="x", sampling=Sampling(top_p=0.0)))


def test_a_row_that_sits_out_keeps_its_state_and_padding_rows_do_not_move(
    engine: BatchedQwenEngine,
) -> None:
    requests = _requests(Sampling.greedy(), frames=8)[:3]
    solo = _codes(_drive(engine, [(0, requests[1])])[0])
    # Turn 1 sits out every other step while 0 and 2 advance: its positions, token, history
    # and KV are untouched on those steps (its KV write went to the scratch position).
    mixed = _drive(engine, [(0, r) for r in requests],
                   sit_out=lambda turn, step: turn == 1 and step % 2 == 0)
    assert torch.equal(_codes(mixed[1]), solo)


def test_an_eager_step_runs_only_the_rows_up_to_the_highest_that_advances(
    tiny_engine_rows: BatchedQwenEngine,
) -> None:
    """On the CPU there is no graph to pad for: three rows run as three, not as bucket 4, and
    a newcomer prefilling in the top row is not computed; the rows keep their solo codes."""
    engine = tiny_engine_rows
    assert not engine.cuda_graphs
    requests = _requests(Sampling.greedy(), frames=6)[:4]
    solo = [_codes(_drive(engine, [(0, r)])[0]) for r in requests[:3]]
    rows = [engine.open(r) for r in requests[:3]]
    for row in rows:
        while row.prefilling:
            engine.prefill(row)
    def step(stepping: list[BatchRow]) -> int:
        bucket = engine.step(stepping)
        for row in stepping:
            engine.drop_pending(row)  # the codec is not under test
        return bucket

    assert step(rows) == 3
    newcomer = engine.open(requests[3])  # index 3, its prompt not yet run
    assert step(rows) == 3
    assert step(rows[:2]) == 2  # the third sits out: above the highest, not computed
    while live := [r for r in rows if r.finished is None]:
        assert step(live) == max(r.index for r in live) + 1
    for row, expected in zip(rows, solo, strict=True):
        assert torch.equal(_codes(row), expected)
    assert newcomer.prefilling and newcomer.frames == 0


def test_stream_chunks_follow_the_schedule_and_the_frame_cap(
    engine: BatchedQwenEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Fixed schedule here; adaptive shrinking is tested in test_tts_chunking.py.
    monkeypatch.setattr(engine, "adaptive_chunks", False)
    chunks = list(engine.stream(SpeechRequest(text="Hello there.", seed=3, max_frames=19,
                                              min_frames=19)))
    sizes = [len(c) // SAMPLES_PER_FRAME for c in chunks]
    assert sizes[:4] == [1, 2, 4, 8] and sum(sizes) == 19
    assert all(c.dtype == np.float32 and np.abs(c).max() <= 1.0 for c in chunks)


def test_streamed_audio_equals_one_decode_of_the_rows_codes(
    engine: BatchedQwenEngine, shared: QwenModel
) -> None:
    row = _drive(engine, [(0, SpeechRequest(text="Nothing is lost.", seed=11, max_frames=21,
                                            min_frames=21))], decode=True)[0]
    codes = torch.cat(row.chunks)
    assert torch.equal(codes, _codes(row))
    decoder = shared.base.model.speech_tokenizer.model.decoder
    solo = list(engine.stream(row.request))
    with torch.inference_mode():
        whole = decoder(codes.T.unsqueeze(0)).reshape(-1).numpy()
    streamed = np.concatenate(solo)
    error = streamed - whole
    assert np.max(np.abs(error)) <= 1e-4 * max(1.0, float(np.abs(whole).max()))


def test_a_row_that_names_no_length_ends_at_the_checkpoints_max_new_tokens(
    engine: BatchedQwenEngine, shared: QwenModel
) -> None:
    """As the slot engine (tests/unit/tts/test_engine.py): the tiny checkpoint's ``max_new_tokens``
    (64) bounds a row whose request names no length; a named length is kept."""
    long = "Thank you for calling Acme Energy, we are glad to help you today. " * 3
    assert shared.max_new_tokens == TINY_MAX_NEW_TOKENS
    unnamed = engine.open(SpeechRequest(text=long, seed=1))
    named = engine.open(SpeechRequest(text=long, seed=1, max_frames=TINY_MAX_NEW_TOKENS + 6))
    try:
        assert unnamed.max_frames == TINY_MAX_NEW_TOKENS
        assert named.max_frames == TINY_MAX_NEW_TOKENS + 6
    finally:
        engine.close(named)
        engine.close(unnamed)
    assert not engine.rows


def test_a_prompt_too_long_for_its_row_is_a_clear_error(shared: QwenModel) -> None:
    small = BatchedQwenEngine(shared, max_rows=1, max_seq_len=128)
    with pytest.raises(EngineError, match="no room"):
        list(small.stream(SpeechRequest(text="x" * 200)))
    assert not small.rows


def test_the_kv_memory_and_batch_cap_are_logged_at_start(
    shared: QwenModel, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO", logger="gateway.tts.batched"):
        engine = BatchedQwenEngine(shared, max_rows=3, max_seq_len=256)
    line = next(r.getMessage() for r in caplog.records if "batch cap" in r.getMessage())
    per_row = engine.kv_bytes_per_row
    assert "batch cap 3 rows" in line and f"{per_row / 2**20:.1f} MiB per row" in line
    assert f"{3 * per_row / 2**20:.1f} MiB for all rows" in line
    config = shared.base.model.config.talker_config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    # keys + values, every layer, 256 positions, float32
    assert per_row == 2 * config.num_hidden_layers * config.num_key_value_heads * 256 * head_dim * 4


# --- the CUDA-graph seam, exercised with the eager replayer --------------------------------------


def test_buckets_and_attended_lengths() -> None:
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 32, 48, 64)
    assert batch_buckets(10) == (1, 2, 4, 8, 10)
    assert [bucket_for(n, 64) for n in (1, 2, 3, 5, 9, 17, 33, 49, 64)] == [
        1, 2, 4, 8, 16, 32, 48, 64, 64]
    assert bucket_for(9, 10) == 10
    with pytest.raises(ValueError):
        bucket_for(11, 10)
    assert [kv_len_for(n, 2048, True) for n in (1, 256, 257, 700, 2048)] == [
        256, 256, 512, 1024, 2048]
    assert [kv_len_for(n, 1024, False) for n in (1, 64, 65, 1000)] == [64, 64, 128, 1024]
    assert kcap_for([50], 3072) == 64 and kcap_for([50, 100], 3072) == 256
    assert kcap_for([0], 3072) == 3072 and kcap_for([5000], 2048) == 2048


def test_graph_mode_replays_give_the_eager_codes_and_capture_changes_no_row(
    shared: QwenModel,
) -> None:
    """The graph-mode branches of the step through the capture stand-in: device staging
    buffers, one copy out per step, a graph per bucket replayed through static buffers.
    Graphs captured lazily mid-turn (no warm-up here) run their capture warm-ups for real with
    every row masked, so rows mid-turn are unchanged: every turn gives the eager codes."""
    requests = _requests(Sampling.greedy(), frames=10)[:3]
    reference = BatchedQwenEngine(shared, max_rows=4, record_codes=True)
    expected = _drive(reference, [(2 * i, r) for i, r in enumerate(requests)])
    engine = BatchedQwenEngine(shared, max_rows=4, record_codes=True, cuda_graphs=True)
    assert "graph stand-in" in engine.name
    got = _drive(engine, [(2 * i, r) for i, r in enumerate(requests)])
    for i in range(3):
        assert torch.equal(_codes(got[i]), _codes(expected[i]))
    # Buckets 1, 2 and 4 (three rows pad to four) at one attended length (256), top-k 64.
    assert sorted(engine._graphs) == [(1, 256, 64, 64), (2, 256, 64, 64), (4, 256, 64, 64)]
    assert engine.captures == 3
    assert all(isinstance(g, StandInGraph) and g.replays > 0 for g in engine._graphs.values())


def test_warm_up_captures_every_graph_and_serving_captures_none(shared: QwenModel) -> None:
    """Warm-up (as the gateway runs it, outside any inference mode) captures every bucket and
    attended length for the engine's sampling envelope; turns with other top-k settings, at
    every batch size, then replay those graphs and capture nothing. Before graph capture ran
    under inference mode, this warm-up raised "Inplace update to inference tensor outside
    InferenceMode" at the first capture, and the gateway never became ready."""
    engine = BatchedQwenEngine(shared, max_rows=4, max_seq_len=512, record_codes=True,
                               record_logits=True, cuda_graphs=True)
    assert not torch.is_inference_mode_enabled()
    engine.warmup()
    assert engine.captures == len(batch_buckets(4)) * 2 == len(engine._graphs)  # 256, 512
    assert {key[:2] for key in engine._graphs} == {
        (b, n) for b in (1, 2, 4) for n in (256, 512)}
    assert engine.capture_s > 0
    samplings = [Sampling(top_k=10), Sampling.greedy(), None, Sampling(top_k=64, top_p=0.9)]
    requests = [SpeechRequest(text=TEXTS[i], speaker=SPEAKERS[i], seed=7 + i,
                              max_frames=6 + i, min_frames=6 + i, sampling=samplings[i])
                for i in range(4)]
    eager = BatchedQwenEngine(shared, max_rows=4, max_seq_len=512, record_codes=True,
                              record_logits=True)
    plan = [(i, r) for i, r in enumerate(requests)]
    got, expected = _drive(engine, plan), _drive(eager, plan)
    assert engine.captures == 6  # nothing captured while serving
    for i in range(4):
        worst, _where = _explain(expected[i], got[i], greedy=samplings[i] == Sampling.greedy())
        assert worst < 1e-3


def test_graph_mode_refuses_a_top_k_beyond_its_captured_envelope(shared: QwenModel) -> None:
    """The candidate count is a graph shape: a request needing more than the envelope the
    graphs were captured for is refused with the setting to change, never captured mid-call."""
    engine = BatchedQwenEngine(shared, max_rows=2, cuda_graphs=True)
    with pytest.raises(EngineError, match="max_top_k"):
        engine.stream(SpeechRequest(text="x", sampling=Sampling(top_k=0)))
    wide = BatchedQwenEngine(shared, max_rows=2, cuda_graphs=True, max_top_k=0)
    assert (wide._tk, wide._pk) == (wide.vocab, wide._pred_vocab)
    chunks = list(wide.stream(SpeechRequest(text="x", seed=1, max_frames=3, min_frames=3,
                                            sampling=Sampling(top_k=0))))
    assert sum(len(c) for c in chunks) == 3 * SAMPLES_PER_FRAME
    # Eager steps follow their rows: no envelope to respect.
    eager = BatchedQwenEngine(shared, max_rows=2)
    assert list(eager.stream(SpeechRequest(text="x", seed=1, max_frames=2, min_frames=2,
                                           sampling=Sampling(top_k=0))))


def test_rebuild_in_graph_mode_recaptures_every_graph_and_serves_the_same_codes(
    shared: QwenModel,
) -> None:
    """After a failed step the loop rebuilds: fresh buffers, every graph captured again (under
    inference mode, as at warm-up), and a turn then gives the codes it gave before."""
    engine = BatchedQwenEngine(shared, max_rows=2, max_seq_len=256, record_codes=True,
                               cuda_graphs=True)
    engine.warmup()
    request = _requests(Sampling.greedy(), frames=6)[0]
    before = _drive(engine, [(0, request)])[0]
    row = engine.open(request)
    engine.prefill(row)
    engine.step([row])
    engine.rebuild()  # as the engine core does after an exception inside a step
    assert engine.captures == 2 * len(batch_buckets(2)) and len(engine._graphs) == 2
    with pytest.raises(EngineError, match="lost when the engine was rebuilt"):
        engine.step([row])
    after = _drive(engine, [(0, request)])[0]
    assert torch.equal(_codes(after), _codes(before))


@pytest.mark.gpu
@pytest.mark.parametrize("sampling", [Sampling.greedy(), None], ids=["greedy", "seeded"])
def test_cuda_graph_steps_match_the_eager_steps(
    tiny_model_dir: Path, sampling: Sampling | None
) -> None:
    """The true CUDA path: graphs per bucket (captured at warm-up) give the eager step's codes,
    up to the same explained float edges as batching (the eager step attends over other
    lengths, so its attention kernels differ)."""
    shared = QwenModel(str(tiny_model_dir), device="cuda", dtype="float32")
    kwargs: dict[str, Any] = {"max_rows": 4, "record_codes": True, "record_logits": True}
    graphs = BatchedQwenEngine(shared, **kwargs)
    eager = BatchedQwenEngine(shared, cuda_graphs=False, **kwargs)
    graphs.warmup()
    assert graphs.captures >= len(batch_buckets(4))
    requests = _requests(sampling, frames=10)[:3]
    plan = [(2 * i, r) for i, r in enumerate(requests)]
    got, expected = _drive(graphs, plan), _drive(eager, plan)
    for i in range(3):
        worst, _where = _explain(expected[i], got[i], greedy=sampling is not None)
        assert worst < 1e-3


# --- sampling, caches ---------------------------------------------------------------------------


def test_inverse_cdf_sampling_follows_the_filtered_distribution() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    one = torch.ones(1)

    def pick(u: float, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> int:
        return int(sample_rows(logits, torch.tensor([u]), temperature * one,
                               torch.tensor([top_k]), top_p * one, 4)[0])

    assert [pick(u) for u in (0.0, 0.49, 0.51, 0.79, 0.81, 0.94, 0.96)] == [0, 0, 1, 1, 2, 2, 3]
    assert [pick(u, top_k=2) for u in (0.6, 0.99)] == [0, 1]  # 0.5/0.8 = 0.625
    assert [pick(u, top_p=0.7) for u in (0.6, 0.99)] == [0, 1]  # keeps 0.5 + 0.3
    assert pick(0.99, temperature=0.0) == 0
    # Per row: each row's token depends on its own logits, settings and draw only.
    rows = torch.randn(5, 50)
    u = torch.rand(5)
    settings = (torch.tensor([0.9, 0.0, 1.3, 0.7, 1.0]), torch.tensor([50, 5, 0, 10, 3]),
                torch.tensor([1.0, 1.0, 0.9, 0.5, 1.0]))
    together = sample_rows(rows, u, *settings, 50)
    for i in range(5):
        alone = sample_rows(rows[i : i + 1], u[i : i + 1],
                            *(s[i : i + 1] for s in settings), 50)
        assert int(alone[0]) == int(together[i])


def test_sampling_matches_the_distribution_of_multinomial() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 12, generator=generator) * 2
    probs = torch.softmax(logits[0] / 0.8, dim=-1)
    u = torch.rand(20000, generator=generator)
    tokens = sample_rows(logits.expand(20000, -1), u, torch.full((20000,), 0.8),
                         torch.zeros(20000, dtype=torch.long), torch.ones(20000), 12)
    freq = torch.bincount(tokens, minlength=12).float() / 20000
    assert float((freq - probs).abs().max()) < 0.015


def test_repetition_penalty_matches_hugging_face() -> None:
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = torch.randn(3, 40)
    history = [torch.tensor([1, 5, 5, 9]), torch.tensor([0]), torch.tensor([39, 2])]
    seen = torch.zeros(3, 40, dtype=torch.bool)
    for row, ids in enumerate(history):
        seen[row, ids] = True
    ours = penalise_repeats(logits, seen, torch.full((3,), 1.3))
    for row, ids in enumerate(history):
        theirs = RepetitionPenaltyLogitsProcessor(1.3)(ids[None], logits[row : row + 1].clone())
        assert torch.allclose(ours[row], theirs[0])


def test_row_draws_are_a_fixed_stream_per_seed() -> None:
    a, b = RowDraws(5), RowDraws(5)
    first = torch.cat([a.take(16).clone() for _ in range(20)])
    second = torch.cat([b.take(16).clone() for _ in range(20)])
    assert torch.equal(first, second) and not torch.equal(first[:16], first[16:32])
    assert float(first.min()) >= 0 and float(first.max()) < 1


def test_batch_draws_give_each_slot_its_own_row_stream_whatever_is_taken_with_it() -> None:
    """All stepping rows' uniforms come from one indexed read, yet each slot's stream is the
    one RowDraws gives its seed, in the same order, whichever slots share the takes."""
    batch = BatchDraws(4)
    seeds = {0: 11, 1: 12, 3: 13}
    for slot, seed in seeds.items():
        batch.start(slot, seed)
    reference = {slot: RowDraws(seed) for slot, seed in seeds.items()}
    firsts = {slot: batch.take(slot, 1) for slot in seeds}  # the prefill's one draw
    for slot in seeds:
        assert torch.equal(firsts[slot], reference[slot].take(1))
    schedule = [[0, 1, 3], [0, 3], [1], [0, 1, 3]] * 6  # rows sitting steps out
    for slots in schedule:
        got = batch.take_rows(slots, 16)
        for row, slot in enumerate(slots):
            assert torch.equal(got[row], reference[slot].take(16))


def test_row_cache_writes_each_row_at_its_own_position(shared: QwenModel) -> None:
    config = shared.base.model.config.talker_config
    cache = RowKVCache(config, rows=3, max_seq_len=16, device="cpu", dtype=torch.float32)
    heads, dim = cache.keys[0].shape[1], cache.keys[0].shape[3]
    keys = torch.randn(2, heads, 1, dim)
    cache.prepare(torch.tensor([4, cache.scratch]), kv_len=8)
    got_k, _got_v = cache.update(keys, keys + 1, 0)
    assert got_k.shape == (2, heads, 8, dim)
    assert torch.equal(cache.keys[0][0, :, 4], keys[0, :, 0])
    assert torch.equal(cache.keys[0][1, :, 15], keys[1, :, 0])  # the scratch slot
    assert not cache.keys[0][1, :, :15].any() and not cache.keys[0][2].any()
    cache.move_row(0, 2, length=5)
    assert torch.equal(cache.keys[0][2, :, :5], cache.keys[0][0, :, :5])


@pytest.fixture
def tiny_engine_rows(engine: BatchedQwenEngine) -> Iterator[BatchedQwenEngine]:
    yield engine
    for row in list(engine.rows):
        engine.close(row)


def test_closing_a_row_moves_the_last_row_into_its_place(
    tiny_engine_rows: BatchedQwenEngine,
) -> None:
    engine = tiny_engine_rows
    requests = _requests(Sampling.greedy(), frames=6)[:3]
    solo = _codes(_drive(engine, [(0, requests[2])])[0])
    rows = [engine.open(r) for r in requests]
    for row in rows:
        while row.prefilling:
            engine.prefill(row)
    engine.step(rows)
    engine.close(rows[0])  # row 2 (index 2) moves to index 0 with its KV and state
    assert rows[2].index == 0 and rows[1].index == 1
    while rows[2].finished is None:
        live = [r for r in rows[1:] if r.finished is None]
        engine.step(live)
        for row in live:
            engine.drop_pending(row)  # the codec is not under test
    assert torch.equal(_codes(rows[2]), solo)


def test_a_rebuild_frees_the_old_buffers_and_graphs_with_the_start_up_heap_frozen(
    shared: QwenModel,
) -> None:
    """A ready gateway freezes its start-up heap (gateway/heap.py), and a frozen object in a
    reference cycle is never collected. So what an engine held before a rebuild (its KV cache,
    its state, its captured steps: GPU memory on CUDA) must be freed by reference counting
    alone, or the first failure's rebuild would keep the start-up ones until the gateway
    stops."""
    engine = BatchedQwenEngine(shared, max_rows=2, trim_leading_silence=False)
    assert list(engine.stream(SpeechRequest(text="Hi.", seed=1, max_frames=3, min_frames=3)))
    assert engine._graphs, "a step was run: its replayer exists"
    old = [weakref.ref(t) for t in (*engine._kv.keys, *engine._kv.values, engine._seen,
                                     engine._token)]
    old += [weakref.ref(graph) for graph in engine._graphs.values()]
    heap.hold()
    gc.disable()  # freed by reference counting, whatever else holds the heap in this process
    try:
        engine.rebuild()
        alive = [ref for ref in old if ref() is not None]
        assert not alive, f"{len(alive)} of {len(old)} old objects outlived the rebuild"
    finally:
        gc.enable()
        heap.release()
    assert list(engine.stream(SpeechRequest(text="Hi.", seed=1, max_frames=3, min_frames=3)))
