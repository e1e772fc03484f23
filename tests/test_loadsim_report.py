"""Load-simulator report: one self-contained HTML file that a real browser renders, and the table.

The browser check needs Debian's ``chromium`` (``.ci/run`` installs it); without it the test
fails and says so rather than skipping, because a report nobody looked at is not tested.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from matplotlib import image as mpimg
from rich.console import Console

from gateway.loadsim.report import (
    ReportDataError,
    build_html,
    render_report,
    render_summary_table,
)

TARGET = "http://127.0.0.1:8000"
REFUSAL = "simulator lateness p99 31.0 ms is more than 10% of the first-audio p50 250.0 ms"
ERROR = "websocket closed: 1011 <internal error> & no audio"


def _pcts(values: list[float], keys: tuple[str, ...] = ("p50", "p95", "p99")) -> dict[str, Any]:
    if not values:
        return dict.fromkeys(keys)
    return {k: float(np.percentile(values, float(k[1:]))) if k != "max" else max(values)
            for k in keys}


def synthetic_document(seed: int = 7, restart_clock: bool = False) -> dict[str, Any]:
    """Three levels (x5, x10, x20) and 60 calls with seeded latencies, gaps and errors."""
    rng = np.random.default_rng(seed)
    concurrency = [5, 10, 20]
    calls_per_level = [10, 20, 30]
    calls: list[dict[str, Any]] = []
    levels: list[dict[str, Any]] = []
    for index, (conc, n_calls) in enumerate(zip(concurrency, calls_per_level, strict=True)):
        level_calls = []
        base = 0.0 if restart_clock else 20.0 * index
        for n in range(n_calls):
            start = base + float(rng.uniform(0, 16))
            turns = []
            for k, kind in enumerate(("answer", "dtmf", "speech", "barge_in")):
                first = float(rng.lognormal(np.log(120 + 40 * index), 0.35))
                gaps = int(rng.random() < 0.08 * (index + 1))
                turns.append({
                    "kind": kind, "at_s": start + 1.1 * k, "first_audio_ms": first,
                    "gaps": gaps, "gap_ms": 20.0 * gaps * int(rng.integers(1, 5)),
                    "barge_in_ms": float(rng.uniform(40, 90)) if kind == "barge_in" else None,
                    "timed_out": False,
                })
            if n == 3 and index == 2:  # one turn that never heard audio
                turns[2].update(first_audio_ms=None, timed_out=True)
            if n == 4 and index == 1:  # one very slow turn, beyond the plot's cut
                turns[1]["first_audio_ms"] = 9000.0
            level_calls.append({
                "id": f"w0-l{index}-c{n + 1}", "level": index,
                "setup_ms": float(rng.uniform(8, 30)),
                "error": ERROR if (index, n) in {(1, 7), (2, 2), (2, 11)} else None,
                "turns": turns, "jitter_ms": float(rng.uniform(0.5, 4.0)),
                "mark_rtt_ms": [float(x) for x in rng.uniform(2, 12, size=3)],
                "loss_pct": float(rng.uniform(0, 0.5)),
            })
        firsts = [t["first_audio_ms"] for c in level_calls for t in c["turns"]
                  if t["first_audio_ms"] is not None]
        levels.append({
            "concurrency": conc, "calls": n_calls,
            "errors": sum(1 for c in level_calls if c["error"]), "dropped": int(index == 2),
            "ttfa_ms": _pcts(firsts), "gaps": sum(t["gaps"] for c in level_calls
                                                  for t in c["turns"]),
            "gap_ms": float(sum(t["gap_ms"] for c in level_calls for t in c["turns"])),
            "mos": 4.3 - 0.1 * index, "r_factor": 90.0 - 2.0 * index,
            "lateness_ms": {"p99": [0.4, 1.1, 31.0][index]},
            "passed": [True, False, None][index],
            "refused": REFUSAL if index == 2 else None,
        })
        calls.extend(level_calls)
    return {
        "meta": {
            "target": TARGET, "transport": "twilio", "scenario": "menu",
            "started": "2025-11-30T01:00:00+00:00", "duration_s": 60.0, "workers": 1,
            "simulator_lateness_ms": {"p50": 0.21, "p99": 12.5, "max": 40.2},
            "slo": "ttfa_p95<400ms,gaps=0", "slo_passed": False,
        },
        "levels": levels,
        "calls": calls,
    }


# --- the file -----------------------------------------------------------------------------------


def test_report_is_one_self_contained_file(tmp_path: Path) -> None:
    out = render_report(synthetic_document(), tmp_path / "sub" / "report.html")
    assert out == tmp_path / "sub" / "report.html"
    page = out.read_text(encoding="utf-8")

    assert page.startswith("<!DOCTYPE html>")
    assert page.count("<svg") >= 4
    # Nothing that makes a browser fetch anything.
    for tag in ("<script", "<link", "<img", "<iframe", "<object", "<embed", "@import", "<?xml"):
        assert tag not in page.lower(), tag
    assert not re.search(r"\bsrc\s*=", page, flags=re.IGNORECASE)
    assert re.findall(r'href="([^"]*)"', page)  # in-page links exist ...
    assert all(h.startswith("#") for h in re.findall(r'href="([^"]*)"', page))  # ... only
    assert all(u.startswith("#") for u in re.findall(r"url\(([^)]*)\)", page))
    # The only URL in the page is the target, shown as text.
    assert page.replace(TARGET, "").count("http://") == 0
    assert "https://" not in page

    # Each inline SVG reuses matplotlib's ids; they must be unique in the page and every
    # in-page reference must resolve, or glyphs of one plot draw in another.
    ids = re.findall(r'\bid="([^"]+)"', page)
    assert len(ids) == len(set(ids))
    assert set(re.findall(r'href="#([^"]+)"', page)) <= set(ids)
    assert set(re.findall(r"url\(#([^)]+)\)", page)) <= set(ids)


def test_report_sections_and_banners() -> None:
    page = build_html(synthetic_document())
    for section in ('id="summary"', 'id="levels"', 'id="plots"', 'id="calls"', 'id="notes"',
                    'id="fig-ttfa-histogram"', 'id="fig-ttfa-cdf"',
                    'id="fig-latency-vs-concurrency"', 'id="fig-gaps-over-time"'):
        assert section in page
    assert 'class="banner fail">SLO missed: ttfa_p95&lt;400ms,gaps=0' in page
    assert "Level ×20: latency figures refused" in page
    assert REFUSAL in page
    assert 'class="refused"' in page  # the refused level's row is marked
    assert "Simulator&#x27;s own lateness" in page and "p99 12.50" in page
    # Untrusted strings are escaped, not interpreted.
    assert "&lt;internal error&gt; &amp; no audio" in page and "<internal error>" not in page
    # Axis labels (drawn as glyph paths; matplotlib keeps the text as a comment).
    for label in ("time to first audio (ms)", "concurrent calls", "gaps (count / s)",
                  "fraction of turns"):
        assert label in page
    assert "1 turn(s) above" in page  # the 9 s outlier is counted, not plotted


def test_levels_with_restarted_clocks_are_laid_end_to_end() -> None:
    page = build_html(synthetic_document(restart_clock=True))
    assert "drawn one after another" in page
    assert "levels end to end" in page
    assert "drawn one after another" not in build_html(synthetic_document())


def test_empty_and_partial_documents_still_render() -> None:
    page = build_html({"meta": {"target": "sip:127.0.0.1:5060", "transport": "sip",
                                "scenario": "hangup"}, "levels": [], "calls": []})
    assert page.count("<svg") == 4
    assert "no per-call samples" in page
    assert "no first-audio measurements in this run" in page


def test_every_level_refused_renders_cleanly_and_deterministically() -> None:
    doc = synthetic_document()
    for level in doc["levels"]:
        level["refused"] = REFUSAL
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. matplotlib's "no artists with labels" legend
        page = build_html(doc)
    assert page.count("latency figures refused by the simulator") == 3
    # Same document, same bytes: no timestamps or random ids in the SVGs.
    assert build_html(doc) == page


@pytest.mark.parametrize(
    ("mutate", "where"),
    [
        (lambda d: d["levels"][0]["ttfa_ms"].update(p50="fast"), "levels[0].ttfa_ms.p50"),
        (lambda d: d["calls"][3]["turns"][1].update(gaps=[1]), "calls[3].turns[1].gaps"),
        (lambda d: d.update(levels={"x": 1}), "levels"),
        (lambda d: d["meta"].update(slo_passed="yes"), "meta.slo_passed"),
    ],
)
def test_malformed_documents_raise_with_the_field(mutate: Any, where: str) -> None:
    doc = synthetic_document()
    mutate(doc)
    with pytest.raises(ReportDataError, match=re.escape(where)):
        build_html(doc)


# --- the terminal table ---------------------------------------------------------------------------


def test_summary_table_has_a_row_per_level() -> None:
    doc = synthetic_document()
    console = Console(record=True, width=220, color_system=None)
    console.print(render_summary_table(doc))
    text = console.export_text()
    assert "menu → http://127.0.0.1:8000 (twilio)" in text
    for level, verdict in zip(doc["levels"], ("pass", "FAIL", "refused"), strict=True):
        p95 = f"{level['ttfa_ms']['p95']:,.0f}"
        row = next(line for line in text.splitlines()
                   if re.match(rf"\W*{level['concurrency']}\b", line))
        assert p95 in row and verdict in row
    assert "SLO ttfa_p95<400ms,gaps=0: missed" in text
    assert "refused at concurrency 20" in text


# --- a real browser ------------------------------------------------------------------------------


def _chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail(
        "chromium is not installed: the report's rendering check needs Debian's chromium "
        "(apt-get install -y chromium; .ci/run installs it)"
    )


def test_report_renders_in_headless_chromium(tmp_path: Path) -> None:
    page = render_report(synthetic_document(), tmp_path / "report.html")
    shot = tmp_path / "report.png"
    cmd = [
        _chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
        "--no-first-run", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--disable-dev-shm-usage", "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}",
        "--window-size=1280,2400", page.resolve().as_uri(),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert shot.exists(), f"no screenshot (exit {proc.returncode}):\n{proc.stderr[-2000:]}"

    pixels = mpimg.imread(shot)
    assert pixels.shape[:2] == (2400, 1280)
    rgb = np.round(pixels[..., :3] * 255).astype(np.uint8).reshape(-1, 3)
    colours, counts = np.unique(rgb, axis=0, return_counts=True)
    # Text, tables, banners and four anti-aliased plots: far from a blank page.
    assert len(colours) > 200
    assert counts.max() / len(rgb) < 0.9
    ink = np.count_nonzero(rgb.min(axis=1) < 200) / len(rgb)
    assert ink > 0.02
    # The refused-level banner's fill (#fff4e5) is on screen.
    banner = np.all(np.abs(rgb.astype(int) - (0xFF, 0xF4, 0xE5)) <= 1, axis=1)
    assert np.count_nonzero(banner) > 5000
