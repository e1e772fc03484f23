"""Static KV caches for the batched loop, plugged into the models' own forward passes.

Two caches, both ``transformers`` :class:`~transformers.Cache` subclasses that the Qwen3-TTS
attention layers call through ``past_key_values.update(key, value, layer_idx, kwargs)`` (the
one method the pinned qwen-tts 0.1.1 / transformers 4.57.3 layers use; tests/unit/tts/test_seam.py
pins that):

- :class:`RowKVCache`, the talker's: one row per turn, ``[rows, kv_heads, max_seq_len, head_dim]``
  per layer. Rows sit at different positions (each turn joined at its own time and has its own
  prompt length), so a decode step writes row ``r``'s new key at that row's own position
  (a scatter with a per-row index tensor, no host sync) and attends over the first
  ``kv_len`` positions of every row, the per-row attention mask hiding what lies beyond each
  row's own length. Rows ``[0, n)`` of the step are always a prefix of the cache: a view, no
  copy. The last position is a scratch slot: rows that sit a step out (and padding rows) write
  there, and no row ever attends to it.
- :class:`FrameKVCache`, the code predictor's: its 15-step loop restarts every codec frame, so
  all rows are at the same position; writes are slices at a Python offset the loop sets before
  each call, which is also what a CUDA graph needs (fixed addresses per unrolled step).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache


def _kv_shape(config: Any) -> tuple[int, int]:
    heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None)
                   or config.hidden_size // config.num_attention_heads)
    return heads, head_dim


class RowKVCache(Cache):
    """The talker's static KV cache with one row per turn and per-row write positions."""

    def __init__(self, config: Any, rows: int, max_seq_len: int, device: Any,
                 dtype: torch.dtype) -> None:
        super().__init__(layers=[])
        heads, head_dim = _kv_shape(config)
        self.rows = rows
        self.max_seq_len = max_seq_len
        #: The last position: written by rows that do not advance this step, never attended.
        self.scratch = max_seq_len - 1
        shape = (rows, heads, max_seq_len, head_dim)
        n_layers = int(config.num_hidden_layers)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        # Set by the step before each forward: the per-row write index (already expanded to the
        # scatter shape) and how many positions of each row attention reads.
        self._index: torch.Tensor | None = None
        self._kv_len = max_seq_len

    @property
    def bytes_per_row(self) -> int:
        k = self.keys[0]
        return 2 * len(self.keys) * k[0].numel() * k.element_size()

    def prepare(self, write_pos: torch.Tensor, kv_len: int) -> None:
        """Aim the next forward: row ``i`` of the batch writes at ``write_pos[i]``."""
        n = int(write_pos.shape[0])
        heads, head_dim = self.keys[0].shape[1], self.keys[0].shape[3]
        self._index = write_pos.view(n, 1, 1, 1).expand(n, heads, 1, head_dim)
        self._kv_len = kv_len

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_kwargs: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = key_states.shape[0]
        if key_states.shape[2] != 1 or self._index is None or self._index.shape[0] != n:
            raise RuntimeError("RowKVCache takes one-token decode steps aimed with prepare()")
        keys, values = self.keys[layer_idx][:n], self.values[layer_idx][:n]
        keys.scatter_(2, self._index, key_states)
        values.scatter_(2, self._index, value_states)
        return keys[:, :, : self._kv_len], values[:, :, : self._kv_len]

    def load_prefix(self, row: int, prefill: Any, source: int = 0,
                    length: int | None = None) -> int:
        """Copy row ``source`` of a prefill's ``DynamicCache`` into ``row`` at ``[0, n)``.

        ``n`` is ``length`` (a right-padded batch prefill: the positions past a row's own
        prompt are padding) or the whole cache.
        """
        n = 0
        for index, layer in enumerate(prefill.layers):
            k, v = layer.keys, layer.values  # [batch, heads, positions, head_dim]
            n = int(k.shape[2]) if length is None else length
            if n > self.scratch:
                raise ValueError(
                    f"prompt of {n} tokens does not fit a {self.max_seq_len}-position row"
                )
            self.keys[index][row, :, :n].copy_(k[source, :, :n])
            self.values[index][row, :, :n].copy_(v[source, :, :n])
        return n

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of row ``src`` into row ``dst`` (compaction)."""
        for keys, values in zip(self.keys, self.values, strict=True):
            keys[dst, :, :length].copy_(keys[src, :, :length])
            values[dst, :, :length].copy_(values[src, :, :length])

    # --- the rest of the Cache API the models may ask for --------------------------------------

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return 0

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.max_seq_len

    @property
    def is_compileable(self) -> bool:
        return True


class FrameKVCache(Cache):
    """The code predictor's static KV cache: every row at the same position, reset per frame."""

    def __init__(self, config: Any, rows: int, length: int, device: Any,
                 dtype: torch.dtype) -> None:
        super().__init__(layers=[])
        heads, head_dim = _kv_shape(config)
        shape = (rows, heads, length, head_dim)
        n_layers = int(config.num_hidden_layers)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        #: Where the next forward writes (set by the loop before each call; a Python int).
        self.offset = 0

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_kwargs: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, q = key_states.shape[0], key_states.shape[2]
        end = self.offset + q
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys[:n, :, self.offset : end] = key_states
        values[:n, :, self.offset : end] = value_states
        # Only the filled positions: no mask is needed (a 2-token prefill is causal, a decode
        # token sees everything before it).
        return keys[:n, :, :end], values[:n, :, :end]

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self.offset

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return int(self.keys[0].shape[2])

    @property
    def is_compileable(self) -> bool:
        return True
