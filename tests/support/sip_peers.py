"""Real SIP peers for the tests: SIPp scenarios and a baresip user agent (Debian packages).

Configurations: baresip headless on loopback with a WAV
file as its microphone, a null speaker, the sndfile module recording what it hears, and its
TCP control socket (netstring-framed JSON) to dial, send DTMF and hang up.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf

from tests.support.net import free_port
from tests.support.paths import SIPP_DIR


def require(tool: str) -> str:
    path = shutil.which(tool)
    assert path, (
        f"{tool} is not installed: apt-get install -y baresip-core sip-tester (.ci/run does)"
    )
    return path


@dataclass
class SippResult:
    returncode: int
    stdout: str
    stats: dict[str, str]

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def run_sipp(
    scenario: str,
    target: tuple[str, int],
    *,
    local_ip: str = "127.0.0.1",
    calls: int = 1,
    rate: float = 100.0,
    limit: int | None = None,
    timeout_s: float = 60,
    workdir: Path,
    extra: list[str] | None = None,
) -> SippResult:
    """Run one SIPp scenario (tests/sipp/NAME.xml) against ``target``; returns its statistics.

    ``rate``: new calls per second. SIPp exits only at the end of a rate period, so at its own
    default of 1 call/s even a lone OPTIONS took a full second; a run of one call is the same
    at any rate, and at 100/s it ends with its call.
    """
    sipp = require("sipp")
    port = free_port(host=local_ip)
    stat_file = workdir / f"{Path(scenario).stem}-{port}.csv"
    command = [
        sipp,
        f"{target[0]}:{target[1]}",
        "-sf",
        str(SIPP_DIR / scenario),
        "-i",
        local_ip,
        "-p",
        str(port),
        "-m",
        str(calls),
        "-r",
        str(rate),
        "-l",
        str(limit or calls),
        "-nostdin",
        "-trace_stat",
        "-stf",
        str(stat_file),
        "-timeout",
        f"{int(timeout_s)}s",
        "-timeout_error",
        "-max_recv_loops",
        "1000",
        "-mp",
        str(free_port(host=local_ip)),
        *(extra or []),
    ]
    proc = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout_s + 30, cwd=workdir
    )
    stats: dict[str, str] = {}
    if stat_file.exists():
        lines = [line for line in stat_file.read_text().splitlines() if line.strip()]
        if len(lines) >= 2:
            header, last = lines[0].split(";"), lines[-1].split(";")
            stats = dict(zip(header, last, strict=False))
    return SippResult(proc.returncode, proc.stdout + proc.stderr, stats)


@dataclass
class Baresip:
    """A headless baresip caller on 127.0.0.1, driven over its ctrl_tcp socket."""

    workdir: Path
    seconds_of_audio: float = 40.0
    microphone: np.ndarray | None = None
    events: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.record_dir = self.workdir / "rec"
        self.record_dir.mkdir(parents=True, exist_ok=True)
        samples = (
            self.microphone
            if self.microphone is not None
            else np.zeros(int(8000 * self.seconds_of_audio), dtype=np.int16)
        )
        sf.write(str(self.workdir / "mic.wav"), samples, 8000, subtype="PCM_16")
        self.proc: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None
        self._buffer = b""
        self._configure()

    def _configure(self) -> None:
        """Pick fresh ports and write baresip's config. Ports are probed free, not reserved, so
        another process can take one before baresip binds it: __enter__ then starts again."""
        self.sip_port = free_port()
        self.ctrl_port = free_port(socket.SOCK_STREAM)
        self.rtp_low = 30000 + (self.sip_port % 200) * 10
        (self.workdir / "config").write_text(
            "\n".join(
                [
                    "net_interface 127.0.0.1",
                    f"sip_listen 127.0.0.1:{self.sip_port}",
                    f"audio_source aufile,{self.workdir / 'mic.wav'}",
                    "audio_player aubridge,nil",
                    "audio_alert aubridge,nil",
                    "module_path /usr/lib/baresip/modules",
                    "module g711.so",
                    "module aufile.so",
                    "module aubridge.so",
                    "module sndfile.so",
                    "module_tmp account.so",
                    "module_app menu.so",
                    "module_app ctrl_tcp.so",
                    f"ctrl_tcp_listen 127.0.0.1:{self.ctrl_port}",
                    f"snd_path {self.record_dir}",
                    f"rtp_ports {self.rtp_low}-{self.rtp_low + 9}",
                ]
            )
            + "\n"
        )
        (self.workdir / "accounts").write_text(
            "<sip:tester@127.0.0.1>;regint=0;answermode=auto;audio_codecs=pcmu;ptime=20\n"
        )

    def __enter__(self) -> Baresip:
        require("baresip")
        log_path = self.workdir / "baresip.log"
        # A start that dies (a probed port taken in between) is retried on fresh ports; one that
        # stays up but is slow (a loaded 2-core CI machine) gets a generous 30 s.
        for attempt in range(3):
            if attempt:
                self._configure()
            with open(log_path, "wb") as log:
                self.proc = subprocess.Popen(
                    ["baresip", "-f", str(self.workdir)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            deadline = time.monotonic() + 30
            while self.proc.poll() is None and time.monotonic() < deadline:
                try:
                    self.sock = socket.create_connection(("127.0.0.1", self.ctrl_port), timeout=1)
                except OSError:
                    time.sleep(0.05)
                    continue
                self.sock.settimeout(0.2)
                return self
            if self.proc.poll() is None:
                break  # alive but silent: retrying would not help
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
        raise AssertionError(f"baresip did not open its control port; its log ends:\n{tail}")

    def __exit__(self, *exc: object) -> None:
        try:
            self.command("quit")
        except OSError:
            pass
        if self.proc is not None:
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self.sock is not None:
            self.sock.close()

    # --- control protocol ---------------------------------------------------------------------

    def command(self, command: str, params: str = "") -> None:
        assert self.sock is not None
        payload = json.dumps({"command": command, "params": params, "token": command}).encode()
        self.sock.sendall(str(len(payload)).encode() + b":" + payload + b",")

    def _pump(self) -> None:
        assert self.sock is not None
        try:
            chunk = self.sock.recv(65536)
        except TimeoutError:
            return
        except OSError:
            return
        self._buffer += chunk
        while b":" in self._buffer:
            length_text, _, rest = self._buffer.partition(b":")
            if not length_text.isdigit() or len(rest) < int(length_text) + 1:
                break
            length = int(length_text)
            message = json.loads(rest[:length])
            self._buffer = rest[length + 1 :]
            if message.get("event"):
                self.events.append(message)

    def wait_event(self, kind: str, timeout: float = 20) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            for event in self.events[seen:]:
                if event.get("type") == kind:
                    return event
            seen = 0
            self._pump()
        raise AssertionError(
            f"baresip: no {kind} in {timeout} s; events {[e.get('type') for e in self.events]}"
        )

    def dial(self, uri: str) -> None:
        self.command("dial", uri)

    def send_dtmf(self, digits: str, gap_s: float = 0.3) -> None:
        for digit in digits:
            self.command("sndcode", digit)
            time.sleep(gap_s)

    def hangup(self) -> None:
        self.command("hangup")

    def recording(self) -> np.ndarray:
        """What baresip heard (the -dec.wav its sndfile module wrote), 8 kHz int16."""
        files = sorted(self.record_dir.glob("*-dec.wav"))
        assert files, f"baresip recorded nothing in {self.record_dir}"
        audio, rate = sf.read(str(files[-1]), dtype="int16")
        assert rate == 8000
        return np.asarray(audio)
