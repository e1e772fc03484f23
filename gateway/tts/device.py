"""Where the model runs, chosen so that the choice cannot mislead.

``auto`` takes CUDA when this process can use it and otherwise falls back to the CPU with a
warning that says why (a gateway serving callers from a CPU is a capacity incident, not a
detail); ``cuda`` refuses to start with the same reason. The reasons an operator meets:

- this torch build has no CUDA (a CPU wheel);
- no NVIDIA driver or no GPU visible to the process (a container started without ``--gpus``);
- the driver is older than this torch build's CUDA needs. PyPI's torch 2.14 wheels are CUDA 13
  builds: NVIDIA's minor-version compatibility runs a CUDA 13.x build on driver 580 or newer,
  12.x on 525 or newer (docs.nvidia.com/deploy/cuda-compatibility). Hosts with an older driver
  need an image built for CUDA 12 (docs/operators/deploy.md: ``TORCH_INDEX_URL``).
"""

from __future__ import annotations

import logging

from gateway.errors import ModelLoadError

log = logging.getLogger(__name__)

#: Oldest NVIDIA driver branch that runs a build of each CUDA major version (minor-version
#: compatibility, NVIDIA's CUDA compatibility guide, table 1).
MIN_DRIVER = {13: 580, 12: 525, 11: 450}


def needed_driver(cuda_version: str | None) -> str:
    """The driver a torch build for ``cuda_version`` (``torch.version.cuda``) needs, in words."""
    if not cuda_version:
        return "no driver (a CPU-only build)"
    major = int(cuda_version.split(".")[0])
    branch = MIN_DRIVER.get(major)
    return f"NVIDIA driver >= {branch}" if branch else f"a driver for CUDA {cuda_version}"


def cuda_unavailable_reason() -> str | None:
    """Why this process cannot use CUDA, in words an operator can act on; None when it can."""
    import torch

    if torch.cuda.is_available():
        return None
    build = f"torch {torch.__version__}"
    if torch.version.cuda is None:
        return f"{build} is a CPU-only build (install a CUDA build of torch to use a GPU)"
    try:
        # Initialising says what is wrong: no driver, a driver too old, no device.
        torch.cuda.init()
    except Exception as exc:
        detail = " ".join(str(exc).split())
    else:
        detail = "CUDA initialised but reports no device"
    if "too old" in detail:
        return (f"the NVIDIA driver is too old for {build} (CUDA {torch.version.cuda}, needs "
                f"{needed_driver(torch.version.cuda)}): {detail} Build the image for the host's "
                "driver with TORCH_INDEX_URL (docs/operators/deploy.md).")
    return (f"no usable CUDA device for {build} (CUDA {torch.version.cuda}, needs "
            f"{needed_driver(torch.version.cuda)}): {detail}")


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when a CUDA device is usable, else ``cpu`` with a warning naming
    the reason; ``cuda`` (or ``cuda:N``) without one raises :class:`ModelLoadError` with it."""
    if device == "auto":
        reason = cuda_unavailable_reason()
        if reason is None:
            return "cuda"
        log.warning("device auto: running on the CPU, not a GPU: %s", reason)
        return "cpu"
    if device.startswith("cuda"):
        reason = cuda_unavailable_reason()
        if reason is not None:
            raise ModelLoadError(f"device {device} was requested but {reason}")
    return device
