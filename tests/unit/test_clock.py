"""The clocks' timed waits: what Python 3.11's own asyncio.wait_for gets wrong."""

from __future__ import annotations

import asyncio
import math

import pytest

from gateway.clock import MIN_WAIT_S, Clock, SystemClock, timer_delay
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



def _deadline_just_ahead(now: float) -> float:
    """A deadline a few picoseconds after ``now``: within asyncio's clock resolution (1 ns),
    as the float sums of a call's timers leave one (a bot's token deadline 2.7e-12 s ahead of
    the time that woke it, in the end-to-end test that hung)."""
    deadline = now
    for _ in range(8):
        deadline = math.nextafter(deadline, math.inf)
    assert 0 < deadline - now < 1e-9
    return deadline


def test_waiting_until_a_deadline_within_the_clock_resolution_reaches_it() -> None:
    """"Wait until the deadline, then check ``now() >= deadline``" on a virtual-time loop (the
    end-to-end tests' gateway clock) while other work is ready to run: asyncio runs a timer up
    to its clock's resolution early when it runs ready work, without its clock passing the
    timer's time, and this loop's time moves only when it is idle, so a wait for the last
    picoseconds woke with the deadline still ahead, again and again (a bot's stalled-answer
    deadline spun a test gateway's event loop for 300 s). A wait now lasts at least
    MIN_WAIT_S: a timer the loop fires only once its clock has passed it."""
    from tests.support.servers import virtual_loop

    async def busy() -> None:
        # Work ready to run in every loop turn (in the hang: the bot session's own futures).
        for _ in range(2000):
            await asyncio.sleep(0)

    async def until_deadline(clock: Clock) -> int:
        peer = asyncio.create_task(busy())
        deadline = _deadline_just_ahead(clock.now())
        rounds = 0
        never = asyncio.Event()
        while clock.now() < deadline and rounds < 1000:
            rounds += 1
            try:
                await clock.wait_for(never.wait(), deadline - clock.now())
            except TimeoutError:
                pass
        await peer
        return rounds

    with virtual_loop() as loop:
        rounds = loop.run_until_complete(until_deadline(LoopClock(loop)))
    assert rounds == 1, f"{rounds} waits to reach a deadline one wait away: the wait spins"


@pytest.mark.parametrize("kind", ["system", "loop"])
def test_a_positive_wait_lasts_at_least_min_wait_and_longer_ones_are_untouched(
        kind: str) -> None:
    from tests.support.servers import virtual_loop

    async def waited(clock: Clock, seconds: float) -> float:
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(TimeoutError):
            await clock.wait_for(asyncio.Event().wait(), seconds)
        return loop.time() - start

    with virtual_loop() as loop:
        clock: Clock = SystemClock() if kind == "system" else LoopClock(loop)
        # On the virtual loop the time jumps to the timer: exactly the delay asyncio was given.
        assert loop.run_until_complete(waited(clock, 1e-12)) == pytest.approx(MIN_WAIT_S,
                                                                               rel=1e-3)
        assert loop.run_until_complete(waited(clock, 0.25)) == pytest.approx(0.25, rel=1e-9)
        assert timer_delay(0.0) == 0.0 and timer_delay(-1.0) == -1.0
