"""Fixtures and the run's hooks, nothing else: the helpers tests import (servers, clocks,
fakes, waiting, metric scraping, real SIP peers) are the :mod:`tests.support` package.

Fixtures: the tiny checkpoints and engine, the demo prompt cache, and real gateway servers on
ephemeral ports (:func:`tests.support.servers.serve` on real time,
:func:`tests.support.servers.serve_virtual` on virtual time).

Nothing heavy is imported at module level: the pure protocol tests (SIP, SDP, RTP, digest,
Twilio messages, G.711, the decimator) run on an install without torch
(tests/unit/test_architecture.py checks it in a subprocess that cannot import torch).
"""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.builds import built_once
from tests.support.paths import DEMO_SCRIPT
from tests.support.servers import (
    LiveServer,
    LoopBackend,
    VirtualServer,
    backend,
    serve,
    serve_virtual,
    virtual_loop,
)

_finished = False


def pytest_unconfigure(config: pytest.Config) -> None:
    global _finished
    _finished = True


def _exit_without_teardown() -> None:
    # An exit handler of a pytest-xdist worker whose session finished: the results went to
    # the controller already, and the handlers registered after this one (at conftest import:
    # the gateway zygote's, multiprocessing's, torch's) have run, since exit handlers run last
    # in, first out. What is left is the interpreter freeing torch's heap and modules: ~3 s
    # per worker, measured, while the controller waits for the last one to exit.
    if _finished:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if "PYTEST_XDIST_WORKER" in os.environ:
    atexit.register(_exit_without_teardown)


def pytest_collection_finish(session: pytest.Session) -> None:
    # Two cores on CI: keep torch from oversubscribing them while the server and client share
    # them. Only where a collected test module brought torch in.
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules with real-time tests first; skip GPU-marked tests only when no CUDA device
    exists (CPU twins cover the behaviour)."""
    _real_time_modules_first(items)
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; covered on CPU by the tiny model")
    for item in gpu_items:
        item.add_marker(skip)


def _real_time_modules_first(items: list[pytest.Item]) -> None:
    """Put the modules that hold ``slow`` (real-time) tests first, each module's tests together
    and in order, the rest after them in collection order.

    pytest-xdist (``--dist loadfile``) hands modules to workers in this order. The real-time
    modules spend most of their wall time waiting (peers in other processes, signals,
    watchdogs): started first, they wait while the CPU-bound modules run on the other workers,
    instead of being what the last worker still waits on after the others are done.
    """
    real_time = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.path not in real_time)  # stable: order kept within groups




@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight CustomVoice checkpoint of the real architecture (built once)."""
    from gateway.tts.tiny import build_tiny_checkpoint

    return built_once(tmp_path_factory, "tiny-custom-voice", build_tiny_checkpoint)


@pytest.fixture(scope="session")
def tiny_base_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Base (voice-clone) checkpoint."""
    from gateway.tts.tiny import build_tiny_checkpoint

    return built_once(tmp_path_factory, "tiny-base",
                       lambda path: build_tiny_checkpoint(path, kind="base"))


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    """The gateway's engine (batched) over the tiny checkpoint, on CPU, warmed up."""
    from gateway.tts.batched import BatchedQwenEngine

    # Recording codes: tests compare what was generated with what was decoded.
    engine = BatchedQwenEngine(model=str(tiny_model_dir), device="cpu", max_rows=4,
                               record_codes=True)
    engine.warmup()
    return engine



@pytest.fixture(scope="module")
def live_gateway(tiny_model_dir: Path) -> Iterator[LiveServer]:
    """One real gateway (tiny model on CPU) shared by a test module."""
    with serve({"model": str(tiny_model_dir)}) as live:
        yield live



@pytest.fixture(scope="session")
def demo_realtime(tiny_model_dir: Path, demo_cache_dir: Path
                  ) -> Iterator[tuple[LiveServer, list[dict[str, Any]]]]:
    """The demo IVR on real time, Twilio and SIP (its backend in a thread): for real peers
    (baresip, SIPp) and for latency that must be measured on the real clock. SIP on an
    ephemeral UDP port of 127.0.0.1 (allow-list 127.0.0.1/32), a 300 ms ring before answering,
    T1 = 100 ms."""
    with backend() as (url, seen), pytest.MonkeyPatch.context() as patch:
        patch.setenv("ACME_BACKEND_URL", url)
        with serve(
            {
                "model": str(tiny_model_dir),
                "script": str(DEMO_SCRIPT),
                "cache_dir": str(demo_cache_dir),
                "sip": "127.0.0.1:0",
                "sip_allow": "127.0.0.1/32",
                "max_calls": 32,
                "sip_answer_delay_ms": 300,
                "sip_t1_ms": 100,
                "rtp_ports": "24000-24999",
            }
        ) as live:
            yield live, seen


@pytest.fixture(scope="session")
def demo_virtual(tiny_model_dir: Path, demo_cache_dir: Path
                 ) -> Iterator[tuple[VirtualServer, list[dict[str, Any]]]]:
    """The demo IVR on virtual time, Twilio and SIP (its backend in the same loop), shared by
    the modules whose callers run in its loop: one start-up for all of them. Yields the server
    and the requests the backend saw."""
    with virtual_loop() as loop:
        backend = loop.run_until_complete(LoopBackend().start())
        try:
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv("ACME_BACKEND_URL", backend.url)
                with serve_virtual({"model": str(tiny_model_dir), "script": str(DEMO_SCRIPT),
                                    "cache_dir": str(demo_cache_dir), "max_calls": 32,
                                    "sip": "127.0.0.1:0", "sip_allow": "127.0.0.1/32",
                                    "rtp_ports": "26000-26999"}, loop=loop) as live:
                    yield live, backend.seen
        finally:
            loop.run_until_complete(backend.stop())


@pytest.fixture(scope="session")
def demo_cache_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """The demo script's static prompts rendered once per run into an on-disk cache, exactly as
    ``gateway script render`` does; servers and runner tests in this run start from it."""
    from gateway.cli import main

    def render(cache: Path) -> None:
        code = main(["script", "render", str(DEMO_SCRIPT), "--model", str(tiny_model_dir),
                     "--device", "cpu", "--cache-dir", str(cache)])
        assert code == 0

    return built_once(tmp_path_factory, "demo-prompt-cache", render)
