"""Grouped-query attention under an attention mask, without copying key / value heads.

Qwen3-TTS's talker and code predictor use grouped-query attention (16 query heads over 8 key /
value heads in the published checkpoints). transformers' ``"sdpa"`` attention passes that to
``scaled_dot_product_attention(enable_gqa=True)`` only when no attention mask is given: on
CUDA, SDPA's fused kernels do not take a mask and GQA together, and it would fall back to the
math kernel. With a mask it first repeats every key and value head into new tensors
(``repeat_kv``), at every layer of every forward. The batched step always passes a mask (each
row attends to its own keys), so on a CPU that copy costs more than the attention itself:
8 rows over 128 positions, 1.18 ms a layer with the copy against 0.40 ms without; over 512
positions 28 ms against 3.1 ms (the copies are fresh 33 MB tensors), and bit-identical output.
SDPA's CPU flash kernel takes the mask and GQA together: on the CPU this module passes
``enable_gqa=True``.

On CUDA the same copy is worse, because the batched step reads every row's keys each frame.
Per layer and step the attention must read ``K`` and ``V`` once: ``2 * rows * kv_heads *
positions * head_dim * bytes``; ``repeat_kv`` also reads them to write ``groups`` copies, which
SDPA then reads, five times the traffic with two groups. For the 0.6B talker (28 layers, 8 key
/ value heads of 128, bf16) at 64 rows over 256 positions: 1.9 GB a step without the copy,
9.4 GB with it (the copy alone 5.6 GB: 0.4 ms against 2.0 ms at the H200's 4.8 TB/s); over
2,048 positions 15 GB against 75 GB. Instead of relying on which fused CUDA kernel takes GQA
and a mask together, :func:`folded_gqa_attention` folds each key / value head's query heads
into the query-length axis (``[rows, kv_heads, groups * q_len, head_dim]``) and runs plain
multi-head SDPA over the unrepeated keys; the mask broadcasts over the fold (a view for the
one-token decode step; a small copy of the mask, never of keys, for a prefill). Each query
head still attends to exactly its own key / value head: the same sums, so the output equals
the library's within float tolerance (tests/unit/tts/test_attention.py checks it on the CPU).

:func:`install` registers ``"sdpa_gqa"`` through transformers' ``AttentionInterface`` (its
extension point for attention functions), with SDPA's mask builder for it, and switches a
loaded model's ``"sdpa"`` configs to it, on every device.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

#: The attention implementation's registered name.
NAME = "sdpa_gqa"
#: Devices where grouped-query heads are folded into the query axis (elsewhere SDPA is given
#: ``enable_gqa``: the CPU's flash kernel takes a mask and GQA together, measured above).
FOLD_DEVICES = frozenset({"cuda"})


def folded_gqa_attention(query: Any, key: Any, value: Any, attention_mask: Any,
                         dropout: float = 0.0, scaling: float | None = None) -> Any:
    """Masked SDPA of ``query [b, hq, lq, d]`` over ``key``/``value`` ``[b, hkv, lk, d]``
    (``hq`` a multiple of ``hkv``) with no copy of the key / value heads.

    Query head ``h`` attends to key / value head ``h // (hq // hkv)``, as ``repeat_kv``
    arranges it. ``attention_mask`` is ``[b, 1 or hq, lq, lk]`` (bool or additive). Returns
    ``[b, lq, hq, d]``, as transformers' attention functions do.
    """
    b, hq, lq, d = query.shape
    hkv = key.shape[1]
    groups = hq // hkv
    folded = query.reshape(b, hkv, groups * lq, d)
    lk = attention_mask.shape[-1]
    if attention_mask.shape[1] == 1:
        mask = attention_mask[:, :, None].expand(b, 1, groups, lq, lk)
        mask = mask.reshape(b, 1, groups * lq, lk)
    else:
        mask = attention_mask.reshape(b, hkv, groups * lq, lk)
    out = torch.nn.functional.scaled_dot_product_attention(
        folded, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
    )
    return out.reshape(b, hq, lq, d).transpose(1, 2).contiguous()


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
    if query.device.type in FOLD_DEVICES and attention_mask.ndim == 4:
        return folded_gqa_attention(query, key, value, attention_mask, dropout, scaling), None
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
