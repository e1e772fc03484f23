"""A script's call flow as a diagram (Graphviz): what an author looks at instead of YAML.

Each node is a box: its name, what it sets, what it says (the sentences, shortened), and what
it does after speaking. Edges carry what takes them: the key pressed, "no answer", a branch's
condition, "open"/"closed", a webhook's "error". Transfers are green and name their target,
hang-ups red, the start has an arrow from a dot, the error node a dashed border.

:func:`flow_graph` builds the graph (``graphviz.Digraph``: its ``.source`` is DOT text);
:func:`render` writes it as SVG, PNG or PDF through Graphviz's ``dot`` (Debian package
``graphviz``), or the DOT source itself for ``.dot``/``.gv``.
"""

from __future__ import annotations

import html
import re
import textwrap
from pathlib import Path

import graphviz

from gateway.errors import GatewayError
from gateway.ivr.script import Node, Script

__all__ = ["FORMATS", "flow_graph", "render"]

#: Output suffix -> Graphviz format (None: write the DOT source).
FORMATS: dict[str, str | None] = {".svg": "svg", ".png": "png", ".pdf": "pdf", ".dot": None,
                                  ".gv": None}
#: A sentence is shortened to this many characters in its box.
SENTENCE_CHARS = 90
_WRAP = 44

_TRANSFER = "#d8f3dc"
_HANGUP = "#ffd6d6"
_PLAIN = "#ffffff"
_DECISION = "#fff3bf"


def _lines(text: str) -> str:
    if len(text) > SENTENCE_CHARS:
        text = text[: SENTENCE_CHARS - 1].rstrip() + "…"
    return "<br/>".join(html.escape(line) for line in textwrap.wrap(text, _WRAP))


def _says(script: Script, node: Node) -> list[str]:
    items = list(node.say or [])
    if node.gather is not None:
        items += node.gather.prompt
    out = []
    for item in items:
        name = item if isinstance(item, str) and script.is_prompt_ref(item) else None
        text = script.sentence(item)
        prefix = f"<i>{html.escape(name)}:</i> " if name else ""
        out.append(f"{prefix}“{_lines(text)}”")
    return out


def _action(node: Node) -> tuple[str, str]:
    """(what the node does, its fill colour)."""
    if node.transfer is not None:
        return f"<b>transfer</b> → {html.escape(node.transfer)}", _TRANSFER
    if node.hangup:
        return "<b>hang up</b>", _HANGUP
    if node.gather is not None:
        g = node.gather
        ends = []
        if g.digits is not None:
            ends.append(f"{g.digits} digit{'s' if g.digits > 1 else ''}")
        if g.terminator is not None:
            ends.append(f"until {g.terminator}")
        retries = f", {g.retries} retr{'ies' if g.retries != 1 else 'y'}" if g.retries else ""
        spoken = {None: "", "digits": " (keyed or said)"}.get(
            g.speech if isinstance(g.speech, str | None) else "", " or speech")
        return (f"<b>gather</b> {html.escape(' '.join(ends))}{spoken} → "
                f"{html.escape(g.store)} ({g.timeout:g} s{retries})", _PLAIN)
    if node.webhook is not None:
        sets = f" sets {', '.join(node.webhook.sets)}" if node.webhook.sets else ""
        return f"<b>webhook</b> {_lines(node.webhook.url)}{html.escape(sets)}", _PLAIN
    if node.bot is not None:
        sets = f" sets {', '.join(node.bot.sets)}" if node.bot.sets else ""
        greeting = (f"<br/>“{_lines(node.bot.welcome_greeting)}”"
                    if node.bot.welcome_greeting else "")
        return f"<b>bot</b> {_lines(node.bot.url)}{html.escape(sets)}{greeting}", _PLAIN
    if node.branch is not None:
        return "<b>branch</b> on data", _DECISION
    if node.hours is not None:
        days = "; ".join(f"{day} {hours if isinstance(hours, str) else ', '.join(hours)}"
                         for day, hours in node.hours.weekly.items())
        holidays = f"; {len(node.hours.holidays)} holiday(s)" if node.hours.holidays else ""
        return (f"<b>hours</b> {html.escape(node.hours.timezone)}<br/>"
                f"{_lines(days + holidays)}", _DECISION)
    if node.play is not None:
        return f"<b>play</b> {html.escape(node.play)}", _PLAIN
    return "", _PLAIN


def _label(script: Script, name: str, node: Node) -> str:
    rows = [f"<b>{html.escape(name)}</b>"]
    changes = []
    for variable, value in (node.assign or {}).items():
        changes.append(f"{variable} = {value}")
    if node.voice is not None:
        fields = node.voice.model_dump(exclude_none=True)
        changes.append("voice: " + ", ".join(f"{k} {v}" for k, v in fields.items()))
    if changes:
        rows.append("<i>" + html.escape("; ".join(changes)) + "</i>")
    rows += _says(script, node)
    action, _ = _action(node)
    if action:
        rows.append(action)
    cells = "".join(f'<tr><td align="left" balign="left">{row}</td></tr>' for row in rows)
    return f'<<table border="0" cellborder="0" cellspacing="2">{cells}</table>>'


def flow_graph(script: Script) -> graphviz.Digraph:
    """The call flow of ``script`` as a Graphviz digraph."""
    graph = graphviz.Digraph(name="flow", comment=script.name)
    graph.attr(rankdir="TB", label=html.escape(script.name), labelloc="t", fontsize="18",
               fontname="Helvetica")
    graph.attr("node", shape="box", style="rounded,filled", fontname="Helvetica",
               fontsize="11", margin="0.15,0.08")
    graph.attr("edge", fontname="Helvetica", fontsize="10")
    graph.node("__start__", label="", shape="circle", style="filled", fillcolor="black",
               width="0.2")
    graph.edge("__start__", script.start, label="call")
    for name, node in script.nodes.items():
        _, fill = _action(node)
        style = "rounded,filled,dashed" if name == script.error else "rounded,filled"
        graph.node(name, label=_label(script, name, node), fillcolor=fill, style=style,
                   penwidth="2" if node.transfer is not None or node.hangup else "1")
    for name, node in script.nodes.items():
        dead = node.dead_cases() if node.branch is not None else {}
        for edge in node.edges():
            if edge.target not in script.nodes:
                continue
            attrs: dict[str, str] = {}
            if edge.kind in ("fallback", "error"):
                attrs["style"] = "dashed"
            if edge.kind == "error":
                attrs["color"] = "#c92a2a"
                attrs["fontcolor"] = "#c92a2a"
            if edge.kind in ("case", "else") and edge.path[1] in dead:
                attrs.update(style="dotted", color="gray")
            label = edge.label
            if edge.kind == "key":
                label = f"press {label}" if label != "any other key" else label
            elif edge.kind == "speech":
                label = f"say {label}"
            elif edge.kind == "case":
                label = f"if {label}"
            if node.webhook is not None and edge.kind == "next":
                label = "ok"
            if node.bot is not None and edge.kind == "next":
                label = "end"
            graph.edge(name, edge.target, label=html.escape(label) if label else None, **attrs)
    if script.error is not None and script.error in script.nodes:
        # A node of its own (not a floating label), so the red arrow visibly starts somewhere.
        graph.node("__error__", label="any failed step\n(speech, webhook, bot)", shape="box",
                   style="rounded,dashed", color="#c92a2a", fontcolor="#c92a2a",
                   fillcolor="white")
        graph.edge("__error__", script.error, style="dashed", color="#c92a2a")
    return graph


def render(script: Script, output: Path) -> Path:
    """Write ``script``'s flow to ``output`` (format from its suffix: .svg .png .pdf .dot)."""
    suffix = output.suffix.lower()
    if suffix not in FORMATS:
        raise GatewayError(f"cannot draw {output.name}: the output must end in "
                           f"{', '.join(FORMATS)}")
    graph = flow_graph(script)
    output.parent.mkdir(parents=True, exist_ok=True)
    fmt = FORMATS[suffix]
    if fmt is None:
        output.write_text(graph.source, encoding="utf-8")
        return output
    try:
        data = graph.pipe(format=fmt)
    except graphviz.ExecutableNotFound:
        raise GatewayError("Graphviz's 'dot' is not installed (apt-get install graphviz); "
                           "write a .dot file instead and render it elsewhere") from None
    if fmt == "svg":
        data = _keep_spaces(data)
    output.write_bytes(data)
    return output


_SVG_TEXT = re.compile(rb"<text([^>]*)>(?=\s)")


def _keep_spaces(svg: bytes) -> bytes:
    """Mark every ``<text>`` that starts with a space ``xml:space="preserve"``: Graphviz writes
    the text after a bold run as its own element (``" on data"``), and browsers drop the
    leading space of an SVG text unless told to keep it ("branchon data")."""
    return _SVG_TEXT.sub(rb'<text\1 xml:space="preserve">', svg)
