"""The staleness sweep, run by `bash run_all.sh --staleness`: when does GSPO's sequence
ratio beat GRPO's token ratios? GRPO (the paper's seq-mean-token-mean) and GSPO (sequence), plus
GRPO token-mean, GSPO-token and PPO, on the long `sums` task, with 1, 4 or 8 minibatch updates per
rollout and 1 epoch (every update after a rollout's first is off-policy: the more minibatches, the
staler the last ones), 3 seeds per cell. One run at a time; a run that reached its last step is
skipped, so an interrupted sweep continues where it stopped. Then the table and the plots.

    bash run_all.sh --staleness                 the sweep (prints its planned total first), then the report
    bash run_all.sh --staleness --plan          print the grid and its planned time; run nothing
    bash run_all.sh --staleness --report-only   the report from the finished runs in OUT
    bash run_all.sh --staleness --quick         a first look: one seed, 20 steps, OUT=runs/staleness-quick

Environment (default in brackets): OUT [runs/staleness]  STEPS [see STEPS below]  SEEDS ["0 1 2"]
MINIBATCHES ["1 4 8"]  CONFIGS [every config of CONFIGS]  PROMPTS_PER_STEP [16]  GROUP_SIZE [4]
EVAL_EVERY [10]  EVAL_SIZE [200]  PYTHON [python]  EXTRA_ARGS (flags added to every run, e.g. "--lr 1e-4")

Layout: OUT/<config>/mb<k>/seed<s>/ (each run's metrics.jsonl, summary.json) and .../seed<s>.log; the data:
OUT/sums_train.jsonl and sums_eval.jsonl (sums_task.write_split).
Writes OUT/staleness_results.md and .json (one row per config x minibatches: mean +- sample std over
seeds) and OUT/staleness_accuracy.png, OUT/staleness_ratios.png. Definitions, used in the table:
  collapse      held-out accuracy falls below half its best and never climbs back to half of it
                (`collapse_step`); the table counts collapsed seeds
  grad spikes   steps whose gradient norm (before clipping, mean over the step's updates) exceeds
                SPIKE_FACTOR x the run's median (`grad_norm_spikes`); mean count per run
  log_ratio_std, ratio_outside_grpo_clip   each loss's info, the same lines in every algorithm;
                means over the run's steps
Not collected by pytest; tests/test_long_task.py tests its functions and the resume through run_all.sh.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from compare_report import IncompleteRun, band, machine_description, mean_std, num, read_run, run_finished
from matplotlib.figure import Figure
from sums_task import task_flags, write_split

ROOT = Path(__file__).resolve().parents[1]

# config -> (script, its flags); a config is named after its script (the part before "-")
CONFIGS = {
    "grpo": ("grpo.py", ["--loss-agg", "seq-mean-token-mean"]),  # the paper's aggregation
    "gspo": ("gspo.py", ["--variant", "sequence"]),  # paper Eq. 5
    "grpo-tokenmean": ("grpo.py", ["--loss-agg", "token-mean"]),  # DAPO: every token counts once
    "gspo-token": ("gspo.py", ["--variant", "token"]),  # section 4.3
    "ppo": ("ppo.py", []),  # a critic: per-token credit
}
STEPS = 90  # sized so the whole default grid takes about two hours of a quiet 2-core CPU (planned_seconds)
SEEDS = "0 1 2"
MINIBATCHES = "1 4 8"
SETTINGS = dict(PROMPTS_PER_STEP="16", GROUP_SIZE="4", EVAL_EVERY="10", EVAL_SIZE="200")
QUICK = dict(STEPS="20", SEEDS="0", OUT="runs/staleness-quick", EVAL_EVERY="10")

# Seconds per training step of one run on a quiet 2-core CPU, for the planned total: the CPU time of
# a 20-step run (model load and its 3 evaluations included) / 20, at these settings and 4 minibatches,
# on the dev machine (docs/staleness.md has the commands). One thread each, so CPU time ~ quiet wall.
SECONDS_PER_STEP = {"grpo": 1.45, "gspo": 1.45, "ppo": 3.0}

SPIKE_FACTOR = 5.0  # a gradient-norm spike: above SPIKE_FACTOR x the run's median
LAST_N = 10  # "entropy at the end": mean of the last LAST_N steps
COLORS = {"grpo": "tab:orange", "gspo": "tab:green", "grpo-tokenmean": "tab:red", "gspo-token": "tab:olive",
          "ppo": "tab:blue"}  # fmt: skip


class UsageError(Exception):
    pass


# ------------------------------------------------------------------------------------------------
# The grid: settings from the environment, one command per run
# ------------------------------------------------------------------------------------------------
def settings_from(env: dict, quick: bool = False) -> dict:
    """The sweep's settings: the environment's, else --quick's, else the defaults; checked."""
    base = {"STEPS": str(STEPS), "SEEDS": SEEDS, "MINIBATCHES": MINIBATCHES, "CONFIGS": " ".join(CONFIGS),
            "OUT": "runs/staleness", "PYTHON": sys.executable, **SETTINGS, **(QUICK if quick else {})}  # fmt: skip
    s = {k: env.get(k) or v for k, v in base.items()}
    s["EXTRA_ARGS"] = env.get("EXTRA_ARGS", "")
    for k in ("STEPS", "PROMPTS_PER_STEP", "GROUP_SIZE", "EVAL_EVERY", "EVAL_SIZE"):
        if not s[k].isdigit() or int(s[k]) < 1:
            raise UsageError(f"{k} must be a positive integer, got {s[k]!r}")
    for k in ("SEEDS", "MINIBATCHES"):
        if not s[k].split() or not all(x.isdigit() for x in s[k].split()):
            raise UsageError(f"{k} must be integers separated by spaces, got {s[k]!r}")
    unknown = [c for c in s["CONFIGS"].split() if c not in CONFIGS]
    if unknown or not s["CONFIGS"].split():
        raise UsageError(f"CONFIGS: unknown {' '.join(unknown) or '(empty)'}; expected some of {' '.join(CONFIGS)}")
    batch = int(s["PROMPTS_PER_STEP"]) * int(s["GROUP_SIZE"])
    for mb in s["MINIBATCHES"].split():
        if int(mb) < 1 or batch % int(mb):
            raise UsageError(f"MINIBATCHES: {mb} does not divide the batch of {batch} (PROMPTS_PER_STEP x GROUP_SIZE)")
    return s


def grid(s: dict) -> list[tuple[str, int, int]]:
    """Every (config, minibatches, seed), seed-major so that a partial sweep covers every cell."""
    return [(c, int(mb), int(seed)) for seed in s["SEEDS"].split() for mb in s["MINIBATCHES"].split()
            for c in s["CONFIGS"].split()]  # fmt: skip


def run_dir(out: Path, config: str, mb: int, seed: int) -> Path:
    return out / config / f"mb{mb}" / f"seed{seed}"


def command(s: dict, config: str, mb: int, seed: int) -> list[str]:
    script, flags = CONFIGS[config]
    # --no-anneal-lr: the sweep varies staleness alone, at the constant rate its results were measured at
    return [s["PYTHON"], str(ROOT / script), "--no-anneal-lr", *task_flags(s["OUT"]), "--steps", s["STEPS"],
            "--seed", str(seed), "--minibatches", str(mb), "--epochs", "1", "--prompts-per-step", s["PROMPTS_PER_STEP"],
            "--group-size", s["GROUP_SIZE"], "--eval-every", s["EVAL_EVERY"], "--eval-size", s["EVAL_SIZE"],
            "--out", str(run_dir(Path(s["OUT"]), config, mb, seed)), *flags, *s["EXTRA_ARGS"].split()]  # fmt: skip


def planned_seconds(s: dict, runs: list[tuple[str, int, int]]) -> float:
    return sum(SECONDS_PER_STEP[c.split("-")[0]] * int(s["STEPS"]) for c, _, _ in runs)


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 600 else f"{seconds / 60:.1f} min"


def finished(out: Path, config: str, mb: int, seed: int) -> bool:
    return run_finished(run_dir(out, config, mb, seed))


# ------------------------------------------------------------------------------------------------
# Running: one run at a time, finished runs skipped, the first failure stops everything
# ------------------------------------------------------------------------------------------------
def run_sweep(s: dict) -> int:
    out = Path(s["OUT"])
    todo = [r for r in grid(s) if not finished(out, *r)]
    n_all = len(grid(s))
    print(f"staleness sweep: {n_all} runs ({len(s['CONFIGS'].split())} configs x {len(s['MINIBATCHES'].split())} "
          f"staleness x {len(s['SEEDS'].split())} seeds, {s['STEPS']} steps each); {n_all - len(todo)} finished "
          f"(skipped), {len(todo)} to run: planned about {minutes(planned_seconds(s, todo))} on a quiet "
          f"2-core CPU (the whole grid: {minutes(planned_seconds(s, grid(s)))})", flush=True)  # fmt: skip
    t_all = time.time()
    write_split(out)
    for n, (config, mb, seed) in enumerate(todo, 1):
        d = run_dir(out, config, mb, seed)
        log = d.with_suffix(".log")
        shutil.rmtree(d, ignore_errors=True)  # an unfinished run starts over
        d.parent.mkdir(parents=True, exist_ok=True)
        cmd = command(s, config, mb, seed)
        print(f"[{n}/{len(todo)}] {config} minibatches {mb} seed {seed} -> {d}", flush=True)
        t0 = time.time()
        with open(log, "w") as f:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
        if rc != 0:
            tail = log.read_text(errors="replace").replace("\r", "\n").strip().splitlines()[-15:]
            print(f"staleness sweep: FAILED: {config} minibatches {mb} seed {seed} (exit status {rc})\n"
                  f"  command: {' '.join(cmd)}\n  log: {log} -- last lines:\n"
                  + "\n".join("    " + line for line in tail)
                  + f"\nstaleness sweep: stopped; {n - 1} runs of this invocation finished (re-run to resume)",
                  file=sys.stderr)  # fmt: skip
            return 1
        print(f"      done in {time.time() - t0:.0f} s", flush=True)
    print(f"staleness sweep: {len(todo)} runs in {time.time() - t_all:.0f} s", flush=True)
    return 0


# ------------------------------------------------------------------------------------------------
# Per-run reductions (tested on hand-made curves)
# ------------------------------------------------------------------------------------------------
def eval_curve(summary: dict, rows: list[dict]) -> list[tuple[int, float]]:
    """(step, held-out accuracy): step 0 is the evaluation before training."""
    curve = [(0, num(summary.get("eval_accuracy_before")))]
    curve += [(r["step"], num(r.get("eval_accuracy"))) for r in rows if "eval_accuracy" in r]
    return [(st, a) for st, a in curve if a is not None]


def collapse_step(curve: list[tuple[int, float]]) -> int | None:
    """The step from which held-out accuracy stays below half its best (the best over the whole
    run) to the end, never recovering; None when the run did not collapse (or its best is 0)."""
    if not curve:
        return None
    best = max(a for _, a in curve)
    if best <= 0 or curve[-1][1] >= best / 2:
        return None
    first = len(curve) - 1
    while first > 0 and curve[first - 1][1] < best / 2:
        first -= 1
    return curve[first][0]


def grad_norm_spikes(norms: list[float], factor: float = SPIKE_FACTOR) -> int:
    """How many steps' gradient norm exceeds `factor` x the median of the run's norms."""
    finite = [x for x in map(num, norms) if x is not None]
    if not finite:
        return 0
    median = statistics.median(finite)
    return sum(x > factor * median for x in finite)


def run_values(summary: dict, rows: list[dict]) -> dict:
    def step_mean(key):
        v = [x for x in (num(r.get(key)) for r in rows) if x is not None]
        return sum(v) / len(v) if v else None

    curve = eval_curve(summary, rows)
    tail = [x for x in (num(r.get("entropy")) for r in rows[-LAST_N:]) if x is not None]
    return {
        "eval_accuracy_before": num(summary.get("eval_accuracy_before")),
        "eval_accuracy_after": num(summary.get("eval_accuracy_after")),
        "best_eval_accuracy": max((a for _, a in curve), default=None),
        # the mean of every evaluation after step 0: less noisy than the last one alone (200 prompts each)
        "mean_eval_accuracy": statistics.mean([a for st, a in curve if st > 0]) if len(curve) > 1 else None,
        "collapsed": collapse_step(curve) is not None,
        "log_ratio_std": step_mean("log_ratio_std"),
        "ratio_outside_grpo_clip": step_mean("ratio_outside_grpo_clip"),
        # GSPO's sequence variant counts clipped sequences (clip_frac_seqs), the others clipped tokens
        "clip_frac": step_mean("clip_frac") if any("clip_frac" in r for r in rows) else step_mean("clip_frac_seqs"),
        "grad_norm_spikes": grad_norm_spikes([r.get("grad_norm") for r in rows]),
        "final_entropy": sum(tail) / len(tail) if tail else None,
        "response_len": step_mean("response_len"),
        "wall_time_s": num(summary.get("wall_time_s")),
    }


# ------------------------------------------------------------------------------------------------
# The report
# ------------------------------------------------------------------------------------------------
COLUMNS = [  # (key, header, digits)
    ("eval_accuracy_after", "final acc", 3),
    ("best_eval_accuracy", "best acc", 3),
    ("mean_eval_accuracy", "mean acc", 3),
    ("log_ratio_std", "log-ratio std", 4),
    ("ratio_outside_grpo_clip", "outside [0.8,1.2]", 4),
    ("clip_frac", "clip frac (GSPO sequence: of sequences)", 4),
    ("grad_norm_spikes", "grad spikes", 1),
    ("final_entropy", "entropy", 3),
    ("response_len", "length", 1),
    ("wall_time_s", "wall s", 0),
]


def load(s: dict) -> tuple[dict, list[str]]:
    """({(config, mb, seed): (summary, rows)}, [one line per missing or incomplete run])."""
    runs, problems, out = {}, [], Path(s["OUT"])
    for config, mb, seed in grid(s):
        d = run_dir(out, config, mb, seed)
        try:
            runs[(config, mb, seed)] = read_run(d, d.with_suffix(".log"), config, seed, int(s["STEPS"]))
        except IncompleteRun as e:
            problems.append(f"minibatches {mb}: {e}")
    return runs, problems


def table(s: dict, runs: dict) -> tuple[list[str], dict]:
    seeds = [int(x) for x in s["SEEDS"].split()]
    header = "| config | minibatches | collapses | " + " | ".join(h for _, h, _ in COLUMNS) + " |"
    lines, results = [header, "|" + "---|" * (len(COLUMNS) + 3)], {}
    for mb in map(int, s["MINIBATCHES"].split()):
        for config in s["CONFIGS"].split():
            per_seed = [run_values(*runs[(config, mb, seed)]) for seed in seeds]
            cell = {k: mean_std([v[k] for v in per_seed]) for k, _, _ in COLUMNS}
            collapses = sum(v["collapsed"] for v in per_seed)
            results[f"{config} mb{mb}"] = {**cell, "collapses": collapses, "per_seed": per_seed}
            shown = [f"{c['mean']:.{d}f} ± {c['std']:.{d}f}" if c["mean"] is not None else "n/a"
                     for c, d in ((cell[k], d) for k, _, d in COLUMNS)]  # fmt: skip
            lines.append(f"| {config} | {mb} | {collapses}/{len(seeds)} | " + " | ".join(shown) + " |")
    return lines, results


def plot(path: Path, s: dict, runs: dict, keys: list[tuple[str, str]]):
    """One column per staleness, one row per key; a line per config: mean over seeds, min-max band."""
    mbs, seeds = [int(x) for x in s["MINIBATCHES"].split()], [int(x) for x in s["SEEDS"].split()]
    fig = Figure(figsize=(4.2 * len(mbs), 3.4 * len(keys)))
    axes = fig.subplots(len(keys), len(mbs), squeeze=False)
    for j, mb in enumerate(mbs):
        for i, (key, label) in enumerate(keys):
            ax = axes[i][j]
            for config in s["CONFIGS"].split():
                if key == "eval_accuracy":
                    curves = [dict(eval_curve(*runs[(config, mb, seed)])) for seed in seeds]
                else:
                    curves = [{r["step"]: num(r.get(key)) for r in runs[(config, mb, seed)][1]} for seed in seeds]
                x = sorted(set.intersection(*({k for k, v in c.items() if v is not None} for c in curves)))
                if not x:
                    continue
                m, lo, hi = band([[c[k] for k in x] for c in curves])
                ax.plot(x, m, color=COLORS.get(config), label=config, marker="o" * (key == "eval_accuracy"), ms=3)
                if len(seeds) > 1:
                    ax.fill_between(x, lo, hi, color=COLORS.get(config), alpha=0.15, linewidth=0)
            ax.set_title(f"{label}, {mb} minibatch{'es' * (mb > 1)} per rollout", fontsize=9)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(f"sums task; line: mean over {len(seeds)} seed(s), band: min-max", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def report(s: dict, cmd: str) -> int:
    out = Path(s["OUT"])
    runs, problems = load(s)
    if problems:
        print("staleness sweep: error: cannot build the report; missing or incomplete runs:", file=sys.stderr)
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
        return 1
    lines, results = table(s, runs)
    total = sum(v["wall_time_s"] or 0 for r in results.values() for v in r["per_seed"])
    md = [
        "# Staleness sweep: GRPO vs GSPO (and PPO) on the sums task",
        "",
        f"Command: `{cmd}`  ",
        f"Date: {datetime.datetime.now().isoformat(timespec='minutes')}; machine: {machine_description()}; "
        f"total training wall time {total / 3600:.2f} h  ",
        f"Settings: {s['STEPS']} steps, {s['PROMPTS_PER_STEP']} prompts x {s['GROUP_SIZE']} samples per step, "
        f"1 epoch, seeds {s['SEEDS']}; held-out accuracy on {s['EVAL_SIZE']} prompts every {s['EVAL_EVERY']} steps",
        "",
        "Mean ± sample std over seeds. collapses: seeds whose held-out accuracy ended below half its best and "
        f"never recovered. grad spikes: steps with grad norm > {SPIKE_FACTOR:g} x the run's median. log-ratio std, "
        "outside [0.8,1.2]: per-token log(pi/pi_old) over each update's tokens, the same for every algorithm. "
        "clip frac: each algorithm's own (GSPO's is per sequence).",
        "",
        *lines,
        "",
    ]
    (out / "staleness_results.md").write_text("\n".join(md))
    (out / "staleness_results.json").write_text(json.dumps({"command": cmd, "results": results}, indent=1))
    plot(out / "staleness_accuracy.png", s, runs, [("eval_accuracy", "held-out accuracy")])
    ratio_keys = [("log_ratio_std", "per-token log-ratio std"), ("ratio_outside_grpo_clip", "outside [0.8, 1.2]")]
    plot(out / "staleness_ratios.png", s, runs, ratio_keys)
    print("\n".join(lines))
    print(f"staleness sweep: wrote {out}/staleness_results.md, staleness_results.json, staleness_accuracy.png, "
          "staleness_ratios.png")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one seed, 20 steps, OUT=runs/staleness-quick")
    p.add_argument("--plan", action="store_true", help="print the grid and its planned time; run nothing")
    p.add_argument("--report-only", action="store_true", help="train nothing; the report from OUT's runs")
    a = p.parse_args(argv)
    try:
        s = settings_from(dict(os.environ), a.quick)
    except UsageError as e:
        print(f"run_all.sh --staleness: error: {e}", file=sys.stderr)
        return 2
    cmd = " ".join(f'{k}="{s[k]}"' for k in ("STEPS", "SEEDS", "MINIBATCHES", "CONFIGS", "OUT", "EXTRA_ARGS") if s[k])
    cmd += " bash run_all.sh --staleness"
    if a.plan:
        for config, mb, seed in grid(s):
            done = " (finished)" if finished(Path(s["OUT"]), config, mb, seed) else ""
            print(f"{config} minibatches {mb} seed {seed}{done}: {' '.join(command(s, config, mb, seed))}")
        todo = [r for r in grid(s) if not finished(Path(s["OUT"]), *r)]
        print(f"planned: {len(grid(s))} runs, {len(todo)} to run, about {minutes(planned_seconds(s, todo))} "
              "on a quiet 2-core CPU")  # fmt: skip
        return 0
    Path(s["OUT"]).mkdir(parents=True, exist_ok=True)
    for name in ("staleness_results.md", "staleness_results.json", "staleness_accuracy.png", "staleness_ratios.png"):
        (Path(s["OUT"]) / name).unlink(missing_ok=True)  # never a table beside runs it does not describe
    if not a.report_only and run_sweep(s):
        return 1
    return report(s, cmd)


if __name__ == "__main__":
    sys.exit(main())
