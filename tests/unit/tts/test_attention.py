"""Masked grouped-query attention without repeated key / value heads (gateway/tts/attention.py).

The tiny checkpoint has the published architecture's grouped-query attention (4 query heads
over 2 key / value heads), so the real talker and code predictor run through it on the CPU.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers.integrations import sdpa_attention
from transformers.masking_utils import create_causal_mask

from gateway.tts import attention
from gateway.tts.batched import BatchedQwenEngine
from gateway.tts.engine import Sampling, SpeechRequest
from gateway.tts.qwen import QwenModel


@pytest.fixture(scope="module")
def shared(tiny_model_dir: Path) -> QwenModel:
    return QwenModel(str(tiny_model_dir), device="cpu")


def _configs(shared: QwenModel) -> list[object]:
    talker = shared.base.model.talker
    return [shared.base.model.config, talker.config, talker.code_predictor.config]


def test_a_cpu_model_attends_through_sdpa_gqa(shared: QwenModel) -> None:
    assert [c._attn_implementation for c in _configs(shared)] == [attention.NAME] * 3  # type: ignore[attr-defined]
    layer = shared.base.model.talker.model.layers[0].self_attn
    assert layer.num_key_value_groups > 1, "the tiny checkpoint must have grouped-query attention"


class _Module:
    num_key_value_groups = 2
    training = False


def test_masked_attention_equals_the_librarys_without_repeating_heads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    g = torch.Generator().manual_seed(3)
    query = torch.randn(8, 4, 1, 16, generator=g)
    key = torch.randn(8, 2, 40, 16, generator=g)
    value = torch.randn(8, 2, 40, 16, generator=g)
    lengths = torch.arange(8) * 5 + 1
    mask = (torch.arange(40)[None, :] < lengths[:, None])[:, None, None, :]
    expected, _ = sdpa_attention.sdpa_attention_forward(_Module(), query, key, value, mask,
                                                        scaling=0.25)

    def no_copy(*_args: object) -> None:
        raise AssertionError("key / value heads repeated")

    monkeypatch.setattr(sdpa_attention, "repeat_kv", no_copy)
    got, weights = attention.sdpa_gqa_attention_forward(_Module(), query, key, value, mask,
                                                        scaling=0.25)
    assert weights is None and got.shape == expected.shape == (8, 1, 4, 16)
    assert torch.allclose(got, expected, rtol=0, atol=1e-6 * float(expected.abs().max()))
    # Unmasked, the library passes GQA to SDPA itself: ours hands the call to it unchanged.
    unmasked, _ = attention.sdpa_gqa_attention_forward(_Module(), query, key, value, None)
    assert unmasked.shape == (8, 1, 4, 16)


@pytest.mark.parametrize("q_len", [1, 7], ids=["decode", "prefill"])
@pytest.mark.parametrize("kind", ["bool", "additive", "per-head"])
def test_folded_attention_equals_the_librarys_without_repeating_heads(
    monkeypatch: pytest.MonkeyPatch, q_len: int, kind: str,
) -> None:
    """The CUDA path, called on the CPU: query heads folded into the query axis over the
    unrepeated keys give the library's repeat-then-attend output, for the one-token step
    (the mask a broadcast view) and a causal multi-token prefill (the mask copied, not K/V)."""
    g = torch.Generator().manual_seed(5)
    rows, hq, hkv, lk, d = 6, 8, 2, 48, 16
    query = torch.randn(rows, q_len, hq, d, generator=g).transpose(1, 2)  # as the layers make it
    key = torch.randn(rows, hkv, lk, d, generator=g)
    value = torch.randn(rows, hkv, lk, d, generator=g)
    lengths = torch.arange(rows) * 7 + q_len
    keys = torch.arange(lk)
    # Row r's query t sits at position lengths[r] - q_len + t and sees keys up to it.
    at = lengths[:, None] - q_len + torch.arange(q_len)[None, :]
    mask = (keys[None, None, :] <= at[:, :, None])[:, None]  # [rows, 1, q_len, lk]
    if kind == "additive":
        mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    elif kind == "per-head":
        mask = mask.expand(rows, hq, q_len, lk).clone()
        mask[:, 1::2, :, :3] = False  # heads differ: the fold must keep each head's own row
        mask[:, :, :, 0] = True
    module = _Module()
    module.num_key_value_groups = hq // hkv
    expected, _ = sdpa_attention.sdpa_attention_forward(module, query, key, value, mask,
                                                        scaling=0.3)

    def no_copy(*_args: object) -> None:
        raise AssertionError("key / value heads repeated")

    monkeypatch.setattr(sdpa_attention, "repeat_kv", no_copy)
    got = attention.folded_gqa_attention(query, key, value, mask, scaling=0.3)
    assert got.shape == expected.shape == (rows, q_len, hq, d)
    assert torch.allclose(got, expected, rtol=0, atol=1e-5 * float(expected.abs().max()))
    # The registered function takes the fold on the devices listed for it.
    monkeypatch.setattr(attention, "FOLD_DEVICES", frozenset({"cpu"}))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls: list[dict[str, object]] = []

    def spy(*args: object, **kwargs: object) -> object:
        calls.append(kwargs)
        return sdpa(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    routed, _ = attention.sdpa_gqa_attention_forward(module, query, key, value, mask,
                                                     scaling=0.3)
    assert torch.equal(routed, got) and calls and "enable_gqa" not in calls[0]


def test_the_library_builds_the_same_masks_for_it_as_for_sdpa(shared: QwenModel) -> None:
    """Registered without SDPA's mask builder, the library would build no mask for the name
    (it takes an unknown name for a backend that needs none): a padded prompt would attend
    to its padding, and faster-qwen3-tts's per-position mask table would be empty."""
    config = copy.deepcopy(shared.base.model.talker.config)  # the setter recurses into sub-configs
    assert config._attn_implementation == attention.NAME
    embeds = torch.zeros(2, 5, 8)
    padding = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    masks = []
    for name in (attention.NAME, "sdpa"):
        config._attn_implementation = name
        masks.append(create_causal_mask(config=config, input_embeds=embeds,
                                        attention_mask=padding,
                                        cache_position=torch.arange(5), past_key_values=None))
    ours, library = masks
    assert isinstance(ours, torch.Tensor) and torch.equal(ours, library)


@pytest.fixture
def plain_sdpa(shared: QwenModel) -> Iterator[None]:
    configs = _configs(shared)
    for config in configs:
        config._attn_implementation = "sdpa"  # type: ignore[attr-defined]
    yield
    for config in configs:
        config._attn_implementation = attention.NAME  # type: ignore[attr-defined]


def _batched_codes(shared: QwenModel) -> list[torch.Tensor]:
    engine = BatchedQwenEngine(shared, max_rows=4, record_codes=True, trim_leading_silence=False)
    rows = [engine.open(SpeechRequest(text=text, seed=i, max_frames=6, min_frames=6,
                                      sampling=Sampling.greedy()))
            for i, text in enumerate(["Press one.", "Your balance is ten dollars.", "Hi."])]
    engine.prefill_rows(rows)
    while live := [row for row in rows if row.finished is None]:
        engine.step(live)
    return [torch.stack(row.codes) for row in rows]


def test_the_batched_step_gives_the_same_codes_as_with_the_librarys_sdpa(
    shared: QwenModel, request: pytest.FixtureRequest
) -> None:
    ours = _batched_codes(shared)
    request.getfixturevalue("plain_sdpa")
    library = _batched_codes(shared)
    assert all(torch.equal(a, b) for a, b in zip(ours, library, strict=True))
