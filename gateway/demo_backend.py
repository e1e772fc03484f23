"""The demo's company backend: the account service ``prompts/demo.yaml`` looks accounts up in.

The demo script's ``lookup`` node POSTs ``{"call_id", "node", "variables": {"account_number",
"caller"}}`` to ``${ACME_BACKEND_URL:-http://127.0.0.1:8081}/accounts/lookup`` and reads
``first_name``, ``balance``, ``due_date`` and ``status`` from the JSON answer. This stub answers
it offline so the whole menu works on a fresh machine: ``gateway demo`` starts it beside the
gateway (unless ``ACME_BACKEND_URL`` points elsewhere), ``gateway demo-backend`` runs it alone.

Accounts (made up, deterministic): every six-digit number is an account of "Dana" whose balance
is the number's last three digits plus 10 cents, due 2026-03-03 (``417029`` -> 29.10 dollars;
ISO dates, which the script's ``{due_date:date}`` reads as a date);
numbers starting with 9 are overdue (the demo routes them to collections); anything else is
answered 404, which the script treats as a failed lookup ("sorry", then an agent).
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any

__all__ = ["DEFAULT_PORT", "account", "create_app", "start_in_thread"]

log = logging.getLogger("gateway.demo_backend")

#: Where prompts/demo.yaml looks accounts up unless ACME_BACKEND_URL says otherwise.
DEFAULT_PORT = 8081


def account(number: str) -> dict[str, str] | None:
    """The stub's record for ``number`` (None: no such account)."""
    if len(number) != 6 or not number.isdigit():
        return None
    return {
        "first_name": "Dana",
        "balance": f"{int(number[-3:])}.10",
        "due_date": "2026-03-03",
        "status": "overdue" if number.startswith("9") else "current",
    }


def create_app() -> Any:
    """The stub as an ASGI app: ``POST /accounts/lookup`` and ``GET /healthz``."""
    from fastapi import FastAPI, HTTPException

    app = FastAPI(title="Acme Energy demo backend", docs_url=None, redoc_url=None)

    @app.post("/accounts/lookup")
    async def lookup(body: dict[str, Any]) -> dict[str, str]:
        variables = body.get("variables")
        number = str(variables.get("account_number", "")) if isinstance(variables, dict) else ""
        record = account(number)
        log.info("demo backend: lookup of account %r for call %s: %s", number,
                 body.get("call_id"), "found" if record else "no such account")
        if record is None:
            raise HTTPException(404, f"no account {number!r} (the demo knows six digits)")
        return record

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return app


def bind(host: str, port: int) -> socket.socket:
    """The stub's listening socket (a port in use is a :class:`~gateway.errors.ConfigError`
    naming it, before anything else starts)."""
    from gateway.net import bind as bind_socket

    return bind_socket(host, port, kind="tcp", what="demo backend",
                       variable="--backend-port / ACME_BACKEND_URL")


class BackendThread:
    """The stub served by uvicorn in a daemon thread of this process (``gateway demo``)."""

    def __init__(self, sock: socket.socket) -> None:
        import uvicorn

        from gateway.logs import uvicorn_log_config

        host, port = sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        self._sock = sock
        config = uvicorn.Config(create_app(), log_level="warning",
                                log_config=uvicorn_log_config())
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="demo-backend", daemon=True)

    def start(self, timeout_s: float = 30.0) -> BackendThread:
        import time

        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the demo backend did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._sock.close()


def start_in_thread(host: str = "127.0.0.1", port: int = DEFAULT_PORT) -> BackendThread:
    """Bind and start the stub in a thread; its ``url`` is what ACME_BACKEND_URL should be."""
    return BackendThread(bind(host, port)).start()
