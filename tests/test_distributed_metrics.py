"""The logged update statistics of 2 gloo ranks with unequal token counts against one process on the same rollout
(slow tier, torchrun; docs/metrics.md, "How the updates' statistics are pooled"). The rollout is
test_distributed_flags' fixed one (every third row of a prompt cut, so the ranks hold unequal numbers of tokens),
and its pi_old is the sampler's log-prob (--old-logp rollout) set to the model's own plus a fixed offset per token,
so that the one update, at the starting weights in both runs, has ratios away from 1 and clips: its ratio and
clip statistics are then functions of the rollout and the starting weights alone, which both runs share, up to
the forward's rounding (logprob_tol). A mean over ranks of each rank's mean (before issue 53) differs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import types

import pytest
import torch
from helpers import LOGGED_TOL, logit_scale, logprob_tol, needs_torchrun, sum_gamma, torchrun_cmd, unit_roundoff
from test_distributed import FIXED_ROLLOUT_RUN, ROOT, WORLD, _free_port
from test_distributed_flags import CUT, ENDS, MAX_NEW_TOKENS, OFF_POLICY_PI_OLD, OFFSET, RETURN
from test_real_checkpoints import graded_reward

pytestmark = pytest.mark.slow

# each rank's tokens and rollout written down, after test_distributed_flags' off-policy pi_old (the model's own
# log-probs offset)
SAVE = """        torch.save(dict(tokens=int(roll.completion_mask.sum()), prompt_ids=roll.prompt_ids,
                        prompt_mask=roll.prompt_mask, completion_ids=roll.completion_ids,
                        completion_mask=roll.completion_mask), os.path.join(OUT, f"rollout-rank{{RANK}}.pt"))
        return roll
"""
RECORD = OFF_POLICY_PI_OLD + SAVE
KEYS = ("clip_frac", "ratio_outside_grpo_clip", "ratio_mean", "ratio_max_dev", "ratio_std", "log_ratio_std")


def run(tmp_path, nproc):
    """grpo.py's train() for one step of one update on the fixed rollout; nproc 0: one plain process. Returns
    (its first metrics row, the record directory)."""
    script = tmp_path / "fixed_offset_rollout_run.py"
    script.write_text(FIXED_ROLLOUT_RUN.replace(ENDS, CUT).replace(RETURN, RECORD.replace("{offset}", str(OFFSET)))
                      .format(root=str(ROOT)))  # fmt: skip
    record, out = tmp_path / f"record-{nproc}", tmp_path / f"out-{nproc}"
    record.mkdir()
    launcher = [*torchrun_cmd(), "--nproc_per_node", str(nproc), "--master_port", str(_free_port())] if nproc else []
    cmd = [*(launcher or [sys.executable]), str(script), "grpo", "--device", "cpu", "--steps", "1",
           "--prompts-per-step", "4", "--group-size", "4", "--minibatches", "1", "--epochs", "1", "--max-new-tokens",
           str(MAX_NEW_TOKENS), "--old-logp", "rollout", "--mask-truncated", "--eval-size", "1", "--eval-every", "0",
           "--reward", graded_reward(tmp_path), "--out", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RLREF_THREADS": "1", "RECORD_DIR": str(record)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[0]), record


@needs_torchrun
def test_two_ranks_with_unequal_tokens_log_the_update_statistics_of_one_process(tmp_path, tiny_path):
    from transformers import AutoModelForCausalLM

    (one, single), (two, ddp) = run(tmp_path, 0), run(tmp_path, WORLD)
    ranks = [torch.load(ddp / f"rollout-rank{k}.pt")["tokens"] for k in range(WORLD)]
    rollout = torch.load(single / "rollout-rank0.pt")
    assert ranks[0] != ranks[1] and sum(ranks) == rollout["tokens"], (ranks, rollout["tokens"])
    assert one["clip_frac"] > 0 and one["ratio_std"] > 0.05, one  # the offsets moved the ratios: not vacuous
    # Each token's log-ratio differs between the runs by at most the two forwards' difference, logprob_tol
    # (the offsets are the same numbers, added to each run's own log-probs: that difference twice)
    model = AutoModelForCausalLM.from_pretrained(tiny_path, torch_dtype=torch.float32)
    lp = 2 * logprob_tol(model.config, *logit_scale(model, types.SimpleNamespace(**rollout)))
    n, largest = rollout["tokens"], math.exp(OFFSET + lp)  # tokens; the largest ratio
    ratio_moves = largest * math.expm1(lp)  # a ratio's largest difference between the runs
    # float32 token means in the loss (sum_gamma of n terms, each run), pooled in float64
    mean_rounding = 2 * sum_gamma(n) * largest + 4 * unit_roundoff(torch.float32)
    tol = {
        "ratio_mean": ratio_moves + mean_rounding,
        "ratio_max_dev": ratio_moves + 4 * unit_roundoff(torch.float32) * largest,
        # a population std moves by at most the largest move of its items; the loss's float32 std (a mean of squared
        # deviations, rounded like a mean, through sqrt: divided by 2 std) and the pooling's difference of sums
        "ratio_std": ratio_moves + (mean_rounding * largest + 8 * sum_gamma(n) * largest**2) / one["ratio_std"],
        "log_ratio_std": lp + 16 * sum_gamma(n, torch.float64) * (OFFSET + lp) ** 2 / one["log_ratio_std"],
        # counts: equal unless a ratio lies within ratio_moves of a boundary; then the float32 share's rounding
        "clip_frac": 4 * unit_roundoff(torch.float32),
        "ratio_outside_grpo_clip": 4 * unit_roundoff(torch.float32),
    }
    for key in KEYS:  # and metrics.jsonl's rounding to 6 decimals, each run's
        assert abs(two[key] - one[key]) <= tol[key] + LOGGED_TOL, (key, two[key], one[key], tol[key])
