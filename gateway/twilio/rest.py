"""Live-call updates through Twilio's REST API: the outcome reaches Twilio from the replica
that decided it.

A transfer or hang-up is decided on the replica running the call's Media Stream. Twilio asks
what comes next with ``POST /twilio/after-stream``, and a load balancer without stickiness may
send that request to any replica, which cannot know the answer. So the replica that decided
updates the live call itself, as pipecat and vocode do: ``POST
/2010-04-01/Accounts/{AccountSid}/Calls/{CallSid}.json`` with ``Twiml=<Response>...``
(Twilio's "Update a Call resource": the call stops what it is doing, ``<Connect><Stream>``
included, and runs the new TwiML at once). The stream stays open until Twilio ends it, so no
``after-stream`` request is ever in flight while the update is (the stream's side of that is
:class:`~gateway.twilio.stream.TwilioTransport`).

:class:`CallUpdater` makes that request with the ``twilio`` library's own client and its
asynchronous HTTP client (aiohttp): nothing blocks the event loop. Every attempt has a timeout;
a connection failure, a timeout, 429 or a 5xx is retried with exponential backoff, unless the
stream has ended meanwhile (Twilio took an update whose answer was lost, or the caller hung up:
a second update would restart a ``<Dial>`` already ringing). Other 4xx are final (20404: no
such call; 21220: the call is over). A failure is logged with the call id, counted in
``gateway_twilio_call_updates_total{result="failed"}``, and the caller falls back on
``after-stream``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from twilio.base.exceptions import TwilioRestException
from twilio.twiml.voice_response import VoiceResponse

from gateway.clock import Clock
from gateway.metrics import Metrics

if TYPE_CHECKING:
    from gateway.config import Settings

log = logging.getLogger(__name__)

#: The twilio library's HTTP client logs each request's method, URL and headers, and each
#: response's, at INFO: a dozen lines per update, beside the one line here that says what was
#: sent for which call. Set this logger to INFO to see them.
_http_log = logging.getLogger(__name__ + ".http")
_http_log.setLevel(logging.WARNING)

__all__ = ["DEFAULT_API_BASE", "CallUpdater"]

DEFAULT_API_BASE = "https://api.twilio.com"

#: Attempts per update (the first and two retries), and the wait before the first retry
#: (doubling after). With the default 3 s timeout a dead API costs a caller at most ~10.5 s of
#: silence before the after-stream fallback.
ATTEMPTS = 3
BACKOFF_S = 0.5


class CallUpdater:
    """Updates live Twilio calls with new TwiML (``calls(sid).update(twiml=...)``).

    ``username``/``password`` are the REST API credentials: an API key SID and its secret, or
    the account SID and its auth token. :meth:`start` and :meth:`close` run on the event loop
    (the app's lifespan): the HTTP session belongs to that loop.
    """

    def __init__(
        self,
        *,
        account_sid: str,
        username: str,
        password: str,
        clock: Clock,
        api_base: str = DEFAULT_API_BASE,
        timeout_s: float = 3.0,
        attempts: int = ATTEMPTS,
        backoff_s: float = BACKOFF_S,
        metrics: Metrics | None = None,
    ) -> None:
        self.account_sid = account_sid
        self.api_base = api_base
        self._username = username
        self._password = password
        self._clock = clock
        self._timeout_s = timeout_s
        self._attempts = max(1, attempts)
        self._backoff_s = backoff_s
        self._metrics = metrics
        self._client: Any = None
        self._http: Any = None
        self._tasks: set[asyncio.Task[bool]] = set()

    @classmethod
    def from_settings(cls, settings: Settings, clock: Clock,
                      metrics: Metrics | None = None) -> CallUpdater | None:
        """The updater ``GATEWAY_TWILIO_ACCOUNT_SID`` and its credentials configure (an API key,
        else the auth token); None without an account SID (after-stream answers alone)."""
        sid = settings.twilio_account_sid
        if sid is None:
            return None
        if settings.twilio_api_key_sid is not None and settings.twilio_api_key_secret is not None:
            username = settings.twilio_api_key_sid
            password = settings.twilio_api_key_secret.get_secret_value()
        else:
            # Settings refuse an account SID with neither an API key nor an auth token.
            assert settings.twilio_auth_token is not None
            username, password = sid, settings.twilio_auth_token.get_secret_value()
        return cls(account_sid=sid, username=username, password=password, clock=clock,
                   api_base=settings.twilio_api_base, timeout_s=settings.twilio_api_timeout_s,
                   metrics=metrics)

    async def start(self) -> None:
        """Open the HTTP session (on the running loop)."""
        from twilio.http.async_http_client import AsyncTwilioHttpClient
        from twilio.rest import Client

        self._http = AsyncTwilioHttpClient(timeout=self._timeout_s, logger=_http_log)
        self._client = Client(self._username, self._password, self.account_sid,
                              http_client=self._http)
        # The REST domain's base URL: Twilio's, or a stand-in (tests, a regional host).
        self._client.api.base_url = self.api_base

    async def close(self) -> None:
        """Stop updates still retrying (shutdown) and close the HTTP session."""
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def update(self, call_sid: str, twiml: VoiceResponse,
                     still_needed: Callable[[], bool] = lambda: True) -> bool:
        """Replace ``call_sid``'s TwiML with ``twiml``; True once Twilio took it (or the call's
        stream ended first, so nothing is left to deliver: ``still_needed`` says whether it
        still runs), False when every attempt failed.

        The request runs in its own task: the caller being cancelled (the stream ended under
        it) neither aborts a request Twilio may be applying nor loses its outcome in the logs.
        """
        if self._client is None:
            raise RuntimeError("CallUpdater.start() was not called")
        task = asyncio.create_task(self._deliver(call_sid, str(twiml), still_needed),
                                   name=f"twilio-update-{call_sid}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(task)

    async def _deliver(self, call_sid: str, twiml: str, still_needed: Callable[[], bool]
                       ) -> bool:
        import aiohttp

        calls = self._client.api.v2010.accounts(self.account_sid).calls
        reason = ""
        attempt = 0
        while attempt < self._attempts:
            attempt += 1
            try:
                await self._clock.wait_for(calls(call_sid).update_async(twiml=twiml),
                                           self._timeout_s)
            except TwilioRestException as exc:
                retry = exc.status == 429 or exc.status >= 500
                reason = f"HTTP {exc.status}, Twilio error {exc.code}: {exc.msg}"
            except TimeoutError:
                retry = True
                reason = f"no answer within {self._timeout_s:g} s"
            except (aiohttp.ClientError, OSError) as exc:
                retry = True
                reason = f"{type(exc).__name__}: {exc}"
            else:
                self._count("delivered")
                log.info("call %s: Twilio updated with %s", call_sid, _summary(twiml))
                return True
            if not retry or attempt == self._attempts:
                break
            wait = self._backoff_s * 2 ** (attempt - 1)
            log.warning("call %s: Twilio REST update failed (attempt %d of %d: %s); retrying in "
                        "%.1f s", call_sid, attempt, self._attempts, reason, wait)
            if self._metrics is not None:
                self._metrics.twilio_update_retries.inc()
            await self._clock.sleep(wait)
            if not still_needed():
                # Twilio ended the stream: it took an update whose answer we lost, or the
                # caller hung up. Either way a second update would only disturb the call.
                self._count("moot")
                log.info("call %s: stream ended before the retry: no second update", call_sid)
                return True
        self._count("failed")
        log.error("call %s: Twilio REST update with %s failed after %d attempt(s): %s; "
                  "falling back on <Connect action> (after-stream)", call_sid, _summary(twiml),
                  attempt, reason)
        return False

    def _count(self, result: str) -> None:
        if self._metrics is not None:
            self._metrics.twilio_updates.labels(result).inc()


def _summary(twiml: str) -> str:
    """The verbs of a TwiML document, for a log line (``<Dial>``, ``<Say><Hangup>``)."""
    import xml.etree.ElementTree as ET

    try:
        root = ET.fromstring(twiml)
    except ET.ParseError:
        return "TwiML"
    return "".join(f"<{child.tag}>" for child in root) or "<Response/>"
