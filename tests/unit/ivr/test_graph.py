"""`gateway script graph`: the demo's flow drawn by Graphviz (the real `dot`), read back."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.ivr.graph import flow_graph
from gateway.ivr.script import load_script, parse_script
from tests.support.paths import REPO

ROOT = REPO
DEMO = ROOT / "prompts" / "demo.yaml"
SVG = "{http://www.w3.org/2000/svg}"


def _svg(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """Node titles -> their text, edge titles ("a->b") -> their label, from a Graphviz SVG."""
    root = ET.parse(path).getroot()
    nodes: dict[str, str] = {}
    edges: dict[str, str] = {}
    for group in root.iter(f"{SVG}g"):
        title = group.find(f"{SVG}title")
        if title is None or title.text is None:
            continue
        text = " ".join(t.text or "" for t in group.iter(f"{SVG}text"))
        if group.get("class") == "node":
            nodes[title.text] = text
        elif group.get("class") == "edge":
            edges[title.text] = " | ".join(filter(None, [edges.get(title.text, ""), text]))
    return nodes, edges


def test_the_demo_as_svg_names_every_node_what_it_says_and_what_takes_each_edge(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "flow.svg"
    assert main(["script", "graph", str(DEMO), "-o", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    nodes, edges = _svg(out)
    script = load_script(DEMO)
    assert set(script.nodes) <= set(nodes)
    assert "Thank you for calling Acme Energy." in nodes["welcome"]
    assert "Para español, oprima 8." in nodes["welcome"]
    assert "transfer" in nodes["agent"] and "+15555550100" in nodes["agent"]
    assert "hang up" in nodes["goodbye"]
    assert "language = Spanish" in nodes["spanish"]
    assert edges["menu->account"] == ('press 1 | say "balance" / "account balance" / '
                                      '"my balance" / "check my balance"')
    assert edges["menu->spanish"] == "press 8"
    assert edges["menu->agent"] == ('press 2 | say "agent" / "representative" / "operator" / '
                                    '"speak to an agent" | no answer')
    assert edges["menu->menu"] == 'press 9 | say "repeat" / "main menu" / "say that again"'
    assert "1 digit or speech → digits" in nodes["menu"]
    assert "6 digits until # (keyed or said) → account_number" in nodes["account"]
    assert edges["account->lookup"] == "any other key"
    assert edges["lookup->route"] == "ok"
    assert edges["lookup->sorry"] == "error"
    assert edges["route->collections"] == 'if status == "overdue" and balance > 0'
    assert edges["route->balance"] == "else"
    assert edges["__start__->welcome"] == "call"


def test_png_and_dot_outputs(tmp_path: Path) -> None:
    assert main(["script", "graph", str(DEMO), "-o", str(tmp_path / "flow.png")]) == 0
    data = (tmp_path / "flow.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert main(["script", "graph", str(DEMO), "-o", str(tmp_path / "flow.dot")]) == 0
    source = (tmp_path / "flow.dot").read_text()
    assert source.startswith("// Acme Energy customer service") and "digraph flow" in source


def test_an_unknown_format_or_an_invalid_script_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["script", "graph", str(DEMO), "-o", str(tmp_path / "flow.jpg")]) == 1
    assert "must end in .svg, .png, .pdf, .dot, .gv" in capsys.readouterr().err
    broken = ROOT / "tests" / "golden" / "scripts" / "logic_errors.yaml"
    assert main(["script", "graph", str(broken), "-o", str(tmp_path / "x.svg")]) == 1
    assert "speaker 'robot' is not a built-in voice" in capsys.readouterr().err
    assert not (tmp_path / "x.svg").exists()


def test_hours_voice_changes_and_markup_in_sentences_are_drawn_safely() -> None:
    script = parse_script(
        "name: 'A <b>&</b> B'\nvoice: {speaker: ryan}\nstart: office\nnodes:\n"
        "  office:\n    hours:\n      timezone: Europe/Madrid\n"
        "      weekly: {mon-fri: '09:00-14:00'}\n      holidays: [2025-12-25]\n"
        "      open: serena\n      closed: shut\n"
        "  serena:\n    voice: {speaker: serena}\n    say: 'Press <1> & wait.'\n    next: shut\n"
        "  shut: {hangup: true}\n"
    )
    source = flow_graph(script).source
    assert "Europe/Madrid" in source and "mon-fri 09:00-14:00; 1 holiday(s)" in source
    assert "voice: speaker serena" in source
    assert "Press &lt;1&gt; &amp; wait." in source  # HTML labels: escaped, never markup
    assert re.search(r"office -> serena \[label=open\]", source)
    assert re.search(r"office -> shut \[label=closed\]", source)


def test_svg_text_keeps_the_space_after_a_bold_label_and_any_failure_is_a_node(
    tmp_path: Path,
) -> None:
    out = tmp_path / "flow.svg"
    assert main(["script", "graph", str(DEMO), "-o", str(out)]) == 0
    root = ET.parse(out).getroot()
    texts = list(root.iter(f"{SVG}text"))
    leading = [t for t in texts if (t.text or "").startswith(" ")]
    # "branch" (bold) then " on data": a browser drops that space unless the element says
    # xml:space="preserve" ("branchon data").
    assert any(t.text == " on data" for t in leading)
    space = "{http://www.w3.org/XML/1998/namespace}space"
    assert all(t.get(space) == "preserve" for t in leading)
    # The red "any failure" arrow starts at a node with a border, not at floating text.
    nodes, edges = _svg(out)
    assert "any failed step" in nodes["__error__"]
    group = next(g for g in root.iter(f"{SVG}g")
                 if (g.findtext(f"{SVG}title") or "") == "__error__")
    assert group.find(f"{SVG}path") is not None or group.find(f"{SVG}polygon") is not None
    assert "__error__->sorry" in edges


def test_a_bot_node_shows_its_url_greeting_what_it_sets_and_its_end_edge(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("RELAY_BOT_URL", raising=False)
    script = load_script(ROOT / "examples" / "bot.yaml")
    source = flow_graph(script).source
    assert "<b>bot</b> ws://127.0.0.1:8765/relay sets reasonCode" in source
    assert "Hello, this is the Acme Energy assistant." in source
    assert re.search(r"assistant -> after \[label=end\]", source)
    assert "(speech, webhook, bot)" in source
