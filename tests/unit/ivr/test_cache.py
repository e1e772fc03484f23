"""The prompt cache: key stability, atomic writes under concurrency, corruption, degraded disk."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from gateway.ivr.cache import PIPELINE_VERSION, PromptCache, PromptKey
from gateway.metrics import Metrics


def key(text: str = "Press 1 for billing.", **overrides: object) -> PromptKey:
    values: dict[str, object] = dict(model="local:abc", voice="speaker:ryan", language="English",
                                     style=None, text=text, seed=0,
                                     audio="dtype=float32,decode=incremental;trim=on,level=-20dBFS")
    values.update(overrides)
    return PromptKey(**values)  # type: ignore[arg-type]


def pcm(n: int = 8000, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * 3000).astype(np.int16)


def test_key_is_stable_and_covers_everything_that_changes_audio() -> None:
    base = key()
    # Pinned: a change here silently invalidates every deployed cache; bump PIPELINE_VERSION
    # instead when the audio really changes.
    assert base.digest() == key().digest()
    assert PIPELINE_VERSION == "1"
    assert len(base.digest()) == 64
    # Whitespace is not content (YAML folding must not re-render a prompt).
    assert key("Press 1   for\nbilling. ").digest() == base.digest()
    for change in [dict(model="local:def"), dict(voice="speaker:vivian"),
                   dict(voice="clone:anna:1234"), dict(language="German"), dict(style="warm"),
                   dict(text="Press 2 for billing."), dict(seed=1), dict(sampling="t0.7"),
                   dict(pipeline="2"), dict(seed=None),
                   dict(audio="dtype=bfloat16,decode=incremental;trim=on,level=-20dBFS"),
                   dict(audio="dtype=float32,decode=windowed;trim=on,level=-20dBFS"),
                   dict(audio="dtype=float32,decode=incremental;trim=off,level=-20dBFS"),
                   dict(audio="dtype=float32,decode=incremental;trim=on,level=off"),
                   dict(audio="dtype=float32,decode=incremental;trim=on,level=-16dBFS")]:
        assert key(**change).digest() != base.digest(), change  # type: ignore[arg-type]


def test_an_unseeded_render_is_keyed_as_unseeded_not_as_seed_0(tmp_path: Path) -> None:
    cache = PromptCache(tmp_path)
    cache.put(key(seed=None), pcm())
    assert PromptCache(tmp_path).get(key(seed=0)) is None
    record = json.loads(next(tmp_path.rglob("*.json")).read_text())
    assert record["key"]["seed"] is None and record["key"]["audio"] == key().audio


def test_the_audio_identity_names_every_setting_that_changes_the_audio() -> None:
    from gateway.audio.condition import Conditioning
    from gateway.ivr.prompts import audio_identity
    from gateway.tts.engine import Engine

    class Rendering(Engine):
        name = speakers = languages = ""  # type: ignore[assignment]

        def __init__(self, settings: str) -> None:
            self.settings = settings

        @property
        def render_settings(self) -> str:
            return self.settings

        def stream(self, request, should_stop=None):  # type: ignore[no-untyped-def]
            raise NotImplementedError

    fp32 = Rendering("dtype=float32,decode=incremental")
    identities = {
        audio_identity(fp32, Conditioning()),
        audio_identity(Rendering("dtype=bfloat16,decode=incremental"), Conditioning()),
        audio_identity(Rendering("dtype=float32,decode=windowed"), Conditioning()),
        audio_identity(fp32, Conditioning(trim_leading_silence=False)),
        audio_identity(fp32, Conditioning(normalize_level=False)),
        audio_identity(fp32, Conditioning(target_dbfs=-16.0)),
        audio_identity(fp32, None),
    }
    assert len(identities) == 7
    assert audio_identity(fp32, Conditioning()) == (
        "dtype=float32,decode=incremental;trim=on,level=-20dBFS")


def test_round_trip_through_disk_as_a_playable_wav(tmp_path: Path) -> None:
    cache = PromptCache(tmp_path)
    audio = pcm()
    cache.put(key(), audio, render_s=0.5)
    fresh = PromptCache(tmp_path)  # a restart: memory empty
    loaded = fresh.get(key())
    assert loaded is not None and np.array_equal(loaded, audio)
    record_path = next(tmp_path.rglob("*.json"))
    record = json.loads(record_path.read_text())
    assert record["text"] == "Press 1 for billing." and record["duration_s"] == 1.0
    wav = record_path.parent / record["wav"]
    info = sf.info(str(wav))
    assert info.samplerate == 8000 and info.subtype == "PCM_16"
    assert fresh.stats.hits == 1 and fresh.get(key("other")) is None and fresh.stats.misses == 1


def test_concurrent_renders_of_one_key_leave_a_consistent_entry(tmp_path: Path) -> None:
    versions = [pcm(4000, seed=i) for i in range(8)]
    caches = [PromptCache(tmp_path) for _ in versions]  # as if 8 processes share the dir
    barrier = threading.Barrier(len(versions))

    def render(i: int) -> None:
        barrier.wait()
        for _ in range(20):
            caches[i].put(key(), versions[i])

    threads = [threading.Thread(target=render, args=(i,)) for i in range(len(versions))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    loaded = PromptCache(tmp_path).get(key())
    assert loaded is not None
    assert any(np.array_equal(loaded, v) for v in versions)
    assert not list(tmp_path.rglob("*.tmp")), "temporary files left behind"


def test_a_reader_never_sees_a_half_written_entry(tmp_path: Path) -> None:
    writer = PromptCache(tmp_path)
    stop = threading.Event()
    bad: list[str] = []

    def read() -> None:
        reader = PromptCache(tmp_path, max_memory_bytes=1)
        while not stop.is_set():
            reader._memory.clear()
            got = reader.get(key())
            if got is not None and len(got) not in (16000, 24000):
                bad.append(f"length {len(got)}")
            if reader.stats.corrupt:
                bad.append("corrupt")

    thread = threading.Thread(target=read)
    thread.start()
    for i in range(40):
        writer.put(key(), pcm(16000 if i % 2 else 24000, seed=i))
    stop.set()
    thread.join()
    assert not bad


@pytest.mark.parametrize("damage", ["flip-a-byte", "truncate", "delete-wav", "garble-record"])
def test_corrupt_entries_are_discarded_never_played(tmp_path: Path, damage: str) -> None:
    metrics = Metrics()
    PromptCache(tmp_path).put(key(), pcm())
    record_path = next(tmp_path.rglob("*.json"))
    wav_path = record_path.parent / json.loads(record_path.read_text())["wav"]
    if damage == "flip-a-byte":
        data = bytearray(wav_path.read_bytes())
        data[1000] ^= 0xFF
        wav_path.write_bytes(bytes(data))
    elif damage == "truncate":
        wav_path.write_bytes(wav_path.read_bytes()[:500])
    elif damage == "delete-wav":
        wav_path.unlink()
    else:
        record_path.write_text("{not json")
    cache = PromptCache(tmp_path, metrics=metrics)
    assert cache.get(key()) is None
    assert cache.stats.corrupt == 1
    assert not record_path.exists()
    # It is re-rendered and served again.
    cache.put(key(), pcm(seed=9))
    assert np.array_equal(PromptCache(tmp_path).get(key()), pcm(seed=9))  # type: ignore[arg-type]
    assert "gateway_prompt_cache_corrupt_total 1.0" in metrics.render().decode()


def test_memory_is_bounded_by_bytes_least_recently_used_first(tmp_path: Path) -> None:
    cache = PromptCache(None, max_memory_bytes=3 * 16000)  # three 1 s prompts
    for i in range(3):
        cache.put(key(f"prompt {i}"), pcm(8000, seed=i))
    assert cache.peek(key("prompt 0")) is not None  # now most recently used
    cache.put(key("prompt 3"), pcm(8000, seed=3))
    assert cache.memory_bytes <= 3 * 16000
    assert cache.peek(key("prompt 1")) is None
    assert cache.peek(key("prompt 0")) is not None and cache.peek(key("prompt 3")) is not None


def test_unwritable_directory_degrades_to_memory_with_an_alarm(tmp_path: Path) -> None:
    # A *file* where the entry's subdirectory must go makes every write fail (even as root,
    # who ignores permission bits): the same path as a read-only or full disk.
    metrics = Metrics()
    cache = PromptCache(tmp_path, metrics=metrics)
    digest = key().digest()
    (tmp_path / digest[:2]).write_text("not a directory")
    cache.put(key(), pcm())
    assert cache.stats.write_errors == 1
    assert np.array_equal(cache.peek(key()), pcm())  # type: ignore[arg-type]
    assert "gateway_prompt_cache_write_errors_total 1.0" in metrics.render().decode()
