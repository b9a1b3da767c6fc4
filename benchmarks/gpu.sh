#!/usr/bin/env bash
# GPU benchmark: rollout tokens/s, training tokens/s and peak GPU memory of gspo/grpo/ppo on a
# randomly initialised Qwen2.5-0.5B-sized model (see benchmarks/gpu.py). Needs a CUDA GPU, no
# network. Prints one table; bounded to 8 minutes. Extra arguments go to benchmarks/gpu.py, e.g.
#   bash benchmarks/gpu.sh --skip-generate --modes chunked
#   bash benchmarks/gpu.sh --cpu-smoke      # tiny sizes on CPU: only checks that everything runs
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# bf16 against float32 rollouts (--rollout-dtype): tokens/s and peak memory of the scripts' sampler
[[ " $* " == *" --cpu-smoke "* ]] || timeout 120 python benchmarks/rollout_dtype.py --device cuda --repeats 3
exec timeout --signal=INT --kill-after=20 "${GPU_BENCH_TIMEOUT:-480}" python benchmarks/gpu.py "$@"
