"""Grouped-query attention left to SDPA under an attention mask, on the CPU.

Qwen3-TTS's talker and code predictor use grouped-query attention (16 query heads over 8 key /
value heads in the published checkpoints). transformers' ``"sdpa"`` attention passes that to
``scaled_dot_product_attention(enable_gqa=True)`` only when no attention mask is given: on
CUDA, SDPA's fused kernels do not take a mask and GQA together, and it would fall back to the
math kernel. With a mask it first repeats every key and value head into new tensors
(``repeat_kv``), at every layer of every forward. The batched step always passes a mask (each
row attends to its own keys), so on a CPU that copy costs more than the attention itself:
8 rows over 128 positions, 1.18 ms a layer with the copy against 0.40 ms without; over 512
positions 28 ms against 3.1 ms (the copies are fresh 33 MB tensors), and bit-identical output.
SDPA's CPU flash kernel takes the mask and GQA together.

:func:`install` registers ``"sdpa_gqa"`` through transformers' ``AttentionInterface`` (its
extension point for attention functions), with SDPA's mask builder for it, and switches a
loaded model's ``"sdpa"`` configs to it. Only on the CPU: CUDA keeps the library's choice.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

#: The attention implementation's registered name.
NAME = "sdpa_gqa"


def sdpa_gqa_attention_forward(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Any, None]:
    """transformers' SDPA attention, with the key / value heads never repeated by hand.

    It runs at every layer of every forward: its imports live at module level (this module
    is imported only once a model is loaded on the CPU)."""
    groups = getattr(module, "num_key_value_groups", 1)
    if (attention_mask is None or groups == 1 or kwargs.get("output_attentions")
            or kwargs.get("head_mask") is not None):
        # No copy to save (no mask: the library passes enable_gqa itself), or a case the
        # library handles its own way.
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, is_causal=is_causal,
                                      **kwargs)
    if attention_mask.ndim == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    # With a mask the library's SDPA path is never causal: the mask says it all.
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
        enable_gqa=True,
    )
    return out.transpose(1, 2).contiguous(), None


def install(model: Any) -> int:
    """Use :data:`NAME` wherever ``model``'s modules were loaded with ``"sdpa"``.

    Returns how many configs were switched (the talker's and the code predictor's; the
    codec's too if it uses SDPA).
    """
    AttentionInterface.register(NAME, sdpa_gqa_attention_forward)
    # The masks it takes are SDPA's. Unregistered, the library would build no mask at all
    # for this name (it takes an unknown one for a backend that needs none).
    AttentionMaskInterface.register(NAME, sdpa_mask)
    switched: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None or id(config) in switched:
            continue
        if getattr(config, "_attn_implementation", None) == "sdpa":
            config._attn_implementation = NAME
            switched[id(config)] = config
    return len(switched)
