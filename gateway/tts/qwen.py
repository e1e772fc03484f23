"""Qwen3-TTS streaming engine: faster-qwen3-tts's CUDA graphs on a GPU, the same loop eager on CPU.

Loading is the real path: ``qwen_tts.Qwen3TTSModel.from_pretrained`` of a Hugging Face model id
or a local directory. Generation is our own streaming loop over faster-qwen3-tts's two step
functions (the talker's one-token decode over a static KV cache, and the code predictor's
15-step loop), because the library's loop has a fixed chunk size and calls
``torch.cuda.synchronize`` unconditionally. Owning the loop gives us:

- a growing chunk schedule (first chunk of 1-2 codec frames: the first chunk sets the latency,
  later chunks only have to stay ahead of playback);
- a CPU path that is the *same* loop: on CPU the "graphs" are replaced at one seam
  (:class:`_EagerReplay` stands in for ``torch.cuda.CUDAGraph``) so streaming, chunking, codec
  windowing and cancellation behave identically and are tested on CPU with the tiny checkpoint.

The seam is pinned to faster-qwen3-tts 0.2.6 / qwen-tts 0.1.1 (see pyproject.toml);
``tests/test_tts_seam.py`` fails loudly if either library changes the pieces we rely on.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gateway.audio.condition import LeadingSilenceTrimmer
from gateway.errors import EngineError, ModelLoadError
from gateway.tts.chunking import ChunkPlanner
from gateway.tts.codec_stream import StreamingCodecDecoder, WindowedCodecDecoder
from gateway.tts.device import resolve_device
from gateway.tts.engine import Engine, Sampling, SpeechRequest, VoicePrompt

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


class _EagerReplay:
    """Stands in for ``torch.cuda.CUDAGraph`` on CPU: ``replay()`` runs the captured step eagerly.

    faster-qwen3-tts's ``PredictorGraph.run`` / ``TalkerGraph.run`` fill static input buffers,
    call ``self.graph.replay()`` and read static output buffers. Swapping the graph object for
    this keeps every other line of their code path, buffers and static caches identical.
    """

    def __init__(self, step: Callable[[], Any]) -> None:
        # ``step`` is a method of the graph holder that keeps this replayer: a strong reference
        # would make a cycle, and a ready gateway freezes its start-up heap out of the cycle
        # collector (gateway/heap.py), so the start-up holders a CPU rebuild replaces (their
        # static caches) would stay until the gateway stops. Weakly: the holder goes when its
        # owner drops it.
        self._step = weakref.WeakMethod(step)

    def replay(self) -> None:
        step = self._step()
        if step is None:
            raise RuntimeError("eager replay after its graph holder was freed")
        step()


def _eager_capture(graph_obj: Any) -> None:
    """CPU replacement for ``PredictorGraph.capture`` / ``TalkerGraph.capture``.

    Does what capture does minus the CUDA stream/graph work: initialise the static cache layers
    and precompute the attention masks, then install an eager replayer.
    """
    graph_obj._init_cache_layers()
    graph_obj._build_attention_masks()
    step = graph_obj._full_loop if hasattr(graph_obj, "_full_loop") else graph_obj._decode_step
    graph_obj.graph = _EagerReplay(step)
    graph_obj.captured = True


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
    if not (target / "model.safetensors").exists() or not _tiny_is_current(target):
        tiny.build_tiny_checkpoint(target)
    log.warning("model 'tiny': random weights from %s; callers will hear noise", target)
    return str(target)


def _tiny_is_current(target: Path) -> bool:
    """Whether a cached tiny checkpoint is what this version builds: one built by an older
    version with another frame budget (``max_new_tokens``) is built again."""
    import json

    from gateway.tts.tiny import TINY_MAX_NEW_TOKENS

    try:
        generation = json.loads((target / "generation_config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(generation, dict) and generation.get("max_new_tokens") == TINY_MAX_NEW_TOKENS


def _looks_like_path(model: str) -> bool:
    return model.startswith(("/", "./", "../", "~")) or os.path.isabs(model)


class QwenModel:
    """Qwen3-TTS weights loaded once per device, shared by every engine slot on it.

    Each slot (:class:`QwenEngine`) owns its static KV caches and CUDA graphs; the modules
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


class QwenEngine(OverSharedModel, Engine):
    """One engine slot: streaming Qwen3-TTS on CUDA graphs, or the same loop eager on CPU.

    ``model`` is a model id / directory (the slot loads its own weights) or a shared
    :class:`QwenModel` (slots on one GPU share weights and hold their own caches and graphs).
    """

    def __init__(
        self,
        model: str | QwenModel = DEFAULT_MODEL,
        device: str = "auto",
        dtype: str = "auto",
        chunk_schedule: str | Sequence[int] = DEFAULT_CHUNK_SCHEDULE,
        max_seq_len: int | None = None,
        codec_decode: str = "incremental",
        trim_leading_silence: bool = True,
        adaptive_chunks: bool = True,
        attn_implementation: str = "sdpa",
        record_codes: bool = False,
    ) -> None:
        shared = model if isinstance(model, QwenModel) else QwenModel(
            model, device, dtype, attn_implementation
        )
        if codec_decode not in ("incremental", "windowed"):
            raise ValueError("codec_decode must be 'incremental' or 'windowed'")
        self.shared = shared
        self.model_id = shared.model_id
        self.device = shared.device
        self.chunk_schedule = parse_chunk_schedule(chunk_schedule)
        # The talker's static cache and its per-position mask table scale with max_seq_len;
        # 1024 positions still leave ~70 s of speech after a long prompt, and keep CPU set-up
        # short (the 2048-entry mask table alone takes ~0.8 s on a 2-core CPU).
        self.max_seq_len = max_seq_len or (2048 if shared.on_cuda else 1024)
        self.codec_decode = codec_decode
        self.trim_leading_silence = trim_leading_silence
        self.adaptive_chunks = adaptive_chunks
        self._wrapper = _graph_holders(shared, self.max_seq_len)
        self._base = shared.base
        #: With ``record_codes`` (tests and debugging compare decodes): the codec frames of the
        #: most recent stream, chunk by chunk. Off in production: a slot would otherwise hold
        #: its last utterance's code tensors until its next one, for as long as it is idle.
        self.record_codes = record_codes
        self.last_codes: list[Any] = []

    # --- Engine API ---------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return f"qwen3-tts {self.model_id} on {self.device}"

    def warmup(self, voices: Sequence[tuple[str, str] | VoicePrompt] = ()) -> None:
        """Capture CUDA graphs (GPU) / build static caches (CPU), then one generation per voice.

        ``voices`` are the ``(speaker, language)`` pairs or cloned voices the gateway speaks
        with; the first real caller then never pays for a first-use path. A Base model given no
        cloned voice has nothing to say and only loads.
        """
        t0 = time.perf_counter()
        if not voices and self.shared.model_type == "custom_voice":
            voices = [(self.speakers[0] if self.speakers else "ryan", "English")]
        for voice in voices:
            if isinstance(voice, VoicePrompt):
                request = SpeechRequest(text="Hello.", voice_prompt=voice, max_frames=8,
                                        min_frames=8)
            else:
                request = SpeechRequest(text="Hello.", speaker=voice[0], language=voice[1],
                                        max_frames=8, min_frames=8)
            for _ in self.stream(request):
                pass
        log.info("engine warm: %s (%d voice(s)) in %.2f s", self.name, max(1, len(voices)),
                 time.perf_counter() - t0)

    def stream(
        self, request: SpeechRequest, should_stop: Callable[[], bool] | None = None
    ) -> Generator[np.ndarray, None, None]:
        kind = self.shared.model_type
        if request.voice_prompt is None and kind != "custom_voice":
            raise EngineError(
                f"{self.model_id} is a {kind!r} model: it speaks only with a registered cloned "
                "voice; for built-in speakers use a CustomVoice model "
                "(e.g. Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice)"
            )
        if request.voice_prompt is not None and kind != "base":
            raise EngineError(
                f"cloned voice {request.voice_prompt.name!r} needs a Base model "
                f"(e.g. Qwen/Qwen3-TTS-12Hz-0.6B-Base); {self.model_id} is {kind!r}"
            )
        if request.sampling not in (None, Sampling()):
            raise EngineError("the slot engine samples with the model defaults only; per-turn "
                              "sampling needs the batched engine")
        try:
            self.validate(request)
        except ValueError as exc:
            raise EngineError(str(exc)) from None
        return self._stream(request, should_stop or _never)

    def rebuild(self) -> None:
        """Make the slot usable again after a failure inside the engine.

        On CPU the graph holders are rebuilt from scratch. On CUDA the captured graphs are kept
        and only their static caches are reset: re-capturing while other slots run on the same
        GPU would fail (graph capture forbids unsafe CUDA calls from other threads), and a
        sticky CUDA error leaves nothing to rebuild anyway (the reset then raises and the
        scheduler retires the slot).
        """
        import torch

        if self.shared.on_cuda:
            self._wrapper.predictor_graph.static_cache.reset()
            self._wrapper.talker_graph.static_cache.reset()
            torch.cuda.synchronize()
        else:
            self._wrapper = _graph_holders(self.shared, self.max_seq_len)

    # --- the loop -----------------------------------------------------------------------------

    def _stream(
        self, request: SpeechRequest, should_stop: Callable[[], bool]
    ) -> Generator[np.ndarray, None, None]:
        import torch

        with torch.inference_mode():
            if request.seed is not None:
                torch.manual_seed(request.seed)
            # 0.6B models ignore instruct (faster-qwen3-tts drops it for "0b6" too).
            instruct = request.instruct if self.shared.model_size != "0b6" else None
            max_frames = request.max_frames or self.shared.default_frames(request.text)
            prefill = self._prefill(request, instruct)
            ref_codes = prefill[-1]
            codes = self._generate_codes(request, prefill, max_frames, should_stop)
            decoded = (
                self._decode_incremental(codes, ref_codes)
                if self.codec_decode == "incremental"
                else self._decode_windowed(codes, ref_codes)
            )
            trimmer = LeadingSilenceTrimmer() if self.trim_leading_silence else None
            try:
                for audio in decoded:
                    if trimmer is not None:
                        audio = trimmer.push(audio)
                        if not len(audio):
                            continue
                    yield audio
            finally:
                decoded.close()
                codes.close()

    def _prefill(self, request: SpeechRequest, instruct: str | None) -> tuple[Any, ...]:
        """Build the talker inputs and run the prefill; returns what the decode loop needs."""
        w = self._wrapper
        voice = request.voice_prompt
        ref_codes = None
        # The talker module is shared between slots and prefill writes talker.rope_deltas.
        with self.shared.prefill_lock:
            if voice is None:
                _m, talker, config, tie, tam, tth, tpe = w._prepare_generation_custom(
                    text=request.text,
                    language=request.language,
                    speaker=request.speaker.lower(),
                    instruct=instruct,
                    non_streaming_mode=True,
                )
            else:
                # A cloned voice (ICL): the reference clip's codes and transcript lead the
                # prompt; upstream's voice-clone default streams the text in (non_streaming
                # False).
                _m, talker, config, tie, tam, tth, tpe, ref_codes = w._prepare_generation(
                    text=request.text,
                    language=request.language,
                    ref_text=voice.ref_text,
                    non_streaming_mode=False,
                    voice_clone_prompt=voice.prompt,
                    instruct=instruct,
                )
            out = talker.forward(
                inputs_embeds=tie,
                attention_mask=tam,
                use_cache=True,
                output_hidden_states=True,
                return_dict=True,
                trailing_text_hidden=tth,
                tts_pad_embed=tpe,
                generation_step=None,
                past_hidden=None,
                past_key_values=None,
            )
            prefill_len = w.talker_graph.prefill_kv(out.past_key_values)
            w.talker_graph.set_generation_state(tam, getattr(talker, "rope_deltas", None))
        return talker, config, tie, tth, tpe, out, prefill_len, ref_codes

    def _generate_codes(
        self,
        request: SpeechRequest,
        prefill: tuple[Any, ...],
        max_frames: int,
        should_stop: Callable[[], bool],
    ) -> Generator[Any, None, None]:
        """Yield ``[n, 16]`` codec-id tensors following the chunk schedule.

        Mirrors ``faster_qwen3_tts.streaming.fast_generate_streaming`` (0.2.6): prefill through
        the HF forward, copy its KV into the static cache, then per frame one code-predictor
        graph replay and one talker graph replay. ``should_stop`` is checked before every frame,
        so a cancelled turn frees its slot within one frame (plus the decode in flight).
        """
        import torch
        from faster_qwen3_tts.sampling import apply_repetition_penalty, sample_logits

        w = self._wrapper
        predictor_graph, talker_graph = w.predictor_graph, w.talker_graph
        on_cuda = self.shared.on_cuda
        # Sampling defaults of faster-qwen3-tts / qwen-tts generate_config.
        temperature, top_k, top_p, repetition_penalty = 0.9, 50, 1.0, 1.05
        # EOS is suppressed for the first frames (2 upstream; ``min_frames`` forces a length).
        min_frames = max(2, request.min_frames or 0)

        talker, config, tie, tth, tpe, out, prefill_len, _ref = prefill
        eos_id = int(config.codec_eos_token_id)
        vocab_size = int(config.vocab_size)
        # The top 1024 ids of the codec vocabulary are control tokens; only EOS may be sampled.
        suppress_mask = torch.zeros(vocab_size, dtype=torch.bool, device=tie.device)
        suppress_mask[max(0, vocab_size - 1024) :] = True
        suppress_mask[eos_id] = False
        predictor = talker.code_predictor
        talker_codec_embed = talker.get_input_embeddings()
        talker_codec_head = talker.codec_head
        predictor_codec_embeds = predictor.get_input_embeddings()
        num_code_groups = int(config.num_code_groups)

        past_hidden = out.past_hidden
        gen_step = out.generation_step
        token = sample_logits(
            out.logits[:, -1, :],
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            do_sample=True,
            suppress_mask=suppress_mask,
            suppress_tokens=[eos_id],
        )
        del out
        max_frames = min(max_frames, talker_graph.max_seq_len - 1 - prefill_len)

        self.last_codes = []
        planner = ChunkPlanner(self.chunk_schedule, adaptive=self.adaptive_chunks)
        target = planner.next_size()
        buffer: list[Any] = []
        history: list[Any] = []
        for step in range(max_frames):
            if should_stop() or int(token.item()) == eos_id:
                break
            last_id_hidden = talker_codec_embed(token.unsqueeze(1))
            pred_input = torch.cat((past_hidden, last_id_hidden), dim=1)
            codebook_ids = predictor_graph.run(pred_input)
            buffer.append(torch.cat([token.view(1), codebook_ids]))
            history.append(token)

            if len(buffer) >= target:
                if on_cuda:
                    torch.cuda.synchronize()
                chunk = torch.stack(buffer)
                if self.record_codes:
                    self.last_codes.append(chunk)
                yield chunk
                # The consumer asks for more once this chunk is decoded and handed on.
                planner.chunk_done(len(buffer))
                buffer = []
                target = planner.next_size()

            if step == max_frames - 1:
                break
            codec_hiddens = [last_id_hidden]
            for i in range(num_code_groups - 1):
                codec_hiddens.append(predictor_codec_embeds[i](codebook_ids[i].view(1, 1)))
            inputs_embeds = torch.cat(codec_hiddens, dim=1).sum(1, keepdim=True)
            if gen_step < tth.shape[1]:
                inputs_embeds = inputs_embeds + tth[:, gen_step].unsqueeze(1)
            else:
                inputs_embeds = inputs_embeds + tpe
            hidden_states = talker_graph.run(inputs_embeds, position=prefill_len + step)
            logits = talker_codec_head(hidden_states[:, -1, :]).unsqueeze(0)
            if repetition_penalty != 1.0:
                logits = apply_repetition_penalty(logits, torch.stack(history), repetition_penalty)
            token = sample_logits(
                logits.squeeze(0),
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                do_sample=True,
                suppress_mask=suppress_mask,
                suppress_tokens=[eos_id] if len(history) < min_frames else None,
            )
            past_hidden = hidden_states[:, -1:, :].clone()
            gen_step += 1
        if buffer and not should_stop():
            if on_cuda:
                torch.cuda.synchronize()
            chunk = torch.stack(buffer)
            if self.record_codes:
                self.last_codes.append(chunk)
            yield chunk

    def _decode_incremental(
        self, codes: Generator[Any, None, None], ref_codes: Any = None
    ) -> Generator[np.ndarray, None, None]:
        """Decode each chunk's new frames only, carrying the codec's state (see codec_stream).

        With a cloned voice the generated codes continue the reference clip's codec stream:
        the decoder is primed with the reference frames and their audio is discarded.
        """
        decoder = StreamingCodecDecoder(self._base.model.speech_tokenizer.model.decoder)
        if ref_codes is not None:
            decoder.decode(ref_codes)
        for chunk in codes:
            yield decoder.decode(chunk)

    def _decode_windowed(
        self, codes: Generator[Any, None, None], ref_codes: Any = None
    ) -> Generator[np.ndarray, None, None]:
        """Decode each chunk with up to 25 frames of left context (faster-qwen3-tts's way);
        a cloned voice's reference frames are left context for the first windows."""
        decoder = WindowedCodecDecoder(self._base.model.speech_tokenizer, CODEC_LEFT_CONTEXT)
        if ref_codes is not None:
            decoder.prime(ref_codes)
        for chunk in codes:
            yield decoder.decode(chunk)


def _never() -> bool:
    return False


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


def build_mask_table(
    graph: Any, attention_mask: Any = None, *, fallback: Callable[[Any], None]
) -> None:
    """A ``TalkerGraph``'s per-position attention masks, built in one vectorised step.

    faster-qwen3-tts builds the table with one ``transformers`` ``create_causal_mask`` call per
    position, at every slot's start, rebuild, and first turn with a new padding: 4 s for 1,024
    positions with a padding mask on this CPU, against 13 ms here (``bench/mask_table.py``); the
    tiny model's whole warm-up was mostly this. Position ``i`` attends to the keys
    ``<= i`` that ``attention_mask`` does not pad. The library's own masks at the first, a
    middle and the last position must equal ours; when they do not (a sliding window, a mask
    format this code does not know), the library builds the table itself (``fallback``).
    """
    import torch
    from transformers.masking_utils import create_causal_mask

    config = graph.model.config
    size = int(graph.max_seq_len)
    if getattr(config, "sliding_window", None) is not None:
        fallback(attention_mask)
        return
    dummy = torch.zeros(1, 1, graph.hidden_size, dtype=graph.dtype, device=graph.device)

    def library(position: int) -> Any:
        return create_causal_mask(
            config=config, input_embeds=dummy, attention_mask=attention_mask,
            cache_position=torch.tensor([position], device=graph.device),
            past_key_values=graph.static_cache,
        )

    first = library(0)
    if not (isinstance(first, torch.Tensor) and first.dtype == torch.bool
            and first.dim() == 4 and tuple(first.shape[1:]) == (1, 1, size)):
        fallback(attention_mask)
        return
    keys = torch.arange(size, device=first.device)
    causal = keys[None, :] <= keys[:, None]  # [position, key]
    table = causal[:, None, None, None, :].expand(size, first.shape[0], 1, 1, size)
    if attention_mask is not None:
        table = table & attention_mask.to(device=first.device, dtype=torch.bool)[
            None, :, None, None, :size]
    table = table.contiguous()
    if not all(torch.equal(table[p], first if p == 0 else library(p))
               for p in (0, size // 2, size - 1)):
        fallback(attention_mask)
        return
    graph.attn_mask_table = list(table.unbind(0))
    if graph.attn_mask is None:
        graph.attn_mask = graph.attn_mask_table[0].clone()
    else:
        graph.attn_mask.copy_(graph.attn_mask_table[0])


def _graph_holders(shared: QwenModel, max_seq_len: int) -> Any:
    """One slot's faster-qwen3-tts graph holders (own static caches) over the shared weights."""
    with _quiet_stdout():
        from faster_qwen3_tts.model import FasterQwen3TTS
        from faster_qwen3_tts.predictor_graph import PredictorGraph
        from faster_qwen3_tts.talker_graph import TalkerGraph
    import torch

    base, torch_dtype = shared.base, shared.torch_dtype
    talker = base.model.talker
    talker_config = base.model.config.talker_config
    pred_config = talker.code_predictor.model.config
    # The graph holders ask torch.cuda for the device index when the device has none; on CPU
    # an explicit index keeps them off the CUDA runtime.
    graph_device: Any = shared.device if shared.on_cuda else torch.device("cpu", 0)
    predictor_graph = PredictorGraph(
        talker.code_predictor,
        pred_config,
        talker_config.hidden_size,
        device=graph_device,
        dtype=torch_dtype,
        do_sample=True,
        top_k=50,
        temperature=0.9,
    )
    talker_graph = TalkerGraph(
        talker.model, talker_config, device=graph_device, dtype=torch_dtype, max_seq_len=max_seq_len
    )
    # The patched methods reach their holder through a weak proxy: stored on the holder, a
    # strong reference would make a cycle, and a ready gateway freezes its start-up heap out of
    # the cycle collector (gateway/heap.py), so the start-up holders a CPU rebuild replaces
    # (and their static caches) would stay until the gateway stops.
    talker_ref = weakref.proxy(talker_graph)
    predictor_ref = weakref.proxy(predictor_graph)
    library_masks = functools.partial(TalkerGraph._build_attention_masks, talker_ref)
    talker_graph._build_attention_masks = functools.partial(
        build_mask_table, talker_ref, fallback=library_masks
    )
    if not shared.on_cuda:
        predictor_graph.capture = lambda num_warmup=0: _eager_capture(predictor_ref)
        talker_graph.capture = lambda prefill_len=0, num_warmup=0: _eager_capture(talker_ref)
    with _quiet_stdout():
        return FasterQwen3TTS(
            base_model=base,
            predictor_graph=predictor_graph,
            talker_graph=talker_graph,
            device=shared.device,
            dtype=torch_dtype,
            max_seq_len=max_seq_len,
        )


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
