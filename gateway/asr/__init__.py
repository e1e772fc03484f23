"""Offline speech recognition for speech menus: callers say "billing" or their account number.

* :mod:`gateway.asr.grammar` - :class:`SpeechGrammar`: phrases per branch (synonyms) and/or an
  N-digit string spoken digit by digit, normalised and matched;
* :mod:`gateway.asr.base` - the :class:`Recognizer` protocol and :class:`RecognitionResult`
  (``MATCH`` / ``NO_MATCH`` / ``NO_SPEECH``, confidence, timings, CPU time), and the
  :class:`Vocabulary` a script is validated against (languages, dictionary);
* :mod:`gateway.asr.sphinx` - the built-in recogniser (PocketSphinx en-us, no download), its
  dictionary and language checks for script validation, and why it rejects what it rejects;
* :mod:`gateway.asr.whisper` - the neural recogniser (Whisper on CTranslate2: phrases scored
  against the audio, digit strings by constrained decoding, read back when unsure, free-form
  transcripts with word timings), and :mod:`gateway.asr.factory`, which of the two a gateway
  runs (``GATEWAY_ASR``);
* :mod:`gateway.asr.pool` - recognisers in worker processes (:class:`RecognizerPool`) and the
  per-turn :class:`SpeechSession` a call feeds 20 ms frames while a speech gather listens
  (when the turn is over is the IVR's: :mod:`gateway.ivr.listening`);
* :mod:`gateway.asr.synth` - synthetic caller speech (flite, espeak-ng) through the G.711 path,
  for tests, the benchmark and the load simulator.

Errors are :class:`~gateway.errors.GrammarError` (a script problem, found at validation) and
:class:`~gateway.errors.RecognizerError` (this turn failed: fall back to keys).
"""

from gateway.asr.base import (
    Encoding,
    MatchStatus,
    RecognitionResult,
    Recognizer,
    UnknownWord,
    Vocabulary,
)
from gateway.asr.grammar import SpeechGrammar, language_code
from gateway.asr.pool import RecognizerPool, SpeechSession

__all__ = [
    "Encoding",
    "MatchStatus",
    "RecognitionResult",
    "Recognizer",
    "RecognizerPool",
    "SpeechGrammar",
    "SpeechSession",
    "UnknownWord",
    "Vocabulary",
    "language_code",
]
