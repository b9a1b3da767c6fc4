"""--temperature 0.7 (with and without --top-p 0.8, either --old-logp) for each script: the first update is
on-policy, and the training log-probs are softmax(z / 0.7)'s of a plain forward (TRL #3029)."""

from __future__ import annotations

import importlib

import pytest
import torch
from helpers import SCRIPTS, assert_within, logit_scale, logprob_tol
from test_pi_old import TINY_BATCH, group_flags, loss_name
from test_real_checkpoints import graded_reward

import common

TEMPERATURE = 0.7


def plain_logprobs(model, roll, temperature):
    """[B, T] log softmax(z / temperature) at each completion token, z from one forward of the whole sequence."""
    ids = torch.cat([roll.prompt_ids, roll.completion_ids], 1)
    attn = torch.cat([roll.prompt_mask, roll.completion_mask.long()], 1)
    positions = (attn.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn, position_ids=positions).logits.double()
    P, T = roll.prompt_ids.shape[1], roll.completion_ids.shape[1]
    z = logits[:, P - 1 : P - 1 + T] / temperature  # the positions that predict each completion token
    return z.log_softmax(-1).gather(-1, roll.completion_ids[..., None]).squeeze(-1)


# the quick tier runs one case a script (recompute with top-p: a temperature missing from pi_old's forward or from the
# update's fails it), the slow tier the other three
CASES = [
    pytest.param(name, top_p, old_logp, marks=[] if (top_p, old_logp) == ("0.8", "recompute") else [pytest.mark.slow])
    for name in SCRIPTS
    for top_p in (None, "0.8")
    for old_logp in ("recompute", "rollout")
]


@pytest.mark.parametrize(("name", "top_p", "old_logp"), CASES)
def test_the_first_update_at_a_temperature_is_on_policy_and_at_that_temperature(name, top_p, old_logp, tmp_path,
                                                                                 monkeypatch):  # fmt: skip
    module = importlib.import_module(name)
    seen = {"updates": [], "forwards": []}
    sample = common.Sampler.sample
    forward = common.CompletionLogprobs.forward

    def recording_sample(self, prompts, generator):
        roll = sample(self, prompts, generator)
        seen["model"], seen["roll"] = self.model, roll
        return roll

    def recording_forward(self, roll, temperature=1.0, *args, **kwargs):
        out = forward(self, roll, temperature, *args, **kwargs)
        if torch.is_grad_enabled() and not seen["forwards"]:  # the first update's training forward
            expected = plain_logprobs(self.model, roll, TEMPERATURE)
            tol = logprob_tol(self.model.config, *logit_scale(self.model, roll, TEMPERATURE))
            seen["forwards"].append((out[0].detach().double(), expected, roll.completion_mask.bool(), tol))
        return out

    loss = getattr(module, loss_name(module, name))

    def recording_loss(logp, old_logp, advantages, mask, *args, **kwargs):
        if not seen["updates"]:  # (before the first step: the weights pi_old was taken with)
            seen["tol"] = logprob_tol(seen["model"].config, *logit_scale(seen["model"], seen["roll"], TEMPERATURE))
        seen["updates"].append((logp - old_logp).detach()[mask.bool()].abs().max().item())
        return loss(logp, old_logp, advantages, mask, *args, **kwargs)

    monkeypatch.setattr(common.Sampler, "sample", recording_sample)
    monkeypatch.setattr(common.CompletionLogprobs, "forward", recording_forward)
    monkeypatch.setattr(module, loss_name(module, name), recording_loss)
    argv = [*TINY_BATCH, *group_flags(name), "--reward", "exact", graded_reward(tmp_path),
            "--temperature", str(TEMPERATURE), "--old-logp", old_logp, *(["--top-p", top_p] if top_p else []),
            "--out", str(tmp_path / "out")]  # fmt: skip
    common.main(module.train, module.Args, argv=argv)

    assert len(seen["updates"]) == 2, seen["updates"]  # both minibatches updated
    # pi_old's forward (or the sampler's, with its KV cache) and the first update's training forward: two float32
    # forwards of the same rows and weights, batched differently (helpers.logprob_tol)
    first = seen["updates"][0]
    assert first <= seen["tol"], (
        f"first update: |log pi - log pi_old| reaches {first:.3g}, rounding allows {seen['tol']:.3g}"
    )
    got, expected, mask, tol = seen["forwards"][0]
    assert_within(got[mask], expected[mask], tol, f"{name}: the training forward's log-probs at T = {TEMPERATURE}")
    # (at temperature 1 they would be off by more than the bound: the check can tell the two apart)
    at_one = plain_logprobs(seen["model"], seen["roll"], 1.0)
    assert (at_one - plain_logprobs(seen["model"], seen["roll"], TEMPERATURE)).abs().max() > 100 * tol
