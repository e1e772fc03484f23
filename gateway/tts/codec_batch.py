"""Batched incremental decoding of the 12 Hz codec: every row due a chunk in one call.

:class:`~gateway.tts.codec_stream.StreamingCodecDecoder` decodes one row at a time: each chunk
is ~800 operator calls (on a GPU, a kernel launch each) and ends with a copy to the host. At 64
rows about 13 are due a chunk per step: ~80 ms of host work per step, a whole frame's playback
budget, and a first-chunk burst of 64 rows costs 64 decodes in a row.

:class:`BatchedCodecDecoder` keeps every row's decoder state in static per-slot buffers (one
slot per engine row, stable for the row's life) and decodes all the rows due a chunk of the same
size in one call: the state of the rows in the call is gathered by slot index, the layers run
once over the stacked rows, the new state is scattered back. The state is what the incremental
decoder carries (see its module docstring):

- each causal ``Conv1d`` with left padding ``p``: the last ``p`` input samples, per slot;
- each causal ``ConvTranspose1d`` (kernel ``k``, stride ``s``): the ``k - s`` trimmed outputs
  added (overlap-add) to the next chunk's first outputs, per slot;
- the sliding-window transformer (window ``W``): the last ``W - 1`` keys and values of every
  layer, per slot, and the slot's position (RoPE continues per row). A new frame attends to the
  keys within the window that the slot has (a per-row mask over ``W - 1 + n`` keys).

The arithmetic is the incremental decoder's, row by row; the matrices have other shapes (several
rows, a fixed-length key window), so float32 sums may run in another order: each row's audio is
held within float tolerance of the per-row decode (tests/unit/tts/test_codec_batch.py).

A call reads and writes only static buffers given a static slot index, so on CUDA it is captured
as a graph per (chunk size, batch bucket) and replayed (through the capture stand-in in graph
mode on a CPU).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache

from gateway.tts.codec_stream import _module_classes

__all__ = ["BatchedCodecDecoder"]

#: Output samples per codec frame (24 kHz / 12.5 Hz).
SAMPLES_PER_FRAME = 1920


class _WindowCache(Cache):
    """The transformer's per-slot key/value window, gathered for the rows of one call."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        super().__init__(layers=[])
        self.keys = keys  # per layer [slots, heads, W - 1, head_dim]
        self.values = values
        self.index: torch.Tensor | None = None  # the call's slots

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.index is not None
        past_k = self.keys[layer_idx].index_select(0, self.index)
        past_v = self.values[layer_idx].index_select(0, self.index)
        keys = torch.cat((past_k, key_states), dim=2)
        values = torch.cat((past_v, value_states), dim=2)
        window = past_k.shape[2]
        self.keys[layer_idx].index_copy_(0, self.index, keys[:, :, -window:])
        self.values[layer_idx].index_copy_(0, self.index, values[:, :, -window:])
        return keys, values

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return 0

    @property
    def is_compileable(self) -> bool:
        return True


class BatchedCodecDecoder:
    """Decoder state for ``slots`` rows, and a batched incremental decode over them.

    ``decode(index, codes)`` decodes ``codes [rows, n, quantizers]`` for the slots in ``index``
    (``[rows]``, a long tensor on the device; slot ``slots`` is a scratch slot for padding rows)
    and returns ``[rows, n * 1920]`` float audio on the device. :meth:`reset` starts a slot's
    utterance over.
    """

    def __init__(self, decoder: Any, slots: int) -> None:
        self.decoder = decoder
        self.slots = slots
        self._classes = _module_classes()
        param = next(decoder.parameters())
        self.device, self.dtype = param.device, param.dtype
        self._conv: dict[int, torch.Tensor] = {}
        self._tail: dict[int, torch.Tensor] = {}
        self._allocate_layers(decoder)
        transformer = decoder.pre_transformer
        config = transformer.config
        self.window = int(config.sliding_window)
        heads = int(config.num_key_value_heads)
        head_dim = int(getattr(config, "head_dim", None)
                       or config.hidden_size // config.num_attention_heads)
        shape = (slots + 1, heads, self.window - 1, head_dim)
        layers = int(config.num_hidden_layers)
        self._cache = _WindowCache(
            [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(layers)],
            [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(layers)],
        )
        #: Frames decoded per slot (its next RoPE position and how much of its window is real).
        self.position = torch.zeros(slots + 1, dtype=torch.long, device=self.device)
        self._key_slot = torch.arange(self.window - 1, device=self.device)

    @property
    def scratch(self) -> int:
        """The slot padding rows decode into."""
        return self.slots

    def tensors(self) -> list[torch.Tensor]:
        """Every state buffer (graph mode's static set)."""
        return [*self._conv.values(), *self._tail.values(), *self._cache.keys,
                *self._cache.values, self.position, self._key_slot]

    @property
    def bytes_per_slot(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.tensors()[:-1])

    def reset(self, slot: int) -> None:
        """Forget ``slot``'s past: its next decode starts an utterance."""
        for state in (*self._conv.values(), *self._tail.values(), *self._cache.keys,
                      *self._cache.values):
            state[slot].zero_()
        self.position[slot] = 0

    # --- the decode -------------------------------------------------------------------------------

    @torch.inference_mode()
    def decode(self, index: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """Audio of ``codes [rows, n, K]`` for the slots ``index [rows]``: ``[rows, n * 1920]``."""
        dec = self.decoder
        rows, n = int(codes.shape[0]), int(codes.shape[1])
        codes = torch.clamp(codes, min=0).transpose(1, 2)  # [rows, K, n]
        hidden = dec.quantizer.decode(codes)
        hidden = self._conv_step(dec.pre_conv, hidden, index).transpose(1, 2)
        # Row r's new frames sit at positions position[r] .. position[r] + n - 1.
        start = self.position.index_select(0, index)
        steps = torch.arange(n, device=self.device)
        positions = start[:, None] + steps[None, :]  # [rows, n]
        self._cache.index = index
        out = dec.pre_transformer(
            inputs_embeds=hidden,
            attention_mask={"sliding_attention": self._window_mask(start, n),
                            "full_attention": None},
            position_ids=positions,
            past_key_values=self._cache,
            use_cache=True,
            cache_position=steps,
        )
        self._cache.index = None
        self.position.index_copy_(0, index, start + n)
        hidden = out.last_hidden_state.permute(0, 2, 1)
        for blocks in dec.upsample:
            for block in blocks:
                hidden = self._run(block, hidden, index)
        for block in dec.decoder:
            hidden = self._run(block, hidden, index)
        return hidden.clamp(min=-1, max=1).reshape(rows, -1)

    def _window_mask(self, start: torch.Tensor, n: int) -> torch.Tensor:
        """``[rows, 1, n, W - 1 + n]``: new frame ``t`` of a row sees the row's past keys in
        the window (``j >= t``, and only as many as it has decoded) and the new keys up to
        itself."""
        w1 = self.window - 1
        steps = torch.arange(n, device=self.device)
        have = torch.clamp(start, max=w1)  # past keys a row really has
        past = (self._key_slot[None, None, :] >= steps[None, :, None]) & (
            self._key_slot[None, None, :] >= (w1 - have)[:, None, None])
        # [n, n]: causal, and within the window (a long priming call has n > W).
        new = (steps[None, :] <= steps[:, None]) & (steps[:, None] - steps[None, :] < self.window)
        rows = start.shape[0]
        return torch.cat((past, new[None].expand(rows, n, n)), dim=2)[:, None]

    # --- layers -----------------------------------------------------------------------------------

    def _run(self, module: Any, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        c = self._classes
        if isinstance(module, c["conv"]):
            return self._conv_step(module, x, index)
        if isinstance(module, c["tconv"]):
            return self._tconv_step(module, x, index)
        if isinstance(module, c["convnext"]):
            y = self._conv_step(module.dwconv, x, index).permute(0, 2, 1)
            y = module.pwconv2(module.act(module.pwconv1(module.norm(y))))
            return x + (module.gamma * y).permute(0, 2, 1)
        if isinstance(module, c["residual"]):
            y = self._conv_step(module.conv1, module.act1(x), index)
            y = self._conv_step(module.conv2, module.act2(y), index)
            return y + x
        if isinstance(module, c["block"]):
            for sub in module.block:
                x = self._run(sub, x, index)
            return x
        if isinstance(module, c["snake"]):
            return module(x)
        raise TypeError(f"no streaming rule for codec layer {type(module).__name__}")

    def _conv_step(self, module: Any, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        state = self._conv.get(id(module))
        if state is None:
            return module.conv(x)
        pad = state.shape[-1]
        full = torch.cat((state.index_select(0, index), x), dim=-1)
        state.index_copy_(0, index, full[..., -pad:])
        return module.conv(full).contiguous()

    def _tconv_step(self, module: Any, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        conv = module.conv
        stride = conv.stride[0]
        y = F.conv_transpose1d(x, conv.weight, None, stride=stride)  # bias once, below
        n_out = x.shape[-1] * stride
        tail = self._tail.get(id(module))
        if tail is not None:
            overlap = tail.shape[-1]
            head = y[..., :overlap] + tail.index_select(0, index)
            tail.index_copy_(0, index, y[..., n_out:])
            y = torch.cat((head, y[..., overlap:n_out]), dim=-1)
        else:
            y = y[..., :n_out]
        if conv.bias is not None:
            y = y + conv.bias.view(1, -1, 1)
        return y.contiguous()

    # --- state layout -----------------------------------------------------------------------------

    def _allocate_layers(self, decoder: Any) -> None:
        """One state buffer per stateful layer, in the decoder's own modules."""
        c = self._classes
        slots = self.slots + 1

        def conv(module: Any) -> None:
            if module.stride != 1:
                raise ValueError("streaming decode supports stride-1 causal convolutions only")
            if module.padding > 0:
                self._conv[id(module)] = torch.zeros(
                    slots, module.conv.in_channels, module.padding, dtype=self.dtype,
                    device=self.device)

        def walk(module: Any) -> None:
            if isinstance(module, c["conv"]):
                conv(module)
            elif isinstance(module, c["tconv"]):
                t = module.conv
                trimmed = t.kernel_size[0] - t.stride[0]
                if trimmed > 0:
                    self._tail[id(module)] = torch.zeros(
                        slots, t.out_channels, trimmed, dtype=self.dtype, device=self.device)
            elif isinstance(module, c["convnext"]):
                conv(module.dwconv)
            elif isinstance(module, c["residual"]):
                conv(module.conv1)
                conv(module.conv2)
            elif isinstance(module, c["block"]):
                for sub in module.block:
                    walk(sub)

        conv(decoder.pre_conv)
        for blocks in decoder.upsample:
            for block in blocks:
                walk(block)
        for block in decoder.decoder:
            walk(block)

