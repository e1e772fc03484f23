"""The clocks' timed waits: what Python 3.11's own asyncio.wait_for gets wrong."""

from __future__ import annotations

import asyncio

import pytest

from gateway.clock import Clock, SystemClock
from tests.support.clocks import LoopClock


@pytest.mark.parametrize("kind", ["system", "loop"])
async def test_a_timed_wait_never_swallows_the_cancellation_of_its_task(kind: str) -> None:
    """A task that loops on a timed wait, cancelled in the loop turn its wait completes (the SIP
    endpoint's timers, woken by the hang-ups that its stop() sends): asyncio.wait_for on 3.11
    returned the result and dropped the cancellation, and the task never ended."""
    clock: Clock = SystemClock() if kind == "system" else LoopClock(asyncio.get_running_loop())
    wake = asyncio.Event()
    rounds = 0

    async def timers() -> None:
        nonlocal rounds
        while True:
            rounds += 1
            wake.clear()
            try:
                await clock.wait_for(wake.wait(), 10.0)
            except TimeoutError:
                pass

    task = asyncio.create_task(timers())
    await asyncio.sleep(0)
    wake.set()
    await asyncio.sleep(0)  # the wait has completed; its task has not run yet
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=2.0)
    assert done == {task} and task.cancelled(), f"still looping after {rounds} rounds"


@pytest.mark.parametrize("seconds", [0.0, 0.01])
async def test_a_timed_wait_times_out_and_cancels_what_it_waited_for(seconds: float) -> None:
    clock = SystemClock()
    never = asyncio.get_running_loop().create_future()
    with pytest.raises(TimeoutError):
        await clock.wait_for(never, seconds)
    assert never.cancelled()
    ready = asyncio.get_running_loop().create_future()
    ready.set_result(7)
    assert await clock.wait_for(ready, seconds) == 7
