"""The seams our engines open in faster-qwen3-tts / qwen-tts / transformers. Fail loudly if
they change.

gateway/tts/qwen.py (the slot engine) mirrors ``fast_generate_streaming`` and, on CPU, replaces
the CUDA graph object behind ``PredictorGraph.run`` / ``TalkerGraph.run`` with an eager replayer.
gateway/tts/batched.py (the batched engine) drives the talker's and the code predictor's own
forwards with its own caches (they must call nothing on a cache but ``update``), hands the
talker a ready 4D mask (which mask creation must pass through untouched) and per-row
M-RoPE positions, and builds prompts with faster-qwen3-tts's prompt builders. That is only
correct for the exact library code it was written against. When a pin is bumped on purpose,
re-read these functions, port any change, and update the hashes below.
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
    # the batched engine
    "Qwen3TTSTalkerModel.forward": "f997524d1e88421e",
    "Qwen3TTSTalkerAttention.forward": "1705139cf8fd3dff",
    "Qwen3TTSTalkerCodePredictorModel.forward": "b55daf8fc3327e4d",
    "Qwen3TTSAttention.forward": "becc8c0aebae5193",
    "Qwen3TTSTalkerForConditionalGeneration.get_rope_index": "6840eadc8f396af8",
    "sdpa_attention_forward": "1552320f53db8dcb",
    "masking_utils._preprocess_mask_arguments": "ee598f46c076f0d6",
    "FasterQwen3TTS._prepare_generation": "7abafd11d51a47c5",
    "FasterQwen3TTS._build_talker_inputs_local": "ea20299d3d89813e",
}


@pytest.mark.parametrize(("package", "expected"), sorted(PINNED.items()))
def test_pinned_versions(package: str, expected: str) -> None:
    assert version(package) == expected, (
        f"{package} {version(package)} installed, the engine seam was written for {expected}"
    )


def _functions() -> dict[str, object]:
    from faster_qwen3_tts import model, predictor_graph, streaming, talker_graph
    from qwen_tts.core.models import modeling_qwen3_tts as qwen
    from transformers import masking_utils
    from transformers.integrations import sdpa_attention

    wrapper = model.FasterQwen3TTS
    return {
        "Qwen3TTSTalkerModel.forward": qwen.Qwen3TTSTalkerModel.forward,
        "Qwen3TTSTalkerAttention.forward": qwen.Qwen3TTSTalkerAttention.forward,
        "Qwen3TTSTalkerCodePredictorModel.forward":
            qwen.Qwen3TTSTalkerCodePredictorModel.forward,
        "Qwen3TTSAttention.forward": qwen.Qwen3TTSAttention.forward,
        "Qwen3TTSTalkerForConditionalGeneration.get_rope_index":
            qwen.Qwen3TTSTalkerForConditionalGeneration.get_rope_index,
        "sdpa_attention_forward": sdpa_attention.sdpa_attention_forward,
        "masking_utils._preprocess_mask_arguments": masking_utils._preprocess_mask_arguments,
        "FasterQwen3TTS._prepare_generation": wrapper._prepare_generation,
        "FasterQwen3TTS._build_talker_inputs_local": wrapper._build_talker_inputs_local,
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


def test_the_batched_engines_caches_see_only_update_calls() -> None:
    """The attention layers reach a cache through ``past_key_values.update`` alone; the models'
    forwards do not ask it for lengths when given ``cache_position`` (the batched engine's caches
    answer nothing else truthfully)."""
    from qwen_tts.core.models import modeling_qwen3_tts as qwen

    for attention in (qwen.Qwen3TTSTalkerAttention, qwen.Qwen3TTSAttention):
        source = inspect.getsource(attention.forward)
        calls = {line.split("past_key_values.", 1)[1].split("(", 1)[0]
                 for line in source.splitlines() if "past_key_values." in line}
        assert calls == {"update"}, calls
    for model in (qwen.Qwen3TTSTalkerModel, qwen.Qwen3TTSTalkerCodePredictorModel):
        source = inspect.getsource(model.forward)
        assert "if cache_position is None:" in source
        assert "get_seq_length" in source.split("if cache_position is None:", 1)[1][:200]


def test_this_torch_build_has_the_onednn_linear_ops_the_cpu_talker_runs_on() -> None:
    """gateway/tts/cpu_linear.py calls two ops private to torch's compiler; without them the
    CPU falls back to torch's default kernels (~2x slower batched steps) with one warning, so
    a torch build in the pinned range that drops them must fail here instead."""
    from gateway.tts import cpu_linear

    assert cpu_linear.available()
