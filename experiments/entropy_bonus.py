"""Does --entropy-coef save a run that collapses? A task the tiny model was never taught (count the
vowels of a random lower-case word, answer a digit) with the `exact` reward: the plain run's entropy
falls to about 0 within a few dozen steps, nearly every group's rewards become equal (zero_std_frac
near 1) and the policy settles on one answer. The same runs with an entropy bonus, several
coefficients, 3 seeds each; every run is reported, whichever way it comes out.

    python experiments/entropy_bonus.py                  the grid below (about 40 minutes on 2 shared CPU cores)
    python experiments/entropy_bonus.py --plan           print the grid; run nothing
    python experiments/entropy_bonus.py --report-only    the table from the finished runs in --out

The data (VOWEL_TASK: 2,000 words of 3-8 letters, seed 0; 10% held out by the scripts' own split)
is written to OUT/vowels.jsonl. Each run: `python ALGO.py --data OUT/vowels.jsonl --steps STEPS
--seed S --entropy-coef C` and RUN_FLAGS, the scripts' defaults otherwise, in OUT/c<C>/seed<S>
(a run with the bonus forwards every row, where the plain run skips the all-equal groups: several
times the step time here). A run that
reached its last step is skipped. Writes OUT/entropy_bonus.md (one row per run, then per
coefficient: mean and range over seeds). Write-up: docs/entropy_bonus.md.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from cli import ArgumentParser  # noqa: E402  (one-line errors, exit status 2)

VOWEL_TASK = dict(seed=0, words=2000, min_len=3, max_len=8)
COEFS = (0.0, 0.01, 0.05)
SEEDS = (0, 1, 2)
LAST = 30  # the table's late-training means are over the last LAST steps
RUN_FLAGS = ["--prompts-per-step", "32", "--eval-size", "200"]  # half the default batch: a bonus run forwards every row


def vowel_records(seed: int, words: int, min_len: int, max_len: int) -> list[dict]:
    rng = random.Random(seed)
    records = []
    for _ in range(words):
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(min_len, max_len)))
        records.append({"prompt": f"vowels in {word}=", "answer": str(sum(c in "aeiou" for c in word))})
    return records


def run_dir(out: Path, coef: float, seed: int) -> Path:
    return out / f"c{coef:g}" / f"seed{seed}"


def finished(run: Path, steps: int) -> bool:
    summary = run / "summary.json"
    return summary.is_file() and json.loads(summary.read_text())["step"] >= steps


def result(run: Path) -> dict:
    """One run's row: held-out accuracy before and after, and the last LAST steps' means."""
    summary = json.loads((run / "summary.json").read_text())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    late = rows[-LAST:]
    evals = [r["eval_accuracy"] for r in rows if "eval_accuracy" in r]

    def mean(key):
        return statistics.fmean(r[key] for r in late)

    return {
        "acc_before": summary["eval_accuracy_before"],
        "acc_after": summary["eval_accuracy_after"],
        "acc_best": max(evals),
        "entropy_late": mean("entropy"),
        "zero_std_late": mean("zero_std_frac") if "zero_std_frac" in late[0] else None,
        "warned_at": (summary.get("no_signal") or {}).get("warned_at_step"),
        "wall_s": summary["wall_time_s"],
    }


def report(out: Path, algo: str, steps: int, coefs, seeds) -> str:
    lines = [
        f"{algo}.py, vowel counting (`exact` reward), {steps} steps, {' '.join(RUN_FLAGS)}, defaults otherwise; "
        f"late = mean over the last {LAST} steps",
        "",
        "| --entropy-coef | seed | eval acc before | after | best | entropy (late) | zero_std_frac (late) "
        "| no-signal warning at step | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    by_coef = {}
    for coef in coefs:
        for seed in seeds:
            run = run_dir(out, coef, seed)
            if not finished(run, steps):
                lines.append(f"| {coef:g} | {seed} | (not run) | | | | | | |")
                continue
            x = result(run)
            by_coef.setdefault(coef, []).append(x)
            zero = "" if x["zero_std_late"] is None else f"{x['zero_std_late']:.3f}"
            lines.append(
                f"| {coef:g} | {seed} | {x['acc_before']:.3f} | {x['acc_after']:.3f} | {x['acc_best']:.3f} "
                f"| {x['entropy_late']:.3f} | {zero} | {x['warned_at'] or '-'} | {x['wall_s']:.0f} |"
            )
    lines += ["", "| --entropy-coef | seeds | eval acc after: mean [min, max] | entropy (late): mean [min, max] |"]
    lines.append("|---|---|---|---|")
    for coef, rs in by_coef.items():
        acc, ent = [x["acc_after"] for x in rs], [x["entropy_late"] for x in rs]
        lines.append(
            f"| {coef:g} | {len(rs)} | {statistics.fmean(acc):.3f} [{min(acc):.3f}, {max(acc):.3f}] "
            f"| {statistics.fmean(ent):.3f} [{min(ent):.3f}, {max(ent):.3f}] |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--algo", choices=["gspo", "grpo", "ppo"], default="gspo")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--coefs", type=float, nargs="+", default=list(COEFS))
    p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    p.add_argument("--out", default="runs/entropy_bonus")
    p.add_argument("--plan", action="store_true", help="print the grid; run nothing")
    p.add_argument("--report-only", action="store_true", help="the table from the finished runs")
    args = p.parse_args(argv)
    out = Path(args.out)
    grid = [(c, s) for c in args.coefs for s in args.seeds]
    print(f"{len(grid)} runs of {args.algo}.py x {args.steps} steps: coefs {args.coefs}, seeds {args.seeds}")
    if args.plan:
        return
    if not args.report_only:
        out.mkdir(parents=True, exist_ok=True)
        data = out / "vowels.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in vowel_records(**VOWEL_TASK)))
        for coef, seed in grid:
            run = run_dir(out, coef, seed)
            if finished(run, args.steps):
                continue
            run.parent.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, f"{args.algo}.py", "--data", str(data), "--steps", str(args.steps),
                   "--seed", str(seed), "--entropy-coef", str(coef), *RUN_FLAGS, "--out", str(run)]  # fmt: skip
            t0 = time.perf_counter()
            with open(run.parent / f"seed{seed}.log", "w") as log:
                rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
            print(f"coef {coef:g} seed {seed}: exit {rc}, {time.perf_counter() - t0:.0f} s", flush=True)
    table = report(out, args.algo, args.steps, args.coefs, args.seeds)
    (out / "entropy_bonus.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
