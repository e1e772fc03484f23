#!/usr/bin/env bash
# The one-shot GPU run: stages in order of value, each under its own timeout, each written out as
# soon as it exists, so that a late failure loses only the later stages.
#
#   stage      what                                                         timeout (s)
#   preflight  versions, driver, GPU; imports; tiny model on the device      75
#              with graphs: capture, ten steps, one decode
#   0.6B       batched engine, 0.6B shapes (random weights), 1..64 turns    150
#   profile    the 0.6B device profile for the simulated engine              60
#              (bench/device_profile.py: steps, prefill, decode timed)
#   1.7B       batched engine, 1.7B shapes, 1..64 turns                     125
#   baselines  slot engine (one batch-1 engine per turn) and the official    70
#              qwen-tts path, 0.6B
#                                                                   total  480 (8 minutes)
#
# The profile stage writes $OUT/profile-0.6B.json (commit it under gateway/tts/profiles/ and size
# with bench/capacity_sim.py --profile). Each stage's table lands in $OUT/<stage>.md and, at once,
# in bench/RESULTS.md's GPU section
# (bench/gpu_results.py rewrites it from the stages so far, with each stage's status); its log in
# $OUT/<stage>.log. The preflight's failure stops the run with its one-line reason.
#
# Prepare on the workstation (wheels the GPU image lacks, into ./.whl; read the script's LAST
# line: "closure check: ok"):
#   bash bench/gpu_wheels.sh
# Then on the device machine (carry: [".whl"]), one run, timeout_s 570:
#   bash bench/gpu_batching.sh
# A dry run of every stage on this CPU, with the tiny model and the graph-capture stand-in
# (RESULTS.md untouched; the stages' output under $OUT, default /tmp/gpu-batching):
#   DRY_RUN=1 bash bench/gpu_batching.sh
# QUICK=1 shortens the dry run further (what tests/bench/test_gpu_run.py runs in CI).
# Knobs: LEVELS (batched), SLOT_LEVELS, FRAMES, OFFICIAL_TURNS, SIZES; the stage timeouts
# T_PREFLIGHT, T_SIZE (each model size), T_PROFILE, T_BASELINES.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=${OUT:-/tmp/gpu-batching}
mkdir -p "$out"
: > "$out/stages.tsv"
started=$(date +%s)

if [ "${DRY_RUN:-0}" = "1" ]; then
  py=${PYTHON:-$root/.venv/bin/python}
  device=cpu results=$out/RESULTS.md
  cp bench/RESULTS.md "$results"
  if [ "${QUICK:-0}" = "1" ]; then
    levels=${LEVELS:-1,2} slot_levels=${SLOT_LEVELS:-1} frames=${FRAMES:-4} turns=2
    official=${OFFICIAL_TURNS:-1} sizes=${SIZES:-0.6B}
    export PROFILE_ROWS=${PROFILE_ROWS:-1}
  else
    levels=${LEVELS:-1,2,4} slot_levels=${SLOT_LEVELS:-1,2} frames=${FRAMES:-8} turns=4
    official=${OFFICIAL_TURNS:-1} sizes=${SIZES:-0.6B 1.7B}
  fi
  t_pre=${T_PREFLIGHT:-120} t_size=${T_SIZE:-150} t_base=${T_BASELINES:-120}
  t_profile=${T_PROFILE:-120} t_size2=${T_SIZE:-150}
  # One torch thread per process on the 2-core workstation, as the test suite runs.
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
else
  py=python3
  device=cuda results=bench/RESULTS.md
  levels=${LEVELS:-1,4,10,16,32,64} slot_levels=${SLOT_LEVELS:-1,4,10} frames=${FRAMES:-40}
  turns=0 official=${OFFICIAL_TURNS:-3} sizes=${SIZES:-0.6B 1.7B}
  t_pre=${T_PREFLIGHT:-75} t_size=${T_SIZE:-150} t_base=${T_BASELINES:-70}
  t_profile=${T_PROFILE:-60} t_size2=${T_SIZE:-125}
fi
export PYTHONUNBUFFERED=1

# stage NAME SECONDS COMMAND...: run under its own timeout, log to $OUT/NAME.log, record status.
stage() {
  local name=$1 limit=$2; shift 2
  local t0 rc status
  t0=$(date +%s)
  echo "== stage $name (at most $limit s)" >&2
  # The stage runs in its own bash (timeout runs commands, not functions): the functions and
  # settings below are exported to it.
  timeout --signal=TERM --kill-after=10 "$limit" bash -c '"$@"' stage "$@" 2>&1 \
      | tee "$out/$name.log"
  rc=${PIPESTATUS[0]}
  case $rc in
    0) status=ok ;;
    124|137) status="timed out after $limit s" ;;
    *) status="failed (exit $rc)" ;;
  esac
  printf '%s\t%s\t%s\n' "$name" "$status" "$(( $(date +%s) - t0 ))" >> "$out/stages.tsv"
  echo "== stage $name: $status in $(( $(date +%s) - t0 )) s" >&2
  "$py" bench/gpu_results.py --out "$out" --results "$results" --device "$device" >&2
  return $rc
}

preflight() {
  if [ "$device" = cuda ] && [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || { echo "preflight FAILED: carried wheels" ; return 1; }
  fi
  if [ "$device" = cuda ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
        > "$out/gpu.txt" || true
  fi
  "$py" bench/gpu_preflight.py --device "$device"
}

# batched SIZE: the batched engine through the scheduler at every level, graphs on.
batched() {
  local size=$1 model build=()
  if [ "$device" = cpu ]; then
    model=tiny  # the dry run: the tiny checkpoint stands in for every size
  else
    model=/tmp/random-$size build=(--build-random "$size")
  fi
  local n=$turns
  [ "$n" = 0 ] && n=16  # per level at least; a level of c callers runs max(n, c) turns
  (cd bench && "$py" engine.py --device "$device" --model "$model" "${build[@]}" \
      --engine batched --graphs on --levels "$levels" --turns "$n" --frames "$frames" \
      --official-turns 0 --markdown "$out/$size.md")
}

profile() {
  local model=tiny build=() shape=(--max-rows "${PROFILE_ROWS:-4}" --max-seq-len 256 --repeats 3)
  [ "$device" = cuda ] && model=/tmp/random-0.6B build=(--build-random 0.6B) shape=()
  "$py" bench/device_profile.py --device "$device" --model "$model" "${build[@]}" \
      "${shape[@]}" --out "$out/profile-0.6B.json"
}

baselines() {
  local model=tiny n=$turns build=()
  [ "$device" = cuda ] && model=/tmp/random-0.6B build=(--build-random 0.6B)
  [ "$n" = 0 ] && n=16
  (cd bench && "$py" engine.py --device "$device" --model "$model" "${build[@]}" --engine slots \
      --levels "$slot_levels" --turns "$n" --frames "$frames" \
      --official-turns "$official" --markdown "$out/baselines.md")
}

if [ "$device" = cuda ]; then
  export PYTHONPATH=/tmp/site:$root
else
  export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
fi
export py device out results levels slot_levels frames turns official root
export -f preflight batched profile baselines
if ! stage preflight "$t_pre" preflight; then
  echo "gpu run: the preflight failed; nothing else was run (see $out/preflight.log)" >&2
  exit 1
fi
for size in $sizes; do
  if [ "$size" = 0.6B ]; then
    stage "$size" "$t_size" batched "$size"
    stage profile "$t_profile" profile
  else
    stage "$size" "$t_size2" batched "$size"
  fi
done
stage baselines "$t_base" baselines
echo "gpu run: finished in $(( $(date +%s) - started )) s; stages:" >&2
cat "$out/stages.tsv" >&2
[ "$results" = "$out/RESULTS.md" ] || cp "$results" "$out/RESULTS.md"
# Every stage must have passed for the run to count as passed.
! grep -qv $'\tok\t' "$out/stages.tsv"
