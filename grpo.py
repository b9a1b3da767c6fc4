"""GRPO: Group Relative Policy Optimization (Shao et al. 2024, DeepSeekMath, arXiv 2402.03300).

Objective, for G completions y_i of each prompt x, maximised (DeepSeekMath Eq. 3, with the
loss aggregation as a choice):

    J(theta) = E[ agg_{i,t} ( min( r_it A_i, clip(r_it, 1 - eps_low, 1 + eps_high) A_i ) - beta KL_it ) ]
    r_it = pi_theta(y_it | x, y_i<t) / pi_old(y_it | x, y_i<t)          (one ratio per *token*)
    A_i  = (R_i - mean_j R_j) / std_j R_j       (Dr. GRPO: R_i - mean_j R_j, --scale-rewards none)
    KL_it = k3 = exp(ref - logp) - (ref - logp) - 1   (only with --kl-coef > 0: a frozen reference)

No critic: the other completions of the same prompt are the baseline. The aggregation decides how
tokens of different sequences are weighted: "seq-mean-token-mean" (the paper: every sequence
counts once), "token-mean" (DAPO: every token counts once), "seq-mean-token-sum-norm" (Dr. GRPO:
a constant normaliser, no length bias).

Defaults, by measurement on the tiny model (held-out accuracy from 0.216): the paper's
seq-mean-token-mean with no KL term reached 0.704 / 0.726 / 0.670 after 600 steps (seeds 0-2).
--loss-agg token-mean looked better at 200 steps on seed 0 (0.572 against 0.474) but not at 400
(0.634 / 0.610 on seeds 0 / 1, against 0.668 / 0.648), and --kl-coef 0.04 reached 0.520 at 200 steps on seed 0; so the
defaults stay the paper's aggregation and beta = 0 (no reference model in memory). Completions
here are 3-4 tokens long, so the aggregations differ little; they matter on long, variable-length
completions.

Run (CPU, embedded tiny Qwen3, about 3 minutes):   python grpo.py
Stop with Ctrl-C (it saves a checkpoint), then continue:   python grpo.py --resume runs/grpo
A real Qwen on a GPU:   python grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k \
    --data gsm8k_train.jsonl --max-new-tokens 512 --prompts-per-step 32 --lr 1e-6 --kl-coef 0.001
Data parallel on N GPUs (each rank samples prompts-per-step / N prompts; gradients averaged):
    torchrun --nproc_per_node N grpo.py ...same flags...   (on CPU: gloo, --device cpu)
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

import common
from common import arg, masked_mean

LOG_RATIO_CLAMP = 20.0  # token log-ratios are clamped to +-20 before exp (as verl does)
AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")


@dataclass
class Args:
    model: str = arg(
        "tiny", "'tiny' (embedded Qwen3, built on first use), 'tiny-moe' (its Qwen3-MoE twin) or a local dir / hub id"
    )
    task: str = arg(None, "arith (default), gsm8k or jsonl; --data alone implies jsonl")
    data: str = arg(None, "JSONL file of {prompt, answer} or GSM8K {question, answer} records")
    steps: int = arg(600, "number of rollout + update steps (about 3 minutes on a 2-core CPU)")
    prompts_per_step: int = arg(64, "prompts sampled per step")
    group_size: int = arg(4, "completions per prompt (G); the group is the advantage baseline")
    max_new_tokens: int = arg(8, "maximum completion length in tokens")
    temperature: float = arg(1.0, "sampling temperature; log-probs use the same temperature")
    top_p: float = arg(1.0, "nucleus sampling threshold (1 = off)")
    lr: float = arg(3e-4, "AdamW learning rate (a real 0.5B-7B Qwen wants about 1e-6)")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    max_grad_norm: float = arg(1.0, "gradient-norm clipping threshold")
    minibatches: int = arg(
        2, "minibatch updates per epoch over each rollout (2 learned faster than 4 here, see README)"
    )
    epochs: int = arg(1, "passes over each rollout")
    eps_low: float = arg(0.2, "lower clip range of the token ratio")
    eps_high: float = arg(0.2, "upper clip range of the token ratio (DAPO clip-higher: 0.28)")
    kl_coef: float = arg(0.0, "beta of the k3 KL penalty to a frozen reference (0: no reference in memory)")
    loss_agg: str = arg(
        "seq-mean-token-mean", "seq-mean-token-mean (paper), token-mean (DAPO) or seq-mean-token-sum-norm (Dr. GRPO)"
    )
    scale_rewards: str = arg("std", "std (group z-score, the paper) or none (Dr. GRPO: R - mean)")
    seed: int = arg(0, "random seed (data order, sampling, init)")
    eval_every: int = arg(10, "evaluate every N steps (0: only before and after training)")
    eval_size: int = arg(500, "held-out prompts used for evaluation")
    out: str = arg("runs/grpo", "output directory")
    device: str = arg("auto", "auto, cpu or cuda")
    save_every: int = arg(0, "write a checkpoint to OUT/checkpoint every N steps and at the end (0: off)")
    resume: str = arg(
        None, "continue the run in this --out directory (or its checkpoint/); its flags are reused, --steps may grow"
    )
    max_consecutive_skips: int = arg(3, "stop (exit status 3) after this many non-finite updates in a row")
    routing_replay: bool = arg(
        False, "MoE models: route every update forward through the experts of the old-logp pass (GSPO paper 5.3)"
    )
    grad_checkpointing: bool = arg(False, "recompute activations in backward (less memory, about 30% slower)")


# --------------------------------------------------------------------------------------------
# The algorithm: pure tensor functions (tests/test_grpo.py checks each against a plain loop)
# --------------------------------------------------------------------------------------------


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "std", eps: float = 1e-6) -> torch.Tensor:
    """[B] -> [B]: R - group mean, divided by (group std + eps) when scale="std" (Bessel's std).
    Rewards come group by group. A group whose rewards are all equal gets exactly 0."""
    r = rewards.float().view(-1, group_size)  # [B/G, G]
    adv = r - r.mean(1, keepdim=True)
    if scale == "std":
        adv = adv / (r.std(1, keepdim=True) + eps)
    elif scale != "none":
        raise ValueError(f"scale must be 'std' or 'none', got {scale!r}")
    constant = r.max(1, keepdim=True).values == r.min(1, keepdim=True).values
    return torch.where(constant, torch.zeros_like(adv), adv).view(-1)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """[B, T]: k3 = exp(x) - x - 1 with x = ref - logp, an unbiased, non-negative estimate of
    KL(pi || ref) (Schulman's k3). expm1 keeps it >= 0 in float32 where exp(x) - 1 would not."""
    x = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.expm1(x) - x).clamp(min=0)


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, agg: str, max_len: int | None = None, denominator: float | None = None
) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to a scalar over mask == 1.
    seq-mean-token-mean: mean_i (sum_t m l / sum_t m)        denominator default B
    token-mean:          sum m l / sum m                      denominator default sum m
    seq-mean-token-sum-norm: sum m l / (B * max_len)          denominator default B * max_len
    When a minibatch is split into micro-batches, pass the whole minibatch's denominator to
    each so that the accumulated gradient equals the full-batch gradient (verl PR #5798)."""
    mask = mask.to(per_token.dtype)
    masked = per_token * mask
    B, T = per_token.shape
    if agg == "seq-mean-token-mean":
        per_seq = masked.sum(1) / mask.sum(1).clamp(min=1)
        return per_seq.sum() / (denominator if denominator is not None else B)
    if agg == "token-mean":
        return masked.sum() / (denominator if denominator is not None else mask.sum().clamp(min=1))
    if agg == "seq-mean-token-sum-norm":
        return masked.sum() / (denominator if denominator is not None else B * (max_len or T))
    raise ValueError(f"agg must be one of {AGGREGATIONS}, got {agg!r}")


def grpo_loss(
    logp,
    old_logp,
    advantages,
    mask,
    eps_low=0.2,
    eps_high=0.2,
    ref_logp=None,
    kl_coef=0.0,
    agg="seq-mean-token-mean",
    max_len=None,
    denominator=None,
):
    """GRPO's per-token clipped surrogate (plus beta * k3 to the reference) as a loss to minimise.
    `logp`, `old_logp`, `mask` (and `ref_logp`) are [B, T]; `advantages` is [B] or [B, T]."""
    mask = mask.bool()
    log_ratio = torch.where(mask, logp - old_logp, torch.zeros_like(logp))  # padding never reaches exp
    ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()  # [B, T]
    adv = advantages if advantages.dim() == 2 else advantages[:, None]
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps_low, 1 + eps_high))
    kl = torch.zeros_like(per_token)
    if ref_logp is not None:
        kl = torch.where(mask, kl_k3(logp, ref_logp), torch.zeros_like(logp))
        per_token = per_token + kl_coef * kl
    loss = aggregate(per_token, mask, agg, max_len, denominator)
    # the clip is active (and the token's gradient zero) where the clipped branch is the larger
    clip_low = (adv < 0) & (ratio < 1 - eps_low) & mask
    clip_high = (adv > 0) & (ratio > 1 + eps_high) & mask
    stats = {
        "clip_frac": masked_mean((clip_low | clip_high).float(), mask).item(),
        "clip_frac_low": masked_mean(clip_low.float(), mask).item(),
        "clip_frac_high": masked_mean(clip_high.float(), mask).item(),
        "ratio_mean": masked_mean(ratio.detach(), mask).item(),
        "ratio_max_dev": ((ratio.detach() - 1).abs() * mask).max().item() if mask.any() else 0.0,
        "ratio_std": masked_mean((ratio.detach() - masked_mean(ratio.detach(), mask)) ** 2, mask).sqrt().item(),
        "kl": masked_mean(kl.detach(), mask).item(),
    }
    return loss, stats


# --------------------------------------------------------------------------------------------
# Training loop
# --------------------------------------------------------------------------------------------


def train(args: Args):
    common.check_common_args(args, needs_group=True)
    rank, world, local_rank = common.init_distributed(args.device)  # (0, 1, 0) without torchrun
    if args.prompts_per_step % world or args.prompts_per_step // world * args.group_size % args.minibatches:
        raise common.UsageError(
            f"--prompts-per-step {args.prompts_per_step} must split into {world} equal "
            f"shares whose completions --minibatches {args.minibatches} divides"
        )
    if args.loss_agg not in AGGREGATIONS:
        raise common.UsageError(f"--loss-agg must be one of {', '.join(AGGREGATIONS)}, got {args.loss_agg!r}")
    if args.scale_rewards not in ("std", "none"):
        raise common.UsageError(f"--scale-rewards must be std or none, got {args.scale_rewards!r}")
    if args.kl_coef < 0:
        raise common.UsageError(f"--kl-coef must be >= 0, got {args.kl_coef}")
    train_set, eval_set = common.load_task(args.task, args.data)
    eval_set = eval_set[: args.eval_size]
    resume_from = common.open_checkpoint(args, "grpo") if args.resume else None

    common.seed_everything(args.seed)
    device = common.resolve_device(args.device, local_rank)
    common.tiny_checkpoint(args.model) if args.model in common.TINY_MODELS else None  # first build is not timed
    t_start = time.perf_counter()
    model, tok = common.load_model(args.model, device)
    eos_ids = common.eos_token_ids(model, tok)
    routing = common.RoutingReplay(model)  # records / replays MoE expert choices; no-op on a dense model
    if args.routing_replay and not routing.blocks:
        raise common.UsageError(f"--routing-replay: --model {args.model} has no MoE layers")
    ref_model = None
    if args.kl_coef > 0:  # a frozen copy of the initial policy; none in memory when beta = 0
        ref_model, _ = common.load_model(args.model, device)
        ref_model.eval().requires_grad_(False)
    if args.grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # the training forward; under torchrun through DDP, which averages the gradients over the ranks
    train_model = common.CompletionLogprobs(model)
    if world > 1:
        train_model = DistributedDataParallel(train_model, device_ids=[device.index] if device.type == "cuda" else None)
    # fused=True: each update is one kernel over all parameters, not a loop of per-tensor ops
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, fused=True)
    stream = common.PromptStream(train_set, args.seed)
    sampling_gen = torch.Generator(device=device).manual_seed(args.seed + rank)  # each rank its own samples
    guard, progress = common.NonFiniteGuard(args.max_consecutive_skips), common.Progress()
    state = {
        "optimizer": optimizer,
        "stream": stream,
        "sampling_gen": sampling_gen,
        "guard": guard,
        "progress": progress,
    }
    if resume_from:  # the policy's weights, `state` and the RNG states as they were after that step
        common.load_checkpoint(resume_from, model, state)
        t_start -= progress.wall_time_s
    else:
        progress.eval_before = progress.last_eval = common.evaluate(model, tok, eval_set, args.max_new_tokens)
        tqdm.write(
            f"step 0: eval accuracy {progress.eval_before['accuracy']:.3f}  "
            f"format {progress.eval_before['format_rate']:.3f}"
        )
    logger = common.RunLogger(args.out, resume_from, enabled=rank == 0)
    bar = tqdm(
        range(progress.step + 1, args.steps + 1),
        initial=progress.step,
        total=args.steps,
        desc="grpo",
        dynamic_ncols=True,
        disable=rank > 0,
    )
    for step in bar:
        t0 = time.perf_counter()
        # 1. Rollout: G completions per prompt, grouped contiguously.
        examples = stream.next(args.prompts_per_step)[rank::world]  # every rank draws the same batch, keeps its share
        prompts = [p for p in common.encode_prompts(tok, examples) for _ in range(args.group_size)]
        answers = [ex["answer"] for ex in examples for _ in range(args.group_size)]
        model.eval()
        roll = common.sample(
            model,
            prompts,
            args.max_new_tokens,
            eos_ids,
            tok.pad_token_id,
            args.temperature,
            args.top_p,
            generator=sampling_gen,
        )
        t_sample = time.perf_counter() - t0
        rewards, formats, _ = common.score_rollout(tok, roll, answers)
        advantages = group_advantages(rewards, args.group_size, args.scale_rewards).to(device)  # [B]
        mask = roll.completion_mask  # [B, T]

        # 2. Log-probs of the sampling policy (pi_old) and of the reference, once per rollout. Until
        #    the first update the policy is pi_old itself, so the first minibatch takes its pi_old
        #    from its own forward pass in step 3 (detached: its ratio is exactly 1) and this pass
        #    covers the other rows. An MoE model runs it on every row: it also records the experts
        #    each token is routed to.
        #    A row whose advantage is 0 (its group's rewards all equal) adds exactly 0 to the loss
        #    and its gradient unless there is a KL term, so the updates forward only each
        #    minibatch's other rows (`kept`; at least one, so that every update and every torchrun
        #    rank still runs) and divide by the whole minibatch: the same gradient for less work.
        minibatches = [
            idx
            for _ in range(args.epochs)  # every epoch's minibatches (row indices), drawn up front
            for idx in torch.randperm(len(roll), device=device).chunk(args.minibatches)
        ]
        has_grad = advantages != 0 if ref_model is None else torch.ones(len(roll), dtype=torch.bool, device=device)
        kept = [idx[has_grad[idx]] if has_grad[idx].any() else idx[:1] for idx in minibatches]
        first_on_policy = not routing.blocks
        old_logp, entropy = torch.zeros(mask.shape, device=device), torch.zeros(mask.shape, device=device)  # [B, T]
        needs_pass = torch.ones(len(roll), dtype=torch.bool, device=device)  # every row, for the entropy
        needs_pass[kept[0]] = not first_on_policy
        rows = needs_pass.nonzero().squeeze(1)
        with torch.no_grad(), routing.record():
            if len(rows):
                old_logp[rows], entropy[rows] = common.completion_logprobs(model, roll[rows], args.temperature)
            ref_logp = common.completion_logprobs(ref_model, roll, args.temperature)[0] if ref_model else None

        # 3. Updates: epochs x minibatches; after the first, the policy is off-policy w.r.t. pi_old.
        model.train()
        step_stats, n_updates = [], 0
        for k, (idx, rows) in enumerate(zip(minibatches, kept)):
            # --routing-replay: the old-logp pass's experts, also in any recompute during backward
            with routing.replay(routing.indices if args.routing_replay else None, rows):
                logp, token_entropy = train_model(roll[rows], args.temperature)
                if k == 0 and first_on_policy:
                    old_logp[rows], entropy[rows] = logp.detach(), token_entropy
                # the whole minibatch's denominator; torchrun: token-mean divides by all ranks'
                # tokens / world (each rank's B is already B / world)
                denominator = (
                    common.mean_denominator(mask[idx].sum())
                    if args.loss_agg == "token-mean"
                    else len(idx) * (args.max_new_tokens if args.loss_agg == "seq-mean-token-sum-norm" else 1)
                )
                loss, stats = grpo_loss(
                    logp,
                    old_logp[rows],
                    advantages[rows],
                    mask[rows],
                    args.eps_low,
                    args.eps_high,
                    ref_logp[rows] if ref_model else None,
                    args.kl_coef,
                    args.loss_agg,
                    max_len=args.max_new_tokens,
                    denominator=denominator,
                )
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
            # skipped rows are never clipped: the clip fractions are over the whole minibatch's tokens
            kept_share = (mask[rows].sum() / mask[idx].sum().clamp(min=1)).item()
            stats.update({key: stats[key] * kept_share for key in ("clip_frac", "clip_frac_low", "clip_frac_high")})
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            if not guard.ok(step, loss, grad_norm):
                continue  # skipped: no optimizer.step(), so weights and AdamW state are untouched
            optimizer.step()
            n_updates += 1
            step_stats.append({**stats, "loss": loss.item(), "grad_norm": grad_norm.item()})

        # Routing drift (MoE): the experts of this step's completions before vs after its updates.
        drift = {}
        if routing.blocks:
            before = routing.indices
            with torch.no_grad(), routing.record():
                common.completion_logprobs(model, roll, args.temperature)
            drift = {"routing_drift": common.routing_drift(before, routing.indices, mask)}

        # 4. Logging.
        step_time = time.perf_counter() - t0
        n_tokens = mask.sum().item()
        mean = lambda k: sum(s[k] for s in step_stats) / max(1, len(step_stats))  # noqa: E731
        row = {
            "step": step,
            "reward": common.global_mean(rewards),  # over all ranks' completions
            "accuracy": common.global_mean(rewards),
            "format_rate": common.global_mean(formats),
            "loss": mean("loss"),
            "clip_frac": mean("clip_frac"),
            "clip_frac_low": mean("clip_frac_low"),
            "clip_frac_high": mean("clip_frac_high"),
            "kl": mean("kl"),
            "ratio_mean": mean("ratio_mean"),
            "ratio_max_dev": max((s["ratio_max_dev"] for s in step_stats), default=0.0),
            "ratio_std": mean("ratio_std"),
            **drift,
            "entropy": masked_mean(entropy, mask).item(),
            "response_len": mask.sum(1).mean().item(),
            "zero_std_frac": (rewards.view(-1, args.group_size).std(1) == 0).float().mean().item(),
            "grad_norm": mean("grad_norm"),
            "skipped_updates": args.epochs * args.minibatches - n_updates,
            "tokens_per_s": n_tokens / t_sample,
            "step_time_s": step_time,
        }
        progress.clip_fracs.append(row["clip_frac"])
        if (args.eval_every and step % args.eval_every == 0) or step == args.steps:
            last_eval = progress.last_eval = common.evaluate(model, tok, eval_set, args.max_new_tokens)
            row.update({"eval_accuracy": last_eval["accuracy"], "eval_format_rate": last_eval["format_rate"]})
            tqdm.write(
                f"step {step}: reward {row['reward']:.3f}  eval accuracy {last_eval['accuracy']:.3f}  "
                f"clip_frac {row['clip_frac']:.3f}"
            )
        logger.log(row)
        bar.set_postfix(
            reward=f"{row['reward']:.3f}", clip=f"{row['clip_frac']:.3f}", acc=f"{progress.last_eval['accuracy']:.3f}"
        )

        # 5. Checkpoint (every --save-every steps, and on SIGINT/SIGTERM, which then stop the run).
        progress.step, progress.wall_time_s = step, time.perf_counter() - t_start
        if common.checkpoint_due(args, step) and rank == 0:
            common.save_checkpoint(logger.out, "grpo", args, model, tok, state)
        if common.stop_requested():
            break

    interrupted = progress.step < args.steps
    if not interrupted:
        logger.save_model(model, tok)
    logger.summary(
        {
            "algo": "grpo",
            "model": args.model,
            "task": args.task or ("jsonl" if args.data else "arith"),
            "seed": args.seed,
            "steps": args.steps,
            "step": progress.step,
            "interrupted": interrupted,
            "eval_accuracy_before": progress.eval_before["accuracy"],
            "eval_accuracy_after": progress.last_eval["accuracy"],
            "eval_format_rate_after": progress.last_eval["format_rate"],
            "wall_time_s": time.perf_counter() - t_start,
            "peak_mem_mb": common.peak_memory_mb(device),
            "mean_clip_frac": sum(progress.clip_fracs) / len(progress.clip_fracs),
            "args": asdict(args),
        }
    )
    logger.close()
    if interrupted:
        raise common.Interrupted(progress.step, logger.out)
    return progress.last_eval


if __name__ == "__main__":
    common.main(train, Args, "grpo")
