"""Each --loss-agg of grpo.py through its own train(), with --mask-truncated on and off: the gradient stepped with
equals the closed form, in float64 from a plain loop (on-policy: g = -sum_i sum_t w_it A_i grad log pi(y_it)):

    seq-mean-token-mean      w_it = m_it / (B n_i)      n_i = sum_t m_it, the row's tokens in the loss
    token-mean               w_it = m_it / sum_jt m_jt  the batch's tokens in the loss
    seq-mean-token-sum-norm  w_it = m_it / (B Tmax)     Tmax = --max-new-tokens, not the padded width

m is the completion mask, less the rows cut at --max-new-tokens under --mask-truncated (they stay in B)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_within, forward_roundings, logit_scale, logprob_tol, probable_gamma

import common
import grpo

MAX_NEW_TOKENS = 6
# 3 prompts x 2 completions; each row: (its length, whether it ends with EOS). "short": every row ends, the
# longest after 4 tokens, so the padded width 4 is below --max-new-tokens 6; "cut": rows 1 and 4 reach 6 tokens
# without an EOS (truncated), the others end earlier, one after a single token
ROWS = {
    "short": [(1, True), (4, True), (2, True), (3, True), (4, True), (2, True)],
    "cut": [(3, True), (6, False), (1, True), (5, True), (6, False), (2, True)],
}
REWARDS = [0.0, 1.0, 0.7, 0.2, 0.4, 0.9]  # every group's rewards differ: every row trains
REWARD_FILE = f"""
def fixed(prompts, completions, **kwargs):
    return {REWARDS!r}[: len(completions)]  # (evaluation asks for one)
"""


def fixed_rollout(sampler, prompts, shape, generator):
    """The sampler's own rollout of `prompts` (for its timing fields), its completions replaced by rows of the
    lengths `shape` gives: token ids drawn from `generator` among non-EOS ids, an EOS last where the row ends."""
    eos = sampler.eos_ids[0]
    allowed = [t for t in range(3, 90) if t not in sampler.eos_ids and t != sampler.pad_id]
    completions = []
    for n, ends in shape:
        ids = [allowed[int(k)] for k in torch.randint(len(allowed), (n,), generator=generator)]
        completions.append(ids[:-1] + [eos] if ends else ids)
    return common.Rollout.from_lists(prompts, completions, sampler.pad_id)


def reference_gradient(roll, advantages, loss_mask, agg):
    """The closed form's gradient, float64: each token's weight from a plain loop, times -A_i, times the float64
    gradient of that token's log-prob under the starting weights."""
    model, _ = common.load_model(common.tiny_checkpoint(), torch.device("cpu"))
    model = model.double()
    logp = common.completion_logprobs(model, roll, 1.0)[0]  # [B, T] float64
    m = loss_mask.tolist()
    B, n_tokens = len(m), sum(map(sum, m))
    total = 0.0
    for i, row in enumerate(m):
        n_i = sum(row)
        for t, on in enumerate(row):
            if not on:
                continue
            if agg == "seq-mean-token-mean":
                w = 1.0 / (B * n_i)
            elif agg == "token-mean":
                w = 1.0 / n_tokens
            else:
                w = 1.0 / (B * MAX_NEW_TOKENS)
            total = total - w * advantages[i] * logp[i, t]
    total.backward()
    return [p.grad for p in model.parameters()], model.config


# the quick tier: every aggregation with --mask-truncated on rows some of which are cut, and the padded width below
# --max-new-tokens where it matters (sum-norm); the slow tier: the rest (about 1.5 s each on 2 busy cores)
QUICK = {("cut", agg, True) for agg in grpo.AGGREGATIONS} | {("short", "seq-mean-token-sum-norm", False)}
CASES = [
    pytest.param(*case, marks=[] if case in QUICK else [pytest.mark.slow])
    for case in [
        (s, agg, mt) for agg in grpo.AGGREGATIONS for s, mt in (("short", False), ("cut", False), ("cut", True))
    ]
]


@pytest.mark.parametrize(("shape", "agg", "mask_truncated"), CASES)
def test_each_aggregation_through_train_gives_the_closed_form_gradient(shape, agg, mask_truncated, tmp_path,
                                                                       monkeypatch):  # fmt: skip
    seen = {}
    sample = common.Sampler.sample

    def fixed_sample(self, prompts, generator):
        real = sample(self, prompts, generator)
        roll = fixed_rollout(self, prompts, ROWS[shape], torch.Generator().manual_seed(0))
        roll.entropy = torch.zeros(roll.completion_mask.shape)
        roll.seconds, roll.sampled_tokens, roll.draws = real.seconds, real.sampled_tokens, real.draws
        seen["roll"], seen["eos"], seen["prompts"] = roll, self.eos_ids, prompts
        return roll

    class RecordingAdamW(torch.optim.AdamW):
        def step(self, closure=None):
            seen["grads"] = [p.grad.detach().clone() for group in self.param_groups for p in group["params"]]
            return super().step(closure)

    monkeypatch.setattr(common.Sampler, "sample", fixed_sample)
    monkeypatch.setattr(torch.optim, "AdamW", RecordingAdamW)
    reward = tmp_path / "fixed.py"
    reward.write_text(REWARD_FILE)
    # one minibatch, one epoch: the one update is on-policy; no gradient clipping, which would rescale a gradient
    # wrongly normalised back to the same norm
    argv = ["--steps", "1", "--prompts-per-step", "3", "--group-size", "2", "--minibatches", "1", "--epochs", "1",
            "--max-new-tokens", str(MAX_NEW_TOKENS), "--max-grad-norm", "1e30", "--eval-size", "1", "--eval-every",
            "0", "--loss-agg", agg, "--reward", f"{reward}:fixed", "--out", str(tmp_path / "out")]  # fmt: skip
    common.main(grpo.train, grpo.Args, argv=argv + (["--mask-truncated"] if mask_truncated else []))

    # the groups that group_advantages takes, consecutive blocks of --group-size rows, are each one prompt's
    # completions (a layout that interleaved the groups would give each advantage another prompt's baseline)
    prompts = seen["prompts"]
    assert [prompts[i - i % 2] for i in range(len(prompts))] == prompts and prompts[0] != prompts[2] != prompts[4]
    roll = seen["roll"]
    T = roll.completion_mask.shape[1]
    assert T == (4 if shape == "short" else MAX_NEW_TOKENS)  # the case is what it is named for
    ends = common.completion_ends(roll, seen["eos"])
    assert ends.tolist() == [e for _, e in ROWS[shape]]
    loss_mask = roll.completion_mask * (ends[:, None] if mask_truncated else 1)
    advantages = grpo.group_advantages(torch.tensor(REWARDS), 2).double().tolist()
    expected, config = reference_gradient(roll, advantages, loss_mask, agg)
    assert len(expected) == len(seen["grads"])
    # the float32 gradient against the float64 one: one forward and backward's sums (helpers.forward_roundings, over
    # the B x L positions a weight collects) to probable_gamma of the largest element, as test_pi_old; and
    # the ratio, 1 to pi_old's forward against the update's (logprob_tol) on every token
    L = roll.prompt_ids.shape[1] + T
    n = forward_roundings(config, L) + len(REWARDS) * L + 1
    model, _ = common.load_model(common.tiny_checkpoint(), torch.device("cpu"))
    relative = 2 * probable_gamma(n) + math.expm1(logprob_tol(config, *logit_scale(model, roll)))
    for i, (got, want) in enumerate(zip(seen["grads"], expected)):
        assert_within(got, want, relative * want.abs().max().item(), f"{agg}, {shape}, gradient {i}")
    assert any(g.abs().max() > 0 for g in expected)
