#!/usr/bin/env bash
# The GPU check, as one command (one CUDA GPU, no network; about 9 minutes, hard-bound):
# 1. the gpu test tier (tests/test_gpu.py: greedy against HF generate, bf16 autocast against float32, 3 steps
#    of each script at tiny and at Qwen2.5-0.5B's shape, stop/resume bit for bit, torchrun with and without
#    --fsdp), bounded by GPU_TIER_SECONDS (200); its failure is reported and the table still runs;
# 2. the benchmark table (see benchmarks/gpu.py): gspo/grpo/ppo end to end on the tiny model and at
#    Qwen2.5-0.5B's shape (exit status, wall time, steps/s, rollout tokens/s, peak GPU memory against
#    tools/plan_memory.py), gspo.py under torchrun with and without --fsdp, and the sampler against HF
#    generate (and greedy with --cuda-graph against the eager step: unmeasured so far) with one training step
#    per loss, bounded by GPU_BENCH_SECONDS (360): gpu.py plans its rows into 30 s less and is stopped 10 s
#    before the end; then, only if at least 75 s are left,
#    benchmarks/rollout_dtype.py (bf16 against float32 rollouts) runs in what remains.
# Extra arguments go to gpu.py:
#   bash benchmarks/gpu.sh --skip-generate --modes chunked
#   bash benchmarks/gpu.sh --cpu-smoke      # the table's rows at tiny sizes on CPU (no tier): does it run?
# The exit status is the table's, or 1 when the tier failed.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
tier=0
if [[ " $* " != *" --cpu-smoke "* ]]; then
  echo "== the gpu tier: python -m pytest -q -m gpu"
  timeout --signal=INT --kill-after=5 "${GPU_TIER_SECONDS:-200}" python -m pytest -q -m gpu -rs || tier=$?
  echo "== the gpu tier's exit status: $tier"
fi
start=$SECONDS
total=${GPU_BENCH_SECONDS:-360}
timeout --signal=INT --kill-after=5 $((total - 10)) python benchmarks/gpu.py --time-budget $((total - 30)) "$@"
left=$((total - (SECONDS - start) - 5))
if [[ " $* " != *" --cpu-smoke "* ]] && ((left >= 75)); then
  timeout --signal=INT --kill-after=5 "$left" python benchmarks/rollout_dtype.py --device cuda --repeats 3
fi
((tier == 0)) || exit 1
