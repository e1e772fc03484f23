"""Assertions on SIP messages shared by the parser's tests and the SIP fuzzer."""

from __future__ import annotations

from gateway.sip.message import Headers, SipRequest, SipResponse, parse_message

__all__ = ["assert_round_trips", "without_length"]


def without_length(headers: Headers) -> list[tuple[str, str]]:
    return [(n.lower(), v) for n, v in headers if n.lower() != "content-length"]


def assert_round_trips(message: SipRequest | SipResponse) -> None:
    """serialize -> parse keeps start line, headers and body; serialize is a fixed point."""
    wire = message.serialize()
    again = parse_message(wire)
    assert type(again) is type(message)
    if isinstance(message, SipRequest):
        assert isinstance(again, SipRequest)
        assert (again.method, again.uri) == (message.method, message.uri)
    else:
        assert isinstance(again, SipResponse)
        assert (again.status, again.reason) == (message.status, message.reason)
    assert without_length(again.headers) == without_length(message.headers)
    assert again.body == message.body
    assert again.headers.get("Content-Length") == str(len(message.body))
    assert again.serialize() == wire
