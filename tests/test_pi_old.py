"""pi_old for every script of helpers.SCRIPTS: each loss call gets the log-probs of the weights that sampled its
rows (helpers.SamplingWeights), whatever the loop's shape; leaving out zero-advantage rows leaves the gradient."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
from helpers import SCRIPTS, SamplingWeights, assert_within, forward_roundings, probable_gamma, traits
from test_real_checkpoints import graded_reward

import common

# 4 prompts x 4 completions (PPO: 16 prompts x 1), two minibatches, one epoch; a reward that varies within
# every group, so that no row is left out for a zero advantage and both minibatches update
TINY_BATCH = ["--steps", "1", "--minibatches", "2", "--epochs", "1", "--max-new-tokens", "6", "--eval-size", "1",
              "--eval-every", "0", "--no-anneal-lr"]  # fmt: skip
DEFAULT_GROUPS = ["--prompts-per-step", "4", "--group-size", "4"]  # (PPO's baseline is no group: 16 prompts x 1)


def group_flags(name: str) -> list:
    return DEFAULT_GROUPS if traits(name).grouped else ["--prompts-per-step", "16", "--group-size", "1"]


def loss_name(module, name: str) -> str:
    for candidate in (f"{name}_loss", f"{name}_policy_loss"):
        if callable(getattr(module, candidate, None)):
            return candidate
    raise AssertionError(f"{name}.py has neither {name}_loss nor {name}_policy_loss")


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_loss_receives_the_log_probs_of_the_weights_that_sampled_its_rows(name, tmp_path, monkeypatch):
    """Two steps of two minibatches; pi_old to helpers.logprob_tol, and some update must run at moved weights."""
    module = importlib.import_module(name)
    sampling = SamplingWeights(monkeypatch)
    seen = {"forwarded": None, "calls": []}
    forward = common.CompletionLogprobs.forward
    loss = getattr(module, loss_name(module, name))

    def recording_forward(self, roll, *args, **kwargs):
        seen["forwarded"] = roll
        return forward(self, roll, *args, **kwargs)

    def recording_loss(logp, old_logp, *args, **kwargs):
        seen["calls"].append((seen["forwarded"], logp.detach().clone(), old_logp.detach().clone()))
        return loss(logp, old_logp, *args, **kwargs)

    monkeypatch.setattr(common.CompletionLogprobs, "forward", recording_forward)
    monkeypatch.setattr(module, loss_name(module, name), recording_loss)
    argv = [*TINY_BATCH, "--steps", "2", *group_flags(name)]
    argv += ["--reward", "exact", graded_reward(tmp_path)]
    common.main(module.train, module.Args, argv=[*argv, "--out", str(tmp_path / "out")])

    assert len(seen["calls"]) >= 4, f"{len(seen['calls'])} loss calls in 2 steps of 2 minibatches"
    moved = 0.0  # the largest |log pi_theta - log pi_sampler| an update saw, in units of its rounding
    for k, (roll, logp, old_logp) in enumerate(seen["calls"]):
        assert roll is not None and len(roll) == len(old_logp), f"loss call {k}: not after a training forward"
        expected, tol = sampling.expected(roll, module.Args.temperature)
        for i, candidates in enumerate(expected):
            real = roll.completion_mask[i].bool()
            errors = [(old_logp[i] - e)[real].abs().max().item() for e in candidates]
            if min(errors) > tol:
                why = "pi_old is not the sampling weights'"
                if (old_logp[i] - logp[i])[real].abs().max().item() <= tol:
                    why = "they equal the current weights' log-probs: pi_old was taken from the current weights, "
                    why += "not from those that sampled the batch"
                raise AssertionError(
                    f"{name}: loss call {k}, row {i}: old_logp is off the log-probs of the weights that sampled the "
                    f"row by {min(errors):.3g} (rounding allows {tol:.3g}); {why}"
                )
            moved = max(moved, min((logp[i] - e)[real].abs().max().item() for e in candidates) / tol)
    assert moved > 100, f"no update ran at weights that had moved since sampling (at most {moved:.3g} x rounding)"


# A reward that depends on the row alone: 1 for the first row of every even group of 4, else 0, so that half the
# groups are constant (advantage exactly 0) whatever the model samples
ROW_REWARD = """
def rows(prompts, completions, **kwargs):
    return [float(i % 8 == 0) for i in range(len(completions))]
"""


@pytest.mark.parametrize("name", [s for s in SCRIPTS if traits(s).skips_zero_advantage])  # (at their defaults)
def test_leaving_out_zero_advantage_rows_leaves_the_gradient_unchanged(name, tmp_path, monkeypatch):
    """One update skipping half the rows against one with every advantage shifted by 1e-30 (none skipped)."""
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
    # --max-grad-norm 1e30: no clipping, which would scale a wrongly normalised gradient back to the same norm;
    # --no-filter-groups where a script has the flag (a DAPO-style fork filters by default): constant groups train
    unfiltered = ["--no-filter-groups"] if "filter_groups" in {f.name for f in dataclasses.fields(module.Args)} else []
    argv = [*TINY_BATCH, "--minibatches", "1", "--max-grad-norm", "1e30", *DEFAULT_GROUPS, *traits(name).test_flags,
            *unfiltered, "--reward", f"{reward}:rows"]  # fmt: skip
    for run in ("skip", "every"):
        if run == "every":
            monkeypatch.setattr(module, "group_advantages", lambda *a, **k: exact_advantages(*a, **k) + 1e-30)
        common.main(module.train, module.Args, argv=[*argv, "--out", str(tmp_path / run)])
    assert forwarded == {"skip": 8, "every": 16}, forwarded  # 2 of the 4 groups constant
    model, tok = common.load_model(common.tiny_checkpoint(), torch.device("cpu"))
    # one update's gradient, two float32 sums in other orders (8 rows or 16 with 8 contributing 0): the
    # first-order bound of test_distributed_flags' gradients, with the longest sequence the tiny run can have
    prompt = max(len(tok(e["prompt"])["input_ids"]) for e in common.arith_split()[0])
    n = forward_roundings(model.config, prompt + 6) + 16 * (prompt + 6) + 1
    for i, (a, b) in enumerate(zip(grads["skip"], grads["every"])):
        assert_within(a, b, 2 * probable_gamma(n) * b.abs().max().item(), f"gradient {i}")
    assert any(g.any() for g in grads["skip"])
