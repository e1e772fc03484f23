"""The first-call dialog: greet on answer, read back each key the caller presses.

It is the smallest dialog that exercises everything a real IVR needs from a call (speak on
answer, DTMF, barge-in, a live generation per caller turn); the IVR runner replaces it.
"""

from __future__ import annotations

import logging

from gateway.call import Call, Dtmf, Hangup, SpeechFailed

log = logging.getLogger(__name__)

_KEY_WORDS = {"*": "star", "#": "pound"}
APOLOGY = "Sorry, something went wrong on our side. Please press a key to try again."


def digit_sentence(digit: str) -> str:
    """The sentence spoken for ``digit``: it contains the key itself (``"You pressed 5."``)."""
    word = _KEY_WORDS.get(digit)
    return f"You pressed {word}, the {digit} key." if word else f"You pressed {digit}."


async def greeter(call: Call, greeting: str) -> None:
    """Speak ``greeting``; on each DTMF digit barge in and speak a sentence with the digit.

    If an utterance fails inside the engine, apologise once (not for a failed apology).
    """
    call.say(greeting, turn_started_at=call.answered_at)
    apologies: set[str] = set()
    while True:
        event = await call.events.get()
        if isinstance(event, Hangup):
            return
        if isinstance(event, SpeechFailed):
            if event.utterance_id not in apologies and not call.speaking:
                apologies.add(call.say(APOLOGY, turn_started_at=event.at).id)
            continue
        if isinstance(event, Dtmf):
            if call.speaking:
                await call.barge_in()
            call.say(digit_sentence(event.digit), turn_started_at=event.at)
