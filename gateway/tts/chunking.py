"""How many codec frames go into the next streamed chunk.

The first chunk sets the caller's latency, so it is small (one 80 ms frame by default); later
chunks only have to arrive before the audio already delivered has finished playing, and larger
chunks cost less decode overhead per frame. The schedule (default 1, 2, 4, 8, then 8s) says how
fast chunks may grow. With ``adaptive`` on, a chunk is also shrunk when the measured cost per
frame (generation plus decode plus hand-off, from the wall time between chunks) says the
scheduled size would not arrive before playback runs out: on a slow device (a CPU, a crowded
GPU) that turns an audible gap into a few more, smaller chunks. Once a turn generates slower
than real time no chunk size can prevent gaps, and the schedule's size is kept for throughput.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gateway.clock import Clock, SystemClock

FRAME_S = 0.08


class ChunkPlanner:
    """Plans chunk sizes for one utterance. Call :meth:`next_size`, then :meth:`chunk_done`."""

    def __init__(
        self,
        schedule: Sequence[int],
        *,
        adaptive: bool = True,
        safety_s: float = 0.02,
        clock: Clock | None = None,
    ) -> None:
        if not schedule or any(n < 1 for n in schedule):
            raise ValueError("schedule needs positive frame counts")
        self.schedule = tuple(schedule)
        self.adaptive = adaptive
        self.safety_s = safety_s
        self.clock = clock if clock is not None else SystemClock()
        self._index = 0
        self._frames_done = 0
        self._origin: float | None = None
        # Created when generation starts: the first chunk's cost includes the prefill, which
        # makes the first estimate conservative (the second chunk is the riskiest one).
        self._last: float | None = self.clock.now()
        self._per_frame: float | None = None

    def lead_s(self, now: float | None = None) -> float:
        """Audio delivered but not yet played by a listener who started at the first chunk."""
        if self._origin is None:
            return 0.0
        now = self.clock.now() if now is None else now
        return self._frames_done * FRAME_S - (now - self._origin)

    def next_size(self) -> int:
        """Frames for the next chunk."""
        size = self.schedule[min(self._index, len(self.schedule) - 1)]
        if not self.adaptive or self._per_frame is None or self._per_frame <= 0:
            return size
        if self._per_frame >= FRAME_S:
            # Slower than real time: no chunk size avoids the gaps, and small chunks only add
            # per-chunk decode overhead. Keep the schedule's size for throughput.
            return size
        fit = math.floor((self.lead_s() - self.safety_s) / self._per_frame)
        return max(1, min(size, fit))

    def chunk_done(self, frames: int) -> None:
        """Record that a chunk of ``frames`` frames has just been handed on."""
        now = self.clock.now()
        if self._origin is None:
            self._origin = now
        if self._last is not None and frames > 0:
            cost = (now - self._last) / frames
            # Smooth, but let a slowdown show at once: a gap costs more than a small chunk.
            self._per_frame = cost if self._per_frame is None else max(
                cost, 0.5 * self._per_frame + 0.5 * cost
            )
        self._last = now
        self._frames_done += frames
        self._index += 1
