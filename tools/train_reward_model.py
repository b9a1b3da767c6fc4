"""tools/train_reward_model.py: a learned reward for --reward-model, by Bradley-Terry training on
preference pairs (InstructGPT's loss; TRL's RewardTrainer).

    python tools/train_reward_model.py --data pairs.jsonl --model tiny --out runs/rm

The pairs are JSONL records {"prompt", "chosen", "rejected"}; the result is a standard
AutoModelForSequenceClassification checkpoint (one output) that any script takes as
`--reward-model DIR`. `arith_preference_pairs` makes such pairs for the built-in `arith` task (the
recipe of the shipped tiny-rm: tools/build_checkpoints.py tiny-rm). docs/reward_model.md.
"""

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py, when run as a script

from cli import ArgumentParser, number  # noqa: E402

from common import (  # noqa: E402
    TINY_MODELS,
    UsageError,
    die,
    eos_token_ids,
    sample,
    score,
    tiny_checkpoint,
)
from extras.data_files import jsonl_objects  # noqa: E402
from extras.hub import check_model_name  # noqa: E402
from extras.reward_model import _tiny_attention, reward_model_scores  # noqa: E402


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """[N], [N] -> scalar: mean of -log sigmoid(r_chosen - r_rejected) (InstructGPT; TRL's
    RewardTrainer), the negative log-likelihood of the preference under the Bradley-Terry model.
    Its gradient on r_chosen is -sigmoid(r_rejected - r_chosen) / N."""
    return -F.logsigmoid(chosen - rejected).mean()


def load_pairs(path: str) -> list[dict]:
    """JSONL preference pairs {"prompt", "chosen", "rejected"} (all strings)."""
    pairs = []
    for i, rec in jsonl_objects(path):
        if not all(isinstance(rec.get(k), str) for k in ("prompt", "chosen", "rejected")):
            raise UsageError(f"--data {path}: line {i} needs string fields prompt, chosen and rejected")
        pairs.append(rec)
    if len(pairs) < 2:
        raise UsageError(f"--data {path}: needs at least 2 pairs (one to train on, one held out)")
    return pairs


def split_pairs(pairs: list[dict], eval_frac: float, seed: int) -> tuple[list, list]:
    """(train, held-out): whole prompts go to one side, so the held-out pairs ask unseen questions."""
    prompts = sorted({p["prompt"] for p in pairs})
    np.random.RandomState(seed).shuffle(prompts)
    held = set(prompts[: max(1, round(len(prompts) * eval_frac))])
    train = [p for p in pairs if p["prompt"] not in held]
    return (train, [p for p in pairs if p["prompt"] in held]) if train else (pairs[1:], pairs[:1])


@torch.no_grad()
def pairwise_accuracy(model, tok, pairs: list[dict], batch_size: int = 64) -> float:
    """Share of pairs whose chosen completion the reward model scores strictly above the rejected one."""
    was_training = model.training
    model.eval()
    prompts = [p["prompt"] for p in pairs]
    chosen = reward_model_scores(model, tok, prompts, [p["chosen"] for p in pairs], batch_size)
    rejected = reward_model_scores(model, tok, prompts, [p["rejected"] for p in pairs], batch_size)
    model.train(was_training)
    return (chosen > rejected).float().mean().item()


def train_reward_model(pairs, model_name: str, out, steps: int = 400, batch_size: int = 32, lr: float = 1e-3,
                       eval_frac: float = 0.1, seed: int = 0, log=print) -> dict:  # fmt: skip
    """Bradley-Terry training of a reward model from a causal-LM checkpoint ('tiny' or a directory /
    hub id): its trunk plus a new scalar head (AutoModelForSequenceClassification, num_labels=1),
    every weight trained by `bradley_terry_loss` with AdamW, minibatches of `batch_size` pairs drawn
    with `seed`. Saves a standard sequence-classification checkpoint (weights and tokenizer) at `out`
    and returns {"pairwise_accuracy" (held-out), "train_pairs", "eval_pairs", "steps", "time_s"}."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    t0 = time.perf_counter()
    path = tiny_checkpoint(model_name) if model_name in TINY_MODELS else model_name
    train, held_out = split_pairs(pairs, eval_frac, seed)
    torch.manual_seed(seed)  # the new head's initialisation
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # not the "newly initialized: score.weight" notice: that is the point
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, dtype=torch.float32, **_tiny_attention(model_name in TINY_MODELS)
        )
    finally:
        transformers_logging.set_verbosity(verbosity)
    model.config.pad_token_id = tok.pad_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = np.random.RandomState(seed)
    model.train()
    for step in range(1, steps + 1):
        batch = [train[i] for i in rng.randint(0, len(train), batch_size)]
        prompts = [p["prompt"] for p in batch] * 2
        scores = reward_model_scores(model, tok, prompts, [p["chosen"] for p in batch] + [p["rejected"] for p in batch],
                                     batch_size=2 * batch_size)  # fmt: skip
        loss = bradley_terry_loss(scores[:batch_size], scores[batch_size:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if log and (step % 100 == 0 or step == steps):
            log(f"reward model step {step}/{steps}: loss {loss.item():.4f}")
    acc = pairwise_accuracy(model, tok, held_out)
    model.config.architectures = [type(model).__name__]
    Path(out).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    result = {"pairwise_accuracy": acc, "train_pairs": len(train), "eval_pairs": len(held_out), "steps": steps,
              "time_s": time.perf_counter() - t0}  # fmt: skip
    (Path(out) / "reward_model.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def wrong_sums(a: int, b: int) -> list[str]:
    """Plausible wrong answers to a+b: each digit of the sum off by one, and the sum without its carries."""
    right = str(a + b)
    wrong = []
    for i, d in enumerate(right):
        for delta in (-1, 1):
            if 0 <= int(d) + delta <= 9 and not (i == 0 and int(d) + delta == 0 and len(right) > 1):
                wrong.append(right[:i] + str(int(d) + delta) + right[i + 1 :])
    no_carry = int("".join(str((int(x) + int(y)) % 10) for x, y in zip(f"{a:03d}", f"{b:03d}")))
    if str(no_carry) != right:
        wrong.append(str(no_carry))
    return wrong


def arith_preference_pairs(examples, seed: int = 0, policy=None, tok=None, policy_samples: int = 4,
                           policy_prompts: int = 0, max_new_tokens: int = 8) -> list[dict]:  # fmt: skip
    """Preference pairs on `arith` records: chosen the right sum; rejected a plausible wrong sum
    (a digit off by one, a dropped carry), or a failure shape a policy produces: an empty answer,
    extra text, a completion cut at max_new_tokens without EOS (the answer repeated); and, with
    `policy`, that policy's own wrong samples (temperature 1) on the first `policy_prompts` records."""
    rng = np.random.RandomState(seed)
    pairs = []
    for ex in examples:
        a, b = map(int, ex["prompt"].rstrip("=").split("+"))
        right = ex["answer"]
        shapes = wrong_sums(a, b) + ["", f"{right}+{b}", f"{right}={right}", (right * max_new_tokens)[:max_new_tokens]]
        pairs.append({"prompt": ex["prompt"], "chosen": right, "rejected": shapes[rng.randint(len(shapes))]})
    if policy is not None and policy_prompts:
        chosen = examples[:policy_prompts]
        prompts = [tok(ex["prompt"])["input_ids"] for ex in chosen for _ in range(policy_samples)]
        gen = torch.Generator().manual_seed(seed)
        roll = sample(policy, prompts, max_new_tokens, eos_token_ids(policy, tok), tok.pad_token_id, generator=gen)
        texts = tok.batch_decode(roll.completion_lists(), skip_special_tokens=True)
        for i, text in enumerate(texts):
            ex = chosen[i // policy_samples]
            if not score(text, ex["answer"])[0]:
                pairs.append({"prompt": ex["prompt"], "chosen": ex["answer"], "rejected": text})
    return pairs


def main(argv=None):
    """python tools/train_reward_model.py --data pairs.jsonl --model tiny --out DIR: Bradley-Terry
    training (`train_reward_model`); prints the held-out pairwise accuracy. docs/reward_model.md."""

    parser = ArgumentParser(prog="python tools/train_reward_model.py", description=main.__doc__.split(":")[0])
    parser.add_argument("--data", required=True, help="JSONL preference pairs {prompt, chosen, rejected}")
    parser.add_argument("--model", default="tiny", help="causal-LM checkpoint to start from: tiny, a dir or a hub id")
    parser.add_argument("--out", required=True, help="where to save the sequence-classification checkpoint")
    parser.add_argument("--steps", type=number(int), default=400, help="AdamW steps (default: 400)")
    parser.add_argument("--batch-size", type=number(int), default=32, help="pairs per step (default: 32)")
    parser.add_argument("--lr", type=number(float), default=1e-3, help="learning rate (default: 1e-3; a 0.5B: 1e-5)")
    parser.add_argument("--eval-frac", type=number(float), default=0.1, help="prompts held out (default: 0.1)")
    parser.add_argument("--seed", type=number(int), default=0, help="held-out split, batches, head init")
    a = parser.parse_args(argv)
    try:
        if a.steps < 1 or a.batch_size < 1 or not 0 < a.eval_frac < 1:
            raise UsageError("--steps and --batch-size must be >= 1 and --eval-frac in (0, 1)")
        if a.model not in TINY_MODELS:
            check_model_name(a.model)
        pairs = load_pairs(a.data)
        result = train_reward_model(pairs, a.model, a.out, a.steps, a.batch_size, a.lr, a.eval_frac, a.seed)
    except UsageError as e:
        die(str(e))
    print(f"held-out pairwise accuracy {result['pairwise_accuracy']:.3f} on {result['eval_pairs']} pairs "
          f"({result['train_pairs']} trained on, {result['time_s']:.0f} s); saved {a.out}")  # fmt: skip


if __name__ == "__main__":
    main()
