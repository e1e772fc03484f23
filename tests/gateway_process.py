"""A real gateway in its own process (``python -m gateway serve``), for signal and scale tests.

In-process servers (conftest ``serve``) cannot receive SIGTERM the way a container does;
these can. Output goes to a log file the test can read (and shows on failure).

By default the process is forked from a parent that has already imported the gateway and its
model libraries (``tests/gateway_zygote.py``, one per test worker): it runs the same
``gateway/__main__.py`` with its own environment, signals and exit code, without the ~7 CPU-s
of imports each start would cost. ``exec_=True`` starts ``python -m gateway serve`` itself.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx
import local_http
from sip_peers import free_port


class ForkedProcess:
    """A child of the zygote, with the part of ``subprocess.Popen`` the tests use."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._ended = threading.Event()

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"gateway pid {self.pid}", timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Zygote:
    """The per-worker parent process of forked gateways (``tests/gateway_zygote.py``)."""

    _instance: _Zygote | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("gateway_zygote.py"))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._stdin: IO[str] = self.proc.stdin
        self._stdout: IO[str] = self.proc.stdout
        self._children: dict[int, ForkedProcess] = {}
        self._spawned: list[int] = []
        self._reply = threading.Condition()
        threading.Thread(target=self._read, name="zygote-reader", daemon=True).start()

    @classmethod
    def get(cls) -> _Zygote:
        with cls._lock:
            if cls._instance is None or cls._instance.proc.poll() is not None:
                cls._instance = cls()
                atexit.register(cls._instance.close)
            return cls._instance

    def _read(self) -> None:
        for line in self._stdout:
            message = json.loads(line)
            with self._reply:
                if "pid" in message:
                    self._spawned.append(message["pid"])
                    self._reply.notify_all()
                else:
                    child = self._children.pop(message["exit"], None)
                    if child is not None:
                        child._exited(message["code"])
        with self._reply:  # the zygote died: its children are gone with it
            for child in self._children.values():
                child._exited(-signal.SIGKILL)
            self._children.clear()
            self._reply.notify_all()

    def spawn(self, argv: list[str], env: dict[str, str], log: Path,
              timeout: float = 120) -> ForkedProcess:
        """Fork ``python -m gateway *argv``; one request at a time (the zygote reads a line
        per fork)."""
        with self._lock, self._reply:
            self._stdin.write(json.dumps({"argv": argv, "env": env, "cwd": os.getcwd(),
                                          "log": str(log)}) + "\n")
            self._stdin.flush()
            if not self._reply.wait_for(lambda: self._spawned or self.proc.poll() is not None,
                                        timeout):
                raise RuntimeError(f"the gateway zygote did not fork in {timeout} s")
            if not self._spawned:
                raise RuntimeError(f"the gateway zygote exited {self.proc.returncode}")
            child = ForkedProcess(self._spawned.pop(0))
            self._children[child.pid] = child
            return child

    def close(self) -> None:
        try:
            self._stdin.close()  # the zygote kills what is left and exits
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


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
    exec_: bool = False

    def __post_init__(self) -> None:
        self.port = free_port(kind=socket.SOCK_STREAM)
        self.sip_port = free_port() if self.sip else None
        self.log_path = self.workdir / f"{self.name}-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | ForkedProcess | None = None

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
        argv = ["serve", *(["--insecure"] if self.insecure else [])]
        if not self.exec_:
            self.proc = _Zygote.get().spawn(argv, env, self.log_path)
            return self
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "gateway", *argv], env=env,
                                     stdout=self._log, stderr=subprocess.STDOUT)
        return self

    def wait_ready(self, timeout: float = 240) -> None:
        """Block until ``/readyz`` answers 200 (raises with the log on exit or timeout)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n{self.log()}")
            try:
                if local_http.get(f"{self.base_url}/readyz", timeout=1).status_code == 200:
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
