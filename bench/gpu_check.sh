#!/usr/bin/env bash
# A short GPU check (a few minutes), for when a GPU machine is available; never part of CI.
#   bash bench/gpu_check.sh [OUT_DIR]
# 1. one-process bf16 training of the tiny FLUX model on CUDA (float32 SDE arithmetic): the on-policy
#    log-prob mismatch must be exactly 0.0;
# 2. the same with every visible GPU under DDP (accelerate launch --multi_gpu), when there are several;
# 3. peak memory of rollout and update (bench/memory.py) and the speed table (bench/speed.py).
set -euo pipefail
out=${1:-${OUT:-/tmp/flowgrpo_gpu_check}}
mkdir -p "$out"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
common=(model.pretrained=tiny model.dtype=bfloat16 model.max_sequence_length=32 sampling.num_steps=6
        train.num_epochs=2 train.prompts_per_epoch=4 train.group_size=4 train.rollout_batch_size=8
        'rewards=[{name: jpeg_compressibility}]' data.train_prompts=t2i_compbench logging.progress=false)
accelerate launch --num_processes 1 flowgrpo/train.py "${common[@]}" output_dir="$out/one" 2>&1 | tail -5
python - "$out/one/metrics.jsonl" <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
mm = [r["policy/logprob_mismatch_max"] for r in recs]
print("logprob_mismatch_max per epoch:", mm)
assert all(m == 0.0 for m in mm), "on-policy ratio is not exactly 1"
PY
ngpu=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$ngpu" -gt 1 ]; then
  accelerate launch --multi_gpu --num_processes "$ngpu" flowgrpo/train.py "${common[@]}" \
    train.prompts_per_epoch=$((4 * ngpu)) output_dir="$out/ddp" 2>&1 | tail -5
fi
python bench/memory.py --sizes 256 512 --json "$out/memory.json"
python bench/speed.py --json "$out/speed.json"
