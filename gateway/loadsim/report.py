"""The load simulator's report: one self-contained HTML file, and the end-of-run terminal table.

Both are built from the simulator's JSON result document (a plain ``dict``), so a result file
written on one host can be rendered on another, and this module does not depend on the
simulator's classes. The document is read once into the small typed view below (STYLE.md
rule 9); a document that cannot be read raises :class:`ReportDataError` naming the field.

The HTML file works offline and forever: the plots are SVG drawn by matplotlib (its SVG
backend, never pyplot, so no GUI backend is chosen and no global figure state is touched)
and embedded inline, the CSS is inline, and there is no JavaScript, no web font and no
external reference. Text in the plots is drawn as glyph paths, so it renders the same without
any font installed.

Document layout (missing optional fields render as "—")::

    {"meta": {"target", "transport", "scenario", "started", "duration_s", "workers",
              "simulator_lateness_ms": {"p50", "p99", "max"}, "slo", "slo_passed"},
     "levels": [{"concurrency", "calls", "errors", "dropped", "ttfa_ms": {"p50", "p95", "p99"},
                 "gaps", "gap_ms", "mos", "r_factor", "lateness_ms": {"p99"}, "passed",
                 "refused": null | "reason"}],
     "calls": [{"id", "level" (index into "levels"), "setup_ms", "error",
                "turns": [{"kind", "at_s", "first_audio_ms", "gaps", "gap_ms", "barge_in_ms",
                           "timed_out"}],
                "jitter_ms", "mark_rtt_ms", "loss_pct"}]}
"""

from __future__ import annotations

import html
import io
import itertools
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from rich.table import Table

from gateway.errors import GatewayError

if TYPE_CHECKING:
    from matplotlib.typing import RcKeyType

__all__ = ["ReportDataError", "build_html", "render_report", "render_summary_table"]


class ReportDataError(GatewayError):
    """The result document is not shaped as the simulator writes it."""


# --- typed view of the document ---------------------------------------------------------------


def _where(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _num(obj: Mapping[str, Any], key: str, path: str) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ReportDataError(f"{_where(path, key)}: expected a number, got {value!r}")
    # JSON has no NaN, but Python's json module writes one; treat it as "not measured".
    return float(value) if math.isfinite(value) else None


def _int(obj: Mapping[str, Any], key: str, path: str, default: int = 0) -> int:
    value = _num(obj, key, path)
    return default if value is None else int(value)


def _str(obj: Mapping[str, Any], key: str, path: str) -> str | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ReportDataError(f"{_where(path, key)}: expected a string, got {value!r}")
    return value


def _bool(obj: Mapping[str, Any], key: str, path: str) -> bool | None:
    value = obj.get(key)
    if value is None or isinstance(value, bool):
        return value
    raise ReportDataError(f"{_where(path, key)}: expected true, false or null, got {value!r}")


def _mapping(obj: Mapping[str, Any], key: str, path: str) -> Mapping[str, Any]:
    value = obj.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ReportDataError(f"{_where(path, key)}: expected an object, got {value!r}")
    return value


def _list(obj: Mapping[str, Any], key: str, path: str) -> list[Any]:
    value = obj.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise ReportDataError(f"{_where(path, key)}: expected a list, got {type(value).__name__}")
    return value


def _object(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ReportDataError(f"{path}: expected an object, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class _Pcts:
    p50: float | None = None
    p95: float | None = None
    p99: float | None = None
    max: float | None = None

    @classmethod
    def parse(cls, obj: Mapping[str, Any], path: str) -> _Pcts:
        return cls(*(_num(obj, k, path) for k in ("p50", "p95", "p99", "max")))


@dataclass(frozen=True, slots=True)
class _Meta:
    target: str
    transport: str
    scenario: str
    started: str | None
    duration_s: float | None
    workers: int | None
    lateness: _Pcts
    slo: str | None
    slo_passed: bool | None

    @classmethod
    def parse(cls, obj: Mapping[str, Any]) -> _Meta:
        p = "meta"
        workers = _num(obj, "workers", p)
        return cls(
            target=_str(obj, "target", p) or "?",
            transport=_str(obj, "transport", p) or "?",
            scenario=_str(obj, "scenario", p) or "?",
            started=_str(obj, "started", p),
            duration_s=_num(obj, "duration_s", p),
            workers=None if workers is None else int(workers),
            lateness=_Pcts.parse(_mapping(obj, "simulator_lateness_ms", p), f"{p}.lateness"),
            slo=_str(obj, "slo", p),
            slo_passed=_bool(obj, "slo_passed", p),
        )


@dataclass(frozen=True, slots=True)
class _Level:
    concurrency: int
    calls: int
    errors: int
    dropped: int
    ttfa: _Pcts
    gaps: int
    gap_ms: float
    mos: float | None
    r_factor: float | None
    lateness: _Pcts
    passed: bool | None
    refused: str | None

    @classmethod
    def parse(cls, obj: Mapping[str, Any], path: str) -> _Level:
        return cls(
            concurrency=_int(obj, "concurrency", path),
            calls=_int(obj, "calls", path),
            errors=_int(obj, "errors", path),
            dropped=_int(obj, "dropped", path),
            ttfa=_Pcts.parse(_mapping(obj, "ttfa_ms", path), f"{path}.ttfa_ms"),
            gaps=_int(obj, "gaps", path),
            gap_ms=_num(obj, "gap_ms", path) or 0.0,
            mos=_num(obj, "mos", path),
            r_factor=_num(obj, "r_factor", path),
            lateness=_Pcts.parse(_mapping(obj, "lateness_ms", path), f"{path}.lateness_ms"),
            passed=_bool(obj, "passed", path),
            refused=_str(obj, "refused", path) or None,
        )


@dataclass(frozen=True, slots=True)
class _Turn:
    kind: str
    at_s: float
    first_audio_ms: float | None
    gaps: int
    gap_ms: float
    barge_in_ms: float | None
    timed_out: bool

    @classmethod
    def parse(cls, obj: Mapping[str, Any], path: str) -> _Turn:
        return cls(
            kind=_str(obj, "kind", path) or "?",
            at_s=_num(obj, "at_s", path) or 0.0,
            first_audio_ms=_num(obj, "first_audio_ms", path),
            gaps=_int(obj, "gaps", path),
            gap_ms=_num(obj, "gap_ms", path) or 0.0,
            barge_in_ms=_num(obj, "barge_in_ms", path),
            timed_out=bool(_bool(obj, "timed_out", path)),
        )


@dataclass(frozen=True, slots=True)
class _Call:
    id: str
    level: int
    setup_ms: float | None
    error: str | None
    turns: tuple[_Turn, ...]
    jitter_ms: float | None
    mark_rtt_ms: tuple[float, ...]
    loss_pct: float | None

    @classmethod
    def parse(cls, obj: Mapping[str, Any], path: str) -> _Call:
        rtts = []
        for i, value in enumerate(_list(obj, "mark_rtt_ms", path)):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ReportDataError(f"{path}.mark_rtt_ms[{i}]: expected a number, got {value!r}")
            rtts.append(float(value))
        turns = tuple(
            _Turn.parse(_object(t, f"{path}.turns[{i}]"), f"{path}.turns[{i}]")
            for i, t in enumerate(_list(obj, "turns", path))
        )
        return cls(
            id=_str(obj, "id", path) or "?",
            level=_int(obj, "level", path),
            setup_ms=_num(obj, "setup_ms", path),
            error=_str(obj, "error", path) or None,
            turns=turns,
            jitter_ms=_num(obj, "jitter_ms", path),
            mark_rtt_ms=tuple(rtts),
            loss_pct=_num(obj, "loss_pct", path),
        )


@dataclass(frozen=True, slots=True)
class _Run:
    meta: _Meta
    levels: tuple[_Level, ...]
    calls: tuple[_Call, ...]

    @classmethod
    def parse(cls, data: Mapping[str, Any]) -> _Run:
        data = _object(data, "document")
        levels = tuple(
            _Level.parse(_object(lv, f"levels[{i}]"), f"levels[{i}]")
            for i, lv in enumerate(_list(data, "levels", ""))
        )
        calls = tuple(
            _Call.parse(_object(c, f"calls[{i}]"), f"calls[{i}]")
            for i, c in enumerate(_list(data, "calls", ""))
        )
        return cls(_Meta.parse(_mapping(data, "meta", "")), levels, calls)

    def level_label(self, index: int) -> str:
        """A call's ``level`` is the index of its level; people read the concurrency."""
        if 0 <= index < len(self.levels):
            return f"×{self.levels[index].concurrency}"
        return f"level {index}"


# --- formatting -------------------------------------------------------------------------------

_DASH = "—"


def _fmt(value: float | None, digits: int = 0) -> str:
    if value is None:
        return _DASH
    return f"{value:,.{digits}f}"


def _verdict(level: _Level) -> str:
    if level.refused:
        return "refused"
    if level.passed is None:
        return _DASH
    return "pass" if level.passed else "FAIL"


def _percentile(values: Sequence[float], q: float) -> float | None:
    # numpy's default (linear) method, as the simulator's own percentiles use.
    return float(np.percentile(np.asarray(values, dtype=float), q)) if values else None


# --- plots ------------------------------------------------------------------------------------

# Okabe-Ito: distinguishable with the common colour-vision deficiencies.
_PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000")
_RC: dict[RcKeyType, Any] = {
    "font.size": 9.0,
    "axes.titlesize": 10.0,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "svg.fonttype": "path",  # glyphs as paths: no font needed where the report is opened
}
_SVG_META = {"Date": None, "Creator": None, "Format": None, "Type": None}
_ID_ATTR = re.compile(r'\bid="([^"]+)"')
_HREF_ATTR = re.compile(r'\bxlink:href="#([^"]+)"')
_URL_REF = re.compile(r"url\(#([^)]+)\)")


def _colour(index: int) -> str:
    return _PALETTE[index % len(_PALETTE)]


def _svg(fig: Figure, name: str) -> str:
    """The figure as an ``<svg>`` element to paste into HTML.

    Every SVG that matplotlib writes reuses the same element ids (``figure_1``, glyph ids such
    as ``DejaVuSans-14`` that name different glyphs in different files, clip paths), and ids are
    document-wide once several SVGs are inlined into one HTML page, so each id and every
    reference to it gets the plot's own prefix. The XML prolog, DOCTYPE, metadata and
    namespace declarations go: the HTML parser puts ``<svg>`` in the SVG namespace itself.
    """
    buffer = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": name}):
        fig.savefig(buffer, format="svg", metadata=_SVG_META)
    text = buffer.getvalue()
    text = text[text.index("<svg") :]
    text = re.sub(r"<metadata>.*?</metadata>\s*", "", text, flags=re.DOTALL)
    text = re.sub(r'\s+xmlns(?::\w+)?="[^"]*"', "", text)
    text = re.sub(r'\s+version="1\.1"', "", text)
    text = _ID_ATTR.sub(lambda m: f'id="{name}-{m.group(1)}"', text)
    text = _HREF_ATTR.sub(lambda m: f'href="#{name}-{m.group(1)}"', text)
    text = _URL_REF.sub(lambda m: f"url(#{name}-{m.group(1)})", text)
    # A label for screen readers; the figure's caption in the page says the rest.
    return text.replace("<svg ", f'<svg role="img" aria-label="{html.escape(name)}" ', 1)


def _figure(height: float = 3.4, rows: int = 1) -> tuple[Figure, list[Axes]]:
    """A figure for one plot; call it inside ``rc_context(_RC)``, which styles its axes."""
    fig = Figure(figsize=(9.0, height), layout="constrained")
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0].tolist()
    return fig, axes


def _no_data(ax: Axes, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} in this run", ha="center", va="center",
            transform=ax.transAxes, color="#666666")
    ax.set_xticks([])
    ax.set_yticks([])


def _first_audio_by_level(run: _Run) -> dict[int, list[float]]:
    by_level: dict[int, list[float]] = {}
    for call in run.calls:
        for turn in call.turns:
            if turn.first_audio_ms is not None:
                by_level.setdefault(call.level, []).append(turn.first_audio_ms)
    return dict(sorted(by_level.items()))


def _x_limit(values: Sequence[float]) -> float:
    """Where to cut the latency axis: one stuck turn (a 15 s timeout) must not squash the rest
    into the first bin. Everything up to 1.5 x p99 stays visible; what lies beyond is counted."""
    top = max(values)
    p99 = _percentile(values, 99) or top
    p50 = _percentile(values, 50) or top
    return top if top <= max(1.5 * p99, 3.0 * p50) else max(1.5 * p99, 3.0 * p50)


def _plot_ttfa_histogram(run: _Run) -> str:
    by_level = _first_audio_by_level(run)
    with matplotlib.rc_context(_RC):
        fig, (ax,) = _figure()
        values = [v for vs in by_level.values() for v in vs]
        if not values:
            _no_data(ax, "first-audio measurements")
        else:
            limit = _x_limit(values)
            edges = np.histogram_bin_edges([v for v in values if v <= limit], bins="auto")
            if len(edges) > 61:
                edges = np.linspace(edges[0], edges[-1], 61)
            ax.hist(
                [[v for v in vs if v <= limit] for vs in by_level.values()],
                bins=edges.tolist(),
                stacked=True,
                color=[_colour(i) for i in by_level],
                label=[f"{run.level_label(i)} callers" for i in by_level],
            )
            hidden = sum(v > limit for v in values)
            if hidden:
                ax.annotate(f"{hidden} turn(s) above {limit:,.0f} ms not shown",
                            xy=(0.99, 0.97), xycoords="axes fraction", ha="right", va="top",
                            color="#a33")
            ax.legend(title="concurrency", loc="upper right",
                      bbox_to_anchor=(1.0, 0.9 if hidden else 1.0))
            ax.set_xlabel("time to first audio (ms)")
            ax.set_ylabel("turns")
        ax.set_title("First-audio latency: caller's turn to first audio byte heard")
        return _svg(fig, "ttfa-histogram")


def _plot_ttfa_cdf(run: _Run) -> str:
    by_level = _first_audio_by_level(run)
    with matplotlib.rc_context(_RC):
        fig, (ax,) = _figure()
        values = sorted(v for vs in by_level.values() for v in vs)
        if not values:
            _no_data(ax, "first-audio measurements")
        else:
            for index, level_values in by_level.items():
                xs = np.sort(np.asarray(level_values))
                ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", lw=1.0,
                        alpha=0.7, color=_colour(index), label=f"{run.level_label(index)}")
            xs = np.asarray(values)
            ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", lw=2.2,
                    color="#222222", label="all turns")
            for q, style in ((50, "--"), (95, ":")):
                value = _percentile(values, q)
                assert value is not None
                ax.axvline(value, color="#b00020", ls=style, lw=1.2)
                ax.axhline(q / 100, color="#b00020", ls=style, lw=0.6, alpha=0.5)
                ax.annotate(f"p{q} {value:,.0f} ms", xy=(value, q / 100), xytext=(6, -12),
                            textcoords="offset points", color="#b00020", fontweight="bold")
            ax.set_xlim(0, _x_limit(values) * 1.02)
            ax.set_ylim(0, 1.02)
            ax.set_xlabel("time to first audio (ms)")
            ax.set_ylabel("fraction of turns ≤ x")
            ax.legend(title="concurrency", loc="lower right")
        ax.set_title("First-audio latency, cumulative (p50 and p95 of all turns marked)")
        return _svg(fig, "ttfa-cdf")


def _plot_latency_vs_concurrency(run: _Run) -> str:
    with matplotlib.rc_context(_RC):
        fig, (ax,) = _figure()
        points = [lv for lv in run.levels if lv.ttfa.p50 is not None]
        if not points:
            _no_data(ax, "levels with latency figures")
        else:
            x = [lv.concurrency for lv in points]
            for key, colour, marker in (("p50", _PALETTE[0], "o"), ("p95", _PALETTE[1], "s"),
                                        ("p99", _PALETTE[5], "^")):
                ys = [getattr(lv.ttfa, key) for lv in points]
                kept = [(cx, y) for cx, y, lv in zip(x, ys, points, strict=True)
                        if y is not None and not lv.refused]
                if kept:
                    ax.plot(*zip(*kept, strict=True), marker=marker, color=colour, label=key)
                refused = [(cx, y) for cx, y, lv in zip(x, ys, points, strict=True)
                           if y is not None and lv.refused]
                if refused:
                    ax.plot(*zip(*refused, strict=True), ls="none", marker=marker,
                            mfc="none", color="#999999")
            for lv in points:
                if lv.refused:
                    top = max(v for v in (lv.ttfa.p50, lv.ttfa.p95, lv.ttfa.p99) if v is not None)
                    ax.annotate("refused", xy=(lv.concurrency, top), xytext=(0, 8),
                                textcoords="offset points", ha="center", color="#a33")
            ax.set_xticks(sorted(set(x)))
            ax.set_ylim(bottom=0)
            ax.set_xlabel("concurrent calls")
            ax.set_ylabel("time to first audio (ms)")
            if ax.get_legend_handles_labels()[1]:  # none when every level was refused
                ax.legend(title="percentile", loc="upper left")
        ax.set_title("First-audio latency vs load (hollow grey: figures refused)")
        return _svg(fig, "latency-vs-concurrency")


def _level_offsets(run: _Run) -> tuple[dict[int, float], bool]:
    """Seconds to add to each level's turn stamps so levels follow each other on one axis.

    ``at_s`` is meant to count from the start of the run; a simulator that restarts its clock
    for every level (the stamps of a later level begin before an earlier level's end) gets its
    levels laid end to end instead, in level order. Returns the offsets and whether any moved.
    """
    stamps: dict[int, list[float]] = {}
    for call in run.calls:
        for turn in call.turns:
            stamps.setdefault(call.level, []).append(turn.at_s)
    order = sorted(stamps)
    restarted = any(min(stamps[b]) < max(stamps[a]) for a, b in itertools.pairwise(order))
    if not restarted:
        return dict.fromkeys(order, 0.0), False
    offsets: dict[int, float] = {}
    cursor = 0.0
    for level in order:
        offsets[level] = cursor
        cursor += math.floor(max(stamps[level])) + 1.0
    return offsets, True


def _plot_gaps_over_time(run: _Run, duration_s: float | None) -> tuple[str, bool]:
    offsets, restarted = _level_offsets(run)
    turns = [(call.level, turn.at_s + offsets[call.level], turn)
             for call in run.calls for turn in call.turns]
    with matplotlib.rc_context(_RC):
        fig, (ax_ms, ax_n) = _figure(height=4.2, rows=2)
        if not turns:
            _no_data(ax_ms, "turns")
            _no_data(ax_n, "turns")
        else:
            end = max(t for _, t, _ in turns)
            if not restarted:
                end = max(end, duration_s or 0.0)
            buckets = math.floor(end) + 1
            gap_ms = np.zeros(buckets)
            gap_count = np.zeros(buckets)
            # The document stamps each turn with its start; gaps heard during the turn are
            # counted in the second it started in.
            for _, at, turn in turns:
                second = min(buckets - 1, max(0, int(at)))
                gap_ms[second] += turn.gap_ms
                gap_count[second] += turn.gaps
            starts = np.arange(buckets)
            ax_ms.bar(starts, gap_ms, width=1.0, align="edge", color=_PALETTE[5])
            ax_n.bar(starts, gap_count, width=1.0, align="edge", color=_PALETTE[0])
            spans: dict[int, list[float]] = {}
            for level, at, _ in turns:
                spans.setdefault(level, []).append(at)
            for n, (level, ats) in enumerate(sorted(spans.items())):
                for ax in (ax_ms, ax_n):
                    ax.axvspan(min(ats), max(ats) + 1.0, color=_colour(level),
                               alpha=0.10 if n % 2 == 0 else 0.18, lw=0)
                ax_ms.annotate(run.level_label(level), xy=(min(ats), 1.0),
                               xycoords=("data", "axes fraction"), xytext=(3, -3),
                               textcoords="offset points", va="top", color="#444444")
            ax_ms.set_ylabel("gap audio (ms / s)")
            ax_n.set_ylabel("gaps (count / s)")
            clock = "levels end to end" if restarted else "since run start"
            ax_n.set_xlabel(f"time {clock} (s), 1 s buckets; shading: concurrency level")
            ax_n.set_xlim(0, buckets)
            ax_ms.set_ylim(bottom=0)
            ax_n.set_ylim(bottom=0)
        ax_ms.set_title("Audio gaps (underruns heard by callers) over the run")
        return _svg(fig, "gaps-over-time"), restarted


# --- HTML -------------------------------------------------------------------------------------

_CSS = """
:root { color-scheme: light; }
* { box-sizing: border-box; }
body { margin: 0; padding: 24px 32px 48px; font: 14px/1.45 system-ui, -apple-system,
  "Segoe UI", "DejaVu Sans", sans-serif; color: #1d1d1f; background: #fafafa; }
main { max-width: 1200px; margin: 0 auto; }
h1 { font-size: 22px; margin: 0 0 4px; }
h2 { font-size: 17px; margin: 32px 0 8px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
.sub { color: #555; margin: 0 0 16px; }
nav a { margin-right: 14px; color: #0b57d0; text-decoration: none; }
.banner { padding: 10px 14px; border-radius: 6px; margin: 8px 0; font-weight: 600;
  border: 2px solid; }
.banner.warn { background: #fff4e5; border-color: #e8a33d; color: #7a4100; }
.banner.fail { background: #fdecec; border-color: #d33; color: #8a1010; }
.banner.ok { background: #e9f7ef; border-color: #2e9e5b; color: #135c31; }
.banner small { display: block; font-weight: 400; margin-top: 2px; }
.scroll { overflow-x: auto; }
table { border-collapse: collapse; background: #fff; margin: 6px 0 4px; font-size: 12.5px; }
th, td { border: 1px solid #e1e1e1; padding: 3px 7px; text-align: right; white-space: nowrap; }
th { background: #f0f2f5; font-weight: 600; white-space: normal; vertical-align: bottom; }
td.l, th.l { text-align: left; }
span.wrap { white-space: normal; display: inline-block; max-width: 640px; }
tr.refused td { color: #8a8a8a; background: #fbf6ee; }
tr.refused td.verdict { color: #b35c00; font-weight: 700; }
td.pass { color: #137333; font-weight: 700; }
td.FAIL { color: #b00020; font-weight: 700; }
figure { margin: 14px 0; background: #fff; border: 1px solid #e1e1e1; border-radius: 6px;
  padding: 8px; }
figure svg { display: block; width: 100%; height: auto; }
figcaption { color: #555; font-size: 12.5px; margin-top: 4px; }
.note { color: #555; font-size: 12.5px; }
footer { margin-top: 36px; color: #666; font-size: 12px; }
"""


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _table(headers: Sequence[str], rows: Iterable[tuple[Sequence[str], str]],
           left: int = 1) -> str:
    """An HTML table; ``rows`` are (already escaped cells, row class); first ``left`` columns
    are left-aligned text."""
    head = "".join(f'<th class="l">{h}</th>' if i < left else f"<th>{h}</th>"
                   for i, h in enumerate(headers))
    body = []
    for cells, css in rows:
        tds = "".join(f'<td class="l">{c}</td>' if i < left else f"<td>{c}</td>"
                      for i, c in enumerate(cells))
        body.append(f'<tr class="{css}">{tds}</tr>' if css else f"<tr>{tds}</tr>")
    return (f'<div class="scroll"><table><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(body)}</tbody></table></div>")


def _banners(run: _Run) -> str:
    parts = []
    meta = run.meta
    if meta.slo:
        if meta.slo_passed is True:
            parts.append(f'<div class="banner ok">SLO met: {_e(meta.slo)}</div>')
        elif meta.slo_passed is False:
            parts.append(f'<div class="banner fail">SLO missed: {_e(meta.slo)}</div>')
        else:
            parts.append(f'<div class="banner warn">SLO not evaluated: {_e(meta.slo)}</div>')
    for level in run.levels:
        if level.refused:
            parts.append(
                f'<div class="banner warn" role="alert">⚠ Level ×{level.concurrency}: '
                f"latency figures refused by the simulator (its own timing was too late to "
                f"trust them)<small>{_e(level.refused)}</small></div>"
            )
    if not run.calls:
        parts.append('<div class="banner warn">This document has no per-call samples: '
                     "the plots built from calls are empty.</div>")
    return "\n".join(parts)


def _meta_table(run: _Run) -> str:
    m = run.meta
    lat = m.lateness
    turns = sum(len(c.turns) for c in run.calls)
    rows = [
        ("Target", _e(m.target)),
        ("Transport", _e(m.transport)),
        ("Scenario", _e(m.scenario)),
        ("Started", _e(m.started or _DASH)),
        ("Duration", f"{_fmt(m.duration_s, 1)} s"),
        ("Worker processes", _fmt(m.workers)),
        ("Calls / turns", f"{len(run.calls):,} / {turns:,}"),
        ("Simulator's own lateness (ms)",
         f"p50 {_fmt(lat.p50, 2)} · p99 {_fmt(lat.p99, 2)} · max {_fmt(lat.max, 2)}"),
        ("SLO", _e(m.slo) if m.slo else _DASH),
        ("SLO verdict",
         _DASH if m.slo_passed is None else ("met" if m.slo_passed else "missed")),
    ]
    return _table(["Run", ""], [((_e(k), v), "") for k, v in rows], left=2)


def _levels_table(run: _Run) -> str:
    headers = ["Concurrency", "Calls", "Errors", "Dropped", "Timeouts", "First audio p50 (ms)",
               "p95 (ms)", "p99 (ms)", "Gaps", "Gap audio (ms)", "MOS", "R",
               "Sim. lateness p99 (ms)", "Verdict"]
    timeouts: Counter[int] = Counter()
    for call in run.calls:
        timeouts[call.level] += sum(t.timed_out for t in call.turns)
    rows = []
    for index, lv in enumerate(run.levels):
        verdict = _verdict(lv)
        cells = [
            f"×{lv.concurrency}", f"{lv.calls:,}", f"{lv.errors:,}", f"{lv.dropped:,}",
            f"{timeouts[index]:,}", _fmt(lv.ttfa.p50), _fmt(lv.ttfa.p95), _fmt(lv.ttfa.p99),
            f"{lv.gaps:,}", _fmt(lv.gap_ms), _fmt(lv.mos, 2), _fmt(lv.r_factor, 1),
            _fmt(lv.lateness.p99, 2),
        ]
        css = "refused" if lv.refused else ""
        verdict_cell = (f'<span title="{_e(lv.refused)}">refused</span>' if lv.refused
                        else _e(verdict))
        rows.append((cells, css, verdict, verdict_cell))
    head = "".join(f'<th class="l">{h}</th>' if i == 0 else f"<th>{h}</th>"
                   for i, h in enumerate(headers))
    body = []
    for cells, css, verdict, verdict_cell in rows:
        tds = "".join(f'<td class="l">{c}</td>' if i == 0 else f"<td>{c}</td>"
                      for i, c in enumerate(cells))
        tds += f'<td class="verdict {_e(verdict)}">{verdict_cell}</td>'
        body.append(f'<tr class="{css}">{tds}</tr>')
    return (f'<div class="scroll"><table><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(body)}</tbody></table></div>")


def _media_table(run: _Run) -> str:
    """Per level, what only the calls carry: setup, jitter, loss, mark round trip, barge-in."""
    grouped: dict[int, list[_Call]] = {}
    for call in run.calls:
        grouped.setdefault(call.level, []).append(call)
    rows = []
    for index, calls in sorted(grouped.items()):
        setup = [c.setup_ms for c in calls if c.setup_ms is not None]
        jitter = [c.jitter_ms for c in calls if c.jitter_ms is not None]
        loss = [c.loss_pct for c in calls if c.loss_pct is not None]
        rtt = [x for c in calls for x in c.mark_rtt_ms]
        barge = [t.barge_in_ms for c in calls for t in c.turns if t.barge_in_ms is not None]
        rows.append(([
            _e(run.level_label(index)), f"{len(calls):,}",
            _fmt(_percentile(setup, 50)), _fmt(_percentile(setup, 95)),
            _fmt(_percentile(jitter, 50), 1), _fmt(_percentile(jitter, 95), 1),
            _fmt(float(np.mean(loss)) if loss else None, 2),
            _fmt(_percentile(rtt, 50)), _fmt(_percentile(rtt, 95)),
            _fmt(_percentile(barge, 50)), _fmt(_percentile(barge, 95)),
        ], ""))
    if not rows:
        return '<p class="note">No calls in this document.</p>'
    return _table(["Concurrency", "Calls", "Setup p50 (ms)", "Setup p95 (ms)", "Jitter p50 (ms)",
                   "Jitter p95 (ms)", "Loss mean (%)", "Mark RTT p50 (ms)", "Mark RTT p95 (ms)",
                   "Barge-in p50 (ms)", "Barge-in p95 (ms)"], rows)


def _errors_table(run: _Run) -> str:
    counts: Counter[str] = Counter()
    levels: dict[str, set[int]] = {}
    for call in run.calls:
        if call.error:
            counts[call.error] += 1
            levels.setdefault(call.error, set()).add(call.level)
    if not counts:
        return '<p class="note">No call ended in an error.</p>'
    rows = []
    for error, count in counts.most_common():
        where = ", ".join(run.level_label(i) for i in sorted(levels[error]))
        rows.append(([f"{count:,}", _e(where), f'<span class="wrap">{_e(error)}</span>'], ""))
    return _table(["Calls", "Levels", "Error"], rows, left=3)


def _slowest_table(run: _Run, limit: int = 10) -> str:
    turns = [(t.first_audio_ms, call, t) for call in run.calls for t in call.turns
             if t.first_audio_ms is not None]
    if not turns:
        return '<p class="note">No first-audio measurements.</p>'
    turns.sort(key=lambda item: item[0], reverse=True)
    rows = [([_e(call.id), _e(run.level_label(call.level)), _e(t.kind), _fmt(t.at_s, 2),
              _fmt(first), f"{t.gaps:,}", _fmt(t.gap_ms)], "")
            for first, call, t in turns[:limit]]
    return _table(["Call", "Level", "Turn", "At (s)", "First audio (ms)", "Gaps",
                   "Gap audio (ms)"], rows, left=3)


def build_html(data: Mapping[str, Any]) -> str:
    """The report for one result document, as a complete self-contained HTML page."""
    run = _Run.parse(data)
    m = run.meta
    title = f"Load test: {m.scenario} → {m.target} ({m.transport})"
    gaps_svg, restarted = _plot_gaps_over_time(run, m.duration_s)
    figures = [
        ("ttfa-histogram", _plot_ttfa_histogram(run),
         "Every turn's time from the caller's action (answer, key, speech) to the first audio "
         "byte back, stacked by concurrency level."),
        ("ttfa-cdf", _plot_ttfa_cdf(run),
         "Fraction of turns that heard audio within x ms; dashed and dotted red lines mark "
         "p50 and p95 of all turns (numpy's linear percentile over the raw turns)."),
        ("latency-vs-concurrency", _plot_latency_vs_concurrency(run),
         "Per-level first-audio percentiles as the simulator aggregated them."),
        ("gaps-over-time", gaps_svg,
         "Silence inserted because audio arrived late, summed per second of the run (top) and "
         "counted (bottom). A turn's gaps are placed in the second the turn started."
         + (" Each level's clock started at 0, so the levels are drawn one after another."
            if restarted else "")),
    ]
    figure_html = "\n".join(
        f'<figure id="fig-{name}">{svg}<figcaption>{_e(caption)}</figcaption></figure>'
        for name, svg, caption in figures
    )
    nav = " ".join(f'<a href="#{a}">{t}</a>' for a, t in (
        ("summary", "Summary"), ("levels", "Levels"), ("plots", "Plots"),
        ("calls", "Calls"), ("notes", "Notes")))
    started = f"started {_e(m.started)} · " if m.started else ""
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{_e(title)}</title>
<style>{_CSS}</style>
</head>
<body>
<main>
<h1>{_e(title)}</h1>
<p class="sub">{started}{_fmt(m.duration_s, 1)} s · {len(run.levels)} level(s) ·
{len(run.calls):,} calls</p>
<nav>{nav}</nav>
{_banners(run)}
<h2 id="summary">Summary</h2>
{_meta_table(run)}
<h2 id="levels">Per level</h2>
{_levels_table(run)}
<p class="note">Rows greyed out are levels whose latency figures the simulator refused: its own
scheduling lateness was too large a share of what it measured.</p>
<h3>Call setup and media, from the calls</h3>
{_media_table(run)}
<h2 id="plots">Plots</h2>
{figure_html}
<h2 id="calls">Calls</h2>
<h3>Errors</h3>
{_errors_table(run)}
<h3>Slowest turns</h3>
{_slowest_table(run)}
<h2 id="notes">Notes</h2>
<p class="note">MOS and R are the simulator's ITU-T G.107 E-model estimates
(gateway.loadsim.emodel) for G.711 with packet-loss concealment (Ie = 0, Bpl = 25.1 from ITU-T
G.113 Appendix I) from each call's measured delay and loss, every other parameter at its G.107
default (unimpaired: R = 93.2, MOS 4.41). They rate what a listener would hear, not what was
said. First-audio latency is measured from the caller's action to the first audio byte back.
</p>
<footer>gateway loadsim report · self-contained: no scripts, no external resources.</footer>
</main>
</body>
</html>
"""


def render_report(data: Mapping[str, Any], path: Path) -> Path:
    """Write the HTML report for ``data`` (the simulator's result document) to ``path``.

    Returns ``path``. Raises :class:`ReportDataError` if the document cannot be read.
    """
    page = build_html(data)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path


def render_summary_table(data: Mapping[str, Any]) -> Table:
    """The end-of-run table the CLI prints: one row per concurrency level."""
    run = _Run.parse(data)
    m = run.meta
    table = Table(title=f"{m.scenario} → {m.target} ({m.transport})", title_justify="left")
    for header in ("concurrency", "calls", "errors", "dropped"):
        table.add_column(header, justify="right")
    for header in ("ttfa p50 ms", "p95 ms", "p99 ms", "gaps", "gap ms", "MOS", "R",
                   "lateness p99 ms"):
        table.add_column(header, justify="right")
    table.add_column("result", justify="left")
    styles = {"pass": "bold green", "FAIL": "bold red", "refused": "bold yellow"}
    for lv in run.levels:
        verdict = _verdict(lv)
        table.add_row(
            f"{lv.concurrency}", f"{lv.calls}", f"{lv.errors}", f"{lv.dropped}",
            _fmt(lv.ttfa.p50), _fmt(lv.ttfa.p95), _fmt(lv.ttfa.p99), f"{lv.gaps}",
            _fmt(lv.gap_ms), _fmt(lv.mos, 2), _fmt(lv.r_factor, 1), _fmt(lv.lateness.p99, 2),
            f"[{styles[verdict]}]{verdict}[/]" if verdict in styles else verdict,
            style="dim" if lv.refused else None,
        )
    captions = []
    if m.slo:
        state = {True: "met", False: "missed", None: "not evaluated"}[m.slo_passed]
        captions.append(f"SLO {m.slo}: {state}")
    refused = [lv.concurrency for lv in run.levels if lv.refused]
    if refused:
        captions.append("latency figures refused at concurrency "
                        + ", ".join(str(c) for c in refused)
                        + " (simulator lateness too large; add --workers)")
    if captions:
        table.caption = "; ".join(captions)
        table.caption_justify = "left"
    return table
