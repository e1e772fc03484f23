"""Registered cloned voices: real prompts from the tiny Base checkpoint, stored and reloaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf
import torch

from gateway.cli import main
from gateway.ivr import voices
from gateway.ivr.voices import VoiceError, VoiceRegistry

TEXT = "Thanks for calling, how can I help?"


def voiced_clip(path: Path, seconds: float = 2.0, rate: int = 16_000, f0: float = 120.0,
                channels: int = 1) -> Path:
    """A synthetic voiced signal: a harmonic series with vibrato, syllable-rate envelope."""
    t = np.arange(int(seconds * rate)) / rate
    phase = 2 * np.pi * np.cumsum(f0 * (1 + 0.05 * np.sin(2 * np.pi * 5 * t))) / rate
    wave = sum(np.sin(k * phase) / k for k in range(1, 12))
    wave *= 0.5 + 0.5 * np.abs(np.sin(2 * np.pi * 2 * t))  # ~4 syllables per second
    wave = (0.3 * wave / np.abs(wave).max()).astype(np.float32)
    sf.write(str(path), np.stack([wave] * channels, axis=1) if channels > 1 else wave, rate)
    return path


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return voiced_clip(tmp_path_factory.mktemp("clips") / "ref.wav")


@pytest.fixture(scope="module")
def base_model(tiny_base_model_dir: Path) -> Any:
    from qwen_tts import Qwen3TTSModel

    return Qwen3TTSModel.from_pretrained(
        str(tiny_base_model_dir), device_map="cpu", dtype=torch.float32
    )


@pytest.fixture(scope="module")
def registered(
    tmp_path_factory: pytest.TempPathFactory, clip: Path, tiny_base_model_dir: Path
) -> VoiceRegistry:
    """A registry holding voice ``alice``, registered once for the read-only tests."""
    registry = VoiceRegistry(tmp_path_factory.mktemp("voices"))
    registry.add("alice", clip, TEXT, base_model=str(tiny_base_model_dir))
    return registry


def add(directory: Path, name: str, ref: Path, text: str, model: Path) -> int:
    return main(["voices", "add", "--text", text, "--dir", str(directory),
                 "--base-model", str(model), "--", name, str(ref)])


def test_cli_add_list_remove(
    tmp_path: Path, clip: Path, tiny_base_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert add(tmp_path, "front-desk", clip, TEXT, tiny_base_model_dir) == 0
    assert "registered voice 'front-desk'" in capsys.readouterr().out

    record = VoiceRegistry(tmp_path).get("front-desk")
    assert record.ref_text == TEXT and record.sample_rate == 16_000 and record.channels == 1
    assert record.ref_duration_s == pytest.approx(2.0)
    assert record.base_model == str(tiny_base_model_dir)
    assert record.icl_mode and not record.x_vector_only_mode
    assert len(record.identity) == 64
    assert (tmp_path / "front-desk" / "reference.wav").read_bytes() == clip.read_bytes()

    assert main(["voices", "list", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for column in ("front-desk", "2.00 s", TEXT, str(tiny_base_model_dir), record.identity[:12]):
        assert column in out
    assert main(["voices", "list", "--dir", str(tmp_path), "--json"]) == 0
    (doc,) = json.loads(capsys.readouterr().out)
    assert doc["prompt_sha256"] == record.identity and doc["created"] == record.created.isoformat()

    assert main(["voices", "remove", "front-desk", "--dir", str(tmp_path)]) == 0
    assert main(["voices", "list", "--dir", str(tmp_path)]) == 0
    assert "no voices in" in capsys.readouterr().out
    with pytest.raises(VoiceError, match="no voice named 'front-desk'"):
        VoiceRegistry(tmp_path).get("front-desk")
    assert not (tmp_path / ".store" / "front-desk").exists()  # its versions went with it


def test_remove_of_an_unknown_voice_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["voices", "remove", "nobody", "--dir", str(tmp_path)]) == 1
    assert "error: no voice named 'nobody'" in capsys.readouterr().err


def test_the_voices_dir_defaults_to_env_then_cwd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_VOICES_DIR", "/srv/voices")
    assert voices.default_voices_dir() == Path("/srv/voices")
    monkeypatch.delenv("GATEWAY_VOICES_DIR")
    assert voices.default_voices_dir() == Path("voices")


def test_the_stored_prompt_round_trips(
    registered: VoiceRegistry, clip: Path, base_model: Any
) -> None:
    # What qwen-tts computes for the clip (+ the 0.5 s of silence the registry appends) is
    # exactly what comes back from disk.
    wav, rate = sf.read(str(clip), dtype="float32")
    padded = np.concatenate([wav, np.zeros(int(voices.APPENDED_SILENCE_S * rate), np.float32)])
    (fresh,) = base_model.create_voice_clone_prompt(ref_audio=(padded, rate), ref_text=TEXT)
    prompt = registered.load_prompt("alice")
    assert set(prompt) == {"ref_code", "ref_spk_embedding", "x_vector_only_mode", "icl_mode"}
    assert prompt["x_vector_only_mode"] == [False] and prompt["icl_mode"] == [True]
    (code,) = prompt["ref_code"]
    (embedding,) = prompt["ref_spk_embedding"]
    assert code.dtype == torch.int64 and code.shape[1] == 16
    assert torch.equal(code, fresh.ref_code)
    assert torch.equal(embedding, fresh.ref_spk_embedding)
    assert registered.get("alice").ref_code_frames == code.shape[0]


def test_a_loaded_voice_generates_with_qwen_tts(registered: VoiceRegistry, base_model: Any) -> None:
    items = registered.load_prompt_items("alice")
    assert items[0].ref_text == TEXT and items[0].icl_mode
    wavs, rate = base_model.generate_voice_clone(
        text="Hello.", language="English", voice_clone_prompt=items, max_new_tokens=10
    )
    assert rate == 24_000 and wavs[0].ndim == 1 and len(wavs[0]) > 0
    assert np.isfinite(wavs[0]).all()


def test_a_loaded_voice_streams_with_faster_qwen3_tts(
    registered: VoiceRegistry, base_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from faster_qwen3_tts.model import FasterQwen3TTS

    record, prompt = registered.load("alice")
    fast = FasterQwen3TTS(base_model=base_model, predictor_graph=None, talker_graph=None,
                          device="cpu", dtype=torch.float32)
    fast._warmed_up = True  # nothing to capture: no CUDA graphs on CPU

    # The dict form (+ ref_text) builds the same talker inputs as qwen-tts's own prompt items.
    from_dict = fast._prepare_generation(text="Hello.", language="English",
                                         ref_text=record.ref_text, voice_clone_prompt=prompt)
    from_items = fast._prepare_generation(text="Hello.", language="English",
                                          voice_clone_prompt=registered.load_prompt_items("alice"))
    for a, b in zip(from_dict[3:], from_items[3:], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(from_dict[-1], prompt["ref_code"][0])  # ICL: returned for the decoder

    # parity_mode is the library's graph-free loop; it only calls torch.cuda.synchronize.
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    stream = fast.generate_voice_clone_streaming(
        text="Hello.", language="English", ref_text=record.ref_text, voice_clone_prompt=prompt,
        max_new_tokens=6, min_new_tokens=6, chunk_size=3, parity_mode=True,
    )
    chunks = [(chunk, rate) for chunk, rate, _timing in stream]
    assert {rate for _, rate in chunks} == {24_000}
    assert sum(len(chunk) for chunk, _ in chunks) == 6 * 1920


def test_identity_is_the_content(
    tmp_path: Path, clip: Path, tiny_base_model_dir: Path, registered: VoiceRegistry
) -> None:
    original = registered.get("alice")
    assert registered.get("alice").identity == original.identity  # loading twice
    assert registered.load("alice")[0] == original

    registry = VoiceRegistry(tmp_path)
    model = str(tiny_base_model_dir)
    same = registry.add("alice", clip, TEXT, base_model=model)
    assert same.identity == original.identity  # same clip, text and model: same voice
    new_text = registry.add("alice", clip, "Press one for billing.", base_model=model)
    assert new_text.identity != original.identity
    assert registry.get("alice").identity == new_text.identity
    other = voiced_clip(tmp_path / "other.wav", rate=44_100, f0=180.0, channels=2)
    new_clip = registry.add("alice", other, "Press one for billing.", base_model=model)
    assert new_clip.identity not in (original.identity, new_text.identity)
    assert (new_clip.sample_rate, new_clip.channels) == (44_100, 2)
    # Re-registering replaced the voice: one version is left on disk.
    assert len(list((tmp_path / ".store" / "alice").iterdir())) == 1


def test_leftovers_of_a_crashed_writer_are_invisible(
    tmp_path: Path, clip: Path, tiny_base_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = VoiceRegistry(tmp_path)
    before = registry.add("alice", clip, TEXT, base_model=str(tiny_base_model_dir))
    # A half-built voice as a crash leaves it: a build dir with a voice.json and no prompt.
    half = tmp_path / ".tmp-bob-x1y2z3"
    half.mkdir()
    (half / "voice.json").write_text("{")
    assert [r.name for r in registry.list()] == ["alice"]
    with pytest.raises(VoiceError, match="no voice named 'bob'"):
        registry.get("bob")

    # A re-registration that dies before its publishing rename leaves the old voice intact.
    def crash(src: Any, dst: Any) -> None:
        raise OSError("simulated crash")

    monkeypatch.setattr(voices.os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        registry.add("alice", clip, "Something else.", base_model=str(tiny_base_model_dir))
    monkeypatch.undo()
    assert registry.get("alice") == before
    assert registry.load_prompt("alice")["ref_code"][0].shape[0] == before.ref_code_frames
    assert [r.name for r in registry.list()] == ["alice"]


def test_a_corrupt_prompt_is_detected(registered: VoiceRegistry, tmp_path: Path) -> None:
    import shutil

    copy = VoiceRegistry(tmp_path / "voices")
    shutil.copytree(registered.directory, copy.directory, symlinks=True)
    prompt_file = copy.directory / "alice" / "prompt.safetensors"
    data = bytearray(prompt_file.read_bytes())
    data[-1] ^= 0xFF
    prompt_file.write_bytes(bytes(data))
    with pytest.raises(VoiceError, match=r"voice 'alice' .* is corrupt: .*checksum mismatch"):
        copy.load_prompt("alice")
    with pytest.raises(VoiceError, match="checksum mismatch"):
        copy.get("alice")

    (copy.directory / "alice" / "voice.json").write_text('{"format": 1, "name": "alice"')
    with pytest.raises(VoiceError, match=r"voice 'alice' .* is corrupt"):
        copy.get("alice")
    assert copy.list() == []  # skipped (and logged), the listing itself still works


@pytest.mark.parametrize(
    "name", ["Alice", "-alice", "_x", "a" * 65, "a/b", "..", "", "alice\n", "al ice", "é"]
)
def test_bad_names_are_rejected(
    name: str, tmp_path: Path, clip: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert add(tmp_path, name, clip, TEXT, tmp_path / "unused-model") == 1
    assert "error: invalid voice name" in capsys.readouterr().err
    with pytest.raises(VoiceError, match="invalid voice name"):
        VoiceRegistry(tmp_path).get(name)


def test_name_limits_are_accepted() -> None:
    for name in ("a", "0", "a" * 64, "front_desk-2"):
        assert voices.validate_name(name) == name


@pytest.mark.parametrize(
    ("seconds", "message"), [(0.5, "too short (0.50 s)"), (30.5, "too long (30.50 s)")]
)
def test_reference_length_limits(
    seconds: float, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ref = voiced_clip(tmp_path / "ref.wav", seconds=seconds, rate=8_000)
    assert add(tmp_path, "alice", ref, TEXT, tmp_path / "unused-model") == 1
    err = capsys.readouterr().err
    assert message in err and "use 1-30 s" in err


@pytest.mark.parametrize("text", ["", "   \n"])
def test_an_empty_reference_text_is_rejected(
    text: str, tmp_path: Path, clip: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert add(tmp_path, "alice", clip, text, tmp_path / "unused-model") == 1
    assert "error: the reference text is empty" in capsys.readouterr().err


def test_unreadable_or_missing_clips_are_clear_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    junk = tmp_path / "junk.wav"
    junk.write_bytes(b"not audio at all")
    assert add(tmp_path, "alice", junk, TEXT, tmp_path / "unused-model") == 1
    assert "error: cannot read reference clip" in capsys.readouterr().err
    assert add(tmp_path, "alice", tmp_path / "missing.wav", TEXT, tmp_path / "m") == 1
    assert "does not exist" in capsys.readouterr().err
    assert not any(tmp_path.glob(".tmp-*"))


def test_a_non_base_model_is_refused(
    tmp_path: Path, clip: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert add(tmp_path, "alice", clip, TEXT, tiny_model_dir) == 1
    assert "voice-clone prompts need a Qwen3-TTS Base model" in capsys.readouterr().err
