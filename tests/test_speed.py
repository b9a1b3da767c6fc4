"""Tests for the fast paths in common.py: chunked log-probs at a realistic vocabulary size, and the
sampler's own decoder (static KV cache, dropped rows) against Hugging Face.

The benchmarks themselves are scripts, not tests: benchmarks/sampler.py, benchmarks/memory.py,
benchmarks/speed.py, benchmarks/gpu.sh.
"""

import copy

import pytest
import torch
from helpers import assert_within, log_softmax_bounds
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import common

# ---------------------------------------------------------------------------------------------
# Log-probs: chunked through the output projection, with checkpointing
# ---------------------------------------------------------------------------------------------


def _naive_f64(hidden, weight, targets, temperature):
    """The whole [B, T, V] logits at once, float64: log p(target) and entropy."""
    logp_all = torch.log_softmax(hidden.double() @ weight.double().T / temperature, -1)
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


@pytest.mark.numeric
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_equal_naive_at_large_vocab_with_gradients(monkeypatch, temperature):
    B, T, H, V, chunk = 3, 40, 32, 5000, 48  # 120 tokens in chunks of 48: 48 + 48 + 24
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, T, H, generator=g).requires_grad_(True)
    weight = (0.3 * torch.randn(V, H, generator=g)).requires_grad_(True)
    targets = torch.randint(0, V, (B, T), generator=g)
    coef = torch.randn(B, T, generator=g)  # an arbitrary upstream gradient for logp

    calls = []
    real_chunk = common._logp_entropy_chunk
    monkeypatch.setattr(common, "_logp_entropy_chunk", lambda h, *a: calls.append(h.shape[0]) or real_chunk(h, *a))
    logp, ent = common.logprobs_from_hidden(hidden, weight, targets, temperature, chunk_tokens=chunk)
    assert calls == [48, 48, 24], "the vocabulary-sized logits must really be made in 3 chunks"
    (coef * logp).sum().backward()
    assert len(calls) == 6, "checkpointing recomputes each chunk in backward"

    h64 = hidden.detach().double().requires_grad_(True)
    w64 = weight.detach().double().requires_grad_(True)
    ref_logp, ref_ent = _naive_f64(h64, w64, targets, temperature)
    (coef.double() * ref_logp).sum().backward()
    bound = log_softmax_bounds(hidden, weight, targets, temperature, coef)  # float32's, from its roundoff
    assert_within(logp, ref_logp.detach(), bound["logp"], "log p")
    assert_within(ent, ref_ent.detach(), bound["entropy"], "entropy")
    assert_within(hidden.grad, h64.grad, bound["grad_hidden"], "d/dhidden")
    assert_within(weight.grad, w64.grad, bound["grad_weight"], "d/dweight")


# ---------------------------------------------------------------------------------------------
# Sampler: the fast decoder against HF generate, for each architecture it accepts
# ---------------------------------------------------------------------------------------------

PROMPTS = ["1+2=", "12+34=", "99+99=abc", "7", "5+5=10 and 3+", "8*8="]
SMALL = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.3,
)
ARCHS = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=8)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict()),  # q/k/v biases, no q/k norm
    "llama": (LlamaConfig, LlamaForCausalLM, dict(head_dim=8)),
}


def random_model(arch, tok, seed=0):
    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(seed)
    config = config_cls(
        vocab_size=len(tok),
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
        **SMALL,
        **extra,
    )
    model = model_cls(config).eval()
    if arch == "qwen2":  # random biases, so that a dropped bias would show
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.3)
    model.generation_config = GenerationConfig(eos_token_id=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    return model


def encode(tok):
    return [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


def generate_lists(model, prompts, T, eos, pad):
    batch = common.Rollout.from_lists(prompts, [[]] * len(prompts), pad)
    with torch.no_grad():
        out = model.generate(
            input_ids=batch.prompt_ids,
            attention_mask=batch.prompt_mask,
            max_new_tokens=T,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=pad,
        )[:, batch.prompt_ids.shape[1] :]
    return [row[: next((i + 1 for i, t in enumerate(row) if t in eos), len(row))] for row in out.tolist()]


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("T, grow", [(12, None), (40, None), (12, 3)])
def test_fast_decoder_greedy_equals_generate(char_tok, monkeypatch, arch, T, grow):
    """Also across cache growth: 40 new tokens grow the default cache twice (16 slots at a time),
    GROW = 3 grows it every third step, rows being dropped in between."""
    if grow:
        monkeypatch.setattr(common._StaticKVDecoder, "GROW", grow)
    model = random_model(arch, char_tok)
    assert common._StaticKVDecoder.supports(model)
    prompts, pad = encode(char_tok), char_tok.pad_token_id
    free = common.sample(model, prompts, T, [], pad, greedy=True)
    assert free.completion_lists() == generate_lists(model, prompts, T, [], pad)
    # EOS ids taken from the free run, so that rows stop at different steps (and get dropped)
    eos = sorted({free.completion_ids[0, 1].item(), free.completion_ids[2, 3].item(), free.completion_ids[4, 2].item()})
    ours = common.sample(model, prompts, T, eos, pad, greedy=True)
    assert ours.completion_lists() == generate_lists(model, prompts, T, eos, pad)
    assert ours.completion_mask.sum(1).min() < T


def test_unsupported_models_use_the_hf_forward(char_tok):
    from transformers import Qwen3Config

    sliding = Qwen3Config(
        vocab_size=len(char_tok),
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=0,
        layer_types=["sliding_attention", "sliding_attention"],
        **{**SMALL, "num_hidden_layers": 2},
    )
    assert not common._StaticKVDecoder.supports(Qwen3ForCausalLM(sliding))
    assert not common._StaticKVDecoder.supports(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("greedy, top_p", [(True, 1.0), (False, 1.0), (False, 0.8)])
@pytest.mark.parametrize("grow", [None, 2])
def test_dropping_finished_rows_changes_nothing(char_tok, monkeypatch, greedy, top_p, grow):
    """The fast decoder drops rows once half the batch has finished; the HF-forward path never
    does. Same seed: same tokens, row by row (the sampling noise is drawn for the whole batch).
    GROW = 2: the cache also grows every other step, before and after rows are dropped."""
    if grow:
        monkeypatch.setattr(common._StaticKVDecoder, "GROW", grow)
    model = random_model("qwen3", char_tok, seed=1)
    prompts, pad, T = encode(char_tok) * 3, char_tok.pad_token_id, 10
    kw = dict(greedy=greedy, temperature=1.3, top_p=top_p)
    free = common.sample(model, prompts, T, [], pad, generator=torch.Generator().manual_seed(4), **kw)
    # the first token of every other row is an EOS: those rows finish at step 0 or soon after
    eos = sorted({free.completion_ids[i, 0].item() for i in range(0, len(prompts), 2)})
    ours = common.sample(model, prompts, T, eos, pad, generator=torch.Generator().manual_seed(4), **kw)
    with monkeypatch.context() as m:
        m.setattr(common._StaticKVDecoder, "supports", classmethod(lambda cls, model: False))
        ref = common.sample(model, prompts, T, eos, pad, generator=torch.Generator().manual_seed(4), **kw)
    lengths = ours.completion_mask.sum(1)
    assert (lengths <= 1).sum() >= len(prompts) // 2 and lengths.max() > 2, "fixture: most rows stop at once"
    assert ours.completion_lists() == ref.completion_lists()
    assert torch.equal(ours.completion_mask, ref.completion_mask)


def test_sampler_leaves_no_inference_tensors_and_trains(char_tok):
    """The sampler decodes under inference_mode; what it returns must still feed a backward pass."""
    model = copy.deepcopy(random_model("qwen3", char_tok))
    roll = common.sample(
        model,
        encode(char_tok),
        5,
        [char_tok.eos_token_id],
        char_tok.pad_token_id,
        generator=torch.Generator().manual_seed(0),
    )
    assert not any(
        t.is_inference() for t in (roll.prompt_ids, roll.prompt_mask, roll.completion_ids, roll.completion_mask)
    )
    logp, _ = common.completion_logprobs(model, roll)
    (logp * roll.completion_mask).sum().backward()
    assert model.lm_head.weight.grad is not None
