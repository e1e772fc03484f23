"""The talker's CPU linears on prepacked oneDNN: same results as ``nn.Linear``, row by row."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gateway.tts import cpu_linear
from gateway.tts.cpu_linear import PackedLinear, install
from gateway.tts.qwen import QwenModel
from tests.support.logs import logged

pytestmark = pytest.mark.skipif(not cpu_linear.available(),
                                reason="this torch build has no oneDNN linear ops")


def _linear(in_features: int, out_features: int, bias: bool, seed: int = 0) -> torch.nn.Linear:
    generator = torch.Generator().manual_seed(seed)
    layer = torch.nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_features, in_features, generator=generator) * 0.05)
        if bias:
            layer.bias.copy_(torch.randn(out_features, generator=generator))
    return layer


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("shape", [(8, 512), (3, 5, 512), (1, 1, 512)], ids=str)
def test_a_packed_linear_computes_what_the_linear_does(shape: tuple[int, ...], bias: bool) -> None:
    layer = _linear(512, 768, bias)
    packed = PackedLinear(layer)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want, got = layer(x), packed(x)
    assert got.shape == want.shape == (*shape[:-1], 768)
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


def test_a_rows_result_does_not_depend_on_the_rows_beside_it() -> None:
    """The property the batched engine's identity rests on: row 0's output is the same bits
    at 1 to 16 rows (MKL's sgemm changes its summation with the row count). On AVX-512 it
    holds at 1 row only up to 1,024 inputs (cpu_linear.py); 512 leaves a margin."""
    packed = PackedLinear(_linear(512, 1024, bias=False))
    x = torch.randn(16, 512, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        alone = packed(x[:1])
        for rows in (2, 3, 5, 8, 16):
            assert torch.equal(packed(x[:rows])[:1], alone), rows
            # and every other row is its own solo result too
            assert torch.equal(packed(x[:rows])[rows - 1], packed(x[rows - 1 : rows])[0])


def test_install_packs_the_large_fp32_cpu_linears_and_nothing_else() -> None:
    model = torch.nn.Sequential(
        _linear(1024, 512, bias=True),           # 512 Ki weights: packed
        torch.nn.ReLU(),
        _linear(64, 64, bias=False),             # below MIN_WEIGHTS: stays
        _linear(512, 1024, bias=False).to(torch.bfloat16),  # not fp32: stays
        torch.nn.Sequential(_linear(512, 512, bias=False)),  # nested, 256 Ki: packed
    )
    x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        before = model[1](model[0](x))
    params_before = sum(p.numel() for p in model.parameters())
    assert install(model) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[4][0], PackedLinear)
    assert type(model[2]) is torch.nn.Linear and type(model[3]) is torch.nn.Linear
    assert cpu_linear.describe(model) == "onednn"
    # The reordered weight replaced the original: only the bias is still a parameter.
    assert sum(p.numel() for p in model.parameters()) == params_before - 1024 * 512 - 512 * 512
    assert "packed" not in model.state_dict() and "0.packed" not in model.state_dict()
    with torch.inference_mode():
        after = model[1](model[0](x))
    assert float((after - before).abs().max()) <= 1e-5 * float(before.abs().max())


def test_install_leaves_everything_alone_where_the_ops_are_missing(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_linear, "available", lambda: False)
    model = torch.nn.Sequential(_linear(1024, 1024, bias=False))
    with logged("gateway.tts.cpu_linear") as records:
        assert install(model) == 0
    assert type(model[0]) is torch.nn.Linear
    assert cpu_linear.describe(model) == "default"
    assert any("stay on torch's default kernels" in r.getMessage() for r in records)


def test_the_model_packs_only_its_talker_and_mkl_leaves_it_alone(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_linear, "MIN_WEIGHTS", 0)  # the tiny layers are mostly below it
    packed = QwenModel(str(tiny_model_dir), device="cpu")
    assert packed.cpu_linear == "onednn"
    assert not any(type(m) is torch.nn.Linear for m in packed.base.model.talker.modules())
    codec = packed.base.model.speech_tokenizer.model
    assert any(type(m) is torch.nn.Linear for m in codec.modules())
    default = QwenModel(str(tiny_model_dir), device="cpu", cpu_linear="mkl")
    assert default.cpu_linear == "default"
    assert not any(isinstance(m, PackedLinear) for m in default.base.model.modules())


def test_an_unknown_kernel_choice_is_refused_before_anything_loads() -> None:
    with pytest.raises(ValueError, match="cpu_linear must be one of"):
        QwenModel("/nonexistent/checkpoint", device="cpu", cpu_linear="blas")
