"""The load simulator's report: one self-contained HTML file, and the end-of-run terminal tables.

Both are built from the simulator's JSON result document (a plain ``dict``), so a result file
written on one host can be rendered on another, and this module does not depend on the
simulator's classes. The document is read once into the small typed view below (STYLE.md
rule 9); a document that cannot be read raises :class:`ReportDataError` naming the field.

The HTML page is rendered from a Jinja2 template shipped as package data
(``gateway/loadsim/templates/report.html.j2``) with autoescaping on, so every string from the
document (targets, failure causes, SLOs) is escaped by the template engine, not by hand. It
works offline and forever: the plots are SVG drawn by matplotlib (its SVG backend, never
pyplot, so no GUI backend is chosen and no global figure state is touched) and embedded
inline, the CSS is inline, and there is no JavaScript, no web font and no external reference.
Text in the plots is drawn as glyph paths, so it renders the same without any font installed.

The terminal summary fits an 80-column terminal: one table per measured speech (cached, live),
ten narrow columns, then one line per level and the calls that did not complete grouped by
cause.

Document layout (missing optional fields render as "—"; version 1 documents, whose levels
carried the withheld-figures reason as ``refused``, still render)::

    {"meta": {"version", "target", "transport", "scenario", "started", "duration_s", "workers",
              "simulator_lateness_ms": {"p50", "p99", "max"}, "slo", "slo_passed",
              "warnings": [str], "capacity": {speech: {"concurrency", "target", "scenario",
              "characters_per_s", "hourly_cost", "cost_per_million_chars"}}},
     "levels": [{"concurrency", "calls", "completed", "refused", "errors", "dropped",
                 "refused_by": {cause: n}, "failures_by": {cause: n}, "placed_per_s",
                 "duration_s", "ttfa_ms": {"p50", "p95", "p99"}, "gaps", "gap_ms", "mos",
                 "r_factor", "characters_per_s", "speech", "target", "lateness_ms": {"p99"},
                 "passed", "withheld": null | "reason"}],
     "calls": [{"id", "level" (index into "levels"), "setup_ms", "error", "refused",
                "started_s", "turns": [{"kind", "at_s", "first_audio_ms", "gaps", "gap_ms",
                "barge_in_ms", "timed_out"}], "jitter_ms", "mark_rtt_ms", "loss_pct"}]}
"""

from __future__ import annotations

import io
import itertools
import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib
import numpy as np
from jinja2 import Environment, PackageLoader, StrictUndefined
from markupsafe import Markup
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from gateway.errors import GatewayError

if TYPE_CHECKING:
    from matplotlib.typing import RcKeyType

__all__ = ["ReportDataError", "build_html", "render_breakdown", "render_report",
           "render_summary_table"]


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


def _counts(obj: Mapping[str, Any], key: str, path: str) -> tuple[tuple[str, int], ...]:
    """A ``{cause: count}`` object, largest first."""
    counts = _mapping(obj, key, path)
    out = []
    for cause in counts:
        out.append((str(cause), _int(counts, cause, f"{_where(path, key)}")))
    return tuple(sorted(out, key=lambda item: -item[1]))


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
class _Capacity:
    speech: str
    concurrency: int | None
    target: str | None
    scenario: str | None
    characters_per_s: float | None
    hourly_cost: float | None
    cost_per_million: float | None


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
    warnings: tuple[str, ...]
    capacity: tuple[_Capacity, ...]

    @classmethod
    def parse(cls, obj: Mapping[str, Any]) -> _Meta:
        p = "meta"
        workers = _num(obj, "workers", p)
        warnings = []
        for i, text in enumerate(_list(obj, "warnings", p)):
            if not isinstance(text, str):
                raise ReportDataError(f"{p}.warnings[{i}]: expected a string, got {text!r}")
            warnings.append(text)
        capacity = []
        for speech, raw in _mapping(obj, "capacity", p).items():
            where = f"{p}.capacity.{speech}"
            entry = _object(raw, where)
            conc = _num(entry, "concurrency", where)
            capacity.append(_Capacity(
                str(speech), None if conc is None else int(conc), _str(entry, "target", where),
                _str(entry, "scenario", where), _num(entry, "characters_per_s", where),
                _num(entry, "hourly_cost", where), _num(entry, "cost_per_million_chars", where)))
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
            warnings=tuple(warnings),
            capacity=tuple(capacity),
        )


@dataclass(frozen=True, slots=True)
class _Level:
    concurrency: int
    calls: int
    completed: int
    refused: int
    errors: int
    dropped: int
    refused_by: tuple[tuple[str, int], ...]
    failures_by: tuple[tuple[str, int], ...]
    #: Turns the gateway's /metrics said it failed (counted in ``errors``), by cause.
    gateway_failures_by: tuple[tuple[str, int], ...]
    placed_per_s: float | None
    duration_s: float | None
    ttfa: _Pcts
    gaps: int
    gap_ms: float
    mos: float | None
    r_factor: float | None
    characters_per_s: float | None
    speech: str | None
    target: str | None
    offered: str | None
    lateness: _Pcts
    passed: bool | None
    withheld: str | None
    #: ``agent`` scenario: the bot's first token -> the caller's first audio (None: not run).
    token_audio: _Pcts | None = None

    @property
    def label(self) -> str:
        """The load the level offered: "×20" callers, "5/s" arrivals, "×1→20" a ramp."""
        return self.offered or f"×{self.concurrency}"

    @classmethod
    def parse(cls, obj: Mapping[str, Any], path: str) -> _Level:
        # Version 1 documents carried the withheld-figures reason in "refused".
        legacy = obj.get("refused")
        if isinstance(legacy, str) or (legacy is None and "withheld" not in obj):
            withheld = legacy or None
            refused = 0
        else:
            withheld = _str(obj, "withheld", path) or None
            refused = _int(obj, "refused", path)
        calls = _int(obj, "calls", path)
        errors = _int(obj, "errors", path)
        completed = obj.get("completed")
        return cls(
            concurrency=_int(obj, "concurrency", path),
            calls=calls,
            completed=(calls - refused - errors if completed is None
                       else _int(obj, "completed", path)),
            refused=refused,
            errors=errors,
            dropped=_int(obj, "dropped", path),
            refused_by=_counts(obj, "refused_by", path),
            failures_by=_counts(obj, "failures_by", path),
            gateway_failures_by=_counts(obj, "gateway_failures_by", path),
            placed_per_s=_num(obj, "placed_per_s", path),
            duration_s=_num(obj, "duration_s", path),
            ttfa=_Pcts.parse(_mapping(obj, "ttfa_ms", path), f"{path}.ttfa_ms"),
            gaps=_int(obj, "gaps", path),
            gap_ms=_num(obj, "gap_ms", path) or 0.0,
            mos=_num(obj, "mos", path),
            r_factor=_num(obj, "r_factor", path),
            characters_per_s=_num(obj, "characters_per_s", path),
            speech=_str(obj, "speech", path),
            target=_str(obj, "target", path),
            offered=_str(obj, "offered", path),
            lateness=_Pcts.parse(_mapping(obj, "lateness_ms", path), f"{path}.lateness_ms"),
            passed=_bool(obj, "passed", path),
            withheld=withheld if isinstance(withheld, str) else None,
            token_audio=(_Pcts.parse(obj["token_audio_ms"], f"{path}.token_audio_ms")
                         if isinstance(obj.get("token_audio_ms"), Mapping)
                         and obj["token_audio_ms"].get("p50") is not None else None),
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
    refused: str | None
    started_s: float | None
    turns: tuple[_Turn, ...]
    jitter_ms: float | None
    mark_rtt_ms: tuple[float, ...]
    loss_pct: float | None

    @property
    def outcome(self) -> str:
        if self.error:
            return "failed"
        return "refused" if self.refused else "completed"

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
            refused=_str(obj, "refused", path) or None,
            started_s=_num(obj, "started_s", path),
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

    @property
    def mixed_speech(self) -> bool:
        """Whether the levels measured more than one kind of speech (a capacity search)."""
        return len({lv.speech for lv in self.levels if lv.speech}) > 1

    def level_label(self, index: int) -> str:
        """A call's ``level`` is the index of its level; people read the concurrency."""
        if 0 <= index < len(self.levels):
            level = self.levels[index]
            prefix = f"{level.speech} " if self.mixed_speech and level.speech else ""
            return f"{prefix}{level.label}"
        return f"level {index}"


# --- formatting -------------------------------------------------------------------------------

_DASH = "—"


def _fmt(value: float | None, digits: int = 0) -> str:
    if value is None:
        return _DASH
    return f"{value:,.{digits}f}"


def _verdict(level: _Level) -> str:
    if level.withheld:
        return "withheld"
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
    # ``name`` is one of this module's plot ids (letters and hyphens): nothing to escape.
    return text.replace("<svg ", f'<svg role="img" aria-label="{name}" ', 1)


def _figure(height: float = 3.4, rows: int = 1,
            sharex: bool = False) -> tuple[Figure, list[Axes]]:
    """A figure for one plot; call it inside ``rc_context(_RC)``, which styles its axes."""
    fig = Figure(figsize=(9.0, height), layout="constrained")
    axes = fig.subplots(rows, 1, sharex=sharex, squeeze=False)[:, 0].tolist()
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
        fig, (ax, ax_calls) = _figure(height=4.6, rows=2)
        points = [lv for lv in run.levels if lv.ttfa.p50 is not None]
        if not points:
            _no_data(ax, "levels with latency figures")
        else:
            styles = {"live": "--"}
            for speech in sorted({lv.speech for lv in points}, key=str):
                series = [lv for lv in points if lv.speech == speech]
                tag = f" {speech}" if run.mixed_speech and speech else ""
                for key, colour, marker in (("p50", _PALETTE[0], "o"), ("p95", _PALETTE[1], "s"),
                                            ("p99", _PALETTE[5], "^")):
                    kept = [(lv.concurrency, getattr(lv.ttfa, key)) for lv in series
                            if getattr(lv.ttfa, key) is not None and not lv.withheld]
                    if kept:
                        ax.plot(*zip(*kept, strict=True), marker=marker, color=colour,
                                ls=styles.get(speech or "", "-"), label=f"{key}{tag}")
                    withheld = [(lv.concurrency, getattr(lv.ttfa, key)) for lv in series
                                if getattr(lv.ttfa, key) is not None and lv.withheld]
                    if withheld:
                        labelled = "figures withheld" in ax.get_legend_handles_labels()[1]
                        ax.plot(*zip(*withheld, strict=True), ls="none", marker=marker,
                                mfc="none", color="#999999",
                                label=None if labelled else "figures withheld")
            highest = max(v for lv in points for v in (lv.ttfa.p50, lv.ttfa.p95, lv.ttfa.p99)
                          if v is not None)
            # Headroom for the "withheld" notes: inside the axes, never over the title.
            ax.set_ylim(0, highest * (1.25 if any(lv.withheld for lv in points) else 1.05))
            for lv in points:
                if lv.withheld:
                    top = max(v for v in (lv.ttfa.p50, lv.ttfa.p95, lv.ttfa.p99) if v is not None)
                    ax.annotate("withheld", xy=(lv.concurrency, top), xytext=(0, 6),
                                textcoords="offset points", ha="center", va="bottom",
                                color="#a33", annotation_clip=True)
            ax.set_ylabel("time to first audio (ms)")
            if ax.get_legend_handles_labels()[1]:
                ax.legend(title="percentile", loc="upper left")
        placed = [lv for lv in run.levels if lv.calls]
        if not placed:
            _no_data(ax_calls, "placed calls")
        else:
            x = np.arange(len(placed))
            refused = [100.0 * lv.refused / lv.calls for lv in placed]
            failed = [100.0 * lv.errors / lv.calls for lv in placed]
            ax_calls.bar(x - 0.2, refused, width=0.4, color=_PALETTE[1], label="refused (busy)")
            ax_calls.bar(x + 0.2, failed, width=0.4, color=_PALETTE[5], label="failed")
            ax_calls.set_xticks(x, [run.level_label(run.levels.index(lv)) for lv in placed])
            ax_calls.set_ylim(0, 100)
            ax_calls.set_ylabel("% of placed calls")
            ax_calls.legend(loc="upper left")
        ax_calls.set_xlabel("concurrent calls")
        if points:
            ax.set_xticks(sorted({lv.concurrency for lv in points}))
        ax.set_title("First-audio latency vs load (hollow grey: figures withheld); "
                     "calls refused and failed")
        return _svg(fig, "latency-vs-concurrency")


def _level_offsets(run: _Run) -> tuple[dict[int, float], bool]:
    """Seconds to add to each level's stamps so levels follow each other on one axis.

    ``at_s`` and ``started_s`` count from the start of the run; a simulator that restarts its
    clock for every level (the stamps of a later level begin before an earlier level's end) gets
    its levels laid end to end instead, in level order. Returns the offsets and whether any
    moved.
    """
    stamps: dict[int, list[float]] = {}
    for call in run.calls:
        for turn in call.turns:
            stamps.setdefault(call.level, []).append(turn.at_s)
        if call.started_s is not None:
            stamps.setdefault(call.level, []).append(call.started_s)
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
    dials = [(call.level, call.started_s + offsets.get(call.level, 0.0), call.outcome)
             for call in run.calls if call.started_s is not None]
    with matplotlib.rc_context(_RC):
        fig, (ax_calls, ax_ms, ax_n) = _figure(height=5.6, rows=3, sharex=True)
        if not turns and not dials:
            for ax in (ax_calls, ax_ms, ax_n):
                _no_data(ax, "turns")
        else:
            end = max([t for _, t, _ in turns] + [t for _, t, _ in dials])
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
            bottom = np.zeros(buckets)
            for outcome, colour in (("completed", _PALETTE[2]), ("refused", _PALETTE[1]),
                                    ("failed", _PALETTE[5])):
                placed = np.zeros(buckets)
                for _, at, kind in dials:
                    if kind == outcome:
                        placed[min(buckets - 1, max(0, int(at)))] += 1
                if placed.any():
                    ax_calls.bar(starts, placed, width=1.0, align="edge", bottom=bottom,
                                 color=colour, label=outcome)
                    bottom += placed
            if ax_calls.get_legend_handles_labels()[1]:
                ax_calls.legend(loc="upper right", title="calls placed, by outcome")
            ax_ms.bar(starts, gap_ms, width=1.0, align="edge", color=_PALETTE[5])
            ax_n.bar(starts, gap_count, width=1.0, align="edge", color=_PALETTE[0])
            for ax, values in ((ax_ms, gap_ms), (ax_n, gap_count)):
                if not values.any():
                    # Not matplotlib's 0-0.05 axis around nothing: say there was nothing.
                    ax.set_ylim(0, 1)
                    ax.set_yticks([0, 1])
                    ax.text(0.5, 0.5, "no gaps heard", ha="center", va="center",
                            transform=ax.transAxes, color="#666666")
            spans: dict[int, list[float]] = {}
            for level, at, _ in turns:
                spans.setdefault(level, []).append(at)
            for level, at, _ in dials:
                spans.setdefault(level, []).append(at)
            for n, (level, ats) in enumerate(sorted(spans.items())):
                for ax in (ax_calls, ax_ms, ax_n):
                    ax.axvspan(min(ats), max(ats) + 1.0, color=_colour(level),
                               alpha=0.10 if n % 2 == 0 else 0.18, lw=0)
                ax_calls.annotate(run.level_label(level), xy=(min(ats), 1.0),
                                  xycoords=("data", "axes fraction"), xytext=(3, -3),
                                  textcoords="offset points", va="top", color="#444444")
            ax_calls.set_ylabel("calls placed / s")
            ax_ms.set_ylabel("gap audio (ms / s)")
            ax_n.set_ylabel("gaps (count / s)")
            clock = "levels end to end" if restarted else "since run start"
            ax_n.set_xlabel(f"time {clock} (s), 1 s buckets; shading: concurrency level")
            ax_n.set_xlim(0, buckets)
            for ax in (ax_calls, ax_ms, ax_n):
                ax.set_ylim(bottom=0)
                if ax is not ax_calls and ax.get_ylim()[1] < 1:
                    ax.set_ylim(0, 1)
        ax_calls.set_title("Calls placed (completed, refused, failed) and audio gaps "
                           "(underruns heard by callers) over the run")
        return _svg(fig, "gaps-over-time"), restarted


# --- HTML -------------------------------------------------------------------------------------


@cache
def _environment() -> Environment:
    # Autoescaping on for every template: document strings (targets, causes, SLOs) are data.
    return Environment(loader=PackageLoader("gateway.loadsim", "templates"), autoescape=True,
                       undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                       keep_trailing_newline=True)


def _levels_rows(run: _Run) -> list[dict[str, Any]]:
    timeouts: Counter[int] = Counter()
    for call in run.calls:
        timeouts[call.level] += sum(t.timed_out for t in call.turns)
    rows = []
    for index, lv in enumerate(run.levels):
        shown = _Pcts() if lv.withheld else lv.ttfa  # withheld figures are not printed
        rows.append({
            "cells": [run.level_label(index), f"{lv.calls:,}", f"{lv.completed:,}",
                      f"{lv.refused:,}", f"{lv.errors:,}", _fmt(lv.placed_per_s, 2),
                      f"{timeouts[index]:,}", _fmt(shown.p50), _fmt(shown.p95),
                      _fmt(shown.p99), f"{lv.gaps:,}", _fmt(lv.gap_ms), _fmt(lv.mos, 2),
                      _fmt(lv.r_factor, 1), _fmt(lv.characters_per_s, 1),
                      _fmt(lv.lateness.p99, 2)],
            "verdict": _verdict(lv), "withheld": lv.withheld,
        })
    return rows


def _media_rows(run: _Run) -> list[list[str]]:
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
        rows.append([
            run.level_label(index), f"{len(calls):,}",
            _fmt(_percentile(setup, 50)), _fmt(_percentile(setup, 95)),
            _fmt(_percentile(jitter, 50), 1), _fmt(_percentile(jitter, 95), 1),
            _fmt(float(np.mean(loss)) if loss else None, 2),
            _fmt(_percentile(rtt, 50)), _fmt(_percentile(rtt, 95)),
            _fmt(_percentile(barge, 50)), _fmt(_percentile(barge, 95)),
        ])
    return rows


def _cause_rows(run: _Run) -> list[dict[str, str]]:
    """Calls that did not complete, grouped by outcome and cause, most frequent first."""
    counts: Counter[tuple[str, str]] = Counter()
    levels: dict[tuple[str, str], set[int]] = {}
    for call in run.calls:
        cause = call.error or call.refused
        if cause:
            key = (call.outcome, cause)
            counts[key] += 1
            levels.setdefault(key, set()).add(call.level)
    if not counts and any(lv.refused_by or lv.failures_by for lv in run.levels):
        # A document without per-call samples still has the levels' grouped counts.
        for index, lv in enumerate(run.levels):
            for outcome, grouped in (("refused", lv.refused_by), ("failed", lv.failures_by)):
                for cause, n in grouped:
                    if outcome == "failed" and cause.startswith("gateway: "):
                        continue  # the gateway's turns: their own rows below
                    counts[(outcome, cause)] += n
                    levels.setdefault((outcome, cause), set()).add(index)
    rows = [{"calls": f"{count:,}", "outcome": outcome,
             "levels": ", ".join(run.level_label(i) for i in sorted(levels[(outcome, cause)])),
             "cause": cause}
            for (outcome, cause), count in counts.most_common()]
    for index, lv in enumerate(run.levels):
        # Not per call: the gateway's own counts of the turns it failed.
        for cause, n in lv.gateway_failures_by:
            rows.append({"calls": "-", "outcome": "failed", "levels": run.level_label(index),
                         "cause": f"{n:,} turn(s) the gateway failed: {cause}"})
    return rows


def _slowest_rows(run: _Run, limit: int = 10) -> list[list[str]]:
    turns = [(t.first_audio_ms, call, t) for call in run.calls for t in call.turns
             if t.first_audio_ms is not None]
    turns.sort(key=lambda item: item[0], reverse=True)
    return [[call.id, run.level_label(call.level), t.kind, _fmt(t.at_s, 2), _fmt(first),
             f"{t.gaps:,}", _fmt(t.gap_ms)] for first, call, t in turns[:limit]]


def _capacity_rows(run: _Run) -> list[list[str]]:
    return [[c.speech, c.scenario or _DASH, c.target or _DASH,
             _DASH if c.concurrency is None else f"{c.concurrency:,}",
             _fmt(c.characters_per_s, 1),
             _DASH if c.hourly_cost is None else f"${c.hourly_cost:,.2f}",
             _DASH if c.cost_per_million is None else f"${c.cost_per_million:,.2f}"]
            for c in run.meta.capacity]


def build_html(data: Mapping[str, Any]) -> str:
    """The report for one result document, as a complete self-contained HTML page."""
    run = _Run.parse(data)
    m = run.meta
    gaps_svg, restarted = _plot_gaps_over_time(run, m.duration_s)
    figures = [
        ("ttfa-histogram", _plot_ttfa_histogram(run),
         "Every turn's time from the caller's action (answer, key, speech) to the first audio "
         "of the utterance that answered it, stacked by concurrency level."),
        ("ttfa-cdf", _plot_ttfa_cdf(run),
         "Fraction of turns that heard audio within x ms; dashed and dotted red lines mark "
         "p50 and p95 of all turns (numpy's linear percentile over the raw turns)."),
        ("latency-vs-concurrency", _plot_latency_vs_concurrency(run),
         "Per-level first-audio percentiles as the simulator aggregated them (top), and the "
         "share of placed calls the gateway refused (busy) or that failed (bottom)."),
        ("gaps-over-time", gaps_svg,
         "Calls placed per second by outcome (top); silence inserted because audio arrived "
         "late, summed per second of the run (middle) and counted (bottom). A turn's gaps are "
         "placed in the second the turn started."
         + (" Each level's clock started at 0, so the levels are drawn one after another."
            if restarted else "")),
    ]
    lat = m.lateness
    turns = sum(len(c.turns) for c in run.calls)
    placed = sum(lv.calls for lv in run.levels) or len(run.calls)
    refused = sum(lv.refused for lv in run.levels)
    failed = sum(lv.errors for lv in run.levels)
    meta_rows = [
        ("Target", m.target),
        ("Transport", m.transport),
        ("Scenario", m.scenario),
        ("Started", m.started or _DASH),
        ("Duration", f"{_fmt(m.duration_s, 1)} s"),
        ("Worker processes", _fmt(m.workers)),
        ("Calls placed / turns", f"{placed:,} / {turns:,}"),
        ("Completed / refused / failed",
         f"{placed - refused - failed:,} / {refused:,} / {failed:,}"),
        ("Simulator's own lateness (ms)",
         f"p50 {_fmt(lat.p50, 2)} · p99 {_fmt(lat.p99, 2)} · max {_fmt(lat.max, 2)}"),
        ("SLO", m.slo or _DASH),
        ("SLO verdict", _DASH if m.slo_passed is None else ("met" if m.slo_passed else "missed")),
    ]
    page = _environment().get_template("report.html.j2").render(
        title=f"Load test: {m.scenario} → {m.target} ({m.transport})",
        meta=m, run=run, meta_rows=meta_rows,
        withheld=[(lv.label, lv.withheld) for lv in run.levels if lv.withheld],
        levels=_levels_rows(run), media=_media_rows(run), causes=_cause_rows(run),
        slowest=_slowest_rows(run), capacity=_capacity_rows(run),
        figures=[(name, Markup(svg), caption) for name, svg, caption in figures],
        duration=_fmt(m.duration_s, 1), calls=f"{len(run.calls):,}",
    )
    return page


def render_report(data: Mapping[str, Any], path: Path) -> Path:
    """Write the HTML report for ``data`` (the simulator's result document) to ``path``.

    Returns ``path``. Raises :class:`ReportDataError` if the document cannot be read.
    """
    page = build_html(data)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path


# --- terminal -----------------------------------------------------------------------------------

_STYLES = {"pass": "bold green", "FAIL": "bold red", "withheld": "bold yellow"}


def _table(title: str) -> Table:
    # No vertical rules and collapsed padding: ten columns in 77 characters.
    return Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
                 pad_edge=False, collapse_padding=True)


def render_summary_table(data: Mapping[str, Any]) -> RenderableType:
    """The end-of-run summary the CLI prints: per measured speech a table with a row per
    level, then a line per level (placed, completed, refused, failed, calls/s). Fits 80
    columns."""
    run = _Run.parse(data)
    m = run.meta
    groups: dict[tuple[str | None, str | None], list[int]] = {}
    for index, lv in enumerate(run.levels):
        groups.setdefault((lv.speech if run.mixed_speech else None, lv.target), []).append(index)
    parts: list[RenderableType] = []
    for (speech, target), indexes in groups.items() or {(None, None): []}.items():
        scenario = "live" if speech == "live" else m.scenario
        title = f"{scenario} → {target or m.target} ({m.transport})"
        if speech:
            title = f"{speech} speech: {title}"
        table = _table(title)
        for header in ("level", "calls", "refused", "failed", "p50 ms", "p95 ms", "p99 ms",
                       "gaps", "MOS"):
            table.add_column(header, justify="right", no_wrap=True)
        table.add_column("result", justify="left", no_wrap=True)
        for index in indexes:
            lv = run.levels[index]
            verdict = _verdict(lv)
            # Withheld figures are not shown: a number beside "withheld" still gets read.
            shown = _Pcts(None, None, None, None) if lv.withheld else lv.ttfa
            table.add_row(
                lv.label, f"{lv.calls:,}", f"{lv.refused:,}", f"{lv.errors:,}",
                _fmt(shown.p50), _fmt(shown.p95), _fmt(shown.p99), f"{lv.gaps:,}",
                _fmt(lv.mos, 2),
                f"[{_STYLES[verdict]}]{verdict}[/]" if verdict in _STYLES else verdict,
                style="dim" if lv.withheld else None,
            )
        parts.append(table)
        for index in indexes:
            lv = run.levels[index]
            line = (f"{lv.label}: {lv.calls:,} calls placed "
                    f"({_fmt(lv.placed_per_s, 2)}/s), {lv.completed:,} completed, "
                    f"{lv.refused:,} refused, {lv.errors:,} failed")
            parts.append(Text(line))
            if lv.gateway_failures_by:
                turns = sum(n for _, n in lv.gateway_failures_by)
                parts.append(Text(f"{lv.label}: {turns:,} turn(s) failed in the gateway "
                                  "(its /metrics; counted as failed): "
                                  + "; ".join(f"{n:,} {cause}"
                                              for cause, n in lv.gateway_failures_by)))
            if lv.characters_per_s:
                parts.append(Text(f"{lv.label}: {lv.characters_per_s:,.1f} characters/s "
                                  "synthesised (live sentences heard whole)"))
            if lv.token_audio is not None and not lv.withheld:
                parts.append(Text(f"{lv.label}: the bot's first token -> first audio p50 "
                                  f"{_fmt(lv.token_audio.p50)} ms, p95 "
                                  f"{_fmt(lv.token_audio.p95)} ms"))
    captions = []
    if m.slo:
        state = {True: "met", False: "missed", None: "not evaluated"}[m.slo_passed]
        captions.append(f"SLO {m.slo}: {state}")
    withheld = [lv for lv in run.levels if lv.withheld]
    if withheld:
        captions.append("latency figures withheld at "
                        + ", ".join(lv.label for lv in withheld)
                        + " (simulator lateness too large; add --workers)")
    for caption in captions:
        parts.append(Text(caption))
    return Group(*parts)


def render_breakdown(data: Mapping[str, Any]) -> Table | None:
    """Calls that did not complete, grouped by outcome (refused, failed) and cause; None when
    every call completed. The cause column wraps within 80 columns."""
    run = _Run.parse(data)
    rows = _cause_rows(run)
    if not rows:
        return None
    table = _table("calls not completed, by cause")
    table.add_column("calls", justify="right", no_wrap=True)
    table.add_column("outcome", no_wrap=True)
    table.add_column("level", no_wrap=True)
    table.add_column("cause", overflow="fold", ratio=1)
    for row in rows:
        style = "yellow" if row["outcome"] == "refused" else "red"
        table.add_row(row["calls"], f"[{style}]{row['outcome']}[/]", row["levels"],
                      Text(row["cause"]))
    return table
