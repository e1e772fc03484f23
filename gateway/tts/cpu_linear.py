"""The talker's linear layers on oneDNN with prepacked weights, on the CPU.

On the CPU every frame is almost all matrix products (86% of a batched step's time in
``torch.profiler``), and torch sends an fp32 ``nn.Linear`` to MKL's ``sgemm``. Its kernels for
a few rows are slow on AMD CPUs, and a few rows are exactly the shape of a step: one row per
live turn. oneDNN (bundled with torch as ``mkldnn``) with the weight reordered once into its
blocked layout is what torch's own compiler uses for CPU linears. One 0.6B talker layer's
seven products on the 2-core AMD EPYC the project measures on (``bench/cpu_linear.py``: 12
distinct layers in turn, so the weights come from memory; three runs):

=================  ==========================
rows               oneDNN prepacked vs MKL
=================  ==========================
1                  1.19-1.30x faster
8                  1.96-2.17x
16                 2.07-2.58x
70 (a prompt)      1.55-1.66x
560 (8 prompts)    1.26-1.44x
=================  ==========================

A whole batched step of 8 rows went from 1,030 to 490 ms, and the batched engine's frames per
second at 8 turns from 6.54 to 12.95 (``bench/batching.py``). The results agree with MKL's to
~1e-6 (relative). A row's result depends less on the rows beside it than on MKL, where it moves
by ~1e-6 with the row count: on this CPU (AVX-512) it is the same bits at 2 to 16 rows, and at
1 row too for layers of up to 1,024 inputs; a lone row through the 2,048- and 3,072-input
layers (``o_proj``, ``down_proj``) differs from the same row shared by ~1e-6, as on MKL. So a
turn's logits are the same whichever turns share its steps, and differ from its solo run only
in the last bits. Other instruction sets split sums differently (AVX2 was row-independent at
every shape the review tried, SSE4.1 at none).

:func:`install` swaps each large ``nn.Linear`` under a module for a :class:`PackedLinear`,
only for fp32 weights on the CPU and only where this torch build has the two ops. They are
private to torch's compiler, so this module is the only seam, ``pyproject.toml`` holds torch to
a range, and ``tests/unit/tts/test_seam.py`` fails if a build in it lacks them. CUDA keeps its own
kernels.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

#: The :class:`~gateway.tts.qwen.QwenModel` ``cpu_linear`` choices: this module's kernels, or
#: torch's default (MKL), kept for benchmarks that compare the two.
KERNELS = ("onednn", "mkl")

#: Layers with fewer weights (in x out) than this stay on torch's kernels: a oneDNN call costs
#: ~12 us more to set up, which smaller layers do not win back (measured at 1 and 8 rows: 32 x
#: 64 4.5 -> 16.6 us at 1 row, 256 x 512 (this size) 16.5 -> 21.9 us at 1 row and 36.5 -> 29.7
#: us at 8, 1024 x 1024 80 -> 52 us at 1 row and 346 -> 108 us at 8). Every layer of the
#: published talkers is far above it; of the tiny test checkpoint's only the output heads (64 x
#: 2048 and up) reach it, unless a test lowers it.
MIN_WEIGHTS = 1 << 17


def available() -> bool:
    """Whether this torch build can run :class:`PackedLinear`."""
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise"))


class PackedLinear(torch.nn.Module):
    """``nn.Linear`` over a weight reordered once for oneDNN (CPU, fp32).

    The reordered weight replaces the original (same size; once :func:`install` is done, no
    second copy). It is a plain attribute, not a parameter or buffer, so state dicts and
    parameter counts never see its opaque layout.
    """

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        # The bias stays a parameter: ordinary layout, and it keeps the module's dtype and
        # device discoverable where a layer has one.
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, kernel=onednn")


def packed_weights(module: torch.nn.Module) -> list[torch.Tensor]:
    """The reordered weights under ``module`` (plain attributes, so ``buffers()`` misses them)."""
    return [m.packed for m in module.modules() if isinstance(m, PackedLinear)]


def install(module: torch.nn.Module) -> int:
    """Replace every fp32 CPU ``nn.Linear`` under ``module`` with at least
    :data:`MIN_WEIGHTS` weights by a :class:`PackedLinear`.

    Returns how many were replaced: 0 where this build lacks the ops (logged) or no layer
    qualifies, so a caller can always call it.
    """
    if not available():
        log.warning("oneDNN linear ops are missing from this torch build: CPU linears stay on "
                    "torch's default kernels")
        return 0
    # Names first, then one swap at a time holding no other original, so each original weight
    # is freed as soon as its packed copy exists (holding them all to the end put 2.1 GiB of
    # packed copies beside every original of the 0.6B model: 7.0 GiB peak instead of the 5.9 it
    # has on MKL; now 5.9).
    targets = [(parent, name) for parent in module.modules()
               for name, child in parent.named_children() if _qualifies(child)]
    for parent, name in targets:
        setattr(parent, name, PackedLinear(getattr(parent, name)))
    swapped = len(targets)
    if swapped:
        _return_freed_memory()
    return swapped


def _qualifies(child: torch.nn.Module) -> bool:
    return (type(child) is torch.nn.Linear and child.weight.device.type == "cpu"
            and child.weight.dtype == torch.float32 and child.weight.numel() >= MIN_WEIGHTS)


def _return_freed_memory() -> None:
    """Hand the replaced weights' pages back to the OS.

    Each original weight is freed once its packed copy exists, but glibc keeps the freed pages
    in its heap: the 0.6B model's process stayed at 7.0 GiB resident instead of the 4.9 GiB it
    has on torch's default kernels, until ``malloc_trim`` (then 4.9 GiB). Elsewhere (musl,
    macOS) there is no such call, and nothing is done.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        trim = getattr(libc, "malloc_trim", None)
    except OSError:
        trim = None
    if trim is not None:
        trim(0)


def describe(model: Any) -> str:
    """The kernel a model's talker linears run on, for start-up logs and benchmark tables."""
    for mod in model.modules():
        if isinstance(mod, PackedLinear):
            return "onednn"
    return "default"
