"""Qwen3's vendored tokenizer and --model tiny-qwen3: the template's generation prompt, two EOS ids (one the pad
id), special tokens dropped on decode, byte-level text, and the real vocabulary's chunked log-probs."""

from __future__ import annotations

import copy
import hashlib
import json
import math

import pytest
import torch
from helpers import entropy_tol, forward_roundings, logit_scale, logprob_tol, main_in_process, probable_gamma

import common
import gspo
from extras import data_files, qwen3_tokenizer

IM_START, IM_END, ENDOFTEXT = 151644, 151645, 151643  # <|im_start|>, <|im_end|> (EOS), <|endoftext|> (pad, EOS too)
ASSISTANT, NEWLINE = 77091, 198  # "assistant", "\n"


@pytest.fixture(scope="module")
def tok():
    return common.load_tokenizer(common.TINY_QWEN3)


@pytest.fixture(scope="module")
def model():
    m, _ = common.load_model(common.TINY_QWEN3, torch.device("cpu"))
    return m


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


# --- The vendored files and the tiny model ---


def test_vendored_files_decompress_to_the_packaged_ones(tok):
    folder = qwen3_tokenizer.tokenizer_dir()
    for name, sha in qwen3_tokenizer.FILES.items():
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == sha, name
    assert type(tok).__name__ == "Qwen2Tokenizer" and len(tok) == 151_669
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token, tok.pad_token_id) == (
        "<|im_end|>", IM_END, "<|endoftext|>", ENDOFTEXT)  # fmt: skip
    assert tok.unk_token_id is None and tok.padding_side == "left"


def test_tiny_qwen3_has_qwen3s_vocabulary_and_stop_ids(model, tok):
    assert model.config.vocab_size == 151_936 and model.get_output_embeddings().weight.shape[0] == 151_936
    assert common.eos_token_ids(model, tok) == [IM_END, ENDOFTEXT]
    assert model.generation_config.pad_token_id == ENDOFTEXT
    # built from a fixed seed: the same weights in every cache
    first = model.get_input_embeddings().weight[IM_END, :4]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(qwen3_tokenizer.SEED)
        from transformers import Qwen3Config, Qwen3ForCausalLM

        again = Qwen3ForCausalLM(Qwen3Config(**qwen3_tokenizer.CONFIG)).get_input_embeddings().weight[IM_END, :4]
    torch.testing.assert_close(first, again, atol=0, rtol=0)


# --- The chat template's generation prompt ---

# <|im_start|>user\nWhat is 2+3?<|im_end|>\n
USER_TURN = [IM_START, 872, NEWLINE, 3838, 374, 220, 17, 10, 18, 30, IM_END, NEWLINE]
GENERATION_PROMPT = [IM_START, ASSISTANT, NEWLINE]  # <|im_start|>assistant\n
SYSTEM_TURN = [IM_START, 8948, NEWLINE, 3430, 9814, 13, IM_END, NEWLINE]  # <|im_start|>system\nBe brief.<|im_end|>\n


EMPTY_THINK = [151667, 271, 151668, 271]  # <think>\n\n</think>\n\n ("\n\n" is one token, 271)
AFTER = {"on": [], "off": EMPTY_THINK}  # --thinking off: the template closes an empty think block itself


@pytest.mark.parametrize("thinking", ["on", "off"])
@pytest.mark.parametrize("system", ["", "Be brief."])
def test_generation_prompt_ids(tok, thinking, system):
    (prompt,) = common.encode_prompts(tok, [{"prompt": "What is 2+3?"}], system, thinking)
    assert prompt == (SYSTEM_TURN if system else []) + USER_TURN + GENERATION_PROMPT + AFTER[thinking]


def test_thinking_reaches_only_templates_that_take_it(tok, char_tok):
    """Qwen3's template reads enable_thinking; a two-line template without it (and the tiny model's plain
    prompts) get the same ids whatever --thinking says, and no keyword they do not know."""
    assert common.thinking_kwargs(tok, "on") == {"enable_thinking": True}
    assert common.thinking_kwargs(tok, "off") == {"enable_thinking": False}
    assert tok.decode(common.encode_prompts(tok, [{"prompt": "Hi"}], "", "off")[0]).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")  # fmt: skip
    two_line = copy.deepcopy(char_tok)
    two_line.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant: "
    assert common.thinking_kwargs(two_line, "on") == {}
    on, off = (common.encode_prompts(two_line, [{"prompt": "1+1="}], "S", t) for t in ("on", "off"))
    assert on == off == [ids(char_tok, "system: S\nuser: 1+1=\nassistant: ")]
    plain = [common.encode_prompts(char_tok, [{"prompt": "1+1="}], "S", t) for t in ("on", "off")]
    assert plain == [[ids(char_tok, "1+1=")]] * 2


def test_reward_model_text_follows_the_completions_thinking(tok):
    """The reward model's assistant turn: an empty think block under --thinking off, the completion's own under on."""
    from extras.reward_model import reward_model_text

    turn = "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    assert reward_model_text(tok, "What is 2+3?", "5", "off") == turn + "<think>\n\n</think>\n\n5<|im_end|>\n"
    reasoned = "<think>\n2+3 is 5\n</think>\n\n5"
    assert reward_model_text(tok, "What is 2+3?", reasoned, "on") == turn + reasoned + "<|im_end|>\n"
    (prompt,) = common.encode_prompts(tok, [{"prompt": "What is 2+3?"}], "", "off")
    assert reward_model_text(tok, "What is 2+3?", "5", "off").startswith(tok.decode(prompt))


# --- EOS [151645, 151643] with pad 151643 ---


def test_completion_ends_respects_the_mask():
    """Rows built by Rollout.from_lists and padded with <|endoftext|>, which is also an EOS id: a row that
    never ended is padded with an EOS id, and that padding must not count as its ending."""
    five, plus = 20, 10  # "5", "+"
    roll = common.Rollout.from_lists(
        [[IM_START]] * 5,
        [
            [five, IM_END],  # ended by <|im_end|>
            [five, ENDOFTEXT],  # ended by <|endoftext|>
            [five],  # cut short, then padded with ENDOFTEXT
            [five, plus, five],  # cut at the longest length: no padding
            [],  # nothing generated, all padding
        ],
        pad_id=ENDOFTEXT,
    )
    assert roll.completion_ids[2, 1:].tolist() == [ENDOFTEXT, ENDOFTEXT]  # the case: padding holds an EOS id
    assert common.completion_ends(roll, [IM_END, ENDOFTEXT]).tolist() == [True, True, False, False, False]
    assert common.completion_ends(roll, [IM_END]).tolist() == [True, False, False, False, False]


@pytest.mark.parametrize("stop", [IM_END, ENDOFTEXT])
def test_sampling_stops_at_either_eos_id(model, tok, stop):
    """An output head that can only say `stop`: every row is exactly [stop] with mask [1], and it has
    ended (the pad id, when it is the token sampled, is a real EOS)."""
    forced = copy.deepcopy(model)
    with torch.no_grad():
        forced.lm_head.weight.zero_()  # (tied: the embedding too; the final norm's output is forced below)
        forced.lm_head.weight[stop] = 1.0
    forced.model.norm.register_forward_hook(lambda module, inputs, output: torch.ones_like(output))
    prompts = common.encode_prompts(tok, [{"prompt": f"What is {a}+3?"} for a in range(3)], system_prompt="")
    eos = common.eos_token_ids(forced, tok)
    for greedy in (True, False):
        roll = common.sample(forced, prompts, 6, eos, tok.pad_token_id, greedy=greedy,
                             generator=torch.Generator().manual_seed(0))  # fmt: skip
        assert roll.completion_lists() == [[stop]] * 3 and roll.completion_mask.tolist() == [[1.0]] * 3
        assert common.completion_ends(roll, eos).all()


# --- Decoded completions carry no template tokens ---


def test_decoded_completions_carry_no_template_tokens(tok):
    """What the rewards and the shown samples read: '5', not '5<|im_end|>' (whose number the exact
    parser would not find), whichever EOS ended the row, and without the padding after it."""
    completions = [ids(tok, "5") + [IM_END], ids(tok, "5") + [ENDOFTEXT], ids(tok, "2+3=5") + [IM_END]]
    roll = common.Rollout.from_lists([[IM_START, ASSISTANT, NEWLINE]] * 3, completions, pad_id=ENDOFTEXT)
    records = [{"prompt": "What is 2+3?", "answer": "5"}] * 3
    rewards, parts = common.Rewards(["exact"], records=records)(tok, roll, records)
    assert rewards.tolist() == [1.0, 1.0, 0.0] and parts["format_rate"].tolist() == [1.0, 1.0, 0.0]
    shown = common._described(tok, roll, records, rewards, parts, [IM_END, ENDOFTEXT])
    assert [s["completion"] for s in shown] == ["5", "5", "2+3=5"]
    assert not any("<|" in s["completion"] for s in shown)
    assert [s["truncated"] for s in shown] == [False, False, False]


# --- Multi-byte text: a byte-level tokenizer has no unknown token ---

MULTI_BYTE = "3加5等于多少？ Combien font trois et cinq, s'il te plaît ? Ελληνικά, naïve café, 😀"


def test_multi_byte_text_is_accepted_and_round_trips(tok, char_tok):
    assert data_files.unknown_characters(tok, MULTI_BYTE) == set()
    data_files.check_characters(tok, common.TINY_QWEN3, "--data", [{"prompt": MULTI_BYTE, "answer": "八"}])  # no error
    assert tok.decode(ids(tok, MULTI_BYTE)) == MULTI_BYTE
    # the same records are refused by the tiny model's character tokenizer (the check is live)
    assert {"加", "ï", "😀"} <= data_files.unknown_characters(char_tok, MULTI_BYTE)
    with pytest.raises(common.UsageError, match="cannot represent"):
        data_files.check_characters(char_tok, "tiny", "--data", [{"prompt": MULTI_BYTE, "answer": "8"}])


# --- The real vocabulary's cost: chunked log-probs ---


@pytest.mark.slow  # 151,936-word logits (~8 s)
def test_chunked_logprobs_equal_the_plain_ones_at_the_real_vocabulary(model, tok):
    prompts = common.encode_prompts(tok, [{"prompt": "What is 2+3?"}, {"prompt": "3加5?"}], system_prompt="")
    roll = common.sample(model, prompts * 4, 40, [], tok.pad_token_id, generator=torch.Generator().manual_seed(0))
    chunk = common.LOGITS_CHUNK_ELEMENTS // 151_936
    assert roll.completion_mask.sum() > 2 * chunk, "fixture: the rollout must span several chunks"
    weight = model.get_output_embeddings().weight
    grads = []
    for chunk_tokens in ("auto", None):
        logp, entropy = common.completion_logprobs(model, roll, chunk_tokens=chunk_tokens)
        (weight_grad,) = torch.autograd.grad((logp * roll.completion_mask).sum(), weight)
        grads.append((logp.detach(), entropy, weight_grad))
    # one forward, its logits made in chunks or at once: helpers' forward model bounds each (log p, entropy, and
    # the head's gradient relative to its size, as in test_common's chunked test)
    length, max_z = logit_scale(model, roll)
    (lp_c, ent_c, g_c), (lp_p, ent_p, g_p) = grads
    torch.testing.assert_close(lp_c, lp_p, atol=logprob_tol(model.config, length, max_z), rtol=0)
    torch.testing.assert_close(ent_c, ent_p, atol=entropy_tol(model.config, length, max_z), rtol=0)
    grad_tol = 2 * probable_gamma(forward_roundings(model.config, length)) * g_p.abs().max().item()
    torch.testing.assert_close(g_c, g_p, atol=grad_tol, rtol=0)


REWARD = "def length_mod_3(completions, **kwargs):\n    return [float(len(c) % 3) for c in completions]\n"


# the slow tier (13-16 s here): with it the quick tier took 119 s of its 120 s budget (2-core EPYC, idle);
# the quick tier keeps the real vocabulary's tokenizer and sampling tests above
@pytest.mark.slow
def test_one_gspo_step_at_the_real_vocabulary(tmp_path, capsys):
    """gspo.py, one step at 151,936 words, with more forwarded tokens than one log-prob chunk holds
    (--thinking off; on, one step of each script: test_flags_reach_update)."""
    (tmp_path / "reward.py").write_text(REWARD)
    out, rows, tokens = tmp_path / "run", 16, 16
    assert rows * tokens > 2 * (common.LOGITS_CHUNK_ELEMENTS // 151_936), "the step must span several chunks"
    argv = ["--model", common.TINY_QWEN3, "--steps", "1", "--prompts-per-step", "4", "--group-size", "4",
            "--minibatches", "1", "--max-new-tokens", str(tokens), "--eval-every", "0", "--eval-size", "4",
            "--thinking", "off", "--reward", f"{tmp_path / 'reward.py'}:length_mod_3", "--out", str(out)]  # fmt: skip
    status, _, err = main_in_process(gspo, argv, capsys)
    assert status == 0, err[-3000:]
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert row["step"] == 1 and row["zero_std_frac"] < 1, row  # some groups had signal: their rows were forwarded
    assert math.isfinite(row["loss"]) and row["grad_norm"] > 0 and row["entropy"] > 0, row
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == common.TINY_QWEN3
