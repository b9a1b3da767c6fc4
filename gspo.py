"""GSPO: Group Sequence Policy Optimization (Zheng et al. 2025, Qwen, arXiv 2507.18071).

Objective (paper Eq. 5), for G completions y_i of each prompt x, maximised:

    J(theta) = E[ 1/G sum_i min( s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i ) ]
    s_i = ( pi_theta(y_i|x) / pi_old(y_i|x) ) ^ (1/|y_i|) = exp( mean_t (logp_t - old_t) )
    A_i = (R_i - mean_j R_j) / std_j R_j                       (group advantage, Eq. 6)

The importance ratio is one number per *sequence*, length-normalised, and the clip acts on whole
sequences, where GRPO clips token by token. GSPO-token (section 4.3) gives every token the same
ratio value, log s_it = sg[log s_i] + logp_t - sg[logp_t], so that per-token advantages can be
used; with one advantage per sequence its loss and gradient equal GSPO's.

Run (CPU, embedded tiny Qwen3, about 5 minutes):   python gspo.py
A real Qwen on a GPU:   python gspo.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k \
    --data gsm8k_train.jsonl --max-new-tokens 512 --prompts-per-step 32 --lr 1e-6
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

import common
from common import arg, masked_mean

LOG_RATIO_CLAMP = (-20.0, 10.0)  # sequence log-ratio bounds before exp (GSPO: <= 10)


@dataclass
class Args:
    model: str = arg("tiny", "'tiny' (embedded Qwen3, built on first use) or a local dir / hub id")
    task: str = arg(None, "arith (default), gsm8k or jsonl; --data alone implies jsonl")
    data: str = arg(None, "JSONL file of {prompt, answer} or GSM8K {question, answer} records")
    steps: int = arg(60, "number of rollout + update steps")
    prompts_per_step: int = arg(32, "prompts sampled per step")
    group_size: int = arg(8, "completions per prompt (G); the group is the advantage baseline")
    max_new_tokens: int = arg(8, "maximum completion length in tokens")
    temperature: float = arg(1.0, "sampling temperature; log-probs use the same temperature")
    top_p: float = arg(1.0, "nucleus sampling threshold (1 = off)")
    lr: float = arg(3e-4, "AdamW learning rate (a real 0.5B-7B Qwen wants about 1e-6)")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    max_grad_norm: float = arg(1.0, "gradient-norm clipping threshold")
    minibatches: int = arg(4, "minibatch updates per epoch over each rollout (paper: 4)")
    epochs: int = arg(1, "passes over each rollout")
    eps_low: float = arg(3e-4, "lower clip range of the sequence ratio (paper: 3e-4)")
    eps_high: float = arg(4e-4, "upper clip range of the sequence ratio (paper: 4e-4)")
    variant: str = arg("sequence", "sequence (GSPO, Eq. 5) or token (GSPO-token, section 4.3)")
    seed: int = arg(0, "random seed (data order, sampling, init)")
    eval_every: int = arg(10, "evaluate every N steps (0: only before and after training)")
    eval_size: int = arg(500, "held-out prompts used for evaluation")
    out: str = arg("runs/gspo", "output directory")
    device: str = arg("auto", "auto, cpu or cuda")


# --------------------------------------------------------------------------------------------
# The algorithm: pure tensor functions (tests/test_gspo.py checks each against a plain loop)
# --------------------------------------------------------------------------------------------


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """[B] -> [B]: (R - group mean) / (group std + eps), std with Bessel's correction (Eq. 6).
    Rewards come group by group. A group whose rewards are all equal gets exactly 0, not float
    residue divided by eps."""
    r = rewards.float().view(-1, group_size)  # [B/G, G]
    adv = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)
    constant = (r.max(1, keepdim=True).values == r.min(1, keepdim=True).values)
    return torch.where(constant, torch.zeros_like(adv), adv).view(-1)


def seq_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B]: log s_i = mean over completion tokens of (logp - old_logp). The mean, not
    the sum: a summed log-ratio shrinks or explodes with length (TRL #5814)."""
    mask = mask.bool()
    diff = torch.where(mask, logp - old_logp, torch.zeros_like(logp))  # padding never reaches exp
    return diff.sum(1) / mask.sum(1).clamp(min=1)


def gspo_loss(logp, old_logp, advantages, mask, eps_low=3e-4, eps_high=4e-4, variant="sequence"):
    """GSPO's clipped surrogate as a loss to minimise; `logp`, `old_logp`, `mask` are [B, T].

    variant="sequence": paper Eq. 5, one clipped ratio per sequence, advantages [B].
    variant="token": GSPO-token (section 4.3), advantages [B] or [B, T], clipped per token and
    aggregated as the mean over sequences of the mean over each sequence's tokens."""
    mask = mask.bool()
    log_s = seq_log_ratio(logp, old_logp, mask).clamp(*LOG_RATIO_CLAMP)  # [B]
    if variant == "sequence":
        ratio, adv = log_s.exp(), advantages  # [B]
    elif variant == "token":
        # value of each token's ratio = s_i; gradient flows through its own logp_t only
        log_s_tok = log_s.detach()[:, None] + logp - logp.detach()  # [B, T]
        ratio = log_s_tok.clamp(*LOG_RATIO_CLAMP).exp()
        adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(ratio)
    else:
        raise ValueError(f"variant must be 'sequence' or 'token', got {variant!r}")
    clipped_ratio = ratio.clamp(1 - eps_low, 1 + eps_high)
    per_item = torch.maximum(-adv * ratio, -adv * clipped_ratio)  # pessimistic bound, negated
    # the clip is active (and the gradient zero) exactly where the clipped branch is the larger
    is_clipped = ((adv > 0) & (ratio > 1 + eps_high)) | ((adv < 0) & (ratio < 1 - eps_low))
    if variant == "sequence":
        loss = per_item.mean()
        clip_frac = is_clipped.float().mean()
    else:
        loss = masked_mean(per_item, mask, dim=1).mean()
        clip_frac = masked_mean(is_clipped.float(), mask)
    seq_ratio = log_s.detach().exp()
    stats = {
        "clip_frac": clip_frac.item(),
        "ratio_mean": seq_ratio.mean().item(),
        "ratio_max_dev": (seq_ratio - 1).abs().max().item(),
    }
    return loss, stats


# --------------------------------------------------------------------------------------------
# Training loop
# --------------------------------------------------------------------------------------------


def train(args: Args):
    common.check_common_args(args, needs_group=True)
    if args.variant not in ("sequence", "token"):
        raise common.UsageError(f"--variant must be sequence or token, got {args.variant!r}")
    if args.eps_low < 0 or args.eps_high < 0 or args.eps_low >= 1:
        raise common.UsageError(f"--eps-low must be in [0, 1) and --eps-high >= 0, got {args.eps_low}, {args.eps_high}")
    train_set, eval_set = common.load_task(args.task, args.data)
    eval_set = eval_set[: args.eval_size]

    common.seed_everything(args.seed)
    device = common.resolve_device(args.device)
    common.tiny_checkpoint() if args.model in common.TINY_MODELS else None  # first build is not timed
    t_start = time.perf_counter()
    model, tok = common.load_model(args.model, device)
    eos_ids = common.eos_token_ids(model, tok)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    stream = common.PromptStream(train_set, args.seed)
    sampling_gen = torch.Generator(device=device).manual_seed(args.seed)
    logger = common.RunLogger(args.out)

    before = common.evaluate(model, tok, eval_set, args.max_new_tokens)
    tqdm.write(f"step 0: eval accuracy {before['accuracy']:.3f}  format {before['format_rate']:.3f}")
    clip_fracs, last_eval, skipped_in_a_row = [], before, 0
    bar = tqdm(range(1, args.steps + 1), desc="gspo", dynamic_ncols=True)
    for step in bar:
        t0 = time.perf_counter()
        # 1. Rollout: G completions per prompt, grouped contiguously.
        examples = stream.next(args.prompts_per_step)
        prompts = [p for p in common.encode_prompts(tok, examples) for _ in range(args.group_size)]
        answers = [ex["answer"] for ex in examples for _ in range(args.group_size)]
        model.eval()
        roll = common.sample(model, prompts, args.max_new_tokens, eos_ids, tok.pad_token_id,
                             args.temperature, args.top_p, generator=sampling_gen)
        t_sample = time.perf_counter() - t0
        rewards, formats, _ = common.score_rollout(tok, roll, answers)
        advantages = group_advantages(rewards, args.group_size).to(device)  # [B]
        mask = roll.completion_mask  # [B, T]

        # 2. Log-probs of the sampling policy, once per rollout (pi_old).
        with torch.no_grad():
            old_logp, entropy = common.completion_logprobs(model, roll, args.temperature)

        # 3. Updates: epochs x minibatches; after the first, the policy is off-policy w.r.t. pi_old.
        model.train()
        step_stats, n_updates = [], 0
        for _ in range(args.epochs):
            order = torch.randperm(len(roll), device=device)
            for idx in order.chunk(args.minibatches):
                logp, _ = common.completion_logprobs(model, roll[idx], args.temperature)
                loss, stats = gspo_loss(logp, old_logp[idx], advantages[idx], mask[idx],
                                        args.eps_low, args.eps_high, args.variant)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                if not (torch.isfinite(loss) and torch.isfinite(grad_norm)):
                    skipped_in_a_row += 1  # non-finite guard: weights and optimizer untouched
                    optimizer.zero_grad(set_to_none=True)
                    if skipped_in_a_row >= 3:
                        common.die(f"loss or gradient norm non-finite in {skipped_in_a_row} consecutive updates (step {step}); lower --lr")
                    continue
                skipped_in_a_row = 0
                optimizer.step()
                n_updates += 1
                step_stats.append({**stats, "loss": loss.item(), "grad_norm": grad_norm.item()})

        # 4. Logging.
        step_time = time.perf_counter() - t0
        n_tokens = mask.sum().item()
        mean = lambda k: sum(s[k] for s in step_stats) / max(1, len(step_stats))  # noqa: E731
        row = {
            "step": step,
            "reward": rewards.mean().item(),
            "accuracy": rewards.mean().item(),
            "format_rate": formats.mean().item(),
            "loss": mean("loss"),
            "clip_frac": mean("clip_frac"),
            "ratio_mean": mean("ratio_mean"),
            "ratio_max_dev": max((s["ratio_max_dev"] for s in step_stats), default=0.0),
            "entropy": masked_mean(entropy, mask).item(),
            "response_len": mask.sum(1).mean().item(),
            "zero_std_frac": (rewards.view(-1, args.group_size).std(1) == 0).float().mean().item(),
            "grad_norm": mean("grad_norm"),
            "skipped_updates": args.epochs * args.minibatches - n_updates,
            "tokens_per_s": n_tokens / t_sample,
            "step_time_s": step_time,
        }
        clip_fracs.append(row["clip_frac"])
        if (args.eval_every and step % args.eval_every == 0) or step == args.steps:
            last_eval = common.evaluate(model, tok, eval_set, args.max_new_tokens)
            row.update({"eval_accuracy": last_eval["accuracy"], "eval_format_rate": last_eval["format_rate"]})
            tqdm.write(f"step {step}: reward {row['reward']:.3f}  eval accuracy {last_eval['accuracy']:.3f}  "
                       f"clip_frac {row['clip_frac']:.3f}")
        logger.log(row)
        bar.set_postfix(reward=f"{row['reward']:.3f}", clip=f"{row['clip_frac']:.3f}", acc=f"{last_eval['accuracy']:.3f}")

    logger.save_model(model, tok)
    logger.summary({
        "algo": "gspo", "model": args.model, "task": args.task or ("jsonl" if args.data else "arith"),
        "seed": args.seed, "steps": args.steps,
        "eval_accuracy_before": before["accuracy"], "eval_accuracy_after": last_eval["accuracy"],
        "eval_format_rate_after": last_eval["format_rate"],
        "wall_time_s": time.perf_counter() - t_start, "peak_mem_mb": common.peak_memory_mb(device),
        "mean_clip_frac": sum(clip_fracs) / len(clip_fracs), "args": asdict(args),
    })
    logger.close()
    return last_eval


if __name__ == "__main__":
    try:
        train(common.parse_args(Args))
    except common.UsageError as e:
        common.die(str(e))
