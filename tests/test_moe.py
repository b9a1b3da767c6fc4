"""The tiny Qwen3-MoE checkpoint, Routing Replay and routing drift (arXiv 2507.18071, 5.3), and smoke runs on it."""

from __future__ import annotations

import importlib
import json
import math

import pytest
import torch
from helpers import logit_scale, logprob_tol, main_in_process, unit_roundoff

import common
from extras.moe import RoutingReplay, routing_drift


@pytest.fixture(scope="module")
def moe():
    """(model, tok) of the tiny MoE checkpoint (shipped in checkpoints/), float32 on CPU."""
    return common.load_model("tiny-moe", torch.device("cpu"))


def small_rollout(tok, n=6):
    train, _ = common.arith_split()
    prompts = [tok(ex["prompt"])["input_ids"] for ex in train[:n]]
    completions = [tok(ex["answer"])["input_ids"][: 1 + i % 3] + [tok.eos_token_id] for i, ex in enumerate(train[:n])]
    return common.Rollout.from_lists(prompts, completions, tok.pad_token_id)


def test_moe_checkpoint_round_trip_and_band(moe):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = common.tiny_checkpoint("tiny-moe")
    assert path != common.tiny_checkpoint("tiny")  # its own checkpoint beside the dense one
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == "qwen3_moe" and config.num_experts == 8 and config.num_experts_per_tok == 2
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert len(RoutingReplay(model).blocks) == config.num_hidden_layers  # every layer sparse
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.decode(tok("12+34=")["input_ids"]) == "12+34="
    _, held_out = common.arith_split()
    acc = common.evaluate(moe[0], moe[1], held_out[:200], max_new_tokens=5)["accuracy"]
    assert 0.10 <= acc <= 0.55, f"held-out accuracy {acc}: outside the band that leaves room for RL"


def test_sample_falls_back_to_hf_and_greedy_equals_generate(moe):
    model, tok = moe
    assert not common._StaticKVDecoder.supports(model)  # qwen3_moe: the HF forward path
    _, held_out = common.arith_split()
    prompts = [tok(ex["prompt"])["input_ids"] for ex in held_out[:6]]
    eos = common.eos_token_ids(model, tok)
    roll = common.sample(model, prompts, 6, eos, tok.pad_token_id, greedy=True)
    for i, p in enumerate(prompts):  # one at a time: no padding in the reference
        ref = model.generate(
            torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=eos, pad_token_id=tok.pad_token_id
        )[0, len(p) :].tolist()
        assert roll.completion_lists()[i] == ref[: len(roll.completion_lists()[i])]
        assert len(roll.completion_lists()[i]) == len(ref) or ref[len(roll.completion_lists()[i])] == tok.pad_token_id


@pytest.mark.numeric
def test_replay_with_unchanged_weights_equals_plain_forward(moe):
    model, tok = moe
    roll, routing = small_rollout(tok), RoutingReplay(model)
    with torch.no_grad(), routing.record():
        plain, _ = common.completion_logprobs(model, roll)
    L, (B, S) = len(routing.blocks), (roll.prompt_ids.shape[0], roll.prompt_ids.shape[1] + roll.completion_ids.shape[1])
    assert routing.indices.shape == (L, B, S, 2)
    with torch.no_grad(), routing.replay(routing.indices):
        replayed, _ = common.completion_logprobs(model, roll)
    # the recorded experts, gathered instead of chosen: one function, two float32 forwards (helpers.logprob_tol;
    # the dense intermediate_size it counts exceeds the experts' width)
    tol = logprob_tol(model.config, *logit_scale(model, roll))
    torch.testing.assert_close(replayed, plain, atol=tol, rtol=0)
    rows = torch.tensor([4, 1])  # a minibatch of the recorded batch
    with torch.no_grad(), routing.replay(routing.indices, rows):
        sub, _ = common.completion_logprobs(model, roll[rows])
    torch.testing.assert_close(sub, plain[rows], atol=tol, rtol=0)


def test_replay_after_weight_change_uses_recorded_experts_and_gradients(moe):
    model, tok = moe
    model = type(model)(model.config).eval()  # a private copy: this test changes weights
    model.load_state_dict(moe[0].state_dict())
    roll, routing, observed = small_rollout(tok), RoutingReplay(model), RoutingReplay(model)
    with torch.no_grad(), routing.record():
        common.completion_logprobs(model, roll)
    recorded = routing.indices.clone()
    torch.manual_seed(0)
    with torch.no_grad():  # a large router change, so the plain top-k moves
        for block in routing.blocks:
            block.gate.weight.add_(torch.randn_like(block.gate.weight))
    with torch.no_grad(), observed.record():
        common.completion_logprobs(model, roll)
    assert routing_drift(recorded, observed.indices) > 0.1  # plain routing has drifted

    model.zero_grad()
    with routing.replay(recorded), observed.record():  # `observed` sees what the experts are given
        logp, _ = common.completion_logprobs(model, roll)
        (logp * roll.completion_mask).sum().backward()
    assert torch.equal(observed.indices, recorded)

    for layer, block in enumerate(routing.blocks):
        used = set(recorded[layer].flatten().tolist())
        expert_grad = block.experts.gate_up_proj.grad.abs().sum((1, 2)) + block.experts.down_proj.grad.abs().sum((1, 2))
        router_grad = block.gate.weight.grad.abs().sum(1)  # [E]
        got = {e for e in range(len(expert_grad)) if expert_grad[e] > 0}
        assert got and got <= used, f"layer {layer}: experts with gradient {got}, recorded {used}"
        # norm_topk_prob: the weights are softmax over the recorded k only (the full softmax's
        # normaliser cancels), so only the recorded experts' router rows get gradient (others: float
        # residue of that cancellation, ~1e-9 of the largest)
        routed = {e for e in range(len(router_grad)) if router_grad[e] > 1e-5 * router_grad.max()}
        assert routed and routed <= used, f"layer {layer}: router rows with gradient {routed}, recorded {used}"


def test_is_moe_and_a_record_without_a_forward(moe):
    """common.is_moe: the MoE checkpoint has sparse blocks, the dense one none. A record() block in which no
    forward ran (--old-logp rollout's first step) leaves no indices, not a stack of Nones, and drift is {}."""
    model, tok = moe
    dense, _ = common.load_model("tiny", torch.device("cpu"))
    assert common.is_moe(model) and not common.is_moe(dense)
    routing = RoutingReplay(model)
    with routing.record():
        pass
    assert routing.indices is None
    assert routing.drift(model, small_rollout(tok)) == {}
    assert RoutingReplay(dense).blocks == []


def test_routing_drift_hand_made_and_identical():
    a = torch.tensor([[[[0, 1], [2, 3], [4, 5]]]])  # [layers=1, B=1, S=3, k=2]
    b = torch.tensor([[[[1, 0], [2, 4], [4, 5]]]])  # same set, different set, same
    # a share: an exact count over an exact total, one float32 division (and one float64 on the right)
    share_rel = unit_roundoff(torch.float32) + unit_roundoff(torch.float64)
    assert routing_drift(a, b) == pytest.approx(1 / 3, rel=share_rel)
    assert routing_drift(a, b, torch.tensor([[1.0, 0.0]])) == 1.0  # completion: last 2
    assert routing_drift(a, b, torch.tensor([[0.0, 1.0]])) == 0.0
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 8, (3, 4, 5, 2), generator=g)
    y = torch.where(torch.rand(3, 4, 5, 1, generator=g) < 0.3, torch.randint(0, 8, (3, 4, 5, 2), generator=g), x)
    mask = (torch.rand(4, 3, generator=g) < 0.7).float()
    differ = total = 0
    for layer in range(3):
        for i in range(4):
            for t in range(3):
                if mask[i, t]:
                    total += 1
                    differ += set(x[layer, i, 2 + t].tolist()) != set(y[layer, i, 2 + t].tolist())
    assert routing_drift(x, y, mask) == pytest.approx(differ / total, rel=share_rel)


SMOKE = ["--model", "tiny-moe", "--steps", "2", "--prompts-per-step", "4", "--group-size", "2", "--minibatches", "2",
         "--eval-size", "8", "--eval-every", "1", "--max-new-tokens", "6"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "script,extra",
    [("grpo", ["--routing-replay"]), ("gspo", [])],  # (without it: test_flags_reach_update, --model tiny-moe)
    ids=["grpo-replay", "gspo"],
)
def test_smoke_run_moe(tmp_path, capsys, moe, script, extra):
    status, _, err = main_in_process(
        importlib.import_module(script), [*SMOKE, *extra, "--out", tmp_path / "run"], capsys
    )
    assert status == 0, err[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0.0 <= r["routing_drift"] <= 1.0 and math.isfinite(r["ratio_std"]) and r["ratio_std"] >= 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["args"].get("routing_replay", False) == ("--routing-replay" in extra)  # gspo.py has no such flag
