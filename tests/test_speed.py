"""The sampler's own decoder (static KV cache, dropped rows) against Hugging Face, for each architecture it takes."""

import copy

import pytest
import torch
import transformers as tf
from helpers import greedy_generate

import common

PROMPTS = ["1+2=", "12+34=", "99+99=abc", "7", "5+5=10 and 3+", "8*8="]
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128, initializer_range=0.3)  # fmt: skip
ARCHS = {
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(head_dim=8)),
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict()),  # q/k/v biases, no q/k norm
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(head_dim=8)),
}


def random_model(arch, tok, seed=0):
    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(seed)
    config = config_cls(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                        bos_token_id=None, tie_word_embeddings=False, **SMALL, **extra)  # fmt: skip
    model = model_cls(config).eval()
    if arch == "qwen2":  # random biases, so that a dropped bias would show
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.3)
    model.generation_config = tf.GenerationConfig(eos_token_id=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    return model


def encode(tok):
    return [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


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
    assert free.completion_lists() == greedy_generate(model, prompts, T, [], pad)
    # EOS ids taken from the free run, so that rows stop at different steps (and get dropped)
    eos = sorted({free.completion_ids[0, 1].item(), free.completion_ids[2, 3].item(), free.completion_ids[4, 2].item()})
    ours = common.sample(model, prompts, T, eos, pad, greedy=True)
    assert ours.completion_lists() == greedy_generate(model, prompts, T, eos, pad)
    assert ours.completion_mask.sum(1).min() < T


def test_unsupported_models_use_the_hf_forward(char_tok):
    sliding = tf.Qwen3Config(vocab_size=len(char_tok), use_sliding_window=True, sliding_window=4, max_window_layers=0,
                          layer_types=["sliding_attention", "sliding_attention"], **SMALL)  # fmt: skip
    assert not common._StaticKVDecoder.supports(tf.Qwen3ForCausalLM(sliding))
    assert not common._StaticKVDecoder.supports(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("greedy, top_p", [(True, 1.0), (False, 1.0), (False, 0.8)])
@pytest.mark.parametrize("grow", [None, 2])
def test_dropping_finished_rows_changes_nothing(char_tok, monkeypatch, greedy, top_p, grow):
    """Dropping finished rows (and growing the cache, GROW = 2) changes no token: same seed, same tokens."""
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
    g = torch.Generator().manual_seed(0)
    roll = common.sample(model, encode(char_tok), 5, [char_tok.eos_token_id], char_tok.pad_token_id, generator=g)
    tensors = (roll.prompt_ids, roll.prompt_mask, roll.completion_ids, roll.completion_mask)
    assert not any(t.is_inference() for t in tensors)
    logp, _ = common.completion_logprobs(model, roll)
    (logp * roll.completion_mask).sum().backward()
    assert model.lm_head.weight.grad is not None
