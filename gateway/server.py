"""The HTTP server process: uvicorn, with SIGTERM meaning "drain", not "drop every call".

uvicorn's own SIGTERM handling stops accepting connections and closes the open WebSockets,
which would cut every caller mid-sentence on each deploy. Here the first SIGTERM (or Ctrl-C)
only starts a drain: ``/readyz`` turns 503 at once so the load balancer stops sending calls,
new calls are refused (Twilio: a short apology; SIP: 503), and active calls go on until they
end or ``GATEWAY_DRAIN_GRACE_S`` passes; then the server shuts down and the process exits 0.
A second signal stops at once (closing the calls, running the application's shutdown); a third
exits without any cleanup.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn

log = logging.getLogger(__name__)

#: After a second signal, the most seconds uvicorn waits for open connections to close.
STOP_NOW_S = 1


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` whose exit signals drain the gateway first."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self._drain_gateway = drain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._stopping = False

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        # uvicorn announces the address only for sockets it bound itself; ``gateway serve``
        # binds its own first (gateway.net), so say where it listens here.
        for sock in sockets or []:
            host, port = sock.getsockname()[:2]
            log.info("HTTP and WebSocket on http://%s:%d", host, port)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in the signal handler (main thread, between two bytecodes of the event loop):
        # only schedule work on the loop from here. Unlike uvicorn's handler, the signal is
        # not re-raised after shutdown: a drained gateway exits 0.
        name = signal.Signals(sig).name
        if self._loop is None or self._stopping:
            # A third signal (or one before the loop runs): uvicorn's force exit, which skips
            # the application's shutdown.
            log.warning("%s again: exiting without cleaning up", name)
            self.should_exit = True
            self.force_exit = True
            return
        if self._drain_task is not None or self.should_exit:
            # Stop now, but cleanly: open calls are closed (WebSockets with 1012, SIP calls
            # hung up by the shutdown), and the application's shutdown still runs (SIP
            # endpoint, speech threads). uvicorn's force_exit would skip it, and the lifespan
            # task, cancelled when the loop closes, logged a traceback.
            log.warning("%s again: stopping now", name)
            self._stopping = True
            self.should_exit = True
            # uvicorn waits this long for open connections before shutting the app down.
            self.config.timeout_graceful_shutdown = min(
                self.config.timeout_graceful_shutdown or STOP_NOW_S, STOP_NOW_S)
            if self._drain_task is not None:
                self._loop.call_soon_threadsafe(self._drain_task.cancel)
            return
        log.warning("%s: draining (again to stop at once)", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.create_task(self._drain(), name="drain")

    async def _drain(self) -> None:
        try:
            await self._drain_gateway()
        finally:
            self.should_exit = True
