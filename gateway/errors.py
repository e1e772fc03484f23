"""The gateway's one exception tree.

Every error the gateway raises on purpose derives from :class:`GatewayError`, and every parse
or protocol error maps to exactly one protocol outcome, so the I/O shells never have to guess:

- :class:`GatewayError`
    - :class:`ConfigError`: bad or missing settings; the process refuses to start and says why.
    - :class:`ModelLoadError`: the TTS model could not be loaded (unknown id, hub unreachable,
      broken local directory); one line names the model and how to pass a local path.
    - :class:`EngineError`: a generation failed mid-utterance; the turn fails, the call lives.
    - :class:`GrammarError`: a speech grammar the recogniser cannot use (a word missing from its
      dictionary, an unsupported language, one phrase in two branches); found when a script is
      validated, each problem located (:attr:`GrammarError.problems`).
    - :class:`RecognizerError`: recognising one caller turn failed (a worker process died, the
      decoder raised, no answer in time). The gather falls back to keys with a logged reason;
      the call lives and no other call notices.
        - :class:`RecognizerUnavailable`: no recogniser can take the turn (not started, closed,
          or its worker process died and is being replaced).
        - :class:`RecognizerTimeout`: the recogniser did not answer within the turn's deadline.
    - :class:`TextError`: a value that cannot be read as its say-as type (a backend answering
      "N/A" for a date). Never fails an utterance: the sentence reads the value as written, and
      the call logs it once (:mod:`gateway.text`).
    - :class:`BotError`: the bot a script handed the call to cannot go on (unreachable, silent,
      gone); the script takes its error path.
    - :class:`BotMessageError`: one message from a bot that cannot be taken; the bot gets an
      ``error`` message back, the call goes on.
    - :class:`CallProtocolError`: a transport message that cannot be accepted. It closes *only
      the call it arrived on* with :attr:`CallProtocolError.close_code` and a logged reason.
        - :class:`MessageTooLarge`: over the size limit (WebSocket close 1009).
        - :class:`UnsupportedData`: a binary frame where text is required (close 1003).
        - :class:`InvalidMessage`: not UTF-8, not JSON, not a known event, bad field types,
          bad base64 (close 1007, "inconsistent data").
        - :class:`ProtocolViolation`: well-formed but not allowed here: media before ``start``,
          a second ``start``, an unknown ``streamSid``, an unsupported media format
          (close 1008, "policy violation").
"""

from __future__ import annotations


class GatewayError(Exception):
    """Base class of every error the gateway raises on purpose."""


class ConfigError(GatewayError):
    """Settings are missing or inconsistent; the gateway refuses to start."""


class ModelLoadError(GatewayError):
    """The TTS model could not be loaded."""


class EngineError(GatewayError):
    """Speech generation failed for one request."""


class GrammarError(GatewayError):
    """A speech grammar the recogniser cannot use; ``problems`` lists each, in plain words."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems

    def __reduce__(self) -> tuple[type[GrammarError], tuple[list[str]]]:
        # Crosses from recogniser worker processes; the default would rebuild from the joined
        # message and lose the list.
        return (type(self), (self.problems,))


class RecognizerError(GatewayError):
    """Recognising one caller turn failed; the gather falls back to keys (logged)."""


class RecognizerUnavailable(RecognizerError):
    """No recogniser can take the turn: not started, closed, or a worker died."""


class RecognizerTimeout(RecognizerError):
    """The recogniser did not answer within the turn's deadline."""


class TextError(GatewayError):
    """A value that cannot be read as its say-as type; it is read as written instead."""


class CallProtocolError(GatewayError):
    """A transport message that closes the call it arrived on (and only that call)."""

    #: WebSocket close code (RFC 6455 section 7.4.1) sent to the peer.
    close_code: int = 1008

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class MessageTooLarge(CallProtocolError):
    """The message exceeds the configured size limit."""

    close_code = 1009


class UnsupportedData(CallProtocolError):
    """A binary frame arrived where the protocol only carries text."""

    close_code = 1003


class InvalidMessage(CallProtocolError):
    """The message is not valid UTF-8/JSON, or not a well-formed known event."""

    close_code = 1007


class ProtocolViolation(CallProtocolError):
    """A well-formed message that is not allowed in the stream's current state."""

    close_code = 1008


class BotError(GatewayError):
    """The bot a script handed the call to (:mod:`gateway.bot`) could not go on: it could not
    be reached (connection refused, TLS certificate not trusted, handshake refused), it
    stopped answering, or it closed the socket. The script takes its error path; the call
    lives."""


class BotMessageError(GatewayError):
    """One message from a bot that cannot be taken (not JSON, unknown type, a field of the
    wrong type, or not possible on this call). The bot gets an ``error`` message back and the
    call goes on."""
