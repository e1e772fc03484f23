#!/usr/bin/env bash
# Continuous batching on a lent GPU: 1..64 concurrent speaking turns, batched vs slots vs the
# official qwen-tts path, 0.6B and 1.7B shapes with random weights; writes the GPU table into
# bench/RESULTS.md (and copies it, with the raw logs, to $OUT when the device tool sets it).
#
# Prepare on the workstation (downloads pairing-A wheels into ./.whl, see the header of
# ../shared/tools/gpu-wheels.sh; the extras are what the gateway imports beyond the image):
#   bash ../shared/tools/gpu-wheels.sh prometheus-client==0.21.1 pydantic-settings==2.7.1 \
#       python-dotenv==1.0.1
# Then, on the device machine (carry: [".whl"]), one run:
#   bash bench/gpu_batching.sh
# Knobs (environment): LEVELS (batched), SLOT_LEVELS, FRAMES, SIZES, OFFICIAL_TURNS.
# A dry run of the same logic on this CPU with the tiny model (no wheels, RESULTS.md untouched):
#   DRY_RUN=1 bash bench/gpu_batching.sh
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=${OUT:-/tmp/gpu-batching}
mkdir -p "$out"

if [ "${DRY_RUN:-0}" = "1" ]; then
  py=${PYTHON:-.venv/bin/python}
  device=cpu sizes=${SIZES:-tiny}
  levels=${LEVELS:-1,2} slot_levels=${SLOT_LEVELS:-1,2} frames=${FRAMES:-8}
  official=${OFFICIAL_TURNS:-1} results=$out/RESULTS.md
  cp bench/RESULTS.md "$results"
else
  py=python3
  if [ -d .whl ]; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$root
  else
    export PYTHONPATH=$root
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
  device=cuda sizes=${SIZES:-0.6B 1.7B}
  # 10 speaking turns (the first-audio target) and 64 (the capacity target) are the points.
  levels=${LEVELS:-1,4,10,16,32,64} slot_levels=${SLOT_LEVELS:-1,4,10} frames=${FRAMES:-40}
  official=${OFFICIAL_TURNS:-3} results=bench/RESULTS.md
fi

table=$out/table.md
: > "$table"
for size in $sizes; do
  if [ "$size" = tiny ]; then
    model=tiny build=()
  else
    model=/tmp/random-$size build=(--build-random "$size")
  fi
  echo "== $size: batched" >&2
  # 64 turns per level at least: every level runs a few waves of its callers.
  "$py" bench/engine.py --device "$device" --model "$model" "${build[@]}" --engine batched \
      --levels "$levels" --turns 64 --frames "$frames" --official-turns "$official" \
      --markdown "$table" 2>&1 | tee "$out/batched-$size.log"
  echo "== $size: slots (the baseline: one batch-1 engine with its own graphs per turn)" >&2
  "$py" bench/engine.py --device "$device" --model "$model" --engine slots \
      --levels "$slot_levels" --turns 32 --frames "$frames" --official-turns 0 \
      --markdown "$table" 2>&1 | tee "$out/slots-$size.log"
done

# Replace the GPU section of RESULTS.md between its markers with this run's tables.
"$py" - "$table" "$results" "$out/gpu.txt" <<'EOF'
import sys
from datetime import date
from pathlib import Path

table, results, gpu = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
start, end = "<!-- gpu-table:start -->", "<!-- gpu-table:end -->"
text = results.read_text()
if start not in text or end not in text:
    sys.exit(f"{results} has no {start} ... {end} section")
hardware = gpu.read_text().strip() if gpu.exists() else "CPU (dry run)"
body = (f"{start}\nMeasured {date.today()} by `bench/gpu_batching.sh` on {hardware}.\n"
        f"{table.read_text()}\n{end}")
head, rest = text.split(start, 1)
results.write_text(head + body + rest.split(end, 1)[1])
print(f"wrote the GPU table into {results}")
EOF
[ "$results" = "$out/RESULTS.md" ] || cp "$results" "$out/RESULTS.md"
