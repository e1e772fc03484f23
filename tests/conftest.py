"""Shared fixtures: the tiny checkpoint and real gateway servers on ephemeral ports.

Nothing heavy is imported at module level: the pure protocol tests (SIP, SDP, RTP, digest,
Twilio messages, G.711, the decimator) run on an install without torch
(tests/test_architecture.py checks it in a subprocess that cannot import torch).

Two ways to serve a gateway:

- :func:`serve`: uvicorn in a background thread on real time (peers in other processes or
  threads: baresip, SIPp, Kamailio; timing that is the point of a test).
- :func:`serve_virtual`: uvicorn in a :class:`virtual_time.VirtualTimeLoop` with the gateway's
  clock on that loop's virtual time; the test's callers and backend run in the same loop, so
  timeouts, pacing and grace periods cost no real time.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import os
import socket
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pytest

if TYPE_CHECKING:
    import uvicorn

    from gateway.app import Gateway

AUTH_TOKEN = "test-auth-token-0123456789abcdef"
T = TypeVar("T")


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


def _built_once(tmp_path_factory: pytest.TempPathFactory, name: str,
                build: Callable[[Path], object]) -> Path:
    """``build(path)`` once per test run, whatever the number of pytest-xdist workers.

    Workers share the run's base temporary directory (its parent, under xdist); the first to
    take the lock builds, the others wait and reuse. Only deterministic artefacts go here (the
    tiny checkpoints are byte-identical for a seed; the demo cache is rendered with seeds).
    """
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        base = base.parent
    path = base / "shared" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    done = path.with_name(name + ".done")
    with FileLock(str(path) + ".lock"):
        if not done.exists():
            build(path)
            done.touch()
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight CustomVoice checkpoint of the real architecture (built once)."""
    from gateway.tts.tiny import build_tiny_checkpoint

    return _built_once(tmp_path_factory, "tiny-custom-voice", build_tiny_checkpoint)


@pytest.fixture(scope="session")
def tiny_base_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Base (voice-clone) checkpoint."""
    from gateway.tts.tiny import build_tiny_checkpoint

    return _built_once(tmp_path_factory, "tiny-base",
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


@dataclass
class LiveServer:
    """A gateway served by uvicorn on 127.0.0.1 in a background thread."""

    base_url: str
    ws_url: str
    gateway: Gateway
    server: uvicorn.Server


def _free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def _settings(base_url: str, overrides: dict[str, object]) -> Any:
    from gateway.config import Settings

    values: dict[str, object] = {
        "twilio_auth_token": AUTH_TOKEN,
        "public_url": base_url,
        "device": "cpu",
        # The built-in recogniser unless a test asks for another (GATEWAY_ASR's default, auto,
        # runs Whisper where its model is): tests/test_speech_whisper_e2e.py does, and the
        # suite's count of neural recognitions (~0.2-0.4 s each) stays bounded.
        "asr": "pocketsphinx",
    }
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


@contextlib.contextmanager
def serve(settings_overrides: dict[str, object], engine_factory=None) -> Iterator[LiveServer]:  # type: ignore[no-untyped-def]
    """Run a real gateway (real time) until the block exits; waits until it is ready."""
    import uvicorn

    from gateway.app import create_app
    from gateway.http_limits import WS_PROTOCOL

    sock = _free_socket()
    port = sock.getsockname()[1]
    base_url = f"http://127.0.0.1:{port}"
    settings = _settings(base_url, settings_overrides)
    app = create_app(settings, engine_factory) if engine_factory else create_app(settings)
    config = uvicorn.Config(
        app, log_level="warning", ws_max_size=settings.ws_max_size, lifespan="on",
        ws=WS_PROTOCOL,  # the media streams' protocol as `gateway serve` runs it
    )
    listening = threading.Event()
    server = _server(config, listening.set)
    gateway: Gateway = app.state.gateway
    settled = threading.Event()
    gateway.readiness.when_settled(settled.set)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        if not settled.wait(120):
            raise RuntimeError("gateway did not become ready in 120 s")
        if gateway.readiness.load_error:
            raise RuntimeError(gateway.readiness.load_error)
        if not listening.wait(30):
            raise RuntimeError("gateway ready but not listening")
        yield LiveServer(base_url, f"ws://127.0.0.1:{port}/twilio/media", gateway, server)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def _server(config: uvicorn.Config, on_started: Callable[[], None], *, quiet: bool = False
            ) -> uvicorn.Server:
    """A uvicorn Server that says when it is listening (``on_started``, on its loop); ``quiet``:
    without its signal handlers (a server inside the test's own thread keeps Ctrl-C for pytest).
    """
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            on_started()

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if quiet:
                yield
            else:
                with super().capture_signals():
                    yield

    return Server(config)


@dataclass
class VirtualServer:
    """A gateway served by uvicorn inside a :class:`virtual_time.VirtualTimeLoop`.

    Tests drive it with :meth:`run`: the coroutine runs in the gateway's own loop, so callers
    made there (``FakeTwilioCall``, httpx.AsyncClient) share its virtual time.
    """

    base_url: str
    ws_url: str
    gateway: Gateway
    server: uvicorn.Server
    loop: Any

    def run(self, coroutine: Awaitable[T], *, realtime: bool = False) -> T:
        """Run ``coroutine`` to completion in the gateway's loop (virtual time unless
        ``realtime``)."""
        self.loop.realtime = realtime
        try:
            return self.loop.run_until_complete(coroutine)  # type: ignore[no-any-return]
        finally:
            self.loop.realtime = False


def on_virtual_time(server_fixture: str, *, realtime: bool = False
                    ) -> Callable[[Callable[..., Awaitable[T]]], Callable[..., T]]:
    """Run an ``async def`` test in the loop of the :class:`VirtualServer` fixture named
    ``server_fixture`` (its callers then share the gateway's virtual time)."""

    def decorate(test: Callable[..., Awaitable[T]]) -> Callable[..., T]:
        @functools.wraps(test)
        def run(*args: Any, **kwargs: Any) -> T:
            server: VirtualServer = kwargs[server_fixture]
            return server.run(test(*args, **kwargs), realtime=realtime)

        return run

    return decorate


@contextlib.contextmanager
def virtual_loop() -> Iterator[Any]:
    """A fresh :class:`virtual_time.VirtualTimeLoop` for the block (closed after)."""
    from virtual_time import VirtualTimeLoop

    loop = VirtualTimeLoop()
    try:
        yield loop
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


@contextlib.contextmanager
def serve_virtual(settings_overrides: dict[str, object], engine_factory=None,  # type: ignore[no-untyped-def]
                  *, loop: Any = None) -> Iterator[VirtualServer]:
    """Run a real gateway in a virtual-time loop until the block exits (ready on entry).

    ``loop``: a :func:`virtual_loop` that peers (a backend) already run in; default a new one.
    """
    if loop is None:
        with virtual_loop() as own, serve_virtual(settings_overrides, engine_factory,
                                                  loop=own) as live:
            yield live
        return
    import uvicorn
    from clocks import LoopClock

    from gateway.app import create_app
    from gateway.http_limits import WS_PROTOCOL

    sock = _free_socket()
    port = sock.getsockname()[1]
    base_url = f"http://127.0.0.1:{port}"
    settings = _settings(base_url, settings_overrides)
    clock = LoopClock(loop)
    app = (create_app(settings, engine_factory, clock=clock) if engine_factory
           else create_app(settings, clock=clock))
    config = uvicorn.Config(
        app, log_level="warning", ws_max_size=settings.ws_max_size, lifespan="on",
        ws=WS_PROTOCOL,  # the media streams' protocol as `gateway serve` runs it
    )
    listening = asyncio.Event()
    server = _server(config, listening.set, quiet=True)
    gateway: Gateway = app.state.gateway

    async def up() -> asyncio.Task[None]:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        await gateway.readiness.settled()
        await listening.wait()
        return task

    task = loop.run_until_complete(up())
    previous_real_work = loop.real_work

    def computing() -> bool:
        speech = gateway.speech
        return (speech is not None and speech.computing) or bool(
            previous_real_work is not None and previous_real_work())

    loop.real_work = computing
    try:
        if gateway.readiness.load_error:
            raise RuntimeError(gateway.readiness.load_error)
        yield VirtualServer(base_url, f"ws://127.0.0.1:{port}/twilio/media", gateway, server,
                            loop)
    finally:
        loop.real_work = previous_real_work
        server.should_exit = True
        loop.run_until_complete(task)
        sock.close()


@pytest.fixture(scope="module")
def live_gateway(tiny_model_dir: Path) -> Iterator[LiveServer]:
    """One real gateway (tiny model on CPU) shared by a test module."""
    with serve({"model": str(tiny_model_dir)}) as live:
        yield live


DEMO_SCRIPT = Path(__file__).resolve().parent.parent / "prompts" / "demo.yaml"


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
    ``gateway prompts render`` does; servers and runner tests in this run start from it."""
    from gateway.cli import main

    def render(cache: Path) -> None:
        code = main(["prompts", "render", str(DEMO_SCRIPT), "--model", str(tiny_model_dir),
                     "--device", "cpu", "--cache-dir", str(cache)])
        assert code == 0

    return _built_once(tmp_path_factory, "demo-prompt-cache", render)


def _backend_app(seen: list[dict[str, Any]]) -> Any:
    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/accounts/lookup")
    async def lookup(body: dict[str, Any]) -> dict[str, str]:
        seen.append(body)
        account = body["variables"]["account_number"]
        return {"first_name": "Dana", "balance": f"{int(account) % 1000}.10", "due_date": "March 3"}

    return app


@contextlib.contextmanager
def backend() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """The company's account service: POST /accounts/lookup (its own thread, real time)."""
    import uvicorn

    seen: list[dict[str, Any]] = []
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    started = threading.Event()
    server = _server(uvicorn.Config(_backend_app(seen), log_level="warning"), started.set)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    if not started.wait(30):
        raise RuntimeError("the backend did not start")
    try:
        yield url, seen
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


class LoopBackend:
    """The same account service served inside an event loop (a virtual-time loop's peer)."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.url = ""
        self._task: asyncio.Task[None] | None = None
        self._server: Any = None
        self._sock: socket.socket | None = None

    async def start(self) -> LoopBackend:
        import uvicorn

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        started = asyncio.Event()
        self._server = _server(uvicorn.Config(_backend_app(self.seen), log_level="warning"),
                               started.set, quiet=True)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        await started.wait()
        self._sock = sock
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        return self

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task
        if self._sock is not None:
            self._sock.close()
