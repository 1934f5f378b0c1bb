#!/usr/bin/env bash
# The GPU check at real size: one script, no network, about 8 minutes on one H200 (see bench/gpu_check.py).
#   bash bench/gpu_check.sh [--wheels DIR] [--out DIR] [--model NAME] [--parts a b c d e f g h i j k l m n o] [--dry-run]
# (g) trains under FSDP2 on one GPU, and on two where two or more are present; (h) is the forward-process
# (DiffusionNFT) update against the bare passes of its draws; (i) sharded save/resume time (one process); (j) the
# FSDP2 CPU-offload step against none; (k) where several GPUs are visible, torchrun over all of them: an HSDP step
# and a context-parallel forward/backward (bench/gpu_check_multi.py; the dry run: 2 CPU processes); (o) one Ray
# staleness-1 run of configs/tiny_jpeg.yaml, the rollout worker on a GPU (bench/gpu_check.py's docstring).
#   NAME: flux (default), sd3, qwenimage, qwenimage_edit_plus, zimage, flux2_klein, flux2, kontext, flux3, qwenimage21
# --wheels DIR: wheels carried to a bare GPU machine (diffusers, pydantic and its deps, open-clip-torch, ftfy,
#   wcwidth, and this project's two wheels from `pip wheel --no-deps . ./rewards`), installed offline into
#   OUT/site (pip --no-index --no-deps --target) and put first on PYTHONPATH, so their entry points are found too.
# --dry-run: the same code at toy sizes on the CPU (CI runs it; every part, (g) with one process).
# Writes OUT/gpu_check.json after every part and OUT/gpu_check.md (a table) at the end.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
wheels=""
out=${OUT:-/tmp/flowgrpo_gpu_check}
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) wheels=$2; shift 2 ;;
    --out) out=$2; args+=(--out "$2"); shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
mkdir -p "$out"
if [ -n "$wheels" ]; then
  python -m pip install --quiet --no-index --no-deps --target "$out/site" "$wheels"/*.whl
  export PYTHONPATH="$out/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$here:$here/rewards:${PYTHONPATH:-}"
python -c "import diffusers, pydantic" 2>/dev/null || {
  echo "error: diffusers and pydantic are needed; pass --wheels DIR with their wheels (offline)" >&2; exit 2; }
exec python "$here/bench/gpu_check.py" --out "$out" "${args[@]}"
