"""Load-simulator report: one self-contained HTML file that a real browser renders, and the tables.

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
    render_breakdown,
    render_report,
    render_summary_table,
)

TARGET = "http://127.0.0.1:8000"
WITHHELD = "simulator lateness p99 31.0 ms is more than 10% of the first-audio p50 250.0 ms"
ERROR = "websocket closed: 1011 <internal error> & no audio"
BUSY = "busy TwiML: Sorry, all our lines are busy right now."


def _pcts(values: list[float], keys: tuple[str, ...] = ("p50", "p95", "p99")) -> dict[str, Any]:
    if not values:
        return dict.fromkeys(keys)
    return {k: float(np.percentile(values, float(k[1:]))) if k != "max" else max(values)
            for k in keys}


def synthetic_document(seed: int = 7, restart_clock: bool = False) -> dict[str, Any]:
    """Three levels (x5, x10, x20) and 60 calls with seeded latencies, gaps and errors, plus
    calls the gateway refused (busy) at the two higher levels."""
    rng = np.random.default_rng(seed)
    concurrency = [5, 10, 20]
    calls_per_level = [10, 20, 30]
    refused_per_level = [0, 2, 5]
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
                "id": f"w0-l{index}-c{n + 1}", "level": index, "started_s": start,
                "setup_ms": float(rng.uniform(8, 30)),
                "error": ERROR if (index, n) in {(1, 7), (2, 2), (2, 11)} else None,
                "refused": None,
                "turns": turns, "jitter_ms": float(rng.uniform(0.5, 4.0)),
                "mark_rtt_ms": [float(x) for x in rng.uniform(2, 12, size=3)],
                "loss_pct": float(rng.uniform(0, 0.5)),
            })
        for n in range(refused_per_level[index]):  # busy: no setup, no turns
            level_calls.append({
                "id": f"w0-l{index}-r{n + 1}", "level": index, "refused": BUSY, "error": None,
                "started_s": base + float(rng.uniform(0, 16)), "turns": [],
            })
        firsts = [t["first_audio_ms"] for c in level_calls for t in c["turns"]
                  if t["first_audio_ms"] is not None]
        errors = sum(1 for c in level_calls if c["error"])
        refused = refused_per_level[index]
        placed = n_calls + refused
        levels.append({
            "concurrency": conc, "calls": placed, "completed": placed - errors - refused,
            "refused": refused, "refused_by": {BUSY: refused} if refused else {},
            "errors": errors, "failures_by": {ERROR: errors} if errors else {},
            "placed_per_s": placed / 16.0, "duration_s": 16.0, "dropped": int(index == 2),
            "ttfa_ms": _pcts(firsts), "gaps": sum(t["gaps"] for c in level_calls
                                                  for t in c["turns"]),
            "gap_ms": float(sum(t["gap_ms"] for c in level_calls for t in c["turns"])),
            "mos": 4.3 - 0.1 * index, "r_factor": 90.0 - 2.0 * index,
            "lateness_ms": {"p99": [0.4, 1.1, 31.0][index]},
            "passed": [True, False, None][index],
            "withheld": WITHHELD if index == 2 else None,
        })
        calls.extend(level_calls)
    return {
        "meta": {
            "version": 2, "target": TARGET, "transport": "twilio", "scenario": "menu",
            "started": "2025-11-30T01:00:00+00:00", "duration_s": 60.0, "workers": 1,
            "simulator_lateness_ms": {"p50": 0.21, "p99": 12.5, "max": 40.2},
            "slo": "ttfa_p95<400ms,gaps=0", "slo_passed": False,
            "warnings": ["offered concurrency 20 exceeds the gateway's call budget "
                         "(max_calls 16 in /readyz)"],
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
    assert "Level ×20: latency figures withheld" in page
    assert WITHHELD in page
    assert 'class="withheld"' in page  # the withheld level's row is marked
    # markupsafe (Jinja2's autoescape) writes ' as &#39;
    assert "Simulator&#39;s own lateness" in page and "p99 12.50" in page
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


def test_every_level_withheld_renders_cleanly_and_deterministically() -> None:
    doc = synthetic_document()
    for level in doc["levels"]:
        level["withheld"] = WITHHELD
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. matplotlib's "no artists with labels" legend
        page = build_html(doc)
    assert page.count("latency figures withheld by the simulator") == 3
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
    for level, verdict in zip(doc["levels"], ("pass", "FAIL", "withheld"), strict=True):
        p95 = f"{level['ttfa_ms']['p95']:,.0f}"
        row = next(line for line in text.splitlines()
                   if re.match(rf"\W*{level['concurrency']}\b", line))
        assert verdict in row
        # Withheld figures are not printed beside "withheld" (they would still be read).
        assert (p95 not in row and row.count("—") == 3) if verdict == "withheld" \
            else p95 in row
    assert "SLO ttfa_p95<400ms,gaps=0: missed" in text
    assert "latency figures withheld at ×20 (simulator lateness too large" in text


def _render(renderables: list[Any], width: int) -> list[str]:
    console = Console(record=True, width=width, color_system=None)
    for renderable in renderables:
        console.print(renderable)
    return console.export_text().splitlines()


def test_summary_fits_80_columns_with_every_figure_whole() -> None:
    doc = synthetic_document()
    lines = _render([render_summary_table(doc), render_breakdown(doc)], 80)
    assert max(len(line) for line in lines) <= 80
    assert not any("…" in line for line in lines)  # nothing cut to fit
    for level, verdict in zip(doc["levels"], ("pass", "FAIL", "withheld"), strict=True):
        row = next(line for line in lines if re.match(rf"\s*×{level['concurrency']}\s", line))
        cells = row.split()
        assert cells[:4] == [f"×{level['concurrency']}", f"{level['calls']:,}",
                             f"{level['refused']:,}", f"{level['errors']:,}"]
        assert cells[-1] == verdict
        p95 = f"{level['ttfa_ms']['p95']:,.0f}"
        assert (p95 not in cells and cells[4:7] == ["—"] * 3) if verdict == "withheld" \
            else p95 in cells
        # One line per level: placed calls and their rate, completed / refused / failed.
        assert (f"×{level['concurrency']}: {level['calls']:,} calls placed "
                f"({level['placed_per_s']:,.2f}/s), {level['completed']:,} completed, "
                f"{level['refused']:,} refused, {level['errors']:,} failed") in lines
    # Grouped by cause, refusals apart from failures, each cause in full.
    text = " ".join(lines)
    refused_row = next(line for line in lines if " refused " in line and "busy" in line)
    assert refused_row.split()[:3] == ["7", "refused", "×10,"]
    failed_row = next(line for line in lines if " failed " in line and "1011" in line)
    assert failed_row.split()[:3] == ["3", "failed", "×10,"]
    assert BUSY in text and ERROR in text


def test_summary_blocks_per_speech_for_a_capacity_search() -> None:
    doc = synthetic_document()
    for level, speech in zip(doc["levels"], ("cached", "cached", "live"), strict=True):
        level["speech"] = speech
    doc["levels"][2]["characters_per_s"] = 31.25
    doc["meta"]["capacity"] = {
        "cached": {"concurrency": 5, "target": TARGET, "scenario": "menu",
                   "characters_per_s": None, "hourly_cost": 2.5, "cost_per_million_chars": None},
        "live": {"concurrency": 20, "target": TARGET, "scenario": "live",
                 "characters_per_s": 31.25, "hourly_cost": 2.5,
                 "cost_per_million_chars": 2.5 / 3600 / 31.25 * 1e6},
    }
    lines = _render([render_summary_table(doc)], 80)
    assert max(len(line) for line in lines) <= 80
    assert "cached speech: menu → http://127.0.0.1:8000 (twilio)" in lines[0]
    assert any(line.startswith("live speech: live → http://127.0.0.1:8000") for line in lines)
    assert any("31.2 characters/s synthesised" in line for line in lines)
    page = build_html(doc)
    assert "Capacity per gateway machine at the SLO" in page
    assert "$22.22" in page  # 2.50 $/h over 31.25 characters/s, per million


def test_progress_line_never_wraps() -> None:
    from gateway.loadsim.cli import progress_line

    state = {"concurrency": 20, "elapsed": 12.345, "active": 16, "placed": 40, "refused": 4,
             "failed": 0, "ttfa_p95": 180.4, "lateness_ms": 1.23}
    line = progress_line(state, 80)
    assert line == ("×20  12.3s  active 16  placed 40  refused 4  failed 0  p95 180ms  "
                    "late 1.2ms")
    assert progress_line({**state, "offered": "5/s"}, 80).startswith("5/s  12.3s  active 16")
    huge = {**state, "concurrency": 10_000, "active": 9_999, "placed": 1_234_567,
            "refused": 1_000_000, "failed": 99_999, "ttfa_p95": 123_456.0}
    for width in (40, 80):
        assert len(progress_line(huge, width)) == width - 1


def test_refused_calls_are_counted_apart_from_failures_in_the_report() -> None:
    page = build_html(synthetic_document())
    # The level rows: placed, completed, refused, failed, placed/s side by side.
    assert "<td>35</td><td>28</td><td>5</td><td>2</td><td>2.19</td>" in page
    assert '<td class="l refused">refused</td><td class="l">×10, ×20</td>' in page
    assert '<td class="l failed">failed</td>' in page
    assert "busy TwiML: Sorry, all our lines are busy right now." in page
    assert "exceeds the gateway&#39;s call budget (max_calls 16 in /readyz)" in page


def test_version_1_documents_still_render() -> None:
    """Before refusals were counted, a level's "refused" held the withheld-figures reason."""
    doc = synthetic_document()
    for level in doc["levels"]:
        level["refused"] = level.pop("withheld")
        for key in ("completed", "refused_by", "failures_by", "placed_per_s", "duration_s"):
            level.pop(key)
    page = build_html(doc)
    assert page.count("latency figures withheld by the simulator") == 1 and WITHHELD in page
    lines = _render([render_summary_table(doc)], 80)
    assert any(line.split()[-1:] == ["withheld"] for line in lines)


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
    # Each colour as one 24-bit number: np.unique over rows (axis=0) sorts 3M structured rows,
    # 5 CPU-s; over packed integers, 0.1 s.
    packed = (rgb[:, 0].astype(np.uint32) << 16) | (rgb[:, 1].astype(np.uint32) << 8) | rgb[:, 2]
    colours, counts = np.unique(packed, return_counts=True)
    # Text, tables, banners and four anti-aliased plots: far from a blank page.
    assert len(colours) > 200
    assert counts.max() / len(rgb) < 0.9
    ink = np.count_nonzero(rgb.min(axis=1) < 200) / len(rgb)
    assert ink > 0.02
    # The withheld-level banner's fill (#fff4e5) is on screen.
    banner = np.all(np.abs(rgb.astype(int) - (0xFF, 0xF4, 0xE5)) <= 1, axis=1)
    assert np.count_nonzero(banner) > 5000


def _figures(doc: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The report's matplotlib figures, by plot name, as build_html draws them."""
    from gateway.loadsim import report

    figures: dict[str, Any] = {}
    monkeypatch.setattr(report, "_svg", lambda fig, name: figures.setdefault(name, fig) and "")
    build_html(doc)
    return figures


def test_withheld_notes_stay_inside_the_plot_and_the_hollow_markers_have_a_legend(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    doc = synthetic_document()  # x20 is withheld
    fig = _figures(doc, monkeypatch)["latency-vs-concurrency"]
    ax = fig.axes[0]
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    title = ax.title.get_window_extent(renderer)
    box = ax.get_window_extent(renderer)
    notes = [t for t in ax.texts if t.get_text() == "withheld"]
    assert notes
    for note in notes:
        extent = note.get_window_extent(renderer)
        assert not extent.overlaps(title), "the note covers the plot's title"
        assert box.y0 <= extent.y0 and extent.y1 <= box.y1, "the note is outside the axes"
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "figures withheld" in legend and "p95" in legend


def test_gap_panels_without_gaps_say_so_instead_of_a_0_to_0_05_axis(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    doc = synthetic_document()
    for call in doc["calls"]:
        for turn in call["turns"]:
            turn["gaps"], turn["gap_ms"] = 0, 0.0
    fig = _figures(doc, monkeypatch)["gaps-over-time"]
    _, ax_ms, ax_n = fig.axes
    for ax in (ax_ms, ax_n):
        assert ax.get_ylim() == (0.0, 1.0)
        assert any(t.get_text() == "no gaps heard" for t in ax.texts)
