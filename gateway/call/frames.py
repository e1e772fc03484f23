"""G.711 frames of the PCM calls play (cached prompts, sound files), encoded once per codec.

A prompt heard by a thousand callers is not encoded a thousand times (0.1 ms per second of
audio, the largest cost of a cached-prompt turn). One :class:`PromptFrames` is owned by the
call lifecycle (:class:`gateway.call.lifecycle.CallLifecycle`, one per app) and handed to every
call it builds, so two gateways in one process (tests, the prompt tester) share nothing and the
cache goes with the app that filled it.
"""

from __future__ import annotations

import collections

import numpy as np
import numpy.typing as npt

from gateway.audio.framer import Framer
from gateway.audio.g711 import alaw_encode, codec_silence, ulaw_encode
from gateway.call.events import Codec

__all__ = ["DEFAULT_MAX_BYTES", "PromptFrames"]

#: 32 MiB of frames: an hour of distinct prompts per codec.
DEFAULT_MAX_BYTES = 32 * 1024 * 1024


class PromptFrames:
    """PCM -> its 20 ms G.711 frames in a codec, remembered.

    Keyed by the array itself (the prompt cache and the sound table hand out the same array
    each time): an entry holds a reference to it, so its id cannot be reused while cached.
    Least recently used first out, bounded by the frames' bytes.
    """

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: collections.OrderedDict[
            tuple[int, Codec], tuple[npt.NDArray[np.int16], list[bytes]]] = (
                collections.OrderedDict())

    def __len__(self) -> int:
        return len(self._entries)

    def frames(self, pcm: npt.NDArray[np.int16], codec: Codec) -> list[bytes]:
        """``pcm``'s frames in ``codec`` (the last one padded with codec silence); the list is
        shared by every caller of the same array: do not modify it."""
        key = (id(pcm), codec)
        entry = self._entries.get(key)
        if entry is not None and entry[0] is pcm:
            self._entries.move_to_end(key)
            return entry[1]
        encoded = ulaw_encode(pcm) if codec == "pcmu" else alaw_encode(pcm)
        framer = Framer(codec_silence(codec))
        frames = framer.push(encoded) + framer.flush()
        size = len(frames) * 160
        if size <= self.max_bytes:
            self._entries[key] = (pcm, frames)
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self.bytes -= len(evicted) * 160
        return frames
