"""--reward-model and tools/train_reward_model.py: the Bradley-Terry loss, batch-independent scores,
re-tokenisation, the saved checkpoint, bad checkpoints, tiny-rm's build and a short run of each script."""

import importlib
import json
import math
import random
import types

import build_checkpoints  # tools/, on sys.path through conftest.py
import helpers
import numpy as np
import pytest
import recipes
import torch
import train_reward_model  # tools/
import transformers
from helpers import LOGGED_TOL, assert_within, gamma, logit_scale, logit_tol, logprob_tol, unit_roundoff

import common
import grpo
from extras import reward_model as reward_model_extra

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             head_dim=16, max_position_embeddings=128)  # fmt: skip


def small_config(tok, **kw):
    return transformers.Qwen3Config(vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                                    eos_token_id=tok.eos_token_id, bos_token_id=None, **SMALL, **kw)  # fmt: skip


def save_classifier(path, tok, num_labels=1, seed=0):
    torch.manual_seed(seed)
    model = transformers.Qwen3ForSequenceClassification(small_config(tok, num_labels=num_labels))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def save_causal_lm(path, tok, seed=0):
    torch.manual_seed(seed)
    transformers.Qwen3ForCausalLM(small_config(tok)).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


PROMPTS = ["3+4=", "12+30=", "99+99=", "0+0=", "7+15="]
COMPLETIONS = ["7", "42 or 43", "", "0000000000", "22"]


# --- The Bradley-Terry loss ---


def test_bradley_terry_loss_hand_case():
    """chosen [1, 0], rejected [0, 2]: loss = (log(1 + e^-1) + log(1 + e^2)) / 2; its gradient on
    r_chosen is -sigmoid(r_rejected - r_chosen) / 2 and on r_rejected the opposite."""
    chosen = torch.tensor([1.0, 0.0], dtype=torch.float64, requires_grad=True)
    rejected = torch.tensor([0.0, 2.0], dtype=torch.float64, requires_grad=True)
    loss = train_reward_model.bradley_terry_loss(chosen, rejected)
    loss.backward()
    expected = (math.log1p(math.exp(-1)) + math.log1p(math.exp(2))) / 2
    # per term a subtraction, exp and log1p (2u each), of size <= 2.13, then their mean (2): each side
    assert loss.item() == pytest.approx(expected, abs=2 * gamma(8) * 2.2)
    assert loss.item() == pytest.approx(1.2200948, abs=5e-8)  # the docstring's figure, rounded to 7 decimals
    sig = [1 / (1 + math.exp(1)), 1 / (1 + math.exp(-2))]  # sigmoid(r - c)
    # sigmoid: a subtraction, exp (2), an addition and a division, then / 2: each side, of size <= 1
    assert chosen.grad.tolist() == pytest.approx([-sig[0] / 2, -sig[1] / 2], abs=2 * gamma(7))
    assert rejected.grad.tolist() == pytest.approx([sig[0] / 2, sig[1] / 2], abs=2 * gamma(7))


@pytest.mark.numeric
def test_bradley_terry_loss_float32_matches_float64_and_stays_finite():
    g = torch.Generator().manual_seed(0)
    c = torch.randn(257, generator=g, dtype=torch.float64) * 30  # gaps up to ~100: log-sigmoid must not overflow
    r = torch.randn(257, generator=g, dtype=torch.float64) * 30
    c32, r32 = c.float().requires_grad_(), r.float().requires_grad_()
    c64, r64 = c.clone().requires_grad_(), r.clone().requires_grad_()
    loss32, loss64 = train_reward_model.bradley_terry_loss(c32, r32), train_reward_model.bradley_terry_loss(c64, r64)
    loss32.backward()
    loss64.backward()
    assert torch.isfinite(loss32)
    # float32 against float64: the inputs round (u |c|, u |r|) and so does their gap (u |c - r|), moving each
    # softplus(r - c) by as much (its slope is <= 1) and each sigmoid by a quarter of it; each term's own
    # roundings (log-sigmoid or sigmoid: 4) are relative to it; the mean sums 257 terms, the gradient divides by N
    u, n = unit_roundoff(torch.float32), c.numel()
    moved = u * (c.abs() + r.abs() + (c - r).abs())
    softplus, sigmoid = torch.nn.functional.softplus(r - c), torch.sigmoid(r - c)
    loss_tol = (moved + gamma(4, torch.float32) * softplus).mean() + gamma(n + 1, torch.float32) * softplus.mean()
    assert loss32.item() == pytest.approx(loss64.item(), abs=loss_tol.item())
    grad_tol = (moved / 4 + gamma(5, torch.float32) * sigmoid) / n
    assert_within(c32.grad, c64.grad, grad_tol, "d/dchosen")
    assert_within(r32.grad, -c64.grad, grad_tol, "d/drejected")


def test_pair_accuracy_hand_case():
    scores = torch.tensor([3.0, 1.0, 2.0, 0.0])
    correct = torch.tensor([1.0, 1.0, 0.0, 0.0])  # pairs (3,2) (3,0) (1,2) (1,0): 3 of 4 ordered rightly
    assert reward_model_extra.pair_accuracy(scores, correct).tolist() == [0.75] * 4
    assert reward_model_extra.pair_accuracy(scores, torch.ones(4)).tolist() == [0.5] * 4  # no wrong row: no pair


# --- Scoring ---


@pytest.fixture
def classifier(tmp_path, char_tok):
    path = save_classifier(tmp_path / "rm", char_tok)
    return reward_model_extra.load_reward_model(path, torch.device("cpu"))


@pytest.mark.numeric
def test_scores_do_not_depend_on_batch_composition_or_padding_side(classifier):
    model, tok = classifier
    together = reward_model_extra.reward_model_scores(model, tok, PROMPTS, COMPLETIONS)
    alone = torch.cat(
        [reward_model_extra.reward_model_scores(model, tok, [p], [c]) for p, c in zip(PROMPTS, COMPLETIONS)]
    )
    reversed_ = reward_model_extra.reward_model_scores(model, tok, PROMPTS[::-1], COMPLETIONS[::-1]).flip(0)
    in_pairs = reward_model_extra.reward_model_scores(model, tok, PROMPTS, COMPLETIONS, batch_size=2)
    tok.padding_side = "left"  # the tokenizer's own side does not matter: scoring pads on the right
    left = reward_model_extra.reward_model_scores(model, tok, PROMPTS, COMPLETIONS)
    # the score, a linear head on the last real token's hidden state, like a logit: two float32 forwards
    # (helpers.logit_tol) over at most `length` positions
    length = max(len(tok(p + c)["input_ids"]) for p, c in zip(PROMPTS, COMPLETIONS)) + 2
    tol = logit_tol(model.config, length, together.abs().max().item())
    for other in (alone, reversed_, in_pairs, left):
        torch.testing.assert_close(together, other, atol=tol, rtol=0)
    assert together.std() > 0  # a random head still tells the texts apart


class SpyScorer(torch.nn.Module):
    """Stands in for a classifier: records what it is given; scores a row by the sum of its ids."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen = []

    def forward(self, input_ids, attention_mask):
        self.seen.append((input_ids, attention_mask))
        return types.SimpleNamespace(logits=(input_ids * attention_mask).sum(1, keepdim=True).float())


def other_tokenizer():
    """A different tokenizer from the policy's: other ids for the same characters, and a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = ["<pad>", "</s>", "<unk>"] + recipes.TINY_CHARS[::-1]
    core = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # "." skips "\n"
    core.decoder = decoders.Fuse()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="</s>",
                                               unk_token="<unk>")  # fmt: skip
    tok.chat_template = "{% for m in messages %}{{ m.role[0] | upper }}:{{ m.content }}\n{% endfor %}"
    return tok


def test_retokenisation_gives_the_reward_model_the_same_text(char_tok):
    """A reward model with another tokenizer reads its own template around the decoded text; the reward is its score."""
    rm_tok = other_tokenizer()
    rm = object.__new__(reward_model_extra.RewardModel)
    rm.model, rm.tok, rm.batch_size, rm.thinking = SpyScorer(), rm_tok, 64, "off"
    records = [{"prompt": p, "answer": "7"} for p in PROMPTS]
    eos = char_tok.eos_token_id
    completions = [char_tok(c)["input_ids"] + [eos] for c in COMPLETIONS]
    roll = common.Rollout.from_lists([char_tok(p)["input_ids"] for p in PROMPTS], completions, char_tok.pad_token_id)
    rewards, parts = common.Rewards([], (), records, rm)(char_tok, roll, records)

    (ids, attention), = rm.model.seen  # fmt: skip
    texts = [rm_tok.decode(row[m.bool()]) for row, m in zip(ids, attention)]
    assert texts == [f"U:{p}\nA:{c}\n" for p, c in zip(PROMPTS, COMPLETIONS)]
    assert texts[0] == reward_model_extra.reward_model_text(rm_tok, PROMPTS[0], COMPLETIONS[0])
    assert rm_tok("7")["input_ids"] != char_tok("7")["input_ids"]  # really another vocabulary
    assert rewards.tolist() == parts["reward/reward_model"].tolist() == (ids * attention).sum(1).float().tolist()
    assert set(parts) == {"reward/reward_model", "accuracy", "format_rate", "reward_model_pair_acc"}
    assert parts["accuracy"].tolist() == [1, 0, 0, 0, 0]  # accuracy is still the exact match, not the proxy


def test_reward_model_is_one_weighted_component(char_tok):
    rm = object.__new__(reward_model_extra.RewardModel)
    rm.model, rm.tok, rm.batch_size, rm.thinking = SpyScorer(), other_tokenizer(), 64, "off"
    records = [{"prompt": p, "answer": c} for p, c in zip(PROMPTS, ["7", "1", "2", "0", "22"])]
    completions = [char_tok(c)["input_ids"] for c in COMPLETIONS]
    roll = common.Rollout.from_lists([char_tok(p)["input_ids"] for p in PROMPTS], completions, char_tok.pad_token_id)
    rewards, parts = common.Rewards(["exact"], [2.0], records, rm, 0.5)(char_tok, roll, records)
    (ids, attention), = rm.model.seen  # fmt: skip
    scores = (ids * attention).sum(1).double()  # the spy's score: its ids' sum, an integer
    assert parts["reward/reward_model"].double().tolist() == scores.tolist()
    expected = 2.0 * parts["reward/exact"].double() + 0.5 * scores
    # float32: 2 x and 0.5 x are exact, their sum one rounding; the expected float64 rounded to float32 once
    torch.testing.assert_close(rewards, expected.float(), atol=0, rtol=2 * unit_roundoff(torch.float32))


# --- Training and checkpoints ---


def write_pairs(path, n=24):
    rows = [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i + 2)} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_trained_reward_model_round_trips_through_auto_classes(tmp_path, char_tok):
    base = save_causal_lm(tmp_path / "lm", char_tok)
    pairs = write_pairs(tmp_path / "pairs.jsonl")
    out = tmp_path / "rm"
    result = train_reward_model.train_reward_model(pairs, base, out, steps=3, batch_size=4, eval_frac=0.25, log=None)
    assert 0 <= result["pairwise_accuracy"] <= 1 and result["eval_pairs"] == 6 and result["train_pairs"] == 18
    loaded = transformers.AutoModelForSequenceClassification.from_pretrained(out)
    assert type(loaded).__name__ == "Qwen3ForSequenceClassification" and loaded.config.num_labels == 1
    reward_model_extra.check(str(out))  # what --reward-model accepts
    model, tok = reward_model_extra.load_reward_model(str(out), torch.device("cpu"))
    base_lm = transformers.AutoModelForCausalLM.from_pretrained(base)
    assert not torch.equal(model.model.embed_tokens.weight, base_lm.model.embed_tokens.weight)  # trained
    with torch.no_grad():
        a = reward_model_extra.reward_model_scores(model, tok, PROMPTS, COMPLETIONS)
        b = reward_model_extra.reward_model_scores(loaded.eval(), tok, PROMPTS, COMPLETIONS)
    # one checkpoint, one architecture, the same inputs: the same kernels, so the same scores bit for bit
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    # a float32 mean of 0/1 flags (exact count, one division) against a plain loop's float64 one
    chosen, rejected = (reward_model_extra.reward_model_scores(model, tok, [p["prompt"] for p in pairs],
                                                               [p[k] for p in pairs]).tolist()
                        for k in ("chosen", "rejected"))  # fmt: skip
    ordered = sum(c > r for c, r in zip(chosen, rejected)) / len(pairs)
    share = unit_roundoff(torch.float32) + unit_roundoff(torch.float64)
    assert train_reward_model.pairwise_accuracy(model, tok, pairs) == pytest.approx(ordered, rel=share)


@pytest.mark.slow
def test_train_reward_model_command_line(tmp_path, char_tok, capsys):
    """The tool's main() in this process (its __main__ calls it alone): a run, then a missing --data in one line."""
    base = save_causal_lm(tmp_path / "lm", char_tok)
    write_pairs(tmp_path / "pairs.jsonl")
    argv = ["--data", str(tmp_path / "pairs.jsonl"), "--model", base, "--out", str(tmp_path / "rm"), "--steps", "2",
            "--batch-size", "4"]  # fmt: skip
    train_reward_model.main(argv)
    assert "held-out pairwise accuracy" in capsys.readouterr().out
    assert (tmp_path / "rm" / "config.json").is_file()
    with pytest.raises(SystemExit) as stop:
        train_reward_model.main([argv[0], str(tmp_path / "missing.jsonl"), *argv[2:]])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("error: --data") and err.count("\n") == 1, err


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["missing", "causal-lm", "two-labels", "not-a-checkpoint"])
def test_bad_reward_model_exits_2_with_one_line(tmp_path, capsys, char_tok, kind):
    path = {
        "missing": lambda: str(tmp_path / "nowhere"),
        "causal-lm": lambda: save_causal_lm(tmp_path / "lm", char_tok),
        "two-labels": lambda: save_classifier(tmp_path / "rm2", char_tok, num_labels=2),
        "not-a-checkpoint": lambda: (tmp_path / "empty").mkdir() or str(tmp_path / "empty"),
    }[kind]()
    with pytest.raises(common.UsageError) as e:  # the check itself, in process
        reward_model_extra.check(path)
    expected = {"missing": "no such", "causal-lm": "Qwen3ForCausalLM, not a sequence classifier",
                "two-labels": "has 2 labels", "not-a-checkpoint": "no such"}[kind]  # fmt: skip
    assert expected in str(e.value)
    if kind != "not-a-checkpoint":  # and through a script (in this process): exit 2, one line, nothing written
        out = tmp_path / "out"
        status, _, err = helpers.main_in_process(grpo, ["--reward-model", path, "--steps", 1, "--out", out], capsys)
        assert status == 2 and err.startswith("error: --reward-model") and err.count("\n") == 1, err[-2000:]
        assert expected in err and not out.exists()


def test_kl_to_init_is_zero_for_the_initial_policy_and_absent_without_it(tmp_path, char_tok):
    model = transformers.AutoModelForCausalLM.from_pretrained(save_causal_lm(tmp_path / "lm", char_tok))
    completions = [char_tok(c or "1")["input_ids"] for c in COMPLETIONS]
    roll = common.Rollout.from_lists([char_tok(p)["input_ids"] for p in PROMPTS], completions, char_tok.pad_token_id)
    logp = common.completion_logprobs(model, roll)[0]
    assert reward_model_extra.kl_to_init(model, roll, logp) == {"kl_to_init": 0.0}
    assert reward_model_extra.kl_to_init(None, roll, logp) == {}


def test_kl_to_init_sums_over_real_completion_tokens_only(tiny_path):
    """kl_to_init against a float64 loop over each row alone; a sum letting padding in would differ."""
    policy = transformers.AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    init = transformers.AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in init.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    tok = transformers.AutoTokenizer.from_pretrained(tiny_path)
    prompts = [tok(p)["input_ids"] for p in ("1+2=", "12+34=", "7+80=")]
    completions = [tok(c)["input_ids"] + [tok.eos_token_id] for c in ("3", "46", "8")]  # lengths 2, 3, 2
    roll = common.Rollout.from_lists(prompts, completions, tok.pad_token_id)
    with torch.no_grad():
        logp = common.completion_logprobs(policy, roll)[0]
        got = reward_model_extra.kl_to_init(init, roll, logp)["kl_to_init"]
        per_row = []
        for p, c in zip(prompts, completions):
            ids = torch.tensor([p + c])
            total = 0.0
            for model, sign in ((policy, 1.0), (init, -1.0)):
                logits = model(input_ids=ids).logits[0].double()  # [P + T, V]
                logps = logits.log_softmax(-1)
                for t, token in enumerate(c):  # position len(p) - 1 + t predicts completion token t
                    total += sign * logps[len(p) - 1 + t, token].item()
            per_row.append(total)
        init_logp = common.completion_logprobs(init, roll)[0]
    expected = sum(per_row) / len(per_row)
    # per token two log-probs, each from batched float32 forwards against one row's (helpers.logprob_tol); a row
    # sums <= 3 tokens' differences
    length, max_z = logit_scale(policy, roll)
    max_z = max(max_z, logit_scale(init, roll)[1])
    tol = 3 * 2 * logprob_tol(policy.config, length, max_z)
    assert got == pytest.approx(expected, abs=tol)
    # the self-check: the padding positions differ enough that a sum letting in any one of them (it would move
    # the figure by its difference / rows) fails the comparison above by a margin
    pad = roll.completion_mask == 0
    assert pad.sum() == 2  # rows 1 and 3, at their third position
    leaks = (logp - init_logp)[pad].abs() / len(prompts)
    assert leaks.min().item() > 2 * tol, (leaks.tolist(), tol)


FAST_RM_RECIPE = dict(recipes.TINY_RM_RECIPE, prompts=16, policy_prompts=4, policy_samples=2, steps=2, batch=4)


def test_building_tiny_rm_leaves_the_random_state_alone(tmp_path):
    """A two-step recipe: the build is deterministic, saves a checkpoint --reward-model loads, and
    the caller's torch, numpy and Python random streams continue as if nothing had run."""
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    threads = torch.get_num_threads()
    report = build_checkpoints.build_tiny_reward_model(tmp_path / "a", FAST_RM_RECIPE)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    assert torch.get_num_threads() == threads
    assert 0 <= report["pairwise_accuracy"] <= 1 and report["steps"] == 2
    build_checkpoints.build_tiny_reward_model(tmp_path / "b", FAST_RM_RECIPE)
    a = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "a")
    b = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "b")
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name
    reward_model_extra.check(str(tmp_path / "a"))


def test_preference_pairs_cover_the_failure_shapes():
    examples = [{"prompt": "58+67=", "answer": "125"}] * 200
    pairs = train_reward_model.arith_preference_pairs(examples, seed=0)
    rejected = {p["rejected"] for p in pairs}
    assert {p["chosen"] for p in pairs} == {"125"}
    assert {"", "115", "124", "126", "135", "15", "125+67", "125=125", "12512512"} <= rejected  # "15": no carries
    assert all(not common.score(r, "125")[0] for r in rejected)  # every rejected answer is wrong


@pytest.mark.slow
@pytest.mark.parametrize("script", ["ppo", "grpo", "gspo"])
def test_each_script_trains_on_a_reward_model(tmp_path, capsys, char_tok, script):
    rm = save_classifier(tmp_path / "rm", char_tok)
    out = tmp_path / "run"
    argv = ["--reward-model", rm, "--steps", 2, "--prompts-per-step", 4, "--group-size", 2, "--minibatches", 2,
            "--eval-size", 8, "--eval-every", 1, "--out", out]  # fmt: skip
    status, _, err = helpers.main_in_process(importlib.import_module(script), argv, capsys)  # in this process
    assert status == 0, err[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        assert r["reward"] == pytest.approx(r["reward/reward_model"], abs=LOGGED_TOL)  # alone: weight 1
        assert "reward/exact" not in r and 0 <= r["accuracy"] <= 1  # the true metric stays
        assert math.isfinite(r["kl_to_init"]) and 0 <= r["reward_model_pair_acc"] <= 1
        assert math.isfinite(r["eval_reward"]) and 0 <= r["eval_accuracy"] <= 1
        assert r["eval_reward/reward_model"] == pytest.approx(r["eval_reward"], abs=LOGGED_TOL)
    # step 1 samples from the initial policy: pi_old and the frozen copy are the same weights, forwarded over the
    # same rows in one batch (the scripts forward every row when a reference is kept: Run.reads_every_row), so
    # bit for bit
    assert rows[0]["kl_to_init"] == 0.0


@pytest.mark.parametrize("script", helpers.SCRIPTS)
def test_help_prints(script, capsys):  # a "%" in a help text once broke --help
    status, out, _ = helpers.main_in_process(importlib.import_module(script), ["--help"], capsys)
    assert status == 0 and "--reward-model " in out
