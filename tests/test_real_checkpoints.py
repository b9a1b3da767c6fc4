"""A tiny random Qwen2 with a chat template and two EOS ids, trained 2 steps by each script on a GSM8K file."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import build_checkpoints  # tools/, on sys.path through conftest.py
import pytest
import torch
from helpers import main_in_process

import common

pytestmark = pytest.mark.slow  # subprocess or torchrun runs: the quick tier (-m "not slow") leaves them out

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SECOND_EOS = "<|eot|>"

GSM8K = [
    {
        "question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
        "answer": f"He has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b:,}",
    }
    for a, b in [(2, 3), (10, 7), (1200, 34), (5, 5), (8, 1), (40, 2), (3, 9), (11, 11), (6, 0), (7, 13)]
]


def build_tiny_qwen2(path: Path) -> Path:
    """A random Qwen2ForCausalLM + char tokenizer with a chat template and two EOS ids
    (<|im_end|>, the tokenizer's own, and <|eot|>, only in generation_config)."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tok = build_checkpoints.build_char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", SECOND_EOS]})
    tok.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id)  # fmt: skip
    model = Qwen2ForCausalLM(config)
    eos_ids = [tok.eos_token_id, tok.convert_tokens_to_ids(SECOND_EOS)]
    model.generation_config = GenerationConfig(eos_token_id=eos_ids, pad_token_id=tok.pad_token_id)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


# A reward that varies within a group whatever a random model writes (`--reward exact <file>:graded`): the exact
# answer alone scores every completion of a random model 0, so every advantage would be 0 and no update run,
# and a test of training could not tell a run that trains from one that never steps its optimizer.
GRADED_REWARD = """
def graded(prompts, completions, **kwargs):
    return [(sum(map(ord, c)) % 11) / 10 for c in completions]
"""


def graded_reward(folder: Path) -> str:
    path = folder / "graded.py"
    path.write_text(GRADED_REWARD)
    return f"{path}:graded"


def assert_trained(out: Path, model_dir: Path, rows: list[dict]):
    """The run trained: no update was skipped, each step's gradient was nonzero, and every weight tensor of
    out/final differs from model_dir's (AdamW moves every element with a gradient by about lr)."""
    from transformers import AutoModelForCausalLM

    assert all(r["skipped_updates"] == 0 and r["grad_norm"] > 0 for r in rows), rows
    start = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    final = AutoModelForCausalLM.from_pretrained(out / "final").state_dict()
    assert sorted(final) == sorted(start)
    unchanged = [k for k in start if torch.equal(final[k], start[k])]
    assert not unchanged, f"weights the run did not update: {unchanged}"


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> Path:
    return build_tiny_qwen2(tmp_path_factory.mktemp("qwen2") / "model")


@pytest.fixture(scope="module")
def gsm8k_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in GSM8K))
    return path


def test_gsm8k_loader_and_reward(gsm8k_file):
    train, held_out = common.load_task(str(gsm8k_file))
    assert len(train) + len(held_out) == len(GSM8K)
    gold = {r["answer"] for r in train + held_out}
    assert "1,234" in gold  # '#### 1,234': the text after ####, normalised only when scored
    assert common.score("so #### 1234.0", "1,234") == (1.0, 1.0)
    assert common.score("1234 apples", "1,234") == (0.0, 0.0)  # no single number: no answer, no format


def test_chat_template_applied(qwen2_dir):
    model, tok = common.load_model(str(qwen2_dir), torch.device("cpu"))
    ids = common.encode_prompts(tok, [{"prompt": "What is 2+3?", "answer": "5"}])[0]
    # whitespace is compared away: AutoTokenizer loads a model_type=qwen2 directory with
    # Qwen2Tokenizer, whose byte-level pre-tokenizer drops spaces from this char vocabulary
    text = "".join(tok.convert_ids_to_tokens(ids))
    squash = lambda s: "".join(s.split())  # noqa: E731
    assert text.startswith(squash("<|im_start|>system" + common.SYSTEM_PROMPT + "<|im_end|>"))
    assert squash("<|im_start|>user What is 2+3?<|im_end|>") in text
    assert text.endswith("<|im_start|>assistant")


def test_every_generation_config_eos_stops_sampling(qwen2_dir):
    model, tok = common.load_model(str(qwen2_dir), torch.device("cpu"))
    second = tok.convert_tokens_to_ids(SECOND_EOS)
    eos_ids = common.eos_token_ids(model, tok)
    assert sorted(eos_ids) == sorted([tok.eos_token_id, second]) and second != tok.eos_token_id
    # bias the model towards <|eot|>: with the attention and MLP outputs zeroed the final hidden state
    # is the normalised input embedding, all ones; the (tied) output row of <|eot|> is 2s, every
    # other row 1s, so <|eot|>'s logit leads by hidden_size = 32
    with torch.no_grad():
        model.model.embed_tokens.weight.fill_(1.0)
        model.model.embed_tokens.weight[second] = 2.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    prompts = common.encode_prompts(tok, [{"prompt": "1+1?", "answer": "2"}] * 3)
    gen = torch.Generator().manual_seed(0)
    roll = common.sample(model, prompts, 8, eos_ids, tok.pad_token_id, generator=gen)
    assert roll.completion_ids[:, 0].tolist() == [second] * 3  # stopped at the second EOS id
    assert roll.completion_mask.sum(1).tolist() == [1.0] * 3 and roll.completion_ids.shape[1] == 1
    # and without that id in the list, sampling would have run on to the token limit
    roll = common.sample(model, prompts, 8, [tok.eos_token_id], tok.pad_token_id, generator=gen)
    assert roll.completion_mask.sum(1).tolist() == [8.0] * 3


@pytest.mark.parametrize(
    "algo,flags",
    [
        ("grpo", ["--group-size", "2", "--loss-agg", "token-mean"]),
        ("gspo", ["--group-size", "2"]),
        ("ppo", ["--group-size", "1"]),
    ],
)
def test_script_trains_real_checkpoint_on_gsm8k(qwen2_dir, gsm8k_file, tmp_path, capsys, algo, flags):
    out = tmp_path / algo
    argv = ["--model", qwen2_dir, "--data", gsm8k_file, "--steps", 2, "--prompts-per-step", 2, "--minibatches", 1,
            "--max-new-tokens", 8, "--eval-size", 1, "--device", "cpu", "--out", out, "--reward", "exact",
            graded_reward(tmp_path), "--grad-checkpointing", *flags]  # fmt: skip
    status, _, err = main_in_process(importlib.import_module(algo), argv, capsys)  # in this process: no torch import
    assert status == 0, err[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert (out / "final" / "config.json").is_file() and (out / "final" / "tokenizer_config.json").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "jsonl" and summary["args"]["grad_checkpointing"]
    assert_trained(out, qwen2_dir, rows)
