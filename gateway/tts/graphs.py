"""CUDA graph capture, and a stand-in that behaves like it on the CPU.

The batched step (and anything else the engine captures) runs as a CUDA graph on a GPU. Code
that only a GPU runs would otherwise never run in the CPU tests, so graph mode has a CPU
stand-in, :class:`StandInGraph`, that holds the region to the rules capture holds it to:

- **Warm-up first.** ``warmup`` eager runs of the step, as CUDA needs before capture (lazy
  initialisation, cuBLAS workspaces) and as the caller must make harmless.
- **Capture refuses what CUDA capture refuses** (:class:`GraphCaptureError`): host syncs
  (``.item()``, ``.tolist()``, ``.numpy()``, ``.cpu()``, ``bool(tensor)``, ``nonzero``,
  ``torch.equal``), data-dependent shapes (``masked_select``, ``unique``, boolean-mask
  indexing, ``repeat_interleave`` by a tensor), tensors built from host data inside the region
  (``torch.tensor(...)``, indexing with a Python list: a pageable host-to-device copy), ops on
  another device, host tensors read inside the region (on CUDA that op would run once, at
  capture, and never again), and tensors that are neither a registered static buffer nor made
  inside the region (a fresh allocation the graph would read by address after it was freed).
- **Capture does not run the step.** As on CUDA, the static buffers the region writes are put
  back as they were before capture, and every tensor the region made holds garbage (NaN,
  a sentinel integer) until the first replay: code that reads results without replaying fails.
- **Replay runs only through the static buffers.** The region is recorded as the list of
  operators it dispatched, with the tensors they read and wrote; replay runs that list again
  on the same tensors. Python values (a batch size, an offset, a branch taken) are baked in at
  capture, exactly as in a CUDA graph: a region that depends on one that changes between
  replays gives the wrong answer here too.

The stand-in is slower than eager execution (every operator re-dispatched and its result copied
into its recorded output), so it is for tests and dry runs, and selected only explicitly
(``cuda_graphs=True`` on a CPU engine, ``GATEWAY_CUDA_GRAPHS=on`` on a CPU gateway); it logs
that it is in use.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gateway.errors import EngineError

log = logging.getLogger(__name__)

__all__ = [
    "DeviceEvent",
    "EagerReplay",
    "GraphCaptureError",
    "StandInGraph",
    "capture",
]


class GraphCaptureError(EngineError):
    """The captured region did something a CUDA graph cannot hold (the message says what)."""


class EagerReplay:
    """Graphs off: ``replay()`` runs the step eagerly."""

    def __init__(self, step: Callable[[], None]) -> None:
        self._step = step

    def replay(self) -> None:
        self._step()


class DeviceEvent:
    """``torch.cuda.Event`` on CUDA; on the CPU the device's work is done when the op returns."""

    def __init__(self, on_cuda: bool) -> None:
        self._event = torch.cuda.Event() if on_cuda else None

    def record(self) -> None:
        if self._event is not None:
            self._event.record()

    def synchronize(self) -> None:
        if self._event is not None:
            self._event.synchronize()


def capture(
    step: Callable[[], None],
    device: Any,
    pool: Any = None,
    warmup: int = 2,
    *,
    graphs: bool = True,
    static: Iterable[torch.Tensor] = (),
    host: Iterable[torch.Tensor] = (),
) -> Any:
    """The graph-capture seam: something with ``replay()`` that runs ``step``.

    ``step`` must read and write static buffers only. With ``graphs`` on CUDA it is captured
    as a ``torch.cuda.CUDAGraph`` (warm-ups on a side stream, as capture requires; the caller
    makes them harmless); with ``graphs`` elsewhere as a :class:`StandInGraph`, checked
    against ``static`` (the buffers it may read and write: parameters, caches, state) and
    ``host`` (host staging buffers it must not touch); without ``graphs`` it runs eagerly.
    """
    if not graphs:
        return EagerReplay(step)
    if str(device).startswith("cuda"):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            step()
        torch.cuda.synchronize()
        return graph
    for _ in range(warmup):
        step()
    return StandInGraph.record(step, device=torch.device(device), static=static, host=host)


# --- the stand-in ---------------------------------------------------------------------------------

_aten = torch.ops.aten

#: Operators that read a tensor's value on the host: a device-to-host sync.
_SYNCS = {
    _aten.item.default: "reads a tensor's value on the host (.item(), int(), float())",
    _aten._local_scalar_dense.default: "reads a tensor's value on the host",
    _aten.is_nonzero.default: "reads a tensor's truth value on the host (bool(tensor), if t:)",
    _aten.equal.default: "compares tensors on the host (torch.equal)",
    _aten.allclose.default: "compares tensors on the host (torch.allclose)",
    _aten.nonzero.default: "has a data-dependent shape and syncs (nonzero / argwhere)",
    _aten.masked_select.default: "has a data-dependent shape (masked_select)",
    _aten._unique2.default: "has a data-dependent shape (unique)",
    _aten.unique_dim.default: "has a data-dependent shape (unique)",
    _aten.unique_consecutive.default: "has a data-dependent shape (unique_consecutive)",
    _aten.repeat_interleave.Tensor: "has a data-dependent shape (repeat_interleave by a tensor)",
    _aten.repeat_interleave.self_Tensor: (
        "has a data-dependent shape (repeat_interleave by a tensor)"
    ),
    _aten._pin_memory.default: "pins host memory inside the region",
}

#: Tensors built from host data inside the region (``torch.tensor(...)``, indexing with a Python
#: list): on CUDA a pageable host-to-device copy, which capture refuses. A 0-dim one is a
#: scalar, passed to kernels by value, and allowed.
_LIFTS = {_aten.lift_fresh.default, _aten.lift_fresh_copy.default}

#: Tensor methods that leave the device (seen before they dispatch, by name).
_HOST_METHODS = {
    "item": "reads a tensor's value on the host (.item())",
    "tolist": "copies a tensor to the host (.tolist())",
    "numpy": "copies a tensor to the host (.numpy())",
    "cpu": "copies a tensor to the host (.cpu())",
    "cuda": "moves a tensor between devices (.cuda())",
    "__array__": "copies a tensor to the host (numpy conversion)",
}

#: Operators that only read metadata (sizes, strides): no sync, allowed whatever they return.
_METADATA = {
    _aten.is_same_size.default,
    _aten.sym_size.int,
    _aten.sym_stride.int,
    _aten.sym_numel.default,
    _aten.sym_storage_offset.default,
    _aten.is_contiguous.default,
    _aten.is_contiguous.memory_format,
}


def _storage(tensor: torch.Tensor) -> int:
    """The identity of the memory under ``tensor`` (an opaque oneDNN weight: the tensor's)."""
    if tensor.is_mkldnn or tensor.layout != torch.strided:
        return id(tensor)
    return tensor.untyped_storage().data_ptr()


def _writes(func: Any) -> list[int]:
    """Positions of the arguments ``func`` writes (in-place ops, ``out=`` variants)."""
    return [i for i, arg in enumerate(func._schema.arguments)
            if arg.alias_info is not None and arg.alias_info.is_write]


def _is_view(func: Any) -> bool:
    """A view op: its output aliases an input and it writes nothing."""
    returns = func._schema.returns
    return (bool(returns) and returns[0].alias_info is not None
            and not returns[0].alias_info.is_write and not _writes(func))


class _Op:
    """One recorded operator: what it ran on and where its results went."""

    __slots__ = ("args", "func", "kind", "kwargs", "outs")

    def __init__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                 outs: list[torch.Tensor], kind: str) -> None:
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.outs = outs
        self.kind = kind

    def run(self) -> None:
        result = self.func(*self.args, **self.kwargs)
        if self.kind == "inplace":
            return
        fresh, _ = tree_flatten(result)
        for recorded, new in zip(self.outs, (t for t in fresh if isinstance(t, torch.Tensor)),
                                 strict=True):
            if recorded.shape != new.shape:
                raise GraphCaptureError(
                    f"{self.func} gave shape {tuple(new.shape)} on replay, "
                    f"{tuple(recorded.shape)} at capture: a data-dependent shape"
                )
            recorded.copy_(new)


class _Methods(TorchFunctionMode):
    """Refuses the tensor methods that leave the device (they never reach the dispatcher)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in _HOST_METHODS:
            raise GraphCaptureError(f"the captured region {_HOST_METHODS[name]}")
        return func(*args, **(kwargs or {}))


class _Recorder(TorchDispatchMode):
    """Records a region's operators and refuses what a CUDA graph cannot hold."""

    def __init__(self, device: torch.device, static: set[int], host: set[int]) -> None:
        super().__init__()
        self.device = device
        self.static = static
        self.host = host
        self.ops: list[_Op] = []
        #: Storages the region made (held alive, like a graph's private memory pool).
        self.made: dict[int, torch.Tensor] = {}
        #: Static tensors the region wrote, with their contents before capture.
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _check_input(self, func: Any, tensor: torch.Tensor) -> None:
        if tensor.device.type != self.device.type:
            raise GraphCaptureError(
                f"{func} reads a tensor on {tensor.device} in a region captured on {self.device}"
            )
        ptr = _storage(tensor)
        if ptr in self.made or ptr in self.static or ptr == 0:
            return
        if ptr in self.host:
            raise GraphCaptureError(
                f"{func} reads a host staging buffer inside the region: on CUDA that op would "
                "run once, at capture, and never on replay (copy it to a device buffer before "
                "replaying)"
            )
        if tensor.dim() == 0 and tensor.device.type == "cpu":
            return  # a scalar constant, baked into the graph as a kernel argument
        raise GraphCaptureError(
            f"{func} reads a tensor {tuple(tensor.shape)} {tensor.dtype} that is neither a "
            "static buffer nor made inside the region: the graph would read it by address "
            "on every replay, after it was freed (allocate it once with the engine's buffers)"
        )

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        reason = _SYNCS.get(func)
        if reason is not None:
            raise GraphCaptureError(f"the captured region {reason} ({func})")
        if func in _METADATA:
            return func(*args, **kwargs)
        if func in _LIFTS and args[0].dim() > 0:
            raise GraphCaptureError(
                "the captured region builds a tensor from host data (torch.tensor(...), or "
                "indexing with a Python list): on CUDA a pageable host-to-device copy, which "
                "capture refuses; build it once as a static buffer"
            )
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        for tensor in tensors:
            self._check_input(func, tensor)
        if func in (_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default):
            indices = args[1]
            if any(i is not None and i.dtype == torch.bool for i in indices):
                raise GraphCaptureError(
                    f"the captured region indexes with a boolean mask ({func}): a "
                    "data-dependent shape; use torch.where"
                )
        for position, argument in enumerate(func._schema.arguments):
            if argument.name != "device":
                continue
            device = args[position] if position < len(args) else kwargs.get("device")
            if device is not None and torch.device(device).type != self.device.type:
                raise GraphCaptureError(f"{func} moves a tensor to {device} inside the region")
        written = _writes(func)
        for position in written:
            target = args[position] if position < len(args) else None
            if isinstance(target, torch.Tensor):
                ptr = _storage(target)
                if ptr not in self.made and ptr not in self.saved:
                    base = _base(target)
                    self.saved[ptr] = (base, base.clone())
        out = func(*args, **kwargs)
        flat_out = [x for x in tree_flatten(out)[0] if x is not None]
        outs = [t for t in flat_out if isinstance(t, torch.Tensor)]
        values = [x for x in flat_out if isinstance(x, bool | float | complex)]
        if values:
            raise GraphCaptureError(
                f"the captured region reads a value on the host ({func} returns "
                f"{type(values[0]).__name__})"
            )
        inputs = {_storage(t) for t in tensors}
        if written:
            kind = "inplace"
        elif outs and all(_storage(t) in inputs for t in outs) and _is_view(func):
            # A view of what it was given: it aliases memory that is refreshed in place.
            kind = "view"
        else:
            # Computed anew (``to``/``reshape``/``contiguous`` that had to copy included):
            # replay recomputes it into the same memory.
            kind = "functional"
            for tensor in outs:
                ptr = _storage(tensor)
                if ptr not in inputs:
                    self.made.setdefault(ptr, tensor)
        if kind != "view":
            self.ops.append(_Op(func, args, kwargs, outs, kind))
        return out


def _base(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor over ``tensor``'s storage (a view of a buffer saves the buffer)."""
    storage = tensor.untyped_storage()
    whole = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return whole.set_(storage, 0, (storage.nbytes(),), (1,))


def _poison(tensor: torch.Tensor) -> None:
    """What a CUDA graph's memory holds before the first replay: not the result."""
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.fill_(float("nan"))
    elif tensor.dtype == torch.bool:
        tensor.fill_(True)
    else:
        tensor.fill_(-(2**30) if tensor.dtype != torch.uint8 else 0xA5)


class StandInGraph:
    """A recorded region that replays through its static buffers (see the module docstring)."""

    def __init__(self, ops: list[_Op], made: dict[int, torch.Tensor]) -> None:
        self._ops = ops
        self._made = made  # the region's private memory, held as a graph's pool is
        self.replays = 0

    @property
    def ops(self) -> int:
        """Operators recorded (the kernels a CUDA graph of the region would launch, roughly)."""
        return len(self._ops)

    @classmethod
    def record(cls, step: Callable[[], None], device: torch.device,
               static: Iterable[torch.Tensor], host: Iterable[torch.Tensor] = ()) -> StandInGraph:
        """Record ``step`` (after its warm-ups), refusing what capture refuses."""
        recorder = _Recorder(device, {_storage(t) for t in static},
                             {_storage(t) for t in host})
        with torch.inference_mode(), _Methods(), recorder:
            step()
        with torch.inference_mode():
            # Capture launches nothing: what the region wrote to static buffers is undone and
            # what it made is garbage until the first replay.
            for base, before in recorder.saved.values():
                base.copy_(before)
            for tensor in recorder.made.values():
                _poison(tensor)
        return cls(recorder.ops, recorder.made)

    def replay(self) -> None:
        with torch.inference_mode():
            for op in self._ops:
                op.run()
        self.replays += 1
