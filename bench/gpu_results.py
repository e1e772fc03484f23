"""Write the one-shot GPU run's stages so far into RESULTS.md's GPU section.

    python bench/gpu_results.py --out /tmp/gpu-batching --results bench/RESULTS.md --device cuda

bench/gpu_batching.sh calls it after every stage, so the section always holds what exists: the
hardware, each stage's status (ok, failed, timed out), and the tables of the stages that wrote
one, in stage order. It rewrites only the text between the section's markers.
"""

from __future__ import annotations

import argparse
import sys
from datetime import date
from pathlib import Path

START, END = "<!-- gpu-table:start -->", "<!-- gpu-table:end -->"


def section(out: Path, device: str) -> str:
    """The GPU section's body from ``out``'s stages.tsv, gpu.txt and per-stage tables."""
    stages = []
    tsv = out / "stages.tsv"
    if tsv.exists():
        for line in tsv.read_text().splitlines():
            name, status, seconds = line.split("\t")
            stages.append((name, status, int(seconds)))
    gpu = out / "gpu.txt"
    if device == "cpu":
        hardware = ("**a DRY RUN on the CPU** (tiny model, graph mode through the capture "
                    "stand-in): it checks that every stage runs; none of its figures is a GPU "
                    "figure")
    else:
        hardware = gpu.read_text().strip() if gpu.exists() else "a GPU (nvidia-smi unread)"
    lines = [f"Measured {date.today()} by `bench/gpu_batching.sh` on {hardware}.", "",
             "| stage | status | seconds |", "|---|---|---:|"]
    lines += [f"| {name} | {status} | {seconds} |" for name, status, seconds in stages]
    for name, _status, _seconds in stages:
        table = out / f"{name}.md"
        if table.exists() and table.read_text().strip():
            lines += ["", f"### Stage {name}", table.read_text().strip()]
    return "\n".join(lines)


def write(results: Path, body: str) -> None:
    text = results.read_text()
    if START not in text or END not in text:
        sys.exit(f"{results} has no {START} ... {END} section")
    head, rest = text.split(START, 1)
    results.write_text(f"{head}{START}\n{body}\n{END}{rest.split(END, 1)[1]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    write(args.results, section(args.out, args.device))
    print(f"gpu results: {args.results} updated from {args.out}")


if __name__ == "__main__":
    main()
