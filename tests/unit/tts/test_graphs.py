"""The CUDA-graph capture stand-in: it refuses what capture refuses and replays like a graph.

Each refusal is a thing that breaks a real CUDA graph (a sync, a data-dependent shape, host
data or host buffers inside the region, a tensor the graph would read after it was freed);
each replay property is one a real graph has (results only after replay, Python values baked
in at capture, nothing allocated anew).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from gateway.tts.graphs import EagerReplay, GraphCaptureError, StandInGraph, capture


@pytest.fixture(autouse=True)
def _inference() -> object:
    with torch.inference_mode():
        yield


def _buffers() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.arange(6, dtype=torch.float32)
    w = torch.full((6,), 2.0)
    out = torch.zeros(6)
    return x, w, out


def _graph(step: Callable[[], None], *static: torch.Tensor,
           host: tuple[torch.Tensor, ...] = ()) -> StandInGraph:
    graph = capture(step, "cpu", warmup=1, static=static, host=host)
    assert isinstance(graph, StandInGraph)
    return graph


def test_replay_recomputes_from_the_static_buffers_in_place() -> None:
    x, w, out = _buffers()

    def step() -> None:
        y = torch.softmax(x * w, dim=0)  # intermediates: the graph's own memory
        out.copy_(y.cumsum(0))

    graph = _graph(step, x, w, out)
    x.copy_(torch.linspace(-1, 1, 6))
    graph.replay()
    assert torch.allclose(out, torch.softmax(x * w, dim=0).cumsum(0))
    x.fill_(3.0)
    graph.replay()
    assert torch.allclose(out, torch.arange(1, 7) / 6)
    assert graph.replays == 2 and graph.ops >= 3


def test_capture_does_not_run_the_step_and_its_own_memory_is_garbage_until_replay() -> None:
    """As on CUDA: capture launches nothing, so code reading results before a replay fails."""
    x, w, out = _buffers()
    kept: list[torch.Tensor] = []
    calls = []

    def step() -> None:
        calls.append(1)
        y = x + w
        kept.append(y)
        out.copy_(y)

    graph = _graph(step, x, w, out)
    assert len(calls) == 2  # one warm-up, one capture
    # The warm-up ran for real; the capture's write was undone; its intermediate is garbage.
    assert torch.equal(out, x + w)
    out.zero_()
    graph.replay()
    assert torch.equal(out, x + w)
    assert torch.equal(kept[-1], x + w)  # refreshed by the replay


def test_capture_undoes_its_writes_to_static_buffers() -> None:
    x, _w, _out = _buffers()
    counter = torch.zeros(1, dtype=torch.long)

    def step() -> None:
        counter.add_(1)
        x.mul_(2)

    graph = capture(step, "cpu", warmup=0, static=(x, counter))
    assert int(counter[0]) == 0 and torch.equal(x, torch.arange(6.0))
    graph.replay()
    graph.replay()
    assert int(counter[0]) == 2 and torch.equal(x, torch.arange(6.0) * 4)


def test_python_values_are_baked_in_at_capture() -> None:
    """A region that reads a Python value which changes later replays the captured one: the
    reason the engine keys its graphs by every shape and offset it bakes."""
    x, _w, out = _buffers()
    state = {"offset": 1}

    def step() -> None:
        out.copy_(x + state["offset"])

    graph = _graph(step, x, out)
    state["offset"] = 100
    graph.replay()
    assert torch.equal(out, x + 1)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (lambda x: x.sum().item(), "on the host"),
        (lambda x: x.tolist(), "tolist"),
        (lambda x: x.numpy(), "numpy"),
        (lambda x: x.cpu(), r"\.cpu\(\)"),
        (lambda x: bool(x[0] > 0), "truth value"),
        (lambda x: int(x[1]), "on the host"),
        (lambda x: torch.nonzero(x), "data-dependent"),
        (lambda x: x[x > 2], "boolean mask"),
        (lambda x: torch.masked_select(x, x > 2), "data-dependent"),
        (lambda x: torch.unique(x), "unique"),
        (lambda x: torch.equal(x, x), "torch.equal"),
        (lambda x: x + torch.tensor([1.0] * 6), "host data"),
        (lambda x: x[[0, 1]], "host data"),
        (lambda x: x.repeat_interleave(x.long()), "repeat_interleave"),
    ],
    ids=["item", "tolist", "numpy", "cpu", "bool", "int", "nonzero", "bool-index",
         "masked_select", "unique", "equal", "torch.tensor", "list-index", "repeat_interleave"],
)
def test_capture_refuses_host_syncs_and_data_dependent_shapes(
    body: Callable[[torch.Tensor], object], message: str
) -> None:
    x, _w, _out = _buffers()
    with pytest.raises(GraphCaptureError, match=message):
        _graph(lambda: body(x), x)


def test_capture_refuses_a_tensor_that_is_not_a_static_buffer() -> None:
    """A tensor made outside the region and not kept by the engine: a graph reads it by address
    on every replay, after it was freed."""
    x, _w, out = _buffers()
    fresh = torch.ones(6)
    with pytest.raises(GraphCaptureError, match="neither a static buffer"):
        _graph(lambda: out.copy_(x + fresh), x, out)
    # Scalars are kernel arguments, baked in: allowed.
    _graph(lambda: out.copy_(x * torch.tensor(3.0).squeeze()), x, out)


def test_capture_refuses_host_staging_buffers_inside_the_region() -> None:
    x, _w, out = _buffers()
    staging = torch.zeros(6)
    with pytest.raises(GraphCaptureError, match="host staging buffer"):
        _graph(lambda: out.copy_(staging), x, out, host=(staging,))


def test_capture_refuses_a_device_change() -> None:
    x, _w, out = _buffers()
    with pytest.raises(GraphCaptureError, match="moves a tensor"):
        _graph(lambda: x.to("meta"), x, out)


def test_graphs_off_runs_the_step_eagerly() -> None:
    x, w, out = _buffers()
    graph = capture(lambda: out.copy_(x + w), "cpu", graphs=False)
    assert isinstance(graph, EagerReplay)
    graph.replay()
    assert torch.equal(out, x + w)
