"""experiments/warm_starts.py: the grid, the gains and the targets on hand-made runs, and the
warm-start recipe built with another SFT seed."""

import json
import sys
from pathlib import Path

import pytest
import warm_starts as ws  # experiments/, on sys.path through conftest.py
from helpers import gamma


def test_verdict_takes_the_worst_gain_of_every_seed():
    def v(gain, t=100.0):
        return {"gain": gain, "train_s": t}

    cells = {0: [v(0.45), v(0.40), v(0.52)], 1: [v(0.31), v(0.35), v(0.30)], 2: [v(0.50), v(0.29, 301.0), v(0.6)]}
    out = ws.verdict(cells)
    assert out["worst_gain_shipped"] == 0.40 and out["meets_shipped"]  # 40 points exactly meets the target
    assert out["worst_gain_other"] == 0.29 and not out["meets_other"]  # one seed of one warm start fails it
    assert out["max_train_s"] == 301.0 and not out["within_budget"]
    cells[0][1] = v(0.399)
    assert not ws.verdict(cells)["meets_shipped"]


def fake_run(d: Path, algo: str, seed: int, before: float, after: float, step_times: list[float], mid=None,
             anneal_lr=False):  # fmt: skip
    """A finished run: eval at step 2 (`mid`, if given) and at the last step (`after`)."""
    d.mkdir(parents=True)
    summary = {"algo": algo, "seed": seed, "steps": len(step_times), "eval_accuracy_before": before,
               "eval_accuracy_after": after, "args": {"anneal_lr": anneal_lr}}  # fmt: skip
    (d / "summary.json").write_text(json.dumps(summary))
    rows = [{"step": i + 1, "step_time_s": t} for i, t in enumerate(step_times)]
    rows[-1]["eval_accuracy"] = after
    if mid is not None:
        rows[1]["eval_accuracy"] = mid
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_from_hand_made_runs(tmp_path, monkeypatch):
    befores = {0: 0.222, 1: 0.270}
    afters = {(0, 0): 0.700, (0, 1): 0.610, (1, 0): 0.500, (1, 1): 0.580}
    mids = {(0, 0): 0.500, (0, 1): 0.650, (1, 0): 0.300, (1, 1): 0.400}
    for (sft, seed), after in afters.items():
        d = ws.run_dir(tmp_path, "grpo", sft, seed)
        fake_run(d, "grpo", seed, befores[sft], after, [1.5, 2.5, 3.0], mids[(sft, seed)])
    env = {"OUT": str(tmp_path), "SCRIPTS": "grpo", "SFT_SEEDS": "0 1", "SEEDS": "0 1"}
    monkeypatch.setattr(sys, "argv", ["warm_starts.py"])
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert ws.main(["--report-only"]) == 0
    md = (tmp_path / "warmstart_results.md").read_text()
    # by hand: shipped gains 0.478 and 0.388 -> +39 to +48; SFT seed 1: 0.230 and 0.310 -> +23 to +31
    assert "| grpo | shipped (SFT seed 0) | 0.222 | 0.700 / 0.610 | +39 to +48 | 7-7 |" in md
    assert "| grpo | SFT seed 1 | 0.270 | 0.500 / 0.580 | +23 to +31 | 7-7 |" in md
    verdict = json.loads((tmp_path / "warmstart_results.json").read_text())["results"]["grpo"]["verdict"]
    # float64 differences and means of <= 4 of the rows' 3-decimal figures (each held to within u of its size,
    # <= 1): at most 8 roundings of sizes <= 1 each side
    DECIMALS = 2 * gamma(8)
    assert verdict["worst_gain_shipped"] == pytest.approx(0.388, abs=DECIMALS) and not verdict["meets_shipped"]
    assert verdict["worst_gain_other"] == pytest.approx(0.230, abs=DECIMALS) and verdict[
        "max_train_s"
    ] == pytest.approx(7.0, abs=DECIMALS * 7)
    # stopped at step 2 (4 s of training): shipped 0.500-0.222 and 0.650-0.222 -> worst 0.278;
    # SFT seed 1: 0.300-0.270 and 0.400-0.270 -> worst 0.030
    at2, at3 = json.loads((tmp_path / "warmstart_results.json").read_text())["results"]["grpo"]["by_length"]
    assert at2["steps"] == 2 and at2["worst_gain_shipped"] == pytest.approx(0.278, abs=DECIMALS)
    assert at2["worst_gain_other"] == pytest.approx(0.030, abs=DECIMALS) and at2["max_train_s"] == pytest.approx(
        4.0, abs=DECIMALS * 4
    )
    assert at3["worst_gain_shipped"] == pytest.approx(0.388, abs=DECIMALS) and at3["max_train_s"] == pytest.approx(
        7.0, abs=DECIMALS * 7
    )
    assert at2["mean_gain"] == pytest.approx((0.278 + 0.428 + 0.030 + 0.130) / 4, abs=DECIMALS)
    assert "| grpo | 2 | +28 | +3 | +22 | 4 |" in md  # stride 1: both lengths listed


def test_no_finished_run_is_an_error(tmp_path, monkeypatch, capsys):
    for k, v in {"OUT": str(tmp_path), "SCRIPTS": "gspo", "SFT_SEEDS": "0", "SEEDS": "0"}.items():
        monkeypatch.setenv(k, v)
    assert ws.main(["--report-only"]) == 1 and "no finished runs" in capsys.readouterr().err


def test_a_run_stopped_by_a_signal_is_not_finished(tmp_path):
    d = ws.run_dir(tmp_path, "grpo", 1, 0)
    fake_run(d, "grpo", 0, 0.2, 0.5, [1.0, 1.0])
    assert not ws.finished(tmp_path, "grpo", 1, 0)  # no "step" in the summary: not known to have finished
    summary = json.loads((d / "summary.json").read_text())
    (d / "summary.json").write_text(json.dumps({**summary, "step": 2, "interrupted": False}))
    assert ws.finished(tmp_path, "grpo", 1, 0)
    (d / "summary.json").write_text(json.dumps({**summary, "step": 1, "interrupted": True}))  # what SIGTERM leaves
    assert not ws.finished(tmp_path, "grpo", 1, 0)
