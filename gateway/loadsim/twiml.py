"""What a simulated Twilio reads from the gateway's webhooks: TwiML, parsed as XML, sans-I/O.

Twilio places an inbound call by POSTing the number's voice webhook and doing what the TwiML
says (https://www.twilio.com/docs/voice/twiml). For an IVR media gateway that is one of:

- ``<Connect><Stream url="wss://..."><Parameter name=... value=.../></Stream></Connect>``: open
  the bidirectional Media Stream at that URL; each ``<Parameter>`` arrives in the stream's
  ``start`` message as ``customParameters``
  (https://www.twilio.com/docs/voice/twiml/stream#custom-parameters). ``<Connect action>`` is
  the URL Twilio requests when the stream ends with the call still up;
- the busy answer, ``<Say>...</Say><Hangup/>`` (or ``<Reject/>``): the call is refused.

After the stream, the ``<Connect action>`` answers with ``<Dial>`` (a transfer) or ``<Hangup/>``.

The text is parsed with :mod:`xml.etree.ElementTree` (expat; entity expansion attacks are
refused by expat >= 2.4.1, which CPython 3.11 bundles), after a size cap. Anything that is not
one of the answers above raises :class:`TwimlError` saying what was found.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Final

from gateway.errors import GatewayError

__all__ = ["AfterStream", "Busy", "StreamAnswer", "TwimlError", "parse_after_stream",
           "parse_voice_answer"]

#: A TwiML answer is a few hundred bytes; anything this large is not one.
MAX_TWIML_BYTES: Final[int] = 64 * 1024


class TwimlError(GatewayError):
    """The webhook's answer is not TwiML a Twilio call can follow (as the simulator reads it)."""


@dataclass(frozen=True)
class StreamAnswer:
    """``<Connect><Stream>``: where the Media Stream goes and what it carries."""

    url: str
    parameters: dict[str, str] = field(default_factory=dict)
    #: ``<Connect action>``: requested when the stream ends while the call is up.
    action: str | None = None
    action_method: str = "POST"


@dataclass(frozen=True)
class Busy:
    """The gateway turned the call away (``<Say>`` then ``<Hangup/>``, or ``<Reject>``)."""

    message: str


@dataclass(frozen=True)
class AfterStream:
    """What the ``<Connect action>`` said to do once the stream ended."""

    #: The ``<Dial>`` target (a number or a ``<Sip>`` URI), None for a hang-up.
    transfer_to: str | None


def _root(text: str) -> ET.Element:
    if len(text.encode("utf-8", "surrogatepass")) > MAX_TWIML_BYTES:
        raise TwimlError(f"TwiML answer over {MAX_TWIML_BYTES} bytes")
    try:
        root = ET.fromstring(text)
    except ET.ParseError as exc:
        raise TwimlError(f"malformed TwiML ({exc})") from None
    if root.tag != "Response":
        raise TwimlError(f"TwiML root element is <{root.tag}>, not <Response>")
    return root


def _verbs(root: ET.Element) -> str:
    return ", ".join(f"<{child.tag}>" for child in root) or "none"


def parse_voice_answer(text: str) -> StreamAnswer | Busy:
    """Read the voice webhook's TwiML: the stream to open, or the busy answer."""
    root = _root(text)
    for verb in root:
        if verb.tag == "Connect":
            stream = verb.find("Stream")
            if stream is None:
                raise TwimlError(f"<Connect> without <Stream> (it holds {_verbs(verb)})")
            url = (stream.get("url") or "").strip()
            if not url.startswith(("ws://", "wss://")):
                raise TwimlError(f"<Stream url={url[:80]!r}> is not a ws:// or wss:// URL")
            parameters: dict[str, str] = {}
            for parameter in stream.findall("Parameter"):
                name = parameter.get("name")
                if name:
                    parameters[name] = parameter.get("value") or ""
            return StreamAnswer(url, parameters, verb.get("action") or None,
                                (verb.get("method") or "POST").upper())
        if verb.tag == "Start" and verb.find("Stream") is not None:
            raise TwimlError("<Start><Stream> forks audio one way; an IVR needs "
                             "<Connect><Stream>")
        if verb.tag == "Reject":
            return Busy(f"<Reject reason={verb.get('reason') or 'rejected'!r}>")
    verbs = list(root)
    if verbs and verbs[-1].tag == "Hangup":
        said = " ".join((v.text or "").strip() for v in verbs if v.tag == "Say").strip()
        return Busy(said or "hung up at once")
    raise TwimlError(f"TwiML has no <Connect><Stream> and no busy answer (verbs: "
                     f"{_verbs(root)})")


def parse_after_stream(text: str) -> AfterStream:
    """Read the ``<Connect action>`` TwiML: a ``<Dial>`` transfer or a hang-up."""
    root = _root(text)
    dial = root.find("Dial")
    if dial is not None:
        sip = dial.find("Sip")
        target = (sip.text if sip is not None else dial.text) or ""
        return AfterStream(target.strip() or None)
    return AfterStream(None)
