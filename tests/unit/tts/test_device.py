"""Device choice that cannot mislead: ``auto`` falls back to the CPU only with a warning naming
the reason, ``cuda`` refuses to start with it (gateway/tts/device.py).

The reasons are produced by torch itself on the machine at hand (this one: a CUDA 13 build of
torch and no driver) or, for the ones this machine cannot show, by torch's calls answering as
they do on such a host.
"""

from __future__ import annotations

import logging

import pytest
import torch

from gateway.errors import ModelLoadError
from gateway.tts import device as device_module
from gateway.tts.device import cuda_unavailable_reason, needed_driver, resolve_device

TOO_OLD = ("The NVIDIA driver on your system is too old (found version 12040). Please update "
           "your GPU driver by downloading and installing a new version from the URL: "
           "http://www.nvidia.com/Download/index.aspx")


def _no_gpu(monkeypatch: pytest.MonkeyPatch, init_error: str, cuda: str | None = "13.0") -> None:
    def init() -> None:
        raise RuntimeError(init_error)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "init", init)
    monkeypatch.setattr(torch.version, "cuda", cuda)


def test_needed_driver_follows_nvidias_minor_version_compatibility() -> None:
    assert needed_driver("13.0") == "NVIDIA driver >= 580"
    assert needed_driver("12.6") == "NVIDIA driver >= 525"
    assert needed_driver(None).startswith("no driver")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a usable GPU")
def test_this_machine_says_why_it_has_no_gpu(caplog: pytest.LogCaptureFixture) -> None:
    reason = cuda_unavailable_reason()
    assert reason is not None and torch.__version__ in reason
    with caplog.at_level(logging.WARNING, logger=device_module.__name__):
        assert resolve_device("auto") == "cpu"
    assert [r.getMessage() for r in caplog.records] == [
        f"device auto: running on the CPU, not a GPU: {reason}"]
    with pytest.raises(ModelLoadError, match="device cuda was requested but"):
        resolve_device("cuda")
    assert resolve_device("cpu") == "cpu"


def test_a_driver_too_old_for_this_torch_is_named_with_the_driver_it_needs(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    _no_gpu(monkeypatch, TOO_OLD)
    reason = cuda_unavailable_reason()
    assert reason is not None
    assert "too old" in reason and "needs NVIDIA driver >= 580" in reason
    assert "found version 12040" in reason and "TORCH_INDEX_URL" in reason
    with caplog.at_level(logging.WARNING, logger=device_module.__name__):
        assert resolve_device("auto") == "cpu"
    assert "too old" in caplog.text
    with pytest.raises(ModelLoadError, match="too old"):
        resolve_device("cuda:0")


def test_a_cpu_only_torch_build_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_gpu(monkeypatch, "Torch not compiled with CUDA enabled", cuda=None)
    reason = cuda_unavailable_reason()
    assert reason is not None and "CPU-only build" in reason


def test_no_driver_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_gpu(monkeypatch, "Found no NVIDIA driver on your system.")
    reason = cuda_unavailable_reason()
    assert reason is not None and "no usable CUDA device" in reason
    assert "Found no NVIDIA driver" in reason


def test_a_usable_gpu_is_chosen_without_a_word(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with caplog.at_level(logging.WARNING, logger=device_module.__name__):
        assert resolve_device("auto") == "cuda"
        assert resolve_device("cuda") == "cuda"
    assert not caplog.records
