"""The built-in recogniser: PocketSphinx 5 with the en-us model its wheel ships (no download).

Everything below was measured on the development half of the corpus that ``bench/asr.py``
generates (flite and espeak-ng voices through the real 8 kHz G.711 path; its target conditions
are clean, quiet and 20 dB line noise: 312 in-menu phrases, 144 out-of-menu sentences, 24
near-miss words, 96 six-digit strings); ``bench/asr.py`` reports the held-out half, which none
of these choices looked at.

**Audio.** The acoustic model is a 16 kHz one (its ``feat.params``: 25 mel filters up to
6.8 kHz). Telephone audio is resampled 8 -> 16 kHz (``scipy.signal.resample_poly``); the band
above 4 kHz stays empty. Running the model's front end at 8 kHz instead (``-samprate 8000
-nfft 256``, filters cut at 3.5 kHz) mismatches every cepstrum the model was trained on:
"agent", "yes" and "billing" by espeak-ng became "no". Digital silence breaks it too: G.711
silence decodes to exact zeros, whose log spectrum dominates the utterance's cepstral mean, and
clean espeak-ng phrases fell from 39/40 (on a noisy line) to 17/40. So the recogniser adds a
seeded, deterministic noise floor 30 dB under the utterance's speech level before the front end
(-50 dBFS for speech at -20 dBFS; floors of -60, -45 and -40 dBFS measured worse).

**Rejection** (what is not in the menu) is the hard part: the grammar alone forces every sound
onto some phrase. Measured, best first:

* *A grammar pass plus an open-vocabulary pass with a menu-biased language model* (kept). The
  open pass is an n-gram search whose bigram model gives the grammar's phrases (and digit
  strings) ``PHRASE_BIAS`` = 99.9 % of a sentence's start, and backs off to the 1,000 most
  frequent English words of the bundled ``en-us.lm.bin`` (their unigram probabilities) as the
  garbage model (see "The garbage vocabulary" below). A turn matches a phrase only when the
  open pass hears exactly that phrase (fillers such as "please" allowed at the edges); the
  grammar pass only proposes digit strings (below). Each multi-word phrase is one compound word
  of the open pass (``tech_support``, pronounced as its words in a row), so the search cannot
  leave it half-way for garbage words: 90.7 % in-menu accuracy at 3.5 % false accepts, against
  87.5 % / 2.1 % with phrases as word sequences ("technical support" was heard "technical the
  for", "check my balance" "check my not and"), and with ``MIN_CONFIDENCE`` 0.1 on the match's
  posterior 90.4 % / 2.8 %. Earlier, on a smaller corpus: the open pass alone 91.9 % / 5.0 %;
  with a 95 % bias 89.4 % / 2.5 %.
* A confidence threshold on the grammar pass alone: its posterior (``hyp.prob``) is ~0.5 for
  in-menu and out-of-menu speech alike (it is the posterior among grammar paths, which are all
  there is); the colleague's 0.88 for "hello" -> "billing" is typical.
* A likelihood ratio against a phone loop (``allphone`` search with the bundled phone
  bigram): 60 % in-menu accuracy at 5 % false accepts.
* Keyword spotting (``kws`` search, per-phone thresholds 1e-2 ... 1e-8): at best 48 % / 25 %.
* A garbage loop inside the grammar: of single-phone words, ~9 s of CPU per 1.3 s utterance
  (PocketSphinx's FSG search expands every cross-word triphone context); of 193 common words,
  slower still; of the ``[SPEECH]`` filler (+SPN+), never chosen (83 % false accepts).

Near-miss single words ("building" for "billing", "agency" for "agent") are still accepted
most of the time; ``bench/asr.py`` reports them in a row of their own.

**Digit strings** are this model's weak spot over the telephone band. Its digit errors were
mostly "six" heard as five, three or two (34 of 91 on the dev half): the /s/ of "six" (and of
"seven") lies above 4 kHz, where telephone audio has nothing and the 16 kHz model expects
frication. :data:`BAND_LIMITED_PRONS` gives both words variants with /f/ or /th/ for the /s/
(and "six" without its final /s/): dev six-digit strings 41.7 % -> 42.7 % exact with S IH K
alone, 61.5 % with all the "six" variants, 66.7 % with "seven"'s too; in-menu and false accepts
unchanged, digits-gather false accepts 1 -> 2 of 24 (held-out test half: 48.3 % -> 57.5 %, see
bench/RESULTS.md). What is left is mostly voice-specific: "nine" heard as "one" (13, nearly all
one espeak-ng voice) and "four" as "five" (9, flite slt). Measured and not better: wider beams
(-beam 1e-80, -wbeam 1e-60: 41/96, at 17x the CPU), noise floors 28 and 40 dB under the speech
(39 and 45/96), folding the 0-4 kHz band into 4-8 kHz as a crude bandwidth extension
(34-37/96), a stronger digit-to-digit weight in the open pass (worse), other acceptance rules
(digit words heard by the open pass, lattice posteriors), and a lower ``DIGITS_SIMILARITY``
(with "six" also as S IH K, 0.4 gave 49 % exact but 29 % of sentences accepted as digits,
against 43 % / 4 % at 0.5). Keys remain the reliable way to enter an account number.

**Also measured on the dev half and not kept** (in-menu / false accepts / six-digit exact,
against 90.4 % / 2.8 % / 41.7 % before the digit variants): accepting the grammar pass's branch
when the open pass heard one of that branch's phrases among garbage words (91.7 % / 16.7 %:
out-of-menu sentences contain menu words, "I don't know" holds "no"); accepting the grammar
pass's phrase when its acoustic score per frame is within a threshold of the open pass's (a
likelihood ratio; -0.5: 91.3 % / 4.2 %, -0.2: 91.3 % / 4.9 %, 0: 92.0 % / 10.4 %); the open
pass's N-best list (its distinct entries are the same words in other segmentations);
``-lw 9`` (91.0 % / 4.2 % / 40.6 %); ``-wip 0.2`` (90.4 % / 2.8 % / 38.5 %); ``-fillprob
1e-4`` (89.7 % / 2.8 % / 42.7 %, digits-gather false accepts 1 -> 2 of 24); every combination
of the words' dictionary pronunciations for a compound ("say that again": DH AH T, AH G EY N;
chosen 12 times, no result changed); VTLN ``-warp_type inverse_linear -warp_params`` 0.94
(90.7 % / 3.5 %) and, with the digit variants, 1.06 (91.3 % / 2.8 % / 60.4 %); band-limited
variants of every phrase word, as for "six" (each S, Z and TH dropped or made F or TH, one at a
time: "tech support" as T EH K AH P AO R T; 91.7 % / 6.2 % / 67.7 %: the phrases take in more
garbage); and the grammar pass's phrase when the open pass heard it followed by one short word
("billing when" for "billing please"; 90.7-91.0 % / 9.0-9.7 %: "thank you" is heard "billing
to").

**The garbage vocabulary** is the 1,000 most frequent words (it was 2,000 until the gateway's
end-of-speech latency was measured against the recognition time). The open pass's CPU scales
with it, and at the end of a caller's turn the decode is what the caller waits for once the
gather's ``complete_timeout`` has run out. Measured on the whole corpus in one session (dev
half: in-menu / false accepts / six-digit exact / digits-gather false accepts; test half, with
the line noise of a run that generated both halves: in-menu / six-digit exact; open-pass CPU of
main-menu phrases p50 / p95):

=====  ==============================  ===============  ==================
words  dev half                        test half        main-menu decode
=====  ==============================  ===============  ==================
2,000  90.4 % / 2.8 % / 66.7 % / 2/24  76.7 % / 58.3 %  139 / 225 ms
1,000  90.7 % / 2.8 % / 67.7 % / 3/24  77.2 % / 57.5 %  121 / 185 ms
500    91.3 % / 2.8 % / 64.6 % / 2/24  79.2 % / 57.5 %  114 / 173 ms
=====  ==============================  ===============  ==================

1,000 loses nothing on the dev half beyond one utterance (a digits-gather sentence); 500 loses
two digit strings there (its test-half in-menu gain was not looked at to choose). The whole
corpus costs 13 % less CPU with 1,000 words than with 2,000.

**Cost.** About 0.1 s of CPU per second of audio for both passes together (the open pass is
~85 % of it), so one core holds ~10 callers listening at once (``bench/asr.py`` measures it).
Each decode is of the whole turn so far: streaming the open pass as frames arrive (live
cepstral mean from a telephone prior) measured 1-2 points worse and would leave ~40 % of the
work (its second and lattice passes) at the end anyway. The gateway decodes at each pause of a
turn (:mod:`gateway.ivr.listening`), so a turn costs one decode per pause that got one (the
call's trace counts them). PocketSphinx holds the GIL for the
whole of a decode (a 0.3 s decode blocked another thread for 0.19 s), hence the worker
processes of :mod:`gateway.asr.pool`. A cheaper open pass, ``-fwdflat no -maxwpf 20``, cost
30-40 % less CPU at no loss on the dev half but lost 4.6 points in-menu on the held-out half
(bench/RESULTS.md), so the decoder keeps PocketSphinx's default search; ``-bestpath no`` would
leave every word's posterior at 1.0 (no lattice), and the confidence floor with nothing to do.
"""

from __future__ import annotations

import collections
import functools
import importlib.util
import itertools
import math
import os
import tempfile
import threading
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt
from scipy import signal

from gateway.asr.base import RATE, MatchStatus, RecognitionResult, UnknownWord
from gateway.asr.grammar import (
    DIGIT_WORDS,
    EDGE_FILLERS,
    POLITE_WORDS,
    Match,
    SpeechGrammar,
    match,
    tokenize,
)
from gateway.errors import GrammarError, RecognizerError, RecognizerUnavailable

__all__ = [
    "LANGUAGES",
    "PHRASE_BIAS",
    "VOCABULARY",
    "BuiltinVocabulary",
    "PocketSphinxRecognizer",
    "check_grammar",
    "dictionary",
    "unknown_words",
]

LANGUAGES: Final[frozenset[str]] = frozenset({"en"})
"""The wheel ships one model: US English (it copes with other English accents)."""

PHRASE_BIAS: Final[float] = 0.999
"""Share of the open pass's sentence starts given to the grammar's phrases (see above)."""

GARBAGE_WORDS: Final[int] = 1000
"""How many of the most frequent English words compete with the phrases in the open pass."""

NOISE_FLOOR_DB: Final[float] = 34.0
"""The added noise floor sits this far under the speech level (the 95th percentile of 20 ms
frame power: ~4 dB over the speech's RMS, so -50 dBFS for speech at -20 dBFS RMS)."""

DIGITS_SIMILARITY: Final[float] = 0.5
"""A grammar-pass digit string needs at least this phonetic similarity to the open pass."""

MIN_CONFIDENCE: Final[float] = 0.1
"""Default confidence below which a match becomes ``NO_MATCH``. Calibrated on the dev half
(``bench/asr.py --sweep``): a real phrase's lattice posterior is ~1.0, while sentences the open
pass forced onto a phrase come out near 0.07 ("hello" -> "billing"); 0.1 rejects one of those
for one in-menu phrase lost, and higher thresholds lose more phrases than they reject."""

BAND_LIMITED_PRONS: Final[Mapping[str, tuple[str, ...]]] = {
    "six": ("S IH K", "F IH K S", "TH IH K S", "F IH K", "TH IH K"),
    "seven": ("F EH V AH N", "TH EH V AH N"),
}
"""Extra pronunciations of digit words for telephone audio (see "Digit strings" above): the
/s/ of "six" and "seven" is frication above 4 kHz, which G.711 cuts off, so what is left sounds
to the 16 kHz model like the weaker /f/ or /th/ (or nothing), and "six" was heard as "five",
"three" or "two". These variants let the search match the band-limited sound to the word
actually said."""

_FRAME_RATE: Final[int] = 100  # PocketSphinx features: 10 ms frames (-frate 100)
_FOLLOW: Final[float] = 0.9  # in the open pass, a phrase word is followed by its phrase's next
_END: Final[float] = 0.15  # share of unigram mass given to ending a garbage sentence
_NOT_WORDS: Final[frozenset[str]] = frozenset({"<s>", "</s>", "<sil>", "[noise]", "[speech]"})
_DECODER_LOCK = threading.Lock()


def _model_dir() -> Path:
    spec = importlib.util.find_spec("pocketsphinx")
    if spec is None or spec.origin is None:
        raise RecognizerUnavailable("pocketsphinx is not installed; pip install pocketsphinx")
    path = Path(spec.origin).parent / "model" / "en-us"
    if not (path / "cmudict-en-us.dict").is_file():
        raise RecognizerUnavailable(f"pocketsphinx is installed but its model {path} is missing")
    return path


def _version() -> str:
    from importlib.metadata import version

    return version("pocketsphinx")


@functools.cache
def dictionary() -> Mapping[str, tuple[str, ...]]:
    """The model's pronunciation dictionary (CMUdict): word -> its pronunciations (ARPAbet).

    Read once per process from the wheel (~135,000 entries, ~0.3 s); no decoder needed, so a
    script validator can use it.
    """
    prons: dict[str, list[str]] = collections.defaultdict(list)
    with open(_model_dir() / "cmudict-en-us.dict", encoding="utf-8") as f:
        for line in f:
            word, _, pron = line.strip().partition(" ")
            if not pron:
                continue
            base = word.split("(", 1)[0]  # "zero(2)" is zero's second pronunciation
            prons[base].append(pron.split("#", 1)[0].strip())
    return {w: tuple(p) for w, p in prons.items()}


def unknown_words(phrases: Iterable[str]) -> list[UnknownWord]:
    """Every word of ``phrases`` the dictionary lacks, with its offset in the phrase."""
    words = dictionary()
    out = []
    for phrase in phrases:
        for token in tokenize(phrase):
            if token.word not in words:
                hint = ("spell numbers out as they are said" if any(c.isdigit() for c in
                        token.word) else "")
                out.append(UnknownWord(phrase, token.word, token.offset, hint))
    return out


def check_grammar(grammar: SpeechGrammar) -> list[str]:
    """Why the built-in recogniser cannot use ``grammar`` (empty list: it can)."""
    problems = []
    if grammar.transcribe:
        problems.append("the built-in recogniser cannot transcribe free-form speech; configure "
                        "the neural one (GATEWAY_ASR=whisper)")
    if grammar.language not in LANGUAGES:
        problems.append(f"the built-in recogniser only knows English, not {grammar.language!r};"
                        " configure a recogniser for that language")
    phrases = [p for _, ps in grammar.branches for p in ps]
    problems += [f"{u} (in {u.phrase!r})" for u in unknown_words(phrases)]
    return problems


class BuiltinVocabulary:
    """The built-in recogniser's languages and dictionary, for script validation (reads the
    wheel's dictionary once; loads no decoder)."""

    @property
    def languages(self) -> frozenset[str]:
        return LANGUAGES

    def unknown_words(self, phrases: Iterable[str]) -> list[UnknownWord]:
        return unknown_words(phrases)


VOCABULARY: Final = BuiltinVocabulary()
"""What :func:`gateway.ivr.script.load_script` checks speech gathers against by default."""


@functools.cache
def _general_unigrams() -> tuple[tuple[str, float], ...]:
    """Dictionary words by frequency in the bundled general language model: (word, ln p)."""
    import pocketsphinx

    lm = pocketsphinx.NGramModel.readfile(str(_model_dir() / "en-us.lm.bin"))
    unknown = lm.prob(["<unk>"])
    ranked = []
    for word in dictionary():
        p = lm.prob([word])  # log base 1.0001, PocketSphinx's logmath default
        if p > unknown and word.isascii():
            ranked.append((p, word))
    ranked.sort(key=lambda pw: (-pw[0], pw[1]))
    return tuple((w, p * math.log(1.0001)) for p, w in ranked)


def _compound(words: Sequence[str]) -> str:
    """The open pass's single dictionary word for a multi-word phrase ("tech_support")."""
    return "_".join(words)


def _open_lm(grammar: SpeechGrammar, bias: float, garbage_words: int,
             compound: bool = True) -> str:
    """ARPA text of the open pass's bigram model for ``grammar`` (see the module docstring).

    With ``compound`` each multi-word phrase is one word of its own (its pronunciation the
    words' in a row), so the search cannot leave a phrase half-way for garbage words."""
    general = _general_unigrams()
    garbage = dict(general[:garbage_words])
    floor = min(garbage.values())
    known = dict(general)
    vocab = dict(garbage)
    for word in grammar.words():
        vocab.setdefault(word, known.get(word, floor))
    z = sum(math.exp(lp) for lp in vocab.values())
    unigram = {w: (1.0 - _END) * math.exp(lp) / z for w, lp in vocab.items()}
    unigram["</s>"] = _END

    starts: dict[str, float] = collections.defaultdict(float)
    follows: dict[str, set[str]] = collections.defaultdict(set)
    phrases: list[tuple[str, ...]] = list(grammar.phrases)
    if compound:
        multi = [_compound(words) for words in phrases if len(words) > 1]
        phrases = [(_compound(words),) for words in phrases]
        # A compound is meant to be reached from the sentence start, through its bigram; as a
        # backed-off unigram (in the middle of garbage) it is rarer than any real word.
        rarest = min(unigram.values()) * 0.1
        for word in multi:
            unigram[word] = rarest
        total_mass = sum(unigram.values())
        unigram = {w: p / total_mass for w, p in unigram.items()}
    for words in phrases:
        starts[words[0]] += 1
        seq = [*words, "</s>"]
        for a, b in itertools.pairwise(seq):
            follows[a].add(b)
        follows[words[-1]].update(POLITE_WORDS)
    for polite in POLITE_WORDS:
        follows[polite].add("</s>")
    if grammar.digits is not None:
        digit_words = sorted(DIGIT_WORDS)
        for w in digit_words:
            # A digit string counts as one "phrase" at the start, shared among its first words.
            starts[w] += max(1, len(phrases)) / len(digit_words)
            follows[w].update([*digit_words, "</s>"])
    total = sum(starts.values())
    bigrams: dict[str, dict[str, float]] = {"<s>": {w: bias * c / total for w, c in
                                                     starts.items()}}
    for a, nexts in follows.items():
        bigrams[a] = {b: _FOLLOW / len(nexts) for b in sorted(nexts)}
    backoff = {h: (1.0 - sum(d.values())) / (1.0 - sum(unigram.get(w, 0.0) for w in d))
               for h, d in bigrams.items()}

    lines = ["\\data\\", f"ngram 1={len(unigram) + 1}",
             f"ngram 2={sum(len(d) for d in bigrams.values())}", "", "\\1-grams:",
             f"-99.0 <s> {math.log10(backoff['<s>']):.6f}"]
    for w, p in unigram.items():
        bo = f" {math.log10(backoff[w]):.6f}" if w in backoff else ""
        lines.append(f"{math.log10(p):.6f} {w}{bo}")
    lines += ["", "\\2-grams:"]
    for h, d in bigrams.items():
        lines += [f"{math.log10(p):.6f} {h} {w}" for w, p in d.items()]
    lines += ["", "\\end\\", ""]
    return "\n".join(lines)


def _jsgf(grammar: SpeechGrammar) -> str:
    """JSGF (W3C Java Speech Grammar Format 1.0) of the grammar pass."""
    alternatives = []
    if grammar.phrases:
        phrases = " | ".join(" ".join(words) for words in sorted(grammar.phrases))
        polite = " | ".join(POLITE_WORDS)
        alternatives.append(f"( {phrases} ) [ {polite} ]")
    if grammar.digits is not None:
        digit = " | ".join(sorted(DIGIT_WORDS))
        alternatives.append(" ".join([f"( {digit} )"] * grammar.digits))
    return ("#JSGF V1.0;\ngrammar turn;\npublic <turn> = "
            + " | ".join(f"( {a} )" for a in alternatives) + ";\n")


@dataclass(frozen=True)
class _Word:
    word: str
    start: int
    end: int
    posterior: float


def _words(decoder: Any) -> list[_Word]:
    return [_Word(part, s.start_frame, s.end_frame, float(s.prob))
            for s in (decoder.seg() or []) if s.word.lower() not in _NOT_WORDS
            for part in s.word.split("(", 1)[0].split("_")]


def _telephone_to_16k(pcm: npt.NDArray[np.int16]) -> bytes:
    x = pcm.astype(np.float64)
    frame = RATE // 50  # 20 ms
    n = len(x) // frame * frame
    if n:
        power = np.mean(x[:n].reshape(-1, frame) ** 2, axis=1)
        speech_db = 10 * np.log10(max(float(np.percentile(power, 95)), 1.0))
    else:
        speech_db = 0.0
    up = signal.resample_poly(x, 2, 1)
    # Fixed seed: the same audio always gets the same floor, so results are reproducible.
    floor_rms = 10 ** ((speech_db - NOISE_FLOOR_DB) / 20)
    up += np.random.default_rng(0).standard_normal(up.shape[0]) * max(floor_rms, 1.0)
    return np.clip(np.rint(up), -32768, 32767).astype(np.int16).tobytes()


class PocketSphinxRecognizer:
    """PocketSphinx grammar + open-vocabulary passes on one decoder (see the module docstring).

    One per process (the decoder holds ~30 MiB and the GIL); not thread-safe. Compiled
    grammars are cached by :meth:`SpeechGrammar.key` (least recently used first out).
    """

    def __init__(
        self,
        *,
        phrase_bias: float = PHRASE_BIAS,
        garbage_words: int = GARBAGE_WORDS,
        compound: bool = True,
        min_confidence: float = MIN_CONFIDENCE,
        max_grammars: int = 64,
        rejection: bool = True,
    ) -> None:
        """Load the model and rank the garbage vocabulary (~1 s, once per process).

        ``min_confidence`` turns matches below it into no match.

        ``rejection=False`` runs the grammar pass alone (every sound is forced onto a phrase):
        the baseline ``bench/asr.py`` measures rejection and its cost against.
        """
        if not 0.0 < phrase_bias < 1.0:
            raise ValueError(f"phrase_bias must be between 0 and 1, got {phrase_bias}")
        try:
            import pocketsphinx
        except ImportError as exc:
            raise RecognizerUnavailable("pocketsphinx is not installed; pip install "
                                        "pocketsphinx") from exc
        model = _model_dir()
        try:
            with _DECODER_LOCK:
                self._decoder = pocketsphinx.Decoder(
                    hmm=str(model / "en-us"), dict=str(model / "cmudict-en-us.dict"), lm=None,
                    loglevel="FATAL")
        except (RuntimeError, ValueError) as exc:
            raise RecognizerUnavailable(f"PocketSphinx failed to load {model}: {exc}") from exc
        try:
            prons = dictionary()
            for word, extra in BAND_LIMITED_PRONS.items():
                for n, pron in enumerate(extra, start=len(prons[word]) + 1):
                    self._decoder.add_word(f"{word}({n})", pron, False)
        except (RuntimeError, ValueError) as exc:
            raise RecognizerUnavailable(f"PocketSphinx rejected a pronunciation: {exc}") from exc
        self._bias = phrase_bias
        self._garbage_words = garbage_words
        self._compound = compound
        self._rejection = rejection
        self._min_confidence = min_confidence
        self._max_grammars = max_grammars
        self._grammars: collections.OrderedDict[str, tuple[str, str]] = collections.OrderedDict()
        self._name = f"pocketsphinx-{_version()}/en-us"
        # Here, not in the first turn: ranking the model's vocabulary takes ~1 s.
        _general_unigrams()

    @property
    def name(self) -> str:
        """``pocketsphinx-<version>/en-us``."""
        return self._name

    @property
    def languages(self) -> frozenset[str]:
        """``{"en"}``."""
        return LANGUAGES

    def unknown_words(self, phrases: Iterable[str]) -> list[UnknownWord]:
        """See :func:`unknown_words`."""
        return unknown_words(phrases)

    def prepare(self, grammar: SpeechGrammar) -> None:
        """Compile both passes of ``grammar`` (~20 ms; raises GrammarError if it cannot)."""
        self._searches(grammar)

    def _searches(self, grammar: SpeechGrammar) -> tuple[str, str]:
        key = grammar.key()
        cached = self._grammars.get(key)
        if cached is not None:
            self._grammars.move_to_end(key)
            return cached
        problems = check_grammar(grammar)
        if problems:
            raise GrammarError(problems)
        names = (f"g{key}", f"o{key}")
        fd, path = tempfile.mkstemp(suffix=".arpa", prefix="asr-")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(_open_lm(grammar, self._bias, self._garbage_words, self._compound))
            if self._compound:
                self._add_compounds(grammar)
            self._decoder.add_jsgf_string(names[0], _jsgf(grammar))
            self._decoder.add_lm_file(names[1], path)
        except (RuntimeError, ValueError) as exc:
            raise RecognizerError(f"PocketSphinx could not compile the grammar: {exc}") from exc
        finally:
            os.unlink(path)
        self._grammars[key] = names
        while len(self._grammars) > self._max_grammars:
            _, old = self._grammars.popitem(last=False)
            for name in old:
                self._decoder.remove_search(name)
        return names

    def _add_compounds(self, grammar: SpeechGrammar) -> None:
        """Put the open pass's compound words in the decoder's dictionary (before its searches
        are built, which read the dictionary; another grammar may have added one already)."""
        prons = dictionary()
        for words in grammar.phrases:
            word = _compound(words)
            if len(words) > 1 and self._decoder.lookup_word(word) is None:
                self._decoder.add_word(word, " ".join(prons[w][0] for w in words), False)

    def _decode(self, search: str, audio: bytes) -> list[_Word]:
        d = self._decoder
        d.activate_search(search)
        # The noise estimate (feat.params: -remove_noise yes) would otherwise carry over from
        # the previous turn, i.e. from another caller: measured, the same audio then decodes
        # differently (tests/test_asr_sphinx.py). PocketSphinx 5.1 calls start_stream
        # "deprecated and unnecessary"; it is neither here.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            d.start_stream()
        d.start_utt()
        # full_utt: the cepstral mean comes from this turn alone, never from another caller's.
        d.process_raw(audio, full_utt=True)
        d.end_utt()
        return _words(d)

    def recognize(self, pcm: npt.NDArray[np.int16], grammar: SpeechGrammar) -> RecognitionResult:
        """Recognise one turn; see :class:`gateway.asr.base.Recognizer`."""
        started = time.thread_time()
        grammar_search, open_search = self._searches(grammar)
        audio_s = len(pcm) / RATE
        if len(pcm) < RATE // 10:
            return RecognitionResult(MatchStatus.NO_SPEECH, reason="under 100 ms of audio",
                                     audio_s=audio_s, cpu_s=time.thread_time() - started,
                                     recognizer=self._name)
        audio = _telephone_to_16k(np.asarray(pcm, dtype=np.int16))
        try:
            if not self._rejection:
                result = _forced(grammar, self._decode(grammar_search, audio))
            else:
                heard = self._decode(open_search, audio)
                # Only a digit string goes on to the grammar pass (see the module docstring).
                result = (self._decide(grammar, heard)
                          or self._digits(grammar, self._decode(grammar_search, audio), heard))
        except RuntimeError as exc:
            raise RecognizerError(f"PocketSphinx failed on this turn: {exc}") from exc
        return replace(result, audio_s=audio_s, cpu_s=time.thread_time() - started,
                       recognizer=self._name)

    def _decide(self, grammar: SpeechGrammar, heard: list[_Word]) -> RecognitionResult | None:
        """The open pass's verdict, or None when only the grammar pass can still decide."""
        transcript = " ".join(w.word for w in heard)
        direct = match(grammar, [w.word for w in heard])
        if direct is not None:
            span = heard[direct.span[0]:direct.span[1]]
            return _matched(direct, span, min(w.posterior for w in span), transcript,
                            self._min_confidence)
        if grammar.digits is not None and heard:
            return None
        return _no_match(heard, transcript)

    def _digits(self, grammar: SpeechGrammar, forced: list[_Word],
                heard: list[_Word]) -> RecognitionResult:
        """The grammar pass's digit string, if the open pass heard something that sounds like it.

        Confidence is the phonetic similarity of the two passes: 1 - (phone edit distance
        between what the open pass heard and the grammar pass's digits) / (the longer length).
        """
        transcript = " ".join(w.word for w in heard)
        guess = match(grammar, [w.word for w in forced])
        if guess is None or guess.digits is None:
            return _no_match(heard, transcript)
        said = forced[guess.span[0]:guess.span[1]]
        core = [w.word for w in heard]
        lo, hi = 0, len(core)
        while lo < hi and core[lo] in EDGE_FILLERS:
            lo += 1
        while hi > lo and core[hi - 1] in EDGE_FILLERS:
            hi -= 1
        similarity = _similarity(core[lo:hi], [w.word for w in said])
        if similarity < DIGITS_SIMILARITY:
            return _no_match(heard, transcript)
        return _matched(guess, said, similarity, transcript, self._min_confidence)


def _phones(words: Iterable[str]) -> list[str]:
    prons = dictionary()
    return [ph for w in words for ph in (prons.get(w) or ("",))[0].split()]


def _similarity(heard: Sequence[str], said: Sequence[str]) -> float:
    """1 - Levenshtein distance between the words' phone strings / the longer length."""
    a, b = _phones(heard), _phones(said)
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, y in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y))
        prev = cur
    return 1.0 - prev[-1] / max(len(a), len(b), 1)


def _no_match(heard: Sequence[_Word], transcript: str) -> RecognitionResult:
    if not heard:
        return RecognitionResult(MatchStatus.NO_SPEECH, reason="no speech recognised")
    spoken = [w for w in heard if w.word not in EDGE_FILLERS] or list(heard)
    return RecognitionResult(
        MatchStatus.NO_MATCH, transcript=transcript,
        reason=f"heard {transcript!r}, which is not in the menu",
        speech_start_s=spoken[0].start / _FRAME_RATE,
        speech_end_s=(spoken[-1].end + 1) / _FRAME_RATE)


def _forced(grammar: SpeechGrammar, forced: list[_Word]) -> RecognitionResult:
    """The grammar pass alone (no rejection): its best complete phrase, if it reached one."""
    transcript = " ".join(w.word for w in forced)
    guess = match(grammar, [w.word for w in forced])
    if guess is None:
        status = MatchStatus.NO_MATCH if forced else MatchStatus.NO_SPEECH
        return RecognitionResult(status, transcript=transcript,
                                 reason="the grammar pass ended inside a phrase")
    return _matched(guess, forced[guess.span[0]:guess.span[1]], 1.0, transcript, 0.0)


def _matched(m: Match, span: Sequence[_Word], confidence: float, transcript: str,
             threshold: float) -> RecognitionResult:
    confidence = min(max(confidence, 0.0), 1.0)  # lattice posteriors round to 1.0002
    start = span[0].start / _FRAME_RATE
    end = (span[-1].end + 1) / _FRAME_RATE
    if confidence < threshold:
        return RecognitionResult(
            MatchStatus.NO_MATCH, transcript=transcript, confidence=confidence,
            reason=f"{m.phrase or m.digits!r} heard with confidence {confidence:.2f}, under "
                   f"{threshold:.2f}", speech_start_s=start, speech_end_s=end)
    return RecognitionResult(MatchStatus.MATCH, branch=m.branch, phrase=m.phrase,
                             digits=m.digits, transcript=transcript, confidence=confidence,
                             speech_start_s=start, speech_end_s=end)
