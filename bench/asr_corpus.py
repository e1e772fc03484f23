"""The speech-menu corpus: utterances generated with flite and espeak-ng at bench time.

Nothing is recorded or committed: every utterance is synthesised, levelled, optionally mixed
with seeded line noise and G.711 mu-law coded by :func:`gateway.asr.synth.phone_line`, so the
same command gives the same audio on any machine with the same flite/espeak-ng.

Two disjoint halves: ``dev`` (the voices and out-of-menu sentences the recognisers' settings
were chosen on, see ``gateway/asr/sphinx.py`` and ``gateway/asr/whisper.py``) and ``test``
(other voices, other sentences, other digit strings), which is what the benchmark's RESULT
lines report.

Issue 32 extended it with what a new user's calls had and it lacked: more voices in each half
(espeak-ng accents and variants, flite's kal16; the test half's new voices were never heard by
any tuning), a ``line effects`` condition that gives every utterance its own seeded chain of
tempo and pitch shifts, a handset band-pass, room reverberation and 15-20 dB line noise
(:func:`gateway.asr.synth.random_effects`), more digit strings (12 per voice and condition),
and turns of noise alone (hiss, hum, crackle, breathing) that must route nowhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

import numpy as np
import numpy.typing as npt

from gateway.asr.grammar import SpeechGrammar
from gateway.asr.synth import (
    NOISES,
    LineEffects,
    SynthVoice,
    apply_effects,
    noise_only,
    phone_line,
    random_effects,
    synthesize,
)
from gateway.audio.g711 import ulaw_decode

Split = Literal["dev", "test"]
Kind = Literal["in", "out", "near", "digits", "digits_out", "digits_len", "noise"]

MAIN_MENU: Final = {
    "balance": ["account balance", "balance", "my balance", "check my balance"],
    "agent": ["agent", "representative", "operator", "speak to an agent"],
    "billing": ["billing", "pay my bill"],
    "support": ["technical support", "tech support"],
    "repeat": ["repeat", "main menu", "say that again"],
}
CONFIRM: Final = {"yes": ["yes", "yeah", "correct", "that's right"],
                  "no": ["no", "nope", "no thanks"]}
GRAMMARS: Final[dict[str, SpeechGrammar]] = {
    "main": SpeechGrammar.build(MAIN_MENU),
    "confirm": SpeechGrammar.build(CONFIRM),
    "digits": SpeechGrammar.build({}, digits=6),
}
POLITE: Final = {"main": [("agent please", "agent"), ("billing please", "billing"),
                          ("operator please", "agent")],
                 "confirm": [("yes please", "yes")]}

VOICES: Final[dict[Split, list[SynthVoice]]] = {
    "dev": [SynthVoice("flite", "slt"), SynthVoice("flite", "kal"),
            SynthVoice("espeak-ng", "en-us"), SynthVoice("espeak-ng", "en-gb+f3", 1.15),
            # Added with issue 32.
            SynthVoice("espeak-ng", "en-gb-x-rp+m2"),
            SynthVoice("espeak-ng", "en-us-nyc+f4", 1.05)],
    "test": [SynthVoice("flite", "awb"), SynthVoice("flite", "rms"),
             SynthVoice("espeak-ng", "en-gb-scotland"), SynthVoice("espeak-ng", "en-029+m3", 0.9),
             SynthVoice("espeak-ng", "en-us+f2", 1.1),
             # Added with issue 32: never heard while tuning either recogniser.
             SynthVoice("flite", "kal16"), SynthVoice("espeak-ng", "en-gb-x-gbclan+m5", 0.95),
             SynthVoice("espeak-ng", "en-gb-x-gbcwmd+f1", pitch=65),
             SynthVoice("espeak-ng", "en-us+klatt4", 1.05)],
}
OUT_OF_MENU: Final[dict[Split, dict[str, list[str]]]] = {
    "dev": {
        "main": ["hello", "I would like to cancel my subscription", "what are your opening hours",
                 "I want to report a power outage", "my internet is not working", "thank you",
                 "I need to change my address", "sorry what", "goodbye", "hang on a second"],
        "confirm": ["maybe", "I don't know"],
        "digits": ["I don't know my account number", "hang on let me find it"],
    },
    "test": {
        "main": ["good morning", "can I pay with a credit card", "I'm calling about my order",
                 "where is my nearest store", "I just moved to a new apartment",
                 "what time do you close", "hold on let me check", "I'm not sure",
                 "can you hear me", "my package never arrived"],
        "confirm": ["let me think", "what was the question"],
        "digits": ["I don't have it with me", "can I just talk to someone"],
    },
}
NEAR_MISS: Final[dict[Split, list[str]]] = {
    "dev": ["building", "agency"],
    "test": ["willing", "agenda", "ballad", "operation"],
}
DIGIT_STRINGS: Final = 12
NOISE_SECONDS: Final = (0.8, 2.0)

_DIGIT_WORD = "zero one two three four five six seven eight nine".split()


@dataclass(frozen=True)
class Condition:
    """A line condition: speech level and optional white-plus-hum noise."""

    name: str
    level_dbfs: float = -20.0
    snr_db: float | None = None
    #: Stress conditions are reported, but not part of the RESULT aggregates.
    stress: bool = False
    #: Each utterance gets its own seeded effects chain (:func:`random_effects`).
    effects: bool = False


CONDITIONS: Final = [
    Condition("clean"),
    Condition("quiet", level_dbfs=-32.0),
    Condition("noise 20 dB", snr_db=20.0),
    Condition("line effects", effects=True),
    Condition("noise 15 dB", snr_db=15.0, stress=True),
]


@dataclass(frozen=True)
class Utterance:
    """One corpus item: what is said, by whom, on what line, and the right answer."""

    split: Split
    kind: Kind
    grammar: str
    text: str
    #: The branch (phrases) or digit string (digits) expected; None for out-of-menu speech.
    expected: str | None
    voice: SynthVoice | None
    condition: Condition
    seed: int

    @property
    def effects(self) -> LineEffects | None:
        """This utterance's effects chain (line-effects condition only)."""
        return random_effects(self.seed) if self.condition.effects else None

    @property
    def who(self) -> str:
        """The voice, or "noise" for a noise-only turn."""
        return self.voice.label if self.voice is not None else "noise"


def render(u: Utterance) -> npt.NDArray[np.int16]:
    """``u`` as the gateway would hear it: 8 kHz int16 after the G.711 mu-law line."""
    effects = u.effects
    if u.kind == "noise":
        kind, seconds = u.text.split(":")
        speech = noise_only(kind, float(seconds), u.seed)
    else:
        assert u.voice is not None
        speech = synthesize(u.text, u.voice)
    snr = u.condition.snr_db
    if effects is not None:
        speech = apply_effects(speech, effects)
        snr = effects.snr_db
    return ulaw_decode(phone_line(speech, level_dbfs=u.condition.level_dbfs, snr_db=snr,
                                  seed=u.seed))


def digit_strings(split: Split) -> list[str]:
    """The six-digit strings of a split (seeded; the two splits never share one)."""
    rng = np.random.default_rng({"dev": 1001, "test": 2002}[split])
    return ["".join(str(d) for d in rng.integers(0, 10, size=6)) for _ in range(DIGIT_STRINGS)]


def wrong_lengths(split: Split) -> list[str]:
    """A five- and a seven-digit string per split: a six-digit gather must not take them."""
    rng = np.random.default_rng({"dev": 1003, "test": 2004}[split])
    return ["".join(str(d) for d in rng.integers(0, 10, size=n)) for n in (5, 7)]


def spoken_digits(digits: str, i: int) -> str:
    """How a caller says ``digits``: every other string says 0 as "oh"; every third is
    grouped in threes ("four one seven, oh two nine"), which puts a pause in the middle."""
    words = [("oh" if d == "0" and i % 2 else _DIGIT_WORD[int(d)]) for d in digits]
    if i % 3 == 0:
        return " ".join(words[:3]) + ", " + " ".join(words[3:])
    return " ".join(words)


def utterances(splits: tuple[Split, ...] = ("dev", "test"), *, quick: bool = False,
               stress: bool = True) -> list[Utterance]:
    """The corpus, in a fixed order. ``quick``: test-style subset (2 voices, 2 conditions)."""
    out: list[Utterance] = []
    for split in splits:
        # Seeds count within the split, so a split's line noise (and its figures) is the same
        # whether or not the other split is generated too (``bench/asr.py --dev``).
        first = len(out)
        voices = VOICES[split][:1] + VOICES[split][2:3] if quick else VOICES[split]
        conditions = [c for c in CONDITIONS if (stress or not c.stress)
                      and (not quick or c.name in ("clean", "noise 20 dB"))]
        items: list[tuple[Kind, str, str, str | None]] = []
        for gname, menu in (("main", MAIN_MENU), ("confirm", CONFIRM)):
            items += [("in", gname, p, b) for b, phrases in menu.items() for p in phrases]
            items += [("in", gname, p, b) for p, b in POLITE[gname]]
            items += [("out", gname, s, None) for s in OUT_OF_MENU[split][gname]]
        items += [("near", "main", w, None) for w in NEAR_MISS[split]]
        items += [("digits", "digits", spoken_digits(d, i), d)
                  for i, d in enumerate(digit_strings(split))]
        items += [("digits_out", "digits", s, None) for s in OUT_OF_MENU[split]["digits"]]
        items += [("digits_len", "digits", spoken_digits(d, i + 1), None)
                  for i, d in enumerate(wrong_lengths(split))]
        for voice in voices:
            for condition in conditions:
                for kind, gname, text, expected in items:
                    out.append(Utterance(split, kind, gname, text, expected, voice, condition,
                                         seed=len(out) - first))
        # Noise alone, once per line condition (no voice): it must route nowhere.
        for condition in conditions:
            for noise in NOISES:
                for seconds in NOISE_SECONDS:
                    for gname in ("main", "digits"):
                        out.append(Utterance(split, "noise", gname, f"{noise}:{seconds:g}", None,
                                             None, condition, seed=len(out) - first))
    return out
