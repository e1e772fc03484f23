"""Prometheus metrics, one registry per app (tests build many apps in one process)."""

from __future__ import annotations

import sys

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# First audio: tens of milliseconds on a GPU, seconds on a CPU; buckets span both.
_LATENCY_BUCKETS = (0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10)


def _cuda_memory(kind: str) -> float:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0.0
    if kind == "allocated":
        return float(torch.cuda.memory_allocated())
    return float(torch.cuda.memory_reserved())


def _gauge_value(gauge: Gauge) -> float:
    """An unlabelled gauge's value, through the public collector interface."""
    return float(next(iter(gauge.collect())).samples[0].value)


class Metrics:
    """The gateway's metrics."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # ``line``: the line a call reached (gateway.ivr.lines): a configured line's name, or
        # "default" for every number no line lists, so the label set stays bounded.
        self.calls_active = Gauge(
            "gateway_calls_active", "Calls in progress.", ["transport", "line"], registry=r
        )
        self.calls_total = Counter(
            "gateway_calls_total", "Calls started.", ["transport", "line"], registry=r
        )
        self.calls_closed_by_error = Counter(
            "gateway_calls_protocol_errors_total",
            "Calls closed because of a malformed or disallowed message.",
            ["transport", "reason"],
            registry=r,
        )
        self.calls_inbound_timeouts = Counter(
            "gateway_calls_inbound_timeouts_total",
            "Calls ended because their inbound media went silent (peer gone without closing: "
            "a half-open WebSocket, a lost SIP BYE).",
            ["transport"], registry=r,
        )
        self.inbound_media_dropped = Counter(
            "gateway_inbound_media_dropped_total",
            "Inbound media messages (Twilio) or RTP packets (SIP) dropped unread because one "
            "call's stream sent more than its rate cap (a flood; a normal stream sends 50/s).",
            ["transport"], registry=r,
        )
        self.call_events_dropped = Counter(
            "gateway_call_events_dropped_total",
            "Inbound call events (keys, speech starts, marks) dropped because the call's "
            "dialog had not read the last ones yet (its queue is bounded).",
            ["transport"], registry=r,
        )
        self.first_audio = Histogram(
            "gateway_first_audio_seconds",
            "Caller's turn (answer, DTMF, speech) to the first 20 ms frame sent; source is "
            "cached (a prompt from the cache) or live (generated for this turn).",
            ["transport", "source", "line"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.turns = Counter(
            "gateway_turns_total", "Caller turns answered with audio.",
            ["transport", "source", "line"], registry=r,
        )
        self.calls_refused = Counter(
            "gateway_calls_refused_total",
            "Calls turned away: at capacity, draining, or not ready yet.",
            ["transport", "reason"],
            registry=r,
        )
        self.seats = Gauge(
            "gateway_seats",
            "Seats of GATEWAY_MAX_CALLS taken: by calls (ringing SIP calls included) or by voice "
            "webhook reservations whose streams have not connected here yet.",
            ["kind"], registry=r,
        )
        self.draining = Gauge(
            "gateway_draining", "1 from SIGTERM until exit: no new calls are taken.", registry=r
        )
        self.gpu_memory = Gauge(
            "gateway_gpu_memory_bytes", "CUDA memory of this process (torch allocator).",
            ["kind"], registry=r,
        )
        # Read at scrape time; zero without CUDA. torch is imported lazily so a metrics-only
        # process (tests, the load simulator) does not pay for it.
        self.gpu_memory.labels("allocated").set_function(lambda: _cuda_memory("allocated"))
        self.gpu_memory.labels("reserved").set_function(lambda: _cuda_memory("reserved"))
        self.barge_ins = Counter(
            "gateway_barge_ins_total", "Utterances stopped by the caller.", ["transport", "line"],
            registry=r,
        )
        self.signature_rejections = Counter(
            "gateway_signature_rejections_total",
            "Requests refused for a missing or bad X-Twilio-Signature.",
            ["endpoint"],
            registry=r,
        )
        self.twilio_updates = Counter(
            "gateway_twilio_call_updates_total",
            "Outcomes sent to Twilio as live-call updates (REST): delivered, failed (every "
            "attempt failed: the call falls back on after-stream; an alarm), or moot (the "
            "stream ended before a retry).",
            ["result"], registry=r,
        )
        self.twilio_update_retries = Counter(
            "gateway_twilio_call_update_retries_total",
            "Live-call update attempts retried after a timeout, a connection error, 429 or 5xx.",
            registry=r,
        )
        self.twilio_after_stream = Counter(
            "gateway_twilio_after_stream_total",
            "<Connect action> requests by answer: outcome (this replica ran the stream), retry "
            "(unknown here: wait and ask again through the balancer) or hangup.",
            ["answer"], registry=r,
        )
        self.http_aborted = Counter(
            "gateway_http_aborted_requests_total",
            "HTTP requests whose client went away before sending the body it announced.",
            registry=r,
        )
        self.tts_busy_slots = Gauge(
            "gateway_tts_busy_slots",
            "Turns generating now (batch rows in use, or engine slots busy).", registry=r
        )
        self.tts_queue_depth = Gauge(
            "gateway_tts_queue_depth", "Generations waiting for a batch row (or slot).",
            registry=r
        )
        self.tts_queue_wait = Histogram(
            "gateway_tts_queue_wait_seconds",
            "Submission to the turn getting a batch row (or slot).",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.tts_batch_size = Histogram(
            "gateway_tts_batch_size", "Rows advanced per batched step.",
            buckets=(1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128, 256), registry=r,
        )
        self.tts_step_seconds = Histogram(
            "gateway_tts_step_seconds",
            "Wall time of one batched step (code predictor then talker for every row).",
            buckets=(0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.2, 0.5, 1, 2, 5),
            registry=r,
        )
        self.event_loop_lag = Histogram(
            "gateway_event_loop_lag_seconds",
            "How late the event loop ran a callback that was due (sampled every 50 ms): what "
            "every call's pacing waits behind the loop's other work and the GIL.",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1),
            registry=r,
        )
        self.tts_step_host_seconds = Histogram(
            "gateway_tts_step_host_seconds",
            "Host time of one engine-core iteration that ran a step: everything but the device "
            "(scheduling, staging, bookkeeping, handing audio to the calls). It bounds how many "
            "steps a second the host can feed a fast device.",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2),
            registry=r,
        )
        self.tts_prefill_seconds = Histogram(
            "gateway_tts_prefill_seconds", "Wall time of one prefill chunk run between steps.",
            buckets=(0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 5),
            registry=r,
        )
        self.tts_rows_waiting = Gauge(
            "gateway_tts_rows_waiting",
            "Rows that did not advance in the last batched step: waiting on their consumer "
            "(backpressure), yielding to an urgent turn (urgency), still prefilling, or waiting "
            "for a bot's next words (text).",
            ["reason"], registry=r,
        )
        self.tts_cancel_to_free = Histogram(
            "gateway_tts_cancel_to_free_seconds", "Cancel (hang-up, barge-in) to the slot free.",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.tts_underruns = Counter(
            "gateway_tts_underruns_total",
            "Engine side: chunks the engine handed on after a listener who started playing at "
            "the turn's first chunk would have run out of audio (the engine fell behind real "
            "time), added when the turn completes (a cancelled turn's are not). Not what callers "
            "hear: the start buffer absorbs short ones, and the phone path can lose lead the "
            "engine had; see gateway_playout_underruns_total.",
            registry=r,
        )
        self.tts_text_underruns = Counter(
            "gateway_tts_text_underruns_total",
            "Streaming-text turns (a bot's answer) that read all the text they had and sat out "
            "steps waiting for more: the bot streams slower than the voice speaks.",
            registry=r,
        )
        self.playout_underruns = Counter(
            "gateway_playout_underruns_total",
            "Caller side: gaps in the middle of an utterance as the call's playout sees them "
            "(Twilio had played everything sent before the utterance's next frame went; an RTP "
            "beat went out as silence while the utterance waited for audio). cause=engine: the "
            "chunk that ended the gap came late from the engine too (also counted in "
            "gateway_tts_underruns_total); cause=playout: it left the engine with lead to spare "
            "and lost it after (the phone path, a stalled event loop, the transport).",
            ["transport", "cause"], registry=r,
        )
        self.playout_start_hold = Histogram(
            "gateway_playout_start_hold_seconds",
            "How long a live utterance's first frame waited in the playout (the start buffer: "
            "what the phone path held back of the first chunk plus the transport's buffer), "
            "part of gateway_first_audio_seconds.",
            ["transport"], buckets=(0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.15,
                                    0.25, 0.5),
            registry=r,
        )
        self.playout_underrun_seconds = Counter(
            "gateway_playout_underrun_seconds_total",
            "Silence of the gaps counted in gateway_playout_underruns_total.",
            ["transport", "cause"], registry=r,
        )
        self.tts_failures = Counter(
            "gateway_tts_failures_total", "Turns failed by an error inside the engine.",
            registry=r,
        )
        self.tts_engines_healthy = Gauge(
            "gateway_tts_engines_healthy",
            "TTS engines in service (a failed rebuild retires one; a stuck step takes one out "
            "until it returns).",
            registry=r,
        )
        # The same gauge under its old name, for one release: it counted engines, not the
        # batch slots gateway_tts_busy_slots counts. Read from the new one at each scrape, so
        # the two never disagree.
        self.tts_slots_healthy_deprecated = Gauge(
            "gateway_tts_slots_healthy",  # renames_35: keep
            "Deprecated alias of gateway_tts_engines_healthy (the same value); removed in the "
            "next release.",
            registry=r,
        )
        self.tts_slots_healthy_deprecated.set_function(
            lambda: _gauge_value(self.tts_engines_healthy))
        self.tts_stuck_steps = Counter(
            "gateway_tts_stuck_steps_total",
            "Engine steps the watchdog gave up on (no progress for GATEWAY_ENGINE_STEP_TIMEOUT_MS):"
            " an alarm.", registry=r,
        )
        self.prompt_cache_hits = Counter(
            "gateway_prompt_cache_hits_total", "Static prompts served from the cache.", registry=r
        )
        self.prompt_cache_misses = Counter(
            "gateway_prompt_cache_misses_total", "Static prompts not in the cache.", registry=r
        )
        self.prompt_cache_bytes = Gauge(
            "gateway_prompt_cache_memory_bytes", "PCM held in the in-memory prompt cache.",
            registry=r,
        )
        self.prompt_cache_corrupt = Counter(
            "gateway_prompt_cache_corrupt_total", "Cache entries discarded (bad checksum).",
            registry=r,
        )
        self.prompt_cache_write_errors = Counter(
            "gateway_prompt_cache_write_errors_total",
            "Cache writes that failed (directory read-only or full): an alarm.", registry=r,
        )
        self.prompt_render_seconds = Histogram(
            "gateway_prompt_render_seconds", "Time to render one prompt into the cache.",
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60), registry=r,
        )
        self.sip_dropped = Counter(
            "gateway_sip_dropped_total",
            "SIP datagrams dropped without a response (malformed, stray, disallowed ACKs).",
            registry=r,
        )
        self.speech_failures = Counter(
            "gateway_speech_failures_total", "Utterances a caller did not hear because TTS failed.",
            ["transport", "line"], registry=r,
        )
        self.script_reloads = Counter(
            "gateway_script_reloads_total",
            "New versions of the lines and scripts installed without a restart (files changed "
            "on disk, or SIGHUP).", registry=r,
        )
        self.script_reload_errors = Counter(
            "gateway_script_reload_errors_total",
            "Reloads refused (an invalid edit, a voice or model that cannot serve it): the "
            "previous version keeps serving; the errors are in the log as file:line:column.",
            registry=r,
        )
        self.script_version = Gauge(
            "gateway_script_version",
            "Version of the lines and scripts new calls run (1 at start, +1 per reload).",
            registry=r,
        )

        self.webhook_failures = Counter(
            "gateway_webhook_failures_total",
            "Script webhooks that failed (timeout, an HTTP error status, no answer, not JSON, "
            "too large): the call went to the node's on_error or the script's error node.",
            ["result"], registry=r,
        )
        self.bot_sessions = Counter(
            "gateway_bot_sessions_total",
            "Calls handed to a bot (ConversationRelay-compatible WebSocket), by how the session "
            "ended: end (the bot handed the call back), error (unreachable, silent, gone: the "
            "script's error path), caller (the caller hung up).",
            ["outcome"], registry=r,
        )
        self.bot_messages = Counter(
            "gateway_bot_messages_total",
            "Messages exchanged with bots, by direction (in: from the bot) and type.",
            ["direction", "type"], registry=r,
        )
        self.bot_message_errors = Counter(
            "gateway_bot_message_errors_total",
            "Bot messages answered with 'error' (malformed, unknown, or not possible on the "
            "call); the call went on.", registry=r,
        )
        self.bot_first_audio = Histogram(
            "gateway_bot_first_audio_seconds",
            "From the first token of a bot's answer to its first audio sent to the caller.",
            buckets=(0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0),
            registry=r,
        )
        self.bot_interrupts = Counter(
            "gateway_bot_interrupts_total",
            "Bot answers the caller cut off, by what cut them off (dtmf or speech).",
            ["by"], registry=r,
        )
        self.speech_turns = Counter(
            "gateway_speech_turns_total",
            "Caller turns a speech gather heard: result is match, no_match, no_speech or "
            "failed (the recogniser failed and the gather took keys instead).",
            ["transport", "result"], registry=r,
        )
        self.speech_decision = Histogram(
            "gateway_speech_decision_seconds",
            "End of the caller's speech to the speech gather's decision (its end-of-speech "
            "timeout plus whatever recognition had left to do).",
            ["transport"], buckets=_LATENCY_BUCKETS, registry=r,
        )

    def render(self) -> bytes:
        """Exposition-format text of every metric."""
        return generate_latest(self.registry)
