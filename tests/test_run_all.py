"""run_all.sh and its report (experiments/compare_report.py): the report from fabricated run directories,
its functions on hand-worked cases, and loud failures (no torch, no training)."""

import inspect
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

import compare_report
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "run_all.sh"
ALGOS = ("ppo", "grpo", "gspo")
SEEDS = (0, 1)
STEPS = 30
EVAL_EVERY = 10

# Algorithm-specific extra keys, as the real scripts log them: the report must not care.
EXTRA_KEYS = {
    "ppo": {"value_loss": 0.12, "explained_variance": 0.4, "kl_to_ref": 0.001, "eos_rate": 0.98},
    "grpo": {"clip_frac_low": 0.01, "clip_frac_high": 0.02, "kl": 0.0, "zero_std_frac": 0.4},
    "gspo": {"ratio_mean": 1.0, "ratio_max_dev": 0.2, "zero_std_frac": 0.35},
}


CLIP = {"ppo": "mean_clip_frac", "grpo": "mean_clip_frac", "gspo": "mean_clip_frac_seqs"}  # each summary's key
CLIP_UNIT = {"ppo": "tokens", "grpo": "tokens", "gspo": "seqs"}  # what each counts: GSPO clips whole sequences


def fabricate(out: Path, algo: str, seed: int, steps: int = STEPS, eval_every: int = EVAL_EVERY, settings=None):
    """Write plausible summary.json + metrics.jsonl for one run; return (summary, rows).
    settings: args that differ from the fabricated defaults (as a script's own defaults would)."""
    clip_key = "mean_clip_frac_seqs" if algo == "gspo" else "mean_clip_frac"  # (CLIP; this runs in a fake trainer too)
    a, k = ALGOS.index(algo), seed
    rows = []
    for step in range(1, steps + 1):
        row = {
            "step": step,
            "reward": round(0.1 + 0.01 * step + 0.03 * a + 0.02 * k + 0.005 * ((step * 7) % 3), 6),
            "accuracy": 0.0,
            "format_rate": 0.99,
            "loss": 0.01,
            "clip_frac": round(0.05 + 0.01 * a + 0.001 * step, 6),
            "entropy": round(0.8 - 0.01 * step - 0.02 * a + 0.03 * k, 6),
            "response_len": 3.5,
            "grad_norm": 1.5,
            "skipped_updates": 0,
            "tokens_per_s": round(1000.0 + 100 * a + 37 * k + 3 * step, 6),
            "step_time_s": round(0.5 + 0.2 * a + 0.01 * k, 6),
            **EXTRA_KEYS[algo],
        }
        row["accuracy"] = row["reward"]
        if algo == "gspo":  # GSPO's sequence variant counts clipped sequences, under its own name
            row["clip_frac_seqs"] = row.pop("clip_frac")
        if step % eval_every == 0 or step == steps:
            row["eval_accuracy"] = round(0.3 + 0.005 * step + 0.01 * a + 0.004 * k, 6)
            row["eval_format_rate"] = 0.99
        rows.append(row)
    summary = {"algo": algo, "model": "tiny", "task": "arith", "seed": seed, "steps": steps, "step": steps,
               "interrupted": False, "eval_accuracy_before": round(0.30 + 0.002 * a + 0.01 * k, 6),
               "eval_accuracy_after": rows[-1]["eval_accuracy"], "eval_format_rate_after": 0.99,
               "wall_time_s": round(100.0 + 40 * a + 3.5 * k, 6),
               "peak_mem_mb": round(900.0 + 300 * (algo == "ppo") + 11 * k, 6),
               clip_key: round(statistics.mean(r[clip_key.removeprefix("mean_")] for r in rows), 6),
               "args": {"model": "tiny", "steps": steps, "prompts_per_step": 16, "group_size": 8, "max_new_tokens": 8,
                        "seed": seed, "eval_every": eval_every, "lr": 3e-4, **(settings or {})}}  # fmt: skip
    d = out / f"{algo}-seed{seed}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "summary.json").write_text(json.dumps(summary, indent=2))
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return summary, rows


def run_all(*flags, env=None, timeout=60, unset=()):
    """bash run_all.sh FLAGS with this file's SEEDS, STEPS and EVAL_EVERY (less those named in unset)."""
    full_env = {**os.environ, "SEEDS": " ".join(map(str, SEEDS)), "STEPS": str(STEPS), "EVAL_EVERY": str(EVAL_EVERY),
                "PYTHON": sys.executable, "MPLBACKEND": "Agg", **(env or {})}  # fmt: skip
    full_env = {k: v for k, v in full_env.items() if k not in unset}
    return subprocess.run(
        ["bash", str(SCRIPT), *flags], env=full_env, capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def ms(values):
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


@pytest.fixture
def fabricated(tmp_path):
    out = tmp_path / "compare"
    runs = {(algo, seed): fabricate(out, algo, seed) for algo in ALGOS for seed in SEEDS}
    return out, runs


@pytest.mark.slow  # bash run_all.sh in a subprocess
def test_report_only_builds_table_json_and_plot(fabricated):
    out, runs = fabricated
    res = run_all("--report-only", env={"OUT": str(out)})
    assert res.returncode == 0, res.stdout + res.stderr

    md = (out / "results.md").read_text()
    table_rows = {line.split("|")[1].strip(): line for line in md.splitlines() if line.startswith("| ")}
    assert set(ALGOS) <= set(table_rows), md
    data = json.loads((out / "results.json").read_text())
    assert data["seeds"] == list(SEEDS) and data["steps"] == STEPS and data["warnings"] == []
    assert "Command:" in md and "Date:" in md and "Machine:" in md and "cores" in md

    for algo in ALGOS:
        summaries = [runs[(algo, s)][0] for s in SEEDS]
        metrics = [runs[(algo, s)][1] for s in SEEDS]
        expected = {
            "eval_accuracy_before": ms([s["eval_accuracy_before"] for s in summaries]),
            "eval_accuracy_after": ms([s["eval_accuracy_after"] for s in summaries]),
            "final_reward": ms([statistics.mean(r["reward"] for r in rows[-10:]) for rows in metrics]),
            "wall_time_s": ms([s["wall_time_s"] for s in summaries]),
            "tokens_per_s": ms([statistics.mean(r["tokens_per_s"] for r in rows) for rows in metrics]),
            "peak_mem_mb": ms([s["peak_mem_mb"] for s in summaries]),
            "mean_clip_frac": ms([s[CLIP[algo]] for s in summaries]),
            "final_entropy": ms([rows[-1]["entropy"] for rows in metrics]),
        }
        got = data["algos"][algo]
        for key, (mean, std) in expected.items():
            assert math.isclose(got[key]["mean"], mean, rel_tol=1e-9, abs_tol=1e-9), (algo, key)
            assert math.isclose(got[key]["std"], std, rel_tol=1e-9, abs_tol=1e-9), (algo, key)
        assert got["before_after"] == [
            {
                "seed": s,
                "before": runs[(algo, s)][0]["eval_accuracy_before"],
                "after": runs[(algo, s)][0]["eval_accuracy_after"],
            }
            for s in SEEDS
        ]

        # the table's cells parsed back: steps, before -> after, then each "m +- s", within display rounding
        cells = [c.strip() for c in table_rows[algo].strip().strip("|").split("|")]
        unit = f" ({CLIP_UNIT[algo]})"  # every clip fraction carries its unit: tokens, or GSPO's seqs
        assert cells[1] == str(STEPS) and cells[7].endswith(unit) and got["clip_frac_unit"] == CLIP_UNIT[algo]
        shown = [float(x) for x in re.findall(r"-?\d+(?:\.\d+)?", " ".join(cells[2:]))]
        tol = {"wall_time_s": 0.5, "tokens_per_s": 0.5, "peak_mem_mb": 0.5}  # shown as whole numbers
        order = ["eval_accuracy_before", "eval_accuracy_after", "final_reward", "wall_time_s", "tokens_per_s",
                 "peak_mem_mb", "mean_clip_frac", "final_entropy"]  # fmt: skip
        want = [(v, tol.get(key, 5e-4)) for key in order for v in expected[key]]
        assert len(shown) == len(want) and all(abs(x - w) <= t + 1e-9 for x, (w, t) in zip(shown, want)), cells
        assert table_rows[algo] in res.stdout  # the same table is printed

    png = (out / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


@pytest.mark.slow  # bash run_all.sh in a subprocess
def test_report_only_refuses_incomplete_runs(fabricated):
    out, _ = fabricated
    (out / "results.md").write_text("stale table\n")
    (out / "results.json").write_text("{}\n")
    run = out / "grpo-seed1"  # truncated metrics (read_run's other damages: test_read_run_refuses_incomplete_runs)
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("".join(lines[:-3]))
    res = run_all("--report-only", env={"OUT": str(out)})
    assert res.returncode != 0
    assert "grpo seed 1" in res.stderr, res.stderr
    assert "ppo seed" not in res.stderr and "gspo seed" not in res.stderr  # only the damaged run is named
    assert not (out / "results.md").exists() and not (out / "results.json").exists()
    assert not (out / "curves.png").exists()


@pytest.mark.slow  # bash run_all.sh in a subprocess
def test_failing_training_run_stops_and_names_it(tmp_path):
    out = tmp_path / "compare"
    fabricate(out, "ppo", 0)  # stale results of an earlier sweep: must not survive
    (out / "results.md").write_text("stale table\n")
    calls = tmp_path / "calls.txt"
    stub = tmp_path / "python-stub"
    stub.write_text(
        f'#!/bin/bash\necho "$@" >> {shlex.quote(str(calls))}\necho "Traceback: something broke" >&2\nexit 1\n'
    )
    stub.chmod(0o755)
    res = run_all(env={"OUT": str(out), "PYTHON": str(stub)})
    assert res.returncode != 0
    text = res.stdout + res.stderr
    assert "FAILED: ppo seed 0" in res.stderr, text
    assert str(out / "ppo-seed0.log") in res.stderr
    assert "something broke" in res.stderr  # the log's tail is shown
    assert len(calls.read_text().splitlines()) == 1  # stopped at the first failure
    assert not (out / "results.md").exists() and not (out / "results.json").exists()
    assert not (out / "ppo-seed0" / "summary.json").exists()  # the old run directory was deleted


FAKE_TRAINER = r"""
import json, os, statistics, sys
from pathlib import Path
script, argv = Path(sys.argv[1]).stem, sys.argv[2:]
with open(os.environ["FAKE_CALLS"], "a") as f:
    f.write(json.dumps([script] + argv) + "\n")
opts = {}
for i, a in enumerate(argv):
    if a.startswith("--"):
        opts[a] = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else True
if os.environ.get("FAKE_FAIL") == f"{script}-seed{opts['--seed']}":
    print("fake failure", file=sys.stderr)
    sys.exit(3)
"""
# The fake scripts' own defaults, as different as the real ones (PPO fewer, larger steps; GSPO another lr).
FAKE_DEFAULTS = {
    "ppo": {"steps": 20, "prompts_per_step": 32, "group_size": 1, "eval_every": 10, "lr": 6e-4},
    "grpo": {"steps": 30, "prompts_per_step": 16, "group_size": 8, "eval_every": 10, "lr": 3e-4},
    "gspo": {"steps": 30, "prompts_per_step": 16, "group_size": 8, "eval_every": 10, "lr": 6e-4},
}
FAKE_FLAGS = {"--steps": "steps", "--prompts-per-step": "prompts_per_step", "--group-size": "group_size",
              "--eval-every": "eval_every"}  # fmt: skip


@pytest.fixture
def fake_python(tmp_path):
    """A PYTHON that runs a fake trainer for `PYTHON {ppo,grpo,gspo}.py ...` and the real interpreter
    otherwise (the report, experiments/compare_report.py, runs for real)."""
    trainer = tmp_path / "fake_trainer.py"
    trainer.write_text(
        FAKE_TRAINER
        + f"ALGOS, STEPS, EVAL_EVERY, EXTRA_KEYS = {ALGOS!r}, {STEPS}, {EVAL_EVERY}, {EXTRA_KEYS!r}\n"
        + f"FAKE_DEFAULTS, FAKE_FLAGS = {FAKE_DEFAULTS!r}, {FAKE_FLAGS!r}\n"
        + inspect.getsource(fabricate)
        + 'run, seed = Path(opts["--out"]), int(opts["--seed"])\n'
        # the script's defaults, where a flag was passed its value
        + "a = {**FAKE_DEFAULTS[script], **{k: int(opts[f]) for f, k in FAKE_FLAGS.items() if f in opts}}\n"
        # fabricate() writes <dir>/<algo>-seed<k>; moved to --out, which is elsewhere under --moe
        + 'fabricate(run.parent / "fake", script, seed, a["steps"], a["eval_every"], settings=a)\n'
        + '(run.parent / "fake" / f"{script}-seed{seed}").rename(run)\n'
    )
    stub = tmp_path / "python-fake"
    py = shlex.quote(sys.executable)
    stub.write_text(
        f'#!/bin/bash\nif [[ "$1" =~ /(ppo|grpo|gspo)\\.py$ ]]; then exec {py} {shlex.quote(str(trainer))} "$@"; fi\n'
        f'exec {py} "$@"\n'
    )
    stub.chmod(0o755)
    calls = tmp_path / "calls.jsonl"
    env = {"PYTHON": str(stub), "FAKE_CALLS": str(calls)}
    return env, calls


@pytest.mark.slow  # bash run_all.sh in a subprocess
def test_full_run_passes_identical_settings_and_builds_report(tmp_path, fake_python):
    env, calls = fake_python
    out = tmp_path / "compare"
    (out / "gspo-seed1").mkdir(parents=True)
    (out / "gspo-seed1" / "stale.txt").write_text("old")
    sizes = {"PROMPTS_PER_STEP": "16", "GROUP_SIZE": "4", "MAX_NEW_TOKENS": "6"}
    res = run_all(env={**env, "OUT": str(out), **sizes, "EXTRA_ARGS": "--eval-size 50", "GSPO_ARGS": "--variant token"})
    assert res.returncode == 0, res.stdout + res.stderr
    recorded = [json.loads(line) for line in calls.read_text().splitlines()]
    assert [(c[0], c[c.index("--seed") + 1]) for c in recorded] == [
        (algo, str(seed)) for seed in SEEDS for algo in ALGOS
    ]
    for c in recorded:
        flags = dict(zip(c[1::2], c[2::2]))
        assert flags["--steps"] == str(STEPS) and flags["--prompts-per-step"] == "16"
        assert flags["--group-size"] == "4" and flags["--max-new-tokens"] == "6"
        assert flags["--model"] == "tiny" and flags["--eval-every"] == str(EVAL_EVERY)
        assert flags["--eval-size"] == "50"
        assert flags["--out"] == str(out / f"{c[0]}-seed{flags['--seed']}")
        assert (flags.get("--variant") == "token") == (c[0] == "gspo")
    assert not (out / "gspo-seed1" / "stale.txt").exists()
    assert all((out / f"{a}-seed{s}.log").is_file() for a in ALGOS for s in SEEDS)
    assert (out / "results.md").is_file() and (out / "curves.png").is_file()
    assert "--eval-size 50" in (out / "results.md").read_text()  # the command is recorded


# --- --defaults: each script at its own settings, runs of different lengths in one report ---
BUDGET = ("STEPS", "PROMPTS_PER_STEP", "GROUP_SIZE", "MAX_NEW_TOKENS", "EVAL_EVERY", "MINIBATCHES")
OWN_STEPS = {algo: FAKE_DEFAULTS[algo]["steps"] for algo in ALGOS}  # ppo 20, grpo 30, gspo 30


def fabricate_defaults(out: Path, seeds=SEEDS) -> dict:
    """Each algo's runs at the fake scripts' own defaults (different lengths); {(algo, seed): (summary, rows)}."""
    return {
        (algo, seed): fabricate(out, algo, seed, OWN_STEPS[algo], 10, settings=FAKE_DEFAULTS[algo])
        for algo in ALGOS
        for seed in seeds
    }


def table_cells(md: str) -> dict:
    """{config: [its row's cells]} of a results.md table."""
    rows = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| algorithm")]
    return {cells[0]: cells for cells in ([c.strip() for c in r.strip().strip("|").split("|")] for r in rows)}


@pytest.mark.slow  # bash run_all.sh in a subprocess
def test_defaults_runs_each_script_with_only_seed_and_out_and_reports_each_length(tmp_path, fake_python):
    env, calls = fake_python
    out = tmp_path / "defaults"
    res = run_all("--defaults", env={**env, "OUT": str(out)}, unset=BUDGET)
    assert res.returncode == 0, res.stdout + res.stderr
    recorded = [json.loads(line) for line in calls.read_text().splitlines()]
    assert [c[0] for c in recorded] == [algo for _ in SEEDS for algo in ALGOS]
    for c in recorded:  # nothing but the seed and the place: every other setting is the script's own
        assert c[1:] == ["--seed", c[2], "--out", str(out / f"{c[0]}-seed{c[2]}")], c
    md = (out / "results.md").read_text()
    cells = table_cells(md)
    assert {algo: int(cells[algo][1]) for algo in ALGOS} == OWN_STEPS  # each config's own length
    for algo in ALGOS:  # the reward of each config's own last 10 steps, recomputed from its metrics
        rewards = [
            statistics.mean(json.loads(line)["reward"] for line in lines[-10:])
            for lines in ((out / f"{algo}-seed{s}" / "metrics.jsonl").read_text().splitlines() for s in SEEDS)
        ]
        m, sd = (float(x) for x in cells[algo][3].split(" +- "))
        assert abs(m - statistics.mean(rewards)) <= 5e-4 + 1e-9 and abs(sd - statistics.stdev(rewards)) <= 5e-4 + 1e-9
    data = json.loads((out / "results.json").read_text())
    assert data["steps"] is None and {a: data["algos"][a]["steps"] for a in ALGOS} == OWN_STEPS
    # the configs differ on purpose: said in the settings line, not warned about
    assert data["warnings"] == [] and "warning" not in res.stderr
    assert "steps: ppo 20, grpo 30, gspo 30" in md and "lr ppo 0.0006, grpo 0.0003, gspo 0.0006" in md
    assert f'Command: `SEEDS="0 1" OUT={out} bash run_all.sh --defaults`' in md
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # --report-only rebuilds the same table from the runs, training nothing
    res = run_all("--defaults", "--report-only", env={**env, "OUT": str(out)}, unset=BUDGET)
    assert res.returncode == 0, res.stderr
    assert len(calls.read_text().splitlines()) == len(recorded)
    assert table_cells((out / "results.md").read_text()) == cells


@pytest.mark.slow  # bash run_all.sh in a subprocess
@pytest.mark.parametrize(
    "flags, env, says", [(["--bogus"], {}, "--bogus"), (["--defaults"], {"STEPS": "4"}, "STEPS is set")]
)
def test_bad_input_exits_2_with_one_line(tmp_path, flags, env, says):
    """A bad flag, or --defaults with a shared budget variable set."""
    res = run_all(*flags, env={"OUT": str(tmp_path / "d"), **env}, unset=set(BUDGET) - set(env))
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and says in res.stderr, res.stderr
    assert not (tmp_path / "d").exists()


@pytest.mark.slow  # bash run_all.sh in a subprocess
@pytest.mark.parametrize(
    "damage,message",
    [
        ("short_metrics", "gspo seed 1: " + "{}/metrics.jsonl has 25 step rows, expected steps 1..30"),
        ("seeds_differ", "gspo: its seeds ran different numbers of steps (seed 0 30, seed 1 20)"),
    ],
)
def test_defaults_report_refuses_a_run_short_of_its_own_steps(tmp_path, damage, message):
    """Each run is held to the steps its own summary.json planned (30 for gspo), not to one STEPS."""
    out = tmp_path / "defaults"
    fabricate_defaults(out)
    run = out / "gspo-seed1"
    if damage == "short_metrics":  # a run still going, or killed, with a stale summary.json beside it
        (run / "metrics.jsonl").write_text("".join((run / "metrics.jsonl").read_text().splitlines(True)[:25]))
    else:  # a gspo seed at another length (ppo's 20 steps) is not the same config
        fabricate(out, "gspo", 1, 20, 10, settings={**FAKE_DEFAULTS["gspo"], "steps": 20})
    res = run_all("--defaults", "--report-only", env={"OUT": str(out)}, unset=BUDGET)
    assert res.returncode == 1 and message.format(run) in res.stderr, res.stderr
    assert "ppo" not in res.stderr and "grpo" not in res.stderr  # only the damaged config is named
    assert not (out / "results.md").exists() and not (out / "curves.png").exists()


def test_settings_line_names_each_setting_on_which_the_configs_differ(tmp_path):
    runs = fabricate_defaults(tmp_path)
    assert compare_report.settings_line(runs, list(ALGOS), list(SEEDS)) == (
        "2 seeds (0 1); steps: ppo 20, grpo 30, gspo 30; model tiny; task arith; "
        "prompts/step x samples: ppo 32 x 1, grpo 16 x 8, gspo 16 x 8; max 8 new tokens; "
        "other settings that differ: lr ppo 0.0006, grpo 0.0003, gspo 0.0006"
    )
    equal = {key: fabricate(tmp_path / "equal", *key) for key in runs}  # one budget, one lr: nothing differs
    assert compare_report.settings_line(equal, list(ALGOS), [0]) == (
        f"seed 0; {STEPS} steps; model tiny; task arith; 16 prompts/step x 8 samples; max 8 new tokens"
    )


def smoothed(values: list[float], window: int) -> list[float]:
    """Trailing moving average, the plain way."""
    out = []
    for i in range(len(values)):
        start = max(0, i - window + 1)
        out.append(sum(values[start : i + 1]) / (i + 1 - start))
    return out


def test_plot_curves_draws_each_config_against_its_own_steps_and_clock(tmp_path):
    runs = fabricate_defaults(tmp_path)
    fig = compare_report.plot_curves(tmp_path / "curves.png", runs, list(ALGOS), list(SEEDS), "settings")
    (acc_step, reward_step), (acc_clock, reward_clock) = fig.axes[0:2], fig.axes[2:4]
    window = 2  # min(10, the shortest run's 20 steps // 10)
    assert f"moving average of {window})" in reward_step.get_title()
    for algo in ALGOS:
        n, label = OWN_STEPS[algo], f"{algo}: {OWN_STEPS[algo]} steps, 2 seeds (0 1)"
        lines = {ax: next(line for line in ax.get_lines() if line.get_label() == label) for ax in fig.axes}
        seed_rows = [runs[(algo, s)][1] for s in SEEDS]
        # reward against its own steps 1..n: each seed smoothed, then the mean over seeds
        per_seed = [smoothed([r["reward"] for r in rows], window) for rows in seed_rows]
        assert list(lines[reward_step].get_xdata()) == list(range(1, n + 1))
        assert list(lines[reward_step].get_ydata()) == pytest.approx([sum(c) / 2 for c in zip(*per_seed)])
        # against its own clock: the seeds' mean of the running sum of step_time_s
        clocks = []
        for rows in seed_rows:
            t, clock = 0.0, []
            for r in rows:
                t += r["step_time_s"]
                clock.append(t)
            clocks.append(clock)
        assert list(lines[reward_clock].get_xdata()) == pytest.approx([sum(c) / 2 for c in zip(*clocks)])
        # held-out accuracy at step 0 and at each evaluation, to its own last step
        evals = list(range(0, n + 1, 10))
        assert list(lines[acc_step].get_xdata()) == evals
        want = [
            statistics.mean(
                runs[(algo, s)][0]["eval_accuracy_before"] if e == 0 else runs[(algo, s)][1][e - 1]["eval_accuracy"]
                for s in SEEDS
            )
            for e in evals
        ]
        assert list(lines[acc_step].get_ydata()) == pytest.approx(want)
        assert lines[acc_clock].get_xdata()[-1] == pytest.approx(lines[reward_clock].get_xdata()[-1])
    assert "each config to its own last step" in fig._suptitle.get_text()


# --- experiments/compare_report.py's functions, called directly ---


def test_mean_std_is_the_sample_std_of_the_finite_values():
    # [1, 2, 4]: mean 7/3; squared deviations 16/9 + 1/9 + 25/9 = 42/9, over n - 1 = 2: 7/3
    got = compare_report.mean_std([1, None, 2, float("nan"), True, "3", 4])
    assert got["n"] == 3 and got["mean"] == pytest.approx(7 / 3) and got["std"] == pytest.approx(math.sqrt(7 / 3))
    assert compare_report.mean_std([0.5]) == {"mean": 0.5, "std": 0.0, "n": 1}
    assert compare_report.mean_std([None, float("inf")]) == {"mean": None, "std": None, "n": 0}


def test_per_seed_values_and_aggregate_hand_worked():
    # 12 steps, reward = step / 10: the last 10 steps are 3..12, mean 7.5 / 10
    def run(seed):
        rows = [
            {"step": s, "reward": s / 10, "tokens_per_s": 100.0 * (seed + 1), "entropy": 0.1 * s + seed}
            for s in range(1, 13)
        ]
        rows[-1]["reward"] = None  # a missing value is skipped, not counted as 0: last 10 = 3..11
        summary = {"eval_accuracy_before": 0.2, "eval_accuracy_after": [0.4, 0.6][seed], "wall_time_s": 10}
        return summary, rows

    runs = {("grpo", 0): run(0), ("grpo", 1): run(1)}
    vals = compare_report.per_seed_values(runs, "grpo", [0, 1])
    assert vals[0]["final_reward"] == pytest.approx(sum(range(3, 12)) / 9 / 10)
    assert [v["tokens_per_s"] for v in vals] == [100.0, 200.0]
    assert [v["final_entropy"] for v in vals] == pytest.approx([1.2, 2.2])
    assert vals[0]["peak_mem_mb"] is None  # not in the summary
    r = compare_report.aggregate(runs, ["grpo"], [0, 1])["grpo"]
    assert r["eval_accuracy_after"]["mean"] == pytest.approx(0.5)
    assert r["eval_accuracy_after"]["std"] == pytest.approx(math.sqrt(0.02))  # (0.1^2 + 0.1^2) / 1
    assert r["before_after"] == [{"seed": 0, "before": 0.2, "after": 0.4}, {"seed": 1, "before": 0.2, "after": 0.6}]
    table = compare_report.results_table({"grpo": r}, ["grpo"], 2)
    assert table[2].startswith("| grpo | 12 | 0.200 +- 0.000 -> 0.500 +- 0.141 |") and "| n/a |" in table[2]


def test_format_mean_std_smooth_and_band():
    ms = {"mean": 0.5, "std": 0.1, "n": 2}
    assert compare_report.format_mean_std(ms, 3, 2) == "0.500 +- 0.100"
    assert compare_report.format_mean_std(ms, 0, 1) == "0"  # one seed: no spread shown
    assert compare_report.format_mean_std({"mean": None, "std": None, "n": 0}, 3, 2) == "n/a"
    assert compare_report.smooth([1.0, None, 3.0, 5.0], 2) == [1.0, 1.0, 3.0, 4.0]
    assert compare_report.band([[1.0, 4.0], [3.0, 2.0]]) == ([2.0, 3.0], [1.0, 2.0], [3.0, 4.0])


@pytest.mark.parametrize(
    "damage,message",
    [
        ("missing_summary", "missing"),
        ("wrong_steps", f"steps={STEPS - 5}, expected STEPS={STEPS}"),
        ("wrong_algo", "algo='gspo', expected 'grpo'"),
        ("short_metrics", f"has {STEPS - 1} step rows, expected steps 1..{STEPS}"),
        ("bad_json", f"metrics.jsonl:{STEPS + 1} is not valid JSON"),
    ],
)
def test_read_run_refuses_incomplete_runs(tmp_path, damage, message):
    fabricate(tmp_path, "grpo", 1)
    run_dir, log = compare_report.run_paths(tmp_path, "grpo", 1)
    assert log == tmp_path / "grpo-seed1.log"
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = run_dir / "metrics.jsonl"
    if damage == "missing_summary":
        (run_dir / "summary.json").unlink()
    elif damage in ("wrong_steps", "wrong_algo"):
        summary.update({"steps": STEPS - 5} if damage == "wrong_steps" else {"algo": "gspo"})
        (run_dir / "summary.json").write_text(json.dumps(summary))
    elif damage == "short_metrics":
        metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:-1]))
    else:
        metrics.write_text(metrics.read_text() + '{"step": \n')
    with pytest.raises(compare_report.IncompleteRun, match="grpo seed 1") as e:
        compare_report.read_run(run_dir, log, "grpo", 1, STEPS)
    assert message in str(e.value)


def test_moe_layout_and_table_hand_worked(tmp_path):
    assert compare_report.run_paths(tmp_path, "grpo-replay", 2, moe=True) == (
        tmp_path / "grpo-replay" / "seed2",
        tmp_path / "grpo-replay" / "seed2.log",
    )
    rows = [
        {"step": s, "reward": 1.0 if s > 2 else 0.0, "routing_drift": 0.01 * s, "ratio_std": 0.1} for s in (1, 2, 3)
    ]
    summary = {"eval_accuracy_before": 0.2, "eval_accuracy_after": 0.3, "wall_time_s": 99.6}
    runs = {("gspo", 0): (summary, rows), ("gspo", 1): ({**summary, "eval_accuracy_after": 0.5}, rows)}
    line = compare_report.moe_table(runs, ["gspo"], [0, 1])[2]
    # reward over the last 10 (all 3) steps: 1/3; drift: mean of 0.01, 0.02, 0.03; no clip_frac logged
    assert line == "| gspo | 0.200 | 0.400 | 0.333 | 0.0200 | 0.1000 | nan | 100 |"


# --- --staleness (experiments/staleness_sweep.py): its flags, its grid, and the resume that skips finished runs ---
@pytest.mark.slow  # bash run_all.sh in a subprocess
def test_staleness_sweep_resumes_skipping_finished_runs(tmp_path, fake_python):
    env, calls = fake_python
    out = tmp_path / "s"
    env = {**env, "OUT": str(out), "CONFIGS": "grpo gspo", "MINIBATCHES": "1 4", "SEEDS": "0"}
    # grpo mb1 finished before; gspo mb4 was stopped by SIGTERM at step 1, which also writes a
    # summary.json (interrupted: true): it must run again
    fabricate(out / "grpo" / "mb1", "grpo", 0)
    (out / "grpo" / "mb1" / "grpo-seed0").rename(out / "grpo" / "mb1" / "seed0")
    (out / "gspo" / "mb4" / "seed0").mkdir(parents=True)
    (out / "gspo" / "mb4" / "seed0" / "metrics.jsonl").write_text('{"step": 1}\n')
    stopped = {"algo": "gspo", "seed": 0, "steps": STEPS, "step": 1, "interrupted": True}
    (out / "gspo" / "mb4" / "seed0" / "summary.json").write_text(json.dumps(stopped))
    res = run_all("--staleness", env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "4 runs" in res.stdout and "1 finished (skipped), 3 to run" in res.stdout
    recorded = [json.loads(line) for line in calls.read_text().splitlines()]
    ran = [(c[0], c[c.index("--minibatches") + 1]) for c in recorded]
    assert ran == [("gspo", "1"), ("grpo", "4"), ("gspo", "4")]
    table = (out / "staleness_results.md").read_text()
    assert table.count("| grpo |") == 2 and table.count("| gspo |") == 2
    assert (out / "staleness_accuracy.png").is_file() and (out / "staleness_ratios.png").is_file()
    # everything finished: a second invocation runs nothing and rebuilds the report
    res = run_all("--staleness", env=env)
    assert res.returncode == 0 and "0 to run" in res.stdout
    assert len(calls.read_text().splitlines()) == 3
    # a missing run: --report-only refuses and names it
    import shutil

    shutil.rmtree(out / "gspo" / "mb1" / "seed0")
    res = run_all("--staleness", "--report-only", env=env)
    assert res.returncode == 1 and "gspo seed 0" in res.stderr and not (out / "staleness_results.md").exists()
