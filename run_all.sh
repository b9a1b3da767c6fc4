#!/usr/bin/env bash
# Run PPO, GRPO and GSPO on the same model, task, seeds and sample budget, one run at a time,
# then build one comparison table ($OUT/results.md, $OUT/results.json) and curves ($OUT/curves.png).
# --defaults: each script at its own settings instead (PPO 500 steps, GRPO and GSPO 1000), the same report.
# --moe: the MoE experiment instead (GRPO, GRPO with --routing-replay, GSPO on --model tiny-moe).
# --reward-model: each script with the learned reward tiny-rm against the same script with the rule reward.
# --staleness: GRPO vs GSPO (and PPO) on the long `sums` task at 1, 4, 8 minibatches per rollout
#   (experiments/staleness_sweep.py: resumes, skipping finished runs; its own table and plots).
# --mismatch: float32 against bf16 rollouts, pi_old from the sampler or recomputed, with and without
#   a correction (experiments/mismatch_sweep.py: resumes, skipping finished runs; its own table and plot).
# `bash run_all.sh --help` lists the settings; the report is experiments/compare_report.py.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

usage() {
    cat <<'EOF'
Usage: bash run_all.sh [--quick | --defaults] [--moe | --reward-model | --staleness [--plan] | --mismatch [--plan]]
                       [--report-only] [--help]

Trains ppo.py, grpo.py and gspo.py with identical settings (model, task, seeds, prompts per step,
samples per prompt, max new tokens, steps; --defaults: each its own), one run after another, then writes
  $OUT/<algo>-seed<k>/      each run's metrics.jsonl, summary.json, final/ (deleted before the run)
  $OUT/<algo>-seed<k>.log   each run's stdout + stderr
  $OUT/results.md           one row per algorithm (mean +- sample std over seeds), command, date, machine;
                            each clip fraction with its unit: (tokens), or (seqs) for GSPO's sequence ratio
  $OUT/results.json         the same numbers plus every seed's values
  $OUT/curves.png           eval accuracy and reward against step and against wall-clock
  $OUT/traces.html          the first seed's runs side by side, token by token (tools/show_traces.py)

Flags:
  --quick         a first look: SEEDS=0 STEPS=100 EVAL_EVERY=20, OUT=runs/compare-quick (variables
                  set explicitly still win). Measured: 7 min 34 s on a 2-core Intel Xeon shared with
                  other jobs (load average 7-12; the runs 263 + 82 + 102 s; 3 min 13 s of CPU time),
                  2026-12-03 (docs/results.md)
  --defaults      each script at its own defaults instead of one shared budget: every run is
                  `<algo>.py --seed <k> --out $OUT/<algo>-seed<k>` (with --model $MODEL if MODEL is
                  set, then EXTRA_ARGS and the *_ARGS), so PPO runs 500 steps x 128 prompts x 1
                  sample, GRPO and GSPO 1000 x 64 x 4, each with its own learning rate and clip.
                  The report tabulates and plots each config against its own steps and wall-clock,
                  refuses a run that did not finish the steps its summary.json planned, and its
                  settings line names where the configs differ. SEEDS and OUT [runs/defaults] as
                  below; STEPS, PROMPTS_PER_STEP, GROUP_SIZE, MAX_NEW_TOKENS, EVAL_EVERY and
                  MINIBATCHES are refused (exit 2): pass a flag through *_ARGS instead. The README's
                  plot: SEEDS="0 1 2" bash run_all.sh --defaults, 9 runs; run two at a time on a
                  2-core Intel Xeon shared with other jobs (load average 7-12) they took 369-1406 s
                  each, 7,255 s in all (2026-12-03, docs/results.md); one at a time not yet timed
  --moe           the MoE experiment (GSPO paper, arXiv 2507.18071, section 5.3) instead: on the
                  embedded tiny Qwen3-MoE (--model tiny-moe: 8 experts, top-2, every layer sparse),
                  configs grpo (grpo.py), grpo-replay (grpo.py --routing-replay) and gspo (gspo.py),
                  same budget and seeds; 6 runs, about 9 minutes on 2 CPU cores (STEPS=20 for a first look).
                  Writes
                    $OUT/<config>/seed<k>/ and $OUT/<config>/seed<k>.log   each run, as above
                    $OUT/moe_results.md   eval accuracy before/after, reward, routing drift per step,
                                          ratio std, clip frac, wall-clock: means over seeds (and steps)
                    $OUT/moe_curves.png   eval accuracy, reward, routing drift, ratio std, clip frac vs step
                  Defaults: STEPS [120] SEEDS ["0 1"] PROMPTS_PER_STEP [32] GROUP_SIZE [4]
                  MINIBATCHES [4] EVAL_EVERY [25] OUT [runs/moe]; MODEL is tiny-moe; MAX_NEW_TOKENS
                  is not passed (the scripts' default).
  --reward-model  the reward-model experiment (docs/reward_model.md): configs ppo, ppo-rm, grpo,
                  grpo-rm, gspo, gspo-rm, where <algo>-rm adds --reward-model tiny-rm (the embedded
                  learned reward, built on first use; alone it is the whole reward) and <algo> keeps
                  the rule reward; same seeds and budget. Writes, besides the runs ($OUT/<config>-seed<k>/),
                    $OUT/rm_results.md   eval accuracy before/after, the reward model's eval score,
                                         kl_to_init, its pairwise accuracy on the policy's samples at
                                         the first and last step, step time and peak memory
                    $OUT/rm_curves.png   eval accuracy and reward-model score against step, and
                                         against kl_to_init (Gao et al. 2022's axis)
                  Default OUT [runs/rm]; the other settings as without it.
  --staleness     the staleness sweep (docs/staleness.md): grpo (seq-mean-token-mean),
                  gspo (sequence), grpo-tokenmean, gspo-token and ppo on the long `sums` task,
                  --minibatches 1, 4 and 8 with 1 epoch, seeds 0 1 2. Prints its
                  planned total first; RESUMES: a run that reached its last step is skipped. Writes
                  $OUT/<config>/mb<k>/seed<s>/ and .log, $OUT/staleness_results.md and .json (mean
                  +- std over seeds per config x staleness: accuracy, collapses, ratio statistics,
                  clip fractions, grad-norm spikes, entropy), $OUT/staleness_accuracy.png and
                  $OUT/staleness_ratios.png. Its own settings: CONFIGS, MINIBATCHES, STEPS, SEEDS,
                  PROMPTS_PER_STEP, GROUP_SIZE, EVAL_EVERY, EVAL_SIZE, OUT [runs/staleness]; with
                  --quick one seed of 20 steps in runs/staleness-quick; --plan prints the grid and
                  its planned time and runs nothing; --report-only as below. The settings and
                  defaults: python experiments/staleness_sweep.py --help and the file's docstring.
  --mismatch      the rollout-mismatch sweep (docs/rollout_mismatch.md): grpo, gspo and ppo on arith
                  and sums with float32 / bf16 rollouts, --old-logp rollout or recompute, with and
                  without --is-correction, seeds 0 1 2. RESUMES like --staleness; writes
                  $OUT/mismatch.md and $OUT/mismatch.png [OUT: runs/mismatch]; --plan and
                  --report-only as for --staleness. Settings: experiments/mismatch_sweep.py.
  --report-only   train nothing; rebuild the table and the plot from the run directories in $OUT
                  (with the STEPS and SEEDS of the runs; with --defaults, SEEDS only)
  --help          this text

Environment (default in brackets; see --moe for its own):
  STEPS [200]  SEEDS ["0 1 2"]  PROMPTS_PER_STEP [64]  GROUP_SIZE [4]  MAX_NEW_TOKENS [8]
  EVAL_EVERY [25]  MODEL [tiny]  OUT [runs/compare]
  MINIBATCHES [4]          --moe only
  PYTHON [python]          interpreter used for the scripts and the report
  EXTRA_ARGS               extra flags passed to every run (after the shared ones, so they win)
  PPO_ARGS, GRPO_ARGS, GSPO_ARGS   extra flags for one script's runs only (passed last)
  (*_ARGS are split on whitespace; quoting inside them is not interpreted.)

Any failing run stops everything: the script names the run, prints its log's tail, exits non-zero
and writes no table. The report also refuses to build unless every (config, seed) run has a
summary.json with the requested number of steps (--defaults: the run's own, the same for every seed
of a config).
EOF
}

QUICK=0
DEFAULTS=0
MOE=0
RM=0
REPORT_ONLY=0
STALENESS=0
MISMATCH=0
PLAN=0
for a in "$@"; do
    case "$a" in
        --quick) QUICK=1 ;;
        --defaults) DEFAULTS=1 ;;
        --moe) MOE=1 ;;
        --reward-model) RM=1 ;;
        --report-only) REPORT_ONLY=1 ;;
        --staleness) STALENESS=1 ;;
        --mismatch) MISMATCH=1 ;;
        --plan) PLAN=1 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "run_all.sh: unknown argument '$a' (see --help)" >&2; exit 2 ;;
    esac
done
if [[ $MISMATCH == 1 ]]; then  # its own driver and report, in Python
    if [[ $MOE == 1 || $RM == 1 || $STALENESS == 1 || $QUICK == 1 || $DEFAULTS == 1 ]]; then
        echo "run_all.sh: --mismatch is its own experiment; it does not combine with --quick, --defaults, --moe, --reward-model or --staleness" >&2
        exit 2
    fi
    sweep=(--out "${OUT:-runs/mismatch}")
    [[ $PLAN == 1 ]] && sweep+=(--plan)
    [[ $REPORT_ONLY == 1 ]] && sweep+=(--report-only)
    exec "${PYTHON:-python}" "$ROOT/experiments/mismatch_sweep.py" "${sweep[@]}"
fi
if [[ $STALENESS == 1 ]]; then  # its own driver and report, in Python
    if [[ $MOE == 1 || $RM == 1 || $DEFAULTS == 1 ]]; then
        echo "run_all.sh: --staleness is its own experiment; it does not combine with --defaults, --moe or --reward-model" >&2
        exit 2
    fi
    sweep=()
    [[ $QUICK == 1 ]] && sweep+=(--quick)
    [[ $PLAN == 1 ]] && sweep+=(--plan)
    [[ $REPORT_ONLY == 1 ]] && sweep+=(--report-only)
    exec "${PYTHON:-python}" "$ROOT/experiments/staleness_sweep.py" "${sweep[@]+"${sweep[@]}"}"
fi
if [[ $PLAN == 1 ]]; then
    echo "run_all.sh: --plan belongs to --staleness or --mismatch" >&2
    exit 2
fi
if [[ $QUICK == 1 && $MOE == 1 ]]; then
    echo "run_all.sh: --quick and --moe do not combine; a first look at the MoE experiment: STEPS=20 bash run_all.sh --moe" >&2
    exit 2
fi

if [[ $DEFAULTS == 1 ]]; then
    if [[ $QUICK == 1 || $MOE == 1 || $RM == 1 ]]; then
        echo "run_all.sh: --defaults runs each script at its own settings; it does not combine with --quick, --moe or --reward-model" >&2
        exit 2
    fi
    for v in STEPS PROMPTS_PER_STEP GROUP_SIZE MAX_NEW_TOKENS EVAL_EVERY MINIBATCHES; do
        if [[ -n "${!v+set}" ]]; then
            echo "run_all.sh: --defaults keeps each script's own settings, but $v is set; unset it, or pass the flag in PPO_ARGS, GRPO_ARGS or GSPO_ARGS" >&2
            exit 2
        fi
    done
    MODEL_FLAG=()  # only a MODEL set explicitly is passed: otherwise the script's own default
    if [[ -n "${MODEL:-}" ]]; then MODEL_FLAG=(--model "$MODEL"); fi
    : "${OUT:=runs/defaults}"
fi

if [[ $MOE == 1 && $RM == 1 ]]; then
    echo "run_all.sh: --moe and --reward-model are separate experiments; run one, then the other" >&2
    exit 2
fi
[[ $RM == 1 && $QUICK == 1 ]] && : "${OUT:=runs/rm-quick}"
[[ $RM == 1 ]] && : "${OUT:=runs/rm}"

if [[ $QUICK == 1 ]]; then
    : "${SEEDS:=0}" "${STEPS:=100}" "${EVAL_EVERY:=20}" "${OUT:=runs/compare-quick}"
fi
if [[ $MOE == 1 ]]; then
    # A config is named after its script (the part before "-"); VARIANT_FLAGS holds a variant's flags.
    CONFIGS=(grpo grpo-replay gspo)
    declare -A VARIANT_FLAGS=([grpo-replay]="--routing-replay")
    : "${STEPS:=120}" "${SEEDS:=0 1}" "${PROMPTS_PER_STEP:=32}" "${OUT:=runs/moe}"
    MODEL=tiny-moe
elif [[ $RM == 1 ]]; then
    CONFIGS=(ppo ppo-rm grpo grpo-rm gspo gspo-rm)
    declare -A VARIANT_FLAGS=([ppo-rm]="--reward-model tiny-rm" [grpo-rm]="--reward-model tiny-rm"
                              [gspo-rm]="--reward-model tiny-rm")
else
    CONFIGS=(ppo grpo gspo)
    declare -A VARIANT_FLAGS=()
fi
STEPS="${STEPS:-200}"   # step budget per run, the same for all (alone, grpo/gspo default to 1000 steps, ppo to 500)
SEEDS="${SEEDS:-0 1 2}"
PROMPTS_PER_STEP="${PROMPTS_PER_STEP:-64}"
GROUP_SIZE="${GROUP_SIZE:-4}"
MAX_NEW_TOKENS="${MAX_NEW_TOKENS:-8}"
MINIBATCHES="${MINIBATCHES:-4}"
EVAL_EVERY="${EVAL_EVERY:-25}"
MODEL="${MODEL:-tiny}"
OUT="${OUT:-runs/compare}"
PYTHON="${PYTHON:-python}"
EXTRA_ARGS="${EXTRA_ARGS:-}"
PPO_ARGS="${PPO_ARGS:-}"
GRPO_ARGS="${GRPO_ARGS:-}"
GSPO_ARGS="${GSPO_ARGS:-}"

die() { echo "run_all.sh: error: $*" >&2; exit 1; }

for v in STEPS PROMPTS_PER_STEP GROUP_SIZE MAX_NEW_TOKENS MINIBATCHES EVAL_EVERY; do
    [[ "${!v}" =~ ^[0-9]+$ ]] || die "$v must be a non-negative integer, got '${!v}'"
done
read -r -a SEED_LIST <<< "$SEEDS"
[[ ${#SEED_LIST[@]} -gt 0 ]] || die "SEEDS is empty"
for s in "${SEED_LIST[@]}"; do
    [[ "$s" =~ ^[0-9]+$ ]] || die "SEEDS must be integers separated by spaces, got '$SEEDS'"
done
command -v "$PYTHON" >/dev/null 2>&1 || die "PYTHON='$PYTHON' not found on PATH"

# The command as it can be re-run, for the report. A --report-only rebuild depends on STEPS, SEEDS
# and OUT only; the report's settings line is read from the runs' own summary.json.
MODE_FLAG=""
[[ $MOE == 1 ]] && MODE_FLAG=" --moe"
[[ $RM == 1 ]] && MODE_FLAG=" --reward-model"
if [[ $DEFAULTS == 1 ]]; then  # SEEDS, OUT, MODEL and the *_ARGS are all it reads
    CMD="SEEDS=\"$SEEDS\" OUT=$OUT"
    if [[ ${#MODEL_FLAG[@]} -gt 0 ]]; then CMD+=" MODEL=$MODEL"; fi
    if [[ $REPORT_ONLY == 0 ]]; then
        for v in EXTRA_ARGS PPO_ARGS GRPO_ARGS GSPO_ARGS; do
            [[ -n "${!v}" ]] && CMD+=" $v=\"${!v}\""
        done
    fi
    CMD+=" bash run_all.sh --defaults"
    [[ $REPORT_ONLY == 1 ]] && CMD+=" --report-only"
elif [[ $REPORT_ONLY == 1 ]]; then
    CMD="STEPS=$STEPS SEEDS=\"$SEEDS\" OUT=$OUT bash run_all.sh$MODE_FLAG --report-only"
else
    CMD="STEPS=$STEPS SEEDS=\"$SEEDS\" PROMPTS_PER_STEP=$PROMPTS_PER_STEP GROUP_SIZE=$GROUP_SIZE"
    if [[ $MOE == 1 ]]; then
        CMD+=" MINIBATCHES=$MINIBATCHES EVAL_EVERY=$EVAL_EVERY"
    else
        CMD+=" MAX_NEW_TOKENS=$MAX_NEW_TOKENS EVAL_EVERY=$EVAL_EVERY MODEL=$MODEL"
    fi
    CMD+=" OUT=$OUT"
    for v in EXTRA_ARGS PPO_ARGS GRPO_ARGS GSPO_ARGS; do
        [[ -n "${!v}" ]] && CMD+=" $v=\"${!v}\""
    done
    CMD+=" bash run_all.sh$MODE_FLAG"
    [[ $QUICK == 1 ]] && CMD+=" --quick"
fi

# One run's directory and log: $OUT/<config>-seed<k>[.log], or $OUT/<config>/seed<k>[.log] under --moe.
run_dir() {
    if [[ $MOE == 1 ]]; then echo "$OUT/$1/seed$2"; else echo "$OUT/$1-seed$2"; fi
}

mkdir -p "$OUT"
# Never leave a table from an earlier invocation next to runs it does not describe.
if [[ $MOE == 1 ]]; then
    rm -f "$OUT/moe_results.md" "$OUT/moe_curves.png"
elif [[ $RM == 1 ]]; then
    rm -f "$OUT/rm_results.md" "$OUT/rm_curves.png"
else
    rm -f "$OUT/results.md" "$OUT/results.json" "$OUT/curves.png"
fi
rm -f "$OUT/traces.html"

# ------------------------------------------------------------------------------------------------
# Training: every (seed, config) in turn; the first failure stops everything.
# ------------------------------------------------------------------------------------------------
if [[ $REPORT_ONLY == 0 ]]; then
    read -r -a extra <<< "$EXTRA_ARGS"
    total=$(( ${#SEED_LIST[@]} * ${#CONFIGS[@]} ))
    n=0
    t_all=$SECONDS
    echo "run_all.sh: $total runs, one at a time: $CMD"
    for seed in "${SEED_LIST[@]}"; do
        for config in "${CONFIGS[@]}"; do
            n=$((n + 1))
            algo="${config%%-*}"
            dir="$(run_dir "$config" "$seed")"
            log="$dir.log"
            per_var="${algo^^}_ARGS"
            read -r -a per <<< "${!per_var}"
            read -r -a variant <<< "${VARIANT_FLAGS[$config]:-}"
            rm -rf "$dir" "$log"
            mkdir -p "$(dirname "$dir")"
            if [[ $DEFAULTS == 1 ]]; then  # the script's own settings: only the seed and the place
                cmd=("$PYTHON" "$ROOT/$algo.py" "${MODEL_FLAG[@]+"${MODEL_FLAG[@]}"}" --seed "$seed" --out "$dir")
            else
                cmd=("$PYTHON" "$ROOT/$algo.py" --model "$MODEL" --steps "$STEPS" --seed "$seed"
                     --prompts-per-step "$PROMPTS_PER_STEP" --group-size "$GROUP_SIZE")
                if [[ $MOE == 1 ]]; then
                    cmd+=(--minibatches "$MINIBATCHES")
                else
                    cmd+=(--max-new-tokens "$MAX_NEW_TOKENS")
                fi
                cmd+=(--eval-every "$EVAL_EVERY" --out "$dir")
            fi
            cmd+=("${variant[@]+"${variant[@]}"}" "${extra[@]+"${extra[@]}"}" "${per[@]+"${per[@]}"}")
            echo "[$n/$total] $config seed $seed -> $dir  (log: $log)"
            t0=$SECONDS
            rc=0
            "${cmd[@]}" >"$log" 2>&1 || rc=$?
            if [[ $rc != 0 ]]; then
                {
                    echo
                    echo "run_all.sh: FAILED: $config seed $seed (exit status $rc)"
                    echo "  command: ${cmd[*]}"
                    echo "  log: $log -- last lines:"
                    tail -n 20 "$log" | tr '\r' '\n' | grep -v '^[[:space:]]*$' | tail -n 15 | sed 's/^/    /'
                    echo "run_all.sh: stopped after $((n - 1)) of $total runs completed; no results table written."
                } >&2
                exit 1
            fi
            echo "      done in $((SECONDS - t0)) s"
        done
    done
    echo "run_all.sh: all $total runs finished in $((SECONDS - t_all)) s"
fi

# ------------------------------------------------------------------------------------------------
# Report: verify every run, then the table and the curves.
# ------------------------------------------------------------------------------------------------
report=("$PYTHON" "$ROOT/experiments/compare_report.py" --out "$OUT" --configs "${CONFIGS[@]}"
        --seeds "${SEED_LIST[@]}" --command "$CMD")
if [[ $DEFAULTS == 1 ]]; then report+=(--own-steps); else report+=(--steps "$STEPS"); fi
[[ $MOE == 1 ]] && report+=(--moe)
[[ $RM == 1 ]] && report+=(--reward-model)
"${report[@]}"

# The first seed's traces (each run writes them at every evaluation), side by side on one page.
traced=()
for config in "${CONFIGS[@]}"; do
    dir="$(run_dir "$config" "${SEED_LIST[0]}")"
    if [[ -s "$dir/traces.jsonl" ]]; then traced+=("$dir"); fi
done
if [[ ${#traced[@]} -gt 0 ]]; then
    "$PYTHON" "$ROOT/tools/show_traces.py" "${traced[@]}" --out "$OUT/traces.html"
fi
