"""Which recogniser a gateway runs: ``GATEWAY_ASR`` and the Whisper model settings, resolved once
at start, in the gateway's process, so that a missing model is one clear line there (a worker
process that fails to start only says that it failed).

``auto`` (the default) runs both when faster-whisper and the Whisper model are on this machine
(``combined``: PocketSphinx first, Whisper when it does not match, digit strings to Whisper
alone; :mod:`gateway.asr.combined`), else PocketSphinx, which needs nothing. Measured on
``bench/asr.py``'s held-out half and through a real gateway (bench/RESULTS.md): menus 89.0 %
combined, 77.2 % Whisper alone, 76.4 % PocketSphinx alone (false accepts 1.6 %, 0.6 %, 1.0 %);
end of speech -> first audio p95 360, 318 and 282 ms.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from typing import TYPE_CHECKING

from gateway.asr.pool import RecognizerFactory
from gateway.errors import RecognizerUnavailable

if TYPE_CHECKING:
    from gateway.config import Settings

__all__ = ["recognizer_factory"]

log = logging.getLogger(__name__)


def recognizer_factory(settings: Settings) -> RecognizerFactory | None:
    """The picklable factory the pool's workers build their recogniser with (None: keys only,
    and why is logged)."""
    choice = settings.asr
    if choice == "off":
        return None
    if choice in ("auto", "whisper", "combined"):
        why = _whisper_missing(settings)
        if why is None:
            from gateway.asr.combined import CombinedRecognizer
            from gateway.asr.whisper import WhisperRecognizer

            cls = WhisperRecognizer if choice == "whisper" else CombinedRecognizer
            return functools.partial(cls, settings.asr_model,
                                     device=settings.asr_device,
                                     cpu_threads=settings.asr_threads,
                                     download=settings.asr_model_download)
        if choice != "auto":
            log.error("GATEWAY_ASR=%s: %s; speech gathers take keys only", choice, why)
            return None
        log.info("speech recogniser: PocketSphinx alone (Whisper is not available: %s)", why)
    from gateway.asr.sphinx import PocketSphinxRecognizer

    return PocketSphinxRecognizer


def _whisper_missing(settings: Settings) -> str | None:
    """Why Whisper cannot run here (None: it can). Never touches the network: with downloads
    on, a model missing here is the worker's to fetch."""
    if importlib.util.find_spec("faster_whisper") is None:
        return "faster-whisper is not installed (pip install faster-whisper)"
    from gateway.asr.whisper import resolve_model

    try:
        resolve_model(settings.asr_model, download=False)
    except RecognizerUnavailable as exc:
        if settings.asr_model_download:
            return None
        return str(exc)
    return None
