#!/usr/bin/env bash
# One entry point for people and CI.
#   ./run.sh [serve options]   set up .venv (first run, or when pyproject.toml changed), run the gateway
#   ./run.sh test [pytest args] set up the same way, run the test suite (CI runs exactly this)
#   ./run.sh setup             only set up
#   ./run.sh --help | help [COMMAND]   the gateway's commands, or one command's options
#   ./run.sh COMMAND ...       any other gateway command (demo, call, say, script, loadsim...)
set -euo pipefail
cd "$(dirname "$0")"

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
# qwen_tts imports torchaudio at import time, and PyPI's torchaudio only loads beside a CUDA
# build of torch (beside a CPU-only torch it fails with "libc10_cuda.so not found"). This pair
# imports on machines with or without a GPU. See docs/architecture/decisions.md.
TORCH_PAIR=("torch==2.14.1" "torchaudio==2.11.1")

setup() {
  local stamp="$VENV/.installed"
  if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt run.sh ]; then
    return
  fi
  echo "run.sh: setting up $VENV (first run takes a few minutes: torch is large)" >&2
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "${TORCH_PAIR[@]}"
  "$VENV/bin/python" -m pip install -q -e ".[test]"
  "$VENV/bin/python" -c "import qwen_tts, faster_qwen3_tts, torchaudio" >/dev/null
  # librosa (qwen_tts's audio library) compiles its numba functions the first time they are
  # imported and caches them beside its sources: ~20 CPU-s, in every process that imports it
  # before the cache exists. Once here, not in each test worker and gateway of the first run.
  "$VENV/bin/python" -c "import librosa.core.audio, librosa.util.utils" >/dev/null
  touch "$stamp"
}

cmd=${1:-serve}
case "$cmd" in
  setup) setup ;;
  test)
    shift
    setup
    # Parallel workers (pytest-xdist): the suite mostly waits on sockets, peers and timers,
    # so three processes on two cores finish it in about half the serial time. A module
    # stays on one worker (--dist loadfile): its module-scoped gateway is started once, and
    # modules are handed out in collection order (--no-loadscope-reorder; tests/conftest.py
    # puts the real-time ones first), not by their number of tests.
    # TEST_WORKERS=0 runs it serially (for a debugger, or -x on the first failure).
    # One torch (OpenMP) thread per test process: the tiny model gains nothing from two, and
    # three workers with two spinning OpenMP threads each on two cores cost ~20% more CPU for
    # the same run (measured per test: 550 vs 447 CPU-s for the whole suite).
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
    # Bytecode caches on, even where the environment turns them off (PYTHONDONTWRITEBYTECODE):
    # pytest rewrites the assertions of every test module and of its plugins' packages
    # (hypothesis alone is 73 modules) on each import without them, and every gateway process
    # a test starts compiles the package again. Cached: 15.3 -> 8.8 CPU-s per collection.
    unset PYTHONDONTWRITEBYTECODE
    exec "$VENV/bin/python" -m pytest -q -n "${TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder "$@"
    ;;
  serve) shift; setup; exec "$VENV/bin/gateway" serve "$@" ;;
  -h|--help) setup; exec "$VENV/bin/gateway" --help ;;
  help) shift; setup; exec "$VENV/bin/gateway" "$@" --help ;;
  -*) setup; exec "$VENV/bin/gateway" serve "$@" ;;
  *) setup; exec "$VENV/bin/gateway" "$@" ;;
esac
