"""The built-in PocketSphinx recogniser on synthetic caller speech through the 8 kHz G.711 path.

A handful of utterances (the benchmark, bench/asr.py, runs the whole corpus): in-menu phrases
and synonyms, the out-of-menu sentences a grammar alone forces onto "billing", digit strings,
silence, the dictionary and language checks, and decoder failures.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gateway.asr.base import MatchStatus, RecognitionResult, Recognizer, to_pcm16
from gateway.asr.grammar import SpeechGrammar
from gateway.asr.sphinx import LANGUAGES, PocketSphinxRecognizer, check_grammar, unknown_words
from gateway.asr.synth import RATE, SynthVoice, phone_line, synthesize
from gateway.audio.g711 import alaw_encode, ulaw_decode
from gateway.errors import GrammarError, RecognizerError

MENU = SpeechGrammar.build({
    "balance": ["account balance", "my balance"],
    "agent": ["agent", "representative", "operator"],
    "billing": ["billing", "pay my bill"],
    "support": ["technical support"],
})
DIGITS = SpeechGrammar.build({"agent": ["agent"]}, digits=6)
SLT = SynthVoice("flite", "slt")
KAL = SynthVoice("flite", "kal")
ESPEAK = SynthVoice("espeak-ng", "en-us")
LEAD_S = 0.3


@pytest.fixture(scope="module")
def asr() -> PocketSphinxRecognizer:
    return PocketSphinxRecognizer()


@pytest.fixture(scope="module")
def grammar_only() -> PocketSphinxRecognizer:
    return PocketSphinxRecognizer(rejection=False)


def _caller(text: str, voice: SynthVoice, snr_db: float | None = None) -> np.ndarray:
    return ulaw_decode(phone_line(synthesize(text, voice), snr_db=snr_db, seed=7, lead_s=LEAD_S))


def test_it_is_a_recognizer(asr: PocketSphinxRecognizer) -> None:
    assert isinstance(asr, Recognizer)
    assert asr.name.startswith("pocketsphinx-5.")
    assert asr.languages == LANGUAGES == frozenset({"en"})


@pytest.mark.parametrize(
    ("text", "voice", "snr_db", "branch", "phrase"),
    [
        ("account balance", SLT, None, "balance", "account balance"),
        ("representative", KAL, 20.0, "agent", "representative"),
        ("operator please", ESPEAK, None, "agent", "operator"),
    ],
)
def test_in_menu_phrases_and_synonyms_route_to_their_branch(
    asr: PocketSphinxRecognizer, text: str, voice: SynthVoice, snr_db: float | None,
    branch: str, phrase: str,
) -> None:
    pcm = _caller(text, voice, snr_db)
    r = asr.recognize(pcm, MENU)
    assert r.status is MatchStatus.MATCH, r
    assert (r.branch, r.phrase, r.digits) == (branch, phrase, None)
    assert r.matched and r.reason is None
    assert 0.0 < r.confidence <= 1.0
    speech_s = len(synthesize(text, voice)) / RATE
    assert r.speech_start_s is not None and r.speech_end_s is not None
    # Frames are 10 ms; the recogniser's word edges sit within ~100 ms of the real ones.
    assert abs(r.speech_start_s - LEAD_S) <= 0.1, r
    assert r.speech_end_s <= LEAD_S + speech_s + 0.15, r
    assert r.audio_s == pytest.approx(len(pcm) / RATE)
    assert 0.0 < r.cpu_s < 10 * r.audio_s
    assert r.recognizer == asr.name


@pytest.mark.parametrize(
    ("text", "voice"),
    [("hello", SLT), ("I would like to cancel my subscription", SLT),
     ("what are your opening hours", ESPEAK)],
)
def test_out_of_menu_speech_is_no_match_where_the_grammar_alone_forces_a_branch(
    asr: PocketSphinxRecognizer, grammar_only: PocketSphinxRecognizer, text: str,
    voice: SynthVoice,
) -> None:
    pcm = _caller(text, voice)
    forced = grammar_only.recognize(pcm, MENU)
    assert forced.status is MatchStatus.MATCH, "the baseline this rejection improves on"
    r = asr.recognize(pcm, MENU)
    assert r.status is MatchStatus.NO_MATCH, r
    assert r.branch is None and r.phrase is None and r.digits is None
    assert r.transcript and r.transcript in (r.reason or "")
    assert r.speech_start_s is not None and r.speech_end_s is not None
    assert r.speech_start_s < r.speech_end_s <= r.audio_s


@pytest.mark.parametrize(
    ("text", "voice", "digits"),
    [("four one seven oh two nine", KAL, "417029"),
     ("nine two two, three two nine", ESPEAK, "922329"),
     # "six" over the telephone band (its /s/ is above 4 kHz): without the band-limited
     # pronunciations these were heard "four five ..." / "three zero five ..." and rejected.
     ("four six zero zero six one", ESPEAK, "460061"),
     ("three zero six, two six two", ESPEAK, "306262")],
)
def test_digits_by_voice_fill_the_digit_string(
    asr: PocketSphinxRecognizer, text: str, voice: SynthVoice, digits: str
) -> None:
    r = asr.recognize(_caller(text, voice), DIGITS)
    assert r.status is MatchStatus.MATCH, r
    assert (r.digits, r.branch) == (digits, None)


def test_digits_gather_rejects_a_sentence_and_still_takes_its_phrase(
    asr: PocketSphinxRecognizer,
) -> None:
    no = asr.recognize(_caller("I don't know my account number", SLT), DIGITS)
    assert no.status is MatchStatus.NO_MATCH, no
    yes = asr.recognize(_caller("agent", SLT), DIGITS)
    assert (yes.status, yes.branch) == (MatchStatus.MATCH, "agent")


def test_silence_and_line_noise_are_no_speech(asr: PocketSphinxRecognizer) -> None:
    silence = np.zeros(2 * RATE, dtype=np.int16)
    assert asr.recognize(silence, MENU).status is MatchStatus.NO_SPEECH
    assert asr.recognize(silence[:400], MENU).status is MatchStatus.NO_SPEECH


def test_same_audio_same_result_whatever_came_before(asr: PocketSphinxRecognizer) -> None:
    pcm = _caller("billing", KAL)
    first = asr.recognize(pcm, MENU)
    asr.recognize(_caller("I would like to cancel my subscription", ESPEAK, 15.0), MENU)
    second = asr.recognize(pcm, MENU)
    assert dataclasses.replace(first, cpu_s=0.0) == dataclasses.replace(second, cpu_s=0.0)
    assert first.branch == "billing"


def test_grammars_sharing_a_multi_word_phrase_both_compile_and_recognise_it(
    asr: PocketSphinxRecognizer,
) -> None:
    # The open pass makes "technical support" one dictionary word; a second grammar with the
    # same phrase (another gather) must reuse it, not fail to add it again.
    other = SpeechGrammar.build({"help": ["technical support", "help desk"]})
    asr.prepare(MENU)
    asr.prepare(other)
    pcm = _caller("technical support", SLT)
    assert asr.recognize(pcm, other).branch == "help"
    assert asr.recognize(pcm, MENU).branch == "support"


def test_encodings_decode_to_the_same_pcm() -> None:
    pcm = _caller("agent", SLT)
    assert np.array_equal(to_pcm16(pcm.tobytes(), "l16"), pcm)
    alaw = to_pcm16(alaw_encode(pcm), "pcma")
    assert np.max(np.abs(alaw.astype(int) - pcm)) <= 1024  # A-law vs mu-law quantisation
    with pytest.raises(ValueError, match="whole number"):
        to_pcm16(b"\x00\x01\x02", "l16")
    with pytest.raises(ValueError, match="unknown audio encoding"):
        to_pcm16(b"", "opus")  # type: ignore[arg-type]


def test_unknown_words_are_located_for_the_validator() -> None:
    found = unknown_words(["frobnicate the widget", "Press 1 for", "that's right"])
    assert [(u.phrase, u.word, u.offset) for u in found] == [
        ("frobnicate the widget", "frobnicate", 0), ("Press 1 for", "1", 6)]
    assert str(found[0]) == '"frobnicate" is not in the recogniser\'s dictionary'
    assert "spell numbers out" in str(found[1])


def test_grammars_the_recogniser_cannot_use_raise_grammar_error(
    asr: PocketSphinxRecognizer,
) -> None:
    german = SpeechGrammar.build({"ja": ["ja"]}, language="German")
    assert any("only knows English" in p for p in check_grammar(german))
    with pytest.raises(GrammarError, match="only knows English"):
        asr.prepare(german)
    with pytest.raises(GrammarError, match='"frobnicate" is not in'):
        asr.recognize(np.zeros(RATE, dtype=np.int16),
                      SpeechGrammar.build({"x": ["frobnicate now"]}))
    assert check_grammar(MENU) == []


def test_a_decoder_failure_is_a_recognizer_error(asr: PocketSphinxRecognizer) -> None:
    class Broken:
        def __getattr__(self, name: str) -> object:
            return getattr(asr._decoder, name)

        def process_raw(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError("process_raw failed")

    broken = PocketSphinxRecognizer()
    broken._decoder = Broken()
    with pytest.raises(RecognizerError, match="PocketSphinx failed on this turn"):
        broken.recognize(_caller("agent", SLT), MENU)


def test_results_are_plain_values() -> None:
    r = RecognitionResult(MatchStatus.NO_MATCH, reason="x")
    assert not r.matched
    assert RecognitionResult(MatchStatus.MATCH, branch="a").matched
