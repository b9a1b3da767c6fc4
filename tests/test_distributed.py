"""Data parallel on CPU with gloo (2 torchrun ranks), and the recorder that runs train() for the torchrun checks."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, Path(__file__).parent):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from helpers import (  # noqa: E402
    SCRIPTS,
    needs_torchrun,
    torchrun_cmd,
)
from test_real_checkpoints import GSM8K, assert_trained, build_tiny_qwen2, graded_reward  # noqa: E402

import common  # noqa: E402
import grpo  # noqa: E402
import gspo  # noqa: E402
import ppo  # noqa: E402
from common import masked_mean  # noqa: E402

pytestmark = pytest.mark.slow  # subprocess or torchrun runs: the quick tier (-m "not slow") leaves them out

WORLD = 2
ENTROPY_COEF = 0.5  # loss_for's "+entropy" cases


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fixed_batch(tok, B=8, T=6, seed=0):
    """A rollout with completions of different lengths (so token counts differ between ranks),
    pi_old log-probs off from the current policy's, advantages and scores."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 90, (int(n),), generator=g).tolist() for n in torch.randint(2, 6, (B,), generator=g)]
    lengths = [1, 6, 2, 5, 6, 1, 3, 6]  # rank 0 takes rows 0, 2, 4, 6 (12 tokens), rank 1 the rest (18)
    completions = [torch.randint(3, 90, (n,), generator=g).tolist() for n in lengths]
    roll = common.Rollout.from_lists(prompts, completions, tok.pad_token_id)
    return {
        "roll": roll,
        "old_shift": 0.3 * torch.randn(B, T, generator=g),
        "adv": torch.randn(B, generator=g),
        "token_adv": torch.randn(B, T, generator=g),
    }


def loss_for(case, train_model, batch, rows):
    """The loss of `rows` of the batch as the scripts' update computes it (with their torchrun delta), `case` one of
    grpo-token-mean, grpo-seq-mean-token-mean, gspo, ppo, each with an optional "+entropy": a hand copy of their
    lines, for test_fsdp's bf16 gathering, which no script reaches on a CPU. No test checks train() with it: the
    tests of a script's own update on 2 ranks against one process run the script (here at its defaults;
    tests/test_distributed_flags.py with other flags, --entropy-coef, --lora-rank, --fsdp)."""
    roll, mask = batch["roll"][rows], batch["roll"].completion_mask[rows]
    case, bonus = case.removesuffix("+entropy"), case.endswith("+entropy")
    c = ENTROPY_COEF if bonus else 0.0
    logp, entropy = train_model(roll, 1.0, entropy_grad=bonus)
    old = (logp.detach() + batch["old_shift"][rows]) * mask
    if case.startswith("grpo"):
        agg = case[len("grpo-") :]
        denominator = common.mean_denominator(mask.sum()) if agg == "token-mean" else mask.shape[0]
        loss = grpo.grpo_loss(logp, old, batch["adv"][rows], mask, agg=agg, denominator=denominator)[0]
        return loss - c * grpo.aggregate(entropy, mask, agg, None, denominator)
    if case == "gspo":
        loss = gspo.gspo_loss(logp, old, batch["adv"][rows], mask, eps_low=0.05, eps_high=0.05)[0]
        return loss - c * masked_mean(entropy, mask, dim=1).sum() / mask.shape[0]
    adv = ppo.whiten(batch["token_adv"][rows], mask)  # whitened over all ranks' tokens
    loss = ppo.ppo_policy_loss(logp, old, adv, mask)[0] - c * masked_mean(entropy, mask)
    return loss * mask.sum().clamp(min=1) / common.mean_denominator(mask.sum())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_tiny_qwen2(tmp_path_factory.mktemp("qwen2") / "model"))


@needs_torchrun
@pytest.mark.parametrize("algo", SCRIPTS)
def test_torchrun_two_processes_complete(model_dir, tmp_path, algo):
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in GSM8K))
    out = tmp_path / algo
    cmd = [
        *torchrun_cmd(),
        "--nproc_per_node",
        str(WORLD),
        "--master_port",
        str(_free_port()),
        str(ROOT / f"{algo}.py"),
        "--model",
        model_dir,
        "--data",
        str(data),
        "--steps",
        "2",
        "--prompts-per-step",
        "4",
        "--group-size",
        "2",
        "--minibatches",
        "2",
        "--max-new-tokens",
        "8",
        "--eval-size",
        "1",
        "--device",
        "cpu",
        "--save-every",
        "2",
        "--reward",
        "exact",
        graded_reward(tmp_path),
        "--out",
        str(out),
    ]
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
    cmd = [*torchrun_cmd(), "--nproc_per_node", str(WORLD), "--master_port", str(_free_port()), str(ROOT / "gspo.py"),
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
    # torchrun's summary of the failed ranks: each of them exited with status 2, none was killed by a
    # signal. torchrun sends SIGTERM to the ranks still running once one has failed, and a rank that
    # tore down with gloo's threads still alive could abort (SIGABRT): main() must end every rank
    # with its own status.
    assert proc.stderr.count("exitcode  : 2") == WORLD, proc.stderr[-3000:]
    assert "SIGABRT" not in proc.stderr and "(SIGTERM)" not in proc.stderr, proc.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# A script's own train() under torchrun against one process, on the same rollout (issue 48)
# ---------------------------------------------------------------------------------------------

# Runs `<algo>.py`'s own train() through common.main, changing two things from outside: the Sampler returns
# completions fixed by each prompt (so 2 ranks and 1 process train on the same rollout, whatever the ranks'
# sampling streams), and every AdamW saves the gradients it is stepped with, and the weights before and after
# (under --fsdp gathered whole on every rank).
FIXED_ROLLOUT_RUN = """
import importlib, os, sys, zlib
import torch
sys.path.insert(0, {root!r})
import common

algo = importlib.import_module(sys.argv[1])
OUT, RANK = os.environ["RECORD_DIR"], int(os.environ.get("RANK", "0"))


class FixedSampler(common.Sampler):
    def sample(self, prompts, generator):
        completions, seen = [], {{}}
        for p in prompts:  # G rows per prompt; the k-th of a prompt's rows gets the k-th fixed completion
            k = seen[tuple(p)] = seen.get(tuple(p), -1) + 1
            g = torch.Generator().manual_seed(zlib.crc32(repr(p).encode()) * 64 + k % self.args.group_size)
            n = int(torch.randint(1, self.args.max_new_tokens, (1,), generator=g))
            completions.append(torch.randint(2, 97, (n,), generator=g).tolist() + [self.eos_ids[0]])
        roll = common.Rollout.from_lists(prompts, completions, self.pad_id)
        with torch.no_grad():  # the sampling distribution's entropy, which sample() records (--fsdp: via its root)
            roll.entropy = common.completion_logprobs(self.model, roll, self.args.temperature)[1]
        roll.seconds, roll.sampled_tokens = 1.0, int(roll.completion_mask.sum())  # what tokens_per_s reads
        return roll


def whole(t):  # --fsdp: a parameter or gradient is this rank's shard of a DTensor; every rank gathers it whole
    if t is None:  # (--lora-rank: a frozen weight has no gradient)
        return None
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t.clone()


class RecordingAdamW(torch.optim.AdamW):
    made = 0

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.id, self.steps = RecordingAdamW.made, 0
        RecordingAdamW.made += 1

    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"]]
        record = dict(grads=[whole(p.grad) for p in params], before=[whole(p) for p in params],
                      sharded=any(hasattr(p, "full_tensor") for p in params))
        out = super().step(closure)
        record["after"] = [whole(p) for p in params]
        torch.save(record, os.path.join(OUT, f"opt{{self.id}}-step{{self.steps}}-rank{{RANK}}.pt"))
        self.steps += 1
        return out


common.Sampler = FixedSampler
torch.optim.AdamW = RecordingAdamW
common.main(algo.train, algo.Args, argv=sys.argv[2:])
"""


# ---------------------------------------------------------------------------------------------
# Per-rank state in checkpoints (issue 52): a fork's carried batch resumes exactly on every rank
# ---------------------------------------------------------------------------------------------


@needs_torchrun
def test_a_forks_per_rank_carried_batch_resumes_bit_for_bit_on_two_ranks(tmp_path):
    """The one-step off-policy fork of grpo.py (tests/test_forks.py) carries, on each rank, the batch that rank
    sampled, a list of Rollouts and tensors passed to Run as state. On 2 gloo ranks, 3 steps then --resume to 6
    against 6 straight: the same metrics rows and the same final weights, bit for bit. (Before issue 52 trainer.pt
    kept rank 0's batch and loaded it on every rank.)"""
    from test_forks import OFF_POLICY, one_step_off_policy

    fork = tmp_path / f"{OFF_POLICY}.py"
    fork.write_text(one_step_off_policy((ROOT / "grpo.py").read_text()))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RLREF_THREADS": "1", "PYTHONPATH": str(ROOT)}
    flags = ["--device", "cpu", "--prompts-per-step", "4", "--group-size", "2", "--max-new-tokens", "4",
             "--eval-size", "2", "--eval-every", "0", "--no-anneal-lr"]  # fmt: skip

    def torchrun(*args):
        cmd = [*torchrun_cmd(), "--nproc_per_node", str(WORLD), "--master_port", str(_free_port()), str(fork), *args]
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
