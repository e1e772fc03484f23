"""The ``gateway`` command, called in-process through ``main(argv)``."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from gateway.cli import main
from tests.support.paths import REPO, TESTS


def test_model_tiny_builds_a_loadable_checkpoint(tmp_path: Path) -> None:
    target = tmp_path / "tiny"
    assert main(["model", "tiny", str(target)]) == 0
    assert (target / "model.safetensors").exists()
    assert (target / "speech_tokenizer" / "model.safetensors").exists()


@pytest.mark.parametrize(("encoding", "subtype"), [("pcm", "PCM_16"), ("ulaw", "ULAW")])
def test_say_renders_an_8khz_wav_through_the_phone_path(
    tiny_model_dir: Path,
    tmp_path: Path,
    encoding: str,
    subtype: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / f"prompt-{encoding}.wav"
    code = main(
        [
            "say",
            "Press one for billing.",
            "-o",
            str(out),
            "--model",
            str(tiny_model_dir),
            "--device",
            "cpu",
            "--encoding",
            encoding,
            "--seed",
            "3",
        ]
    )
    assert code == 0
    info = sf.info(str(out))
    assert info.samplerate == 8000 and info.channels == 1 and info.subtype == subtype
    audio, _ = sf.read(str(out), dtype="int16")
    assert len(audio) % 160 == 0 and len(audio) >= 160
    assert np.abs(audio.astype(np.int32)).max() > 100  # noise from random weights, not silence
    assert "first chunk after" in capsys.readouterr().out


def test_say_rejects_an_unknown_encoding(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["say", "Hi.", "-o", str(tmp_path / "x.wav"), "--encoding", "mp3"]) == 1
    assert "--encoding must be pcm or ulaw" in capsys.readouterr().err


def test_serve_refuses_to_start_without_an_auth_token(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("GATEWAY_TWILIO_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("GATEWAY_INSECURE", raising=False)
    monkeypatch.chdir(TESTS)  # no stray .env file
    assert main(["serve", "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert "GATEWAY_TWILIO_AUTH_TOKEN" in err and "--insecure" in err


def test_serve_exits_nonzero_when_the_model_cannot_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing-model"
    code = main(
        ["serve", "--insecure", "--host", "127.0.0.1", "--port", "0", "--model", str(missing)]
    )
    assert code == 1
    assert f"local directory {missing} does not exist" in capsys.readouterr().err


def test_serve_with_the_sip_port_taken_stops_with_one_line_and_loads_nothing(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It used to start loading the model, then fail the bind inside uvicorn's lifespan (a
    traceback), exit 0 and leave the load thread running."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        threads = set(threading.enumerate())
        t0 = time.monotonic()
        code = main(["serve", "--insecure", "--host", "127.0.0.1", "--port", "0",
                     "--model", str(tiny_model_dir), "--sip", f"127.0.0.1:{port}"])
        took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert code == 1
    errors = [line for line in err.splitlines() if "--insecure" not in line]
    assert errors == [f"error: cannot bind the SIP endpoint to udp 127.0.0.1:{port} "
                      "(GATEWAY_SIP): Address already in use"], err
    assert set(threading.enumerate()) <= threads  # no model-loading thread left behind
    assert took < 5, f"{took:.1f} s: something was loaded first"


def test_serve_with_the_http_port_taken_stops_with_one_line_and_loads_nothing(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """uvicorn used to bind the port only after the app's lifespan had started loading the
    model: its own ``[Errno 98] error while attempting to bind`` line, then a process that
    waited for the load thread to finish before it could exit."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()  # another server on the port
        port = taken.getsockname()[1]
        threads = set(threading.enumerate())
        tasks = set(asyncio.all_tasks()) if _loop_running() else set()
        t0 = time.monotonic()
        code = main(["serve", "--insecure", "--host", "127.0.0.1", "--port", str(port),
                     "--model", str(tiny_model_dir), "--sip", "127.0.0.1:0"])
        took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert code == 1
    errors = [line for line in err.splitlines() if "--insecure" not in line]
    assert errors == [f"error: cannot bind the HTTP server to tcp 127.0.0.1:{port} "
                      "(GATEWAY_HOST/GATEWAY_PORT): Address already in use"], err
    assert set(threading.enumerate()) <= threads  # no model-loading thread left behind
    if tasks:
        assert set(asyncio.all_tasks()) <= tasks
    assert took < 5, f"{took:.1f} s: something was loaded first"


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


async def test_a_sip_bind_failure_in_the_lifespan_starts_no_model_load() -> None:
    from gateway.app import create_app
    from gateway.config import Settings
    from gateway.errors import ConfigError

    loads: list[object] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        app = create_app(Settings(insecure=True, device="cpu", sip=f"127.0.0.1:{port}"),
                         lambda settings: loads.append(settings) or [])
        with pytest.raises(ConfigError, match=f"udp 127.0.0.1:{port} \\(GATEWAY_SIP\\)"):
            async with app.router.lifespan_context(app):
                pass
    loaders = [t for t in asyncio.all_tasks() if t.get_coro().__name__ == "_load"]  # type: ignore[union-attr]
    assert not loaders and not loads


def test_help_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("serve", "say", "model"):
        assert command in out


def test_usage_errors_exit_2_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["say"]) == 2
    assert "Missing" in capsys.readouterr().err


def _free_tcp_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


OFFLINE_COMMANDS = {
    "say": ["say", "Hi.", "-o", "{tmp}/x.wav", "--device", "cpu"],
    "serve": ["serve", "--insecure", "--port", "0"],
    "script render": ["script", "render", "prompts/demo.yaml", "--cache-dir", "{tmp}/cache"],
    "voices add": ["voices", "add", "anna", "{tmp}/ref.wav", "--text", "Hello.", "--dir",
                   "{tmp}/voices"],
}


@pytest.mark.parametrize("command", sorted(OFFLINE_COMMANDS))
@pytest.mark.parametrize("how", ["offline", "unreachable"])
def test_every_model_command_with_a_hub_model_and_no_hub_fails_at_once_with_one_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    how: str, command: str,
) -> None:
    import time

    root = REPO
    monkeypatch.chdir(root)  # the README's relative paths (prompts/demo.yaml)
    for name in ("GATEWAY_MODEL", "GATEWAY_SCRIPT", "GATEWAY_LINES", "HTTPS_PROXY",
                 "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    sf.write(str(tmp_path / "ref.wav"), np.zeros(16000, dtype=np.int16), 16000)
    # An empty hub cache: the default model is not there.
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    if how == "offline":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        # A hub endpoint on loopback where nothing listens: the connection is refused at once.
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_free_tcp_port()}")
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in OFFLINE_COMMANDS[command]]
    t0 = time.monotonic()
    code = main(argv)
    elapsed = time.monotonic() - t0
    err = capsys.readouterr().err
    assert code == 1
    model = ("Qwen/Qwen3-TTS-12Hz-0.6B-Base" if command == "voices add"
             else "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice")
    assert f"model {model!r}: " in err
    assert "/path/to/model" in err and "gateway model tiny DIR" in err
    if how == "offline":
        assert "HF_HUB_OFFLINE=1 and it is not in the local cache" in err
    else:
        assert "the Hugging Face hub could not provide it (127.0.0.1:" in err
    # One line: no hub retry warnings before it (there were 55, each printed twice). serve's
    # own --insecure warning comes first.
    lines = [line for line in err.splitlines() if line.strip() and "--insecure:" not in line]
    assert len(lines) == 1, err
    assert elapsed < 10, f"took {elapsed:.1f} s"  # serve and voices add used to take 54 s
    assert not (tmp_path / "x.wav").exists() and not (tmp_path / "voices" / "anna").exists()


def test_command_summaries_are_whole_sentences_not_the_docstrings_line_breaks(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "250")  # wide enough that nothing needs wrapping
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if "│ demo " in line)
    assert "account backend stub: call it with `gateway call" in line
    assert main(["script", "--help"]) == 0
    out = capsys.readouterr().out
    assert "schema and logic errors as file:line:column: message" in out



# --- `gateway prompts`: the script commands' old name, a deprecated alias for one release -------

SCRIPT_VERBS = ("validate", "graph", "test", "render")


def _deprecation(verb: str) -> str:
    return (f"warning: `gateway prompts {verb}` is deprecated and will be removed in the next "
            f"release; use `gateway script {verb}`")


@pytest.mark.parametrize("verb", SCRIPT_VERBS)
def test_deprecated_prompts_verbs_are_the_script_commands_with_a_one_line_deprecation_notice(
    verb: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "250")
    assert main(["script", verb, "--help"]) == 0
    new = capsys.readouterr()
    assert main(["prompts", verb, "--help"]) == 0  # renames_35: keep
    old = capsys.readouterr()
    assert new.err == ""
    assert old.err.splitlines() == [_deprecation(verb)]
    # The same command, the same options: only the name in the usage line differs.
    assert " ".join(old.out.replace("gateway prompts", "gateway script").split()) == " ".join(
        new.out.split())


@pytest.mark.parametrize("script", ["demo.yaml", "broken.yaml"])
def test_deprecated_prompts_validate_still_runs_and_answers_as_script_validate(
    script: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = REPO / "prompts" / script
    if script == "broken.yaml":
        path = tmp_path / script
        path.write_text("start: nowhere\nnodes:\n  a:\n    say: Hi.\n")
    code = main(["script", "validate", str(path)])
    new = capsys.readouterr()
    assert main(["prompts", "validate", str(path)]) == code  # renames_35: keep
    old = capsys.readouterr()
    assert code == (0 if script == "demo.yaml" else 1)
    assert old.out == new.out
    assert "ok (" in new.out if code == 0 else ": error: " in new.err
    assert old.err.splitlines() == [_deprecation("validate"), *new.err.splitlines()]


def test_help_lists_script_and_marks_prompts_deprecated(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "250")
    assert main(["--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any("│ script " in line and "IVR scripts" in line for line in lines)
    assert any("│ prompts " in line and "Deprecated alias of `gateway script`" in line
               for line in lines)

@pytest.mark.parametrize(("argv", "usage"), [(["--help"], "Usage: gateway [OPTIONS] COMMAND"),
                                             (["help"], "Usage: gateway [OPTIONS] COMMAND"),
                                             (["help", "call"], "Usage: gateway call ")])
def test_run_sh_help_lists_the_commands_or_explains_one(argv: list[str], usage: str) -> None:
    import subprocess

    root = REPO
    done = subprocess.run(["bash", str(root / "run.sh"), *argv], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": "120"})
    assert done.returncode == 0, done.stderr
    assert usage in done.stdout
    assert "Run the gateway (HTTP webhooks" not in done.stdout.split("Commands", 1)[0]
