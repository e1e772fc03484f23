"""Random-weight Qwen3-TTS checkpoints of the real architecture, built offline.

What this is for
----------------
Tests and offline smoke runs of the gateway need a Qwen3-TTS model that the *real* loading and
generation code accepts unchanged (``qwen_tts.Qwen3TTSModel.from_pretrained`` ->
``generate_custom_voice`` / ``create_voice_clone_prompt`` + ``generate_voice_clone``, and the
faster-qwen3-tts streaming pieces), without downloading anything from the Hugging Face hub.

:func:`build_tiny_checkpoint` writes such a directory (~20 MB) from the library's own config and
model classes (``Qwen3TTSConfig`` / talker / code-predictor / speaker-encoder configs,
``Qwen3TTSForConditionalGeneration`` and the 12 Hz codec ``Qwen3TTSTokenizerV2Model``), with
randomly initialised weights and a tiny byte-level BPE text tokenizer. The structural constants
that the surrounding code depends on are kept: 16 code groups, a 3072-entry talker codec vocabulary
with the published special-id layout (codec EOS 2150, pad 2148, bos 2149, think 2154..2157,
language ids 2050..2074, speaker ids 2861..3066), the published speaker and language names,
2048-entry codebooks, a 12.5 Hz codec with 1920 samples per frame at 24 kHz, and
``tts_model_size`` "0b6". Only widths and depths shrink, so that 25 codec frames generate in well
under a second on a CPU.

**The output is noise.** The weights are random: the audio has the right sample rate, length and
dtype, but no speech in it, and the model stops (samples codec EOS) only by chance; pass
``max_new_tokens``. It exercises the real qwen-tts code path, not the model's quality.

:func:`full_size_config` returns the published 0.6B / 1.7B architecture as a ``Qwen3TTSConfig``,
and :func:`build_random_checkpoint` saves a full-size random-weight checkpoint the same way (for
timing on a GPU machine, where the real weights cannot be fetched).

Layout written (the standard Hugging Face layout of the published repositories)::

    out_dir/
      config.json                 Qwen3TTSConfig (speaker_encoder_config without "model_type")
      model.safetensors           Qwen3TTSForConditionalGeneration weights
      generation_config.json      qwen-tts generation defaults (read as plain JSON, mandatory)
      tokenizer.json, vocab.json, merges.txt, tokenizer_config.json, special_tokens_map.json
                                  Qwen2TokenizerFast; tokenizer_config has processor_class
      speech_tokenizer/
        config.json               Qwen3TTSTokenizerV2Config (model_type qwen3_tts_tokenizer_12hz)
        model.safetensors         Qwen3TTSTokenizerV2Model weights (Mimi encoder + decoder)
        preprocessor_config.json  EncodecFeatureExtractor, 24 kHz mono
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, cast

import torch

__all__ = [
    "CODEBOOK_SIZE",
    "CODEC_BOS_ID",
    "CODEC_EOS_TOKEN_ID",
    "CODEC_PAD_ID",
    "CODEC_VOCAB_SIZE",
    "FRAME_RATE_HZ",
    "LANGUAGES",
    "LANGUAGE_IDS",
    "NUM_CODE_GROUPS",
    "SAMPLES_PER_FRAME",
    "SAMPLE_RATE",
    "SPEAKERS",
    "SPEAKER_DIALECTS",
    "SPEAKER_IDS",
    "TINY_MAX_NEW_TOKENS",
    "ModelKind",
    "ModelSize",
    "build_random_checkpoint",
    "build_text_tokenizer",
    "build_tiny_checkpoint",
    "codec_config",
    "full_size_config",
    "talker_parameter_count",
    "tiny_config",
]

ModelKind = Literal["custom_voice", "base"]
ModelSize = Literal["0.6B", "1.7B"]

# --- Published structural constants (Qwen3-TTS-12Hz-*; config.json / speech_tokenizer) ---------

SAMPLE_RATE = 24_000
SAMPLES_PER_FRAME = 1920
FRAME_RATE_HZ = SAMPLE_RATE / SAMPLES_PER_FRAME  # 12.5
NUM_CODE_GROUPS = 16
CODEBOOK_SIZE = 2048
CODEC_VOCAB_SIZE = 3072  # talker codec vocab; ids 2048..3071 are special (suppressed but EOS)

CODEC_PAD_ID = 2148
CODEC_BOS_ID = 2149
CODEC_EOS_TOKEN_ID = 2150
CODEC_THINK_ID = 2154
CODEC_NOTHINK_ID = 2155
CODEC_THINK_BOS_ID = 2156
CODEC_THINK_EOS_ID = 2157

#: CustomVoice speakers -> talker codec ids (published 0.6B/1.7B CustomVoice config).
SPEAKER_IDS: dict[str, int] = {
    "vivian": 3065,
    "serena": 3066,
    "uncle_fu": 3010,
    "dylan": 2878,
    "eric": 2875,
    "ryan": 3061,
    "aiden": 2861,
    "ono_anna": 2873,
    "sohee": 2864,
}
#: Speakers whose Chinese/Auto prompts use a dialect tag instead of the language tag.
SPEAKER_DIALECTS: dict[str, str | bool] = {
    "vivian": False,
    "serena": False,
    "uncle_fu": False,
    "dylan": "beijing_dialect",
    "eric": "sichuan_dialect",
    "ryan": False,
    "aiden": False,
    "ono_anna": False,
    "sohee": False,
}
#: Languages (and the two dialect tags) -> talker codec ids.
LANGUAGE_IDS: dict[str, int] = {
    "chinese": 2055,
    "english": 2050,
    "german": 2053,
    "italian": 2070,
    "portuguese": 2071,
    "spanish": 2054,
    "japanese": 2058,
    "korean": 2064,
    "french": 2061,
    "russian": 2069,
    "beijing_dialect": 2074,
    "sichuan_dialect": 2062,
}
SPEAKERS: tuple[str, ...] = tuple(SPEAKER_IDS)
#: Languages a caller may pass (besides "Auto"); the dialect tags are not selectable.
LANGUAGES: tuple[str, ...] = tuple(k for k in LANGUAGE_IDS if "dialect" not in k)

# Published text-side ids (Qwen2 vocabulary) of the full-size checkpoints.
_QWEN_TEXT_VOCAB_SIZE = 151_936
_QWEN_TEXT_IDS = {
    "im_start_token_id": 151_644,
    "im_end_token_id": 151_645,
    "tts_pad_token_id": 151_671,
    "tts_bos_token_id": 151_672,
    "tts_eos_token_id": 151_673,
    "assistant_token_id": 77_091,
}

_GENERATION_DEFAULTS: dict[str, Any] = {
    "do_sample": True,
    "repetition_penalty": 1.05,
    "temperature": 0.9,
    "top_p": 1.0,
    "top_k": 50,
    "subtalker_dosample": True,
    "subtalker_temperature": 0.9,
    "subtalker_top_p": 1.0,
    "subtalker_top_k": 50,
    "max_new_tokens": 8192,
}
#: The tiny model never learns to stop, so its default budget is small: 32 frames, 2.56 s of
#: audio per prompt or sentence (as long as a short real prompt; every test and smoke run
#: renders it, so a longer budget only costs CPU).
TINY_MAX_NEW_TOKENS = 32

# --- Text tokenizer ------------------------------------------------------------------------------

# Special tokens in the order of the Qwen2/Qwen3-TTS vocabulary (names as published).
_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<|audio_pad|>",
)
# Words merged into one token each. "assistant" must be one token: qwen-tts slices the prompt
# "<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n" as [:3], [3:-5], [4:-5].
_WHOLE_WORDS = ("assistant", "user", "system")
# The Qwen2 pre-tokenizer split pattern.
_QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character map (the ByteLevel alphabet)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def build_text_tokenizer() -> Any:
    """A tiny byte-level BPE wrapped as ``Qwen2TokenizerFast``; deterministic, built offline.

    Vocabulary: the 256 byte tokens (ids = byte values), merges that make each of
    ``assistant``/``user``/``system`` a single token, then the Qwen special tokens. It encodes
    ``"<|im_start|>assistant\\n"`` as 3 tokens and ``"<|im_end|>\\n<|im_start|>assistant\\n"`` as 5,
    which the slicing in qwen-tts relies on; any other text costs one token per UTF-8 byte.
    """
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
    )
    from transformers import Qwen2TokenizerFast

    byte_map = _bytes_to_unicode()
    vocab: dict[str, int] = {byte_map[b]: b for b in range(256)}
    merges: list[tuple[str, str]] = []
    for word in _WHOLE_WORDS:
        symbols = [byte_map[b] for b in word.encode("utf-8")]
        current = symbols[0]
        for sym in symbols[1:]:
            merged = current + sym
            if merged not in vocab:
                merges.append((current, sym))
                vocab[merged] = len(vocab)
            current = merged

    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    backend = Tokenizer(bpe)
    backend.normalizer = normalizers.NFC()
    # A Sequence whose first element is the Split: transformers 4.57.3 replaces element [0] when a
    # caller passes fix_mistral_regex=True (qwen-tts does) for a local directory.
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in _SPECIAL_TOKENS]
    )
    tok = Qwen2TokenizerFast(
        tokenizer_object=backend,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        errors="replace",
        add_prefix_space=False,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
        model_max_length=131072,
    )
    return tok


def _text_ids(tok: Any) -> dict[str, int]:
    ids = {
        "im_start_token_id": tok.convert_tokens_to_ids("<|im_start|>"),
        "im_end_token_id": tok.convert_tokens_to_ids("<|im_end|>"),
        "tts_pad_token_id": tok.convert_tokens_to_ids("<tts_pad>"),
        "tts_bos_token_id": tok.convert_tokens_to_ids("<tts_text_bos>"),
        "tts_eos_token_id": tok.convert_tokens_to_ids("<tts_text_eod>"),
        "assistant_token_id": tok.convert_tokens_to_ids("assistant"),
    }
    return {k: int(v) for k, v in ids.items()}


# --- Configs -------------------------------------------------------------------------------------


def _talker_dict(
    *,
    kind: ModelKind,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    mrope_section: list[int],
    text_vocab_size: int,
    text_hidden: int,
    predictor: dict[str, Any],
) -> dict[str, Any]:
    if sum(mrope_section) != head_dim // 2:
        raise ValueError(f"mrope_section {mrope_section} must sum to head_dim/2 = {head_dim // 2}")
    custom = kind == "custom_voice"
    return {
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000,
        "rope_scaling": {
            "interleaved": True,
            "mrope_section": mrope_section,
            "rope_type": "default",
        },
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "vocab_size": CODEC_VOCAB_SIZE,
        "text_vocab_size": text_vocab_size,
        "text_hidden_size": text_hidden,
        "num_code_groups": NUM_CODE_GROUPS,
        "position_id_per_seconds": 13,
        "codec_pad_id": CODEC_PAD_ID,
        "codec_bos_id": CODEC_BOS_ID,
        "codec_eos_token_id": CODEC_EOS_TOKEN_ID,
        "codec_think_id": CODEC_THINK_ID,
        "codec_nothink_id": CODEC_NOTHINK_ID,
        "codec_think_bos_id": CODEC_THINK_BOS_ID,
        "codec_think_eos_id": CODEC_THINK_EOS_ID,
        "codec_language_id": dict(LANGUAGE_IDS),
        "spk_id": dict(SPEAKER_IDS) if custom else {},
        "spk_is_dialect": dict(SPEAKER_DIALECTS) if custom else {},
        "code_predictor_config": predictor,
    }


def _predictor_dict(
    *, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, head_dim: int
) -> dict[str, Any]:
    return {
        "vocab_size": CODEBOOK_SIZE,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 65536,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "num_code_groups": NUM_CODE_GROUPS,
    }


def _speaker_encoder_dict(enc_dim: int, channels: int, attention_channels: int) -> dict[str, Any]:
    return {
        "mel_dim": 128,  # fixed: extract_speaker_embedding computes 128 mel bins
        "enc_dim": enc_dim,  # must equal the talker hidden size
        "enc_channels": [channels] * 4 + [3 * channels],
        "enc_kernel_sizes": [5, 3, 3, 3, 1],
        "enc_dilations": [1, 2, 3, 4, 1],
        "enc_attention_channels": attention_channels,
        "enc_res2net_scale": 8,
        "enc_se_channels": attention_channels,
        "sample_rate": SAMPLE_RATE,
    }


def _qwen3_tts_config(
    *,
    kind: ModelKind,
    size_tag: str,
    talker: dict[str, Any],
    speaker_encoder: dict[str, Any],
    text_ids: dict[str, int],
) -> Any:
    from qwen_tts.core.models import Qwen3TTSConfig

    if kind not in ("custom_voice", "base"):
        raise ValueError(f"kind must be 'custom_voice' or 'base', not {kind!r}")
    # Qwen3TTSConfig builds its sub-configs with Config(**dict): pass dicts, not config objects.
    return Qwen3TTSConfig(
        talker_config=talker,
        speaker_encoder_config=speaker_encoder,
        tokenizer_type="qwen3_tts_tokenizer_12hz",
        tts_model_size=size_tag,
        tts_model_type=kind,
        **text_ids,
    )


def full_size_config(size: ModelSize, kind: ModelKind = "custom_voice") -> Any:
    """The ``Qwen3TTSConfig`` of the published 0.6B or 1.7B 12 Hz architecture.

    Text-side token ids are the published Qwen ids (151644...). A checkpoint written by
    :func:`build_random_checkpoint` re-points them at its own tiny text tokenizer.
    """
    if size == "0.6B":
        hidden, intermediate, tag = 1024, 3072, "0b6"
    elif size == "1.7B":
        hidden, intermediate, tag = 2048, 6144, "1b7"
    else:
        raise ValueError(f"size must be '0.6B' or '1.7B', not {size!r}")
    predictor = _predictor_dict(
        hidden=1024, intermediate=3072, layers=5, heads=16, kv_heads=8, head_dim=128
    )
    talker = _talker_dict(
        kind=kind,
        hidden=hidden,
        intermediate=intermediate,
        layers=28,
        heads=16,
        kv_heads=8,
        head_dim=128,
        mrope_section=[24, 20, 20],
        text_vocab_size=_QWEN_TEXT_VOCAB_SIZE,
        text_hidden=2048,
        predictor=predictor,
    )
    return _qwen3_tts_config(
        kind=kind,
        size_tag=tag,
        talker=talker,
        speaker_encoder=_speaker_encoder_dict(hidden, channels=512, attention_channels=128),
        text_ids=dict(_QWEN_TEXT_IDS),
    )


def tiny_config(
    kind: ModelKind = "custom_voice",
    *,
    text_vocab_size: int = 512,
    text_ids: dict[str, int] | None = None,
) -> Any:
    """The ``Qwen3TTSConfig`` of the tiny model: real id layout, widths 64, 2 layers each."""
    if text_ids is None:
        text_ids = _text_ids(build_text_tokenizer())
    if max(text_ids.values()) >= text_vocab_size:
        raise ValueError("text_vocab_size must exceed every text token id")
    # One predictor layer: the predictor runs 15 steps per frame through HF generate, so its
    # depth dominates CPU time (25 frames: ~25% faster than with 2 layers).
    predictor = _predictor_dict(
        hidden=64, intermediate=128, layers=1, heads=4, kv_heads=2, head_dim=16
    )
    talker = _talker_dict(
        kind=kind,
        hidden=64,
        intermediate=128,
        layers=2,
        heads=4,
        kv_heads=2,
        head_dim=16,
        mrope_section=[4, 2, 2],
        text_vocab_size=text_vocab_size,
        text_hidden=64,
        predictor=predictor,
    )
    return _qwen3_tts_config(
        kind=kind,
        size_tag="0b6",
        talker=talker,
        speaker_encoder=_speaker_encoder_dict(64, channels=32, attention_channels=16),
        text_ids=text_ids,
    )


# Codec widths: (tiny, published). Everything else in codec_config() is the published value.
_CODEC_ENCODER_SIZES: dict[str, tuple[int, int]] = {  # Mimi encoder
    "hidden_size": (32, 512),
    "num_filters": (4, 64),
    "num_hidden_layers": (1, 8),
    "num_attention_heads": (2, 8),
    "num_key_value_heads": (2, 8),
    "head_dim": (16, 64),
    "intermediate_size": (64, 2048),
    "num_quantizers": (16, 32),  # only the first 16 are used (encoder_valid_num_quantizers)
    "codebook_dim": (8, 256),
    "vector_quantization_hidden_dimension": (8, 256),
    "upsample_groups": (32, 512),  # = hidden_size
}
_CODEC_DECODER_SIZES: dict[str, tuple[int, int]] = {
    "latent_dim": (32, 1024),
    "codebook_dim": (16, 512),
    "decoder_dim": (32, 1536),  # halves per upsample stage: must be divisible by 16
    "hidden_size": (32, 512),
    "intermediate_size": (64, 1024),
    "num_hidden_layers": (1, 8),
    "num_attention_heads": (2, 16),
    "num_key_value_heads": (2, 16),
    "head_dim": (16, 64),
    "vector_quantization_hidden_dimension": (16, 512),
}


def codec_config(tiny: bool = True) -> Any:
    """``Qwen3TTSTokenizerV2Config`` of the 12 Hz codec: published, or shrunk (``tiny``).

    Both keep 24 kHz in/out, 16 valid codebooks of 2048, 1920 samples per frame: encoder
    (Mimi) strides 8*6*5*4 then /2, decoder upsampling 2*2 then 8*5*4*3.
    """
    from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import (
        Qwen3TTSTokenizerV2Config,
    )

    pick = 0 if tiny else 1
    enc = {key: sizes[pick] for key, sizes in _CODEC_ENCODER_SIZES.items()}
    dec = {key: sizes[pick] for key, sizes in _CODEC_DECODER_SIZES.items()}
    encoder_config: dict[str, Any] = {
        "sampling_rate": SAMPLE_RATE,
        "frame_rate": FRAME_RATE_HZ,
        "audio_channels": 1,
        "num_residual_layers": 1,
        "upsampling_ratios": [8, 6, 5, 4],
        "kernel_size": 7,
        "last_kernel_size": 3,
        "residual_kernel_size": 3,
        "dilation_growth_rate": 2,
        "use_causal_conv": True,
        "pad_mode": "constant",
        "compress": 2,
        "trim_right_ratio": 1.0,
        "codebook_size": CODEBOOK_SIZE,
        "num_semantic_quantizers": 1,
        "use_conv_shortcut": False,
        "hidden_act": "gelu",
        "max_position_embeddings": 8000,
        "norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "sliding_window": 250,
        "layer_scale_initial_scale": 0.01,
        **enc,
    }
    decoder_config: dict[str, Any] = {
        "codebook_size": CODEBOOK_SIZE,
        "semantic_codebook_size": 4096,
        "num_quantizers": NUM_CODE_GROUPS,
        "num_semantic_quantizers": 1,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "layer_scale_initial_scale": 0.01,
        "max_position_embeddings": 8000,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000,
        "sliding_window": 72,
        "upsample_rates": [8, 5, 4, 3],
        "upsampling_ratios": [2, 2],
        **dec,
    }
    return Qwen3TTSTokenizerV2Config(
        encoder_config=encoder_config,
        decoder_config=decoder_config,
        encoder_valid_num_quantizers=NUM_CODE_GROUPS,
        input_sample_rate=SAMPLE_RATE,
        output_sample_rate=SAMPLE_RATE,
        decode_upsample_rate=SAMPLES_PER_FRAME,
        encode_downsample_rate=SAMPLES_PER_FRAME,
    )


def talker_parameter_count(config: Any) -> int:
    """Parameters of talker + code predictor for ``config``, counted on the meta device.

    Allocates no weight memory, so it is cheap even for the full-size configs.
    """
    from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSTalkerForConditionalGeneration

    with torch.device("meta"):
        talker = Qwen3TTSTalkerForConditionalGeneration(config.talker_config)
    return sum(p.numel() for p in talker.parameters())


# --- Building checkpoints ------------------------------------------------------------------------


@contextlib.contextmanager
def _seeded(seed: int, device: str | torch.device = "cpu") -> Iterator[None]:
    """Seed torch's RNG for the block and restore the caller's RNG state afterwards."""
    dev = torch.device(device)
    cuda_devices = [dev.index or 0] if dev.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda_devices):
        torch.manual_seed(seed)
        yield


def _randomise_codebooks(module: torch.nn.Module, std: float = 1.0) -> None:
    """Codebooks start at zero (no init in the library); give them random centroids so codes
    actually change the decoded audio and the encoder's nearest-centroid search is not a tie."""
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import EuclideanCodebook
    from transformers.models.mimi.modeling_mimi import MimiEuclideanCodebook

    with torch.no_grad():
        for sub in module.modules():
            if isinstance(sub, EuclideanCodebook):
                sub.embedding_sum.normal_(0.0, std)
                sub.cluster_usage.fill_(1.0)
            elif isinstance(sub, MimiEuclideanCodebook):
                cast(torch.Tensor, sub.embed_sum).normal_(0.0, std)
                cast(torch.Tensor, sub.cluster_usage).fill_(1.0)
                sub._embed = None


def _variance_preserving_decoder_init(decoder: torch.nn.Module) -> None:
    """The library's init (normal, std 0.02) shrinks the signal ~10x per conv layer, so a random
    codec decoder outputs ~1e-8. Re-draw conv/linear weights with variance 1/fan_in instead."""
    with torch.no_grad():
        for mod in decoder.modules():
            if isinstance(mod, torch.nn.ConvTranspose1d):
                fan_in = mod.weight.shape[0] * mod.weight.shape[2] / mod.stride[0]
                mod.weight.normal_(0.0, fan_in**-0.5)
            elif isinstance(mod, (torch.nn.Conv1d, torch.nn.Linear)):
                mod.weight.normal_(0.0, mod.weight[0].numel() ** -0.5)


def _calibrate_codec_output(codec: Any, target_rms: float = 0.1, frames: int = 25) -> None:
    """Scale the decoder's last conv so random codes decode to noise of RMS ~``target_rms``
    (the output is clamped to [-1, 1]; unscaled it would be clipped square-wave noise)."""
    decoder = codec.decoder
    codes = torch.randint(0, CODEBOOK_SIZE, (1, NUM_CODE_GROUPS, frames), device=codec.device)
    with torch.no_grad():
        last = decoder.decoder[-1].conv
        last.bias.zero_()
        hidden = decoder.quantizer.decode(codes)
        hidden = decoder.pre_conv(hidden).transpose(1, 2)
        hidden = decoder.pre_transformer(inputs_embeds=hidden).last_hidden_state.permute(0, 2, 1)
        for blocks in decoder.upsample:
            for block in blocks:
                hidden = block(hidden)
        for block in decoder.decoder:
            hidden = block(hidden)
        rms = float(hidden.float().pow(2).mean().sqrt())
        if rms > 0:
            last.weight.mul_(target_rms / rms)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", "utf-8")


def _fix_root_config(out_dir: Path) -> None:
    """``save_pretrained`` writes ``"model_type": ""`` into speaker_encoder_config, whose
    ``__init__`` takes no extra kwargs: loading would raise TypeError. Strip it."""
    path = out_dir / "config.json"
    cfg = json.loads(path.read_text("utf-8"))
    spk = cfg.get("speaker_encoder_config") or {}
    spk.pop("model_type", None)
    cfg["speaker_encoder_config"] = spk
    _write_json(path, cfg)


def _save_text_tokenizer(tok: Any, out_dir: Path) -> None:
    tok.save_pretrained(str(out_dir))
    # Slow-tokenizer files too (the published repos ship vocab.json + merges.txt).
    tok.backend_tokenizer.model.save(str(out_dir))
    path = out_dir / "tokenizer_config.json"
    cfg = json.loads(path.read_text("utf-8"))
    cfg["processor_class"] = "Qwen3TTSProcessor"
    _write_json(path, cfg)


def _save_speech_tokenizer(codec: Any, out_dir: Path, max_shard_size: str) -> None:
    from transformers import EncodecFeatureExtractor

    st_dir = out_dir / "speech_tokenizer"
    st_dir.mkdir(parents=True, exist_ok=True)
    codec.save_pretrained(str(st_dir), safe_serialization=True, max_shard_size=max_shard_size)
    EncodecFeatureExtractor(
        feature_size=1,
        sampling_rate=SAMPLE_RATE,
        padding_value=0.0,
        chunk_length_s=None,
        overlap=None,
        return_attention_mask=True,
    ).save_pretrained(str(st_dir))


def _build(
    out_dir: str | Path,
    config: Any,
    codec_cfg: Any,
    tok: Any,
    *,
    seed: int,
    dtype: torch.dtype,
    device: str | torch.device,
    generation: dict[str, Any],
    max_shard_size: str,
) -> Path:
    from qwen_tts.core.models import Qwen3TTSForConditionalGeneration
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import (
        Qwen3TTSTokenizerV2Model,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with _seeded(seed, device), torch.device(device):
        model = Qwen3TTSForConditionalGeneration(config)
        codec = Qwen3TTSTokenizerV2Model(codec_cfg)
        _randomise_codebooks(codec)
        _variance_preserving_decoder_init(codec.decoder)
        _calibrate_codec_output(codec)
    model = model.to(dtype=dtype).eval()
    codec = codec.to(dtype=dtype).eval()

    model.save_pretrained(str(out), safe_serialization=True, max_shard_size=max_shard_size)
    _fix_root_config(out)
    # save_pretrained may write an HF GenerationConfig; qwen-tts reads this file as plain JSON.
    _write_json(out / "generation_config.json", generation)
    _save_text_tokenizer(tok, out)
    _save_speech_tokenizer(codec, out, max_shard_size)
    for path in out.rglob("*"):
        if path.is_file():
            path.chmod(0o644)  # safetensors files are written 0600; fixtures may be shared
    return out


def build_tiny_checkpoint(
    out_dir: str | Path,
    kind: ModelKind = "custom_voice",
    seed: int = 0,
) -> Path:
    """Write a tiny random Qwen3-TTS checkpoint of the real architecture to ``out_dir``.

    ``qwen_tts.Qwen3TTSModel.from_pretrained(out_dir, device_map="cpu", dtype=torch.float32)``
    loads it; ``kind="custom_voice"`` supports ``generate_custom_voice`` with the nine published
    speakers, ``kind="base"`` supports ``create_voice_clone_prompt`` / ``generate_voice_clone``.
    The same ``seed`` gives byte-identical weight files. Returns ``Path(out_dir)``.
    """
    tok = build_text_tokenizer()
    config = tiny_config(kind, text_vocab_size=512, text_ids=_text_ids(tok))
    generation = dict(_GENERATION_DEFAULTS, max_new_tokens=TINY_MAX_NEW_TOKENS)
    return _build(
        out_dir,
        config,
        codec_config(tiny=True),
        tok,
        seed=seed,
        dtype=torch.float32,
        device="cpu",
        generation=generation,
        max_shard_size="10GB",
    )


def build_random_checkpoint(
    out_dir: str | Path,
    size: ModelSize = "0.6B",
    kind: ModelKind = "custom_voice",
    dtype: torch.dtype = torch.bfloat16,
    *,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> Path:
    """Write a full-size (0.6B or 1.7B) random-weight checkpoint, laid out like the published one.

    For timing on a GPU machine that cannot fetch the real weights: the talker, code predictor,
    speaker encoder (base) and codec have the published shapes; the text tokenizer is the tiny
    byte-level one (one token per byte, so prompts are a few times longer than with the real
    Qwen vocabulary) and the config's text-side ids point at it. ``device="cuda"`` initialises
    the weights on the GPU (much faster than CPU for 1.7B). Needs ~4 bytes per parameter of
    memory while building (0.6B: ~1.0B parameters with codec).
    """
    tok = build_text_tokenizer()
    config = full_size_config(size, kind)
    for key, value in _text_ids(tok).items():
        setattr(config, key, value)
    return _build(
        out_dir,
        config,
        codec_config(tiny=False),
        tok,
        seed=seed,
        dtype=dtype,
        device=device,
        generation=dict(_GENERATION_DEFAULTS),
        max_shard_size="20GB",
    )
