"""One quick check of where a Qwen3-TTS model would load from, for every command that loads one.

Without it, a hub model id on a machine that cannot reach the Hugging Face hub costs ~54 s of
huggingface_hub retrying each file of the checkpoint with back-off (55 lines of warnings, each
printed twice) before the loader's clear error. :func:`require_model_source` answers in at most
:data:`HUB_PROBE_TIMEOUT_S` with the same message every command prints (``serve``, ``say``,
``script render``, ``voices add``, ``demo``).

Kept apart from :mod:`gateway.tts.qwen` on purpose: it needs none of the model libraries, so a
command can fail before importing torch.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlsplit

from gateway.errors import GatewayError

__all__ = ["HUB_PROBE_TIMEOUT_S", "ModelSourceError", "model_source_problem",
           "require_model_source", "unavailable_message"]

#: How long the hub (or the HTTPS proxy in front of it) gets to accept a TCP connection before
#: it is called unreachable.
HUB_PROBE_TIMEOUT_S = 3.0
#: The alias the engine resolves to its tiny offline checkpoint (gateway.tts.qwen.TINY_ALIAS).
_TINY_ALIAS = "tiny"


class ModelSourceError(GatewayError):
    """The model cannot be loaded from where it was asked for; the message says what to do."""


def _is_local(model: str) -> bool:
    # A hub id is "org/name"; anything else (the tiny alias, a path) the loader handles itself,
    # and quickly.
    return (model == _TINY_ALIAS or "/" not in model
            or model.startswith(("/", "./", "../", "~"))
            or Path(model).expanduser().exists())


def _in_hub_cache(model: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(model, "config.json"), str)
    except Exception:  # an id the hub library cannot even parse: let the loader say so
        return True


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def model_source_problem(model: str, timeout_s: float = HUB_PROBE_TIMEOUT_S) -> str | None:
    """Why ``model`` cannot be loaded now, or None when loading may proceed.

    None for a local path, the ``tiny`` alias and a model already in the local hub cache.
    Otherwise ``HF_HUB_OFFLINE`` is honoured as huggingface_hub reads it, and the hub endpoint
    (``HF_ENDPOINT``, through ``HTTPS_PROXY`` when one is set) must accept a TCP connection
    within ``timeout_s``.
    """
    if _is_local(model) or _in_hub_cache(model):
        return None
    if _offline():
        return "HF_HUB_OFFLINE=1 and it is not in the local cache"
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    parts = urlsplit(proxy if proxy else endpoint)
    host = parts.hostname or "huggingface.co"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as exc:
        via = "its proxy " if proxy else ""
        return (f"it is not a local directory and the Hugging Face hub could not provide it "
                f"({via}{host}:{port} unreachable: {exc or type(exc).__name__})")


def unavailable_message(model: str, reason: str, what: str = "Qwen3-TTS model",
                        option: str = "--model") -> str:
    """The one message every command prints for a model it cannot load."""
    return (f"cannot load {what} {model!r}: {reason}. Pass a local checkpoint directory with "
            f"{option} /path/to/model (or GATEWAY_MODEL=/path/to/model); "
            "`gateway model tiny DIR` builds a tiny offline one for smoke tests.")


def require_model_source(model: str, what: str = "Qwen3-TTS model",
                         option: str = "--model") -> None:
    """Raise :class:`ModelSourceError` at once when ``model`` cannot be loaded from here."""
    reason = model_source_problem(model)
    if reason is not None:
        raise ModelSourceError(unavailable_message(model, reason, what, option))
