"""The warm-start study: how much does each script gain at its defaults, from the shipped
checkpoint and from the same recipe's other warm starts? Defaults are chosen by the worst of these.

    python experiments/warm_starts.py                build the warm starts, run the grid, write the report
    python experiments/warm_starts.py --plan         print the grid; run nothing
    python experiments/warm_starts.py --report-only  the report from OUT's finished runs

Warm starts: SFT seed 0 is the shipped checkpoint (`common.tiny_checkpoint("tiny")`: the recipe
`TINY_WARMSTART` (tools/recipes.py) with seed 0, built once on the AMD EPYC host). SFT seed k > 0 is the same
recipe with seed k, built on first use into OUT/checkpoints/sft<k>/ (about a minute each). They stand
in for what the recipe gives on other machines: it stops at the first probe past 20% training
accuracy, mid-way through a fast rise, so its seed and the CPU's rounding both move where it stops.

Environment (default in brackets): OUT [runs/warmstart]  SCRIPTS ["ppo grpo gspo"]  SFT_SEEDS
["0 1 2 3 4 5"]  SEEDS (RL seeds) ["0 1 2"]  JOBS (runs at a time, one thread each) [2]  PYTHON [python]
PPO_ARGS, GRPO_ARGS, GSPO_ARGS: flags added to that script's runs (a candidate default; give it its own OUT).

Layout: OUT/<script>/sft<k>/seed<s>/ (metrics.jsonl, summary.json) and .../seed<s>.log. Runs are
seed-major, so a partial study covers every warm start; a run that reached its last step is skipped.
Writes OUT/warmstart_results.md and .json: per script x warm start, held-out accuracy before, after
each RL seed, the gains, training time (sum of step times; model loading and evaluations excluded),
and the targets: a gain of at least TARGET_SHIPPED from the shipped checkpoint and TARGET_OTHER from
every other warm start, on every RL seed, within BUDGET_S of training.
Not collected by pytest; tests/test_warm_starts.py tests its functions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from compare_report import IncompleteRun, machine_description, num, read_run, run_finished

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCRIPTS = ("ppo", "grpo", "gspo")
TARGET_SHIPPED = 0.40  # the target: at least 40 points from the shipped checkpoint, every RL seed
TARGET_OTHER = 0.30  # ... and at least 30 from every alternative warm start
BUDGET_S = 300.0  # ... within 5 minutes of training on a 2-core CPU


class UsageError(Exception):
    pass


def settings_from(env: dict) -> dict:
    s = {"OUT": "runs/warmstart", "SCRIPTS": " ".join(SCRIPTS), "SFT_SEEDS": "0 1 2 3 4 5", "SEEDS": "0 1 2",
         "JOBS": "2", "EVAL_EVERY": "25", "PYTHON": sys.executable}  # fmt: skip
    s = {k: env.get(k) or v for k, v in s.items()}
    for k in ("SFT_SEEDS", "SEEDS"):
        if not s[k].split() or not all(x.isdigit() for x in s[k].split()):
            raise UsageError(f"{k} must be integers separated by spaces, got {s[k]!r}")
    for k in ("JOBS", "EVAL_EVERY"):
        if not s[k].isdigit() or int(s[k]) < 1:
            raise UsageError(f"{k} must be a positive integer, got {s[k]!r}")
    unknown = [x for x in s["SCRIPTS"].split() if x not in SCRIPTS]
    if unknown or not s["SCRIPTS"].split():
        raise UsageError(f"SCRIPTS: unknown {' '.join(unknown) or '(empty)'}; expected some of {' '.join(SCRIPTS)}")
    for script in SCRIPTS:
        s[f"{script.upper()}_ARGS"] = env.get(f"{script.upper()}_ARGS", "")
    return s


def grid(s: dict) -> list[tuple[str, int, int]]:
    """Every (script, SFT seed, RL seed): the shipped checkpoint's runs first, then RL-seed-major, so a
    partial study has the headline cell whole and every other warm start at least once."""
    every = [(script, int(sft), int(seed)) for seed in s["SEEDS"].split() for sft in s["SFT_SEEDS"].split()
             for script in s["SCRIPTS"].split()]  # fmt: skip
    return sorted(every, key=lambda r: r[1] != 0)  # stable: the order above within each part


def run_dir(out: Path, script: str, sft: int, seed: int) -> Path:
    return out / script / f"sft{sft}" / f"seed{seed}"


def checkpoint_path(out: Path, sft: int) -> Path:
    return out / "checkpoints" / f"sft{sft}"


def warm_start(out: Path, sft: int) -> str:
    """The checkpoint of SFT seed `sft`: the shipped one for 0, else built (once) into OUT."""

    sys.path.insert(0, str(ROOT / "tools"))
    import recipes
    from build_checkpoints import build_tiny_checkpoint

    if sft == 0:
        return "tiny"  # the shipped checkpoint, by name: the script loads it as the demo does
    path = checkpoint_path(out, sft)
    if not (path / "config.json").is_file():
        t0 = time.time()
        print(f"building warm start SFT seed {sft} -> {path}", flush=True)
        build_tiny_checkpoint("tiny", path.resolve(), recipe=dict(recipes.TINY_WARMSTART, seed=sft))
        print(f"      built in {time.time() - t0:.0f} s", flush=True)
    return str(path)


def command(s: dict, script: str, sft: int, seed: int, model: str) -> list[str]:
    return [s["PYTHON"], str(ROOT / f"{script}.py"), "--model", model, "--seed", str(seed),
            "--eval-every", s["EVAL_EVERY"], "--out", str(run_dir(Path(s["OUT"]), script, sft, seed)),
            *s[f"{script.upper()}_ARGS"].split()]  # fmt: skip


def finished(out: Path, script: str, sft: int, seed: int) -> bool:
    return run_finished(run_dir(out, script, sft, seed))


def run_study(s: dict) -> int:
    """Every unfinished run, JOBS at a time (each one torch thread); the first failure stops it."""
    out = Path(s["OUT"])
    todo = [r for r in grid(s) if not finished(out, *r)]
    print(f"warm-start study: {len(grid(s))} runs, {len(todo)} to run, {s['JOBS']} at a time", flush=True)
    models = {sft: warm_start(out, sft) for sft in sorted({sft for _, sft, _ in todo})}
    env = dict(os.environ, RLREF_THREADS="1")  # a checkpoint given by path would otherwise take every core
    running: list[tuple[subprocess.Popen, tuple, float]] = []
    t_all, n_done = time.time(), 0
    while todo or running:
        while todo and len(running) < int(s["JOBS"]):
            script, sft, seed = r = todo.pop(0)
            d = run_dir(out, script, sft, seed)
            shutil.rmtree(d, ignore_errors=True)  # an unfinished run starts over
            d.parent.mkdir(parents=True, exist_ok=True)
            with open(d.with_suffix(".log"), "w") as log:
                proc = subprocess.Popen(command(s, script, sft, seed, models[sft]), stdout=log,
                                        stderr=subprocess.STDOUT, env=env)  # fmt: skip
            running.append((proc, r, time.time()))
            print(f"[start] {script} SFT seed {sft} RL seed {seed} -> {d}", flush=True)
        time.sleep(1)
        for item in [x for x in running if x[0].poll() is not None]:
            proc, (script, sft, seed), t0 = item
            running.remove(item)
            if proc.returncode != 0:
                for p, _, _ in running:
                    p.terminate()
                log = run_dir(out, script, sft, seed).with_suffix(".log")
                print(f"warm-start study: FAILED: {script} SFT seed {sft} RL seed {seed} (exit status "
                      f"{proc.returncode}); log: {log}; re-run to resume", file=sys.stderr)  # fmt: skip
                return 1
            n_done += 1
            print(f"[done {n_done}] {script} SFT seed {sft} RL seed {seed} in {time.time() - t0:.0f} s", flush=True)
    print(f"warm-start study: {n_done} runs in {time.time() - t_all:.0f} s", flush=True)
    return 0


# ------------------------------------------------------------------------------------------------
# The report
# ------------------------------------------------------------------------------------------------
def run_values(summary: dict, rows: list[dict]) -> dict:
    """Before, after, gain, training time, and the curve: (step, held-out accuracy, training seconds
    up to that step) at every evaluation (step 0: before training)."""
    before, after = num(summary.get("eval_accuracy_before")), num(summary.get("eval_accuracy_after"))
    curve, t = [(0, before, 0.0)], 0.0
    for r in rows:
        t += num(r.get("step_time_s")) or 0.0
        if num(r.get("eval_accuracy")) is not None:
            curve.append((r["step"], num(r["eval_accuracy"]), t))
    return {
        "before": before,
        "after": after,
        "gain": None if before is None or after is None else after - before,
        "train_s": t,
        "steps": summary.get("steps"),
        "curve": curve,
        # --anneal-lr: the rate at each step depends on --steps, so the curve's early points are not shorter runs
        "annealed": bool((summary.get("args") or {}).get("anneal_lr")),
    }


def verdict(script_cells: dict[int, list[dict]]) -> dict:
    """Worst gains of one script against the targets. script_cells: SFT seed -> per-RL-seed values."""
    shipped = [v["gain"] for v in script_cells.get(0, [])]
    other = [v["gain"] for sft, vs in script_cells.items() if sft != 0 for v in vs]
    times = [v["train_s"] for vs in script_cells.values() for v in vs]
    worst_shipped = min(shipped) if shipped else None
    worst_other = min(other) if other else None
    return {
        "worst_gain_shipped": worst_shipped,
        "worst_gain_other": worst_other,
        "max_train_s": max(times) if times else None,
        # accuracies are float32 multiples of 1/500: 0.6 - 0.2 must meet a 40-point target
        "meets_shipped": worst_shipped is not None and worst_shipped >= TARGET_SHIPPED - 1e-6,
        "meets_other": worst_other is not None and worst_other >= TARGET_OTHER - 1e-6,
        "within_budget": bool(times) and max(times) <= BUDGET_S,
    }


def gains_by_length(script_cells: dict[int, list[dict]]) -> list[dict]:
    """The verdict had every run stopped at step N, for each N evaluated in every run: how the worst
    gains and the longest training time grow with the run's length (the curves give it for free: a
    run stopped at N is the same run up to N). Empty when a run annealed its learning rate over its
    --steps: then a run stopped at N is not the run of N steps."""
    runs = [v for vs in script_cells.values() for v in vs]
    if any(v.get("annealed") for v in runs):
        return []
    common_steps = sorted(set.intersection(*({st for st, _, _ in v["curve"]} for v in runs))) if runs else []
    rows = []
    for n in common_steps[1:]:
        at_n = {sft: [dict(zip(("step", "acc", "t"), next(c for c in v["curve"] if c[0] == n))) for v in vs]
                for sft, vs in script_cells.items()}  # fmt: skip
        cells = {sft: [{"gain": c["acc"] - v["before"], "train_s": c["t"]} for c, v in zip(cs, script_cells[sft])]
                 for sft, cs in at_n.items()}  # fmt: skip
        gains = [c["gain"] for cs in cells.values() for c in cs]
        rows.append({"steps": n, **verdict(cells), "mean_gain": sum(gains) / len(gains)})
    return rows


def load(s: dict) -> tuple[dict, list[str]]:
    """({(script, sft, seed): run values} of the finished runs, [one line per missing run])."""
    runs, missing, out = {}, [], Path(s["OUT"])
    for script, sft, seed in grid(s):
        d = run_dir(out, script, sft, seed)
        try:
            steps = json.loads((d / "summary.json").read_text()).get("steps") if (d / "summary.json").is_file() else 0
            runs[(script, sft, seed)] = run_values(*read_run(d, d.with_suffix(".log"), script, seed, steps))
        except (IncompleteRun, ValueError):
            missing.append(f"{script} sft{sft}/seed{seed}")
    return runs, missing


def pts(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.0f}"


def met(ok: bool) -> str:
    return "met" if ok else "NOT met"


ANNEALED_NOTE = [
    "The runs annealed their learning rate over their own --steps (--anneal-lr), so a run stopped at step N is",
    "not the run of N steps: no per-length table (run each length, or give --no-anneal-lr).",
]


def by_length_table(lengths: list[str]) -> list[str]:
    return [
        "The same runs stopped earlier (a run stopped at step N is the same run up to N): worst gain over RL seeds,",
        "from the shipped checkpoint and from the other warm starts, and the longest training time to step N.",
        "",
        "| script | steps | worst gain, shipped | worst gain, others | mean gain, all runs | longest training s |",
        "|---|---|---|---|---|---|",
        *lengths,
    ]


def report(s: dict, cmd: str) -> int:
    """The tables from the finished runs; a run not finished is listed, not guessed."""
    out = Path(s["OUT"])
    runs, missing = load(s)
    if not runs:
        print("warm-start study: error: no finished runs in " + str(out), file=sys.stderr)
        return 1
    seeds, sfts = [int(x) for x in s["SEEDS"].split()], [int(x) for x in s["SFT_SEEDS"].split()]
    lines = [f"| script | warm start | before | after, RL seeds {' / '.join(map(str, seeds))} | gain (points) | "
             "training s |", "|---|---|---|---|---|---|"]  # fmt: skip
    results, verdicts, lengths = {}, [], []
    for script in s["SCRIPTS"].split():
        cells = {sft: [runs[(script, sft, seed)] for seed in seeds if (script, sft, seed) in runs] for sft in sfts}
        cells = {sft: vs for sft, vs in cells.items() if vs}
        for sft, vs in cells.items():
            name = "shipped (SFT seed 0)" if sft == 0 else f"SFT seed {sft}"
            by_seed = {seed: runs.get((script, sft, seed)) for seed in seeds}
            afters = " / ".join("-" if v is None else f"{v['after']:.3f}" for v in by_seed.values())
            gains = sorted(v["gain"] for v in vs)
            times = [v["train_s"] for v in vs]
            lines.append(f"| {script} | {name} | {vs[0]['before']:.3f} | {afters} | {pts(gains[0])} to "
                         f"{pts(gains[-1])} | {min(times):.0f}-{max(times):.0f} |")  # fmt: skip
        v = verdict(cells)
        by_length = gains_by_length(cells)
        results[script] = {"verdict": v, "by_length": by_length, "runs": {f"sft{k}": vs for k, vs in cells.items()}}
        n_runs = sum(len(vs) for vs in cells.values())
        verdicts.append(
            f"- {script} ({n_runs} runs): worst gain {pts(v['worst_gain_shipped'])} from the shipped checkpoint "
            f"(target {pts(TARGET_SHIPPED)}: {met(v['meets_shipped'])}), {pts(v['worst_gain_other'])} from the "
            f"others (target {pts(TARGET_OTHER)}: {met(v['meets_other'])}); longest training "
            f"{v['max_train_s']:.0f} s (budget {BUDGET_S:.0f} s: {met(v['within_budget'])})"
        )
        stride = max(1, len(by_length) // 8)
        for r in by_length[stride - 1 :: stride]:
            gains = [pts(r[k]) for k in ("worst_gain_shipped", "worst_gain_other", "mean_gain")]
            lengths.append(f"| {script} | {r['steps']} | {' | '.join(gains)} | {r['max_train_s']:.0f} |")
    md = [
        "# Warm-start study: each script's gain from each warm start",
        "",
        f"Command: `{cmd}`  ",
        f"Date: {datetime.datetime.now().isoformat(timespec='minutes')}; machine: {machine_description()}; "
        f"{s['JOBS']} runs at a time, one thread each  ",
        "Held-out greedy accuracy on the 500 held-out prompts, before and after RL. Training time: the sum of "
        "the step times (loading and evaluations excluded).",
        "",
        *lines,
        "",
        *verdicts,
        *([f"- not finished ({len(missing)} of {len(grid(s))} runs): " + ", ".join(missing)] if missing else []),
        "",
        *(ANNEALED_NOTE if any(v["annealed"] for v in runs.values()) else by_length_table(lengths)),
        "",
    ]
    (out / "warmstart_results.md").write_text("\n".join(md))
    (out / "warmstart_results.json").write_text(
        json.dumps({"command": cmd, "results": results, "missing": missing}, indent=1)
    )
    print("\n".join(md[6:]))
    print(f"warm-start study: wrote {out}/warmstart_results.md and .json")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plan", action="store_true", help="print the grid; run nothing")
    p.add_argument("--report-only", action="store_true", help="train nothing; the report from OUT's runs")
    a = p.parse_args(argv)
    try:
        s = settings_from(dict(os.environ))
    except UsageError as e:
        print(f"warm_starts.py: error: {e}", file=sys.stderr)
        return 2
    keys = ("SCRIPTS", "SFT_SEEDS", "SEEDS", "OUT", "PPO_ARGS", "GRPO_ARGS", "GSPO_ARGS")
    cmd = " ".join(f'{k}="{s[k]}"' for k in keys if s[k]) + " python experiments/warm_starts.py"
    if a.plan:
        out = Path(s["OUT"])
        for script, sft, seed in grid(s):
            model = "tiny" if sft == 0 else str(checkpoint_path(out, sft))
            done = " (finished)" if finished(out, script, sft, seed) else ""
            print(f"{script} SFT seed {sft} RL seed {seed}{done}: {' '.join(command(s, script, sft, seed, model))}")
        return 0
    Path(s["OUT"]).mkdir(parents=True, exist_ok=True)
    if not a.report_only and run_study(s):
        return 1
    return report(s, cmd)


if __name__ == "__main__":
    sys.exit(main())
