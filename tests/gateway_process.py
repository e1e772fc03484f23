"""A real gateway in its own process (``python -m gateway serve``), for signal and scale tests.

In-process servers (conftest ``serve``) cannot receive SIGTERM the way a container does;
these can. Output goes to a log file the test can read (and shows on failure).

By default the process is forked from a parent that has already imported the gateway and its
model libraries (``tests/gateway_zygote.py``, one per test run, shared by its workers): it
runs the same ``gateway/__main__.py`` with its own environment, signals and exit code, without
the ~7 CPU-s of imports each start would cost. ``exec_=True`` starts ``python -m gateway
serve`` itself.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

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
    """This worker's connection to the test run's parent of forked gateways
    (``tests/gateway_zygote.py``): the first worker that needs one starts it, the others
    connect to it."""

    _instance: _Zygote | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        # The test run: the xdist controller (a worker's parent), or this process alone.
        root = os.getppid() if "PYTEST_XDIST_WORKER" in os.environ else os.getpid()
        run = os.environ.get("PYTEST_XDIST_TESTRUNUID", str(root))
        path = Path(tempfile.gettempdir()) / f"gateway-zygote-{run[:16]}.sock"
        # One worker starts it, the others wait for it. One lock file for every run (never
        # unlinked: unlinking a file others may hold a flock on races); runs only queue for it
        # while one of them starts its zygote.
        with open(path.with_name("gateway-zygote.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                self._sock = self._connect(path)
            except (FileNotFoundError, ConnectionRefusedError):
                path.unlink(missing_ok=True)  # a zygote of this run that has died
                self._start(path, root)
                self._sock = self._connect(path)
        self._stdout = self._sock.makefile("r")
        self._children: dict[int, ForkedProcess] = {}
        self._spawned: list[int] = []
        self.alive = True
        self._reply = threading.Condition()
        threading.Thread(target=self._read, name="zygote-reader", daemon=True).start()

    @staticmethod
    def _connect(path: Path) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(path))
        except OSError:
            sock.close()
            raise
        return sock

    @staticmethod
    def _start(path: Path, root: int) -> None:
        """Start the zygote (it outlives this worker: it exits with the test run) and wait
        until it listens."""
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("gateway_zygote.py")), str(path),
             str(root)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
        )
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        if not ready:
            proc.kill()
            raise RuntimeError("the gateway zygote did not listen in 120 s")
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the gateway zygote exited {proc.wait()} before it listened")
        proc.stdout.close()

    @classmethod
    def get(cls) -> _Zygote:
        with cls._lock:
            if cls._instance is None or not cls._instance.alive:
                cls._instance = cls()
                atexit.register(cls._instance.close)
            return cls._instance

    def _read(self) -> None:
        try:
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
        except (OSError, ValueError):
            pass  # a reset or a torn line: the zygote is gone all the same
        finally:
            with self._reply:  # the zygote died: its children are gone with it
                self.alive = False
                for child in self._children.values():
                    child._exited(-signal.SIGKILL)
                self._children.clear()
                self._reply.notify_all()

    def spawn(self, argv: list[str], env: dict[str, str], log: Path,
              timeout: float = 120) -> ForkedProcess:
        """Fork ``python -m gateway *argv``; one request at a time (replies come in order)."""
        with self._lock, self._reply:
            request = json.dumps({"argv": argv, "env": env, "cwd": os.getcwd(),
                                  "log": str(log)}) + "\n"
            self._sock.sendall(request.encode())
            if not self._reply.wait_for(lambda: self._spawned or not self.alive, timeout):
                raise RuntimeError(f"the gateway zygote did not fork in {timeout} s")
            if not self._spawned:
                raise RuntimeError("the gateway zygote went away")
            child = ForkedProcess(self._spawned.pop(0))
            self._children[child.pid] = child
            return child

    def close(self) -> None:
        """Hang up: the zygote kills what this worker left running."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


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
            # The built-in recogniser unless a test asks for Whisper (as tests/conftest.py's
            # in-process gateways do): the suite's count of neural recognitions stays bounded.
            "GATEWAY_ASR": "pocketsphinx",
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
