"""A real gateway in its own process (``python -m gateway serve``), for signal and scale tests.

In-process servers (conftest ``serve``) cannot receive SIGTERM the way a container does;
these can. Output goes to a log file the test can read (and shows on failure).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from sip_peers import free_port


@dataclass
class GatewayProcess:
    """``gateway serve --insecure`` with ``GATEWAY_*`` settings from ``env`` (``insecure``
    False: signatures are checked, ``env`` gives GATEWAY_TWILIO_AUTH_TOKEN)."""

    model_dir: Path
    workdir: Path
    env: dict[str, str] = field(default_factory=dict)
    sip: bool = False
    name: str = "gateway"
    insecure: bool = True

    def __post_init__(self) -> None:
        self.port = free_port(kind=socket.SOCK_STREAM)
        self.sip_port = free_port() if self.sip else None
        self.log_path = self.workdir / f"{self.name}-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/twilio/media"

    def start(self) -> GatewayProcess:
        env = {
            **os.environ,
            "GATEWAY_MODEL": str(self.model_dir),
            "GATEWAY_DEVICE": "cpu",
            "GATEWAY_HOST": "127.0.0.1",
            "GATEWAY_PORT": str(self.port),
            "GATEWAY_PUBLIC_URL": self.base_url,
            **self.env,
        }
        if self.sip_port is not None:
            env["GATEWAY_SIP"] = f"127.0.0.1:{self.sip_port}"
            rtp = free_port()
            env.setdefault("GATEWAY_RTP_PORTS", f"{rtp}-{rtp + 40}")
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", *(["--insecure"] if self.insecure else [])],
            env=env, stdout=self._log, stderr=subprocess.STDOUT,
        )
        return self

    def wait_ready(self, timeout: float = 240) -> None:
        """Block until ``/readyz`` answers 200 (raises with the log on exit or timeout)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/readyz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} not ready in {timeout} s:\n{self.log()}")

    def signal(self, sig: int = signal.SIGTERM) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait_exit(self, timeout: float) -> int:
        """The exit code, waiting at most ``timeout`` seconds."""
        assert self.proc is not None
        return self.proc.wait(timeout)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Kill whatever is left (tests' finally blocks)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if hasattr(self, "_log"):
            self._log.close()

    def __enter__(self) -> GatewayProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
