"""Qwen3-TTS telephony IVR media gateway."""

__version__ = "0.1.0"
