"""Start-up's disk work runs off the event loop: a starting gateway keeps answering.

A gateway with SIP binds its endpoint and serves /healthz before the engine has loaded; then it
loads the script's sound files, reads, verifies and decodes every cached prompt, and renders
and writes (fsync) the missing ones. All of that used to run on the event loop, which answered
nothing meanwhile. Here a real gateway (the tiny model on CPU, a script with a sound file and a
sentence not yet cached) starts with its sound-file read held up until the test has seen the
gateway answer an HTTP request and a SIP OPTIONS, and every disk access of the start-up is
checked to have run on another thread than the loop's.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf
import uvicorn

from gateway.ivr.cache import PromptCache
from gateway.sip.message import build_request, new_branch, new_call_id, new_tag, parse_message
from tests.support import local_http
from tests.support.net import free_socket
from tests.support.servers import gateway_settings, uvicorn_server

SCRIPT = """\
name: start-up
voice: {speaker: ryan}
start: chime
nodes:
  chime: {play: chime.wav, next: bye}
  bye: {say: "Goodbye.", hangup: true}
"""


def _options(sip: tuple[str, int]) -> int:
    """A SIP OPTIONS to ``sip`` over UDP; the response's status (socket timeout: 5 s)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.settimeout(5.0)
        host, port = sock.getsockname()
        uri = f"sip:{sip[0]}:{sip[1]}"
        request = build_request(
            "OPTIONS", uri, call_id=new_call_id(host), from_=f"<sip:probe@{host}>;tag={new_tag()}",
            to=f"<{uri}>", cseq=1, via_host=host, via_port=port, branch=new_branch())
        sock.sendto(request.serialize(), sip)
        data, _ = sock.recvfrom(65536)
    return parse_message(data).status  # type: ignore[union-attr,no-any-return]


def test_start_up_disk_work_runs_off_the_loop_and_the_gateway_keeps_answering(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gateway.ivr.switchboard as switchboard_module
    from gateway.app import create_app

    (tmp_path / "ivr.yaml").write_text(SCRIPT)
    t = np.arange(3200) / 16000
    sf.write(tmp_path / "chime.wav", (0.3 * np.sin(2 * np.pi * 880 * t)).astype(np.float32),
             16000)
    threads: dict[str, set[int]] = {"load_sound": set(), "cache.get": set(),
                                    "cache.write": set()}
    reading, release = threading.Event(), threading.Event()
    load_sound = switchboard_module.load_sound

    def held_load_sound(path: Path) -> Any:
        threads["load_sound"].add(threading.get_ident())
        reading.set()
        release.wait(30)  # on the loop (before), nothing else can run meanwhile
        return load_sound(path)

    monkeypatch.setattr(switchboard_module, "load_sound", held_load_sound)
    for name in ("get", "write"):
        real = getattr(PromptCache, name)

        def spy(self: PromptCache, *args: Any, _real: Any = real, _name: str = name) -> Any:
            threads[f"cache.{_name}"].add(threading.get_ident())
            return _real(self, *args)

        monkeypatch.setattr(PromptCache, name, spy)

    sock = free_socket()
    port = sock.getsockname()[1]
    settings = gateway_settings(f"http://127.0.0.1:{port}", {
        "model": str(tiny_model_dir), "script": str(tmp_path / "ivr.yaml"),
        "cache_dir": str(tmp_path / "cache"), "sip": "127.0.0.1:0",
        "sip_allow": "127.0.0.1/32", "rtp_ports": "27500-27519"})
    app = create_app(settings)
    gateway = app.state.gateway
    listening, settled = threading.Event(), threading.Event()
    gateway.readiness.when_settled(settled.set)
    server = uvicorn_server(uvicorn.Config(app, log_level="warning", lifespan="on"), listening.set)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        assert listening.wait(60), "the server did not start"
        assert reading.wait(120), "start-up never reached the sound files"
        # Start-up is now in the middle of reading a sound file: the loop still answers.
        health = local_http.get(f"http://127.0.0.1:{port}/healthz", timeout=5.0)
        ready = local_http.get(f"http://127.0.0.1:{port}/readyz", timeout=5.0)
        assert health.status_code == 200 and ready.json()["status"] == "loading"
        assert gateway.sip is not None and gateway.sip.local_addr is not None
        assert _options(gateway.sip.local_addr) == 503  # alive, not taking calls yet
        release.set()
        assert settled.wait(120) and gateway.readiness.ready, gateway.readiness.load_error
    finally:
        release.set()
        server.should_exit = True
        thread.join(30)
        sock.close()
    loop_thread = thread.ident
    assert all(threads.values()), threads  # each happened: a miss read, a render written
    assert all(loop_thread not in idents for idents in threads.values()), threads
