"""One call lifecycle for every transport: admit, start, run the dialog, finish, drain.

A transport adapter asks :class:`CallLifecycle` three things and nothing else:

1. :meth:`~CallLifecycle.admit` when a call arrives (Twilio ``start``, a SIP INVITE), or
   :meth:`~CallLifecycle.reserve` when it is announced ahead (Twilio's voice webhook): a seat
   in the replica's one budget, or why not;
2. :meth:`~CallLifecycle.start` once its wire side is up: the lifecycle builds the
   :class:`~gateway.call.session.Call` (phone-audio path, playout with the adapter's policy,
   speech detector for the call's codec, inactivity watch), registers it, and runs the dialog
   the :class:`DialogFactory` chooses for it;
3. :meth:`~CallLifecycle.finish` when its wire side is over (stop, BYE, socket gone, timed out):
   the dialog is told (:class:`~gateway.call.events.Hangup`) and stopped, the call's work
   cancelled, its seat released and it is forgotten.

So a new transport (WebRTC, a plain WebSocket) is one adapter: parse its wire, call these, and
implement :class:`~gateway.call.session.CallTransport` (send frames, marks, clear, end, abort).
:meth:`~CallLifecycle.drain` is the replica's side of SIGTERM: stop admitting, let calls finish
within the grace period, hang up the rest.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from gateway.aio import cancel_and_wait
from gateway.audio.condition import Conditioning
from gateway.call.admission import Admission, Refusal
from gateway.call.events import Codec, HangUp, Hangup
from gateway.call.frames import PromptFrames
from gateway.call.inactivity import InactivityWatch
from gateway.call.inbound import InboundCap, InboundRate
from gateway.call.registry import CallRegistry
from gateway.call.session import Call, CallTransport, Dialog, SpeechDetector
from gateway.clock import Clock
from gateway.logs import call_context
from gateway.metrics import Metrics
from gateway.readiness import Readiness

log = logging.getLogger(__name__)

__all__ = ["CallLifecycle", "DetectorFactory", "DialogFactory"]

#: A caller-speech detector for a call's codec (None: speech barge-in is off).
DetectorFactory = Callable[[Codec], SpeechDetector]


class DialogFactory(Protocol):
    """Chooses what runs each call (the IVR script of the line dialled, the greeter...)."""

    def for_call(self, call: Call) -> Dialog:
        """The dialog for ``call``; it may look at ``call.parameters`` (caller, called) and
        name the call's line (``call.line``, a metrics label) before the call is counted."""
        ...


class CallLifecycle:
    """Start, run and finish calls; the one place both transports share."""

    def __init__(
        self,
        *,
        admission: Admission,
        registry: CallRegistry,
        readiness: Readiness,
        dialogs: DialogFactory,
        clock: Clock,
        metrics: Metrics | None = None,
        conditioning: Conditioning | None = None,
        detectors: DetectorFactory | None = None,
        inbound: InboundCap | None = None,
        prompt_frames: PromptFrames | None = None,
    ) -> None:
        self.admission = admission
        self.registry = registry
        self.readiness = readiness
        self.dialogs = dialogs
        self.clock = clock
        self.metrics = metrics
        self.conditioning = conditioning
        self.detectors = detectors
        #: The cap on each call's inbound media rate, the same for every transport.
        self.inbound = inbound if inbound is not None else InboundCap()
        #: The frames of what calls play, encoded once for every call of this lifecycle.
        self.prompt_frames = prompt_frames if prompt_frames is not None else PromptFrames()
        self._dialog_tasks: dict[str, asyncio.Task[None]] = {}

    # --- admission ----------------------------------------------------------------------------

    def refusal(self) -> Refusal | None:
        """Why a new call would be turned away now (``None``: welcome)."""
        return self.admission.refusal()

    def reserve(self, key: str, transport: str, hold_s: float) -> Refusal | None:
        """Hold a seat for a call announced ahead of its media (Twilio's voice webhook)."""
        return self.admission.reserve(key, transport, hold_s)

    def admit(self, key: str, transport: str) -> Refusal | None:
        """A seat for a call arriving now (its reservation, or a fresh one), or why not."""
        return self.admission.admit(key, transport)

    def inbound_meter(self) -> InboundRate:
        """The inbound-rate meter of one new call or stream (:mod:`gateway.call.inbound`)."""
        return self.inbound.meter()

    def watch(self, timeout_s: float, transport: str, on_expired: Callable[[], None],
              label: str) -> InactivityWatch:
        """An inactivity watch for a connection whose call has not started yet (Twilio's
        socket before ``start``); :meth:`start` adopts it."""
        watch = InactivityWatch(self.clock, timeout_s, transport=transport, metrics=self.metrics,
                                on_expired=on_expired, label=label)
        watch.start()
        return watch

    # --- calls --------------------------------------------------------------------------------

    def start(
        self,
        seat: str,
        transport: CallTransport,
        *,
        transport_name: str,
        call_id: str,
        parameters: dict[str, str],
        inactivity_s: float,
        watch: InactivityWatch | None = None,
    ) -> Call:
        """Bring up an admitted call: build it, register it, run its dialog."""
        detectors = self.detectors
        call = Call(
            call_id, transport, self.clock,
            transport_name=transport_name,
            conditioning=self.conditioning,
            detector=detectors(transport.codec) if detectors is not None else None,
            inactivity_s=inactivity_s,
            watch=watch,
            metrics=self.metrics,
            prompt_frames=self.prompt_frames,
        )
        call.seat = seat
        call.parameters.update(parameters)
        # The dialog is chosen before the call is counted: the factory names the call's line,
        # a label of the metrics registering it starts.
        try:
            dialog = self.dialogs.for_call(call)
        except BaseException:
            self.admission.release(seat)
            raise
        self.registry.add(call)
        # The call's tasks (and the tasks they start) log with its id.
        with call_context(call_id):
            call.start()
            task = asyncio.create_task(self._run_dialog(call, dialog), name=f"dialog-{call_id}")
        self._dialog_tasks[call_id] = task
        return call

    async def finish(self, call: Call, reason: str) -> None:
        """The call's wire side is over: stop everything it was doing and forget it."""
        if call.call_id not in self.registry or self.registry.get(call.call_id) is not call:
            return
        call.deliver(Hangup(reason, at=self.clock.now()))  # also marks the call ended: a
        # dialog still running its last step can start nothing new from here on
        task = self._dialog_tasks.pop(call.call_id, None)
        if task is asyncio.current_task():
            task = None  # the dialog ending its own call: it returns by itself
        try:
            await call.close()
            await cancel_and_wait(task, log=log, what=f"call {call.call_id}: dialog")
        finally:
            # Also when whoever finishes the call is cancelled meanwhile (a shutdown): the
            # dialog is still stopped and the seat never leaked.
            if task is not None and not task.done():
                task.cancel()
            self._forget(call)

    def _forget(self, call: Call) -> None:
        if self.registry.remove(call):
            self.admission.release(call.seat)

    async def _run_dialog(self, call: Call, dialog: Dialog) -> None:
        """Drive ``call`` with ``dialog``; a dialog bug ends this call, not the gateway."""
        try:
            await dialog(call)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("call %s: dialog failed; hanging up", call.call_id)
            await call.end(HangUp())
        finally:
            self._dialog_tasks.pop(call.call_id, None)

    # --- the whole replica --------------------------------------------------------------------

    async def drain(self, grace_s: float) -> None:
        """Stop taking calls; wait (up to ``grace_s``) for active calls and reservations to end;
        hang up the rest."""
        if self.readiness.begin_drain():
            log.warning("draining: no new calls; %d active call(s) may continue for up to %g s",
                        len(self.registry), grace_s)
        await self.admission.wait_idle(self.clock.now() + grace_s)
        left = self.registry.values()
        if left:
            log.warning("drain grace over: hanging up %d call(s)", len(left))
            # All at once: a hang-up may be a round trip to Twilio's REST API (seconds when it
            # retries), and the orchestrator's SIGKILL deadline does not wait for a queue.
            results = await asyncio.gather(*(call.end(HangUp()) for call in left),
                                           return_exceptions=True)
            for call, result in zip(left, results, strict=True):
                # (A CancelledError here is that hang-up's own: the call ended meanwhile. The
                # drain's own cancellation is raised by gather itself.)
                if isinstance(result, Exception):
                    log.error("call %s: hang-up at the end of the drain failed", call.call_id,
                              exc_info=result)
        log.info("drained")

    async def close_all(self) -> None:
        """Shutdown: stop every call's work at once (no outcome)."""
        for call in self.registry.values():
            await self.finish(call, "shutdown")
