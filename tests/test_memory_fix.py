"""Regression tests of issue 42's memory fix (docs/memory.md, "PPO's regression"), without timing or RSS.

PPO's peak is the policy's backward, through the vocabulary-sized log-prob chunks. ppo.py runs it before
the critic's forward and backward, so that the critic's gradients (among them a second embedding-sized
gradient: 151,936 x 128 float32 values, 78 MB, at the benchmark's shape) do not exist yet while it
runs. The test watches a real run: at every update, when the policy's backward reaches its log-probs,
no critic parameter holds a gradient; and when the critic's backward runs, the policy's gradients are
already there (the order is really policy first, critic second, not a skipped backward)."""

from __future__ import annotations

from helpers import SMOKE_ARGS, main_in_process

import common
import ppo


def test_policy_backward_runs_before_the_critic_has_gradients(tmp_path, monkeypatch, capsys):
    critics, seen = [], []  # seen: ("policy" | "critic", critic grads present, policy grads present)
    policy_models = []

    def grads_present(module) -> bool:
        return any(p.grad is not None for p in module.parameters() if p.requires_grad)

    def note(kind):
        def hook(grad):
            seen.append((kind, grads_present(critics[0]), grads_present(policy_models[0])))
            return grad

        return hook

    critic_init, critic_forward = ppo.Critic.__init__, ppo.Critic.forward
    logprobs_forward = common.CompletionLogprobs.forward

    def init(self, *a, **k):
        critic_init(self, *a, **k)
        critics.append(self)

    def forward_critic(self, roll):
        values = critic_forward(self, roll)
        if values.requires_grad:  # the update's forward (the rollout's values are taken under no_grad)
            values.register_hook(note("critic"))
        return values

    def forward_logprobs(self, roll, *a, **k):
        logp, entropy = logprobs_forward(self, roll, *a, **k)
        if logp.requires_grad:
            policy_models[:] = [self.model]
            logp.register_hook(note("policy"))
        return logp, entropy

    monkeypatch.setattr(ppo.Critic, "__init__", init)
    monkeypatch.setattr(ppo.Critic, "forward", forward_critic)
    monkeypatch.setattr(common.CompletionLogprobs, "forward", forward_logprobs)
    argv = [*SMOKE_ARGS, "--epochs", "1", "--out", tmp_path / "out"]  # 2 steps of 2 minibatches
    status, _, err = main_in_process(ppo, argv, capsys)
    assert status == 0, err

    updates = 2 * 2  # steps x minibatches
    assert [kind for kind, _, _ in seen] == ["policy", "critic"] * updates
    for kind, critic_has_grads, policy_has_grads in seen:
        if kind == "policy":  # zero_grad(set_to_none=True) ran, and the critic's backward has not yet
            assert not critic_has_grads and not policy_has_grads
        else:  # the policy's backward is done; the critic's own gradients are being computed
            assert policy_has_grads and not critic_has_grads
