"""extras/rollout_precision.py: the sampler in bf16 (--rollout-dtype), pi_old from the sampler (--old-logp rollout),
the mismatch between the sampler mu and the trainer, and its correction (--is-correction): docs/rollout_mismatch.md.
"""

from __future__ import annotations

import contextlib
import copy
import math

import torch

from common import UsageError, _top_p_filter


def check_args(args):
    """--rollout-dtype, --old-logp, --is-correction, --is-cap: one-line errors (check_common_args)."""
    if not 1 <= args.is_cap < math.inf:
        raise UsageError(f"--is-cap must be a finite number >= 1, got {args.is_cap}")
    if args.is_correction != "none" and args.old_logp == "rollout":
        raise UsageError(
            "--is-correction weighs by pi_old / mu, and with --old-logp rollout pi_old is mu (every weight 1): "
            "use --old-logp recompute, or leave the correction to the ratio itself"
        )


class LowPrecisionCopy:
    """The policy's modules with parameters of `dtype`, filled from the policy for a rollout and emptied after it
    (`cast_from`): memory only while sampling (buffers stay float32). With LoRA it samples the adapted policy."""

    def __init__(self, model, dtype: torch.dtype):
        self.dtype = dtype
        empty = {id(p): torch.nn.Parameter(torch.empty(0), requires_grad=False) for p in model.parameters()}
        self.module = copy.deepcopy(model, memo=empty).eval()

    @contextlib.contextmanager
    def cast_from(self, model):
        """Context: the module to sample, the copy holding `model`'s current weights cast to `dtype`, or `model`
        itself when its weights are `dtype` already (--fsdp gathered them so)."""
        if next(model.parameters()).dtype == self.dtype:
            yield model
            return
        pairs = list(zip(self.module.parameters(), model.parameters()))
        for dst, src in pairs:
            dst.data = src.detach().to(self.dtype)
        try:
            yield self.module
        finally:
            for dst, src in pairs:
                dst.data = torch.empty(0, dtype=self.dtype, device=src.device)


def mismatch_stats(trainer_logp: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor) -> dict:
    """The training-inference mismatch before any correction, over the tokens of `mask` [B, T], of d = log(pi / mu)
    per token, pi the trainer's log-prob at the rollout's weights (the keys: docs/rollout_mismatch.md)."""
    m = mask.bool()
    if not m.any():
        return {}
    d = torch.where(m, trainer_logp - mu, torch.zeros_like(mu)).double()
    tokens = d[m]
    rows = m.any(1)
    seq = d.sum(1)[rows]
    geo = seq / m.sum(1)[rows]
    return {
        "mismatch_log_ratio_mean": tokens.mean().item(),
        "mismatch_log_ratio_std": tokens.std(unbiased=False).item(),
        "mismatch_k3": (tokens.exp() - tokens - 1).mean().item(),
        "mismatch_frac_beyond_ln2": (tokens.abs() > math.log(2)).double().mean().item(),
        "mismatch_seq_ratio_std": seq.clamp(max=20).exp().std(unbiased=False).item(),
        "mismatch_geo_ratio_max_dev": (geo.exp() - 1).abs().max().item(),
    }


def is_weights(old_logp: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor, mode: str, cap: float, per="token"):
    """Detached [B, T] loss weights correcting for sampling from mu instead of pi_old (--is-correction), 1 wherever
    mask == 0; `none`: None. tis: truncated importance sampling (verl PR #2953; Yao et al. 2025), w_t = min(pi_old /
    mu, cap); per="sequence" (GSPO): min(exp(mean_t log(pi_old / mu)), cap) on every token of the sequence. mask:
    TRL's `sequence_mask` (TRL #4772), w = 0 on a sequence whose exp(sum_t log(pi_old / mu)) exceeds cap, else 1;
    masked rows stay in the batch and in every denominator."""
    if mode == "none":
        return None
    m = mask.bool()
    d = torch.where(m, old_logp - mu, torch.zeros_like(mu)).detach()  # log(pi_old / mu) per token
    if mode == "tis" and per == "token":
        w = d.clamp(max=math.log(cap)).exp()
    elif mode == "tis":
        w = (d.sum(1) / m.sum(1).clamp(min=1)).clamp(max=math.log(cap)).exp()[:, None].expand_as(d)
    elif mode == "mask":
        w = (d.sum(1) <= math.log(cap)).to(d.dtype)[:, None].expand_as(d)
    else:
        raise ValueError(f"mode must be none, tis or mask, got {mode!r}")
    return torch.where(m, w, torch.ones_like(w))


def rollout_mismatch(roll, old_logp: torch.Tensor, weights, args) -> dict | None:
    """A step's mismatch_* and is_* metrics, before its updates: mu (the sampler) against the script's pi_old over
    every row; {} when mu was not recorded; None under --old-logp rollout, which
    has no trainer pi_old (the script measures it on its first update's forward, `on_policy`)."""
    if roll.sample_logp is None:
        return {}
    if args.old_logp == "rollout":
        return None
    mask = roll.completion_mask
    stats = mismatch_stats(old_logp, roll.sample_logp, mask)
    if weights is not None and mask.bool().any():  # is_weight_mean, and the share truncated at cap (tis) or masked
        w, tis = weights[mask.bool()], args.is_correction == "tis"
        changed = (w >= args.is_cap) if tis else (w == 0)
        stats["is_weight_mean"] = w.mean().item()
        stats[f"is_{'truncated' if tis else 'masked'}_frac"] = changed.float().mean().item()
    return stats


def token_logps(logits, token, alive, temperature: float, top_p: float) -> dict:
    """common.sample(record_logp=True), per decoded row: the log-prob of `token` under logits / temperature
    (sample_logp_full) and under the distribution it was drawn from, after top-p (sample_logp); 0 where done."""
    scaled = logits.float() / temperature
    full = scaled.log_softmax(-1).gather(-1, token[:, None]).squeeze(-1)
    kept = _top_p_filter(scaled, top_p).log_softmax(-1) if top_p < 1.0 else None
    sampled = full if kept is None else kept.gather(-1, token[:, None]).squeeze(-1)
    # where, not *: a finished row's padding may lie outside the nucleus (-inf * 0 is nan)
    return {"sample_logp_full": full.where(alive, 0.0), "sample_logp": sampled.where(alive, 0.0)}
