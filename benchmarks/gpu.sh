#!/usr/bin/env bash
# GPU benchmark (see benchmarks/gpu.py): gspo/grpo/ppo end to end on the tiny model and at Qwen2.5-0.5B's
# shape (exit status, wall time, steps/s, rollout tokens/s, peak GPU memory against tools/plan_memory.py),
# gspo.py under torchrun with and without --fsdp, and the sampler against HF generate with one training
# step per loss. One CUDA GPU, no network; one table, in about 5 minutes. The whole command is bounded
# by GPU_BENCH_SECONDS (360): gpu.py plans its rows into 30 s less and is stopped 10 s before the end;
# then, only if at least 75 s are left, benchmarks/rollout_dtype.py (bf16 against float32 rollouts:
# tokens/s and peak memory of the scripts' sampler) runs in what remains. Extra arguments go to gpu.py:
#   bash benchmarks/gpu.sh --skip-generate --modes chunked
#   bash benchmarks/gpu.sh --cpu-smoke      # every row at tiny sizes on CPU: only checks that everything runs
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
total=${GPU_BENCH_SECONDS:-360}
timeout --signal=INT --kill-after=5 $((total - 10)) python benchmarks/gpu.py --time-budget $((total - 30)) "$@"
left=$((total - SECONDS - 5))
if [[ " $* " != *" --cpu-smoke "* ]] && ((left >= 75)); then
  timeout --signal=INT --kill-after=5 "$left" python benchmarks/rollout_dtype.py --device cuda --repeats 3
fi
