"""Artefacts built once per test run and shared by the pytest-xdist workers."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str,
                build: Callable[[Path], object]) -> Path:
    """``build(path)`` once per test run, whatever the number of pytest-xdist workers.

    Workers share the run's base temporary directory (its parent, under xdist); the first to
    take the lock builds, the others wait and reuse. Only deterministic artefacts go here (the
    tiny checkpoints are byte-identical for a seed; the demo cache is rendered with seeds).
    """
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        base = base.parent
    path = base / "shared" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    done = path.with_name(name + ".done")
    with FileLock(str(path) + ".lock"):
        if not done.exists():
            build(path)
            done.touch()
    return path
