"""The slot engine: one batch-1 streaming engine per turn (the batching benchmark's baseline).

Before continuous batching (issue 11) the gateway served each turn on its own engine "slot": our
streaming loop over faster-qwen3-tts's two step functions (the talker's one-token decode over a
static KV cache, and the code predictor's 15-step loop), captured as faster-qwen3-tts's CUDA
graphs on a GPU and replayed eagerly at one seam on a CPU (:class:`_EagerReplay` stands in for
``torch.cuda.CUDAGraph``), several slots over shared weights, one thread each. The gateway no
longer uses it: it lives here so that ``bench/batching.py`` and the GPU run's baselines stage can
measure the batched engine against it in the same process.

:class:`SlotService` is the minimal front those benchmarks need: a queue by deadline, one worker
thread per slot, the same :class:`~gateway.tts.stream.SpeechStream` a caller of the gateway
iterates. It has none of the gateway's failure handling (no watchdog, no rebuilds).

The seam is pinned to faster-qwen3-tts 0.2.6 / qwen-tts 0.1.1 (see pyproject.toml);
``tests/test_bench_slot_engine.py`` keeps it honest.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Generator, Sequence
from typing import Any

import numpy as np

from gateway.audio.condition import LeadingSilenceTrimmer
from gateway.clock import SystemClock
from gateway.errors import EngineError
from gateway.tts.chunking import ChunkPlanner
from gateway.tts.codec_stream import StreamingCodecDecoder, WindowedCodecDecoder
from gateway.tts.core import Outbox
from gateway.tts.engine import Engine, Sampling, SpeechRequest, VoicePrompt
from gateway.tts.qwen import (
    CODEC_LEFT_CONTEXT,
    DEFAULT_CHUNK_SCHEDULE,
    DEFAULT_MODEL,
    OverSharedModel,
    QwenModel,
    _quiet_stdout,
    parse_chunk_schedule,
)
from gateway.tts.stream import ServiceStats, SpeechStream

log = logging.getLogger(__name__)

__all__ = ["SlotEngine", "SlotService", "build_mask_table"]


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


SlotEngine = QwenEngine


class SlotService:
    """Turns served by slot engines, one worker thread each, in deadline order."""

    def __init__(self, engines: Sequence[Engine], first_audio_budget_s: float = 0.2) -> None:
        if not engines:
            raise ValueError("at least one engine slot is required")
        self.engines = list(engines)
        self.first_audio_budget_s = first_audio_budget_s
        #: Nothing is counted here (the batched front's counters have no slot equivalent).
        self.stats = ServiceStats()
        self._heap: list[tuple[float, int, SpeechStream]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._stopping = False
        self._threads: list[threading.Thread] = []

    @property
    def capacity(self) -> int:
        return len(self.engines)

    def start(self) -> None:
        for index, engine in enumerate(self.engines):
            thread = threading.Thread(target=self._worker, args=(engine,),
                                      name=f"tts-slot-{index}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            for _, _, stream in self._heap:
                stream.cancel_from_core()
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout)

    def stream(self, request: SpeechRequest) -> SpeechStream:
        try:
            self.engines[0].validate(request)
        except ValueError as exc:
            raise EngineError(str(exc)) from None
        now = time.monotonic()
        stream = SpeechStream(request, asyncio.get_running_loop(), now,
                              now + self.first_audio_budget_s, SystemClock())
        with self._cond:
            heapq.heappush(self._heap, (stream.deadline, next(self._seq), stream))
            self._cond.notify()
        return stream

    def _next(self) -> SpeechStream | None:
        with self._cond:
            while True:
                if self._stopping:
                    return None
                while self._heap:
                    _, _, stream = heapq.heappop(self._heap)
                    if not stream.stopping:
                        return stream
                    stream.finish_now()
                self._cond.wait()

    def _worker(self, engine: Engine) -> None:
        while (stream := self._next()) is not None:
            outbox = Outbox()
            stream.started_at = time.monotonic()
            generator = engine.stream(stream.request, should_stop=lambda s=stream: s.stopping)
            try:
                for chunk in generator:
                    if stream.stopping:
                        break
                    stream.deliver(chunk, time.monotonic(), outbox)
                    outbox.flush()
                else:
                    stream.finished_at = time.monotonic()
                    stream.end(outbox)
                    outbox.flush()
                    continue
            except Exception as exc:  # the benchmark reports it through the stream
                stream.fail(exc, outbox)
            finally:
                generator.close()
            stream.finished_at = time.monotonic()
            stream.finish(outbox)
            outbox.flush()
