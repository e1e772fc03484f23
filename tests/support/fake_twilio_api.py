"""A stand-in for Twilio's REST API, as far as live-call updates go, on a loopback port.

``POST /2010-04-01/Accounts/{AccountSid}/Calls/{CallSid}.json`` with a form body (``Twiml``),
authenticated with HTTP basic auth (the account SID and auth token, or an API key and its
secret): Twilio's "Update a Call resource"
(https://www.twilio.com/docs/voice/api/call-resource#update-a-call-resource). It records each
request as it came and answers 200 with a call resource, or what a test planned for that call:
a status (Twilio's error JSON with a code, as the twilio library parses it) or ``"hang"`` (no
answer until the client gives up). The gateway is pointed at it with GATEWAY_TWILIO_API_BASE.

Runs in its own thread (uvicorn), so gateways in other threads or processes can reach it;
tests wait on :meth:`FakeTwilioApi.wait_for`, a condition with a bound, never a sleep.
"""

from __future__ import annotations

import base64
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tests.support.servers import uvicorn_server

T = TypeVar("T")

#: Error bodies Twilio answers with (https://www.twilio.com/docs/api/errors).
ERRORS = {
    400: (21220, "Call is not in-progress. Cannot redirect."),
    401: (20003, "Authenticate"),
    404: (20404, "The requested resource was not found"),
    429: (20429, "Too Many Requests"),
    500: (20500, "Internal Server Error"),
    503: (20503, "Service Unavailable"),
}


@dataclass(frozen=True)
class CallUpdate:
    """One update request as it arrived."""

    method: str
    path: str
    account_sid: str
    call_sid: str
    #: (username, password) of the basic ``Authorization`` header, or None.
    auth: tuple[str, str] | None
    content_type: str
    form: dict[str, str]
    #: What it was answered with (a status, or "hang").
    answer: int | str
    at: float = field(default_factory=time.monotonic)


@dataclass
class FakeTwilioApi:
    """Twilio's REST API for ``account_sid``, accepting ``credentials`` (username, password)."""

    account_sid: str
    credentials: tuple[str, str]
    updates: list[CallUpdate] = field(default_factory=list)
    #: CallSid -> answers for its next requests in turn (then 200).
    plans: dict[str, list[int | str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._changed = threading.Condition()
        self._release = threading.Event()
        self.url = ""

    # --- server -------------------------------------------------------------------------------

    def __enter__(self) -> FakeTwilioApi:
        import uvicorn

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        started = threading.Event()
        self._server = uvicorn_server(uvicorn.Config(self._app(), log_level="warning"), started.set,
                               quiet=True)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        daemon=True)
        self._thread.start()
        self._sock = sock
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        if not started.wait(30):
            raise RuntimeError("the fake Twilio API did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._release.set()
        self._server.should_exit = True
        self._thread.join(10)
        self._sock.close()

    def _app(self) -> Any:
        # (Request and JSONResponse are module-level names: FastAPI resolves the handler's
        # annotations, strings under ``from __future__ import annotations``, in this module.)
        app = FastAPI()

        @app.post("/2010-04-01/Accounts/{account_sid}/Calls/{call_sid}.json")
        async def update(account_sid: str, call_sid: str, request: Request) -> JSONResponse:
            form = {key: str(value) for key, value in (await request.form()).items()}
            auth = _basic(request.headers.get("authorization", ""))
            answer: int | str = 200
            if auth != self.credentials or account_sid != self.account_sid:
                answer = 401
            else:
                plan = self.plans.get(call_sid)
                if plan:
                    answer = plan.pop(0)
            record = CallUpdate(request.method, request.url.path, account_sid, call_sid, auth,
                                request.headers.get("content-type", ""), form, answer)
            with self._changed:
                self.updates.append(record)
                self._changed.notify_all()
            if answer == "hang":
                # No answer until the client gives up (its timeout) or the server stops.
                import asyncio

                give_up = time.monotonic() + 30
                while (not self._release.is_set() and time.monotonic() < give_up
                       and not await request.is_disconnected()):
                    await asyncio.sleep(0.05)  # polling the client's connection, not a wait
                return JSONResponse({}, status_code=504)
            assert isinstance(answer, int)
            if answer >= 400:
                code, message = ERRORS.get(answer, (20000 + answer, "error"))
                return JSONResponse(
                    {"code": code, "message": message, "status": answer,
                     "more_info": f"https://www.twilio.com/docs/errors/{code}"},
                    status_code=answer)
            return JSONResponse({
                "sid": call_sid, "account_sid": account_sid, "api_version": "2010-04-01",
                "status": "in-progress", "direction": "inbound",
                "uri": f"/2010-04-01/Accounts/{account_sid}/Calls/{call_sid}.json",
            })

        return app

    # --- queries ------------------------------------------------------------------------------

    def for_call(self, call_sid: str) -> list[CallUpdate]:
        with self._changed:
            return [update for update in self.updates if update.call_sid == call_sid]

    def wait_for(self, predicate: Callable[[], T | None], timeout: float = 20,
                 what: str = "an update") -> T:
        """Block until ``predicate()`` is truthy after a request (or now); AssertionError after
        ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                result = predicate()
                if result:
                    return result
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"fake Twilio API: no {what} in {timeout} s; got "
                                         f"{[(u.call_sid, u.answer) for u in self.updates]}")
                self._changed.wait(left)


def _basic(header: str) -> tuple[str, str] | None:
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        user, _, password = base64.b64decode(value).decode().partition(":")
    except ValueError:
        return None
    return user, password
