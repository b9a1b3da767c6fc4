"""grpo.py's --routing-replay through its own train() (GSPO paper, arXiv 2507.18071, section 5.3), not through
RoutingReplay's functions alone (tests/test_moe.py): one step of the tiny MoE checkpoint with 2 minibatches x 2
epochs, so that the weights have moved before every update after the first. What each forward routed is read
where the experts receive it (a pre-hook on every block's `experts`, which is handed the chosen expert ids), not
from RoutingReplay:

(a) with --routing-replay, every update's forward runs each token of its rows (prompt and completion, every layer)
    through the experts the pi_old forward chose for it;
(b) and the router (each block's `gate`) still gets a non-zero gradient in every update (Megatron-LM PR #79: a
    replay that detached the router's logits trained every weight but the router's);
(c) without --routing-replay, some update after the first routes some completion token elsewhere, so (a) is a
    check that can fail: the weights moved enough for the routing to drift.

A train() that never enters the replay fails (a); a replay whose routing weights are detached from the router's
logits fails (b)."""

from __future__ import annotations

import torch
from test_real_checkpoints import graded_reward

import common
import grpo

# 4 prompts x 4 completions, 2 minibatches x 2 epochs (4 updates), no evaluation; a reward that varies within every
# group, so that every update has a gradient
ARGV = ["--model", "tiny-moe", "--steps", "1", "--prompts-per-step", "4", "--group-size", "4", "--minibatches",
        "2", "--epochs", "2", "--max-new-tokens", "6", "--eval-size", "1", "--eval-every", "0",
        "--no-anneal-lr"]  # fmt: skip


def one_step(tmp_path, monkeypatch, replay: bool, out: str) -> dict:
    """One step of grpo.py's train(); returns what it recorded: `pi_old` [layers, B, S, k] (the experts chosen in
    the pi_old forward), `updates` (each update's [layers, rows, S, k]), `plan` (the loop's (idx, rows) of each
    update), `mask` [B, T] (the completion mask), `gate_grads` (each optimizer step's router gradients, by layer)."""
    seen = {"phase": None, "experts": [], "forwards": [], "gate_grads": []}
    load_model, plan_updates, logprobs_of_rows = common.load_model, common.plan_updates, common.logprobs_of_rows
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
        seen["forwards"].append((phase, torch.stack([ids.view(shape) for ids in seen["experts"]])))
        return result

    def pi_old_forward(model, roll, rows, temperature=1.0):
        seen["mask"] = roll.completion_mask
        return observed("pi_old", roll, lambda: logprobs_of_rows(model, roll, rows, temperature))

    def update_forward(self, roll, *args, **kwargs):
        if not torch.is_grad_enabled():  # (the drift measurement after the updates, evaluation)
            return forward(self, roll, *args, **kwargs)
        return observed("update", roll, lambda: forward(self, roll, *args, **kwargs))

    def planning(*args, **kwargs):
        seen["plan"] = plan_updates(*args, **kwargs)
        return seen["plan"]

    class RecordingAdamW(torch.optim.AdamW):
        def step(self, closure=None):
            grads = [b.gate.weight.grad for b in seen["blocks"]]
            seen["gate_grads"].append([None if g is None else g.detach().clone() for g in grads])
            return super().step(closure)

    monkeypatch.setattr(common, "load_model", loading)
    monkeypatch.setattr(common, "plan_updates", planning)
    monkeypatch.setattr(common, "logprobs_of_rows", pi_old_forward)
    monkeypatch.setattr(common.CompletionLogprobs, "forward", update_forward)
    monkeypatch.setattr(torch.optim, "AdamW", RecordingAdamW)
    argv = [*ARGV, "--reward", "exact", graded_reward(tmp_path), "--out", str(tmp_path / out)]
    common.main(grpo.train, grpo.Args, argv=argv + (["--routing-replay"] if replay else []))
    monkeypatch.undo()  # (the next run installs its own recorders)

    phases = [phase for phase, _ in seen["forwards"]]
    assert phases == ["pi_old"] + ["update"] * len(seen["plan"]), phases
    assert len(seen["plan"]) == 4 and len(seen["gate_grads"]) == 4  # 2 epochs x 2 minibatches, each stepped
    return {
        "pi_old": seen["forwards"][0][1],
        "updates": [ids for _, ids in seen["forwards"][1:]],
        "plan": seen["plan"],
        "mask": seen["mask"],
        "gate_grads": seen["gate_grads"],
    }


def moved_tokens(recorded: torch.Tensor, routed: torch.Tensor, mask: torch.Tensor | None = None) -> int:
    """The number of (layer, row, position) whose set of experts differs between two routings [layers, rows, S, k];
    with `mask` [rows, T], of completion tokens only (the last T positions)."""
    differ = (recorded.sort(-1).values != routed.sort(-1).values).any(-1)  # [layers, rows, S]
    if mask is not None:
        differ = differ[..., -mask.shape[1] :] & mask.bool()[None]
    return int(differ.sum())


def test_routing_replay_through_train_routes_each_update_as_pi_old_and_trains_the_router(tmp_path, monkeypatch):
    replayed = one_step(tmp_path, monkeypatch, replay=True, out="replay")
    layers = replayed["pi_old"].shape[0]
    for k, ((_, rows), routed) in enumerate(zip(replayed["plan"], replayed["updates"])):
        recorded = replayed["pi_old"][:, rows]
        assert routed.shape == recorded.shape, (k, routed.shape, recorded.shape)
        # (a) every position of the update's rows, every layer: the experts of the pi_old forward
        moved = moved_tokens(recorded, routed)
        assert moved == 0, f"update {k}: {moved} (layer, token) pairs routed to other experts than pi_old's"
        # (b) every layer's router has a gradient (the recorded experts' rows of it, at least)
        for layer, grad in enumerate(replayed["gate_grads"][k]):
            assert grad is not None and grad.abs().max() > 0, f"update {k}, layer {layer}: no gradient to the router"
    assert layers == len(replayed["gate_grads"][0]) > 0

    # (c) the same step without --routing-replay: a later update's own top-k moves some completion token, so (a)
    # above is not true of any routing whatever
    plain = one_step(tmp_path, monkeypatch, replay=False, out="plain")
    drift = [
        moved_tokens(plain["pi_old"][:, rows], routed, plain["mask"][rows])
        for (_, rows), routed in zip(plain["plan"][1:], plain["updates"][1:])
    ]
    assert any(drift), f"no update after the first routed a completion token elsewhere ({drift}): (a) cannot fail"
