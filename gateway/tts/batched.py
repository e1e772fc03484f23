"""The batched Qwen3-TTS engine: every active turn is a row, every step advances all rows a frame.

One :class:`BatchedQwenEngine` owns a device. A step takes the rows that advance now and runs,
for all of them at once, the code predictor's 15-step loop (the frame's codebooks 1-15) and
then the talker's one-token decode (the next frame's first codebook), over

- a :class:`~gateway.tts.batch_cache.RowKVCache` with one row per turn: each row has its own
  write position, attention mask (keys up to its own length) and multimodal-RoPE position
  (its position plus its own ``rope_deltas`` from the prefill), so turns that joined at
  different times and have prompts of different lengths share a step;
- per-row sampling (:mod:`gateway.tts.batch_sampling`): each row its own temperature, top-k,
  top-p, repetition penalty over its own history, EOS suppressed for its own first frames, and
  its own seeded ``torch.Generator``, so a seeded turn gives the same codes whatever it shares
  steps with (up to the float effects documented in docs/architecture/engine.md).

Rows ``[0, n)`` of the cache are the live turns (a leaving turn's row is refilled by moving the
last row down), and a step runs over the smallest batch bucket >= n; rows in it that do not
advance (padding, prefilling turns, turns sitting a step out) are masked: their KV write goes
to a scratch position nobody attends and their state is left as it was.

The step reads and writes only static buffers, so on CUDA it is captured once per
(batch bucket, attended length) as a CUDA graph and replayed, every graph at warm-up; on CPU the
same body runs eagerly behind the same seam (:func:`gateway.tts.graphs.capture`), or, with graphs
forced on, through the capture stand-in that holds it to CUDA capture's rules (tests, dry runs).
The step's outputs reach the host in one copy per step for all rows (the codes for the codec,
the next tokens for the EOS check): no host sync per row.

A new turn's prefill (its prompt through the talker, eagerly, in chunks of ``prefill_chunk``
tokens) runs between steps; :mod:`gateway.tts.scheduler` decides how much of it fits before
the running rows need their next frame. Codec decoding is incremental, chunked by each row's
own :class:`~gateway.tts.chunking.ChunkPlanner`, and batched: every row due a chunk of the same
size decodes in one call of :class:`~gateway.tts.codec_batch.BatchedCodecDecoder` (a graph per
chunk size and batch bucket in graph mode), and all their audio reaches the host in one copy.

The pieces of qwen-tts / faster-qwen3-tts this reaches into are pinned by
``tests/unit/tts/test_seam.py``: the talker and predictor forwards, which call only
``past_key_values.update``; the prompt builders of ``FasterQwen3TTS``.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import numpy as np

from gateway.audio.condition import LeadingSilenceTrimmer
from gateway.errors import EngineError
from gateway.tts import cpu_linear
from gateway.tts.batch_sampling import (
    DEFAULT_SAMPLING,
    DRAWS_PER_FRAME,
    BatchDraws,
    Sampling,
    kcap_for,
    penalise_repeats,
    sample_rows,
)
from gateway.tts.chunking import ChunkPlanner
from gateway.tts.codec_batch import BatchedCodecDecoder
from gateway.tts.codec_stream import WindowedCodecDecoder
from gateway.tts.engine import (
    SAMPLES_PER_FRAME,
    BatchEngine,
    EngineRow,
    SpeechRequest,
    VoicePrompt,
)
from gateway.tts.graphs import DeviceEvent, capture
from gateway.tts.qwen import (
    DEFAULT_CHUNK_SCHEDULE,
    DEFAULT_MODEL,
    OverSharedModel,
    QwenModel,
    _quiet_stdout,
    parse_chunk_schedule,
)

log = logging.getLogger(__name__)

#: Batch sizes a step runs at (a batch is padded up to the next one; the cap is always one).
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64)
#: CUDA: attended lengths the talker graphs are captured for (powers of two up to the cache).
CUDA_KV_MIN = 256
#: CPU: attended length rounded up to this (no graphs to bound, so follow the rows closely).
CPU_KV_STEP = 64


def bucket_for(n: int, cap: int) -> int:
    """The batch size a step of ``n`` rows runs at: the smallest bucket >= n (the cap last)."""
    if not 1 <= n <= cap:
        raise ValueError(f"{n} rows do not fit a batch of at most {cap}")
    return next((b for b in batch_buckets(cap) if b >= n), cap)


def batch_buckets(cap: int) -> tuple[int, ...]:
    """The buckets below ``cap``, then ``cap`` itself."""
    return (*(b for b in BATCH_BUCKETS if b < cap), cap)


def kv_len_for(need: int, max_seq_len: int, graphs: bool) -> int:
    """Positions a step attends for a longest row of ``need`` keys (a graph shape with graphs)."""
    if graphs:
        size = CUDA_KV_MIN
        while size < need:
            size *= 2
        return min(size, max_seq_len)
    return min(max_seq_len, max(CPU_KV_STEP, math.ceil(need / CPU_KV_STEP) * CPU_KV_STEP))


_F = TypeVar("_F", bound=Callable[..., Any])


def _inference(method: _F) -> _F:
    """Run an engine method under ``torch.inference_mode`` (whichever thread calls it)."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        import torch

        with torch.inference_mode():
            return method(*args, **kwargs)

    return cast(_F, wrapper)


@dataclass(eq=False)
class BatchRow:
    """One turn in the batch, as the host sees it (the tensors live in the engine's buffers)."""

    request: SpeechRequest
    sampling: Sampling
    seed: int
    max_frames: int
    min_frames: int
    #: Row of the cache and of every state buffer (changes when rows are compacted).
    index: int
    epoch: int
    #: Prompt embeddings, cloned-voice reference codes (the trailing text lives in the
    #: engine's text buffer, the random stream in its draws, both at the row's codec slot).
    prompt: Any
    ref_codes: Any = None
    #: Prompt tokens through the talker so far; the prefill's DynamicCache until it is loaded.
    prefilled: int = 0
    prefill_cache: Any = None
    ready: bool = False
    #: Positions of the row's KV in use (prompt plus frames), frames generated, text step.
    length: int = 0
    frames: int = 0
    #: None while generating; then "eos" or "cap".
    finished: str | None = None
    output: _RowOutput | None = None
    #: The row's slot of the batched codec decoder's state (stable for the row's life).
    codec_slot: int = -1
    #: Text tokens on the row's text track, and whether its text is complete (a streaming
    #: turn's is not until its last piece arrives).
    text_tokens: int = 0
    text_done: bool = True
    #: With ``record_codes``: each frame's codes ``[16]`` and each chunk's ``[n, 16]`` (host);
    #: with ``record_logits``: per step, the talker logits the next token was sampled from
    #: and the code predictor's logits ``[15, vocab]`` for codebooks 1-15.
    codes: list[Any] = field(default_factory=list)
    chunks: list[Any] = field(default_factory=list)
    logits: list[Any] = field(default_factory=list)
    predictor_logits: list[Any] = field(default_factory=list)

    @property
    def prompt_tokens(self) -> int:
        return int(self.prompt.shape[1])

    @property
    def prefilling(self) -> bool:
        return not self.ready

    @property
    def waiting_for_text(self) -> bool:
        return not self.text_done and self.frames >= self.text_tokens

    @property
    def frames_to_chunk(self) -> int:
        if self.output is None:
            return 0
        return max(0, self.output.target - self.output.pending)


class _RowOutput:
    """One row's way from codes to audio: chunk plan, frames waiting to be decoded, trim.

    Incremental decoding keeps the row's codec state in the engine's batched decoder (at the
    row's codec slot) and its waiting frames in the engine's pending-codes buffer; windowed
    decoding (the reference mode) keeps a decoder and the frames here, per row.
    """

    def __init__(self, engine: BatchedQwenEngine, row: BatchRow) -> None:
        self.planner = ChunkPlanner(engine.chunk_schedule, adaptive=engine.adaptive_chunks)
        self.target = self.planner.next_size()
        #: Frames generated and not yet decoded.
        self.pending = 0
        self.windowed: WindowedCodecDecoder | None = None
        self.buffer: list[Any] = []
        if engine.codec_decode == "windowed":
            self.windowed = WindowedCodecDecoder(engine.shared.base.model.speech_tokenizer)
            if row.ref_codes is not None:
                self.windowed.prime(row.ref_codes)
        else:
            engine._codec_start(row)
        self.trimmer = LeadingSilenceTrimmer() if engine.trim_leading_silence else None


class BatchedQwenEngine(OverSharedModel, BatchEngine):
    """Streaming Qwen3-TTS for many turns at once on one device (see the module docstring).

    The engine is driven by one thread: :class:`~gateway.tts.core.EngineCore` in the
    gateway, or :meth:`stream` for a single turn (warm-up, tools). ``max_rows`` is the batch
    cap: how many turns generate at once (their KV rows are allocated up front).
    """

    def __init__(
        self,
        model: str | QwenModel = DEFAULT_MODEL,
        device: str = "auto",
        dtype: str = "auto",
        *,
        max_rows: int | None = None,
        max_seq_len: int | None = None,
        chunk_schedule: str | Sequence[int] = DEFAULT_CHUNK_SCHEDULE,
        codec_decode: str = "incremental",
        trim_leading_silence: bool = True,
        adaptive_chunks: bool = True,
        prefill_chunk: int = 0,
        cuda_graphs: bool | None = None,
        max_top_k: int | None = None,
        record_codes: bool = False,
        record_logits: bool = False,
        attn_implementation: str = "sdpa",
    ) -> None:
        shared = model if isinstance(model, QwenModel) else QwenModel(
            model, device, dtype, attn_implementation
        )
        if codec_decode not in ("incremental", "windowed"):
            raise ValueError("codec_decode must be 'incremental' or 'windowed'")
        if prefill_chunk < 0:
            raise ValueError("prefill_chunk must be >= 0 (0: whole prompts)")
        self.shared = shared
        self.model_id = shared.model_id
        self.device = shared.device
        self.on_cuda = shared.on_cuda
        self.max_rows = max_rows or (64 if self.on_cuda else 16)
        if not 1 <= self.max_rows <= 256:
            raise ValueError("max_rows must be in 1..256")
        self.max_seq_len = max_seq_len or (2048 if self.on_cuda else 1024)
        self.chunk_schedule = parse_chunk_schedule(chunk_schedule)
        self.codec_decode = codec_decode
        self.trim_leading_silence = trim_leading_silence
        self.adaptive_chunks = adaptive_chunks
        self.prefill_chunk = prefill_chunk
        #: Graph mode: the step captured per (bucket, attended length) at warm-up and replayed
        #: (default: on CUDA). On a CPU it runs through the capture stand-in (tests, dry runs:
        #: slower than eager, never chosen by default); False runs the step eagerly.
        self.cuda_graphs = self.on_cuda if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and not self.on_cuda:
            log.warning("graph mode on %s: the step runs through the CUDA-graph capture "
                        "stand-in (for tests and dry runs; slower than eager)", self.device)
        #: Test and benchmark hooks: keep every row's codes / talker logits per frame.
        self.record_codes = record_codes
        self.record_logits = record_logits
        base = shared.base
        self._talker = base.model.talker
        self._config = base.model.config.talker_config
        self.eos_id = int(self._config.codec_eos_token_id)
        self.vocab = int(self._config.vocab_size)
        self.num_code_groups = int(self._config.num_code_groups)
        self._pred_vocab = int(self._talker.code_predictor.config.vocab_size)
        #: The largest top-k a request may ask for in graph mode (0, "off", is the whole
        #: vocabulary). The sorted-candidate count (:func:`kcap_for`) is a shape, so graphs
        #: are captured for this envelope once, at warm-up, and never while serving; a
        #: narrower request samples the same tokens from it. Eager steps follow their rows.
        top = max_top_k if max_top_k is not None else max(DEFAULT_SAMPLING.top_k,
                                                          DEFAULT_SAMPLING.predictor_top_k)
        if top < 0:
            raise ValueError("max_top_k must be >= 0 (0: the whole vocabulary)")
        self.max_top_k = top
        self._tk = kcap_for([top], self.vocab)
        self._pk = kcap_for([top], self._pred_vocab)
        self._prompts = _prompt_builder(shared, self.max_seq_len)
        self._epoch = 0
        self._rows: list[BatchRow] = []
        #: Graph (or eager replayer) per (bucket, kv_len, talker kcap, predictor kcap).
        self._graphs: dict[tuple[int, int, int, int], Any] = {}
        self.captures = 0
        #: Seconds spent capturing at the last warm-up or rebuild.
        self.capture_s = 0.0
        self._owner: object | None = None
        self._serving = False
        #: With ``record_codes``: each chunk's codes of the last turn :meth:`stream` ran.
        self.last_codes: list[Any] = []
        self._allocate()
        log.info(
            "batched engine %s: batch cap %d rows; talker KV %.1f MiB per row (%d positions), "
            "%.1f MiB for all rows; CUDA graphs %s",
            self.name, self.max_rows, self.kv_bytes_per_row / 2**20, self.max_seq_len,
            self.kv_bytes_total / 2**20, self.graph_mode,
        )

    @property
    def graph_mode(self) -> str:
        """How the step runs: CUDA graphs, the capture stand-in, or eagerly."""
        if not self.cuda_graphs:
            return "off (eager step)"
        return "on" if self.on_cuda else "stand-in (CPU, tests and dry runs)"

    # --- Engine API ---------------------------------------------------------------------------

    @property
    def name(self) -> str:
        graphs = ", graph stand-in" if self.cuda_graphs and not self.on_cuda else ""
        return (f"qwen3-tts {self.model_id} on {self.device} "
                f"(batched, {self.max_rows} rows{graphs})")

    @property
    def kv_bytes_per_row(self) -> int:
        return self._kv.bytes_per_row

    @property
    def kv_bytes_total(self) -> int:
        return self._kv.bytes_per_row * self._cap

    @property
    def rows(self) -> Sequence[BatchRow]:
        """Rows in use, by index (ready or prefilling)."""
        return tuple(self._rows)

    @property
    def free_rows(self) -> int:
        return self.max_rows - len(self._rows)

    def validate(self, request: SpeechRequest) -> None:
        kind = self.shared.model_type
        if request.voice_prompt is None and kind != "custom_voice":
            raise ValueError(
                f"{self.model_id} is a {kind!r} model: it speaks only with a registered cloned "
                "voice; for built-in speakers use a CustomVoice model "
                "(e.g. Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice)"
            )
        if request.voice_prompt is not None and kind != "base":
            raise ValueError(
                f"cloned voice {request.voice_prompt.name!r} needs a Base model "
                f"(e.g. Qwen/Qwen3-TTS-12Hz-0.6B-Base); {self.model_id} is {kind!r}"
            )
        super().validate(request)
        sampling = request.sampling or DEFAULT_SAMPLING
        sampling.validate()
        if self.cuda_graphs and (
            kcap_for([sampling.top_k], self.vocab) > self._tk
            or kcap_for([sampling.predictor_top_k], self._pred_vocab) > self._pk
        ):
            raise ValueError(
                f"sampling top_k {sampling.top_k} / predictor_top_k {sampling.predictor_top_k} "
                f"needs more candidates than this engine's graphs were captured for (top-k up to "
                f"{self.max_top_k or 'the whole vocabulary'}; max_top_k, 0 for the whole "
                "vocabulary)"
            )

    def warmup(self, voices: Sequence[tuple[str, str] | VoicePrompt] = ()) -> None:
        """Capture the CUDA graphs of every bucket (GPU), then one turn per voice.

        A Base model given no cloned voice has nothing to say and only captures.
        """
        t0 = time.perf_counter()
        if self.cuda_graphs:
            self.capture_all()
        if not voices and self.shared.model_type == "custom_voice":
            voices = [(self.speakers[0] if self.speakers else "ryan", "English")]
        for voice in voices:
            if isinstance(voice, VoicePrompt):
                request = SpeechRequest(text="Hello.", voice_prompt=voice, max_frames=8,
                                        min_frames=8, seed=0)
            else:
                request = SpeechRequest(text="Hello.", speaker=voice[0], language=voice[1],
                                        max_frames=8, min_frames=8, seed=0)
            for _ in self.stream(request):
                pass
        log.info("engine warm: %s (%d voice(s), %d graph(s)) in %.2f s", self.name,
                 max(1, len(voices)), self.captures, time.perf_counter() - t0)

    def stream(
        self, request: SpeechRequest, should_stop: Callable[[], bool] | None = None
    ) -> Generator[np.ndarray, None, None]:
        """One turn alone (warm-up, tools): the batched loop with a single row."""
        try:
            self.validate(request)
        except ValueError as exc:
            raise EngineError(str(exc)) from None
        if self._owner is not None:
            raise RuntimeError("this engine is driven by a running batch loop")
        return self._solo(request, should_stop)

    def _solo(
        self, request: SpeechRequest, should_stop: Callable[[], bool] | None
    ) -> Generator[np.ndarray, None, None]:
        import torch

        with torch.inference_mode():
            row = self.open(request)
        try:
            while True:
                with torch.inference_mode():
                    if row.prefilling:
                        self.prefill(row)
                        continue
                    if row.finished is None:
                        if should_stop is not None and should_stop():
                            return
                        self.step([row])
                    audio = self.next_chunk(row)
                if audio is not None and len(audio):
                    yield audio
                elif row.finished is not None and audio is None:
                    return
        finally:
            # With ``record_codes``, what the last solo turn generated, chunk by chunk.
            self.last_codes = list(row.chunks)
            if row.epoch == self._epoch and row in self._rows:
                self.close(row)

    def rebuild(self) -> None:
        """Forget every row and start from fresh buffers (after a failure inside a step)."""
        import torch

        self._epoch += 1
        self._rows = []
        self._graphs.clear()
        if self.on_cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        self._allocate()
        if self.cuda_graphs:
            self.capture_all()

    # --- rows -----------------------------------------------------------------------------------

    def claim(self, owner: object) -> None:
        """Mark the engine as driven by ``owner`` (its :meth:`stream` then refuses to run);
        ``None`` releases it (the core stopped)."""
        self._owner = owner
        self._serving = owner is not None

    @_inference
    def open(self, request: SpeechRequest) -> BatchRow:
        """Give ``request`` a row and build its prompt; :meth:`prefill` runs it through."""
        import torch

        if not self.free_rows:
            raise RuntimeError("no free row")
        sampling = request.sampling or DEFAULT_SAMPLING
        seed = request.seed if request.seed is not None else int(torch.Generator().seed())
        # 0.6B models ignore instruct (faster-qwen3-tts drops it for "0b6" too).
        instruct = request.instruct if self.shared.model_size != "0b6" else None
        voice = request.voice_prompt
        ref_codes = None
        streaming = request.text_stream
        if streaming and not request.text.strip():
            raise EngineError("a streaming-text turn starts with its first words")
        if streaming and request.voice_prompt is not None:
            # A cloned voice reads its text alongside the reference clip's frames in the
            # prompt: a short text is all in the prompt, with nothing left to extend.
            raise EngineError("streaming text needs a built-in speaker, not a cloned voice")
        with _quiet_stdout():
            if voice is None:
                # Streaming text: the prompt holds the first text token and the talker reads
                # the rest one token per frame (qwen-tts's streaming mode), so text can keep
                # arriving; otherwise the whole text is in the prompt.
                _m, _t, _c, tie, _tam, tth, tpe = self._prompts._prepare_generation_custom(
                    text=request.text, language=request.language,
                    speaker=request.speaker.lower(), instruct=instruct,
                    non_streaming_mode=not streaming,
                )
            else:
                # A cloned voice (ICL): the reference clip's codes and transcript lead the
                # prompt; upstream's voice-clone default streams the text in.
                _m, _t, _c, tie, _tam, tth, tpe, ref_codes = self._prompts._prepare_generation(
                    text=request.text, language=request.language, ref_text=voice.ref_text,
                    non_streaming_mode=False, voice_clone_prompt=voice.prompt,
                    instruct=instruct,
                )
        prompt_len = int(tie.shape[1])
        room = self.max_seq_len - 1 - prompt_len
        if room < 1:
            raise EngineError(
                f"prompt of {prompt_len} tokens leaves no room in a {self.max_seq_len}-position "
                "row (GATEWAY_MAX_SEQ_LEN)"
            )
        # A streaming turn's length is unknown when it opens: its EOS or its row ends it.
        default = room if streaming else self.shared.default_frames(request.text)
        max_frames = min(request.max_frames or default, room)
        row = BatchRow(
            request=request, sampling=sampling, seed=seed, max_frames=max_frames,
            # EOS is suppressed for the first frames (2 upstream; min_frames forces a length).
            min_frames=max(2, request.min_frames or 0),
            index=len(self._rows), epoch=self._epoch, prompt=tie, ref_codes=ref_codes,
            codec_slot=self._free_slots.pop(),
        )
        # The text the talker reads on its second track, one token per frame after the
        # prompt (qwen-tts's trailing_text_hidden), then padding: in the text buffer at the
        # row's slot, so a step gathers every row's next token in one indexed read.
        trailing = tth[0]
        if streaming:
            # The text's end marker (tts_eos) comes after its last piece, not now.
            self._eos_embed.copy_(trailing[-1].to(self._eos_embed.dtype))
            trailing = trailing[:-1]
            row.text_done = False
        if trailing.shape[0] > self._text_cap:
            self._free_slots.append(row.codec_slot)
            raise EngineError(f"text of {trailing.shape[0]} tokens is longer than a turn may be "
                              f"({self._text_cap}); split it into sentences")
        slot = row.codec_slot
        self._text[slot, : trailing.shape[0]] = trailing.to(self._text.dtype)
        self._text_len[slot] = row.text_tokens = int(trailing.shape[0])
        self._pad_embed.copy_(tpe[0, 0].to(self._pad_embed.dtype))
        self._draws.start(slot, seed)
        self._rows.append(row)
        return row

    @_inference
    def prefill(self, row: EngineRow) -> int:
        """Run the next chunk of ``row``'s prompt through the talker; returns its token count.

        The chunking is fixed by the request alone (``prefill_chunk`` tokens), never by load,
        so a turn's numbers do not depend on what else is going on. When the last chunk is
        done the row's KV is loaded into its cache row and its first token sampled.
        """
        import torch
        from transformers import DynamicCache

        row = self._own(row)
        if row.ready:
            return 0
        total = row.prompt_tokens
        start = row.prefilled
        end = total if self.prefill_chunk <= 0 else min(total, start + self.prefill_chunk)
        if row.prefill_cache is None:
            row.prefill_cache = DynamicCache()
        out = self._talker.model(
            inputs_embeds=row.prompt[:, start:end],
            past_key_values=row.prefill_cache,
            use_cache=True,
            cache_position=torch.arange(start, end, device=row.prompt.device),
        )
        row.prefilled = end
        if end < total:
            return end - start
        hidden = out.last_hidden_state[:, -1:, :]
        logits = self._talker.codec_head(hidden[:, -1, :])
        length = self._kv.load_prefix(row.index, row.prefill_cache)
        row.prefill_cache = None
        self._install(row, hidden, logits, length, self._rope_delta(total))
        return end - start

    @_inference
    def prefill_rows(self, rows: Sequence[EngineRow]) -> int:
        """Run the next prefill chunk of every row in ``rows``; returns the tokens processed.

        New rows whose whole prompt is one chunk (``prefill_chunk`` 0, or a prompt no longer
        than it) go through the talker together, in one forward over their prompts padded on
        the right to the longest. Padding on the right changes nothing a real token computes:
        under the causal mask each token attends only to the tokens before it, all of its own
        prompt, at the positions it has alone. Each row then takes its own prompt's KV and its
        last real token's hidden state, as :meth:`prefill` would give it (up to float32 sums
        in another order: batched products pick kernels by shape). On the 2-core CPU one forward
        of 8 prompts of ~70 tokens of the 0.6B model cost 1.28-1.56x less than 8 forwards
        (``bench/batching.py``), and a burst of newcomers reaches its first step sooner. Any
        other mix runs one :meth:`prefill` per row.

        Rows are changed only once the forward has succeeded: after an exception every row is
        as it was, and the caller may retry them one by one to find the one that fails.
        """
        import torch
        from transformers import DynamicCache

        own = [self._own(row) for row in rows]
        if len(own) < 2 or not all(
            not row.ready and row.prefilled == 0
            and (self.prefill_chunk <= 0 or row.prompt_tokens <= self.prefill_chunk)
            for row in own
        ):
            return sum(self.prefill(row) for row in own)
        lengths = [row.prompt_tokens for row in own]
        longest = max(lengths)
        first = own[0].prompt
        embeds = first.new_zeros(len(own), longest, first.shape[2])
        for j, row in enumerate(own):
            embeds[j, : lengths[j]] = row.prompt[0]
        cache = DynamicCache()
        out = self._talker.model(
            inputs_embeds=embeds,
            past_key_values=cache,
            use_cache=True,
            cache_position=torch.arange(longest, device=first.device),
        )
        last = torch.tensor([n - 1 for n in lengths], device=first.device)
        hidden = out.last_hidden_state[torch.arange(len(own), device=first.device), last]
        logits = self._talker.codec_head(hidden)  # [rows, vocab]
        for j, row in enumerate(own):
            length = self._kv.load_prefix(row.index, cache, source=j, length=lengths[j])
            row.prefilled = lengths[j]
            self._install(row, hidden[j : j + 1, None], logits[j : j + 1], length,
                          self._rope_delta(lengths[j]))
        return sum(lengths)

    def _rope_delta(self, tokens: int) -> Any:
        """A prompt's multimodal-RoPE delta, computed the way the talker's forward does
        (``get_rope_index`` minus the padding): 0 for an unpadded text prompt, but a prompt
        that carried padding or other modalities would get its own."""
        import torch

        ones = torch.ones(1, tokens, dtype=torch.long, device=self.device)
        _positions, deltas = self._talker.get_rope_index(ones)
        return (deltas - (1 - ones).sum(dim=-1, keepdim=True)).reshape(1).float()

    def _install(self, row: BatchRow, hidden: Any, logits: Any, length: int, delta: Any) -> None:
        """Write a freshly prefilled row's state into the buffers; sample its first token."""
        import torch

        i, s = row.index, row.sampling
        logits = logits.float().masked_fill(self._suppress[None, :], float("-inf"))
        logits[:, self.eos_id] = float("-inf")  # frame 0 < min_frames (>= 2)
        uniforms = self._draws.take(row.codec_slot, 1).to(self.device)
        params = self._params
        token = sample_rows(
            logits, uniforms,
            torch.tensor([s.temperature], device=self.device),
            torch.tensor([s.top_k], device=self.device),
            torch.tensor([s.top_p], device=self.device),
            kcap_for([s.top_k], self.vocab),
        )
        self._token[i] = token[0]
        self._past_hidden[i] = hidden[0]
        self._seen[i] = False
        self._pos[i] = length
        self._rope[i] = delta[0]
        self._frames[i] = 0
        self._min_frames[i] = row.min_frames
        values = (s.temperature, s.top_k, s.top_p, s.repetition_penalty,
                  s.predictor_temperature, s.predictor_top_k, s.predictor_top_p)
        for buffer, value in zip(params, values, strict=True):
            buffer[i] = value
        row.length = length
        row.ready = True
        row.output = _RowOutput(self, row)

    @_inference
    def close(self, row: EngineRow) -> None:
        """Free ``row`` (finished, cancelled or failed); the last row moves into its place."""
        row = self._own(row)
        index = row.index
        self._rows.remove(row)
        self._free_slots.append(row.codec_slot)
        row.epoch = -1
        last = len(self._rows)
        if index == last:
            return
        moved = self._rows[-1]
        assert moved.index == last
        self._rows.remove(moved)
        self._rows.insert(index, moved)
        if moved.ready:
            self._kv.move_row(last, index, moved.length)
            for buffer in self._state:
                buffer[index] = buffer[last]
        moved.index = index

    def _own(self, row: EngineRow) -> BatchRow:
        if not isinstance(row, BatchRow) or row.epoch != self._epoch:
            raise EngineError("this turn's row was lost when the engine was rebuilt")
        return row

    # --- the step -------------------------------------------------------------------------------

    @_inference
    def step(self, rows: Sequence[EngineRow]) -> int:
        """Advance ``rows`` (ready, unfinished) by one codec frame; returns the batch size run.

        That is the batch bucket on CUDA (one graph each) and, eager on the CPU, the rows up to
        the highest one in ``rows``. Every row run that is not in ``rows`` keeps its state.
        Afterwards each advanced row holds its new frame in its output buffer and ``finished``
        says whether it sampled EOS or reached its frame cap.
        """
        if not rows:
            return 0
        return self._step([self._own(row) for row in rows])

    def _step(self, rows: list[BatchRow]) -> int:
        import torch

        for row in rows:
            if not row.ready or row.finished is not None:
                raise ValueError("only ready, unfinished rows can step")
            if row.output is not None and row.output.pending >= self._max_chunk:
                raise ValueError("a row's due chunk must be decoded before it steps again")
            if row.waiting_for_text:
                raise ValueError("a streaming row has read all its text: it waits for more")
        index = [row.index for row in rows]
        if self.cuda_graphs:
            # A graph per batch bucket: the step runs at the bucket, padding rows masked.
            bucket = bucket_for(len(self._rows), self._cap)
            tk, pk = self._tk, self._pk
        else:
            # Eager there is nothing to pad for: rows [0, highest stepping row] only. Rows are
            # kept compact (close moves the last into the gap), so 5 rows cost 5, not 8, and a
            # newcomer still prefilling in the last row is not computed as a masked row.
            bucket = max(index) + 1
            tk = kcap_for([row.sampling.top_k for row in rows], self.vocab)
            pk = kcap_for([row.sampling.predictor_top_k for row in rows], self._pred_vocab)
        need = max(row.length for row in rows) + 1
        kv_len = kv_len_for(need, self.max_seq_len, self.cuda_graphs)

        active = self._active_host
        active.zero_()
        active[index] = True
        uniforms = self._uniform_host
        slots = [row.codec_slot for row in rows]
        uniforms[index] = self._draws.take_rows(slots, DRAWS_PER_FRAME)
        # Each row's next text token (its frame count into its trailing text), or the pad
        # embedding once its text is read: one gather for every row.
        frames = [row.frames for row in rows]
        reading = [f < self._text_len[slot] for f, slot in zip(frames, slots, strict=True)]
        at = torch.tensor([min(f, self._text_cap - 1) for f in frames], device=self.device)
        slot_t = torch.tensor(slots, device=self.device)
        tokens = self._text[slot_t, at]
        keep = torch.tensor(reading, device=self.device)[:, None]
        addend = torch.where(keep, tokens, self._pad_embed[None, :])
        idx = torch.tensor(index, device=self.device)
        self._addend.index_copy_(0, idx, addend.unsqueeze(1))
        if self._active is not active:
            self._active[:bucket].copy_(active[:bucket], non_blocking=True)
            self._uniforms[:bucket].copy_(uniforms[:bucket], non_blocking=True)

        t_device = time.perf_counter()
        self._replayer(bucket, kv_len, tk, pk).replay()

        codes = self._out_codes[:bucket].clone()
        if self._codes_host is not None:
            # Device buffers (CUDA, or graph mode): one copy out and one sync per step, for
            # every row at once.
            host_codes = self._codes_host[:bucket]
            host_next = self._next_host[:bucket]
            host_codes.copy_(codes, non_blocking=True)
            host_next.copy_(self._token[:bucket], non_blocking=True)
            self._done.record()
            self._done.synchronize()
            next_tokens = host_next.tolist()
        else:
            host_codes = codes
            next_tokens = self._token[:bucket].tolist()
        self.device_s += time.perf_counter() - t_device
        if self._codec is not None:
            # Every advancing row's new frame into its pending codes, in one indexed write.
            pending = [row.output.pending for row in rows if row.output is not None]
            self._pending_codes[slots, pending] = codes[index]
        for row in rows:
            i = row.index
            assert row.output is not None
            if self._codec is None:
                row.output.buffer.append(codes[i])
            row.output.pending += 1
            if self.record_codes:
                row.codes.append(host_codes[i].clone())
            if self.record_logits:
                row.logits.append(self._out_logits[i].clone())
                row.predictor_logits.append(self._out_plogits[i].clone())
            row.frames += 1
            row.length += 1
            if next_tokens[i] == self.eos_id:
                row.finished = "eos"
            elif row.frames >= row.max_frames:
                row.finished = "cap"
        return bucket

    @_inference
    def extend_text(self, row: EngineRow, text: str, last: bool) -> int:
        """Append ``text`` to a streaming turn's text track (whole words: tokenised alone, a
        piece that starts at a word boundary gives the tokens the whole text would); ``last``
        adds the text's end marker. Returns the tokens added."""
        import torch

        own = self._own(row)
        if own.text_done:
            raise EngineError("this turn's text is complete; nothing more can be added")
        talker = self._talker
        added = 0
        pieces = []
        if text:
            ids = self.shared.base.processor(text=text, return_tensors="pt")["input_ids"]
            ids = ids.to(self.device)
            pieces.append(talker.text_projection(talker.get_text_embeddings()(ids))[0])
        if last:
            pieces.append(self._eos_embed[None, :])
        if not pieces:
            return 0
        embeds = torch.cat(pieces).to(self._text.dtype)
        slot = own.codec_slot
        start = self._text_len[slot]
        if start + embeds.shape[0] > self._text_cap:
            raise EngineError(f"a turn's text may hold at most {self._text_cap} tokens")
        self._text[slot, start : start + embeds.shape[0]] = embeds
        added = int(embeds.shape[0]) - (1 if last else 0)
        self._text_len[slot] = own.text_tokens = start + int(embeds.shape[0])
        own.text_done = last
        return added

    def drop_pending(self, row: EngineRow) -> None:
        """Forget ``row``'s frames not decoded yet (benchmarks and tests that measure or check
        the step alone; the row's audio then skips them)."""
        own = self._own(row)
        if own.output is not None:
            own.output.pending = 0
            own.output.buffer.clear()

    def next_chunk(self, row: EngineRow) -> np.ndarray | None:
        """:meth:`next_chunks` for one row."""
        return self.next_chunks([row])[0]

    @_inference
    def next_chunks(self, rows: Sequence[EngineRow]) -> list[np.ndarray | None]:
        """Decode the next chunk of every row in ``rows`` that has one due (its planned size,
        or the row finished); for each row its 24 kHz audio (possibly empty while leading
        silence is trimmed) or None when nothing is due.

        Incremental decoding runs the due rows together, one call per chunk size (a graph each
        per batch bucket in graph mode), and brings all their audio to the host in one copy.
        """
        import torch

        own = [self._own(row) for row in rows]
        due: dict[int, list[BatchRow]] = {}
        for row in own:
            out = row.output
            if out is None or not out.pending:
                continue
            if out.pending < out.target and row.finished is None:
                continue
            due.setdefault(out.pending, []).append(row)
        results: dict[int, np.ndarray] = {}
        if self._codec is None:
            for group in due.values():
                for row in group:
                    results[id(row)] = self._decode_windowed(row)
        elif due:
            parts = []
            for n, group in due.items():
                for start in range(0, len(group), self._cap):
                    chunk = group[start : start + self._cap]
                    parts.append((chunk, n, self._decode_group(chunk, n)))
            # One copy to the host for every row's audio.
            t_device = time.perf_counter()
            host = torch.cat([audio.reshape(-1) for _g, _n, audio in parts]).float().cpu()
            flat = host.numpy()
            self.device_s += time.perf_counter() - t_device
            offset = 0
            for group, n, _audio in parts:
                size = n * SAMPLES_PER_FRAME
                for row in group:
                    results[id(row)] = flat[offset : offset + size]
                    offset += size
        chunks: list[np.ndarray | None] = []
        for row in own:
            audio = results.get(id(row))
            if audio is None:
                chunks.append(None)
                continue
            out = row.output
            assert out is not None
            out.planner.chunk_done(out.pending)
            out.pending = 0
            out.target = out.planner.next_size()
            if out.trimmer is not None:
                audio = out.trimmer.push(audio)
            chunks.append(audio)
        return chunks

    def _decode_windowed(self, row: BatchRow) -> np.ndarray:
        import torch

        out = row.output
        assert out is not None and out.windowed is not None
        codes = torch.stack(out.buffer)
        out.buffer = []
        if self.record_codes:
            row.chunks.append(codes.cpu())
        return out.windowed.decode(codes)

    def _decode_group(self, rows: list[BatchRow], n: int) -> Any:
        """Decode ``n`` pending frames of each of ``rows`` in one call; their audio on the
        device ``[len(rows), n * 1920]``."""
        import torch

        codec = self._codec
        assert codec is not None
        count = len(rows)
        bucket = bucket_for(count, self._cap) if self.cuda_graphs else count
        slots = [row.codec_slot for row in rows] + [codec.scratch] * (bucket - count)
        self._codec_index[:bucket].copy_(torch.tensor(slots), non_blocking=True)
        if self.record_codes:
            for row in rows:
                row.chunks.append(self._pending_codes[row.codec_slot, :n].to("cpu", copy=True))
        replayer = self._codec_replayer(n, bucket)
        t_device = time.perf_counter()
        replayer.replay()
        audio = self._codec_out[:count, : n * SAMPLES_PER_FRAME].clone()
        self.device_s += time.perf_counter() - t_device
        return audio

    def _codec_replayer(self, n: int, bucket: int) -> Any:
        key = (n, bucket)
        graph = self._codec_graphs.get(key)
        if graph is None:
            codec = self._codec
            assert codec is not None

            def run() -> None:
                index = self._codec_index[:bucket]
                codes = self._pending_codes.index_select(0, index)[:, :n]
                audio = codec.decode(index, codes)
                self._codec_out[:bucket, : n * SAMPLES_PER_FRAME].copy_(audio)

            if self.cuda_graphs:
                if self._serving:
                    log.warning("capturing a codec graph while serving (%d frames, %d rows)",
                                n, bucket)
                # Capture warm-ups decode for real: into the scratch slot only.
                saved = self._codec_index[:bucket].clone()
                self._codec_index[:bucket].fill_(codec.scratch)
                graph = capture(run, self.device, self._pool, static=self._static,
                                host=self._host)
                self._codec_index[:bucket].copy_(saved)
                ops = getattr(graph, "ops", None)
                log.info("captured codec graph: %d frames x %d rows%s", n, bucket,
                         f" (stand-in, {ops} operators)" if ops else "")
            else:
                graph = capture(run, self.device, graphs=False)
            self._codec_graphs[key] = graph
        return graph

    def _codec_start(self, row: BatchRow) -> None:
        """A new row's codec slot starts an utterance (a cloned voice: primed with the
        reference clip's frames, their audio dropped)."""
        import torch

        codec = self._codec
        assert codec is not None
        codec.reset(row.codec_slot)
        if row.ref_codes is not None:
            index = torch.tensor([row.codec_slot], device=self.device)
            codec.decode(index, row.ref_codes.to(self.device)[None])

    @_inference
    def capture_all(self) -> None:
        """Capture the step for every batch bucket and attended length (graph mode).

        The sampling shape is the engine's envelope (``max_top_k``), the same for every step,
        so after this nothing is captured while serving. Runs under inference mode, as every
        engine buffer was made there (an in-place write to one outside it is refused).
        """
        t0 = time.perf_counter()
        before = self.captures
        for bucket in batch_buckets(self._cap):
            for kv_len in self.kv_lengths():
                self._replayer(bucket, kv_len, self._tk, self._pk)
        if self._codec is not None:
            # The codec: every chunk size a row can be due (up to the schedule's largest) at
            # every batch bucket.
            for n in range(1, self._max_chunk + 1):
                for bucket in batch_buckets(self._cap):
                    self._codec_replayer(n, bucket)
        self.capture_s = time.perf_counter() - t0
        log.info("captured %d step graph(s) (%d batch buckets x %d attended lengths, top-k %d/%d)"
                 " and %d codec graph(s) in %.2f s (%s)", self.captures - before,
                 len(batch_buckets(self._cap)), len(self.kv_lengths()), self._tk, self._pk,
                 len(self._codec_graphs), self.capture_s, self.graph_mode)

    def kv_lengths(self) -> list[int]:
        """The attended lengths a graph-mode step can run at (one graph each per bucket)."""
        return sorted({kv_len_for(n, self.max_seq_len, True)
                       for n in (1, *(2**k for k in range(8, 16))) if n <= self.max_seq_len})

    def _replayer(self, bucket: int, kv_len: int, tk: int, pk: int) -> Any:
        key = (bucket, kv_len, tk, pk)
        graph = self._graphs.get(key)
        if graph is None:
            def run() -> None:
                self._step_body(bucket, kv_len, tk, pk)

            if self.cuda_graphs:
                if self._serving:
                    log.warning("capturing a step graph while serving (batch %d, %d positions): "
                                "a stall for every live turn", bucket, kv_len)
                # Capture warm-ups run the step for real: with no row active they change
                # nothing but scratch positions and output buffers.
                saved = self._active.clone()
                self._active.zero_()
                graph = capture(run, self.device, self._pool, static=self._static,
                                host=self._host)
                self._active.copy_(saved)
                ops = getattr(graph, "ops", None)
                log.info("captured step graph: batch %d, %d positions, top-k %d/%d%s", bucket,
                         kv_len, tk, pk, f" (stand-in, {ops} operators)" if ops else "")
            else:
                graph = capture(run, self.device, graphs=False)
            self.captures += 1
            self._graphs[key] = graph
        return graph

    def _step_body(self, nb: int, kv_len: int, tk: int, pk: int) -> None:
        """One frame for rows ``[0, nb)`` on the static buffers (captured as a graph on CUDA)."""
        import torch

        talker = self._talker
        active = self._active[:nb]
        token = self._token[:nb]
        last_id_hidden = talker.get_input_embeddings()(token).unsqueeze(1)  # [nb, 1, H]
        pred_in = torch.cat((self._past_hidden[:nb], last_id_hidden), dim=1)
        codes = self._predict(pred_in, nb, pk)  # [nb, 15]
        self._out_codes[:nb, 0] = token
        self._out_codes[:nb, 1:] = codes

        embeds = talker.code_predictor.get_input_embeddings()
        hiddens = [last_id_hidden] + [embeds[i](codes[:, i : i + 1])
                                      for i in range(self.num_code_groups - 1)]
        inputs = torch.cat(hiddens, dim=1).sum(1, keepdim=True) + self._addend[:nb]

        pos = self._pos[:nb]
        write = torch.where(active, pos, self._kv.scratch)
        # Row r attends to its own keys 0..pos[r] (the new one included); a row that does not
        # advance attends to key 0 only (its output is dropped; no all-masked NaN rows).
        limit = torch.where(active, pos, 0)
        mask = (self._key_index[:kv_len][None, :] <= limit[:, None])[:, None, None, :]
        positions = (pos.float() + self._rope[:nb])[None, :, None].expand(3, nb, 1)
        self._kv.prepare(write, kv_len)
        out = talker.model(
            inputs_embeds=inputs,
            attention_mask=mask,
            past_key_values=self._kv,
            cache_position=self._cache_position,
            position_ids=positions,
            use_cache=True,
        )
        hidden = out.last_hidden_state  # [nb, 1, H]
        logits = talker.codec_head(hidden[:, -1, :]).float()
        seen = self._seen[:nb].clone()
        seen.scatter_(1, token[:, None], True)
        temp, top_k, top_p, rep = (p[:nb] for p in self._params[:4])
        logits = penalise_repeats(logits, seen, rep)
        logits = logits.masked_fill(self._suppress[None, :], float("-inf"))
        block = (self._frames[:nb] + 1) < self._min_frames[:nb]
        logits = logits.masked_fill(block[:, None] & self._eos_column[None, :], float("-inf"))
        nxt = sample_rows(logits, self._uniforms[:nb, DRAWS_PER_FRAME - 1], temp, top_k, top_p, tk)
        if self.record_logits:
            self._out_logits[:nb] = logits

        # Commit only the rows that advanced.
        self._token[:nb] = torch.where(active, nxt, token)
        self._past_hidden[:nb] = torch.where(active[:, None, None], hidden,
                                             self._past_hidden[:nb])
        self._seen[:nb] = torch.where(active[:, None], seen, self._seen[:nb])
        step = active.long()
        self._pos[:nb] += step
        self._frames[:nb] += step

    def _predict(self, pred_in: Any, nb: int, pk: int) -> Any:
        """The code predictor's 15-step loop for ``nb`` rows at once (codebooks 1-15)."""
        import torch

        cp = self._talker.code_predictor
        cache = self._pcache
        temp, top_k, top_p = (p[:nb] for p in self._params[4:])
        cache.offset = 0
        out = cp.model(inputs_embeds=cp.small_to_mtp_projection(pred_in),
                       attention_mask=self._no_mask, past_key_values=cache,
                       cache_position=self._pred_positions[0], use_cache=True)
        logits = cp.lm_head[0](out.last_hidden_state[:, -1, :])
        token = sample_rows(logits, self._uniforms[:nb, 0], temp, top_k, top_p, pk)
        if self.record_logits:
            self._out_plogits[:nb, 0] = logits
        tokens = [token]
        for i in range(1, self.num_code_groups - 1):
            cache.offset = i + 1
            embed = cp.small_to_mtp_projection(cp.model.codec_embedding[i - 1](token[:, None]))
            out = cp.model(inputs_embeds=embed, attention_mask=self._no_mask,
                           past_key_values=cache, cache_position=self._pred_positions[i],
                           use_cache=True)
            logits = cp.lm_head[i](out.last_hidden_state[:, -1, :])
            token = sample_rows(logits, self._uniforms[:nb, i], temp, top_k, top_p, pk)
            if self.record_logits:
                self._out_plogits[:nb, i] = logits
            tokens.append(token)
        return torch.stack(tokens, dim=1)

    # --- buffers --------------------------------------------------------------------------------

    def _allocate(self) -> None:
        import torch

        from gateway.tts.batch_cache import FrameKVCache, RowKVCache

        with torch.inference_mode():
            cap = max(batch_buckets(self.max_rows))
            self._cap = cap
            dev, dtype = self.device, self.shared.torch_dtype
            hidden = int(self._config.hidden_size)
            long, f32 = torch.long, torch.float32
            self._kv = RowKVCache(self._config, cap, self.max_seq_len, dev, dtype)
            pconfig = self._talker.code_predictor.model.config
            self._pcache = FrameKVCache(pconfig, cap, self.num_code_groups + 1, dev, dtype)
            self._token = torch.zeros(cap, dtype=long, device=dev)
            self._past_hidden = torch.zeros(cap, 1, hidden, dtype=dtype, device=dev)
            self._seen = torch.zeros(cap, self.vocab, dtype=torch.bool, device=dev)
            self._pos = torch.zeros(cap, dtype=long, device=dev)
            self._rope = torch.zeros(cap, dtype=f32, device=dev)
            self._frames = torch.zeros(cap, dtype=long, device=dev)
            self._min_frames = torch.zeros(cap, dtype=long, device=dev)
            # temperature, top_k, top_p, repetition penalty; predictor temperature, top_k, top_p
            self._params = [torch.zeros(cap, dtype=t, device=dev)
                            for t in (f32, long, f32, f32, f32, long, f32)]
            #: Per-row state compaction moves (everything but the KV, moved separately).
            self._state = [self._token, self._past_hidden, self._seen, self._pos, self._rope,
                           self._frames, self._min_frames, *self._params]
            self._addend = torch.zeros(cap, 1, hidden, dtype=dtype, device=dev)
            self._out_codes = torch.zeros(cap, self.num_code_groups, dtype=long, device=dev)
            traced = cap if self.record_logits else 1
            self._out_logits = torch.zeros(traced, self.vocab, dtype=f32, device=dev)
            self._out_plogits = torch.zeros(traced, self.num_code_groups - 1, self._pred_vocab,
                                            dtype=f32, device=dev)
            pin = self.on_cuda
            self._active_host = torch.zeros(cap, dtype=torch.bool, pin_memory=pin)
            self._uniform_host = torch.zeros(cap, DRAWS_PER_FRAME, dtype=f32, pin_memory=pin)
            self._done = DeviceEvent(self.on_cuda)
            self._pool = (torch.cuda.graph_pool_handle()
                          if self.on_cuda and self.cuda_graphs else None)
            if self.on_cuda or self.cuda_graphs:
                # The step reads device buffers that the host's staging buffers are copied
                # into, and its outputs come back through host buffers in one copy per step
                # (in graph mode on a CPU too, so the stand-in checks that path).
                self._active = torch.zeros(cap, dtype=torch.bool, device=dev)
                self._uniforms = torch.zeros(cap, DRAWS_PER_FRAME, dtype=f32, device=dev)
                self._codes_host: Any = torch.zeros(cap, self.num_code_groups, dtype=long,
                                                    pin_memory=pin)
                self._next_host: Any = torch.zeros(cap, dtype=long, pin_memory=pin)
            else:
                # Eager on a CPU the step reads the host staging buffers directly.
                self._active = self._active_host
                self._uniforms = self._uniform_host
                self._codes_host = self._next_host = None
            # The batched codec: per-row decoder state at stable slots, each row's frames
            # waiting to be decoded, and the decode's static inputs and outputs.
            self._max_chunk = max(self.chunk_schedule)
            self._codec: BatchedCodecDecoder | None = None
            self._free_slots = list(range(cap - 1, -1, -1))
            self._codec_graphs: dict[tuple[int, int], Any] = {}
            if self.codec_decode == "incremental":
                decoder = self.shared.base.model.speech_tokenizer.model.decoder
                self._codec = BatchedCodecDecoder(decoder, slots=cap)
            self._pending_codes = torch.zeros(cap + 1, self._max_chunk, self.num_code_groups,
                                              dtype=long, device=dev)
            # Per slot: the trailing text the talker reads (tokens as embeddings), its
            # length, and the row's random stream (host).
            self._text_cap = min(self.max_seq_len, 1024)
            self._text = torch.zeros(cap + 1, self._text_cap, hidden, dtype=dtype, device=dev)
            self._text_len = [0] * (cap + 1)
            self._pad_embed = torch.zeros(hidden, dtype=dtype, device=dev)
            self._eos_embed = torch.zeros(hidden, dtype=dtype, device=dev)
            self._draws = BatchDraws(cap + 1)
            self._codec_index = torch.zeros(cap, dtype=long, device=dev)
            codec_dtype = self._codec.dtype if self._codec is not None else f32
            self._codec_out = torch.zeros(cap, self._max_chunk * SAMPLES_PER_FRAME,
                                          dtype=codec_dtype, device=dev)
            self._key_index = torch.arange(self.max_seq_len, device=dev)
            self._cache_position = torch.zeros(1, dtype=long, device=dev)
            self._pred_positions = [torch.arange(2, device=dev)] + [
                torch.tensor([i + 1], device=dev) for i in range(1, self.num_code_groups - 1)
            ]
            self._no_mask = {"full_attention": None, "sliding_attention": None}
            # The top 1024 ids of the codec vocabulary are control tokens; only EOS may be
            # sampled (as faster-qwen3-tts and qwen-tts do).
            suppress = torch.zeros(self.vocab, dtype=torch.bool, device=dev)
            suppress[max(0, self.vocab - 1024):] = True
            suppress[self.eos_id] = False
            self._suppress = suppress
            eos = torch.zeros(self.vocab, dtype=torch.bool, device=dev)
            eos[self.eos_id] = True
            self._eos_column = eos
            #: What a captured step may read and write (graph mode checks it against these):
            #: the talker's and predictor's weights, the caches and every state buffer ...
            self._static = [
                *self._talker.parameters(), *self._talker.buffers(),
                *cpu_linear.packed_weights(self._talker),
                *self._kv.keys, *self._kv.values, *self._pcache.keys, *self._pcache.values,
                *self._state, self._addend, self._out_codes, self._out_logits,
                self._out_plogits, self._active, self._uniforms, self._key_index,
                self._cache_position, *self._pred_positions, self._suppress, self._eos_column,
                *self.shared.base.model.speech_tokenizer.model.decoder.parameters(),
                *self.shared.base.model.speech_tokenizer.model.decoder.buffers(),
                *(self._codec.tensors() if self._codec is not None else ()),
                self._pending_codes, self._codec_index, self._codec_out,
            ]
            #: ... and what it must not touch: the host side of the staging copies.
            self._host = [t for t in (self._active_host, self._uniform_host, self._codes_host,
                                      self._next_host) if t is not None and
                          t is not self._active and t is not self._uniforms]


def _prompt_builder(shared: QwenModel, max_seq_len: int) -> Any:
    """faster-qwen3-tts's wrapper used only for its prompt builders (no graphs of its own)."""
    with _quiet_stdout():
        from faster_qwen3_tts.model import FasterQwen3TTS

    wrapper = FasterQwen3TTS(base_model=shared.base, predictor_graph=None, talker_graph=None,
                             device=shared.device, dtype=shared.torch_dtype,
                             max_seq_len=max_seq_len)
    # Its prompt builders capture its own graphs on first use unless told they exist.
    wrapper._warmed_up = True
    return wrapper
