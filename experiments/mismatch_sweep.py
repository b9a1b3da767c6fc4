"""The rollout-mismatch sweep, run by `bash run_all.sh --mismatch`: GRPO, GSPO and PPO with float32
and bf16 rollouts, the sampler's log-probs taken as pi_old (--old-logp rollout: the mismatch
enters the ratio and the clip) or recomputed by the trainer without and with a correction
(--is-correction tis | mask), on the arithmetic task and the long `sums` task, several seeds.

    python experiments/mismatch_sweep.py                  the grid (--plan prints it and its planned time)
    python experiments/mismatch_sweep.py --report-only    the table and plot from the finished runs
    python experiments/mismatch_sweep.py --seeds 0 --algos gspo --tasks arith    a part of it

CONDITIONS (each a set of flags; the default run, float32 + recompute, is f32-recompute):
  f32-rollout     float32 rollouts, pi_old = the sampler's log-probs (the control: ratio 1 to 1e-5)
  bf16-rollout    bf16 rollouts, pi_old = the sampler's: the mismatch is in every ratio and clip
  bf16-recompute  bf16 rollouts, pi_old recomputed in float32 by the trainer: mu never enters the loss
  bf16-tis        ... and each term weighted by min(pi_old / mu, 2) (token TIS; GSPO per sequence)
  bf16-mask       ... and sequences with exp(sum log(pi_old / mu)) > 2 masked (TRL's sequence_mask)
Each run: `python ALGO.py --steps STEPS[TASK] --seed S` + TASK_FLAGS + the condition's flags (sums: and
sums_task.task_flags, its data written to OUT), in OUT/<task>/<algo>/<condition>/seed<S>; a run that
reached its last step is skipped.
Writes OUT/mismatch.md (one row per task x algo x condition: held-out accuracy before and after,
mean clip_frac and ratio_max_dev over the run, the mismatch diagnostics and the correction's share,
means and [min, max] over seeds) and OUT/mismatch.png. Write-up: docs/rollout_mismatch.md.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sums_task import task_flags, write_split  # noqa: E402

sys.path.insert(0, str(ROOT / "tools"))
from cli import ArgumentParser  # noqa: E402  (one-line errors, exit status 2)

CONDITIONS = {
    "f32-rollout": ["--rollout-dtype", "float32", "--old-logp", "rollout"],
    "bf16-rollout": ["--rollout-dtype", "bfloat16", "--old-logp", "rollout"],
    "bf16-recompute": ["--rollout-dtype", "bfloat16", "--old-logp", "recompute"],
    "bf16-tis": ["--rollout-dtype", "bfloat16", "--is-correction", "tis"],
    "bf16-mask": ["--rollout-dtype", "bfloat16", "--is-correction", "mask"],
}
ALGOS = ("grpo", "gspo", "ppo")
TASKS = ("arith", "sums")
SEEDS = (0, 1, 2)
STEPS = {"arith": 60, "sums": 20}
TASK_FLAGS = {  # evaluated before and after training only
    "arith": ["--prompts-per-step", "32", "--eval-every", "0", "--eval-size", "200"],
    "sums": ["--prompts-per-step", "16", "--eval-every", "0", "--eval-size", "100", "--no-anneal-lr"],
}
# CPU seconds of one whole run (model load and both evaluations included) on this 2-core AMD EPYC without
# avx512_bf16, extrapolated from the user time of 10-step arith and 4-step sums runs of gspo (2026-12-02,
# under load): for the planned total only; each run prints its own time
SECONDS_PER_RUN = {("arith", "f32"): 40, ("arith", "bf16"): 45, ("sums", "f32"): 55, ("sums", "bf16"): 70}
SHOWN = ("clip_frac", "ratio_max_dev", "mismatch_log_ratio_std", "mismatch_k3", "mismatch_geo_ratio_max_dev",
         "is_truncated_frac", "is_masked_frac")  # fmt: skip


def run_dir(out: Path, task: str, algo: str, condition: str, seed: int) -> Path:
    return out / task / algo / condition / f"seed{seed}"


def finished(run: Path) -> bool:
    summary = run / "summary.json"
    return summary.is_file() and not json.loads(summary.read_text())["interrupted"]


def planned_seconds(grid) -> float:
    return sum(SECONDS_PER_RUN[(t, c.split("-")[0])] for t, _, c, _ in grid)


def summarize(run: Path) -> dict:
    summary = json.loads((run / "summary.json").read_text())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    out = {"acc_before": summary["eval_accuracy_before"], "acc_after": summary["eval_accuracy_after"]}
    for key in SHOWN:  # (GSPO's sequence variant logs its clipped sequences' share as clip_frac_seqs)
        values = [v for r in rows if (v := r.get(key, r.get(f"{key}_seqs"))) is not None]
        out[key] = statistics.fmean(values) if values else None
    return out


def cell(values) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    fmt = (lambda x: f"{x:.2e}") if max(abs(v) for v in values) < 1e-2 else (lambda x: f"{x:.3f}")
    if len(values) == 1:
        return fmt(values[0])
    return f"{fmt(statistics.fmean(values))} [{fmt(min(values))}, {fmt(max(values))}]"


def report(out: Path, algos, tasks, seeds) -> str:
    lines = [
        f"Mean over seeds {', '.join(map(str, seeds))} [min, max]; clip_frac, ratio_max_dev and the mismatch_* / is_* "
        "columns are means over each run's steps. Settings: experiments/mismatch_sweep.py.",
        "",
        "| task | algo | condition | seeds | eval acc before | eval acc after | " + " | ".join(SHOWN) + " |",
        "|" + "---|" * (6 + len(SHOWN)),
    ]
    results = {}
    for task in tasks:
        for algo in algos:
            for cond in CONDITIONS:
                done = [summarize(r) for s in seeds if finished(r := run_dir(out, task, algo, cond, s))]
                if not done:
                    continue
                results[(task, algo, cond)] = done
                cols = [cell([d[k] for d in done]) for k in ("acc_before", "acc_after", *SHOWN)]
                lines.append(f"| {task} | {algo} | {cond} | {len(done)} | " + " | ".join(cols) + " |")
    plot(out, results, algos, tasks)
    return "\n".join(lines) + "\n"


def plot(out: Path, results: dict, algos, tasks):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4 * len(tasks) + 2, 3.5))
    conds = list(CONDITIONS)
    for j, task in enumerate(tasks):
        ax = fig.add_subplot(1, len(tasks), j + 1)
        for i, algo in enumerate(algos):
            for k, cond in enumerate(conds):
                done = results.get((task, algo, cond), [])
                x = i * (len(conds) + 1) + k
                if done:
                    accs = [d["acc_after"] for d in done]
                    ax.bar(x, statistics.fmean(accs), color=f"C{k}", label=cond if i == 0 else None)
                    ax.plot([x] * len(accs), accs, "k.", ms=3)
        ax.set_xticks([i * (len(conds) + 1) + (len(conds) - 1) / 2 for i in range(len(algos))], algos)
        ax.set_title(f"{task}: held-out accuracy after training")
        ax.set_ylim(0, 1)
    fig.axes[0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(out / "mismatch.png", dpi=110)


def main(argv=None):
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--algos", nargs="+", choices=ALGOS, default=list(ALGOS))
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    p.add_argument("--conditions", nargs="+", choices=list(CONDITIONS), default=list(CONDITIONS))
    p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    p.add_argument("--out", default="runs/mismatch")
    p.add_argument("--plan", action="store_true", help="print the grid and its planned time; run nothing")
    p.add_argument("--report-only", action="store_true", help="the table and plot from the finished runs")
    a = p.parse_args(argv)
    out = Path(a.out)
    grid = [(t, al, c, s) for s in a.seeds for t in a.tasks for al in a.algos for c in a.conditions]
    todo = [g for g in grid if not finished(run_dir(out, *g))]
    print(f"mismatch sweep: {len(grid)} runs ({len(a.tasks)} tasks x {len(a.algos)} algos x {len(a.conditions)} "
          f"conditions x {len(a.seeds)} seeds; steps {', '.join(f'{t} {STEPS[t]}' for t in a.tasks)}); "
          f"{len(grid) - len(todo)} finished; planned {planned_seconds(todo) / 60:.0f} min for the rest "
          "on a quiet 2-core CPU")  # fmt: skip
    if a.plan:
        for g in todo:
            print("  " + " ".join(g[:3]) + f" seed {g[3]}")
        return
    if not a.report_only:
        write_split(out)
        for task, algo, cond, seed in todo:
            run = run_dir(out, task, algo, cond, seed)
            run.parent.mkdir(parents=True, exist_ok=True)
            data = task_flags(out) if task == "sums" else []  # arith: the scripts' default task
            cmd = [sys.executable, str(ROOT / f"{algo}.py"), *data, "--steps", str(STEPS[task]),
                   "--seed", str(seed), *TASK_FLAGS[task], *CONDITIONS[cond], "--out", str(run)]  # fmt: skip
            t0 = time.perf_counter()
            with open(run.parent / f"seed{seed}.log", "w") as log:
                rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
            print(f"{task} {algo} {cond} seed {seed}: exit {rc}, {time.perf_counter() - t0:.0f} s", flush=True)
            if rc:
                sys.exit(f"a run failed: see {run.parent / f'seed{seed}.log'}")
    table = report(out, a.algos, a.tasks, a.seeds)
    (out / "mismatch.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
