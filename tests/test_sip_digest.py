"""Stateless SIP digest authentication: RFC 2617 / RFC 8760 round trips computed with hashlib."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from clocks import ManualClock

from gateway.sip.digest import DigestAuthenticator, parse_credentials
from gateway.sip.message import SipRequest, parse_message

GOLDEN = Path(__file__).parent / "golden" / "sip"
SECRET = b"0123456789abcdef-server-secret"
USERS = {"tester": "s3cret", "alice": "wonderland"}


def _clock() -> ManualClock:
    """A virtual clock whose wall time (what nonces carry) is 1,700,000,000 s to start."""
    return ManualClock(0.0, wall_start=1_700_000_000.0)


def invite() -> SipRequest:
    message = parse_message((GOLDEN / "invite_baresip.sip").read_bytes())
    assert isinstance(message, SipRequest)
    return message


def h(algorithm: str, text: str) -> str:
    name = {"MD5": "md5", "SHA-256": "sha256"}[algorithm]
    return hashlib.new(name, text.encode()).hexdigest()


def client_authorization(
    challenge: str, request: SipRequest, username: str, password: str, *,
    qop: bool = True, nc: str = "00000001", cnonce: str = "0a4f113b", uri: str | None = None,
) -> str:
    """What a UAC computes from a challenge (RFC 2617 3.2.2, RFC 8760 2)."""
    params = parse_credentials(challenge)
    assert params is not None
    algorithm, realm, nonce = params["algorithm"], params["realm"], params["nonce"]
    uri = uri or request.uri
    ha1 = h(algorithm, f"{username}:{realm}:{password}")
    ha2 = h(algorithm, f"{request.method}:{uri}")
    if qop:
        response = h(algorithm, f"{ha1}:{nonce}:{nc}:{cnonce}:auth:{ha2}")
        extra = f', qop=auth, nc={nc}, cnonce="{cnonce}"'
    else:
        response = h(algorithm, f"{ha1}:{nonce}:{ha2}")
        extra = ""
    return (f'Digest username="{username}", realm="{realm}", nonce="{nonce}", uri="{uri}", '
            f'response="{response}", algorithm={algorithm}{extra}')


def with_auth(value: str, header: str = "Authorization") -> SipRequest:
    request = invite()
    request.headers.add(header, value)
    return request


@pytest.mark.parametrize("algorithm", ["MD5", "SHA-256"])
def test_challenge_response_round_trip(algorithm: str) -> None:
    clock = _clock()
    auth = DigestAuthenticator("gw.example.com", USERS, SECRET, clock=clock, algorithm=algorithm)
    header, nonce = auth.challenge()
    assert header.startswith('Digest realm="gw.example.com", nonce="')
    assert f"algorithm={algorithm}" in header and 'qop="auth"' in header
    assert "stale" not in header and nonce in header

    clock.t += 10
    request = with_auth(client_authorization(header, invite(), "tester", "s3cret"))
    assert auth.verify(request) == "tester"
    result = auth.check(request)
    assert result.username == "tester" and not result.stale

    # RFC 2069 style (no qop) still verifies.
    assert auth.verify(with_auth(client_authorization(header, invite(), "alice", "wonderland",
                                                      qop=False))) == "alice"


def test_proxy_authorization_header_name() -> None:
    auth = DigestAuthenticator("gw", USERS, SECRET, clock=_clock())
    header = auth.challenge_header()
    request = with_auth(client_authorization(header, invite(), "tester", "s3cret"),
                        "Proxy-Authorization")
    assert auth.verify(request) is None
    assert auth.verify(request, header_name="Proxy-Authorization") == "tester"


def test_wrong_password_unknown_user_and_wrong_uri_are_refused() -> None:
    auth = DigestAuthenticator("gw", USERS, SECRET, clock=_clock())
    header = auth.challenge_header()
    assert auth.verify(with_auth(client_authorization(header, invite(), "tester", "nope"))) is None
    result = auth.check(with_auth(client_authorization(header, invite(), "tester", "nope")))
    assert not result.stale and "wrong response" in result.reason
    assert auth.verify(with_auth(client_authorization(header, invite(), "mallory", "x"))) is None
    other_uri = client_authorization(header, invite(), "tester", "s3cret", uri="sip:other@h")
    assert "Request-URI" in auth.check(with_auth(other_uri)).reason
    assert auth.check(invite()).reason.startswith("no Authorization")
    bad_nc = client_authorization(header, invite(), "tester", "s3cret", nc="1")
    assert auth.verify(with_auth(bad_nc)) is None


def test_expired_nonce_is_stale_and_gets_a_stale_challenge() -> None:
    clock = _clock()
    auth = DigestAuthenticator("gw", USERS, SECRET, nonce_ttl_s=300, clock=clock)
    header = auth.challenge_header()
    request = with_auth(client_authorization(header, invite(), "tester", "s3cret"))
    clock.t += 299
    assert auth.verify(request) == "tester"
    clock.t += 2  # a replay past the TTL
    result = auth.check(request)
    assert result.username is None and result.stale and "expired" in result.reason
    assert auth.verify(request) is None
    rechallenge = auth.challenge_header(stale=True)
    assert rechallenge.endswith(", stale=true")
    # Stale is only said for correct credentials (RFC 2617 3.2.1).
    wrong = with_auth(client_authorization(header, invite(), "tester", "nope"))
    assert not auth.check(wrong).stale


def test_tampered_or_foreign_nonce_is_refused() -> None:
    clock = _clock()
    auth = DigestAuthenticator("gw", USERS, SECRET, clock=clock)
    header, nonce = auth.challenge()
    stamp, salt, mac = nonce.split(".")
    # Move the issue time forward to dodge expiry: the HMAC no longer matches.
    forged_stamp = f"{int(stamp, 16) + 10_000:x}"
    for forged in [f"{forged_stamp}.{salt}.{mac}", f"{stamp}.{salt}.{'0' * len(mac)}",
                   "abc", nonce + "x"]:
        tampered = client_authorization(header.replace(nonce, forged), invite(), "tester",
                                        "s3cret")
        result = auth.check(with_auth(tampered))
        assert result.username is None and not result.stale
        assert result.reason == "nonce was not issued by us"
    other = DigestAuthenticator("gw", USERS, b"another-secret-0123456789", clock=clock)
    foreign = client_authorization(other.challenge_header(), invite(), "tester", "s3cret")
    assert auth.verify(with_auth(foreign)) is None
    # A nonce issued for MD5 does not validate as SHA-256 (the algorithm is signed too).
    swapped = client_authorization(header.replace("algorithm=MD5", "algorithm=SHA-256"),
                                   invite(), "tester", "s3cret")
    assert auth.verify(with_auth(swapped)) is None


def test_other_realms_and_malformed_credentials() -> None:
    auth = DigestAuthenticator("gw", USERS, SECRET, clock=_clock())
    header = auth.challenge_header()
    request = invite()
    request.headers.add("Authorization", 'Digest username="x", realm="elsewhere", nonce="n", '
                                         'uri="sip:a@b", response="00"')
    request.headers.add("Authorization", client_authorization(header, invite(), "tester",
                                                              "s3cret"))
    assert auth.verify(request) == "tester"
    for value in ["Basic dGVzdGVyOnMzY3JldA==", "Digest", 'Digest realm="gw", realm="gw"',
                  'Digest realm="gw" username="x"', 'Digest realm="gw", nonce="unterminated',
                  'Digest realm="gw", qop=auth-int', 'Digest realm="gw", username="tester"']:
        assert auth.verify(with_auth(value)) is None


def test_parse_credentials_and_configuration_errors() -> None:
    assert parse_credentials('Digest username="a\\"b", realm=r , nc=00000001') == {
        "username": 'a"b', "realm": "r", "nc": "00000001",
    }
    assert parse_credentials('digest  REALM="x"') == {"realm": "x"}
    with pytest.raises(ValueError):
        DigestAuthenticator("gw", USERS, b"short")
    with pytest.raises(ValueError):
        DigestAuthenticator("gw", USERS, SECRET, algorithm="SHA-1")
    with pytest.raises(ValueError):
        DigestAuthenticator("gw", USERS, SECRET).challenge(algorithm="MD4")
