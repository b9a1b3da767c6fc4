"""The collapse warnings (issue 42): the rules on hand-worked sequences, common.watch, a clipless fork warned."""

from __future__ import annotations

import importlib
import io
import json
import random
import re
import sys
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from helpers import SCRIPTS, main_in_process

import common

WINDOW, SHARE = common.FLAT_WINDOW, common.FLAT_SHARE


def first_warning(before, accuracies):
    """The index of the evaluation at which accuracy_collapsed first holds, fed one evaluation at a time."""
    return next((i for i in range(len(accuracies)) if common.accuracy_collapsed(before, accuracies[: i + 1])), None)


# --- the rules ---


@pytest.mark.parametrize(
    "before, accuracies, expected",
    [
        (0.3, [0.2], None),  # one evaluation is not two in a row
        (0.3, [0.2, 0.2], 1),  # exactly 0.1 below, twice: 0.3 - 0.2 is 0.0999... in floats, still a drop of 0.1
        (0.3, [0.2, 0.2 + 1e-6], None),  # (so accuracy_collapsed allows 1e-9, no more)
        (0.3, [0.21, 0.2], None),  # 0.09 below, then 0.1: not two
        (0.3, [0.21, 0.2, 0.19], 2),
        (0.3, [0.1, 0.3, 0.1, 0.25, 0.05], None),  # drops at 0, 2 and 4, never consecutive
        (0.3, [0.1, 0.3, 0.1, 0.15], 3),
        (0.222, [0.234, 0.1, 0.046, 0.0], 2),  # the fork, roughly
        (0.05, [0.0, 0.0, 0.0], None),  # a start below 0.1 cannot fall 0.1
        (0.5, [0.6, 0.7, 0.8], None),  # learning
    ],
)
def test_accuracy_collapsed_on_hand_worked_sequences(before, accuracies, expected):
    assert first_warning(before, accuracies) == expected


@pytest.mark.parametrize(
    "flat, expected",
    [
        ([1.0] * (WINDOW - 1), False),  # not a whole window yet
        ([1.0] * WINDOW, True),
        ([1.0] * 45 + [0.0] * 5, False),  # exactly 90%: not past it
        ([1.0] * 46 + [0.0] * 4, True),
        ([0.0] * 10 + [1.0] * WINDOW, True),  # only the last 50 steps count
        ([1.0] * WINDOW + [0.0] * 5, False),  # 45 of the last 50
        ([0.95] * WINDOW, True),  # shares, not counts: 95% of every step's groups
        ([1.0, 0.0] * WINDOW, False),  # scattered all-equal steps: half of them
        ([0.875] * WINDOW, False),  # 7 of 8 groups at every step
    ],
)
def test_mostly_flat_on_hand_worked_windows(flat, expected):
    assert common.mostly_flat(flat) == expected


def test_exactly_ninety_percent_of_shares_stays_below_whatever_the_order():
    """Steps whose shares average exactly 90% (25 at 0.8 and 25 at 1.0, or 0.6, 1, 1, 1, 0.9 ten times)
    are not past it, though some orders sum a little above it in floats."""
    orders = [[0.8] * 25 + [1.0] * 25]
    for seed in range(50):
        flat = [0.6, 1.0, 1.0, 1.0, 0.9] * 10
        random.Random(seed).shuffle(flat)
        orders.append(flat)
    assert sum(orders[0]) / WINDOW > SHARE  # the float trap is real
    assert sum(sum(flat) / WINDOW > SHARE for flat in orders) > 1
    assert not any(common.mostly_flat(flat) for flat in orders)


# --- through each script's train(): a solved task is no collapse (issue 65), a collapsing run still warns ---

# 4 prompts x 2 completions a step (8 rewards; the evaluation's batches hold 3): every completion scores 1, or the
# first 3 training batches (the reward's start-up check among them) hold one success and every later one none
REWARDS = """
calls = 0
def solved(prompts, completions, **kw):
    return [1.0] * len(completions)
def collapsing(prompts, completions, **kw):
    global calls
    calls += len(completions) == 8
    return [float(i == 0 and calls <= 3) for i in range(len(completions))]
"""


@pytest.mark.parametrize("name", SCRIPTS)
@pytest.mark.parametrize("reward", ["solved", "collapsing"])
def test_a_solved_task_gives_no_collapse_warning_and_a_collapsing_run_does(tmp_path, capsys, name, reward):
    """60 steps of every completion scoring the maximum: every group is constant at the batch's lowest reward (and
    PPO's every step has no signal), which used to count as flat, so the run warned "collapsing" at step 50; now a
    batch all at the highest reward the run has sampled is solved. A run whose groups all fail after it once
    succeeded still warns at step 50 (47 of the last 50 steps flat)."""
    module = importlib.import_module(name)
    (tmp_path / "rewards.py").write_text(REWARDS)
    argv = ["--reward", f"{tmp_path}/rewards.py:{reward}", "--steps", 60, "--prompts-per-step", 4, "--group-size", 2,
            "--minibatches", 1, "--max-new-tokens", 6, "--eval-every", 0, "--eval-size", 3, "--out", tmp_path / "out",
            *(["--kl-coef", 0, "--missing-eos-penalty", 0] if name == "ppo" else [])]  # fmt: skip
    status, _, err = main_in_process(module, argv, capsys)
    assert status == 0, err
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    if name != "ppo":  # what the warning reads: every group all at the batch's lowest reward, at every step
        flat = [r["zero_std_low_frac"] for r in rows]
        assert flat == [1.0] * 60 if reward == "solved" else flat[3:] == [1.0] * 57, flat
    if reward == "solved":
        assert summary["flat_groups"] is None and "collapsing" not in err, err
    else:
        assert summary["flat_groups"]["warned_at_step"] == 50, summary["flat_groups"]
        assert "the policy may be collapsing" in err


# --- common.watch, step by step ---


def watcher(before=0.3, needs_group=True, progress=None):
    """What common.watch reads (the run's Progress, its Setup), with the collapse warnings collected."""
    progress = progress or common.Progress(eval_before={"accuracy": before})
    return SimpleNamespace(progress=progress, env=SimpleNamespace(rank=0, needs_group=needs_group), warned=[])


def drive(run, steps, flat, evals):
    """Steps `steps` with each step's share of all-equal groups `flat(step)` and accuracy `evals.get(step)`."""
    said = lambda line, file: run.warned.append(line.removeprefix("warning: ").split(": the policy may")[0])  # noqa: E731
    with mock.patch.object(common.tqdm, "write", said):
        for step in steps:
            common.watch(run.env, run.progress, step, False, flat(step), evals.get(step))


def test_each_warning_comes_once_where_its_rule_holds():
    run = watcher(before=0.3)
    evals = {10: 0.25, 20: 0.15, 30: 0.3, 40: 0.2, 50: 0.1, 60: 0.0, 70: 0.0}  # drops at 20, 40, 50, 60, 70
    flat = lambda step: 1.0 if step % 10 else 0.0  # noqa: E731  (90% of every window of 50: never past it)
    drive(run, range(1, 71), flat, evals)
    assert len(run.warned) == 1 and "at 2 evaluations in a row (step 40 0.200, step 50 0.100)" in run.warned[0]
    drop = {"before": 0.3, "evals": [[40, 0.2], [50, 0.1]], "warned_at_step": 50}
    assert run.progress.warned["accuracy_drop"] == drop
    assert run.progress.warned.get("flat_groups") is None and len(run.progress.flat_window) == WINDOW
    drive(run, range(71, 80), lambda step: 1.0, {})  # up to steps 30-79: zeros at 30, 40, 50, 60, 70, 45 of 50
    assert run.progress.warned.get("flat_groups") is None
    drive(run, range(80, 81), lambda step: 1.0, {})  # steps 31-80: 46 of 50
    assert len(run.warned) == 2
    assert "92% of the groups of the last 50 steps had all-equal rewards, the batch's lowest" in run.warned[1]
    assert "(steps 31-80)" in run.warned[1]
    assert run.progress.warned.get("flat_groups") == {"share": 0.92, "from_step": 31, "warned_at_step": 80}
    drive(run, range(82, 200), lambda step: 1.0, {s: 0.0 for s in range(90, 200, 10)})
    assert len(run.warned) == 2  # once each per run


def test_ppo_counts_steps_without_signal():
    run = watcher(needs_group=False)
    drive(run, range(1, WINDOW + 1), lambda step: float(step > 3), {})  # 47 of 50 steps without signal
    assert run.warned == ["94% of the last 50 steps had no learning signal (steps 1-50)"]


def test_no_accuracy_no_accuracy_warning():
    """A reward without answers (--reward-model alone) has no held-out accuracy: nothing to compare."""
    run = watcher()
    run.progress.eval_before = {"reward": 0.3}
    drive(run, range(1, 31), lambda step: 0.0, {10: 0.0, 20: 0.0, 30: 0.0})
    assert run.warned == [] and run.progress.eval_accuracies == []


def test_the_watch_survives_a_checkpoint(tmp_path):
    """Progress' state dict, saved and loaded as save_checkpoint / load_checkpoint do (torch.save,
    weights_only=True), carries the window and the evaluations: a resumed run warns at the same steps."""
    evals = {10: 0.3, 20: 0.15, 30: 0.1}
    whole = watcher()
    drive(whole, range(1, 61), lambda step: 1.0, evals)
    first = watcher()
    drive(first, range(1, 26), lambda step: 1.0, evals)
    torch.save({"progress": first.progress.state_dict()}, tmp_path / "trainer.pt")
    resumed = watcher(progress=common.Progress())
    resumed.progress.load_state_dict(torch.load(tmp_path / "trainer.pt", weights_only=True)["progress"])
    drive(resumed, range(26, 61), lambda step: 1.0, evals)
    assert resumed.warned == whole.warned and len(whole.warned) == 2
    assert resumed.progress.warned == whole.progress.warned
    assert resumed.progress.warned["accuracy_drop"] == {
        "before": 0.3, "evals": [[20, 0.15], [30, 0.1]], "warned_at_step": 30}  # fmt: skip
    assert resumed.progress.warned["flat_groups"] == {
        "share": 1.0, "from_step": 1, "warned_at_step": 50}  # fmt: skip


@pytest.mark.parametrize("rank", [0, 1])
def test_the_warning_is_one_line_naming_the_causes_on_rank_0_only(monkeypatch, rank):
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    common.warn(SimpleNamespace(rank=rank), common.Progress(), "x", f"something fell: {common.COLLAPSE}")
    if rank:
        assert err.getvalue() == ""
        return
    line = err.getvalue()
    assert line.count("\n") == 1 and line.startswith("warning: something fell: the policy may be collapsing")
    for cause in ("--lr", "--minibatches", "--epochs", "clip", "reward"):
        assert cause in line


# --- a fork without a clip ---

FORK_RUN = ["--lr", "3e-3", "--no-anneal-lr", "--minibatches", "2", "--prompts-per-step", "8", "--group-size", "4",
            "--eval-size", "50", "--eval-every", "5", "--seed", "0"]  # fmt: skip


def without_clip_flags(source: str) -> str:
    """gspo.py's text as a fork that drops --eps-low / --eps-high would write it: no fields, no
    Args.check (which only checked them), fixed clip values passed to the loss."""
    edits = [
        # the two fields, each a line and its docstring's line
        (r"\n    eps_low: float = [^\n]*\n    \"\"\"[^\n]*\n    eps_high: float = [^\n]*\n    \"\"\"[^\n]*\n", "\n"),
        (r"\n    def check\(self\):\n(?:        [^\n]*\n)+", "\n"),  # the method, every line indented under it
        (r"eps_low=args\.eps_low,\s*eps_high=args\.eps_high,", "eps_low=3e-4, eps_high=4e-4,"),  # the loss's clip
    ]
    for pattern, new in edits:
        source, n = re.subn(pattern, new, source)
        assert n == 1, f"gspo.py no longer has the text the fork edits ({pattern!r} matched {n} times)"
    assert "eps_low" not in source.split("def gspo_loss")[0].split("class Args")[1], "a clip field is left"
    assert "args.eps_" not in source and "def check(self)" not in source
    return source


@pytest.fixture
def noclip(tmp_path, monkeypatch):
    """gspo.py forked to noclip.py with its clip removed: the clip flags gone and the loss given the
    range [0, inf], so the ratio of the second, off-policy minibatch is never clipped."""
    source = without_clip_flags((common.SHIPPED_CHECKPOINTS.parent / "gspo.py").read_text())
    head, sep, loop = source.partition("\ndef train(")  # the loss's defaults above keep their values
    loop, n = re.subn(r"eps_low=3e-4, eps_high=4e-4,", 'eps_low=1.0, eps_high=float("inf"),', loop)
    assert n == 1
    source = head + sep + loop
    (tmp_path / "noclip.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "noclip", raising=False)
    yield importlib.import_module("noclip")
    sys.modules.pop("noclip", None)


def run_fork(module, argv, capsys):
    status, _, err = main_in_process(module, argv, capsys)
    return status, err


def expected_warnings(rows, before):
    """The steps at which each rule holds first, computed from metrics.jsonl's rows, not from the run's own watch."""
    evals = [(r["step"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r]
    fell = lambda a: before - a >= 0.1 - 1e-9  # noqa: E731
    drop = next((s for (_, a), (s, b) in zip(evals, evals[1:]) if fell(a) and fell(b)), None)
    flat = [r["zero_std_low_frac"] for r in rows]
    window = next((i + 1 for i in range(WINDOW - 1, len(flat)) if sum(flat[i - WINDOW + 1 : i + 1]) > 45 + 1e-6), None)
    return drop, window


def warning_lines(err):
    return [line for line in err.splitlines() if "may be collapsing" in line]


@pytest.mark.slow
def test_a_fork_without_a_clip_collapses_and_is_warned(noclip, tmp_path, capsys):
    out = tmp_path / "out"
    status, err = run_fork(noclip, [*FORK_RUN, "--steps", "55", "--out", out], capsys)
    assert status == 0, err
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    before = summary["eval_accuracy_before"]
    assert before >= 0.1 and summary["eval_accuracy_after"] <= before - 0.1  # it did collapse
    assert "eps_low" not in summary["args"] and "eps_high" not in summary["args"]  # shared code reads no clip flag
    drop, window = expected_warnings(rows, before)
    assert drop is not None and window is not None
    assert summary["accuracy_drop"]["warned_at_step"] == drop
    assert summary["flat_groups"]["warned_at_step"] == window and summary["flat_groups"]["from_step"] == window - 49
    lines = warning_lines(err)
    assert len(lines) == 2, err
    assert "held-out accuracy fell 0.1 or more" in lines[0] and f"step {drop} " in lines[0]
    assert f"had all-equal rewards, the batch's lowest (steps {window - 49}-{window})" in lines[1]
