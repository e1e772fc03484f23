"""Qwen3-TTS weights and what every engine over them shares.

Loading is the real path: ``qwen_tts.Qwen3TTSModel.from_pretrained`` of a Hugging Face model id
or a local directory (:class:`QwenModel`, once per device), on the device
:func:`~gateway.tts.device.resolve_device` chooses. The gateway's engine over it is
:class:`gateway.tts.batched.BatchedQwenEngine`; the batch-1 slot engine it replaced lives in
``bench/slot_engine.py`` as the batching benchmark's baseline.

The pieces of qwen-tts / faster-qwen3-tts this reaches into are pinned (see pyproject.toml);
``tests/unit/tts/test_seam.py`` fails loudly if either library changes them.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import math
import os
import shutil
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gateway.errors import ModelLoadError
from gateway.tts.device import resolve_device

log = logging.getLogger(__name__)
# faster-qwen3-tts warns at construction that it "could not infer sample rate ... defaulting to
# 24000 Hz": qwen-tts's 12 Hz tokenizer does not expose it, and 24 kHz is right for every model.
logging.getLogger("faster_qwen3_tts.model").setLevel(logging.ERROR)

DEFAULT_MODEL = "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice"
#: Frames of already-decoded left context re-decoded with each chunk (faster-qwen3-tts uses 25):
#: the codec decoder is causal but has a receptive field, so a window without context clicks.
CODEC_LEFT_CONTEXT = 25
#: Default codec frames per chunk: 1 frame (80 ms) first, then growing; the last value repeats.
DEFAULT_CHUNK_SCHEDULE = (1, 2, 4, 8)


def parse_chunk_schedule(spec: str | Sequence[int]) -> tuple[int, ...]:
    """``"1,2,4,8"`` -> ``(1, 2, 4, 8)``; every entry a positive number of codec frames."""
    if isinstance(spec, str):
        parts = [p for p in spec.replace(" ", "").split(",") if p]
        try:
            values = tuple(int(p) for p in parts)
        except ValueError:
            raise ValueError(f"chunk schedule {spec!r} must be comma-separated integers") from None
    else:
        values = tuple(int(v) for v in spec)
    if not values or any(v < 1 or v > 64 for v in values):
        raise ValueError(f"chunk schedule {spec!r} needs 1..64 codec frames per entry")
    return values


def default_max_frames(text: str) -> int:
    """Cap on codec frames for ``text``: twice a slow speaking rate plus 2 s, at 12.5 frames/s.

    Speech runs ~15 characters per second; a random or confused model may never emit EOS, and
    without a cap one request would hold a GPU slot until the static cache is full.
    """
    seconds = 2.0 + 0.15 * len(text)
    return math.ceil(seconds * 12.5)


#: ``--model tiny``: a tiny random-weight checkpoint built on first use (offline smoke runs).
TINY_ALIAS = "tiny"


def resolve_model(model: str) -> str:
    """Map the ``tiny`` alias to a cached tiny checkpoint; anything else is returned unchanged.

    The tiny checkpoint has the real architecture and random weights: it exercises the whole
    gateway offline, and it speaks noise.
    """
    if model != TINY_ALIAS:
        return model
    with _quiet_stdout():
        from gateway.tts import tiny

    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "qwen3-tts-gateway"
    target = cache / "tiny-custom_voice"
    if not _tiny_is_current(target):
        cache.mkdir(parents=True, exist_ok=True)
        # One builder at a time (several processes start at once: test workers, a gateway
        # and its tools), and never a half-written checkpoint where a reader looks: it is
        # built beside the target and moved into place whole, so a build killed midway
        # leaves nothing a later run would take for a checkpoint.
        with open(cache / "tiny-custom_voice.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not _tiny_is_current(target):
                building = Path(tempfile.mkdtemp(prefix=".tiny-building-", dir=cache))
                try:
                    tiny.build_tiny_checkpoint(building)
                    if target.exists():
                        shutil.rmtree(target)
                    os.replace(building, target)
                finally:
                    shutil.rmtree(building, ignore_errors=True)
    log.warning("model 'tiny': random weights from %s; callers will hear noise", target)
    return str(target)


def _tiny_is_current(target: Path) -> bool:
    """Whether a cached tiny checkpoint is what this version builds: one built by an older
    version with another frame budget (``max_new_tokens``) is built again."""
    import json

    from gateway.tts.tiny import TINY_MAX_NEW_TOKENS

    if not (target / "model.safetensors").exists():
        return False
    try:
        generation = json.loads((target / "generation_config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(generation, dict) and generation.get("max_new_tokens") == TINY_MAX_NEW_TOKENS


def _looks_like_path(model: str) -> bool:
    return model.startswith(("/", "./", "../", "~")) or os.path.isabs(model)


class QwenModel:
    """Qwen3-TTS weights loaded once per device, shared by every engine on it.

    Each engine over it owns its static KV caches and CUDA graphs; the modules
    themselves are shared read-only. The one piece of mutable module state, the talker's
    ``rope_deltas`` written during prefill, is guarded by :attr:`prefill_lock`.

    On the CPU the talker's linear layers run on oneDNN over prepacked weights
    (``cpu_linear="onednn"``, :mod:`gateway.tts.cpu_linear`); ``"mkl"`` keeps torch's default
    kernels, for benchmarks that compare the two. :attr:`cpu_linear` says which is in use:
    ``"onednn"`` where any layer was packed, else ``"default"`` (torch's own kernels: MKL on
    the CPU, cuBLAS on CUDA).
    """

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        device: str = "auto",
        dtype: str = "auto",
        attn_implementation: str = "sdpa",
        cpu_linear: str = "onednn",
    ) -> None:
        from gateway.tts import cpu_linear as cpu_linear_kernels

        if cpu_linear not in cpu_linear_kernels.KERNELS:
            raise ValueError(f"cpu_linear must be one of {cpu_linear_kernels.KERNELS}, "
                             f"not {cpu_linear!r}")
        model = resolve_model(model)
        self.model_id = model
        self.device = resolve_device(device)
        self.base, self.torch_dtype = _load_base(model, self.device, dtype, attn_implementation)
        inner = self.base.model
        if attn_implementation == "sdpa":
            from gateway.tts import attention

            # The batched step's masked attention without a copy of every key and value head
            # (on the CPU through SDPA's own GQA, on CUDA by folding the query heads).
            attention.install(inner)
        if not self.on_cuda and cpu_linear == "onednn":
            # Every frame on the CPU is almost all the talker's matrix products: oneDNN over
            # prepacked weights runs a step's few rows ~2x faster than MKL (cpu_linear.py).
            swapped = cpu_linear_kernels.install(inner.talker)
            log.info("talker linears on oneDNN with prepacked weights: %d layers", swapped)
        self.cpu_linear = cpu_linear_kernels.describe(inner.talker)
        self.speakers = tuple(sorted(s.lower() for s in (inner.get_supported_speakers() or [])))
        self.languages = tuple(
            sorted(lang.capitalize() for lang in (inner.get_supported_languages() or []))
        )
        self.model_type = str(inner.tts_model_type)
        self.model_size = str(inner.tts_model_size)
        # qwen-tts reads the checkpoint's generation_config.json into generate_config; its
        # max_new_tokens bounds a generation that names no length (8192 in the published
        # checkpoints: no bound in practice; 64 in the tiny one, which never samples EOS).
        generation = getattr(inner, "generate_config", None) or {}
        budget = generation.get("max_new_tokens")
        self.max_new_tokens: int | None = int(budget) if budget else None
        self.prefill_lock = threading.Lock()

    def default_frames(self, text: str) -> int:
        """Codec frames a request for ``text`` may take when it names no ``max_frames``:
        :func:`default_max_frames`, within the checkpoint's ``max_new_tokens`` (as qwen-tts's
        own ``generate`` bounds it)."""
        frames = default_max_frames(text)
        return frames if self.max_new_tokens is None else min(frames, self.max_new_tokens)

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def render_settings(self, codec_decode: str) -> str:
        """What besides the weights changes the audio an engine over this model renders (the
        dtype, and how the codec is decoded): part of every prompt-cache key."""
        dtype = str(self.torch_dtype).removeprefix("torch.")
        return f"dtype={dtype},decode={codec_decode}"

    @functools.cached_property
    def fingerprint(self) -> str:
        """Model id and revision: the hub commit when known, else a digest of the local files.

        A local checkpoint is identified by its config, its generation defaults (their
        ``max_new_tokens`` bounds a prompt's length) and the first 16 MB of its weights plus
        their size (hashing gigabytes at start-up would cost seconds); that changes whenever
        the weights do.
        """
        import hashlib

        commit = getattr(self.base.model.config, "_commit_hash", None)
        root = Path(self.model_id)
        if not root.is_dir():
            return f"{self.model_id}@{commit or 'unknown'}"
        digest = hashlib.sha256()
        for name in ("config.json", "generation_config.json", "model.safetensors",
                     "speech_tokenizer/model.safetensors"):
            path = root / name
            if path.is_file():
                digest.update(name.encode())
                digest.update(str(path.stat().st_size).encode())
                with path.open("rb") as handle:
                    digest.update(handle.read(16 * 1024 * 1024))
        return f"local:{digest.hexdigest()[:16]}"


class OverSharedModel:
    """What an engine over a :class:`QwenModel` reports of it (the slot and batched engines'
    shared part of the Engine API): the model's identity, speakers and languages, and the
    render settings of its audio (dtype and the engine's codec decode mode)."""

    shared: QwenModel
    codec_decode: str

    @property
    def fingerprint(self) -> str:
        return self.shared.fingerprint

    @property
    def render_settings(self) -> str:
        return self.shared.render_settings(self.codec_decode)

    @property
    def speakers(self) -> Sequence[str]:
        return self.shared.speakers

    @property
    def languages(self) -> Sequence[str]:
        return self.shared.languages


def _load_base(model: str, device: str, dtype: str, attn: str) -> tuple[Any, Any]:
    """Load the model through qwen-tts (``from_pretrained`` of an id or a local directory)."""
    import torch

    with _quiet_stdout():
        from qwen_tts import Qwen3TTSModel

    if _looks_like_path(model) and not Path(model).expanduser().is_dir():
        raise ModelLoadError(
            f"cannot load Qwen3-TTS model: local directory {model} does not exist. Pass a "
            "checkpoint directory or a Hugging Face model id (e.g. "
            f"{DEFAULT_MODEL}) with --model / GATEWAY_MODEL."
        )
    model = str(Path(model).expanduser()) if _looks_like_path(model) else model
    on_cuda = device.startswith("cuda")
    if dtype == "auto":
        torch_dtype = torch.bfloat16 if on_cuda else torch.float32
    else:
        torch_dtype = getattr(torch, dtype)
    try:
        base = Qwen3TTSModel.from_pretrained(
            model, device_map=device, dtype=torch_dtype, attn_implementation=attn
        )
    except Exception as exc:
        raise ModelLoadError(_load_error_message(model, exc)) from exc
    return base, torch_dtype


def _load_error_message(model: str, exc: BaseException) -> str:
    local = Path(model).expanduser()
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if local.exists():
        return f"cannot load Qwen3-TTS model from local directory {local}: {detail}"
    hint = (
        "it is not a local directory and the Hugging Face hub could not provide it"
        if os.environ.get("HF_HUB_OFFLINE") != "1"
        else "HF_HUB_OFFLINE=1 and it is not in the local cache"
    )
    return (
        f"cannot load Qwen3-TTS model {model!r}: {hint} ({detail}). Pass a local checkpoint "
        "directory with --model /path/to/model (or GATEWAY_MODEL=/path/to/model); "
        "`gateway model tiny DIR` builds a tiny offline one for smoke tests."
    )


class _quiet_stdout:
    """qwen_tts prints a flash-attn banner and a SoX warning at import; keep logs clean."""

    def __enter__(self) -> None:
        import contextlib
        import io

        self._ctx = contextlib.redirect_stdout(io.StringIO())
        self._ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(None, None, None)
