"""LoRA (--lora-rank): every equality with non-zero adapters, against W + (alpha / r) B A merged here by hand."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import build_checkpoints  # tools/, on sys.path through conftest.py
import pytest
import torch
from helpers import (
    entropy_tol,
    gamma,
    logit_scale,
    logit_tol,
    logprob_tol,
)
from safetensors.torch import load_file
from test_reliability import assert_same_weights, metrics, train_in_process

import common
import ppo

pytestmark = pytest.mark.slow  # subprocess or torchrun runs: the quick tier (-m "not slow") leaves them out

pytest.importorskip("peft")

CPU = torch.device("cpu")
RANK, ALPHA = 4, 16.0  # scale alpha / r = 4: non-zero adapters visibly change the tiny model
LORA = SimpleNamespace(lora_rank=RANK, lora_alpha=ALPHA, lora_targets=common.LORA_TARGETS)


def nonzero_adapters(model, seed=1, std=0.2):
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, std)


def lora_tensors(model) -> dict:
    """{projection path in the base model: (A [r, in], B [out, r])} of an in-memory peft model."""
    prefix = "base_model.model."
    return {
        name[len(prefix) :]: (m.lora_A["default"].weight.detach(), m.lora_B["default"].weight.detach())
        for name, m in model.named_modules()
        if hasattr(m, "lora_A") and "default" in m.lora_A
    }


def saved_lora_tensors(adapter_dir) -> dict:
    """The same from a saved adapter_model.safetensors (keys base_model.model.<path>.lora_A.weight)."""
    state = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    paths = {k[len("base_model.model.") : -len(".lora_A.weight")] for k in state if k.endswith(".lora_A.weight")}
    return {
        p: (state[f"base_model.model.{p}.lora_A.weight"], state[f"base_model.model.{p}.lora_B.weight"]) for p in paths
    }


def merged_by_hand(base_state: dict, tensors: dict, scale: float) -> dict:
    """The base's state dict with W + scale * B A in every adapted projection."""
    merged = dict(base_state)
    for path, (A, B) in tensors.items():
        merged[f"{path}.weight"] = base_state[f"{path}.weight"] + scale * (B.double() @ A.double()).float()
    return merged


def prompts(tok, n=12):
    return [tok(f"{a}+{b}=")["input_ids"] for a, b in zip(range(3, 3 + 7 * n, 7), range(50, 50 + 3 * n, 3))]


@pytest.fixture(scope="module")
def lora_and_merged(tiny_path):
    """(the tiny policy with non-zero adapters, the hand-merged model, the untouched base, tok)."""
    base, tok = common.load_model("tiny", CPU)
    model = common.add_lora(common.load_model("tiny", CPU)[0], LORA)
    nonzero_adapters(model)
    merged = common.load_model("tiny", CPU)[0]
    merged.load_state_dict(merged_by_hand(base.state_dict(), lora_tensors(model), ALPHA / RANK))
    return model.eval(), merged.eval(), base.eval(), tok


def test_the_reference_is_the_base_model(lora_and_merged):
    model, _, base, tok = lora_and_merged
    roll = common.sample(base, prompts(tok), 6, common.eos_token_ids(base, tok), tok.pad_token_id, greedy=True)
    reference = common.reference_model(model, CPU, SimpleNamespace(model="tiny", fsdp=False))
    assert not isinstance(reference, torch.nn.Module)  # a view of the policy, not a second copy of the weights
    with torch.no_grad():
        ref_logp = common.completion_logprobs(reference, roll)[0]
        base_logp = common.completion_logprobs(base, roll)[0]
        policy_logp = common.completion_logprobs(model, roll)[0]
    mask = roll.completion_mask.bool()
    # the policy with its adapters switched off and the base: one model, two float32 forwards (helpers)
    tol = logprob_tol(base.config, *logit_scale(base, roll))
    torch.testing.assert_close(ref_logp[mask], base_logp[mask], rtol=0, atol=tol)
    assert (policy_logp - base_logp)[mask].abs().max() > 0.1  # the adapters do change the policy
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)  # enabled again afterwards


def test_sampler_and_logprobs_see_the_adapters(lora_and_merged):
    model, merged, base, tok = lora_and_merged
    eos, ps = common.eos_token_ids(base, tok), prompts(tok)
    greedy = common.sample(model, ps, 6, eos, tok.pad_token_id, greedy=True)
    expected = common.sample(merged, ps, 6, eos, tok.pad_token_id, greedy=True)
    assert torch.equal(greedy.completion_ids, expected.completion_ids)
    assert torch.equal(greedy.completion_mask, expected.completion_mask)
    from_base = common.sample(base, ps, 6, eos, tok.pad_token_id, greedy=True)
    assert not torch.equal(greedy.completion_ids, from_base.completion_ids)  # reading .weight alone gave these
    with torch.no_grad():
        logp, entropy = common.completion_logprobs(model, greedy)
        logp_merged, entropy_merged = common.completion_logprobs(merged, greedy)
    mask = greedy.completion_mask.bool()
    # x W + s (x A) B against x (W + s B A): one function, two float32 forwards (helpers.logit_tol's model)
    length, max_z = logit_scale(merged, greedy)
    torch.testing.assert_close(logp[mask], logp_merged[mask], rtol=0, atol=logprob_tol(merged.config, length, max_z))
    tol = entropy_tol(merged.config, length, max_z)
    torch.testing.assert_close(entropy[mask], entropy_merged[mask], rtol=0, atol=tol)


# --- PPO runs with LoRA: what trains, --merge-lora, --resume ---

# --no-anneal-lr: "part" extended from 3 steps to 6 equals "full" only at a constant learning rate
LORA_FLAGS = ["--lora-rank", str(RANK), "--lora-alpha", str(ALPHA), "--merge-lora", "--lr", "3e-3", "--no-anneal-lr"]


@pytest.fixture(scope="module")
def ppo_runs(tmp_path_factory, tiny_path):
    """ppo.py with LoRA, in this process: "full" 6 steps; "part" the same run stopped by --steps 3 --save-every 3."""
    base = tmp_path_factory.mktemp("lora-runs")
    train_in_process(ppo, *LORA_FLAGS, "--steps", "6", "--out", base / "full")
    train_in_process(ppo, *LORA_FLAGS, "--steps", "3", "--save-every", "3", "--out", base / "part")
    return base


def test_a_lora_run_trains_only_adapters_and_the_critic_head(ppo_runs, tiny_path):
    final = ppo_runs / "full" / "final"
    base = load_file(str(Path(tiny_path) / "model.safetensors"))
    adapters = saved_lora_tensors(final)
    assert len(adapters) == 4 * len(common.LORA_TARGETS)  # every projection of the 4 layers
    assert all(B.abs().max() > 0 for _, B in adapters.values())  # the adapters trained
    # final/merged is base + (alpha / r) B A in the adapted projections, and the base everywhere else
    merged = load_file(str(final / "merged" / "model.safetensors"))
    expected = merged_by_hand(base, adapters, ALPHA / RANK)
    assert merged.keys() == expected.keys()
    for k in merged:
        # W + s B A in float32 two ways: B A sums RANK products (gamma_RANK), the scale and the sum 2 more,
        # of size |W| + s |B| |A|, each side
        path = k.removesuffix(".weight")
        size = base[k].abs()
        if path in adapters:
            A, B = adapters[path]
            size = size + ALPHA / RANK * (B.abs().double() @ A.abs().double()).float()
        bound = 2 * gamma(RANK + 2, torch.float32) * size
        assert ((merged[k] - expected[k]).abs() <= bound).all(), k
        if k.rsplit(".", 2)[-2] not in common.LORA_TARGETS:
            assert torch.equal(merged[k], base[k]), k  # embeddings, norms: frozen, bit for bit
    # the critic: its trunk's base weights frozen at the checkpoint's, its adapters and head trained
    critic = torch.load(final / "critic.pt")
    for k, v in critic.items():
        if k.startswith("trunk.") and "lora_" not in k:
            assert torch.equal(v, base["model." + k[len("trunk.") :].replace(".base_layer", "")]), k
    assert any(v.abs().max() > 0 for k, v in critic.items() if "lora_B" in k)
    assert critic["head.weight"].abs().max() > 0


def test_the_merged_checkpoint_loads_as_peft_loads_the_adapter(ppo_runs, tiny_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    final = ppo_runs / "full" / "final"
    merged = AutoModelForCausalLM.from_pretrained(final / "merged").eval()
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_path), final).eval()
    ids = torch.tensor([build_checkpoints.build_char_tokenizer()("12+34=46")["input_ids"]])
    with torch.no_grad():
        logits = merged(input_ids=ids).logits
        tol = logit_tol(merged.config, ids.shape[1], logits.abs().max().item())  # two float32 forwards (helpers)
        torch.testing.assert_close(logits, with_adapter(input_ids=ids).logits, rtol=0, atol=tol)


def test_resume_with_lora_equals_the_uninterrupted_run(ppo_runs, tmp_path):
    resumed = tmp_path / "resumed"
    shutil.copytree(ppo_runs / "part", resumed)
    assert (resumed / "checkpoint" / "policy" / "adapter_model.safetensors").is_file()  # the adapters, not the base
    common.main(ppo.train, ppo.Args, ["--resume", str(resumed), "--steps", "6"])
    full = ppo_runs / "full"
    assert metrics(resumed) == metrics(full)
    for name in ("adapter_model.safetensors", "merged/model.safetensors"):
        assert_same_weights(load_file(str(resumed / "final" / name)), load_file(str(full / "final" / name)))
    assert_same_weights(torch.load(resumed / "final" / "critic.pt"), torch.load(full / "final" / "critic.pt"))
