"""SIP scale-out: Kamailio (infra/sip/kamailio.cfg) in front of two real gateways, and a drain.

Everything is real and on loopback: two ``gateway serve`` processes (tiny model on CPU, SIP on
UDP), Kamailio running the shipped configuration unchanged (only its ``#!define`` settings are
overridden with ``-A``: loopback ports, a 1 s probing interval, a dispatcher list in a tmp dir),
and SIPp callers. Which gateway answered each call is read two ways: the proxy's own log line
(``call <Call-ID> answered by <ip:port>``, the Call-ID chosen per phase with SIPp ``-cid_str``)
and each gateway's ``gateway_calls_total{transport="sip"}`` (summed over lines).

The drain follows a rolling deploy: a long call is up on gateway A, A gets SIGTERM, its OPTIONS
turn 503, the proxy takes it out of rotation, new calls all land on B, the long call still ends
with the caller's BYE answered by A, and A exits 0 after it. Meanwhile a second proxy that does
not probe shows the failover of an initial INVITE: to B after A's 503 and after a timeout from a
destination that never answers.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.gateway_process import GatewayProcess
from tests.support.metrics import metric
from tests.support.net import free_port
from tests.support.paths import REPO
from tests.support.sip_peers import SippResult, run_sipp
from tests.support.waiting import wait_until as _wait

pytestmark = pytest.mark.slow

INFRA = REPO / "infra" / "sip"
def sip_options(port: int, timeout: float = 1.0) -> int | None:
    """One OPTIONS over UDP to 127.0.0.1:``port``: the final status code, None without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        local = sock.getsockname()[1]
        message = (
            f"OPTIONS sip:127.0.0.1:{port} SIP/2.0\r\n"
            f"Via: SIP/2.0/UDP 127.0.0.1:{local};branch=z9hG4bK{uuid.uuid4().hex[:12]}\r\n"
            f"From: <sip:probe@127.0.0.1>;tag={uuid.uuid4().hex[:8]}\r\n"
            f"To: <sip:127.0.0.1:{port}>\r\n"
            f"Call-ID: {uuid.uuid4().hex}\r\n"
            "CSeq: 1 OPTIONS\r\nMax-Forwards: 70\r\nContent-Length: 0\r\n\r\n"
        )
        sock.sendto(message.encode(), ("127.0.0.1", port))
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            try:
                data, _ = sock.recvfrom(65536)
            except (TimeoutError, ConnectionRefusedError):
                return None
            code = int(data.split(b" ", 2)[1])
            if code >= 200:
                return code
    return None


class Kamailio:
    """infra/sip/kamailio.cfg in the foreground on 127.0.0.1, its log lines timestamped."""

    def __init__(self, workdir: Path, name: str, gateways: list[int], **defines: int) -> None:
        self.workdir = workdir / name
        self.workdir.mkdir()
        self.name = name
        self.port = free_port()
        self.lines: list[tuple[float, str]] = []
        dispatcher_list = self.workdir / "dispatcher.list"
        dispatcher_list.write_text(
            "".join(f"1 sip:127.0.0.1:{port} 0 0 duid=gw{i}\n" for i, port in enumerate(gateways))
        )
        binary = shutil.which("kamailio") or "/usr/sbin/kamailio"
        assert os.path.exists(binary), (
            "kamailio is not installed: apt-get install -y --no-install-recommends kamailio"
        )
        # Probe every second; FR_TIMER_MS keeps the shipped 2 s, so a gateway slowed down by a
        # busy CI machine is not mistaken for a dead one.
        settings = {"PING_INTERVAL": 1, "INACTIVE_THRESHOLD": 1, **defines}
        self.command = [
            binary, "-DD", "-E",  # foreground, log to stderr
            "-f", str(INFRA / "kamailio.cfg"),
            "-Y", str(self.workdir),  # runtime dir it can write
            "-m", "32", "-M", "4",  # shared / per-process memory (MB): plenty for a test
            "-A", f"LISTEN=udp:127.0.0.1:{self.port}",
            "-A", f'DISPATCHER_LIST="{dispatcher_list}"',
            "-A", f'CTL_SOCKET="unix:{self.workdir / "ctl"}"',
            *(arg for key, value in settings.items() for arg in ("-A", f"{key}={value}")),
        ]
        self.proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> Kamailio:
        self.proc = subprocess.Popen(
            self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            stdin=subprocess.DEVNULL,
        )
        threading.Thread(target=self._read, daemon=True).start()
        try:
            # Up once it answers its own OPTIONS (200 or 503, depending on the gateways).
            _wait(lambda: self.proc is not None and self.proc.poll() is None
                  and sip_options(self.port, 0.3), 10, f"{self.name} to answer OPTIONS")
        except AssertionError:
            self.__exit__()
            raise AssertionError(f"{self.name} did not start:\n{self.log()}") from None
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with (self.workdir / "kamailio.log").open("w") as copy:
            for line in self.proc.stdout:
                self.lines.append((time.monotonic(), line.rstrip()))
                copy.write(line)

    def log(self) -> str:
        return "\n".join(line for _, line in self.lines[-80:])

    def first(self, pattern: str, after: float = 0.0) -> float | None:
        """When a log line matching ``pattern`` (regex) first appeared after ``after``."""
        return next(
            (t for t, line in list(self.lines) if t >= after and re.search(pattern, line)), None
        )

    def answered_by(self, cid_prefix: str) -> list[int]:
        """Gateway SIP ports that answered the calls whose Call-ID starts with the prefix."""
        pattern = re.compile(rf"call ({re.escape(cid_prefix)}\S*) answered by 127\.0\.0\.1:(\d+)")
        found: dict[str, int] = {}
        for _, line in list(self.lines):
            match = pattern.search(line)
            if match:
                found[match.group(1)] = int(match.group(2))
        return list(found.values())


def _calls_total(gateway: GatewayProcess) -> float:
    # Summed over the line label (these gateways run the greeter: one line, "default").
    return metric(gateway.base_url, "gateway_calls_total", default=0.0, transport="sip")


def _calls(proxy: Kamailio, workdir: Path, cid: str, calls: int, hold_ms: int,
           scenario: str = "proxy_call.xml", limit: int = 1, timeout_s: float = 30) -> SippResult:
    """SIPp calls through ``proxy``; Call-IDs start with ``cid`` so the proxy's log names them."""
    return run_sipp(
        scenario, ("127.0.0.1", proxy.port), calls=calls, rate=50, limit=limit,
        workdir=workdir, timeout_s=timeout_s,
        extra=["-d", str(hold_ms), "-cid_str", f"{cid}-%u-%p@%s"],
    )


def _in_thread(function: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        out["result"] = function()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_calls_spread_over_gateways_and_a_drained_gateway_finishes_its_calls(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    env = {
        "GATEWAY_SIP_ALLOW": "127.0.0.1/32",
        "GATEWAY_GREETING": "Hello.",
        "GATEWAY_CACHE_DIR": "",
        "GATEWAY_DRAIN_GRACE_S": "30",
        # 64*T1 = 6.4 s: the unacknowledged call below gets the gateway's BYE within the test.
        "GATEWAY_SIP_T1_MS": "100",
        # Two processes on CI's two cores: one torch thread each, not two fighting threads each.
        "OMP_NUM_THREADS": "1",
    }
    gateways = [
        GatewayProcess(tiny_model_dir, tmp_path, dict(env), sip=True, name=f"gw{i}")
        for i in range(2)
    ]
    dead = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # a "gateway" that never answers
    dead.bind(("127.0.0.1", 0))
    proxies: list[Kamailio] = []
    try:
        started = time.monotonic()
        for gateway in gateways:  # both load their model at the same time
            gateway.start()
        for gateway in gateways:
            gateway.wait_ready(180)  # both load their model: slow on a busy 2-core box
        print(f"\ntwo gateways ready in {time.monotonic() - started:.1f} s")
        ports = [gateway.sip_port for gateway in gateways if gateway.sip_port is not None]
        assert len(ports) == 2
        lb = Kamailio(tmp_path, "lb", ports)
        proxies.append(lb.__enter__())
        # A second proxy that does not probe (PING_INTERVAL=0): it only learns that a gateway
        # is draining or dead from the INVITE it sends there, which must fail over.
        no_probe = Kamailio(tmp_path, "lb-no-probe", [ports[0], dead.getsockname()[1], ports[1]],
                            PING_INTERVAL=0)
        proxies.append(no_probe.__enter__())
        assert sip_options(lb.port) == 200

        # --- 1. Round robin: four calls, two on each gateway. ---------------------------------
        result = _calls(lb, tmp_path, "rr", calls=4, hold_ms=300)
        assert result.ok, result.stdout[-3000:] + lb.log()
        placed = lb.answered_by("rr-")
        assert sorted(placed) == sorted(ports * 2), placed
        assert [_calls_total(g) for g in gateways] == [2.0, 2.0]

        # --- 2. A long call (it will be on the gateway we drain) and an unacknowledged one. ---
        long_thread, long_out = _in_thread(
            lambda: _calls(lb, tmp_path, "long", calls=1, hold_ms=12000, timeout_s=40)
        )
        placed = _wait(lambda: lb.answered_by("long-"), 10, "the long call to be answered")
        a_port = placed[0]
        b_port = ports[1 - ports.index(a_port)]
        a, b = gateways[ports.index(a_port)], gateways[ports.index(b_port)]
        # No ACK: after 64*T1 the gateway hangs up with its own BYE, which carries no Route
        # header (the gateway keeps no route set): the proxy must still relay it to the caller.
        no_ack_thread, no_ack_out = _in_thread(
            lambda: _calls(lb, tmp_path, "noack", calls=1, hold_ms=0, scenario="no_ack.xml")
        )
        _wait(lambda: lb.answered_by("noack-"), 10, "the unacknowledged call to be answered")
        before = {"a": _calls_total(a), "b": _calls_total(b)}

        # --- 3. Drain A. ------------------------------------------------------------------------
        t0 = time.monotonic()
        a.signal(signal.SIGTERM)
        _wait(lambda: sip_options(a_port, 0.5) == 503, 5, "A's OPTIONS to answer 503")
        t_options_503 = time.monotonic()
        down = rf"gateway down: sip:127\.0\.0\.1:{a_port}\b"
        t_down = _wait(lambda: lb.first(down, after=t0), 5, "the proxy to take A out")
        assert sip_options(lb.port) == 200  # B still takes calls

        result = _calls(lb, tmp_path, "new", calls=4, hold_ms=200, limit=2)
        assert result.ok, result.stdout[-3000:] + lb.log()
        assert lb.answered_by("new-") == [b_port] * 4
        assert _calls_total(b) == before["b"] + 4
        assert _calls_total(a) == before["a"]  # A's /metrics still serves while it drains

        # The proxy that does not probe still sends INVITEs to A (503) and to the dead
        # destination (no answer): each fails over, and every call is answered by B.
        result = _calls(no_probe, tmp_path, "fo", calls=3, hold_ms=100)
        assert result.ok, result.stdout[-3000:] + no_probe.log()
        assert no_probe.answered_by("fo-") == [b_port] * 3
        assert a.proc is not None and a.proc.poll() is None, "A exited before the failover check"
        failed = r"gateway sip:127\.0\.0\.1:{} failed call fo-\S+ \({}\)"
        assert no_probe.first(failed.format(a_port, 503)), no_probe.log()
        assert no_probe.first(failed.format(dead.getsockname()[1], 408)), no_probe.log()

        # --- 4. The long call ends normally (its BYE answered by A); then A exits 0. ------------
        long_thread.join(40)
        t_long_end = time.monotonic()
        assert long_out["result"].ok, long_out["result"].stdout[-3000:] + a.log()
        code = a.wait_exit(20)
        t_exit = time.monotonic()
        assert code == 0, a.log()
        a_log = a.log()
        assert "drain grace over" not in a_log
        assert re.search(r"sip call sip-long-\S+ ended \(bye\)", a_log), a_log
        no_ack_thread.join(30)
        assert no_ack_out["result"].ok, no_ack_out["result"].stdout[-3000:] + lb.log()

        # --- 5. B drains too (no calls: it exits at once); the proxy then refuses calls. --------
        t_b = time.monotonic()
        b.signal(signal.SIGTERM)
        assert b.wait_exit(20) == 0, b.log()
        _wait(lambda: lb.first(rf"gateway down: sip:127\.0\.0\.1:{b_port}\b", after=t_b),
              1 + 2 + 5, "the proxy to take B out")
        assert sip_options(lb.port) == 503
        refused = run_sipp("draining.xml", ("127.0.0.1", lb.port), workdir=tmp_path, timeout_s=10)
        assert refused.ok, refused.stdout[-3000:] + lb.log()

        print(
            "\ndrain behind Kamailio (probe every 1 s, threshold 1):"
            f"\n  t=0.000 s  SIGTERM to gateway A (one 12 s call up)"
            f"\n  t={t_options_503 - t0:.3f} s  A answers OPTIONS with 503"
            f"\n  t={t_down - t0:.3f} s  Kamailio marks A down (no new calls to it)"
            f"\n  t={t_long_end - t0:.3f} s  the long call ends (caller's BYE answered by A)"
            f"\n  t={t_exit - t0:.3f} s  A exits 0"
        )
        assert t_down < t_long_end <= t_exit
    finally:
        for proxy in proxies:
            proxy.__exit__()
        for gateway in gateways:
            gateway.stop()
        dead.close()
