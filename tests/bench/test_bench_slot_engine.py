"""The slot engine (bench/slot_engine.py): the batching benchmark's baseline, kept working.

The gateway no longer serves turns with it; ``bench/batching.py`` and the GPU run's baselines
stage measure the batched engine against it. These are its own mechanisms: faster-qwen3-tts's
graph holders behind the CPU seam, the vectorised attention-mask table, and the minimal slot
front the benchmarks drive.
"""

from __future__ import annotations

import gc
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gateway import heap
from gateway.tts.engine import SAMPLES_PER_FRAME, SpeechRequest
from tests.support.paths import REPO

sys.path.insert(0, str(REPO / "bench"))
from slot_engine import SlotEngine, SlotService, build_mask_table


@pytest.fixture(scope="module")
def slot(tiny_model_dir: Path) -> Iterator[SlotEngine]:
    engine = SlotEngine(model=str(tiny_model_dir), device="cpu", record_codes=True)
    engine.warmup()
    yield engine


def test_the_slot_engine_streams_its_chunk_schedule(slot: SlotEngine) -> None:
    slot.adaptive_chunks = False
    try:
        chunks = list(slot.stream(SpeechRequest(text="Press one.", seed=1, max_frames=7,
                                                min_frames=7)))
    finally:
        slot.adaptive_chunks = True
    assert [len(c) // SAMPLES_PER_FRAME for c in chunks] == [1, 2, 4]
    assert int(torch.cat(slot.last_codes).shape[0]) == 7


async def test_the_slot_service_serves_turns_side_by_side(slot: SlotEngine) -> None:
    service = SlotService([slot])
    service.start()
    try:
        streams = [service.stream(SpeechRequest(text=f"Caller {i}.", seed=i, max_frames=3,
                                                min_frames=3)) for i in range(2)]
        for stream in streams:
            chunks = [c async for c in stream]
            frames = sum(len(c) for c in chunks) // SAMPLES_PER_FRAME
            assert frames == 3
            await stream.finished.wait()
            assert stream.started_at is not None and stream.finished_at is not None
    finally:
        service.stop()


@pytest.mark.parametrize("pads", [0, 3])
def test_the_slots_attention_mask_table_is_the_librarys_built_at_once(
    slot: SlotEngine, pads: int
) -> None:
    """faster-qwen3-tts builds a slot's per-position masks with one transformers call each
    (~2 CPU-s per slot start or rebuild); ours builds the same table in one step. Every
    position's mask must equal the library's, with and without left padding."""
    from faster_qwen3_tts.talker_graph import TalkerGraph

    graph = SlotEngine(slot.shared, max_seq_len=48)._wrapper.talker_graph
    graph._init_cache_layers()
    mask = torch.ones(1, 48, dtype=torch.long)
    mask[0, :pads] = 0

    def fallback(_: object) -> None:
        raise AssertionError("the vectorised table was not built")

    build_mask_table(graph, mask if pads else None, fallback=fallback)
    ours = [m.clone() for m in graph.attn_mask_table]
    TalkerGraph._build_attention_masks(graph, mask if pads else None)
    theirs = graph.attn_mask_table
    assert len(ours) == len(theirs) == 48
    for position, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape, position
        assert torch.equal(a, b), position




@pytest.mark.gpu
def test_cuda_graph_engine_streams_on_gpu(tiny_model_dir: Path) -> None:
    """The same stream through captured CUDA graphs (skipped without a CUDA device)."""
    engine = SlotEngine(model=str(tiny_model_dir), device="cuda", adaptive_chunks=False)
    engine.warmup()
    chunks = list(engine.stream(SpeechRequest(text="Press one.", seed=1, max_frames=7)))
    assert [len(c) // SAMPLES_PER_FRAME for c in chunks][:3] == [1, 2, 4]




def test_a_cpu_rebuild_frees_the_old_graph_holders_with_the_start_up_heap_frozen(
    slot: SlotEngine,
) -> None:
    """A ready gateway freezes its start-up heap out of the cycle collector (gateway/heap.py):
    the graph holders (and their static caches) a CPU rebuild replaces must go by reference
    counting alone. Their eager replayer once held its holder's step strongly: a cycle."""
    assert list(slot.stream(SpeechRequest(text="Hi.", seed=1, max_frames=2)))
    wrapper = slot._wrapper
    old = [weakref.ref(wrapper.predictor_graph), weakref.ref(wrapper.talker_graph)]
    del wrapper
    heap.hold()
    gc.disable()  # freed by reference counting, whatever else holds the heap in this process
    try:
        slot.rebuild()
        assert [ref() for ref in old] == [None, None]
    finally:
        gc.enable()
        heap.release()
    assert list(slot.stream(SpeechRequest(text="Hi.", seed=1, max_frames=2)))
