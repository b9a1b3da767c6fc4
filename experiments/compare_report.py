"""The report that `bash run_all.sh` writes after its runs: read every run's summary.json and
metrics.jsonl, refuse unless every (config, seed) run finished its steps, then a table and curves.
It trains nothing and imports none of the training scripts.

    python experiments/compare_report.py --out runs/compare --configs ppo grpo gspo --seeds 0 1 2 --steps 200 \
        --command "bash run_all.sh"
        runs in OUT/<config>-seed<k>/ (logs OUT/<config>-seed<k>.log); writes
        OUT/results.md    one row per config: mean +- sample std over seeds, command, date, machine
        OUT/results.json  the same numbers plus every seed's values
        OUT/curves.png    eval accuracy and reward against step and against wall-clock

    python experiments/compare_report.py --out runs/defaults --configs ppo grpo gspo --seeds 0 1 2 --own-steps
        the same report from runs of different lengths (run_all.sh --defaults: each script at its own
        settings): each run must finish the steps its own summary.json planned, the seeds of one
        config the same number; each config is tabulated and plotted against its own steps and
        wall-clock, and the settings line names every setting on which the configs differ.

    python experiments/compare_report.py --moe --out runs/moe --configs grpo grpo-replay gspo --seeds 0 1 --steps 120
        runs in OUT/<config>/seed<k>/ (logs OUT/<config>/seed<k>.log); writes
        OUT/moe_results.md   one row per config: means over seeds (and over steps for the MoE metrics)
        OUT/moe_curves.png   eval accuracy, reward, routing drift, ratio std, clip frac against step

    python experiments/compare_report.py --reward-model --out runs/rm --configs ppo ppo-rm grpo grpo-rm gspo gspo-rm \
        --seeds 0 1 2 --steps 200
        runs in OUT/<config>-seed<k>/ (<algo>-rm: --reward-model tiny-rm); writes
        OUT/rm_results.md    one row per config: eval accuracy, the reward model's eval score,
                             kl_to_init, its accuracy on the policy's samples, step time, memory
        OUT/rm_curves.png    eval accuracy and reward-model score against step and against kl_to_init

A config is named after the script it ran, with a suffix for a variant (grpo-replay: grpo.py
--routing-replay), so each run's summary.json must name the algorithm before the first "-".
Not collected by pytest; tests/test_run_all.py tests its functions directly and through run_all.sh.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
from pathlib import Path

from matplotlib.figure import Figure

LAST_N = 10  # "reward at the end" = mean reward of the last LAST_N steps
METRICS = [
    "eval_accuracy_before",
    "eval_accuracy_after",
    "final_reward",
    "wall_time_s",
    "tokens_per_s",
    "peak_mem_mb",
    "mean_clip_frac",
    "final_entropy",
]
# Settings that must agree for the comparison to be fair (only warned about: *_ARGS may change them).
SHARED_SETTINGS = ("model", "task", "prompts_per_step", "group_size", "max_new_tokens", "eval_size", "temperature")
MOE_CURVES = ["reward", "routing_drift", "ratio_std", "clip_frac"]
MOE_SUMMARY_KEYS = ["eval_accuracy_before", "eval_accuracy_after", "wall_time_s"]
MOE_STEP_KEYS = ["routing_drift", "ratio_std", "clip_frac"]  # averaged over steps, then seeds
# GSPO's sequence variant counts clipped sequences (clip_frac_seqs), every other run clipped tokens (clip_frac):
# the report reads whichever a run logged and labels every clip fraction it shows with its unit.
CLIP_UNITS = {"clip_frac": "tokens", "clip_frac_seqs": "seqs"}
CLIP_KEYS = tuple(CLIP_UNITS)


def clip_frac_of(d: dict, prefix: str = "") -> float | None:
    """A metrics row's (or, prefix "mean_", a summary's) clip fraction, in whichever unit it was logged."""
    return next((d[prefix + k] for k in CLIP_KEYS if d.get(prefix + k) is not None), None)


def clip_unit_of(d: dict, prefix: str = "") -> str | None:
    """The unit of clip_frac_of(d, prefix): "tokens", "seqs", or None where no clip fraction was logged."""
    return next((CLIP_UNITS[k] for k in CLIP_KEYS if d.get(prefix + k) is not None), None)


def joint_unit(units) -> str | None:
    """One unit for several values: "tokens", "seqs", "seqs+tokens" (a mean over both, flagged), or None."""
    found = sorted({u for u in units if u is not None})
    return "+".join(found) if found else None


COLORS = {"ppo": "tab:blue", "grpo": "tab:orange", "gspo": "tab:green"}


# ------------------------------------------------------------------------------------------------
# Loading: every expected run, complete, or a list of what is wrong
# ------------------------------------------------------------------------------------------------
class IncompleteRun(Exception):
    """A run that cannot enter the report; the message names the run and the file."""


def run_finished(run_dir: Path) -> bool:
    """Whether the run in `run_dir` reached its last step (what a resuming sweep may skip): a run
    stopped by a signal writes summary.json too, with interrupted: true and the step it reached."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    return not summary.get("interrupted") and summary.get("step") == summary.get("steps")


def run_paths(out: Path, config: str, seed: int, moe: bool = False) -> tuple[Path, Path]:
    """(run directory, log file) of one run, in run_all.sh's layout."""
    if moe:
        run_dir = out / config / f"seed{seed}"
        return run_dir, out / config / f"seed{seed}.log"
    return out / f"{config}-seed{seed}", out / f"{config}-seed{seed}.log"


def read_run(run_dir: Path, log: Path, config: str, seed: int, steps: int | None) -> tuple[dict, list[dict]]:
    """(summary, metric rows sorted by step) of a run that finished all `steps` steps; steps None: all
    the steps its own summary.json planned (a run at its script's defaults)."""
    name, algo = f"{config} seed {seed}", config.split("-")[0]
    sp, mp = run_dir / "summary.json", run_dir / "metrics.jsonl"
    if not sp.is_file():
        raise IncompleteRun(f"{name}: missing {sp} (run not finished or failed; see {log})")
    try:
        summary = json.loads(sp.read_text())
    except (OSError, ValueError) as e:
        raise IncompleteRun(f"{name}: unreadable {sp} ({e})") from e
    planned = summary.get("steps")
    if steps is None:
        if isinstance(planned, bool) or not isinstance(planned, int) or planned < 1:
            raise IncompleteRun(f"{name}: {sp} has steps={planned!r}, not a step count")
        steps = planned
    elif planned != steps:
        raise IncompleteRun(f"{name}: {sp} has steps={planned!r}, expected STEPS={steps}")
    if summary.get("interrupted") or summary.get("step", steps) != steps:
        raise IncompleteRun(f"{name}: {sp} stopped at step {summary.get('step')!r} of {steps} (see {log})")
    if "seed" in summary and summary["seed"] != seed:
        raise IncompleteRun(f"{name}: {sp} has seed={summary['seed']!r}, expected {seed}")
    if "algo" in summary and summary["algo"] != algo:
        raise IncompleteRun(f"{name}: {sp} has algo={summary['algo']!r}, expected {algo!r}")
    if not mp.is_file():
        raise IncompleteRun(f"{name}: missing {mp}")
    rows = []
    for lineno, line in enumerate(mp.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise IncompleteRun(f"{name}: {mp}:{lineno} is not valid JSON") from e
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    rows.sort(key=lambda r: r["step"])
    if [r["step"] for r in rows] != list(range(1, steps + 1)):
        raise IncompleteRun(f"{name}: {mp} has {len(rows)} step rows, expected steps 1..{steps}")
    return summary, rows


def load_runs(out: Path, configs: list[str], seeds: list[int], steps: int | None, moe: bool = False):
    """({(config, seed): (summary, rows)} of the complete runs, [one line per incomplete run]).
    steps None: each run's own (read_run), and the seeds of one config must agree on it."""
    runs, problems = {}, []
    for config in configs:
        for seed in seeds:
            try:
                runs[(config, seed)] = read_run(*run_paths(out, config, seed, moe), config, seed, steps)
            except IncompleteRun as e:
                problems.append(str(e))
        lengths = {seed: len(runs[(config, seed)][1]) for seed in seeds if (config, seed) in runs}
        if len(set(lengths.values())) > 1:
            detail = ", ".join(f"seed {seed} {n}" for seed, n in lengths.items())
            problems.append(f"{config}: its seeds ran different numbers of steps ({detail})")
    return runs, problems


def refuse(problems: list[str]):
    print("run_all.sh: error: cannot build the report; incomplete or inconsistent runs:", file=sys.stderr)
    for p in problems:
        print(f"  - {p}", file=sys.stderr)
    print("run_all.sh: no results table written (re-run the runs named above).", file=sys.stderr)
    sys.exit(1)


def mismatched_settings(runs: dict, across_configs: bool = True) -> list[str]:
    """One line per shared setting on which the runs' args differ: between any two runs, or
    (across_configs False: configs at their own defaults differ on purpose) between the seeds of one config."""
    warnings = []
    groups = sorted({config for config, _ in runs}) if not across_configs else [None]
    for group in groups:
        for key in SHARED_SETTINGS:
            seen = {}
            for (config, seed), (summary, _) in runs.items():
                a = summary.get("args") or {}
                if key in a and group in (None, config):
                    seen.setdefault(json.dumps(a[key]), []).append(f"{config}-seed{seed}")
            if len(seen) > 1:
                detail = "; ".join(f"{k}: {', '.join(v)}" for k, v in seen.items())
                warnings.append(f"runs differ in {key} ({detail})")
    return warnings


# ------------------------------------------------------------------------------------------------
# Aggregation over steps and seeds
# ------------------------------------------------------------------------------------------------
def num(x) -> float | None:
    """A finite float, or None (missing keys, null, NaN, strings)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(x) else None


def mean_or_none(values) -> float | None:
    """Mean of the finite values, None if there are none."""
    v = [x for x in map(num, values) if x is not None]
    return sum(v) / len(v) if v else None


def mean_std(values) -> dict:
    """Mean and sample standard deviation (n - 1; 0 for a single value) of the finite values."""
    v = [x for x in map(num, values) if x is not None]
    if not v:
        return {"mean": None, "std": None, "n": 0}
    m = sum(v) / len(v)
    sd = math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1)) if len(v) > 1 else 0.0
    return {"mean": m, "std": sd, "n": len(v)}


def per_seed_values(runs: dict, config: str, seeds: list[int]) -> list[dict]:
    """One dict of METRICS per seed: the summary's numbers, and the rows' reduced to one value."""
    vals = []
    for seed in seeds:
        summary, rows = runs[(config, seed)]
        vals.append(
            {
                "seed": seed,
                "eval_accuracy_before": num(summary.get("eval_accuracy_before")),
                "eval_accuracy_after": num(summary.get("eval_accuracy_after")),
                "final_reward": mean_or_none(r.get("reward") for r in rows[-LAST_N:]),
                "wall_time_s": num(summary.get("wall_time_s")),
                "tokens_per_s": mean_or_none(r.get("tokens_per_s") for r in rows),
                "peak_mem_mb": num(summary.get("peak_mem_mb")),
                "mean_clip_frac": num(clip_frac_of(summary, "mean_")),
                "clip_frac_unit": clip_unit_of(summary, "mean_"),
                "final_entropy": num(rows[-1].get("entropy")),
            }
        )
    return vals


def aggregate(runs: dict, configs: list[str], seeds: list[int]) -> dict:
    """{config: {"steps": its runs' steps, metric: mean_std over seeds, "clip_frac_unit": "tokens" or
    "seqs", "before_after": [...], "per_seed": [...]}}."""
    results = {}
    for config in configs:
        vals = per_seed_values(runs, config, seeds)
        results[config] = {
            "steps": len(runs[(config, seeds[0])][1]),
            **{k: mean_std([v[k] for v in vals]) for k in METRICS},
            "before_after": [
                {"seed": v["seed"], "before": v["eval_accuracy_before"], "after": v["eval_accuracy_after"]}
                for v in vals
            ],
            "per_seed": vals,
            "clip_frac_unit": joint_unit(v["clip_frac_unit"] for v in vals),
        }
    return results


# ------------------------------------------------------------------------------------------------
# The comparison report: results.md, results.json, curves.png
# ------------------------------------------------------------------------------------------------
def format_mean_std(ms: dict, digits: int, n_seeds: int) -> str:
    """Mean +- std with `digits` decimals; the mean alone for one seed; n/a without a value."""
    if ms["mean"] is None:
        return "n/a"
    s = f"{ms['mean']:.{digits}f}"
    return s if n_seeds == 1 else f"{s} +- {ms['std']:.{digits}f}"


def format_clip_frac(ms: dict, unit: str | None, n_seeds: int) -> str:
    """A clip fraction's cell, labelled with its unit: "0.063 +- 0.002 (tokens)", "0.071 (seqs)", "n/a"."""
    cell = format_mean_std(ms, 3, n_seeds)
    return cell if cell == "n/a" or unit is None else f"{cell} ({unit})"


def results_table(results: dict, configs: list[str], n_seeds: int) -> list[str]:
    """The markdown table, one row per config; each config's own steps, each clip fraction with its unit."""
    header = [
        "algorithm",
        "steps",
        "held-out acc before -> after",
        f"reward (last {LAST_N} steps)",
        "wall-clock (s)",
        "tokens/s",
        "peak mem (MB)",
        "clip frac",
        "final entropy",
    ]
    table = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    for config in configs:
        r, n = results[config], n_seeds
        cells = [
            config,
            str(r["steps"]),
            f"{format_mean_std(r['eval_accuracy_before'], 3, n)} -> {format_mean_std(r['eval_accuracy_after'], 3, n)}",
            format_mean_std(r["final_reward"], 3, n),
            format_mean_std(r["wall_time_s"], 0, n),
            format_mean_std(r["tokens_per_s"], 0, n),
            format_mean_std(r["peak_mem_mb"], 0, n),
            format_clip_frac(r["mean_clip_frac"], r["clip_frac_unit"], n),
            format_mean_std(r["final_entropy"], 3, n),
        ]
        table.append("| " + " | ".join(cells) + " |")
    return table


def seeds_phrase(seeds: list[int]) -> str:
    """ "seed 0" for one seed, "3 seeds (0 1 2)" for several."""
    if len(seeds) == 1:
        return f"seed {seeds[0]}"
    return f"{len(seeds)} seeds ({' '.join(map(str, seeds))})"


def headline_settings(summary: dict) -> dict:
    """{label: value} of the settings every report names first, read from one run's summary.json."""
    a = summary.get("args") or {}
    return {
        "steps": summary.get("steps", a.get("steps")),
        "model": summary.get("model", a.get("model")),
        "task": summary.get("task") or a.get("task") or "arith",
        "prompts/step x samples": (a.get("prompts_per_step", "?"), a.get("group_size", "?")),
        "max new tokens": a.get("max_new_tokens", "?"),
    }


# How the settings line says a headline setting that every config shares ("1000 steps").
HEADLINE_PHRASES = {
    "steps": "{} steps",
    "model": "model {}",
    "task": "task {}",
    "prompts/step x samples": "{} prompts/step x {} samples",
    "max new tokens": "max {} new tokens",
}
NOT_SETTINGS = {"seed", "out", "resume", "steps", "model", "task", "prompts_per_step", "group_size", "max_new_tokens"}


def setting_text(value) -> str:
    """A setting as the settings line shows it: 0.0006, true, sequence, ["q_proj"], 64 x 4 (a pair)."""
    if isinstance(value, tuple):
        return " x ".join(map(setting_text, value))
    if isinstance(value, float):
        return f"{value:g}"
    return value if isinstance(value, str) else json.dumps(value)


def settings_line(runs: dict, configs: list[str], seeds: list[int]) -> str:
    """Seeds, then steps, model, task and sizes, read from each config's first summary.json: one value
    where every config agrees, each config's where they differ; then every other setting that all the
    configs have and on which they differ ("other settings that differ: lr ppo 0.0006, grpo 0.0003");
    a setting only some scripts have (PPO's critic_lr) is the algorithm's, not listed."""
    firsts = {config: runs[(config, seeds[0])][0] for config in configs}
    args = {config: summary.get("args") or {} for config, summary in firsts.items()}

    def each(values: dict) -> str:
        return ", ".join(f"{config} {setting_text(v)}" for config, v in values.items())

    parts = [seeds_phrase(seeds)]
    headlines = {config: headline_settings(summary) for config, summary in firsts.items()}
    for label, phrase in HEADLINE_PHRASES.items():
        values = {config: headlines[config][label] for config in configs}
        same = len({json.dumps(v) for v in values.values()}) == 1
        agreed = values[configs[0]] if isinstance(values[configs[0]], tuple) else (values[configs[0]],)
        parts.append(phrase.format(*map(setting_text, agreed)) if same else f"{label}: {each(values)}")
    shared = set.intersection(*(set(a) for a in args.values())) - NOT_SETTINGS
    differing = [
        f"{key} {each({config: args[config][key] for config in configs})}"
        for key in sorted(shared)
        if len({json.dumps(args[config][key]) for config in configs}) > 1
    ]
    if differing:
        parts.append("other settings that differ: " + "; ".join(differing))
    return "; ".join(parts)


def machine_description() -> str:
    """CPU model and core count, for the report's Machine line."""
    cpu = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "Processor", "cpu model") and value.strip():
                cpu = value.strip()
                break
    except OSError:
        pass
    cpu = cpu or platform.processor() or platform.machine() or "unknown CPU"
    return f"{cpu}, {os.cpu_count()} cores"


def smooth(y: list, w: int) -> list[float]:
    """Trailing moving average of window w (shorter at the start); None values are skipped."""
    out = []
    for i in range(len(y)):
        win = [v for v in y[max(0, i - w + 1) : i + 1] if v is not None]
        out.append(sum(win) / len(win) if win else float("nan"))
    return out


def band(series: list[list[float]]) -> tuple[list[float], list[float], list[float]]:
    """series: per-seed lists of equal length -> mean, lower, upper (min-max over seeds)."""
    cols = list(zip(*series))
    mean = [sum(c) / len(c) for c in cols]
    return mean, [min(c) for c in cols], [max(c) for c in cols]


def plot_curves(path: Path, runs: dict, configs: list[str], seeds: list[int], settings: str) -> Figure:
    """2 x 2: eval accuracy and smoothed reward, against step and against training wall-clock; each
    config to its own last step (its runs' length), so runs of different lengths share the axes."""
    lengths = {config: len(runs[(config, seeds[0])][1]) for config in configs}
    window = max(1, min(10, min(lengths.values()) // 10))
    fig = Figure(figsize=(12, 8.5))
    axes = fig.subplots(2, 2)
    for i, config in enumerate(configs):
        c = COLORS.get(config, f"C{i}")
        clocks, rewards, evals = [], [], []
        for seed in seeds:
            summary, rows = runs[(config, seed)]
            t, clock = 0.0, [0.0]
            for r in rows:
                t += num(r.get("step_time_s")) or 0.0
                clock.append(t)  # clock[s] = training seconds after step s
            clocks.append(clock)
            rewards.append(smooth([num(r.get("reward")) for r in rows], window))
            ev = {0: num(summary.get("eval_accuracy_before"))}
            ev.update({r["step"]: num(r.get("eval_accuracy")) for r in rows})
            evals.append({s: a for s, a in ev.items() if a is not None})
        label = f"{config}: {lengths[config]} steps, {seeds_phrase(seeds)}"
        # reward: one point per step, every seed of a config has all its steps
        m, lo, hi = band(rewards)
        clock_mean = band([c[1:] for c in clocks])[0]
        for ax, x in ((axes[0][1], list(range(1, lengths[config] + 1))), (axes[1][1], clock_mean)):
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

    clock_label = "training wall-clock (s, sum of step_time_s" + ("; mean over seeds)" if len(seeds) > 1 else ")")
    titles = [
        ["held-out eval accuracy vs step", f"training reward vs step (moving average of {window})"],
        ["held-out eval accuracy vs wall-clock", f"training reward vs wall-clock (moving average of {window})"],
    ]
    for r in range(2):
        for col in range(2):
            ax = axes[r][col]
            ax.set_title(titles[r][col], fontsize=10)
            ax.set_xlabel("step" if r == 0 else clock_label)
            ax.set_ylabel("eval accuracy" if col == 0 else "reward")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(plot_title(configs, seeds, settings, len(set(lengths.values())) > 1), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return fig  # for the tests, which read the plotted lines back


def plot_title(configs: list[str], seeds: list[int], settings: str, lengths_differ: bool) -> str:
    """The curves' title: the configs, the settings line wrapped, and what a line and a band are."""
    if len(seeds) == 1:
        reading = f"each line: the one run of seed {seeds[0]} (no spread over seeds)"
    else:
        reading = f"line: mean over {len(seeds)} seeds; band: min-max over seeds"
    if lengths_differ:
        reading += "; each config to its own last step"
    lines = [" vs ".join(config.upper() for config in configs) + ":"]
    for part in settings.split("; "):  # wrapped between settings, not inside one
        if len(lines[-1]) + len(part) > 150:
            lines.append(part + ";")
        else:
            lines[-1] += f" {part};"
    return "\n".join([*lines, reading]).replace(";\n", "\n")


def write_comparison_report(
    out: Path, runs: dict, configs: list[str], seeds: list[int], steps: int | None, command: str
):
    """results.md, results.json and curves.png. steps: the budget every run had, or None where each
    config ran its own (run_all.sh --defaults): then only a config's own seeds must agree on settings."""
    warnings = mismatched_settings(runs, across_configs=steps is not None)
    for w in warnings:
        print(f"run_all.sh: warning: {w}", file=sys.stderr)
    results = aggregate(runs, configs, seeds)
    table = results_table(results, configs, len(seeds))
    settings = settings_line(runs, configs, seeds)
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    machine = machine_description()
    spread = "Mean +- sample std over seeds" if len(seeds) > 1 else "One seed, no spread"
    md = [
        "# " + " vs ".join(config.upper() for config in configs),
        "",
        f"{spread}. {settings}.",
        "",
        *table,
        "",
        f"steps: each config's own (its runs' summary.json); reward: mean training reward of the last {LAST_N} "
        "steps; wall-clock: the run's wall_time_s; tokens/s: mean over steps of sampled completion tokens per "
        "second of generation; clip frac: mean over steps of the share clipped, in the unit beside it: (tokens) "
        "of clipped tokens, (seqs) of clipped sequences (GSPO's sequence ratio), two different units; "
        "final entropy: last step's.",
        "",
        f"Command: `{command}`  ",
        f"Date: {date}  ",
        f"Machine: {machine}",
    ]
    md += [f"\nWarning: {w}" for w in warnings]
    summary = {
        "command": command,
        "date": date,
        "machine": machine,
        "steps": steps,  # the budget every run had; null: each config's own ("steps" in "algos")
        "seeds": seeds,
        "last_n_reward_steps": LAST_N,
        "std": "sample (n-1); 0 for one seed",
        "warnings": warnings,
        "algos": results,
    }
    (out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "results.md").write_text("\n".join(md) + "\n")
    plot_curves(out / "curves.png", runs, configs, seeds, settings)

    print()
    print("\n".join(table))
    print()
    print(f"Wrote {out / 'results.md'}, {out / 'results.json'}, {out / 'curves.png'}")


# ------------------------------------------------------------------------------------------------
# The MoE report (run_all.sh --moe): moe_results.md, moe_curves.png
# ------------------------------------------------------------------------------------------------
def nan_mean(values) -> float:
    """Mean of the finite values, NaN if there are none (printed as "nan" in the table)."""
    m = mean_or_none(values)
    return float("nan") if m is None else m


def moe_table(runs: dict, configs: list[str], seeds: list[int]) -> list[str]:
    """One row per config: the summary's numbers averaged over seeds, the MoE metrics over steps then seeds."""
    lines = [
        f"| config | eval acc before | eval acc after | reward (last {LAST_N} steps) | routing drift / step "
        "| ratio std | clip frac | wall (s) |",
        "|---" * 8 + "|",
    ]
    for config in configs:
        summaries = [runs[(config, s)][0] for s in seeds]
        seed_rows = [runs[(config, s)][1] for s in seeds]
        over_seeds = {k: nan_mean(summary.get(k) for summary in summaries) for k in MOE_SUMMARY_KEYS}
        over_steps = {k: nan_mean(nan_mean(r.get(k) for r in rows) for rows in seed_rows) for k in MOE_STEP_KEYS}
        over_steps["clip_frac"] = nan_mean(nan_mean(clip_frac_of(r) for r in rows) for rows in seed_rows)
        unit = joint_unit(clip_unit_of(r) for rows in seed_rows for r in rows)
        clip_unit = f" ({unit})" if unit else ""
        final_reward = nan_mean(nan_mean(r.get("reward") for r in rows[-LAST_N:]) for rows in seed_rows)
        lines.append(
            f"| {config} | {over_seeds['eval_accuracy_before']:.3f} | {over_seeds['eval_accuracy_after']:.3f} "
            f"| {final_reward:.3f} | {over_steps['routing_drift']:.4f} | {over_steps['ratio_std']:.4f} "
            f"| {over_steps['clip_frac']:.4f}{clip_unit} | {over_seeds['wall_time_s']:.0f} |"
        )
    return lines


def plot_moe_curves(path: Path, runs: dict, configs: list[str], seeds: list[int]) -> Figure:
    """1 x 5: held-out accuracy and MOE_CURVES against step, one line per (config, seed); the clip
    fraction's legend gives each config's unit (tokens, or GSPO's seqs)."""
    fig = Figure(figsize=(22, 4))
    axes = fig.subplots(1, 5)
    clip_axis = axes[1 + MOE_CURVES.index("clip_frac")]
    for c, config in enumerate(configs):
        unit = joint_unit(clip_unit_of(r) for seed in seeds for r in runs[(config, seed)][1])
        for i, seed in enumerate(seeds):
            summary, rows = runs[(config, seed)]
            label = config if i == 0 else None
            ev = [(0, summary.get("eval_accuracy_before"))]
            ev += [(r["step"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r]
            axes[0].plot(*zip(*ev), marker="o", label=label, color=f"C{c}")
            for ax, key in zip(axes[1:], MOE_CURVES):
                values = [clip_frac_of(r) if key == "clip_frac" else r.get(key) for r in rows]
                line_label = f"{config} ({unit})" if ax is clip_axis and label and unit else label
                ax.plot([r["step"] for r in rows], values, label=line_label, color=f"C{c}", alpha=0.8)
    for ax, title in zip(axes, ["held-out accuracy"] + MOE_CURVES):
        ax.set_title(title)
        ax.set_xlabel("step")
    clip_axis.set_title("clip frac (share of tokens or seqs, as labelled)")
    axes[0].legend()
    clip_axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return fig  # for the tests, which read the legends back


def write_moe_report(out: Path, runs: dict, configs: list[str], seeds: list[int]):
    lines = moe_table(runs, configs, seeds)
    seed_list = " ".join(map(str, seeds))
    (out / "moe_results.md").write_text("\n".join(lines) + f"\n\nseeds: {seed_list}; means over steps and seeds\n")
    print("\n".join(lines))
    plot_moe_curves(out / "moe_curves.png", runs, configs, seeds)
    print(f"wrote {out / 'moe_results.md'} and {out / 'moe_curves.png'}")


# ------------------------------------------------------------------------------------------------
# The reward-model report (run_all.sh --reward-model): rm_results.md, rm_curves.png
# ------------------------------------------------------------------------------------------------
def fmt(x, digits: int = 3) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def rm_table(runs: dict, configs: list[str], seeds: list[int]) -> list[str]:
    """One row per config, means over seeds. For an -rm config eval_reward is the reward model's score
    of greedy held-out completions; kl_to_init and reward_model_pair_acc exist only there."""
    lines = [
        "| config | eval acc before | eval acc after | RM eval score before | RM eval score after "
        "| kl_to_init (last) | RM pair acc (step 1) | RM pair acc (last) | step time (s) | peak mem (MB) |",
        "|---" * 10 + "|",
    ]
    for config in configs:
        summaries = [runs[(config, s)][0] for s in seeds]
        seed_rows = [runs[(config, s)][1] for s in seeds]
        rm = config.endswith("-rm")

        def over_seeds(values):
            return mean_or_none([num(v) for v in values])

        evals = [[r for r in rows if "eval_reward" in r] for rows in seed_rows]
        cells = [
            over_seeds(s.get("eval_accuracy_before") for s in summaries),
            over_seeds(s.get("eval_accuracy_after") for s in summaries),
            over_seeds(s.get("eval_reward_before") for s in summaries) if rm else None,
            over_seeds(e[-1]["eval_reward"] if e else None for e in evals) if rm else None,
            over_seeds(rows[-1].get("kl_to_init") for rows in seed_rows),
            over_seeds(rows[0].get("reward_model_pair_acc") for rows in seed_rows),
            over_seeds(rows[-1].get("reward_model_pair_acc") for rows in seed_rows),
            over_seeds(nan_mean(r.get("step_time_s") for r in rows) for rows in seed_rows),
        ]
        mem = over_seeds(s.get("peak_mem_mb") for s in summaries)
        lines.append(f"| {config} | " + " | ".join(fmt(c) for c in cells) + f" | {fmt(mem, 0)} |")
    return lines


def plot_rm_curves(path: Path, runs: dict, configs: list[str], seeds: list[int]):
    """1 x 3: held-out accuracy against step (every config); the reward model's held-out score against
    step (-rm configs); held-out accuracy (solid) and reward-model score (dashed, right axis) against
    kl_to_init (-rm configs): Gao et al. 2022's over-optimisation plot. kl_to_init is measured on each
    step's samples, so the evaluation after step s is placed at step s + 1's KL (the last has none)."""
    fig = Figure(figsize=(18, 4.5))
    axes = fig.subplots(1, 3)
    score_axis = axes[2].twinx()
    for c, config in enumerate(configs):
        color = COLORS.get(config.split("-")[0], f"C{c}")
        style = "-" if config.endswith("-rm") else ":"
        for i, seed in enumerate(seeds):
            summary, rows = runs[(config, seed)]
            label = config if i == 0 else None
            acc = [(0, summary.get("eval_accuracy_before"))] + [(r["step"], r["eval_accuracy"]) for r in rows
                                                                  if "eval_accuracy" in r]  # fmt: skip
            axes[0].plot(*zip(*acc), style, color=color, marker="o", markersize=3, label=label)
            if not config.endswith("-rm"):
                continue
            ev = [r for r in rows if "eval_reward" in r]
            score = [(0, summary.get("eval_reward_before"))] + [(r["step"], r["eval_reward"]) for r in ev]
            score = [p for p in score if p[1] is not None]
            if score:
                axes[1].plot(*zip(*score), style, color=color, marker="o", markersize=3, label=label)
            # an evaluation after step s's update meets the KL of the samples of step s + 1 (the same policy)
            kl_after = {r["step"] - 1: r["kl_to_init"] for r in rows if "kl_to_init" in r}
            ev = [r for r in ev if r["step"] in kl_after]
            kl = [0.0] + [kl_after[r["step"]] for r in ev]
            accuracy = [summary.get("eval_accuracy_before")] + [r["eval_accuracy"] for r in ev]
            axes[2].plot(kl, accuracy, "-", color=color, marker="o", markersize=3,
                         label=f"{config} accuracy" if i == 0 else None)  # fmt: skip
            if summary.get("eval_reward_before") is not None:
                score_axis.plot(kl, [summary["eval_reward_before"]] + [r["eval_reward"] for r in ev], "--",
                                color=color, marker="x", markersize=3,
                                label=f"{config} RM score" if i == 0 else None)  # fmt: skip
    titles = ["held-out accuracy (true metric) vs step", "reward model's held-out score vs step",
              "held-out accuracy (solid) and RM score (dashed) vs KL to the start"]  # fmt: skip
    for ax, title in zip(axes, titles):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[2].set_xlabel("kl_to_init (nats per completion)")
    score_axis.set_ylabel("RM score")
    score_axis.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def write_rm_report(out: Path, runs: dict, configs: list[str], seeds: list[int], command: str):
    lines = rm_table(runs, configs, seeds)
    note = (
        f"\nMeans over seeds {' '.join(map(str, seeds))}. RM eval score: tiny-rm's score of greedy held-out "
        "completions (the -rm runs' eval reward); kl_to_init: mean over the last step's completions of "
        "sum_t log pi/pi_init; RM pair acc: share of (correct, wrong) completion pairs of a step's batch "
        "that tiny-rm orders rightly.\n"
    )
    machine = machine_description()
    (out / "rm_results.md").write_text("\n".join(lines) + note + f"\nCommand: `{command}`  \nMachine: {machine}\n")
    print("\n".join(lines))
    plot_rm_curves(out / "rm_curves.png", runs, configs, seeds)
    print(f"wrote {out / 'rm_results.md'} and {out / 'rm_curves.png'}")


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="the directory holding the runs; the report goes there")
    p.add_argument("--configs", nargs="+", required=True, help="run names, in table order (ppo grpo gspo)")
    p.add_argument("--seeds", nargs="+", type=int, required=True, help="every config must have run every seed")
    length = p.add_mutually_exclusive_group(required=True)
    length.add_argument("--steps", type=int, help="every run must have finished exactly this many steps")
    length.add_argument(
        "--own-steps",
        action="store_true",
        help="each run must have finished the steps its summary.json planned (runs at each script's defaults)",
    )
    p.add_argument("--command", default="", help="the command that reproduces the runs, quoted in results.md")
    p.add_argument("--moe", action="store_true", help="the MoE experiment's layout and report (run_all.sh --moe)")
    p.add_argument("--reward-model", action="store_true", help="the reward-model report (run_all.sh --reward-model)")
    args = p.parse_args(argv)

    runs, problems = load_runs(args.out, args.configs, args.seeds, args.steps, args.moe)
    if problems:
        refuse(problems)
    if args.moe:
        write_moe_report(args.out, runs, args.configs, args.seeds)
    elif args.reward_model:
        write_rm_report(args.out, runs, args.configs, args.seeds, args.command)
    else:
        write_comparison_report(args.out, runs, args.configs, args.seeds, args.steps, args.command)


if __name__ == "__main__":
    main()
