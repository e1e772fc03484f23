"""Phone-line scripts the tests serve."""

from __future__ import annotations

from pathlib import Path

__all__ = ["TRANSFER_LINE", "write_transfer_line"]

#: A phone line that waits for a key (no prompts: nothing to render): 0 transfers to a number,
#: 5 to a SIP URI, 9 hangs up.
TRANSFER_LINE = """\
name: Transfer line
voice: {speaker: ryan, language: English}
start: menu
nodes:
  menu:
    gather:
      digits: 1
      timeout: 60s
      retries: 0
      branch: {"0": agent, "5": sip_agent, "9": bye}
      fallback: bye
  agent:
    transfer: "+15550100200"
  sip_agent:
    transfer: "sip:agent@pbx.example.com"
  bye:
    hangup: true
"""


def write_transfer_line(directory: Path) -> Path:
    path = directory / "line.yaml"
    path.write_text(TRANSFER_LINE)
    return path
