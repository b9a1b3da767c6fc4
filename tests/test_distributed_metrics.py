"""The logged update statistics of 2 gloo ranks with unequal token counts against one process (docs/metrics.md)."""

from __future__ import annotations

import math
import types

import pytest
import torch
from helpers import LOGGED_TOL, logit_scale, logprob_tol, needs_torchrun, sum_gamma, unit_roundoff
from test_distributed import WORLD
from test_distributed_flags import OFF_POLICY_CASES, OFFSET, first_row
from test_distributed_flags import run as flags_run

import common

pytestmark = pytest.mark.slow

KEYS = ("clip_frac", "ratio_outside_grpo_clip", "ratio_mean", "ratio_max_dev", "ratio_std", "log_ratio_std")


def run(tmp_path, nproc):
    """grpo.py's one update on test_distributed_flags' fixed rollout, pi_old offset by OFFSET: the clipped update's
    run there (made once): (its first metrics row, its record directory: each rank's tokens and rollout)."""
    record = flags_run(tmp_path, *OFF_POLICY_CASES["grpo-token-mean"], nproc, offset=OFFSET)
    return first_row(record), record


@needs_torchrun
def test_two_ranks_with_unequal_tokens_log_the_update_statistics_of_one_process(tmp_path, tiny_path):
    from transformers import AutoModelForCausalLM

    (one, single), (two, ddp) = run(tmp_path, 0), run(tmp_path, WORLD)
    ranks = [torch.load(ddp / f"tokens-rank{k}.pt")[0] for k in range(WORLD)]
    rollout = torch.load(single / "rollout-rank0.pt")
    n = int(rollout["completion_mask"].sum())
    assert ranks[0] != ranks[1] and sum(ranks) == n, (ranks, n)
    assert one["clip_frac"] > 0 and one["ratio_std"] > 0.05, one  # the offsets moved the ratios: not vacuous
    # Each token's log-ratio differs between the runs by at most the two forwards' difference, logprob_tol
    # (the offsets are the same numbers, added to each run's own log-probs: that difference twice)
    model = AutoModelForCausalLM.from_pretrained(tiny_path, torch_dtype=torch.float32)
    lp = 2 * logprob_tol(model.config, *logit_scale(model, types.SimpleNamespace(**rollout)))
    largest = math.exp(OFFSET + lp)  # the largest ratio
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


# rank 0's prompts (the first and third of the stream at --seed 0) each give their first completion 1, every other
# completion 0: rank 1's two groups are constant, so its one update forwards a stand-in row
RANK_0_ONLY = """
SIGNAL = {signal!r}
def rank_0_only(prompts, completions, **kw):
    seen, out = set(), []
    for p in prompts:
        out.append(float(p in SIGNAL and p not in seen))
        seen.add(p)
    return out
"""


@needs_torchrun
@pytest.mark.parametrize("case", ["grpo-token-mean", "gspo-sequence"])
def test_a_rank_without_signal_logs_the_update_statistics_of_one_process(tmp_path, case):
    """Issue 65: rank 1 holds no row of signal, so its update forwards one stand-in row (advantage 0) to keep DDP's
    ranks in step. One process holds both ranks' rows in one update and no stand-in; the stand-in enters no logged
    number, so the 2 ranks' ratio and clip statistics are one process's (it used to add its ratio to them)."""
    examples = common.PromptStream(common.arith_split()[0], 0).next(4)
    (tmp_path / "rank0.py").write_text(RANK_0_ONLY.format(signal={ex["prompt"] for ex in examples[0::2]}))
    reward = f"{tmp_path / 'rank0.py'}:rank_0_only"
    algo, flags = OFF_POLICY_CASES[case]
    one = first_row(flags_run(tmp_path, algo, flags, 0, offset=OFFSET, name="-rank0-only", reward=reward))
    two = first_row(flags_run(tmp_path, algo, flags, WORLD, offset=OFFSET, name="-rank0-only", reward=reward))
    assert one["zero_std_frac"] == two["zero_std_frac"] == 0.5, (one, two)  # rank 1's two groups of the four
    assert one["ratio_std"] > 0.01, one  # the offsets moved the ratios: a stand-in's would move the statistics
    # the same tokens' log-ratios, from forwards of other batch shapes (within ~1e-6 here), rounded to 6 decimals
    for key in ("clip_frac_seqs" if algo == "gspo" else "clip_frac", *KEYS[1:]):
        assert two[key] == pytest.approx(one[key], abs=1e-5), (key, one[key], two[key])
