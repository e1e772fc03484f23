"""20 ms G.711 framing and the whole 24 kHz TTS -> 8 kHz phone-frame pipeline.

G.711 at 8 kHz is one byte per sample, so a 20 ms packet is 160 bytes: the default packetisation
for PCMU/PCMA (RFC 3551 section 4.2 and 4.5.14) and what Twilio Media Streams send and expect.
Frames are emitted whole; only the last frame of an utterance may be short, and :meth:`Framer.flush`
pads it with the codec's silence byte so the far end's jitter buffer always sees full packets.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt

from gateway.audio.condition import SpeechConditioner
from gateway.audio.g711 import Codec, Encoder, codec_silence
from gateway.audio.resample import Decimator24kTo8k

__all__ = ["FRAME_BYTES", "Framer", "PhonePipeline"]

FRAME_BYTES: Final[int] = 160
"""One 20 ms G.711 frame at 8 kHz, one byte per sample."""

BytesLike = bytes | bytearray | memoryview


class Framer:
    """Cut a stream of G.711 bytes into exact ``frame_bytes``-long frames.

    ``push`` returns every complete frame; bytes that do not yet fill a frame wait for the next
    push. ``flush`` ends the utterance: it pads the pending partial frame (if any) with
    ``silence`` and returns it, so only an utterance's last frame is ever padded.
    """

    __slots__ = ("_frame_bytes", "_pending", "_silence")

    def __init__(self, silence: int, frame_bytes: int = FRAME_BYTES) -> None:
        if not 0 <= silence <= 0xFF:
            raise ValueError(f"silence must be one byte value (0..255), got {silence}")
        if frame_bytes <= 0:
            raise ValueError(f"frame_bytes must be positive, got {frame_bytes}")
        self._silence = silence
        self._frame_bytes = frame_bytes
        self._pending = bytearray()

    @property
    def silence(self) -> int:
        """The byte used to pad an utterance's final partial frame."""
        return self._silence

    @property
    def pending(self) -> int:
        """Bytes waiting for a frame to fill (always fewer than ``frame_bytes``)."""
        return len(self._pending)

    def push(self, data: BytesLike) -> list[bytes]:
        """Append encoded bytes; return the frames now complete (possibly none)."""
        pending = self._pending
        pending += data
        size = self._frame_bytes
        whole = len(pending) - len(pending) % size
        if not whole:
            return []
        # One copy per frame, straight from the buffer; the memoryview must be released before
        # the bytearray is resized, hence the with-block.
        with memoryview(pending) as view:
            frames = [bytes(view[i : i + size]) for i in range(0, whole, size)]
        del pending[:whole]
        return frames

    def flush(self) -> list[bytes]:
        """End of utterance: return the pending partial frame padded with silence, or ``[]``."""
        pending = self._pending
        if not pending:
            return []
        frame = bytes(pending) + bytes((self._silence,)) * (self._frame_bytes - len(pending))
        pending.clear()
        return [frame]

    def reset(self) -> None:
        """Drop pending bytes without emitting them (barge-in: STYLE.md rule 7)."""
        self._pending.clear()


class PhonePipeline:
    """Qwen3-TTS 24 kHz float32 -> 8 kHz G.711 20 ms frames, for one call and direction.

    Composes the optional phone-audio ``conditioner`` (leading-silence trim and level, see
    :mod:`gateway.audio.condition`), :class:`~gateway.audio.resample.Decimator24kTo8k`, float ->
    int16 and G.711 (``pcmu`` or ``pcma``), and :class:`Framer`. The byte stream it produces
    depends only on the utterance's samples, never on how they were chunked; without a
    conditioner it carries exactly ``ceil(n_in / 3)`` real samples followed by at most 159
    silence bytes of padding at the utterance's end.
    """

    __slots__ = ("_conditioner", "_decimator", "_encoder", "_framer", "tap")

    def __init__(self, codec: Codec = "pcmu",
                 conditioner: SpeechConditioner | None = None) -> None:
        self._conditioner = conditioner
        self._encoder = Encoder(codec)
        self._decimator = Decimator24kTo8k()
        self._framer = Framer(codec_silence(codec))
        #: When a list, every 8 kHz float block is appended to it (to cache a live render).
        self.tap: list[npt.NDArray[np.float32]] | None = None

    @property
    def codec(self) -> Codec:
        """The G.711 variant produced, ``pcmu`` or ``pcma``."""
        return self._encoder.codec

    def push(self, chunk: npt.NDArray[np.floating]) -> list[bytes]:
        """Feed 24 kHz float samples in [-1, 1); return the 160-byte frames now complete."""
        if self._conditioner is not None:
            chunk = self._conditioner.push(chunk)
        return self._resample_and_frame(chunk)

    def flush(self) -> list[bytes]:
        """End of utterance: emit all remaining audio, the last frame padded with silence."""
        if self._conditioner is not None:
            held = self._conditioner.flush()
            frames = self._resample_and_frame(held) if held.shape[0] else []
        else:
            frames = []
        y = self._decimator.flush()
        if self.tap is not None and y.shape[0]:
            self.tap.append(y.copy())
        if y.shape[0]:
            frames.extend(self._framer.push(self._encoder.encode_array(y).data))
        frames.extend(self._framer.flush())
        return frames

    def _resample_and_frame(self, chunk: npt.NDArray[np.floating]) -> list[bytes]:
        y = self._decimator.push(chunk)
        if not y.shape[0]:
            return []
        if self.tap is not None:
            self.tap.append(y.copy())
        # .data is a memoryview of the encoder's scratch; the framer copies it before returning.
        return self._framer.push(self._encoder.encode_array(y).data)

    def reset(self) -> None:
        """Drop everything buffered (barge-in); the next push starts a new utterance."""
        if self._conditioner is not None:
            self._conditioner.reset()
        self._decimator.reset()
        self._framer.reset()
