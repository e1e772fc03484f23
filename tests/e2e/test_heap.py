"""The start-up heap is frozen out of full collections while a gateway runs (gateway/heap.py).

A full collection walks every tracked object, holding the GIL; with the model libraries loaded
that is ~0.3 s without any call's media moving. What the tests check is the mechanism (what a
full collection would walk); ``bench/gc_pause.py`` measures the pause itself.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Sequence

import pytest

from gateway import heap
from gateway.tts.engine import Engine
from gateway.tts.simulated import DeviceProfile, SimulatedEngine
from tests.support.servers import serve

#: A simulated device that takes no time: the gateway around it is what is under test.
_INSTANT = DeviceProfile(name="instant", device="none", model="none", source="a test",
                         step_base_ms=0.0)


def _engines(settings: object) -> Sequence[Engine]:
    return [SimulatedEngine(_INSTANT, max_rows=2)]


@pytest.fixture
def no_holders() -> Iterator[None]:
    """The holds of this process lifted for the test (a session's demo gateway may be up in
    this worker; holds are only counts), taken again after; the test must leave none."""
    lifted = heap.holders()
    for _ in range(lifted):
        heap.release()
    try:
        yield
        assert heap.holders() == 0
    finally:
        for _ in range(lifted):
            heap.hold()


def test_a_ready_gateway_holds_the_heap_frozen_and_lets_go_when_it_stops(no_holders: None,
                                                                         ) -> None:
    assert gc.get_freeze_count() == 0
    with serve({"greeting": "Hello."}, _engines) as live:
        assert live.gateway.readiness.ready
        assert heap.holders() == 1
        frozen = gc.get_freeze_count()
        # This process has torch, transformers and qwen_tts imported (~0.5 M objects): a full
        # collection now walks only what was made after start-up, a small part of that.
        walked = len(gc.get_objects())
        assert frozen > 100_000, frozen
        assert walked < frozen / 4, (walked, frozen)
    assert heap.holders() == 0
    assert gc.get_freeze_count() == 0  # handed back: a stopped gateway's cycles can be freed


def test_the_heap_stays_frozen_until_the_last_of_two_gateways_stops(no_holders: None) -> None:
    with serve({"greeting": "Hello."}, _engines):
        with serve({"greeting": "Hi."}, _engines):
            assert heap.holders() == 2
        assert heap.holders() == 1
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def test_only_the_first_hold_freezes_so_later_garbage_stays_collectable(no_holders: None,
                                                                         ) -> None:
    heap.hold()
    later = [[] for _ in range(1000)]  # made after the first hold, as a later gateway's are
    heap.hold()
    assert any(x is later[0] for x in gc.get_objects())  # still the collector's, not frozen
    heap.release()
    assert gc.get_freeze_count() > 0  # the first hold is still in force
    heap.release()
    assert gc.get_freeze_count() == 0


def test_a_release_without_a_hold_is_a_bug_that_says_so(no_holders: None) -> None:
    with pytest.raises(RuntimeError, match="without a hold"):
        heap.release()
    heap.hold()
    heap.release()
    assert gc.get_freeze_count() == 0
