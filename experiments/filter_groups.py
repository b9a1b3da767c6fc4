"""--filter-groups (DAPO's dynamic sampling) against the same script without it, per step and at equal
training seconds (issue 47; the table and plot in docs/results.md).

For each of grpo.py and gspo.py and each seed: the filtered run (--steps STEPS), the unfiltered one at the
same steps, and an unfiltered one given about the filtered run's training seconds (its steps scaled by the
two runs' mean step times); then --group-size 8, filtered and not, for the first seed. One run at a time,
RLREF_THREADS=1; a run whose summary.json exists is skipped, so the sweep resumes. Then the table
(OUT/filter_groups.md) and the plot (OUT/filter_groups.png: held-out accuracy against step and against
training seconds, the sum of step_time_s, evaluations excluded).

    python experiments/filter_groups.py --out runs/filter-groups [--steps 150] [--seeds 0 1 2] [--report-only]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMON = ["--eval-every", "25"]


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def train_seconds(rows: list[dict]) -> float:
    return sum(r["step_time_s"] for r in rows)


def launch(out: Path, name: str, algo: str, flags: list[str]):
    run = out / name
    if (run / "summary.json").is_file():
        return
    cmd = [sys.executable, str(ROOT / f"{algo}.py"), *COMMON, *flags, "--out", str(run), "--overwrite"]
    print(" ".join(cmd[1:]), flush=True)
    with open(out / f"{name}.log", "w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True, env={**os.environ, "RLREF_THREADS": "1"})


def sweep(out: Path, steps: int, seeds: list[int]):
    for seed in seeds:
        for algo in ("grpo", "gspo"):
            base = ["--seed", str(seed), "--steps", str(steps)]
            launch(out, f"{algo}-filter-s{seed}", algo, [*base, "--filter-groups"])
            launch(out, f"{algo}-s{seed}", algo, base)
            per_step = train_seconds(metrics(out / f"{algo}-s{seed}")) / steps
            wall_steps = round(train_seconds(metrics(out / f"{algo}-filter-s{seed}")) / per_step)
            launch(out, f"{algo}-wall-s{seed}", algo, ["--seed", str(seed), "--steps", str(wall_steps)])
    for algo in ("grpo", "gspo"):
        base = ["--seed", str(seeds[0]), "--steps", str(steps), "--group-size", "8"]
        launch(out, f"{algo}-g8-filter-s{seeds[0]}", algo, [*base, "--filter-groups"])
        launch(out, f"{algo}-g8-s{seeds[0]}", algo, base)


CONFIGS = [  # (name prefix, what the table calls it)
    ("grpo-filter", "grpo.py --filter-groups"),
    ("grpo", "grpo.py"),
    ("grpo-wall", "grpo.py, the filtered run's training seconds"),
    ("gspo-filter", "gspo.py --filter-groups"),
    ("gspo", "gspo.py"),
    ("gspo-wall", "gspo.py, the filtered run's training seconds"),
    ("grpo-g8-filter", "grpo.py --group-size 8 --filter-groups"),
    ("grpo-g8", "grpo.py --group-size 8"),
    ("gspo-g8-filter", "gspo.py --group-size 8 --filter-groups"),
    ("gspo-g8", "gspo.py --group-size 8"),
]


def spread(values: list[float], digits: int = 3) -> str:
    if not values:
        return "-"
    mean = statistics.mean(values)
    return f"{mean:.{digits}f} ± {statistics.stdev(values):.{digits}f}" if len(values) > 1 else f"{mean:.{digits}f}"


def report(out: Path, seeds: list[int]):
    lines = [
        "| config | seeds | steps | held-out accuracy after | before | training s | step s | sample rounds / step "
        "| prompts drawn / step | groups with signal trained / step | zero_std_frac (sampled) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    curves = {}
    for prefix, label in CONFIGS:
        runs = [out / f"{prefix}-s{s}" for s in seeds if (out / f"{prefix}-s{s}" / "summary.json").is_file()]
        if not runs:
            continue
        rows = [metrics(r) for r in runs]
        sums = [json.loads((r / "summary.json").read_text()) for r in runs]
        curves[prefix] = [(m, s["eval_accuracy_before"]) for m, s in zip(rows, sums)]
        lines.append(
            f"| {label} | {','.join(r.name.rsplit('-s', 1)[1] for r in runs)} "
            f"| {'/'.join(str(len(m)) for m in rows)} "
            f"| {spread([s['eval_accuracy_after'] for s in sums])} "
            f"| {spread([s['eval_accuracy_before'] for s in sums])} "
            f"| {spread([train_seconds(m) for m in rows], 0)} "
            f"| {spread([train_seconds(m) / len(m) for m in rows], 3)} "
            f"| {spread([statistics.mean(r['sample_rounds'] for r in m) for m in rows], 2)} "
            f"| {spread([statistics.mean(r['groups_sampled'] for r in m) for m in rows], 1)} "
            f"| {spread([statistics.mean(r['groups_kept'] for r in m) for m in rows], 1)} "
            f"| {spread([statistics.mean(r['zero_std_frac'] for r in m) for m in rows], 3)} |"
        )
    (out / "filter_groups.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(out, curves)


def plot(out: Path, curves: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharey=True)
    colours = {"filter": "tab:red", "": "tab:blue", "wall": "tab:green"}
    for row, algo in enumerate(("grpo", "gspo")):
        for kind, colour in colours.items():
            prefix = f"{algo}-{kind}" if kind else algo
            for i, (rows, before) in enumerate(curves.get(prefix, [])):
                evals = [(0, 0.0, before)] + [(r["step"], sum(x["step_time_s"] for x in rows[: r["step"]]),
                                               r["eval_accuracy"]) for r in rows if "eval_accuracy" in r]  # fmt: skip
                label = {"filter": "--filter-groups", "": "unfiltered, same steps", "wall": "unfiltered, same s"}
                kw = {"color": colour, "alpha": 0.8, "label": f"{algo} {label[kind]}" if i == 0 else None}
                if kind != "wall":
                    axes[row, 0].plot([e[0] for e in evals], [e[2] for e in evals], **kw)
                axes[row, 1].plot([e[1] for e in evals], [e[2] for e in evals], **kw)
        axes[row, 0].set_xlabel("step")
        axes[row, 1].set_xlabel("training seconds (evaluations excluded)")
        for ax in axes[row]:
            ax.set_ylabel("held-out accuracy")
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3)
    fig.suptitle("--filter-groups against none: each line a seed (0-2), --group-size 4, 2-core AMD EPYC (shared)")
    fig.tight_layout()
    fig.savefig(out / "filter_groups.png", dpi=80)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/filter-groups")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        sweep(out, args.steps, args.seeds)
    report(out, args.seeds)


if __name__ == "__main__":
    main()
