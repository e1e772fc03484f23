"""How long a full garbage collection stops a gateway process: start-up heap frozen or not.

    python bench/gc_pause.py [--rounds 5] [--churn 20000] [--model-dir DIR]

The process loads what ``gateway serve`` loads on its way to ready: the gateway's modules, the
model libraries, and the engine (the tiny checkpoint of the real architecture on CPU, built
first unless ``--model-dir`` names one; the published sizes have more modules, so more objects,
so this is a lower bound). Then, round after round, in alternating order:

* **unfrozen** (the baseline): the heap as it was before ``gateway/heap.py``;
* **frozen**: inside :func:`gateway.heap.hold`, as a ready gateway runs.

Each round first makes what calls leave behind between two collections (``--churn`` small
objects in reference cycles, dropped, and as many kept alive), then times one full
``gc.collect()``: the time the GIL is held, so the time every call's media stands still. The
last line is ``RESULT full collection X ms unfrozen, Y ms frozen (median of N rounds), Zx
shorter``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without an install
    sys.path.insert(0, str(ROOT))

from common import print_table  # noqa: E402


def _load(model_dir: Path) -> list[Any]:
    """Import and load what a served gateway holds once it is ready."""
    import uvicorn  # noqa: F401

    import gateway.app
    import gateway.asr.sphinx
    import gateway.audio.vad
    import gateway.cli
    import gateway.server
    import gateway.sip.endpoint
    from gateway.config import Settings

    if not (model_dir / "config.json").exists():
        from gateway.tts.tiny import build_tiny_checkpoint

        build_tiny_checkpoint(model_dir)
    engines = gateway.app.default_engine_factory(Settings(model=str(model_dir), device="cpu"))
    for engine in engines:
        engine.warmup()
    return engines


class _Node:
    """A call-sized object in a cycle (what per-call state, tasks and tracebacks leave)."""

    def __init__(self) -> None:
        self.me = self
        self.data = {"frame": [1, 2, 3]}


def _timed_collection(churn: int, kept: list[Any]) -> tuple[float, int]:
    """Leave ``churn`` dead cycles and keep ``churn`` live objects, then time a full
    collection: (milliseconds, objects it had to walk)."""
    for _ in range(churn):
        _Node()
    kept.extend(_Node() for _ in range(churn))
    walked = len(gc.get_objects())
    start = time.perf_counter()
    gc.collect()
    return 1000 * (time.perf_counter() - start), walked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--churn", type=int, default=20_000)
    parser.add_argument("--model-dir", type=Path)
    args = parser.parse_args()

    from gateway import heap

    with tempfile.TemporaryDirectory(prefix="gc-pause-") as tmp:
        engines = _load(args.model_dir or Path(tmp) / "tiny")
        gc.collect()
        times: dict[str, list[float]] = {"unfrozen": [], "frozen": []}
        walked: dict[str, list[int]] = {"unfrozen": [], "frozen": []}
        rows = []
        for round_ in range(args.rounds):
            order = ("unfrozen", "frozen") if round_ % 2 == 0 else ("frozen", "unfrozen")
            row = [str(round_ + 1)]
            cells: dict[str, str] = {}
            for variant in order:
                kept: list[Any] = []
                if variant == "frozen":
                    heap.hold()
                try:
                    ms, objects = _timed_collection(args.churn, kept)
                finally:
                    if variant == "frozen":
                        heap.release()
                times[variant].append(ms)
                walked[variant].append(objects)
                cells[variant] = f"{ms:.1f} ms / {objects:,}"
                del kept
            row += [cells["unfrozen"], cells["frozen"], order[0]]
            rows.append(row)
        del engines
    print_table(rows, ["round", "unfrozen: pause / objects walked",
                       "frozen: pause / objects walked", "first"],
                title="one full gc.collect() in a loaded gateway process")
    unfrozen = statistics.median(times["unfrozen"])
    frozen = statistics.median(times["frozen"])
    print(f"RESULT full collection {unfrozen:.1f} ms unfrozen, {frozen:.1f} ms frozen "
          f"(median of {args.rounds} rounds), {unfrozen / max(frozen, 1e-6):.1f}x shorter")


if __name__ == "__main__":
    main()
