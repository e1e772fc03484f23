"""The SIP settings are checked where they are declared: a bad value stops start-up by name.

``GATEWAY_SIP``, ``GATEWAY_SIP_ALLOW``, ``GATEWAY_RTP_PORTS`` and ``GATEWAY_SIP_USERS`` are
strings in the environment. They used to be split apart only when the SIP endpoint started:
an inverted port range then gave every call a 503, and a user without ``:`` was dropped
silently (its trunk then failed every INVITE with 401). Now the settings object refuses them,
``gateway serve`` exits 1 with one line naming the variable, and the endpoint reads them
parsed. A password is never part of a message.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.cli import main
from gateway.config import Settings, settings_error
from tests.support.paths import TESTS

BAD = [
    ("GATEWAY_SIP", "5060", "host:port"),
    ("GATEWAY_SIP", "0.0.0.0:99999", "over 65535"),
    ("GATEWAY_SIP", "0.0.0.0:sip", "host:port"),
    ("GATEWAY_SIP", "[not-v6]:5060", "host:port"),
    ("GATEWAY_SIP", "a b:5060", "host:port"),
    ("GATEWAY_SIP_ALLOW", "10.0.0.0/8,trunk.example.com", "'trunk.example.com' is not"),
    ("GATEWAY_SIP_ALLOW", "10.0.0.0/33", "'10.0.0.0/33' is not"),
    ("GATEWAY_SIP_ALLOW", " , ", "no network"),
    ("GATEWAY_RTP_PORTS", "20999-20000", "inverted"),
    ("GATEWAY_RTP_PORTS", "20000:20999", "low-high"),
    ("GATEWAY_RTP_PORTS", "20000-70000", "1024-65535"),
    ("GATEWAY_RTP_PORTS", "80-90", "1024-65535"),
    ("GATEWAY_SIP_USERS", "trunk:s3cret,pbx", "entry 2 is not name:password (user 'pbx')"),
    ("GATEWAY_SIP_USERS", "trunk:", "entry 1 is not name:password"),
    ("GATEWAY_SIP_USERS", ":s3cret", "entry 1 is not name:password"),
    ("GATEWAY_SIP_USERS", "trunk:s3cret,trunk:other", "user 'trunk' twice"),
]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("GATEWAY_SIP", "GATEWAY_SIP_ALLOW", "GATEWAY_RTP_PORTS", "GATEWAY_SIP_USERS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(TESTS)  # no stray .env file


@pytest.mark.parametrize(("variable", "value", "words"), BAD)
def test_a_bad_sip_setting_is_refused_naming_its_variable(
        monkeypatch: pytest.MonkeyPatch, variable: str, value: str, words: str) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValidationError) as info:
        Settings()
    message = settings_error(info.value)
    assert message.startswith(variable + " ") or message.startswith(variable + ":"), message
    assert words in message, message
    assert "s3cret" not in message and "s3cret" not in str(info.value)


@pytest.mark.parametrize(("variable", "value", "words"), BAD[::3])
def test_serve_stops_before_loading_anything_with_the_variables_name(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path,
        variable: str, value: str, words: str) -> None:
    monkeypatch.setenv("GATEWAY_SIP", "127.0.0.1:0")
    monkeypatch.setenv(variable, value)
    code = main(["serve", "--insecure", "--host", "127.0.0.1", "--port", "0",
                 "--model", str(tmp_path / "no-model")])
    assert code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: invalid settings: ") and variable in err and words in err, err
    assert "no-model" not in err  # refused before the model was looked at
    assert "s3cret" not in err and len(err.splitlines()) == 1


def test_good_sip_settings_are_read_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_SIP", ":5070")
    monkeypatch.setenv("GATEWAY_SIP_ALLOW", " 203.0.113.7 , 10.1.2.3/8,::1")
    monkeypatch.setenv("GATEWAY_RTP_PORTS", " 30000 - 30009 ")
    monkeypatch.setenv("GATEWAY_SIP_USERS", "trunk:s3:cr:et, pbx:pw")
    settings = Settings()
    assert settings.sip_bind == ("0.0.0.0", 5070)
    assert settings.sip_allow_networks == ["203.0.113.7/32", "10.0.0.0/8", "::1/128"]
    assert settings.rtp_port_range == range(30000, 30010)
    # A password may hold ':' (only the first one separates the name).
    assert settings.sip_user_table == {"trunk": "s3:cr:et", "pbx": "pw"}
    assert Settings(sip="[::1]:5060", rtp_ports="20000").sip_bind == ("::1", 5060)
    assert Settings(rtp_ports="20000").rtp_port_range == range(20000, 20001)
    monkeypatch.delenv("GATEWAY_SIP")
    monkeypatch.delenv("GATEWAY_SIP_USERS")
    assert Settings().sip_bind is None and Settings().sip_user_table is None
    assert Settings(sip="").sip is None


# --- live-call updates (GATEWAY_TWILIO_ACCOUNT_SID and its credentials) ------------------------

SID = "AC" + "0123456789abcdef" * 2
KEY = "SK" + "fedcba9876543210" * 2

TWILIO_BAD = [
    ({"GATEWAY_TWILIO_ACCOUNT_SID": "AC123", "GATEWAY_TWILIO_AUTH_TOKEN": "t0ken"},
     "GATEWAY_TWILIO_ACCOUNT_SID must be AC followed by 32 hex digits"),
    ({"GATEWAY_TWILIO_ACCOUNT_SID": SID},  # nothing to authenticate the updates with
     "GATEWAY_TWILIO_ACCOUNT_SID is set but there is nothing to authenticate with"),
    ({"GATEWAY_TWILIO_ACCOUNT_SID": SID, "GATEWAY_TWILIO_API_KEY_SID": KEY},
     "GATEWAY_TWILIO_API_KEY_SID and GATEWAY_TWILIO_API_KEY_SECRET go together"),
    ({"GATEWAY_TWILIO_API_KEY_SID": KEY, "GATEWAY_TWILIO_API_KEY_SECRET": "s3cret"},
     "GATEWAY_TWILIO_API_KEY_SID is set without GATEWAY_TWILIO_ACCOUNT_SID"),
    ({"GATEWAY_TWILIO_ACCOUNT_SID": SID, "GATEWAY_TWILIO_API_KEY_SID": "AC" + "0" * 32,
      "GATEWAY_TWILIO_API_KEY_SECRET": "s3cret"},
     "GATEWAY_TWILIO_API_KEY_SID must be SK followed by 32 hex digits"),
    ({"GATEWAY_TWILIO_API_BASE": "api.twilio.com"},
     "GATEWAY_TWILIO_API_BASE must look like https://api.twilio.com"),
    ({"GATEWAY_TWILIO_RESERVATION_S": "-1"}, "GATEWAY_TWILIO_RESERVATION_S"),
]


@pytest.mark.parametrize(("environment", "words"), TWILIO_BAD)
def test_bad_live_call_update_settings_are_refused_by_name(
        monkeypatch: pytest.MonkeyPatch, environment: dict[str, str], words: str) -> None:
    for name in ("GATEWAY_TWILIO_AUTH_TOKEN", "GATEWAY_TWILIO_ACCOUNT_SID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError) as info:
        Settings()
    message = settings_error(info.value)
    assert message.startswith(words), message
    assert "s3cret" not in message and "s3cret" not in str(info.value)


def test_live_call_updates_use_the_api_key_else_the_auth_token(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.clock import SystemClock
    from gateway.twilio.rest import CallUpdater

    monkeypatch.delenv("GATEWAY_TWILIO_ACCOUNT_SID", raising=False)
    assert CallUpdater.from_settings(Settings(twilio_auth_token="t0ken"), SystemClock()) is None
    by_token = CallUpdater.from_settings(
        Settings(twilio_account_sid=SID, twilio_auth_token="t0ken",
                 twilio_api_base="http://127.0.0.1:9/"), SystemClock())
    assert by_token is not None and by_token.api_base == "http://127.0.0.1:9"
    assert (by_token._username, by_token._password) == (SID, "t0ken")
    by_key = CallUpdater.from_settings(
        Settings(twilio_account_sid=SID, twilio_auth_token="t0ken", twilio_api_key_sid=KEY,
                 twilio_api_key_secret="s3cret"), SystemClock())
    assert by_key is not None and by_key.api_base == "https://api.twilio.com"
    assert (by_key._username, by_key._password, by_key.account_sid) == (KEY, "s3cret", SID)


def test_the_inbound_media_cap_is_a_setting_both_transports_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """GATEWAY_INBOUND_MEDIA_RATE / _BURST reach the one cap the call lifecycle holds, and the
    meter each transport takes from it per call (the SIP endpoint's, under flood, is
    tests/unit/sip/test_media.py's test); a cap a normal 50-a-second stream would hit is refused by
    name."""
    from gateway.app import create_app

    monkeypatch.setenv("GATEWAY_INBOUND_MEDIA_RATE", "200")
    monkeypatch.setenv("GATEWAY_INBOUND_MEDIA_BURST", "400")
    lifecycle = create_app(Settings(), engine_factory=lambda s: []).state.gateway.lifecycle
    assert (lifecycle.inbound.rate, lifecycle.inbound.burst) == (200, 400)
    meter = lifecycle.inbound_meter()
    assert (meter.rate, meter.burst) == (200, 400)
    assert lifecycle.inbound_meter() is not meter  # one bucket per call
    monkeypatch.setenv("GATEWAY_INBOUND_MEDIA_RATE", "40")
    with pytest.raises(ValidationError) as info:
        Settings()
    assert settings_error(info.value).startswith("GATEWAY_INBOUND_MEDIA_RATE")
