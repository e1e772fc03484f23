#!/usr/bin/env bash
# Downloads, into ./.whl of the current repo, the wheels that the GPU machine bench/gpu_batching.sh
# runs on (Python 3.12, torch 2.11 + torchaudio, transformers 5.17 preinstalled, no network) lacks for the Qwen3-TTS
# stack: pairing A (faster-qwen3-tts 0.2.6 + qwen-tts 0.1.1 + transformers 4.57.3) by default,
# or pairing B with `--pairing B` (faster-qwen3-tts 0.5.4 + qwen-tts-hf + transformers 5.16.1).
# Then, in the device run (carry: [".whl", ...]), start the command with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# Extra wheels your project needs: list them after the options, NAME==VERSION.
set -euo pipefail
pairing=A
if [ "${1:-}" = "--pairing" ]; then pairing=$2; shift 2; fi
top=$(git rev-parse --show-toplevel)
cd "$top"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
case $pairing in
  A) pkgs=(faster-qwen3-tts==0.2.6 qwen-tts==0.1.1 transformers==4.57.3 tokenizers==0.22.2 "huggingface-hub==0.36.0") ;;
  B) pkgs=(faster-qwen3-tts==0.5.4 qwen-tts-hf==0.1.1.post1 transformers==5.16.1 tokenizers==0.23.3) ;;
  *) echo "pairing must be A or B" >&2; exit 2 ;;
esac
# qwen_tts's own imports beyond what the image has (gradio is only for its demo UI: not needed)
# cffi (soundfile's backend) and platformdirs (pooch, which librosa imports) are not in the image.
pkgs+=(librosa==0.11.0 audioread lazy-loader pooch platformdirs soxr sox soundfile cffi pycparser decorator "$@")
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plat[@]}" -d .whl "${pkgs[@]}"
du -sh .whl
ls .whl
# Closure check: every requirement of every carried wheel must be carried or already in the image.
# KINDS_MD names a file listing the image's packages on a line "Packages: a, b, c." (the GPU
# machine's description); without it the check is skipped.
python3 - .whl "${KINDS_MD:-}" <<'PY'
import re, sys, zipfile
from pathlib import Path
try:
    from packaging.markers import Marker
except ImportError:
    from pip._vendor.packaging.markers import Marker
ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
       "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
#: Declared but never imported on the paths the gateway and its benchmarks use (qwen-tts's demo UI).
OPTIONAL = {"gradio"}
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
whl, kinds = Path(sys.argv[1]), Path(sys.argv[2])
if not sys.argv[2] or not kinds.is_file():
    print("closure check skipped: the image's package list not found (set KINDS_MD)"); sys.exit(0)
text = kinds.read_text()
m = re.search(r"Packages: (.*?)\.\s*$", text, re.M)
image = {norm(x) for x in m.group(1).split(", ")} if m else set()
carried, needs = set(), {}
for w in whl.glob("*.whl"):
    z = zipfile.ZipFile(w)
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    body = z.read(meta).decode()
    name = norm(re.search(r"^Name: (.+)$", body, re.M).group(1).strip())
    carried.add(name)
    for req in re.findall(r"^Requires-Dist: (.+)$", body, re.M):
        if "extra ==" in req:
            continue
        if ";" in req and not Marker(req.split(";", 1)[1]).evaluate(ENV):
            continue
        needs.setdefault(norm(re.split(r"[ ;<>=!~\[(]", req.strip())[0]), set()).add(name)
missing = {r: by for r, by in needs.items() if r not in carried | image | OPTIONAL}
for r, by in sorted(missing.items()):
    print(f"closure: {r} is needed by {', '.join(sorted(by))} and is neither carried nor in the image")
print("closure check: " + ("ok" if not missing else f"{len(missing)} missing (carry them, or check they are optional)"))
PY

