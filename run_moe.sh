#!/usr/bin/env bash
# The MoE experiment (GSPO paper, arXiv 2507.18071, section 5.3): on the embedded tiny Qwen3-MoE
# (--model tiny-moe: 8 experts, top-2, every layer sparse), GRPO, GRPO with --routing-replay and
# GSPO, same budget and seeds, then a table (OUT/moe_results.md) and a plot (OUT/moe_curves.png) of
# held-out accuracy, reward, routing drift, ratio spread and clip fraction against step.
#
#   bash run_moe.sh                  # defaults below: about 18 minutes on 2 CPU cores (6 runs of ~3 min)
#   STEPS=20 bash run_moe.sh         # a first look
#   bash run_moe.sh --report-only    # rebuild the table and plot from OUT
#
# Settings (environment): STEPS [120] SEEDS ["0 1"] PROMPTS_PER_STEP [32] GROUP_SIZE [4]
#   MINIBATCHES [4] EVAL_EVERY [25] OUT [runs/moe] PYTHON [python]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
STEPS="${STEPS:-120}"
SEEDS="${SEEDS:-0 1}"
PROMPTS_PER_STEP="${PROMPTS_PER_STEP:-32}"
GROUP_SIZE="${GROUP_SIZE:-4}"
MINIBATCHES="${MINIBATCHES:-4}"
EVAL_EVERY="${EVAL_EVERY:-25}"
OUT="${OUT:-runs/moe}"
PYTHON="${PYTHON:-python}"
REPORT_ONLY=0
for a in "$@"; do
    case "$a" in
        --report-only) REPORT_ONLY=1 ;;
        -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
        *) echo "run_moe.sh: unknown argument '$a' (see --help)" >&2; exit 2 ;;
    esac
done

# name -> script and flags: the three configurations differ only here
declare -A SCRIPT=([grpo]=grpo.py [grpo-replay]=grpo.py [gspo]=gspo.py)
declare -A FLAGS=([grpo]="" [grpo-replay]="--routing-replay" [gspo]="")
CONFIGS="grpo grpo-replay gspo"

if [[ $REPORT_ONLY == 0 ]]; then
    "$PYTHON" -c "import sys; sys.path.insert(0, '$ROOT'); import common; common.tiny_checkpoint('tiny-moe')"
    for seed in $SEEDS; do
        for name in $CONFIGS; do
            dir="$OUT/$name/seed$seed"
            echo "== $name seed $seed -> $dir"
            mkdir -p "$(dirname "$dir")"
            # shellcheck disable=SC2086
            "$PYTHON" "$ROOT/${SCRIPT[$name]}" --model tiny-moe --steps "$STEPS" --seed "$seed" \
                --prompts-per-step "$PROMPTS_PER_STEP" --group-size "$GROUP_SIZE" --minibatches "$MINIBATCHES" \
                --eval-every "$EVAL_EVERY" --out "$dir" ${FLAGS[$name]} > "$dir.log" 2>&1 \
                || { echo "run failed, log: $dir.log" >&2; tail -5 "$dir.log" >&2; exit 1; }
        done
    done
fi

OUT="$OUT" CONFIGS="$CONFIGS" SEEDS="$SEEDS" "$PYTHON" - <<'EOF'
import json, math, os
from pathlib import Path

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

out, configs, seeds = Path(os.environ["OUT"]), os.environ["CONFIGS"].split(), os.environ["SEEDS"].split()
KEYS = ["reward", "routing_drift", "ratio_std", "clip_frac"]
runs = {}
for name in configs:
    for seed in seeds:
        d = out / name / f"seed{seed}"
        rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
        runs[name, seed] = (json.loads((d / "summary.json").read_text()), rows)


def mean(xs):
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else float("nan")


lines = ["| config | eval acc before | eval acc after | reward (last 10 steps) | routing drift / step "
         "| ratio std | clip frac | wall (s) |", "|---" * 8 + "|"]
for name in configs:
    per = [runs[name, s] for s in seeds]
    cell = lambda k: mean([mean([r.get(k) for r in rows]) for _, rows in per])  # noqa: E731
    lines.append(f"| {name} | {mean([s['eval_accuracy_before'] for s, _ in per]):.3f} "
                 f"| {mean([s['eval_accuracy_after'] for s, _ in per]):.3f} "
                 f"| {mean([mean([r['reward'] for r in rows[-10:]]) for _, rows in per]):.3f} "
                 f"| {cell('routing_drift'):.4f} | {cell('ratio_std'):.4f} | {cell('clip_frac'):.4f} "
                 f"| {mean([s['wall_time_s'] for s, _ in per]):.0f} |")
(out / "moe_results.md").write_text("\n".join(lines) + f"\n\nseeds: {' '.join(seeds)}; means over steps and seeds\n")
print("\n".join(lines))

fig, axes = plt.subplots(1, 5, figsize=(22, 4))
for name in configs:
    for i, seed in enumerate(seeds):
        summary, rows = runs[name, seed]
        label = name if i == 0 else None
        ev = [(0, summary["eval_accuracy_before"])] + [(r["step"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r]
        axes[0].plot(*zip(*ev), marker="o", label=label, color=f"C{configs.index(name)}")
        for ax, k in zip(axes[1:], KEYS):
            ax.plot([r["step"] for r in rows], [r.get(k) for r in rows], label=label, color=f"C{configs.index(name)}", alpha=0.8)
for ax, title in zip(axes, ["held-out accuracy"] + KEYS):
    ax.set_title(title)
    ax.set_xlabel("step")
axes[0].legend()
fig.tight_layout()
fig.savefig(out / "moe_curves.png", dpi=100)
print(f"wrote {out / 'moe_results.md'} and {out / 'moe_curves.png'}")
EOF
