"""Real gateways for tests, on real or virtual time, and the demo script's account backend.

Two ways to serve a gateway:

- :func:`serve`: uvicorn in a background thread on real time (peers in other processes or
  threads: baresip, SIPp, Kamailio; timing that is the point of a test).
- :func:`serve_virtual`: uvicorn in a :class:`~tests.support.virtual_time.VirtualTimeLoop` with
  the gateway's clock on that loop's virtual time; the test's callers and backend run in the
  same loop, so timeouts, pacing and grace periods cost no real time.

Nothing heavy is imported at module level (uvicorn and the gateway load inside the functions):
the pure protocol tests import this package on an install without torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from tests.support.net import free_socket

if TYPE_CHECKING:
    import uvicorn

    from gateway.app import Gateway

#: The Twilio auth token every test gateway signs and checks with.
AUTH_TOKEN = "test-auth-token-0123456789abcdef"
T = TypeVar("T")


@dataclass
class LiveServer:
    """A gateway served by uvicorn on 127.0.0.1 in a background thread."""

    base_url: str
    ws_url: str
    gateway: Gateway
    server: uvicorn.Server


def gateway_settings(base_url: str, overrides: dict[str, object]) -> Any:
    from gateway.config import Settings

    values: dict[str, object] = {
        "twilio_auth_token": AUTH_TOKEN,
        "public_url": base_url,
        "device": "cpu",
        # The built-in recogniser unless a test asks for another (GATEWAY_ASR's default, auto,
        # runs Whisper where its model is): tests/e2e/test_speech_whisper_e2e.py does, and the
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

    sock = free_socket()
    port = sock.getsockname()[1]
    base_url = f"http://127.0.0.1:{port}"
    settings = gateway_settings(base_url, settings_overrides)
    app = create_app(settings, engine_factory) if engine_factory else create_app(settings)
    config = uvicorn.Config(
        app, log_level="warning", ws_max_size=settings.ws_max_size, lifespan="on",
        ws=WS_PROTOCOL,  # the media streams' protocol as `gateway serve` runs it
    )
    listening = threading.Event()
    server = uvicorn_server(config, listening.set)
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


def uvicorn_server(config: uvicorn.Config, on_started: Callable[[], None], *, quiet: bool = False
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
    from tests.support.virtual_time import VirtualTimeLoop

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

    from gateway.app import create_app
    from gateway.http_limits import WS_PROTOCOL
    from tests.support.clocks import LoopClock

    sock = free_socket()
    port = sock.getsockname()[1]
    base_url = f"http://127.0.0.1:{port}"
    settings = gateway_settings(base_url, settings_overrides)
    clock = LoopClock(loop)
    app = (create_app(settings, engine_factory, clock=clock) if engine_factory
           else create_app(settings, clock=clock))
    config = uvicorn.Config(
        app, log_level="warning", ws_max_size=settings.ws_max_size, lifespan="on",
        ws=WS_PROTOCOL,  # the media streams' protocol as `gateway serve` runs it
    )
    listening = asyncio.Event()
    server = uvicorn_server(config, listening.set, quiet=True)
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


def backend_app(seen: list[dict[str, Any]]) -> Any:
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
    server = uvicorn_server(uvicorn.Config(backend_app(seen), log_level="warning"), started.set)
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
        self._server = uvicorn_server(uvicorn.Config(backend_app(self.seen), log_level="warning"),
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
