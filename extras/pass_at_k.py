"""--eval-samples N: pass@1 and pass@N at each evaluation (common.evaluate), from N completions per prompt
sampled at the run's --temperature and --top-p, from the evaluation's own generator."""

from __future__ import annotations

import math

import torch

from common import sample


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of Chen et al. 2021 (Codex paper, Eq. 1) from n samples of which c are
    correct: 1 - C(n - c, k) / C(n, k), as a product so that no binomial is ever formed."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_rates(model, tok, prompts, records, reward_fn, n: int, max_new_tokens: int, eos, temperature: float,
               top_p: float, generator) -> dict:  # fmt: skip
    """{"pass@1", "pass@n"}: [len(prompts)] each, of n completions per prompt: pass@1 is their mean accuracy
    (reward_fn's answer parser), pass@n the unbiased estimator."""
    roll = sample(model, [p for p in prompts for _ in range(n)], max_new_tokens, eos, tok.pad_token_id, temperature,
                  top_p, generator=generator)  # fmt: skip
    _, parts = reward_fn.score(tok, roll, [r for r in records for _ in range(n)])
    correct = parts["accuracy"].view(-1, n).sum(1).long().tolist()  # per prompt
    return {
        "pass@1": torch.tensor([c / n for c in correct]),
        f"pass@{n}": torch.tensor([pass_at_k(n, c, n) for c in correct]),
    }
