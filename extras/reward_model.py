"""extras/reward_model.py: --reward-model, a learned reward as one component of the run's reward, and the policy's
KL to its start (kl_to_init), the x-axis of the over-optimisation curves (docs/reward_model.md; trained by
tools/train_reward_model.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from common import (
    TINY_RM,
    Rollout,
    UsageError,
    _describe,
    completion_logprobs,
    global_mean,
    thinking_kwargs,
    tiny_checkpoint,
)


def reward_model_text(tok, prompt: str, completion: str, thinking: str = "off") -> str:
    """What a reward model reads: the prompt and the completion as a user and an assistant turn of its own chat
    template (--thinking passed where it takes it), or without one, concatenated."""
    if getattr(tok, "chat_template", None):
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        return tok.apply_chat_template(messages, tokenize=False, **thinking_kwargs(tok, thinking))
    return prompt + completion


def reward_model_scores(model, tok, prompts, completions, batch_size: int = 64, thinking: str = "off") -> torch.Tensor:
    """[N] float32: a sequence classifier's scalar head on each (prompt, completion) in its own tokenizer, right
    padded so that a score does not depend on the rest of the batch (gradients flow when enabled: training)."""
    device = next(model.parameters()).device
    texts = [reward_model_text(tok, p, c, thinking) for p, c in zip(prompts, completions)]
    special = not getattr(tok, "chat_template", None)  # a chat template writes its own special tokens
    scores = []
    for s in range(0, len(texts), batch_size):
        enc = tok(texts[s : s + batch_size], padding=True, padding_side="right", add_special_tokens=special,
                  return_tensors="pt").to(device)  # fmt: skip
        logits = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits  # [b, 1]
        scores.append(logits[:, 0].float())
    return torch.cat(scores) if scores else torch.zeros(0, device=device)


def check(spec: str):
    """'tiny-rm', or a checkpoint whose config is a sequence classifier with one output (a causal LM would load as
    one, with a random head), checked before anything loads."""
    if spec == TINY_RM:
        return
    from transformers import AutoConfig

    path = Path(spec).expanduser()
    local = path.exists() or spec.startswith(("/", ".", "~")) or Path(spec.split("/")[0]).is_dir()
    if local and not (path / "config.json").is_file():
        raise UsageError(f"--reward-model {spec}: no such checkpoint directory (expected tiny-rm or a directory "
                         "with config.json)")  # fmt: skip
    try:
        config = AutoConfig.from_pretrained(spec)
    except Exception as e:
        raise UsageError(f"--reward-model {spec}: cannot load its config ({_describe(e)})") from e
    archs = config.architectures or []
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        raise UsageError(f"--reward-model {spec}: is a {'/'.join(archs) or 'model of unknown class'}, not a sequence "
                         "classifier (train one: python tools/train_reward_model.py)")  # fmt: skip
    if config.num_labels != 1:
        raise UsageError(f"--reward-model {spec}: has {config.num_labels} labels; a reward model has one output")


def _tiny_attention(tiny: bool) -> dict:
    """The tiny models' padded batches run about 10x faster on CPU with eager attention than with sdpa."""
    return {"attn_implementation": "eager"} if tiny else {}


def load_reward_model(spec: str, device: torch.device):
    """(model, tokenizer) of a checked --reward-model, frozen, in eval mode."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    check(spec)
    path = tiny_checkpoint(TINY_RM) if spec == TINY_RM else spec
    try:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=torch.float32, **_tiny_attention(spec == TINY_RM)
        )
    except Exception as e:
        raise UsageError(f"--reward-model {spec}: cannot load it ({_describe(e)})") from e
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if model.config.pad_token_id is None:  # the head reads the last non-pad token of each row
        model.config.pad_token_id = tok.pad_token_id
    return model.to(device).eval().requires_grad_(False), tok


class RewardModel:
    """--reward-model as a reward function with TRL's signature, weighed by `Rewards` like any other: the classifier's
    score of (prompt, completion), in the reward model's own tokenizer and chat template."""

    def __init__(self, spec: str, device: torch.device, batch_size: int = 64, thinking="off"):
        self.model, self.tok = load_reward_model(spec, device)
        self.batch_size, self.thinking = batch_size, thinking

    @torch.no_grad()
    def __call__(self, prompts, completions, **fields) -> list[float]:
        scores = reward_model_scores(self.model, self.tok, prompts, completions, self.batch_size, self.thinking)
        return scores.double().tolist()


def kl_to_init(init_model, roll: Rollout, logp: torch.Tensor, temperature: float = 1.0) -> dict:
    """{"kl_to_init": mean over completions of sum_t (logp - logp_init)}, a k1 estimate of KL(pi || pi_init) per
    sequence, the x-axis of Gao et al. 2022's over-optimisation curves; {} when init_model is None."""
    if init_model is None:
        return {}
    with torch.no_grad():
        init_logp = completion_logprobs(init_model, roll, temperature)[0]  # [B, T]
    return {"kl_to_init": global_mean(((logp - init_logp) * roll.completion_mask).sum(1))}


def pair_accuracy(scores: torch.Tensor, correct: torch.Tensor) -> torch.Tensor:
    """[B] filled with the share of the batch's (correct, wrong) pairs of rows whose correct row scores strictly
    higher (0.5 without such a pair); [B] so that it averages over ranks like the other parts."""
    good, bad = scores[correct.bool()], scores[~correct.bool()]
    acc = (good[:, None] > bad[None, :]).float().mean().item() if len(good) and len(bad) else 0.5
    return torch.full_like(scores, acc, dtype=torch.float32)
