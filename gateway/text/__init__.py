"""Telephone text normalisation: what the speech engine receives, in words a caller expects.

Qwen3-TTS reads its text as written ("1234.56", "2026-12-15", "004512" are left to the model),
and an IVR is mostly numbers. This package sits in front of the engine:

- :mod:`.template`: sentence templates with ``{variables}`` and say-as slots
  (``{balance:currency}``, ``{"+1 555 010 0199":telephone}``).
- :mod:`.sayas`: the say-as types (currency, digits, telephone, date, time, ordinal, number,
  characters), read in the sentence's language with num2words, babel and phonenumbers.
- :mod:`.auto`: the free-text normaliser (off, numbers, full) for text nobody marked up.
- :mod:`.lexicon`: a line's pronunciation lexicon (exact words and regular expressions).
- :mod:`.reading`: a line's settings and the :class:`~.reading.Reader` that puts them
  together: the sentence as written, and the words the engine (and the prompt cache) get.
- :mod:`.languages`: the model's language names as the libraries know them.

Nothing here does I/O or keeps per-call state; a value that does not parse as its type is read
as written (:class:`~gateway.errors.TextError` never reaches a call).
"""

from gateway.text.auto import MODES, FreeTextMode
from gateway.text.lexicon import Lexicon, LexiconEntry, LexiconError
from gateway.text.reading import Fallback, Reader, Reading, Rendering, slot_problems
from gateway.text.sayas import KINDS, Conventions

__all__ = [
    "KINDS",
    "MODES",
    "Conventions",
    "Fallback",
    "FreeTextMode",
    "Lexicon",
    "LexiconEntry",
    "LexiconError",
    "Reader",
    "Reading",
    "Rendering",
    "slot_problems",
]
