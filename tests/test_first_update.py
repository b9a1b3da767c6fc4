"""The quick tier's check of what makes each script PPO-like, on a tiny batch, in this process: pi_old is
taken once per rollout, before any update. The first update of a step is on-policy, so every token's
log-ratio log pi - log pi_old is 0 to rounding (ratio 1); the second minibatch's update comes after the
first has moved the weights, so its ratios are off 1 by more than rounding (a pi_old retaken before each
update would leave every ratio 1 and the clip idle). The log-ratios are computed here from what train() hands
its loss, not read from what the loss logs. Every script in tests/helpers.py's SCRIPTS; a fork names its loss
`<name>_loss` (README, "Fork it"), or `<name>_policy_loss` as PPO does."""

from __future__ import annotations

import importlib

import pytest
import torch
from helpers import SCRIPTS, assert_within, forward_roundings, logit_scale, logprob_tol, probable_gamma, traits
from test_real_checkpoints import graded_reward

import common

# 4 prompts x 4 completions (PPO: 16 prompts x 1), two minibatches, one epoch; a reward that varies within
# every group, so that no row is left out for a zero advantage and both minibatches update
TINY_BATCH = ["--steps", "1", "--minibatches", "2", "--epochs", "1", "--max-new-tokens", "6", "--eval-size", "1",
              "--eval-every", "0", "--no-anneal-lr"]  # fmt: skip
GROUPS = {"ppo": ["--prompts-per-step", "16", "--group-size", "1"]}
DEFAULT_GROUPS = ["--prompts-per-step", "4", "--group-size", "4"]


def loss_name(module, name: str) -> str:
    for candidate in (f"{name}_loss", f"{name}_policy_loss"):
        if callable(getattr(module, candidate, None)):
            return candidate
    raise AssertionError(f"{name}.py has neither {name}_loss nor {name}_policy_loss")


@pytest.mark.parametrize("name", SCRIPTS)
def test_pi_old_is_taken_before_any_update_and_the_first_update_has_ratio_one(name, tmp_path, monkeypatch):
    module = importlib.import_module(name)
    seen = {"rolls": [], "updates": []}
    sample = common.Sampler.sample

    def recording_sample(self, prompts, generator):
        roll = sample(self, prompts, generator)
        seen["rolls"].append((self.model, roll))
        return roll

    loss = getattr(module, loss_name(module, name))

    def recording_loss(logp, old_logp, advantages, mask, *args, **kwargs):
        if not seen["updates"]:  # before the first step: the weights pi_old was taken with
            model, roll = seen["rolls"][-1]
            seen["scale"] = logit_scale(model, roll, module.Args.temperature)
            seen["config"] = model.config
        real = mask.bool()
        seen["updates"].append((logp - old_logp).detach()[real].abs().max().item())
        return loss(logp, old_logp, advantages, mask, *args, **kwargs)

    monkeypatch.setattr(common.Sampler, "sample", recording_sample)
    monkeypatch.setattr(module, loss_name(module, name), recording_loss)
    argv = [*TINY_BATCH, *GROUPS.get(name, DEFAULT_GROUPS), "--reward", "exact", graded_reward(tmp_path)]
    common.main(module.train, module.Args, argv=[*argv, "--out", str(tmp_path / "out")])

    assert len(seen["updates"]) == 2, seen["updates"]  # both minibatches updated
    # pi_old's no-grad pass and the first update's training forward: two float32 forwards of the same rows
    # and weights, batched differently (helpers.logprob_tol)
    tol = logprob_tol(seen["config"], *seen["scale"])
    first, second = seen["updates"]
    assert first <= tol, f"first update: |log pi - log pi_old| reaches {first:.3g}, rounding allows {tol:.3g}"
    assert second > 100 * tol, f"second update: log-ratios within {second:.3g} of 0: was pi_old taken again?"


# A reward that depends on the row alone: 1 for the first row of every even group of 4, else 0, so that half the
# groups are constant (advantage exactly 0) whatever the model samples
ROW_REWARD = """
def rows(prompts, completions, **kwargs):
    return [float(i % 8 == 0) for i in range(len(completions))]
"""


@pytest.mark.parametrize("name", [s for s in SCRIPTS if traits(s).skips_zero_advantage])  # (at their defaults)
def test_leaving_out_zero_advantage_rows_leaves_the_gradient_unchanged(name, tmp_path, monkeypatch):
    """train() forwards only the rows whose advantage is not 0 (the slow tier's twin runs 2 steps from the
    command line). One update on the same rollout, once skipping half the rows and once with every advantage
    shifted by 1e-30 (none exactly 0, so none skipped; 1e-30 is lost next to a real advantage): the gradients
    the optimizer is stepped with agree to rounding, and the skipping run did forward fewer rows."""
    module = importlib.import_module(name)
    reward = tmp_path / "rows.py"
    reward.write_text(ROW_REWARD)
    grads, forwarded = {}, {}
    exact_advantages = module.group_advantages
    loss = getattr(module, loss_name(module, name))

    class RecordingAdamW(torch.optim.AdamW):
        def step(self, closure=None):
            grads[run] = [p.grad.detach().clone() for group in self.param_groups for p in group["params"]]
            return super().step(closure)

    def counting_loss(logp, *args, **kwargs):
        forwarded[run] = forwarded.get(run, 0) + logp.shape[0]
        return loss(logp, *args, **kwargs)

    monkeypatch.setattr(torch.optim, "AdamW", RecordingAdamW)
    monkeypatch.setattr(module, loss_name(module, name), counting_loss)
    # --max-grad-norm 1e30: no clipping, which would scale a wrongly normalised gradient back to the same norm
    argv = [*TINY_BATCH, "--minibatches", "1", "--max-grad-norm", "1e30", *DEFAULT_GROUPS, *traits(name).test_flags,
            "--reward", f"{reward}:rows"]  # fmt: skip
    for run in ("skip", "every"):
        if run == "every":
            monkeypatch.setattr(module, "group_advantages", lambda *a, **k: exact_advantages(*a, **k) + 1e-30)
        common.main(module.train, module.Args, argv=[*argv, "--out", str(tmp_path / run)])
    assert forwarded == {"skip": 8, "every": 16}, forwarded  # 2 of the 4 groups constant
    model, tok = common.load_model(common.tiny_checkpoint(), torch.device("cpu"))
    # one update's gradient, two float32 sums in other orders (8 rows or 16 with 8 contributing 0): the
    # first-order bound of test_distributed.sgd_step_tol, with the longest sequence the tiny run can have
    prompt = max(len(tok(e["prompt"])["input_ids"]) for e in common.arith_split()[0])
    n = forward_roundings(model.config, prompt + 6) + 16 * (prompt + 6) + 1
    for i, (a, b) in enumerate(zip(grads["skip"], grads["every"])):
        assert_within(a, b, 2 * probable_gamma(n) * b.abs().max().item(), f"gradient {i}")
    assert any(g.any() for g in grads["skip"])
