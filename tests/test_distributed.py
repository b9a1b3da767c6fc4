"""Data parallel on CPU with gloo (2 torchrun ranks), and the recorder that runs train() for the torchrun checks."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers import ROOT, free_port, needs_torchrun, torchrun_cmd
from test_real_checkpoints import GSM8K, assert_trained, build_tiny_qwen2, graded_reward

pytestmark = pytest.mark.slow  # subprocess or torchrun runs: the quick tier (-m "not slow") leaves them out

WORLD = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_tiny_qwen2(tmp_path_factory.mktemp("qwen2") / "model"))


@needs_torchrun
def test_torchrun_two_processes_complete(model_dir, tmp_path, algo="ppo"):
    """ppo.py (a critic besides the policy) on 2 ranks, on a Qwen2 and a data file: rank 0 alone writes, and it trains.
    Each script's own update on 2 ranks against one process: tests/test_distributed_flags.py."""
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in GSM8K))
    out = tmp_path / algo
    cmd = [*torchrun_cmd(), "--nproc_per_node", str(WORLD), "--master_port", str(free_port()), str(ROOT / f"{algo}.py"),
           "--model", model_dir, "--data", str(data), "--steps", "2", "--prompts-per-step", "4", "--group-size", "2",
           "--minibatches", "2", "--max-new-tokens", "8", "--eval-size", "1", "--device", "cpu", "--save-every", "2",
           "--reward", "exact", graded_reward(tmp_path), "--out", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]  # one writer: rank 0
    assert (out / "final" / "config.json").is_file() and (out / "checkpoint" / "meta.json").is_file()
    assert "eval_accuracy_after" in json.loads((out / "summary.json").read_text())
    assert_trained(out, Path(model_dir), rows)


RANK_ONE_FAILS = """
import os

def rank_one_fails(prompts, completions, **kwargs):
    if os.environ["RANK"] == "1" and len(completions) == 4:  # a training batch (2 prompts x 2) on rank 1 only
        raise RuntimeError("lookup table missing on this node")
    return [float(i % 2) for i in range(len(completions))]
"""


@needs_torchrun
def test_a_reward_failing_on_one_rank_stops_every_rank(tmp_path):
    """Rank 1's reward raises in step 1; rank 0's did not and would wait in its next all-reduce
    forever: both must stop with exit status 2 (the reward call is a collective check)."""
    reward = tmp_path / "rank_reward.py"
    reward.write_text(RANK_ONE_FAILS)
    cmd = [*torchrun_cmd(), "--nproc_per_node", str(WORLD), "--master_port", str(free_port()), str(ROOT / "gspo.py"),
           "--reward", f"{reward}:rank_one_fails", "--steps", "2", "--prompts-per-step", "4", "--group-size", "2",
           "--minibatches", "2", "--max-new-tokens", "4", "--eval-size", "2", "--device", "cpu",
           "--out", str(tmp_path / "run")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RLREF_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)
    assert proc.returncode != 0
    # each rank's message once (the two ranks share stderr, so their order is not fixed)
    for message in (
        "error: --reward rank_one_fails raised RuntimeError: lookup table missing on this node on a batch of 4 "
        "(no single row raises alone)\n",
        "error: stopped because rank 1 failed (its error is above)\n",
    ):
        assert proc.stderr.count(message) == 1, proc.stderr[-3000:]
    # torchrun's summary: every rank exited with status 2, none killed by a signal (SIGTERM's teardown could abort)
    assert proc.stderr.count("exitcode  : 2") == WORLD, proc.stderr[-3000:]
    assert "SIGABRT" not in proc.stderr and "(SIGTERM)" not in proc.stderr, proc.stderr[-3000:]


# --- Per-rank state in checkpoints (issue 52): a fork's carried batch resumes exactly on every rank ---


@needs_torchrun
def test_a_forks_per_rank_carried_batch_resumes_bit_for_bit_on_two_ranks(tmp_path):
    """test_forks' off-policy fork on 2 ranks, 3 steps then --resume to 6, equals 6 straight bit for bit (issue 52)."""
    from test_forks import OFF_POLICY, one_step_off_policy

    fork = tmp_path / f"{OFF_POLICY}.py"
    fork.write_text(one_step_off_policy((ROOT / "grpo.py").read_text()))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RLREF_THREADS": "1", "PYTHONPATH": str(ROOT)}
    flags = ["--device", "cpu", "--prompts-per-step", "4", "--group-size", "2", "--max-new-tokens", "4",
             "--eval-size", "2", "--eval-every", "0", "--no-anneal-lr"]  # fmt: skip

    def torchrun(*args):
        cmd = [*torchrun_cmd(), "--nproc_per_node", str(WORLD), "--master_port", str(free_port()), str(fork), *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]

    torchrun(*flags, "--steps", "6", "--out", str(tmp_path / "straight"))
    torchrun(*flags, "--steps", "3", "--save-every", "3", "--out", str(tmp_path / "resumed"))
    assert (tmp_path / "resumed" / "checkpoint" / "rank1.pt").is_file()
    torchrun("--resume", str(tmp_path / "resumed"), "--steps", "6")

    def rows(out):
        lines = (out / "metrics.jsonl").read_text().splitlines()
        # (timings aside, and the evaluation that ends the 3-step run: --eval-every 0 evaluates only the last step)
        return [{k: v for k, v in json.loads(line).items() if not (k.endswith("_s") or k.startswith("eval_"))}
                for line in lines]  # fmt: skip

    straight, resumed = rows(tmp_path / "straight"), rows(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6] and resumed == straight
    final = [
        (out / "final" / "model.safetensors").read_bytes() for out in (tmp_path / "straight", tmp_path / "resumed")
    ]
    assert final[0] == final[1], "final weights differ: some rank resumed another rank's carried batch"
