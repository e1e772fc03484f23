"""The greeter: the dialog a gateway runs when no IVR script is configured (``GATEWAY_SCRIPT``).

It greets on answer and reads back each key the caller presses, every sentence generated live:
the smallest dialog that exercises what the IVR runner (:mod:`gateway.ivr.runner`) also relies
on (speak on answer, DTMF, barge-in, a live generation per caller turn, an apology when the
engine fails), with no script, prompt cache or backend to set up. ``./run.sh serve --insecure
--model tiny`` without ``--script`` answers with it.
"""

from __future__ import annotations

import logging

from gateway.call.events import CallerHungUp, Dtmf, SpeechFailed
from gateway.call.session import Call, Dialog, Utterance
from gateway.speech import Speaker
from gateway.text import Reader

log = logging.getLogger(__name__)

_KEY_WORDS = {"*": "star", "#": "pound"}
APOLOGY = "Sorry, something went wrong on our side. Please press a key to try again."


def digit_sentence(digit: str) -> str:
    """The sentence for ``digit``: it contains the key itself (``"You pressed 5."``; the
    greeter's free-text normaliser has the engine say "You pressed five.")."""
    word = _KEY_WORDS.get(digit)
    return f"You pressed {word}, the {digit} key." if word else f"You pressed {digit}."


async def greeter(call: Call, speaker: Speaker, greeting: str,
                  reader: Reader | None = None) -> None:
    """Speak ``greeting``; on each DTMF digit barge in and speak a sentence with the digit.

    If an utterance fails inside the engine, apologise once (not for a failed apology).
    ``reader``: every sentence goes through its free-text normaliser first ("You pressed 5."
    is said "You pressed five."); None: as written.
    """
    language = speaker.voice.language

    def say(text: str, at: float | None) -> Utterance:
        words = reader.free(text, language) if reader is not None else text
        return speaker.say(call, words, turn_started_at=at)

    say(greeting, call.answered_at)
    apologies: set[str] = set()
    while True:
        event = await call.events.get()
        if isinstance(event, CallerHungUp):
            return
        if isinstance(event, SpeechFailed):
            if event.utterance_id not in apologies and not call.speaking:
                apologies.add(say(APOLOGY, event.at).id)
            continue
        if isinstance(event, Dtmf):
            if call.speaking:
                await call.barge_in()
            say(digit_sentence(event.digit), event.at)


class GreeterDialogs:
    """The :class:`~gateway.call.lifecycle.DialogFactory` of a gateway without a script."""

    def __init__(self, speaker: Speaker, greeting: str, reader: Reader | None = None) -> None:
        self.speaker = speaker
        self.greeting = greeting
        self.reader = reader

    def for_call(self, call: Call) -> Dialog:
        return self._run

    async def _run(self, call: Call) -> None:
        await greeter(call, self.speaker, self.greeting, self.reader)
