"""The seam our engine opens in faster-qwen3-tts / qwen-tts. Fails loudly if they change.

gateway/tts/qwen.py mirrors ``fast_generate_streaming`` and, on CPU, replaces the CUDA graph
object behind ``PredictorGraph.run`` / ``TalkerGraph.run`` with an eager replayer. That is only
correct for the exact library code it was written against. When a pin is bumped on purpose,
re-read these functions, port any change into qwen.py, and update the hashes below.
"""

from __future__ import annotations

import hashlib
import inspect
from importlib.metadata import version

import pytest

PINNED = {"faster-qwen3-tts": "0.2.6", "qwen-tts": "0.1.1", "transformers": "4.57.3"}

#: sha256 prefixes of the library functions our loop mirrors or wraps.
SOURCES = {
    "streaming.fast_generate_streaming": "633857e8c34ef965",
    "PredictorGraph.run": "3080ae4fcd8fbfe5",
    "PredictorGraph.capture": "9d9fe7cb65344497",
    "TalkerGraph.run": "9e30d60e89da6178",
    "TalkerGraph.capture": "3f7c8a559b5fd2be",
    "FasterQwen3TTS._prepare_generation_custom": "b01de86c6d2f1050",
    "FasterQwen3TTS._warmup": "c5068b9ad655ee12",
}


@pytest.mark.parametrize(("package", "expected"), sorted(PINNED.items()))
def test_pinned_versions(package: str, expected: str) -> None:
    assert version(package) == expected, (
        f"{package} {version(package)} installed, the engine seam was written for {expected}"
    )


def _functions() -> dict[str, object]:
    from faster_qwen3_tts import model, predictor_graph, streaming, talker_graph

    wrapper = model.FasterQwen3TTS
    return {
        "streaming.fast_generate_streaming": streaming.fast_generate_streaming,
        "PredictorGraph.run": predictor_graph.PredictorGraph.run,
        "PredictorGraph.capture": predictor_graph.PredictorGraph.capture,
        "TalkerGraph.run": talker_graph.TalkerGraph.run,
        "TalkerGraph.capture": talker_graph.TalkerGraph.capture,
        "FasterQwen3TTS._prepare_generation_custom": wrapper._prepare_generation_custom,
        "FasterQwen3TTS._warmup": wrapper._warmup,
    }


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_mirrored_library_code_is_unchanged(name: str) -> None:
    source = inspect.getsource(_functions()[name])  # type: ignore[arg-type]
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    assert digest == SOURCES[name], f"{name} changed upstream: re-port gateway/tts/qwen.py"


def test_graph_holders_replay_through_a_graph_attribute() -> None:
    """The eager CPU path swaps ``.graph``; both ``run`` methods must go through it."""
    from faster_qwen3_tts.predictor_graph import PredictorGraph
    from faster_qwen3_tts.talker_graph import TalkerGraph

    for cls, step in ((PredictorGraph, "_full_loop"), (TalkerGraph, "_decode_step")):
        assert "self.graph.replay()" in inspect.getsource(cls.run)
        for helper in ("_init_cache_layers", "_build_attention_masks", step):
            assert callable(getattr(cls, helper, None)), f"{cls.__name__}.{helper} is gone"


def test_wrapper_constructor_signature() -> None:
    from faster_qwen3_tts.model import FasterQwen3TTS

    params = list(inspect.signature(FasterQwen3TTS.__init__).parameters)
    assert params[:7] == ["self", "base_model", "predictor_graph", "talker_graph", "device",
                          "dtype", "max_seq_len"]
