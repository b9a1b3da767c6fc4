"""grpo.py's --routing-replay through train() (and each fork in helpers.SCRIPTS), read at the experts' pre-hook:
(a) every update routes each token through its own batch's pi_old experts; (b) every router gets a gradient
(Megatron-LM PR #79); (c) without the flag some token routes elsewhere, so (a) can fail."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib

import pytest
import torch
from helpers import SCRIPTS
from test_real_checkpoints import graded_reward

import common


def has_routing_replay(name: str) -> bool:
    return "routing_replay" in {f.name for f in dataclasses.fields(importlib.import_module(name).Args)}


REPLAYING = [name for name in SCRIPTS if has_routing_replay(name)]  # grpo.py and each fork of it in SCRIPTS
STEPS, UPDATES = 2, 4  # updates a step: 2 minibatches x 2 epochs
# 4 prompts x 4 completions, no evaluation; a reward that varies within every group, so that every update has a
# gradient
ARGV = ["--model", "tiny-moe", "--steps", str(STEPS), "--prompts-per-step", "4", "--group-size", "4",
        "--minibatches", "2", "--epochs", "2", "--max-new-tokens", "6", "--eval-size", "1", "--eval-every", "0",
        "--no-anneal-lr"]  # fmt: skip


def rows_of(roll) -> list[tuple]:
    """Each row of a Rollout as its padded token ids: the same key in the batch and in rows picked out of it."""
    return [(tuple(p), tuple(c)) for p, c in zip(roll.prompt_ids.tolist(), roll.completion_ids.tolist())]


def train(tmp_path, monkeypatch, name: str, replay: bool, out: str) -> dict:
    """STEPS steps of train(): the pi_old forwards' (rows, experts), the updates' (rows, experts, mask), gate_grads."""
    module = importlib.import_module(name)
    seen = {"phase": None, "experts": [], "forwards": [], "gate_grads": []}
    load_model, completion_logprobs, recording = common.load_model, common.completion_logprobs, common.recording_experts
    forward = common.CompletionLogprobs.forward

    def experts_input(block_experts, inputs):  # (hidden_states [N, H], top_k_index [N, k], top_k_weights [N, k])
        if seen["phase"] is not None:
            seen["experts"].append(inputs[1].detach().clone())

    def loading(*args, **kwargs):
        model, tok = load_model(*args, **kwargs)
        seen["blocks"] = [m for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]
        for block in seen["blocks"]:
            block.experts.register_forward_pre_hook(experts_input)
        return model, tok

    def observed(phase, roll, run):
        """Run `run` (one forward of `roll`) with the experts' inputs recorded, as [layers, rows, S, k]."""
        seen["phase"], seen["experts"] = phase, []
        try:
            result = run()
        finally:
            seen["phase"] = None
        assert len(seen["experts"]) == len(seen["blocks"]), f"{phase}: one forward, each block once"
        shape = (len(roll), roll.prompt_ids.shape[1] + roll.completion_ids.shape[1], -1)
        experts = torch.stack([ids.view(shape) for ids in seen["experts"]])
        seen["forwards"].append((phase, rows_of(roll), experts, roll.completion_mask))
        return result

    @contextlib.contextmanager
    def recording_pi_old(moe, roll):  # the script's pi_old forward runs inside it
        seen["pi_old"] = True
        try:
            with recording(moe, roll):
                yield
        finally:
            seen["pi_old"] = False

    def pi_old_forward(model, roll, *args, **kwargs):
        if not seen.get("pi_old"):  # (the reference's forward, --kl-coef)
            return completion_logprobs(model, roll, *args, **kwargs)
        return observed("pi_old", roll, lambda: completion_logprobs(model, roll, *args, **kwargs))

    def update_forward(self, roll, *args, **kwargs):
        if not torch.is_grad_enabled():  # (the drift measurement after the updates, evaluation)
            return forward(self, roll, *args, **kwargs)
        return observed("update", roll, lambda: forward(self, roll, *args, **kwargs))

    class RecordingAdamW(torch.optim.AdamW):
        def step(self, closure=None):
            grads = [b.gate.weight.grad for b in seen["blocks"]]
            seen["gate_grads"].append([None if g is None else g.detach().clone() for g in grads])
            return super().step(closure)

    monkeypatch.setattr(common, "load_model", loading)
    monkeypatch.setattr(common, "recording_experts", recording_pi_old)
    monkeypatch.setattr(common, "completion_logprobs", pi_old_forward)
    monkeypatch.setattr(common.CompletionLogprobs, "forward", update_forward)
    monkeypatch.setattr(torch.optim, "AdamW", RecordingAdamW)
    argv = [*ARGV, "--reward", "exact", graded_reward(tmp_path), "--out", str(tmp_path / out)]
    common.main(module.train, module.Args, argv=argv + (["--routing-replay"] if replay else []))
    monkeypatch.undo()  # (the next run installs its own recorders)

    pi_old = [(rows, experts) for phase, rows, experts, _ in seen["forwards"] if phase == "pi_old"]
    updates = [(rows, experts, mask) for phase, rows, experts, mask in seen["forwards"] if phase == "update"]
    assert len(updates) == len(seen["gate_grads"]) == STEPS * UPDATES  # each update stepped
    return {"pi_old": pi_old, "updates": updates, "gate_grads": seen["gate_grads"]}


def recorded_for(pi_old: list, rows: list[tuple]) -> torch.Tensor:
    """[layers, rows, S, k]: the experts that the pi_old forward of these rows' batch chose for them (the one
    pi_old forward that holds them all, whichever step ran it)."""
    batches = [(batch, experts) for batch, experts in pi_old if set(rows) <= set(batch)]
    assert len(batches) == 1, f"{len(batches)} pi_old forwards hold the update's rows (one expected)"
    batch, experts = batches[0]
    return experts[:, [batch.index(row) for row in rows]]


def moved_tokens(recorded: torch.Tensor, routed: torch.Tensor, mask: torch.Tensor | None = None) -> int:
    """The number of (layer, row, position) whose set of experts differs between two routings [layers, rows, S, k];
    with `mask` [rows, T], of completion tokens only (the last T positions)."""
    differ = (recorded.sort(-1).values != routed.sort(-1).values).any(-1)  # [layers, rows, S]
    if mask is not None:
        differ = differ[..., -mask.shape[1] :] & mask.bool()[None]
    return int(differ.sum())


@pytest.mark.parametrize("name", REPLAYING)
def test_routing_replay_through_train_routes_each_update_as_pi_old_and_trains_the_router(tmp_path, monkeypatch,
                                                                                         name):  # fmt: skip
    replayed = train(tmp_path, monkeypatch, name, replay=True, out="replay")
    layers = replayed["pi_old"][0][1].shape[0]
    for k, (rows, routed, _) in enumerate(replayed["updates"]):
        recorded = recorded_for(replayed["pi_old"], rows)
        assert routed.shape == recorded.shape, (k, routed.shape, recorded.shape)
        # (a) every position of the update's rows, every layer: the experts of its batch's pi_old forward
        moved = moved_tokens(recorded, routed)
        assert moved == 0, (
            f"update {k}: {moved} of {routed[..., 0].numel()} (layer, token) pairs routed to other experts than "
            "the pi_old forward of their batch chose"
        )
        # (b) every layer's router has a gradient (the recorded experts' rows of it, at least)
        for layer, grad in enumerate(replayed["gate_grads"][k]):
            assert grad is not None and grad.abs().max() > 0, f"update {k}, layer {layer}: no gradient to the router"
    assert layers == len(replayed["gate_grads"][0]) > 0

    # (c) the same steps without --routing-replay: an update's own top-k moves some completion token, so (a) above
    # is not true of any routing whatever
    plain = train(tmp_path, monkeypatch, name, replay=False, out="plain")
    drift = [moved_tokens(recorded_for(plain["pi_old"], rows), routed, mask) for rows, routed, mask in plain["updates"]]
    assert any(drift), f"no update routed a completion token elsewhere ({drift}): (a) cannot fail"
