"""Registered cloned voices: Qwen3-TTS voice-clone prompts computed once and kept on disk.

An IVR script speaks with a CustomVoice speaker or with a *registered voice*. Registering
(``gateway voices add NAME REF.wav --text "..."``) runs a Qwen3-TTS **Base** model's
``create_voice_clone_prompt`` once (ICL mode: the reference clip's codec codes plus its speaker
embedding, conditioned on the clip's transcript) and stores the result in a voices directory that
every replica can mount, so voices survive restarts and are shared.

On-disk layout (``GATEWAY_VOICES_DIR``, default ``./voices``)::

    voices/
      alice -> .store/alice/5f0c1e9a2b7d4c30     relative symlink: the published version
      .store/alice/5f0c1e9a2b7d4c30/
        voice.json           name, ref text, duration, rate, base model, created, flags, sha256
        prompt.safetensors   ref_code (int64 [frames, 16]), ref_spk_embedding (float32 [dim]),
                             plus the generation-relevant metadata as one canonical JSON string
        reference.wav        the reference clip as registered
      .tmp-alice-3b9d.../    a version being built (or left by a crash): never read
      .lock                  serialises publishers; readers never lock

Why a symlink: a version directory is written completely inside the registry directory (same
filesystem), fsynced, renamed into ``.store`` and only then published by ``os.replace`` of the
``alice`` symlink, which is atomic on POSIX filesystems including NFS. A directory cannot be
renamed over a non-empty directory, so without the indirection re-registering would leave a
moment with no voice at all. This is the scheme Kubernetes uses for ConfigMap volumes.
Version directories are immutable once published; a reader resolves the link once and reads
every file from that one version, so it never mixes two versions. Replaced versions are deleted
after the swap: a reader that loses that race gets ``FileNotFoundError`` and resolves again.

The voice's **identity** is the sha256 of ``prompt.safetensors``. The file holds everything that
shapes generation (codes, embedding, transcript, mode flags, base model id), and nothing else, so
the identity is content-addressed: a new clip or a new transcript gives a new identity, while
registering the same clip and text with the same model again gives the same one (so prompt caches
keyed on it stay valid). The hash is checked on every load.

Errors: everything this module raises on purpose is :class:`VoiceError`
(a :class:`~gateway.errors.GatewayError`): invalid names, unreadable or out-of-range reference
clips, empty transcripts, unknown voices, corrupt entries. The CLI prints it as ``error: ...``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import io
import json
import logging
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from gateway.errors import GatewayError

__all__ = [
    "APPENDED_SILENCE_S",
    "DEFAULT_BASE_MODEL",
    "MAX_REF_SECONDS",
    "MIN_REF_SECONDS",
    "NAME_PATTERN",
    "VoiceError",
    "VoiceRecord",
    "VoiceRegistry",
    "default_voices_dir",
]

log = logging.getLogger(__name__)

#: The Base model whose prompts match the default CustomVoice model's size (0.6B).
DEFAULT_BASE_MODEL = "Qwen/Qwen3-TTS-12Hz-0.6B-Base"
#: Voice names: lower-case, usable as a directory name and in a URL or YAML without quoting.
NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
MIN_REF_SECONDS = 1.0
MAX_REF_SECONDS = 30.0
#: Silence appended to the clip before encoding. faster-qwen3-tts does the same
#: (``append_silence=True``, 0.5 s) when it builds an ICL prompt from ``ref_audio``, because
#: generation continues from the clip's last codec frame and would otherwise start with a bleed
#: of its last phoneme; with a precomputed prompt it cannot add it, so it is done here.
APPENDED_SILENCE_S = 0.5

FORMAT_VERSION = 1
VOICE_JSON = "voice.json"
PROMPT_FILE = "prompt.safetensors"
REFERENCE_FILE = "reference.wav"
STORE_DIR = ".store"
TMP_PREFIX = ".tmp-"
LOCK_FILE = ".lock"
#: Metadata key in prompt.safetensors. One key holding canonical JSON: safetensors writes its
#: metadata map in hash order, so several keys would make the file bytes (and the identity)
#: differ between runs for the same content.
_PROMPT_META_KEY = "gateway_voice"
#: Build directories older than this are assumed abandoned by a crashed writer and removed.
_STALE_TMP_S = 3600.0
_READ_ATTEMPTS = 3


class VoiceError(GatewayError):
    """A voice cannot be registered, found or loaded; the message says which and why."""


@dataclass(frozen=True, slots=True)
class VoiceRecord:
    """What ``voice.json`` says about one registered voice."""

    name: str
    ref_text: str
    ref_duration_s: float
    sample_rate: int
    channels: int
    base_model: str
    created: datetime
    x_vector_only_mode: bool
    icl_mode: bool
    ref_code_frames: int
    appended_silence_s: float
    prompt_sha256: str
    ref_sha256: str

    @property
    def identity(self) -> str:
        """The voice's identity: sha256 (hex) of its ``prompt.safetensors``."""
        return self.prompt_sha256

    def to_json(self) -> dict[str, Any]:
        """The ``voice.json`` document (also what ``gateway voices list --json`` prints)."""
        doc = dataclasses.asdict(self)
        doc["created"] = self.created.isoformat()
        return {"format": FORMAT_VERSION, **doc}

    @classmethod
    def from_json(cls, doc: Any) -> VoiceRecord:
        """Parse a ``voice.json`` document; raises :class:`VoiceError` when it is not one."""
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_VERSION:
            raise VoiceError(f"not a format-{FORMAT_VERSION} voice.json")
        try:
            values = {f.name: doc[f.name] for f in dataclasses.fields(cls)}
            values["created"] = datetime.fromisoformat(values["created"])
            record = cls(**values)
        except (KeyError, TypeError, ValueError) as exc:
            raise VoiceError(f"malformed voice.json ({type(exc).__name__}: {exc})") from None
        return record


def default_voices_dir() -> Path:
    """``$GATEWAY_VOICES_DIR`` if set, else ``./voices``."""
    return Path(os.environ.get("GATEWAY_VOICES_DIR") or "voices")


def validate_name(name: str) -> str:
    """Return ``name`` if it is a valid voice name, else raise :class:`VoiceError`."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise VoiceError(
            f"invalid voice name {name!r}: use 1-64 characters a-z, 0-9, '_' or '-', "
            "starting with a letter or digit"
        )
    return name


class VoiceRegistry:
    """The registered voices in one directory (see the module docstring for the layout).

    Safe for concurrent use by several processes and hosts sharing the directory: readers take
    no lock and always see a complete voice; publishers serialise on an ``flock``.
    """

    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)

    # -- reading ---------------------------------------------------------------------------

    def exists(self, name: str) -> bool:
        """True if ``name`` is registered and readable (a corrupt voice counts as missing)."""
        try:
            self.get(name)
        except VoiceError:
            return False
        return True

    def get(self, name: str) -> VoiceRecord:
        """The record of voice ``name`` (its prompt file's checksum verified)."""
        return self.load(name)[0]

    def load_prompt(self, name: str) -> dict[str, Any]:
        """Voice ``name``'s prompt in the dict form Qwen3-TTS generation takes.

        ``{"ref_code": [LongTensor[frames, 16]], "ref_spk_embedding": [FloatTensor[dim]],
        "x_vector_only_mode": [False], "icl_mode": [True]}`` (CPU tensors, batch of one), i.e.
        ``Qwen3TTSModel._prompt_items_to_voice_clone_prompt`` of the stored item. Pass it as
        ``voice_clone_prompt=`` to faster-qwen3-tts *together with* ``ref_text=record.ref_text``
        (the dict form carries no transcript). Use :meth:`load` to get both from one version.
        """
        return self.load(name)[1]

    def load(self, name: str) -> tuple[VoiceRecord, dict[str, Any]]:
        """Record and prompt dict of voice ``name``, both read from the same version."""
        validate_name(name)
        for _ in range(_READ_ATTEMPTS):
            version = self._resolve(name)
            try:
                meta_bytes = (version / VOICE_JSON).read_bytes()
                prompt_bytes = (version / PROMPT_FILE).read_bytes()
            except FileNotFoundError:
                continue  # replaced or removed while we read: resolve the link again
            record = self._parse_record(name, meta_bytes)
            return record, self._parse_prompt(name, record, prompt_bytes)
        self._resolve(name)  # raises "no voice named" if it was removed meanwhile
        raise VoiceError(
            f"voice {name!r} in {self.directory} is corrupt: its {VOICE_JSON} or {PROMPT_FILE} "
            f"is missing; register it again with `gateway voices add`"
        )

    def load_prompt_items(self, name: str) -> list[Any]:
        """Voice ``name`` as ``[qwen_tts.VoiceClonePromptItem]`` (with ``ref_text``).

        The form ``Qwen3TTSModel.generate_voice_clone(voice_clone_prompt=...)`` needs for ICL
        prompts, and which faster-qwen3-tts also accepts without a separate ``ref_text``.
        """
        from qwen_tts.inference.qwen3_tts_model import VoiceClonePromptItem

        record, prompt = self.load(name)
        return [
            VoiceClonePromptItem(
                ref_code=prompt["ref_code"][0],
                ref_spk_embedding=prompt["ref_spk_embedding"][0],
                x_vector_only_mode=record.x_vector_only_mode,
                icl_mode=record.icl_mode,
                ref_text=record.ref_text,
            )
        ]

    def list(self) -> list[VoiceRecord]:
        """Every registered voice, sorted by name. Entries that cannot be read are logged and
        skipped; build directories and anything else that is not a voice name are ignored."""
        if not self.directory.is_dir():
            return []
        records = []
        for entry in sorted(os.listdir(self.directory)):
            if not NAME_PATTERN.fullmatch(entry):
                continue
            try:
                records.append(self._read_record(entry))
            except VoiceError as exc:
                log.warning("skipping voice %r: %s", entry, exc)
        return records

    # -- writing ---------------------------------------------------------------------------

    def add(
        self,
        name: str,
        ref_wav: Path | str,
        text: str,
        base_model: str = DEFAULT_BASE_MODEL,
        device: str = "cpu",
    ) -> VoiceRecord:
        """Compute voice ``name``'s clone prompt from ``ref_wav`` + ``text`` and publish it.

        ``ref_wav``: any file soundfile reads (any rate, any channels; mixed down to mono),
        1-30 s long. ``text``: what the clip says. ``base_model``: a Qwen3-TTS *Base* model id or
        local directory, loaded on ``device`` in float32. An existing voice of that name is
        replaced atomically.
        """
        validate_name(name)
        text = text.strip() if isinstance(text, str) else ""
        if not text:
            raise VoiceError("the reference text is empty: pass what the clip says with --text")
        ref_path = Path(ref_wav)
        wav, sample_rate, channels = _read_reference(ref_path)
        duration = len(wav) / sample_rate
        if duration < MIN_REF_SECONDS:
            raise VoiceError(
                f"reference clip {ref_path} is too short ({duration:.2f} s): "
                f"use {MIN_REF_SECONDS:g}-{MAX_REF_SECONDS:g} s of clear speech"
            )
        if duration > MAX_REF_SECONDS:
            raise VoiceError(
                f"reference clip {ref_path} is too long ({duration:.2f} s): "
                f"use {MIN_REF_SECONDS:g}-{MAX_REF_SECONDS:g} s of clear speech"
            )

        tensors, flags = _compute_prompt(base_model, device, wav, sample_rate, text)
        prompt_meta = {
            "format": FORMAT_VERSION,
            "ref_text": text,
            "base_model": base_model,
            "appended_silence_s": APPENDED_SILENCE_S,
            **flags,
        }
        self.directory.mkdir(parents=True, exist_ok=True)
        build = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{name}-", dir=self.directory))
        try:
            build.chmod(0o755)  # mkdtemp makes it 0700; other replicas may run as other users
            prompt_bytes = _serialize_prompt(tensors, prompt_meta)
            _write_file(build / PROMPT_FILE, prompt_bytes)
            ref_sha = _copy_reference(ref_path, wav, sample_rate, build / REFERENCE_FILE)
            record = VoiceRecord(
                name=name,
                ref_text=text,
                ref_duration_s=round(duration, 4),
                sample_rate=sample_rate,
                channels=channels,
                base_model=base_model,
                created=datetime.now(UTC),
                x_vector_only_mode=flags["x_vector_only_mode"],
                icl_mode=flags["icl_mode"],
                ref_code_frames=int(tensors["ref_code"].shape[0]),
                appended_silence_s=APPENDED_SILENCE_S,
                prompt_sha256=hashlib.sha256(prompt_bytes).hexdigest(),
                ref_sha256=ref_sha,
            )
            doc = json.dumps(record.to_json(), indent=2, ensure_ascii=False) + "\n"
            _write_file(build / VOICE_JSON, doc.encode())
            _fsync_dir(build)
            self._publish(name, build)
        finally:
            shutil.rmtree(build, ignore_errors=True)  # gone already unless publishing failed
        return record

    def remove(self, name: str) -> None:
        """Unregister voice ``name``; raises :class:`VoiceError` if there is none."""
        validate_name(name)
        with self._locked():
            link = self.directory / name
            if not os.path.lexists(link):
                raise self._unknown(name)
            if link.is_symlink():
                link.unlink()
            else:  # a plain directory (copied in by hand): retire it whole, GC deletes it
                retired = self.directory / STORE_DIR / name / f"plain-{uuid.uuid4().hex[:16]}"
                retired.parent.mkdir(parents=True, exist_ok=True)
                os.rename(link, retired)
            _fsync_dir(self.directory)
            self._collect_garbage()

    # -- internals -------------------------------------------------------------------------

    def _publish(self, name: str, build: Path) -> None:
        store = self.directory / STORE_DIR / name
        version = uuid.uuid4().hex[:16]
        target = Path(STORE_DIR) / name / version  # relative: replicas mount it anywhere
        with self._locked():
            store.mkdir(parents=True, exist_ok=True)  # under the lock: GC removes empty ones
            os.rename(build, self.directory / target)
            _fsync_dir(store)
            link = self.directory / name
            if os.path.lexists(link) and not link.is_symlink():
                # A plain directory can't be replaced atomically; retire it into the store.
                os.rename(link, store / f"plain-{version}")
            new_link = self.directory / f"{TMP_PREFIX}link-{version}"
            os.symlink(target, new_link)
            os.replace(new_link, link)
            _fsync_dir(self.directory)
            self._collect_garbage()

    def _collect_garbage(self) -> None:
        """Delete store versions no name links to, and stale build directories.

        Runs under the lock: every version is linked in the same critical section that moves
        it into the store, so any unlinked one is a replaced version or a crash's leftover.
        """
        store = self.directory / STORE_DIR
        live = {
            (self.directory / e).resolve()
            for e in os.listdir(self.directory)
            if NAME_PATTERN.fullmatch(e) and (self.directory / e).is_symlink()
        }
        if store.is_dir():
            for name_dir in store.iterdir():
                for version in name_dir.iterdir() if name_dir.is_dir() else ():
                    if version.resolve() not in live:
                        shutil.rmtree(version, ignore_errors=True)
                with contextlib.suppress(OSError):
                    name_dir.rmdir()  # only succeeds when no version is left
        now = time.time()
        for entry in os.listdir(self.directory):
            path = self.directory / entry
            if entry.startswith(TMP_PREFIX):
                with contextlib.suppress(OSError):
                    if now - path.lstat().st_mtime > _STALE_TMP_S:
                        if path.is_dir() and not path.is_symlink():
                            shutil.rmtree(path, ignore_errors=True)
                        else:
                            path.unlink()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _resolve(self, name: str) -> Path:
        link = self.directory / name
        if not os.path.lexists(link):
            raise self._unknown(name)
        return link.resolve()

    def _unknown(self, name: str) -> VoiceError:
        return VoiceError(
            f"no voice named {name!r} in {self.directory} "
            "(`gateway voices list` shows the registered ones)"
        )

    def _read_record(self, name: str) -> VoiceRecord:
        for _ in range(_READ_ATTEMPTS):
            try:
                data = (self._resolve(name) / VOICE_JSON).read_bytes()
            except FileNotFoundError:
                continue
            return self._parse_record(name, data)
        raise VoiceError(f"voice {name!r} in {self.directory} has no {VOICE_JSON}")

    def _parse_record(self, name: str, data: bytes) -> VoiceRecord:
        try:
            record = VoiceRecord.from_json(json.loads(data))
        except (ValueError, VoiceError) as exc:  # JSONDecodeError is a ValueError
            raise VoiceError(f"voice {name!r} in {self.directory} is corrupt: {exc}") from None
        if record.name != name:
            raise VoiceError(
                f"voice {name!r} in {self.directory} is corrupt: its {VOICE_JSON} names "
                f"{record.name!r}"
            )
        return record

    def _parse_prompt(self, name: str, record: VoiceRecord, data: bytes) -> dict[str, Any]:
        from safetensors import SafetensorError
        from safetensors.torch import load

        where = f"voice {name!r} in {self.directory}"
        digest = hashlib.sha256(data).hexdigest()
        if digest != record.prompt_sha256:
            raise VoiceError(
                f"{where} is corrupt: {PROMPT_FILE} checksum mismatch (sha256 {digest[:12]}..., "
                f"{VOICE_JSON} says {record.prompt_sha256[:12]}...); register it again"
            )
        try:
            tensors = load(data)
            meta = _prompt_metadata(data)
        except (SafetensorError, ValueError, KeyError) as exc:
            raise VoiceError(f"{where} is corrupt: unreadable {PROMPT_FILE} ({exc})") from None
        expected = {
            "ref_text": record.ref_text,
            "base_model": record.base_model,
            "x_vector_only_mode": record.x_vector_only_mode,
            "icl_mode": record.icl_mode,
        }
        if any(meta.get(k) != v for k, v in expected.items()) or "ref_spk_embedding" not in tensors:
            raise VoiceError(f"{where} is corrupt: {VOICE_JSON} disagrees with {PROMPT_FILE}")
        if record.icl_mode and "ref_code" not in tensors:
            raise VoiceError(f"{where} is corrupt: ICL prompt without ref_code")
        return {
            "ref_code": [tensors.get("ref_code")],
            "ref_spk_embedding": [tensors["ref_spk_embedding"]],
            "x_vector_only_mode": [record.x_vector_only_mode],
            "icl_mode": [record.icl_mode],
        }


def _read_reference(path: Path) -> tuple[np.ndarray, int, int]:
    """(mono float32 samples, sample rate, original channel count) of a reference clip."""
    import soundfile as sf

    if not path.is_file():
        raise VoiceError(f"reference clip {path} does not exist")
    try:
        data, sample_rate = sf.read(str(path), dtype="float32", always_2d=True)
    except Exception as exc:  # soundfile raises LibsndfileError/RuntimeError/TypeError
        raise VoiceError(f"cannot read reference clip {path}: {exc}") from None
    channels = int(data.shape[1])
    mono = data.mean(axis=1, dtype=np.float32) if channels > 1 else data[:, 0]
    return np.ascontiguousarray(mono), int(sample_rate), channels


@functools.lru_cache(maxsize=1)
def _base_model(base_model: str, device: str) -> Any:
    from gateway.tts.qwen import _load_base, resolve_device

    try:
        model, _dtype = _load_base(base_model, resolve_device(device), "float32", "sdpa")
    except GatewayError as exc:
        raise VoiceError(str(exc)) from None
    kind = getattr(model.model, "tts_model_type", None)
    if kind != "base":
        raise VoiceError(
            f"{base_model} is a {kind!r} model; voice-clone prompts need a Qwen3-TTS Base model "
            f"(e.g. {DEFAULT_BASE_MODEL}) passed with --base-model"
        )
    return model


def _compute_prompt(
    base_model: str, device: str, wav: np.ndarray, sample_rate: int, text: str
) -> tuple[dict[str, Any], dict[str, bool]]:
    """Run ``create_voice_clone_prompt`` (ICL mode); returns CPU tensors and the mode flags."""
    import torch

    model = _base_model(base_model, device)
    padded = np.concatenate([wav, np.zeros(int(APPENDED_SILENCE_S * sample_rate), np.float32)])
    try:
        with torch.inference_mode():
            (item,) = model.create_voice_clone_prompt(
                ref_audio=(padded, sample_rate), ref_text=text, x_vector_only_mode=False
            )
    except Exception as exc:
        raise VoiceError(
            f"computing the voice-clone prompt with {base_model} failed: {exc}"
        ) from exc
    tensors = {
        "ref_code": item.ref_code.detach().to("cpu", torch.int64).contiguous(),
        # Stored as float32 whatever the model ran in; generation casts to the talker's dtype.
        "ref_spk_embedding": item.ref_spk_embedding.detach().to("cpu", torch.float32).contiguous(),
    }
    flags = {"x_vector_only_mode": bool(item.x_vector_only_mode), "icl_mode": bool(item.icl_mode)}
    return tensors, flags


def _serialize_prompt(tensors: dict[str, Any], meta: dict[str, Any]) -> bytes:
    from safetensors.torch import save

    canonical = json.dumps(meta, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return save(tensors, metadata={_PROMPT_META_KEY: canonical})


def _prompt_metadata(data: bytes) -> dict[str, Any]:
    """The JSON metadata block of a serialized prompt (safetensors header ``__metadata__``)."""
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    meta = json.loads(header["__metadata__"][_PROMPT_META_KEY])
    if not isinstance(meta, dict):
        raise ValueError("prompt metadata is not an object")
    return meta


def _copy_reference(src: Path, wav: np.ndarray, sample_rate: int, dst: Path) -> str:
    """Keep the clip as registered: WAV files byte for byte, anything else as float WAV."""
    import soundfile as sf

    if sf.info(str(src)).format == "WAV":
        data = src.read_bytes()
    else:
        buffer = io.BytesIO()
        sf.write(buffer, wav, sample_rate, format="WAV", subtype="FLOAT")
        data = buffer.getvalue()
    _write_file(dst, data)
    return hashlib.sha256(data).hexdigest()


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """Make a rename or new entry in ``path`` durable (POSIX: fsync the directory)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
