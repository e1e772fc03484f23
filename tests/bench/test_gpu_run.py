"""The one-shot GPU run (bench/gpu_batching.sh), dry: every stage on this CPU with the tiny model
and graph mode through the capture stand-in, so the run a lent GPU gets works the first time.

The shortened form (QUICK=1) runs here; ``DRY_RUN=1 bash bench/gpu_batching.sh`` runs every
stage in full (about a minute on the 2-core workstation).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.support.paths import REPO

REPO = REPO
SCRIPT = REPO / "bench" / "gpu_batching.sh"


def _run(out: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, "DRY_RUN": "1", "QUICK": "1", "OUT": str(out), **env}
    return subprocess.run(["bash", str(SCRIPT)], cwd=REPO, env=environ, capture_output=True,
                          text=True, timeout=600)


def _stages(out: Path) -> list[list[str]]:
    return [line.split("\t") for line in (out / "stages.tsv").read_text().splitlines()]


@pytest.mark.timeout(600)
def test_the_dry_run_passes_every_stage_through_the_capture_stand_in(tmp_path: Path) -> None:
    done = _run(tmp_path)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-3000:]
    assert [(name, status) for name, status, _s in _stages(tmp_path)] == [
        ("preflight", "ok"), ("0.6B", "ok"), ("profile", "ok"), ("baselines", "ok")]
    # The profile stage leaves a device profile the simulated engine loads.
    from gateway.tts.simulated import load_profile

    profile = load_profile(str(tmp_path / "profile-0.6B.json"))
    assert "measured" in profile.source and profile.table
    assert "preflight [" in log and "all checks passed" in log
    # Every bucket the stage can run (1 and 2 rows) captured through the stand-in at warm-up.
    for bucket in (1, 2):
        assert f"captured step graph: batch {bucket}, 256 positions" in log
    assert "(stand-in, " in log and "graph stand-in" in log
    results = (tmp_path / "RESULTS.md").read_text()
    section = results.split("<!-- gpu-table:start -->")[1].split("<!-- gpu-table:end -->")[0]
    assert "DRY RUN on the CPU" in section and "| 0.6B | ok |" in section
    assert "### Stage 0.6B" in section and "### Stage baselines" in section
    # The repository's RESULTS.md is untouched by a dry run.
    assert "DRY RUN" not in (REPO / "bench" / "RESULTS.md").read_text()


def test_a_failed_preflight_stops_the_run_within_seconds_with_its_reason(
    tmp_path: Path,
) -> None:
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "qwen_tts.py").write_text("raise ImportError('qwen-tts wheel not carried')\n")
    done = _run(tmp_path / "out", PYTHONPATH=str(shim))
    log = done.stdout + done.stderr
    assert done.returncode == 1
    assert "preflight FAILED" in log and "qwen-tts wheel not carried" in log
    assert "the preflight failed; nothing else was run" in log
    assert [row[:2] for row in _stages(tmp_path / "out")] == [["preflight", "failed (exit 1)"]]


@pytest.mark.timeout(600)
def test_a_stage_that_overruns_its_timeout_loses_only_itself(tmp_path: Path) -> None:
    done = _run(tmp_path, T_SIZE="2")
    assert done.returncode != 0
    stages = {name: status for name, status, _s in _stages(tmp_path)}
    assert stages == {"preflight": "ok", "0.6B": "timed out after 2 s", "profile": "ok",
                      "baselines": "ok"}
    section = (tmp_path / "RESULTS.md").read_text()
    assert "| 0.6B | timed out after 2 s |" in section and "### Stage baselines" in section
