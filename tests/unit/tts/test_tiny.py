"""The tiny random-weight Qwen3-TTS checkpoint loads and runs through the real qwen-tts path."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from gateway.tts import tiny

# The published CustomVoice speakers and languages (Qwen3-TTS-12Hz-0.6B/1.7B-CustomVoice).
REAL_SPEAKERS = {
    "vivian", "serena", "uncle_fu", "dylan", "eric", "ryan", "aiden", "ono_anna", "sohee",
}  # fmt: skip
REAL_LANGUAGES = {
    "chinese", "english", "german", "italian", "portuguese", "spanish", "japanese", "korean",
    "french", "russian",
}  # fmt: skip


# The checkpoints themselves are the session fixtures of conftest.py (built once per run).
@pytest.fixture(scope="session")
def tiny_custom_voice_dir(tiny_model_dir: Path) -> Path:
    return tiny_model_dir


@pytest.fixture(scope="session")
def tiny_base_dir(tiny_base_model_dir: Path) -> Path:
    return tiny_base_model_dir


def _load(path: Path) -> Any:
    from qwen_tts import Qwen3TTSModel

    return Qwen3TTSModel.from_pretrained(str(path), device_map="cpu", dtype=torch.float32)


@pytest.fixture(scope="session")
def custom_voice_model(tiny_custom_voice_dir: Path) -> Any:
    return _load(tiny_custom_voice_dir)


@pytest.fixture(scope="session")
def base_model(tiny_base_dir: Path) -> Any:
    return _load(tiny_base_dir)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _check_audio(wav: np.ndarray, max_frames: int) -> None:
    assert wav.dtype == np.float32 and wav.ndim == 1
    assert np.isfinite(wav).all()
    assert np.abs(wav).max() <= 1.0
    assert wav.size % tiny.SAMPLES_PER_FRAME == 0
    assert 0 < wav.size <= max_frames * tiny.SAMPLES_PER_FRAME
    assert float(np.sqrt(np.mean(wav**2))) > 1e-3  # noise, not silence


def test_layout_and_structural_constants(tiny_custom_voice_dir: Path) -> None:
    d = tiny_custom_voice_dir
    for name in (
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "vocab.json",
        "merges.txt",
        "tokenizer_config.json",
        "speech_tokenizer/config.json",
        "speech_tokenizer/model.safetensors",
        "speech_tokenizer/preprocessor_config.json",
    ):
        assert (d / name).is_file(), name
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_tts"
    assert cfg["tts_model_type"] == "custom_voice" and cfg["tts_model_size"] == "0b6"
    assert cfg["tokenizer_type"] == "qwen3_tts_tokenizer_12hz"
    assert "model_type" not in cfg["speaker_encoder_config"]  # the save_pretrained trap
    talker = cfg["talker_config"]
    assert talker["vocab_size"] == 3072 and talker["num_code_groups"] == 16
    assert (talker["codec_pad_id"], talker["codec_bos_id"], talker["codec_eos_token_id"]) == (
        2148,
        2149,
        2150,
    )
    assert sum(talker["rope_scaling"]["mrope_section"]) == talker["head_dim"] // 2
    assert talker["code_predictor_config"]["vocab_size"] == 2048
    assert talker["code_predictor_config"]["num_code_groups"] == 16
    assert cfg["speaker_encoder_config"]["enc_dim"] == talker["hidden_size"]

    st = json.loads((d / "speech_tokenizer/config.json").read_text())
    assert st["model_type"] == "qwen3_tts_tokenizer_12hz"
    assert st["input_sample_rate"] == st["output_sample_rate"] == 24000
    assert st["decode_upsample_rate"] == st["encode_downsample_rate"] == 1920
    assert st["decoder_config"]["num_quantizers"] == 16
    assert st["decoder_config"]["codebook_size"] == 2048
    dec = st["decoder_config"]
    assert np.prod(dec["upsample_rates"] + dec["upsampling_ratios"]) == 1920

    tok_cfg = json.loads((d / "tokenizer_config.json").read_text())
    assert tok_cfg["processor_class"] == "Qwen3TTSProcessor"
    gen = json.loads((d / "generation_config.json").read_text())
    assert gen["max_new_tokens"] == tiny.TINY_MAX_NEW_TOKENS and gen["subtalker_top_k"] == 50


def test_directory_is_small(tiny_custom_voice_dir: Path, tiny_base_dir: Path) -> None:
    assert _dir_bytes(tiny_custom_voice_dir) < 30 * 2**20
    assert _dir_bytes(tiny_base_dir) < 30 * 2**20


def test_loads_through_the_real_loader(custom_voice_model: Any) -> None:
    from qwen_tts.core.models import Qwen3TTSForConditionalGeneration

    assert isinstance(custom_voice_model.model, Qwen3TTSForConditionalGeneration)
    assert custom_voice_model.model.dtype == torch.float32
    st = custom_voice_model.model.speech_tokenizer
    assert st.get_model_type() == "qwen3_tts_tokenizer_12hz"
    assert st.get_output_sample_rate() == 24000 and st.get_decode_upsample_rate() == 1920
    assert custom_voice_model.model.speaker_encoder is None


def test_speakers_and_languages_are_the_published_ones(custom_voice_model: Any) -> None:
    assert set(custom_voice_model.get_supported_speakers()) == REAL_SPEAKERS
    assert set(custom_voice_model.get_supported_languages()) == REAL_LANGUAGES | {"auto"}
    assert set(tiny.SPEAKERS) == REAL_SPEAKERS and set(tiny.LANGUAGES) == REAL_LANGUAGES

    talker = custom_voice_model.model.config.talker_config
    specials = [
        talker.codec_pad_id,
        talker.codec_bos_id,
        talker.codec_eos_token_id,
        talker.codec_think_id,
        talker.codec_nothink_id,
        talker.codec_think_bos_id,
        talker.codec_think_eos_id,
    ]
    ids = [*talker.spk_id.values(), *talker.codec_language_id.values(), *specials]
    assert len(ids) == len(set(ids)), "speaker/language/control ids must be distinct"
    assert all(2048 <= i < 3072 for i in ids), "all in the special range of the codec vocab"
    assert talker.spk_is_dialect["dylan"] == "beijing_dialect"
    assert talker.spk_is_dialect["eric"] == "sichuan_dialect"


def test_text_tokenizer_obeys_the_prompt_slicing(custom_voice_model: Any) -> None:
    # qwen-tts slices the assistant prompt [:3], [3:-5], [4:-5]; the loaded processor (after
    # transformers' fix_mistral_regex patch of a local dir) must keep these counts.
    proc = custom_voice_model.processor
    assert len(proc(text="<|im_start|>assistant\n")["input_ids"][0]) == 3
    assert len(proc(text="<|im_end|>\n<|im_start|>assistant\n")["input_ids"][0]) == 5
    text = "Press 1 for sales."
    prompt = f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"
    ids = proc(text=prompt)["input_ids"][0]
    assert proc.tokenizer.decode(ids[3:-5]) == text
    cfg = custom_voice_model.model.config
    assert ids[0] == cfg.im_start_token_id
    vocab = cfg.talker_config.text_vocab_size
    assert max(cfg.tts_pad_token_id, cfg.tts_bos_token_id, cfg.tts_eos_token_id) < vocab
    assert len(proc.tokenizer) <= vocab


def test_custom_voice_generation_returns_24khz_audio(custom_voice_model: Any) -> None:
    torch.manual_seed(0)
    wavs, sr = custom_voice_model.generate_custom_voice(
        text="Thank you for calling. Please hold.",
        speaker="Ryan",
        language="English",
        max_new_tokens=25,
    )
    assert sr == 24000 and len(wavs) == 1
    # qwen-tts returns max_new_tokens - 1 frames at most: the prefill step yields no codes.
    _check_audio(wavs[0], max_frames=24)


def test_custom_voice_dialect_speaker_and_batch(custom_voice_model: Any) -> None:
    torch.manual_seed(1)
    wavs, sr = custom_voice_model.generate_custom_voice(
        text=["你好", "Hallo"],
        speaker=["Dylan", "sohee"],
        language=["Chinese", "German"],
        max_new_tokens=6,
    )
    assert sr == 24000 and len(wavs) == 2
    for wav in wavs:
        _check_audio(wav, max_frames=5)


def test_generation_is_reproducible_under_a_seed(custom_voice_model: Any) -> None:
    outs = []
    for _ in range(2):
        torch.manual_seed(123)
        wavs, _ = custom_voice_model.generate_custom_voice(
            text="Hi.", speaker="vivian", language="English", max_new_tokens=6
        )
        outs.append(wavs[0])
    np.testing.assert_array_equal(outs[0], outs[1])


def test_builder_is_deterministic(tiny_custom_voice_dir: Path, tmp_path: Path) -> None:
    again = tiny.build_tiny_checkpoint(tmp_path / "again", seed=0)
    other = tiny.build_tiny_checkpoint(tmp_path / "other", seed=1)
    for name in ("model.safetensors", "speech_tokenizer/model.safetensors", "config.json",
                 "tokenizer.json"):  # fmt: skip
        assert _sha256(again / name) == _sha256(tiny_custom_voice_dir / name), name
    assert _sha256(other / "model.safetensors") != _sha256(again / "model.safetensors")
    assert _sha256(other / "speech_tokenizer/model.safetensors") != _sha256(
        again / "speech_tokenizer/model.safetensors"
    )


def test_base_kind_computes_a_voice_clone_prompt(base_model: Any) -> None:
    cfg = base_model.model.config
    assert cfg.tts_model_type == "base" and cfg.talker_config.spk_id == {}
    assert base_model.model.speaker_encoder is not None
    with pytest.raises(ValueError):
        base_model.generate_custom_voice(text="x", speaker="ryan", language="English")

    sr = 24000  # the codec's and speaker encoder's rate: no resampling on this path
    t = np.arange(sr) / sr
    rng = np.random.default_rng(0)
    ref = (0.3 * np.sin(2 * np.pi * 220 * t) + 0.02 * rng.standard_normal(sr)).astype(np.float32)

    items = base_model.create_voice_clone_prompt(ref_audio=(ref, sr), ref_text="Hello there.")
    assert len(items) == 1 and items[0].icl_mode and not items[0].x_vector_only_mode
    code, emb = items[0].ref_code, items[0].ref_spk_embedding
    assert code.shape == (13, 16)  # 1 s at 12.5 Hz, rounded up; 16 codebooks
    assert int(code.min()) >= 0 and int(code.max()) < 2048
    assert emb.shape == (cfg.talker_config.hidden_size,) and torch.isfinite(emb).all()

    torch.manual_seed(0)
    wavs, out_sr = base_model.generate_voice_clone(
        text="Thanks for calling.", language="English", voice_clone_prompt=items, max_new_tokens=6
    )
    assert out_sr == 24000
    _check_audio(wavs[0], max_frames=5)

    xvec = base_model.create_voice_clone_prompt(ref_audio=(ref, sr), x_vector_only_mode=True)
    assert xvec[0].ref_code is None
    torch.manual_seed(0)
    wavs, _ = base_model.generate_voice_clone(
        text="Thanks.", language="Auto", voice_clone_prompt=xvec, max_new_tokens=6
    )
    _check_audio(wavs[0], max_frames=5)


@pytest.mark.parametrize(
    ("size", "hidden", "intermediate", "tag", "low", "high"),
    [("0.6B", 1024, 3072, "0b6", 0.85e9, 0.95e9), ("1.7B", 2048, 6144, "1b7", 1.8e9, 2.0e9)],
)
def test_full_size_config(
    size: tiny.ModelSize, hidden: int, intermediate: int, tag: str, low: float, high: float
) -> None:
    cfg = tiny.full_size_config(size)
    talker = cfg.talker_config
    assert (talker.hidden_size, talker.intermediate_size, talker.num_hidden_layers) == (
        hidden,
        intermediate,
        28,
    )
    assert (talker.num_attention_heads, talker.num_key_value_heads, talker.head_dim) == (16, 8, 128)
    assert talker.rope_scaling["mrope_section"] == [24, 20, 20]
    assert talker.text_vocab_size == 151936 and talker.text_hidden_size == 2048
    pred = talker.code_predictor_config
    assert (pred.hidden_size, pred.num_hidden_layers, pred.vocab_size) == (1024, 5, 2048)
    assert cfg.tts_model_size == tag and cfg.speaker_encoder_config.enc_dim == hidden
    assert cfg.tts_eos_token_id == 151673
    # Counted on the meta device: no weight memory is allocated.
    assert low < tiny.talker_parameter_count(cfg) < high
    base = tiny.full_size_config(size, kind="base")
    assert base.tts_model_type == "base" and base.talker_config.spk_id == {}


def test_codec_configs_keep_the_frame_geometry() -> None:
    for small in (True, False):
        cfg = tiny.codec_config(tiny=small)
        assert cfg.encoder_config.frame_rate == 12.5
        assert cfg.encoder_config.sampling_rate == 24000
        dec = cfg.decoder_config
        assert int(np.prod(list(dec.upsample_rates) + list(dec.upsampling_ratios))) == 1920
        assert cfg.encoder_config.num_quantizers >= cfg.encoder_valid_num_quantizers == 16


def test_the_tiny_alias_builds_again_when_the_cached_checkpoint_is_an_older_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--model tiny`` reuses its cached checkpoint, unless an older version built it with
    another frame budget (then callers would hear that version's prompt lengths)."""
    from gateway.tts.qwen import resolve_model

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    target = tmp_path / "qwen3-tts-gateway" / "tiny-custom_voice"
    built: list[Path] = []

    def fake_build(out_dir: Path) -> Path:
        built.append(Path(out_dir))
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "model.safetensors").write_bytes(b"weights")
        (Path(out_dir) / "generation_config.json").write_text(
            json.dumps({"max_new_tokens": tiny.TINY_MAX_NEW_TOKENS}))
        return Path(out_dir)

    monkeypatch.setattr(tiny, "build_tiny_checkpoint", fake_build)
    assert resolve_model("tiny") == str(target) and len(built) == 1  # none cached: built
    # Built beside the target and moved into place whole.
    assert built[0].parent == target.parent and built[0] != target
    assert (target / "model.safetensors").read_bytes() == b"weights"
    assert resolve_model("tiny") == str(target) and len(built) == 1  # current: reused
    (target / "generation_config.json").write_text(json.dumps({"max_new_tokens": 64}))
    assert resolve_model("tiny") == str(target) and len(built) == 2  # an older build: again
    assert resolve_model("Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice") == (
        "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice")


def test_a_tiny_build_killed_midway_leaves_nothing_a_later_run_takes_for_a_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several processes resolve ``tiny`` at once (test workers, a gateway and its tools), and a
    run can be killed mid-build (a stage timeout): the half-written directory must never be
    where readers look."""
    from gateway.tts.qwen import resolve_model

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cache = tmp_path / "qwen3-tts-gateway"
    target = cache / "tiny-custom_voice"

    def killed(out_dir: Path) -> Path:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt  # the process is stopped here

    monkeypatch.setattr(tiny, "build_tiny_checkpoint", killed)
    with pytest.raises(KeyboardInterrupt):
        resolve_model("tiny")
    assert not target.exists()
    assert [p.name for p in cache.iterdir()] == ["tiny-custom_voice.lock"]
