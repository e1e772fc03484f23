"""Text into a call's speech: the voice a dialog speaks with, and the request it makes.

The dialog (IVR runner, greeter) decides *what* to say; :class:`Speaker` turns a sentence into a
:class:`~gateway.tts.service.SpeechService` stream in the dialog's voice and hands that stream to
the call (:meth:`gateway.call.session.Call.speak`), which turns audio into frames. The call never
builds speech requests, and the speech service never sees a call.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.call.session import AudioStream, Call, Utterance
from gateway.tts.engine import SpeechRequest, VoicePrompt
from gateway.tts.service import SpeechService

__all__ = ["Speaker", "SpeechVoice"]


@dataclass(frozen=True)
class SpeechVoice:
    """The voice a call speaks with, as the engine takes it (speaker, language, instruction,
    seed or a cloned voice's prompt); a script's ``voice:`` setting is
    :class:`gateway.ivr.script.ScriptVoice`, resolved into this one per line."""

    speaker: str = "ryan"
    language: str = "English"
    instruct: str | None = None
    seed: int | None = None
    #: A registered cloned voice (with a Base model) instead of ``speaker``.
    prompt: VoicePrompt | None = None


class Speaker:
    """Live speech in one voice through the speech service."""

    def __init__(self, speech: SpeechService, voice: SpeechVoice) -> None:
        self.speech = speech
        self.voice = voice

    def with_voice(self, voice: SpeechVoice) -> Speaker:
        """The same speech service in another voice (a node changed the call's)."""
        return Speaker(self.speech, voice)

    def request(self, text: str, call_id: str, utterance_id: str,
                voice: SpeechVoice | None = None) -> SpeechRequest:
        """The request for ``text`` in ``voice`` (default: this speaker's)."""
        voice = voice if voice is not None else self.voice
        return SpeechRequest(
            text=text,
            speaker=voice.speaker,
            language=voice.language,
            instruct=voice.instruct,
            seed=voice.seed,
            voice_prompt=voice.prompt,
            tags={"call": call_id, "utterance": utterance_id},
        )

    def say(self, call: Call, text: str, *, turn_started_at: float | None = None,
            capture: bool = False, voice: SpeechVoice | None = None,
            interruptible: bool = False) -> Utterance:
        """Start ``call`` saying ``text`` (live generation); returns at once with the handle.

        ``voice``: a variant of this speaker's voice for this sentence (the IVR runner renders
        a sentence it will cache with the script's seed); ``interruptible``: the caller's
        speech may stop it (:meth:`Call.speak`)."""

        def open_stream(utterance: Utterance) -> AudioStream:
            return self.speech.stream(self.request(text, call.call_id, utterance.id, voice),
                                      turn_started_at=utterance.turn_started_at)

        return call.speak(text, open_stream, turn_started_at=turn_started_at, capture=capture,
                          interruptible=interruptible)
