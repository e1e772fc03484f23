"""A second transfer on a SIP call while the first REFER is pending, over real UDP.

The real :class:`~gateway.sip.endpoint.SipEndpoint` on 127.0.0.1 answers a call from the load
simulator's phone (its own SIP stack: it accepts a REFER with 202, then reports the transfer
failed in a NOTIFY, as a phone that cannot follow it does; RFC 3515 2.4.5). The gateway is then
asked to transfer the call twice at once. One REFER goes out; both requests end with that one
REFER's outcome (the caller is hung up) at once. The second used to replace the first one's
future, which nothing then resolved: the first waited out the whole 32 s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.call import Admission, CallerHungUp, CallLifecycle, CallRegistry
from gateway.clock import SystemClock
from gateway.loadsim.sip_caller import SipCaller
from gateway.metrics import Metrics
from gateway.readiness import Readiness
from gateway.sip.endpoint import TRANSFER_TIMEOUT_S, SipEndpoint
from gateway.sip.uas import UasConfig


class _Waiting:
    """A dialog that says nothing and waits for the hang-up."""

    def for_call(self, call: Any) -> Any:
        return self.run

    async def run(self, call: Any) -> None:
        while not isinstance(await call.events.get(), CallerHungUp):
            pass


@pytest.fixture
async def endpoint() -> AsyncIterator[SipEndpoint]:
    clock = SystemClock()
    metrics = Metrics()
    readiness = Readiness(metrics, clock)
    readiness.mark_ready("test")
    lifecycle = CallLifecycle(admission=Admission(4, readiness, clock, metrics),
                              registry=CallRegistry(metrics), readiness=readiness,
                              dialogs=_Waiting(), clock=clock, metrics=metrics)
    endpoint = SipEndpoint(lifecycle, UasConfig(local_ip="127.0.0.1", local_port=0,
                                                allow=["127.0.0.1/32"], t1=0.1),
                           metrics=metrics, rtp_ports=range(27200, 27300))
    await endpoint.start("127.0.0.1", 0)
    try:
        yield endpoint
    finally:
        await endpoint.stop()
        await lifecycle.close_all()


async def test_a_second_transfer_while_the_first_is_pending_shares_its_outcome(
        endpoint: SipEndpoint) -> None:
    assert endpoint.local_addr is not None
    async with SipCaller(t1=0.1) as phone:
        await phone.call(endpoint.local_addr)
        [key] = endpoint.calls
        t0 = time.monotonic()
        first = asyncio.create_task(endpoint.transfer(key, "+15555550100"))
        await asyncio.sleep(0)  # the first REFER is out and waits for its outcome
        second = asyncio.create_task(endpoint.transfer(key, "+15555550199"))
        # Bounded well below the 32 s an orphaned REFER waits.
        done, _ = await asyncio.wait({first, second}, timeout=TRANSFER_TIMEOUT_S / 4)
        took = time.monotonic() - t0
        assert done == {first, second}, f"a transfer still waits after {took:.1f} s"
        assert first.result() is None and second.result() is None  # neither raised
        print(f"\nboth transfers ended {1000 * took:.0f} ms after the first REFER")
        assert phone.requests_received.get("REFER") == 1  # one REFER per call at a time
        assert phone.transferred_to is not None and "+15555550100" in phone.transferred_to
        # The phone reported the transfer failed: the gateway hangs up (BYE).
        for _ in range(500):
            if phone.remote_hangup_at is not None:
                break
            await asyncio.sleep(0.01)
        assert phone.remote_hangup_at is not None
    assert not endpoint._transfers  # nothing pending is left behind
