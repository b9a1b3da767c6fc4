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
from helpers import SCRIPTS, logit_scale, logprob_tol
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
