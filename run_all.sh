#!/usr/bin/env bash
# Run PPO, GRPO and GSPO on the same model, task, seeds and sample budget, one run at a time,
# then build one comparison table ($OUT/results.md, $OUT/results.json) and curves ($OUT/curves.png).
# `bash run_all.sh --help` lists the settings.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ALGOS=(ppo grpo gspo)

usage() {
    cat <<'EOF'
Usage: bash run_all.sh [--quick] [--report-only] [--help]

Trains ppo.py, grpo.py and gspo.py with identical settings (model, task, seeds, prompts per step,
samples per prompt, max new tokens, steps), one run after another, then writes
  $OUT/<algo>-seed<k>/      each run's metrics.jsonl, summary.json, final/ (deleted before the run)
  $OUT/<algo>-seed<k>.log   each run's stdout + stderr
  $OUT/results.md           one row per algorithm (mean +- sample std over seeds), command, date, machine
  $OUT/results.json         the same numbers plus every seed's values
  $OUT/curves.png           eval accuracy and reward against step and against wall-clock

Flags:
  --quick         a first look in about 3 minutes: SEEDS=0 STEPS=100 EVAL_EVERY=20,
                  OUT=runs/compare-quick (variables set explicitly still win)
  --report-only   train nothing; rebuild the table and the plot from the run directories in $OUT
  --help          this text

Environment (default in brackets):
  STEPS [200]  SEEDS ["0 1 2"]  PROMPTS_PER_STEP [64]  GROUP_SIZE [4]  MAX_NEW_TOKENS [8]
  EVAL_EVERY [25]  MODEL [tiny]  TASK [the scripts' default, arith]  OUT [runs/compare]
  PYTHON [python]          interpreter used for the scripts and the report
  EXTRA_ARGS               extra flags passed to all three scripts (after the shared ones, so they win)
  PPO_ARGS, GRPO_ARGS, GSPO_ARGS   extra flags for one script only (passed last)
  (*_ARGS are split on whitespace; quoting inside them is not interpreted.)

Any failing run stops everything: the script names the run, prints its log's tail, exits non-zero
and writes no table. The report also refuses to build unless every (algo, seed) run has a
summary.json with the requested number of steps.
EOF
}

QUICK=0
REPORT_ONLY=0
for a in "$@"; do
    case "$a" in
        --quick) QUICK=1 ;;
        --report-only) REPORT_ONLY=1 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "run_all.sh: unknown argument '$a' (see --help)" >&2; exit 2 ;;
    esac
done

if [[ $QUICK == 1 ]]; then
    : "${SEEDS:=0}" "${STEPS:=100}" "${EVAL_EVERY:=20}" "${OUT:=runs/compare-quick}"
fi
STEPS="${STEPS:-200}"   # step budget per run, the same for all three (alone, grpo/gspo default to 600, ppo to 150)
SEEDS="${SEEDS:-0 1 2}"
PROMPTS_PER_STEP="${PROMPTS_PER_STEP:-64}"
GROUP_SIZE="${GROUP_SIZE:-4}"
MAX_NEW_TOKENS="${MAX_NEW_TOKENS:-8}"
EVAL_EVERY="${EVAL_EVERY:-25}"
MODEL="${MODEL:-tiny}"
TASK="${TASK:-}"
OUT="${OUT:-runs/compare}"
PYTHON="${PYTHON:-python}"
EXTRA_ARGS="${EXTRA_ARGS:-}"
PPO_ARGS="${PPO_ARGS:-}"
GRPO_ARGS="${GRPO_ARGS:-}"
GSPO_ARGS="${GSPO_ARGS:-}"

die() { echo "run_all.sh: error: $*" >&2; exit 1; }

for v in STEPS PROMPTS_PER_STEP GROUP_SIZE MAX_NEW_TOKENS EVAL_EVERY; do
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
if [[ $REPORT_ONLY == 1 ]]; then
    CMD="STEPS=$STEPS SEEDS=\"$SEEDS\" OUT=$OUT bash run_all.sh --report-only"
else
    CMD="STEPS=$STEPS SEEDS=\"$SEEDS\" PROMPTS_PER_STEP=$PROMPTS_PER_STEP GROUP_SIZE=$GROUP_SIZE"
    CMD+=" MAX_NEW_TOKENS=$MAX_NEW_TOKENS EVAL_EVERY=$EVAL_EVERY MODEL=$MODEL"
    [[ -n "$TASK" ]] && CMD+=" TASK=$TASK"
    CMD+=" OUT=$OUT"
    for v in EXTRA_ARGS PPO_ARGS GRPO_ARGS GSPO_ARGS; do
        [[ -n "${!v}" ]] && CMD+=" $v=\"${!v}\""
    done
    CMD+=" bash run_all.sh"
    [[ $QUICK == 1 ]] && CMD+=" --quick"
fi

mkdir -p "$OUT"
# Never leave a table from an earlier invocation next to runs it does not describe.
rm -f "$OUT/results.md" "$OUT/results.json" "$OUT/curves.png"

# ------------------------------------------------------------------------------------------------
# Training: every (seed, algo) in turn; the first failure stops everything.
# ------------------------------------------------------------------------------------------------
if [[ $REPORT_ONLY == 0 ]]; then
    read -r -a extra <<< "$EXTRA_ARGS"
    total=$(( ${#SEED_LIST[@]} * ${#ALGOS[@]} ))
    n=0
    t_all=$SECONDS
    echo "run_all.sh: $total runs, one at a time: $CMD"
    for seed in "${SEED_LIST[@]}"; do
        for algo in "${ALGOS[@]}"; do
            n=$((n + 1))
            dir="$OUT/$algo-seed$seed"
            log="$OUT/$algo-seed$seed.log"
            per_var="${algo^^}_ARGS"
            read -r -a per <<< "${!per_var}"
            rm -rf "$dir" "$log"
            cmd=("$PYTHON" "$ROOT/$algo.py" --model "$MODEL" --steps "$STEPS" --seed "$seed"
                 --prompts-per-step "$PROMPTS_PER_STEP" --group-size "$GROUP_SIZE"
                 --max-new-tokens "$MAX_NEW_TOKENS" --eval-every "$EVAL_EVERY" --out "$dir")
            [[ -n "$TASK" ]] && cmd+=(--task "$TASK")
            cmd+=("${extra[@]+"${extra[@]}"}" "${per[@]+"${per[@]}"}")
            echo "[$n/$total] $algo seed $seed -> $dir  (log: $log)"
            t0=$SECONDS
            rc=0
            "${cmd[@]}" >"$log" 2>&1 || rc=$?
            if [[ $rc != 0 ]]; then
                {
                    echo
                    echo "run_all.sh: FAILED: $algo seed $seed (exit status $rc)"
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
# Report: verify every run, then the table (results.md, results.json) and the curves (curves.png).
# ------------------------------------------------------------------------------------------------
export RA_OUT="$OUT" RA_SEEDS="$SEEDS" RA_STEPS="$STEPS" RA_CMD="$CMD" RA_ALGOS="${ALGOS[*]}"
"$PYTHON" - <<'PYEOF'
import datetime
import json
import math
import os
import sys
from pathlib import Path

out = Path(os.environ["RA_OUT"])
seeds = [int(s) for s in os.environ["RA_SEEDS"].split()]
steps_wanted = int(os.environ["RA_STEPS"])
algos = os.environ["RA_ALGOS"].split()
LAST_N = 10  # "reward at the end" = mean reward of the last LAST_N steps


def fail(problems):
    print("run_all.sh: error: cannot build the report; incomplete or inconsistent runs:", file=sys.stderr)
    for p in problems:
        print(f"  - {p}", file=sys.stderr)
    print(f"run_all.sh: no results table written (re-run the runs named above).", file=sys.stderr)
    sys.exit(1)


def num(x):
    """A finite float, or None (missing keys, null, NaN, strings)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(x) else None


def mean_std(values):
    """Mean and sample standard deviation (n - 1; 0 for a single value) of the finite values."""
    v = [x for x in values if x is not None]
    if not v:
        return {"mean": None, "std": None, "n": 0}
    m = sum(v) / len(v)
    sd = math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1)) if len(v) > 1 else 0.0
    return {"mean": m, "std": sd, "n": len(v)}


# ---- load and verify every expected run ---------------------------------------------------------
runs, problems = {}, []
for algo in algos:
    for seed in seeds:
        name = f"{algo} seed {seed}"
        d = out / f"{algo}-seed{seed}"
        sp, mp = d / "summary.json", d / "metrics.jsonl"
        if not sp.is_file():
            problems.append(f"{name}: missing {sp} (run not finished or failed; see {out}/{algo}-seed{seed}.log)")
            continue
        try:
            summary = json.loads(sp.read_text())
        except (OSError, ValueError) as e:
            problems.append(f"{name}: unreadable {sp} ({e})")
            continue
        if summary.get("steps") != steps_wanted:
            problems.append(f"{name}: {sp} has steps={summary.get('steps')!r}, expected STEPS={steps_wanted}")
            continue
        if "seed" in summary and summary["seed"] != seed:
            problems.append(f"{name}: {sp} has seed={summary['seed']!r}, expected {seed}")
            continue
        if "algo" in summary and summary["algo"] != algo:
            problems.append(f"{name}: {sp} has algo={summary['algo']!r}, expected {algo!r}")
            continue
        if not mp.is_file():
            problems.append(f"{name}: missing {mp}")
            continue
        rows = []
        for lineno, line in enumerate(mp.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                problems.append(f"{name}: {mp}:{lineno} is not valid JSON")
                break
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                rows.append(row)
        rows.sort(key=lambda r: r["step"])
        if [r["step"] for r in rows] != list(range(1, steps_wanted + 1)):
            problems.append(f"{name}: {mp} has {len(rows)} step rows, expected steps 1..{steps_wanted}")
            continue
        runs[(algo, seed)] = (summary, rows)
if problems:
    fail(problems)

# Settings that must agree for the comparison to be fair (only warned about: *_ARGS may change them).
warnings = []
for key in ("model", "task", "prompts_per_step", "group_size", "max_new_tokens", "eval_size", "temperature"):
    seen = {}
    for (algo, seed), (summary, _) in runs.items():
        a = summary.get("args") or {}
        if key in a:
            seen.setdefault(json.dumps(a[key]), []).append(f"{algo}-seed{seed}")
    if len(seen) > 1:
        detail = "; ".join(f"{k}: {', '.join(v)}" for k, v in seen.items())
        warnings.append(f"runs differ in {key} ({detail})")
for w in warnings:
    print(f"run_all.sh: warning: {w}", file=sys.stderr)

# ---- aggregate ----------------------------------------------------------------------------------
def per_seed_values(algo):
    vals = []
    for seed in seeds:
        summary, rows = runs[(algo, seed)]
        rewards = [num(r.get("reward")) for r in rows[-LAST_N:]]
        rewards = [x for x in rewards if x is not None]
        tps = [x for x in (num(r.get("tokens_per_s")) for r in rows) if x is not None]
        vals.append({
            "seed": seed,
            "eval_accuracy_before": num(summary.get("eval_accuracy_before")),
            "eval_accuracy_after": num(summary.get("eval_accuracy_after")),
            "final_reward": sum(rewards) / len(rewards) if rewards else None,
            "wall_time_s": num(summary.get("wall_time_s")),
            "tokens_per_s": sum(tps) / len(tps) if tps else None,
            "peak_mem_mb": num(summary.get("peak_mem_mb")),
            "mean_clip_frac": num(summary.get("mean_clip_frac")),
            "final_entropy": num(rows[-1].get("entropy")),
        })
    return vals


METRICS = ["eval_accuracy_before", "eval_accuracy_after", "final_reward", "wall_time_s",
           "tokens_per_s", "peak_mem_mb", "mean_clip_frac", "final_entropy"]
results = {}
for algo in algos:
    vals = per_seed_values(algo)
    results[algo] = {
        **{k: mean_std([v[k] for v in vals]) for k in METRICS},
        "before_after": [{"seed": v["seed"], "before": v["eval_accuracy_before"], "after": v["eval_accuracy_after"]}
                         for v in vals],
        "per_seed": vals,
    }


def fmt(ms, digits):
    if ms["mean"] is None:
        return "n/a"
    s = f"{ms['mean']:.{digits}f}"
    return s if len(seeds) == 1 else f"{s} +- {ms['std']:.{digits}f}"


header = ["algorithm", "held-out acc before -> after", f"reward (last {LAST_N} steps)", "wall-clock (s)",
          "tokens/s", "peak mem (MB)", "clip frac", "final entropy"]
table = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
for algo in algos:
    r = results[algo]
    cells = [algo, f"{fmt(r['eval_accuracy_before'], 3)} -> {fmt(r['eval_accuracy_after'], 3)}",
             fmt(r["final_reward"], 3), fmt(r["wall_time_s"], 0), fmt(r["tokens_per_s"], 0),
             fmt(r["peak_mem_mb"], 0), fmt(r["mean_clip_frac"], 3), fmt(r["final_entropy"], 3)]
    table.append("| " + " | ".join(cells) + " |")


def cpu_model():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "Processor", "cpu model") and value.strip():
                return value.strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine() or "unknown CPU"


date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
machine = f"{cpu_model()}, {os.cpu_count()} cores"
first_summary = runs[(algos[0], seeds[0])][0]
first = first_summary.get("args") or {}
settings = (f"{len(seeds)} seed(s) {' '.join(map(str, seeds))}; {steps_wanted} steps; "
            f"model {first_summary.get('model', first.get('model', '?'))}; "
            f"task {first_summary.get('task') or first.get('task') or 'arith'}; "
            f"{first.get('prompts_per_step', '?')} prompts/step x {first.get('group_size', '?')} samples; "
            f"max {first.get('max_new_tokens', '?')} new tokens")
md = ["# PPO vs GRPO vs GSPO", "",
      f"Mean +- sample std over seeds. {settings}.", "",
      *table, "",
      f"reward: mean training reward of the last {LAST_N} steps; tokens/s: mean over steps of sampled "
      f"completion tokens per second of generation; clip frac: mean over steps; final entropy: last step's.",
      "",
      f"Command: `{os.environ['RA_CMD']}`  ",
      f"Date: {date}  ",
      f"Machine: {machine}"]
for w in warnings:
    md.append(f"\nWarning: {w}")
(out / "results.json").write_text(json.dumps({
    "command": os.environ["RA_CMD"], "date": date, "machine": machine, "steps": steps_wanted,
    "seeds": seeds, "last_n_reward_steps": LAST_N, "std": "sample (n-1); 0 for one seed",
    "warnings": warnings, "algos": results,
}, indent=2) + "\n")
(out / "results.md").write_text("\n".join(md) + "\n")

# ---- curves -------------------------------------------------------------------------------------
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def smooth(y, w):
    """Trailing moving average of window w (shorter at the start); None values are skipped."""
    outv = []
    for i in range(len(y)):
        win = [v for v in y[max(0, i - w + 1): i + 1] if v is not None]
        outv.append(sum(win) / len(win) if win else float("nan"))
    return outv


def band(series):
    """series: per-seed lists of equal length -> mean, lower, upper (min-max over seeds)."""
    cols = list(zip(*series))
    mean = [sum(c) / len(c) for c in cols]
    return mean, [min(c) for c in cols], [max(c) for c in cols]


window = max(1, min(10, steps_wanted // 10))
fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
colors = {"ppo": "tab:blue", "grpo": "tab:orange", "gspo": "tab:green"}
for i, algo in enumerate(algos):
    c = colors.get(algo, f"C{i}")
    clocks, rewards, evals = [], [], []
    for seed in seeds:
        summary, rows = runs[(algo, seed)]
        t, clock = 0.0, [0.0]
        for r in rows:
            t += num(r.get("step_time_s")) or 0.0
            clock.append(t)  # clock[s] = training seconds after step s
        clocks.append(clock)
        rewards.append(smooth([num(r.get("reward")) for r in rows], window))
        ev = {0: num(summary.get("eval_accuracy_before"))}
        ev.update({r["step"]: num(r.get("eval_accuracy")) for r in rows if num(r.get("eval_accuracy")) is not None})
        evals.append({s: a for s, a in ev.items() if a is not None})
    label = f"{algo} ({len(seeds)} seed{'s' if len(seeds) > 1 else ''})"
    # reward: one point per step, every seed has all steps
    steps_x = list(range(1, steps_wanted + 1))
    m, lo, hi = band(rewards)
    clock_mean = band([c[1:] for c in clocks])[0]
    for ax, x in ((axes[0][1], steps_x), (axes[1][1], clock_mean)):
        ax.plot(x, m, color=c, label=label)
        if len(seeds) > 1:
            ax.fill_between(x, lo, hi, color=c, alpha=0.2, linewidth=0)
    # eval accuracy: the steps evaluated in every seed
    eval_steps = sorted(set.intersection(*(set(e) for e in evals)))
    if eval_steps:
        m, lo, hi = band([[e[s] for s in eval_steps] for e in evals])
        eval_clock = [sum(c[s] for c in clocks) / len(clocks) for s in eval_steps]
        for ax, x in ((axes[0][0], eval_steps), (axes[1][0], eval_clock)):
            ax.plot(x, m, color=c, marker="o", markersize=3, label=label)
            if len(seeds) > 1:
                ax.fill_between(x, lo, hi, color=c, alpha=0.2, linewidth=0)

spread = "band: min-max over seeds" if len(seeds) > 1 else "one seed"
titles = [["held-out eval accuracy vs step", f"training reward vs step (moving average of {window})"],
          ["held-out eval accuracy vs wall-clock", f"training reward vs wall-clock (moving average of {window})"]]
for r in range(2):
    for col in range(2):
        ax = axes[r][col]
        ax.set_title(titles[r][col], fontsize=10)
        ax.set_xlabel("step" if r == 0 else "training wall-clock (s, sum of step_time_s; seed mean)")
        ax.set_ylabel("eval accuracy" if col == 0 else "reward")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
fig.suptitle(f"PPO vs GRPO vs GSPO: {settings}\nline: mean over seeds; {spread}", fontsize=10)
fig.tight_layout()
fig.savefig(out / "curves.png", dpi=110)

print()
print("\n".join(table))
print()
print(f"Wrote {out / 'results.md'}, {out / 'results.json'}, {out / 'curves.png'}")
PYEOF
