"""Evaluation (pass@k, --eval-data), samples.jsonl, the closing line, TensorBoard, and --mask-truncated end to end."""

from __future__ import annotations

import itertools
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ROOT, gamma, unit_roundoff
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

import common
import gspo
from extras.pass_at_k import pass_at_k

SMALL = ["--prompts-per-step", "4", "--group-size", "2", "--max-new-tokens", "6", "--eval-size", "8",
         "--minibatches", "2"]  # fmt: skip

# 1 for odd rows, 0 for even ones: every group of 2 has a spread, whatever the model samples
ROWS = "def alternate(prompts, completions, **kwargs):\n    return [float(i % 2) for i in range(len(completions))]\n"


def train_in_process(module, *argv):
    common.main(module.train, module.Args, [*SMALL, *map(str, argv)])


def rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# --- pass@k and evaluate() ---


@given(n=st.integers(1, 9), data=st.data())
@settings(max_examples=150, deadline=None)
def test_pass_at_k_equals_brute_force(n, data):
    c = data.draw(st.integers(0, n))
    k = data.draw(st.integers(1, n))
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    brute = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
    # c factors 1 - k / i (2 roundings each), c - 1 products and 1 - prod (<= 1 in size): gamma_{3n}; brute: 1
    assert pass_at_k(n, c, k) == pytest.approx(brute, abs=gamma(3 * n + 1))


def test_evaluate_reports_pass_at_1_and_pass_at_n(tiny_path, monkeypatch):
    """Correct by row: greedy [1, 0, 1], samples [1, 1, 0, 0], [0] * 4, [1, 0, 0, 0]:
    pass@1 = (2/4 + 0 + 1/4) / 3, pass@4 = 2 / 3."""
    fixed = {3: [1, 0, 1], 12: [1, 1, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0]}

    def by_row(tok, roll, answers, parser="exact"):
        correct = torch.tensor(fixed[len(answers)], dtype=torch.float32)
        return correct, torch.ones(len(answers))

    monkeypatch.setattr(common, "score_rollout", by_row)
    model, tok = common.load_model(tiny_path, torch.device("cpu"))
    examples = common.arith_split()[1][:3]
    gen = torch.Generator().manual_seed(0)
    result = common.evaluate(model, tok, examples, 5, common.Rewards(), n_samples=4, generator=gen, show=2)
    # float32 means of 3 exactly summed values: one rounding each, and one for the float64 expected
    share = unit_roundoff(torch.float32) + unit_roundoff(torch.float64)
    assert result["accuracy"] == pytest.approx(2 / 3, rel=share) and result["reward"] == pytest.approx(2 / 3, rel=share)
    assert result["format_rate"] == 1.0
    assert result["pass@1"] == pytest.approx((0.5 + 0 + 0.25) / 3, rel=share)
    assert result["pass@4"] == pytest.approx(2 / 3, rel=share)
    assert [s["prompt"] for s in result["samples"]] == [ex["prompt"] for ex in examples[:2]]
    assert [s["rewards"] for s in result["samples"]] == [{"exact": 1.0}, {"exact": 0.0}]


# --- --eval-data ---


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def setup_with(*argv):
    args = common.parse_args(gspo.Args, [*SMALL, *map(str, argv)])
    return common.setup(args, needs_group=True)


def test_eval_data_replaces_the_held_out_part_and_overlap_is_counted(tmp_path, capsys):
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"q{i}", "answer": str(i)} for i in range(10)])
    # GSM8K's form; two questions also in training ("q3", and "q8" with surrounding spaces)
    test = write_jsonl(
        tmp_path / "test.jsonl",
        [{"question": q, "answer": f"work #### {i}"} for i, q in enumerate(["q3", "e1", " q8 ", "e2", "e3", "q9"])],
    )
    env = setup_with("--data", train, "--eval-data", test, "--eval-size", "5", "--out", tmp_path / "run")
    assert [r["prompt"] for r in env.train_set] == [f"q{i}" for i in range(10)]  # all of --data
    assert env.eval_set == [{"prompt": q, "answer": str(i)} for i, q in enumerate(["q3", "e1", " q8 ", "e2", "e3"])]
    assert env.eval_overlap == 2  # "q9" is beyond --eval-size 5
    err = capsys.readouterr().err
    assert f"warning: 2 of the 5 evaluation prompts also occur in the training data (--eval-data {test})" in err

    disjoint = write_jsonl(tmp_path / "disjoint.jsonl", [{"prompt": f"e{i}", "answer": "1"} for i in range(4)])
    env = setup_with("--data", train, "--eval-data", disjoint, "--out", tmp_path / "run")
    assert env.eval_overlap == 0 and "warning" not in capsys.readouterr().err
    env = setup_with("--data", train, "--out", tmp_path / "run")  # no --eval-data: a held-out 10%
    assert len(env.train_set) == 9 and len(env.eval_set) == 1 and env.eval_overlap == 0


def test_eval_data_errors_name_the_flag(tmp_path):
    with pytest.raises(common.UsageError, match="--eval-data .*missing.jsonl: file not found"):
        setup_with("--eval-data", tmp_path / "missing.jsonl", "--out", tmp_path / "run")
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "1+1="}])
    with pytest.raises(common.UsageError, match=r"--eval-data .*bad.jsonl:1: missing field 'answer'"):
        setup_with("--eval-data", bad, "--out", tmp_path / "run")
    with pytest.raises(common.UsageError, match="--eval-samples must be 0"):
        setup_with("--eval-samples", "1", "--out", tmp_path / "run")


# --- samples.jsonl ---


LR = 1.234567891e-4  # more digits than a rounding to 6 decimals keeps


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """gspo.py run as a user runs it, 2 steps, an evaluation at each, two rewards: (out, its process, its seconds)."""
    import os
    import subprocess

    tmp = tmp_path_factory.mktemp("cli")
    rewards = tmp / "task_rewards.py"
    rewards.write_text("def prompt_len(prompts, completions, **kwargs):\n    return [len(p) % 3 for p in prompts]\n")
    out = tmp / "run"
    cmd = [sys.executable, "gspo.py", *SMALL, "--steps", "2", "--eval-every", "1", "--lr", repr(LR), "--reward",
           "exact", f"{rewards}:prompt_len", "--reward-weights", "1", "2", "--out", str(out)]  # fmt: skip
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "RLREF_THREADS": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc, time.perf_counter() - started


@pytest.mark.slow
def test_samples_jsonl_holds_each_evaluation_s_first_prompts(cli_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = cli_run[0]
    samples = rows(out / "samples.jsonl")
    eval_set = common.arith_split()[1][:3]
    assert [s["step"] for s in samples] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [(s["prompt"], s["answer"]) for s in samples] == [(ex["prompt"], ex["answer"]) for ex in eval_set] * 3
    for s in samples:
        assert s["rewards"]["prompt_len"] == len(s["prompt"]) % 3
        assert s["rewards"]["exact"] in (0.0, 1.0)
        assert s["reward"] == s["rewards"]["exact"] + 2 * s["rewards"]["prompt_len"]  # small integers: exact
    # the last evaluation's completions are the final policy's greedy ones: Hugging Face generate agrees
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    tok = AutoTokenizer.from_pretrained(out / "final", padding_side="left")
    batch = tok([ex["prompt"] for ex in eval_set], return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        generated = model.generate(**batch, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    new = generated[:, batch["input_ids"].shape[1] :]
    assert [s["completion"] for s in samples[-3:]] == tok.batch_decode(new, skip_special_tokens=True)
    assert [s["truncated"] for s in samples[-3:]] == [bool((row != tok.eos_token_id).all()) for row in new]


# --- The end of a run: the closing line, transformers' bars, the progress bar's field, summary.json ---


def floats_in(value):
    """Every float inside `value` (dicts and lists too)."""
    if isinstance(value, float):
        return [value]
    if isinstance(value, dict):
        return [x for v in value.values() for x in floats_in(v)]
    if isinstance(value, list):
        return [x for v in value for x in floats_in(v)]
    return []


@pytest.mark.slow
def test_a_run_ends_with_one_closing_line_and_no_transformers_bars(cli_run):
    """A subprocess run: one closing line, true to summary.json and --out; no transformers bars; rounded numbers."""
    import re

    out, proc, elapsed = cli_run
    summary, metrics = json.loads((out / "summary.json").read_text()), rows(out / "metrics.jsonl")
    before, after = summary["eval_accuracy_before"], summary["eval_accuracy_after"]
    assert after == metrics[-1]["eval_accuracy"]  # bit for bit: both rounded alike

    last = proc.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"gspo: held-out accuracy (\S+) -> (\S+) in (\d+) s; wrote (.+) \((.+)\)", last)
    assert m, last
    assert m.group(1, 2) == (f"{before:.3f}", f"{after:.3f}")
    assert int(m.group(3)) == round(summary["wall_time_s"])
    assert m.group(4) == str(out)
    written = ["summary.json", "metrics.jsonl", "samples.jsonl", "traces.jsonl", "console.log", "final/"]
    assert m.group(5).split(", ") == written
    assert {p.name for p in out.iterdir()} - {common.LOCK} == {
        name.rstrip("/") for name in written
    }  # (.lock: no output)

    both = proc.stdout + proc.stderr
    assert "Loading weights" not in both and "Writing model shards" not in both
    assert " acc=" not in both and re.findall(r"eval_acc=([\d.]+)", proc.stderr)[-1] == f"{after:.3f}"

    measured = {k: v for k, v in summary.items() if k != "args"}
    assert all(round(x, 6) == x for x in floats_in(measured)), measured
    assert summary["args"]["lr"] == LR  # the flags as given, not rounded
    steps_s = sum(r["step_time_s"] for r in metrics)
    assert steps_s < summary["wall_time_s"] <= elapsed


def test_wall_time_counts_from_the_scripts_start(tmp_path, monkeypatch):
    """summary.json's wall_time_s counts from common.STARTED (the script's import), not from the Run's creation."""
    monkeypatch.setattr(common, "STARTED", time.perf_counter() - 1000.0)
    began = time.perf_counter()
    train_in_process(gspo, "--steps", "1", "--out", tmp_path / "run")
    took = time.perf_counter() - began
    wall = json.loads((tmp_path / "run" / "summary.json").read_text())["wall_time_s"]
    assert 1000.0 < wall <= 1000.0 + took + 1e-3


def test_the_closing_lines_pieces():
    assert [common.duration(s) for s in (0.4, 44.6, 59.4, 137.2, 3599.4, 3780.0)] == [
        "0 s", "45 s", "59 s", "2 min 17 s", "59 min 59 s", "1 h 3 min"]  # fmt: skip
    assert common.rounded({"a": 0.22200000286102295, "b": [1.0000004, 3], "c": "x", "d": None, "e": 7}) == {
        "a": 0.222, "b": [1.0, 3], "c": "x", "d": None, "e": 7}  # fmt: skip


def test_the_closing_line_says_reward_where_the_task_has_no_accuracy(tmp_path):
    (tmp_path / "summary.json").write_text("{}")
    (tmp_path / "traces.jsonl").write_text("")  # empty: not named
    (tmp_path / "checkpoint").mkdir()
    line = common.closing_line("ppo", {"reward": 0.25}, {"reward": 0.5}, 75.0, tmp_path)
    assert line == f"ppo: held-out reward 0.250 -> 0.500 in 1 min 15 s; wrote {tmp_path} (summary.json, checkpoint/)"


# --- TensorBoard ---


def tensorboard_scalars(log_dir) -> dict:
    """{tag: [(step, value), ...]} as TensorBoard shows it (orphaned events purged)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def assert_tensorboard_equals_metrics(out):
    metrics = rows(out / "metrics.jsonl")
    scalars = tensorboard_scalars(out / "tensorboard")
    expected = {}
    for row in metrics:
        for k, v in row.items():
            if k != "step":
                expected.setdefault(k, []).append((row["step"], v))
    assert scalars.keys() == expected.keys()
    for tag, points in expected.items():
        got = scalars[tag]
        assert [s for s, _ in got] == [s for s, _ in points], tag  # each step once, in order
        for (_, value), (_, want) in zip(got, points):
            want32 = np.float32(want)  # event files store float32
            assert value == want32 or (math.isnan(value) and math.isnan(want32)), (tag, value, want)


@pytest.mark.slow
def test_tensorboard_holds_the_metrics_and_a_resume_continues_the_curves(tmp_path):
    out = tmp_path / "run"
    train_in_process(gspo, "--steps", "3", "--save-every", "3", "--eval-every", "2", "--report-to", "tensorboard",
                     "--out", out)  # fmt: skip
    assert_tensorboard_equals_metrics(out)
    assert {r["step"] for r in rows(out / "samples.jsonl")} == {0, 2, 3}

    # what a crash after step 5 of a longer run would leave beyond the step-3 checkpoint
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(out / "tensorboard"))
    for step in (4, 5):
        writer.add_scalar("reward", -1.0, step)
    writer.close()
    with open(out / "samples.jsonl", "a") as f:
        f.write(json.dumps({"step": 4, "prompt": "stale", "completion": "", "reward": -1.0}) + "\n")
    time.sleep(1.1)  # event files are ordered by their names' timestamps, in seconds

    common.main(gspo.train, gspo.Args, ["--resume", str(out), "--steps", "5"])
    assert [r["step"] for r in rows(out / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    assert_tensorboard_equals_metrics(out)  # steps 4 and 5 once each, the resumed run's values
    samples = rows(out / "samples.jsonl")
    assert [s["step"] for s in samples] == [0] * 3 + [2] * 3 + [3] * 3 + [4] * 3 + [5] * 3  # 3: the first run's last
    assert all(s["prompt"] != "stale" for s in samples)


# --- --mask-truncated ---


@pytest.mark.slow  # grpo's, every aggregation: test_aggregation_through_train.py; an empty row: test_losses.py
def test_mask_truncated_end_to_end_no_update_when_every_row_is_cut(tmp_path, monkeypatch, tiny_path, module=gspo):
    """Every advantage nonzero, every completion cut: with --mask-truncated the weights stay; without it they move."""
    rewards = tmp_path / "rows.py"
    rewards.write_text(ROWS)
    monkeypatch.setattr(common, "completion_ends", lambda roll, eos_ids: torch.zeros(len(roll), dtype=torch.bool))
    initial = load_file(str(Path(tiny_path) / "model.safetensors"))
    flags = ["--steps", "1", "--eval-every", "0", "--reward", f"{rewards}:alternate"]
    train_in_process(module, *flags, "--mask-truncated", "--out", tmp_path / "masked")
    row = rows(tmp_path / "masked" / "metrics.jsonl")[0]
    assert row["truncated_frac"] == 1.0 and row["reward"] == 0.5 and row["skipped_updates"] == 0
    masked = load_file(str(tmp_path / "masked" / "final" / "model.safetensors"))
    assert all(torch.equal(masked[k], initial[k]) for k in initial)
    train_in_process(module, *flags, "--out", tmp_path / "plain")  # the precondition: without the flag it trains
    plain = load_file(str(tmp_path / "plain" / "final" / "model.safetensors"))
    assert any(not torch.equal(plain[k], initial[k]) for k in initial)
