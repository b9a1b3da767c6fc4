"""GSPO: Group Sequence Policy Optimization (Zheng et al. 2025, Qwen, arXiv 2507.18071).

Objective (paper Eq. 5), for G completions y_i of each prompt x, maximised:

    J(theta) = E[ 1/G sum_i min( s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i ) ]
    s_i = ( pi_theta(y_i|x) / pi_old(y_i|x) ) ^ (1/|y_i|) = exp( mean_t (logp_t - old_t) )
    A_i = (R_i - mean_j R_j) / std_j R_j                       (group advantage, Eq. 6)

The importance ratio is one number per *sequence*, length-normalised, and the clip acts on whole
sequences, where GRPO clips token by token. GSPO-token (section 4.3) gives every token the same
ratio value, log s_it = sg[log s_i] + logp_t - sg[logp_t], so that per-token advantages can be
used; with one advantage per sequence its loss and gradient equal GSPO's.

Run (CPU, embedded tiny Qwen3, about 3 minutes):   python gspo.py
Stop with Ctrl-C (it saves a checkpoint), then continue:   python gspo.py --resume runs/gspo
A real Qwen on a GPU:   python gspo.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k \
    --data gsm8k_train.jsonl --max-new-tokens 512 --prompts-per-step 32 --lr 1e-6
Data parallel on N GPUs (each rank samples prompts-per-step / N prompts; gradients averaged):
    torchrun --nproc_per_node N gspo.py ...same flags...   (on CPU: gloo, --device cpu)
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

import common
from common import arg, masked_mean

LOG_RATIO_CLAMP = (-20.0, 10.0)  # sequence log-ratio bounds before exp (GSPO: <= 10)


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
        2, "minibatch updates per epoch over each rollout (the paper uses 4; 2 learned faster here, see README)"
    )
    epochs: int = arg(1, "passes over each rollout")
    eps_low: float = arg(3e-4, "lower clip range of the sequence ratio (paper: 3e-4)")
    eps_high: float = arg(4e-4, "upper clip range of the sequence ratio (paper: 4e-4)")
    variant: str = arg("sequence", "sequence (GSPO, Eq. 5) or token (GSPO-token, section 4.3)")
    seed: int = arg(0, "random seed (data order, sampling, init)")
    eval_every: int = arg(10, "evaluate every N steps (0: only before and after training)")
    eval_size: int = arg(500, "held-out prompts used for evaluation")
    out: str = arg("runs/gspo", "output directory")
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
# The algorithm: pure tensor functions (tests/test_gspo.py checks each against a plain loop)
# --------------------------------------------------------------------------------------------


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """[B] -> [B]: (R - group mean) / (group std + eps), std with Bessel's correction (Eq. 6).
    Rewards come group by group. A group whose rewards are all equal gets exactly 0, not float
    residue divided by eps."""
    r = rewards.float().view(-1, group_size)  # [B/G, G]
    adv = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)
    constant = r.max(1, keepdim=True).values == r.min(1, keepdim=True).values
    return torch.where(constant, torch.zeros_like(adv), adv).view(-1)


def seq_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B]: log s_i = mean over completion tokens of (logp - old_logp). The mean, not
    the sum: a summed log-ratio shrinks or explodes with length (TRL #5814)."""
    mask = mask.bool()
    diff = torch.where(mask, logp - old_logp, torch.zeros_like(logp))  # padding never reaches exp
    return diff.sum(1) / mask.sum(1).clamp(min=1)


def gspo_loss(
    logp, old_logp, advantages, mask, eps_low=3e-4, eps_high=4e-4, variant="sequence", denominator: int | None = None
):
    """GSPO's clipped surrogate as a loss to minimise; `logp`, `old_logp`, `mask` are [B, T]. The
    mean over sequences divides by `denominator` (default B): pass the whole minibatch's size when
    `logp` covers only some of its rows (the others contributing 0).

    variant="sequence": paper Eq. 5, one clipped ratio per sequence, advantages [B].
    variant="token": GSPO-token (section 4.3), advantages [B] or [B, T], clipped per token and
    aggregated as the mean over sequences of the mean over each sequence's tokens."""
    mask = mask.bool()
    raw_log_s = seq_log_ratio(logp, old_logp, mask)  # [B]
    log_s = raw_log_s.clamp(*LOG_RATIO_CLAMP)
    if variant == "sequence":
        ratio, adv = log_s.exp(), advantages  # [B]
    elif variant == "token":
        # value of each token's ratio = s_i; gradient flows through its own logp_t only. The clamp
        # acts on the unclamped value, so beyond it both variants have zero gradient alike.
        own = torch.where(mask, logp - logp.detach(), torch.zeros_like(logp))  # 0-valued, carries grad
        log_s_tok = raw_log_s.detach()[:, None] + own  # [B, T]
        ratio = log_s_tok.clamp(*LOG_RATIO_CLAMP).exp()
        adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(ratio)
    else:
        raise ValueError(f"variant must be 'sequence' or 'token', got {variant!r}")
    clipped_ratio = ratio.clamp(1 - eps_low, 1 + eps_high)
    per_item = torch.maximum(-adv * ratio, -adv * clipped_ratio)  # pessimistic bound, negated
    # the clip is active (and the gradient zero) exactly where the clipped branch is the larger
    is_clipped = ((adv > 0) & (ratio > 1 + eps_high)) | ((adv < 0) & (ratio < 1 - eps_low))
    n_seqs = denominator if denominator is not None else logp.shape[0]
    if variant == "sequence":
        loss = (per_item * mask.any(1)).sum() / n_seqs  # an empty row contributes 0, as in GSPO-token
        clip_frac = is_clipped.float().mean()
    else:
        loss = masked_mean(per_item, mask, dim=1).sum() / n_seqs
        clip_frac = masked_mean(is_clipped.float(), mask)
    seq_ratio = log_s.detach().exp()
    stats = {
        "clip_frac": clip_frac.item(),
        "ratio_mean": seq_ratio.mean().item(),
        "ratio_max_dev": (seq_ratio - 1).abs().max().item(),
        "ratio_std": seq_ratio.std(unbiased=False).item(),  # spread of the sequence ratios
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
    if args.variant not in ("sequence", "token"):
        raise common.UsageError(f"--variant must be sequence or token, got {args.variant!r}")
    train_set, eval_set = common.load_task(args.task, args.data)
    eval_set = eval_set[: args.eval_size]
    resume_from = common.open_checkpoint(args, "gspo") if args.resume else None

    common.seed_everything(args.seed)
    device = common.resolve_device(args.device, local_rank)
    common.tiny_checkpoint(args.model) if args.model in common.TINY_MODELS else None  # first build is not timed
    t_start = time.perf_counter()
    model, tok = common.load_model(args.model, device)
    eos_ids = common.eos_token_ids(model, tok)
    routing = common.RoutingReplay(model)  # records / replays MoE expert choices; no-op on a dense model
    if args.routing_replay and not routing.blocks:
        raise common.UsageError(f"--routing-replay: --model {args.model} has no MoE layers")
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
        desc="gspo",
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
        advantages = group_advantages(rewards, args.group_size).to(device)  # [B]
        mask = roll.completion_mask  # [B, T]

        # 2. Log-probs of the sampling policy (pi_old), once per rollout. Until the first update the
        #    policy is pi_old itself, so the first minibatch takes them from its own forward pass in
        #    step 3 (detached: its ratio is exactly 1) and this pass covers the other rows. An MoE
        #    model runs it on every row: it also records the experts each token is routed to.
        #    A row whose advantage is 0 (its group's rewards all equal) adds exactly 0 to the loss
        #    and its gradient, so the updates forward only each minibatch's other rows (`kept`; at
        #    least one, so that every update and every torchrun rank still runs) and divide by the
        #    whole minibatch: the same gradient for less work.
        minibatches = [
            idx
            for _ in range(args.epochs)  # every epoch's minibatches (row indices), drawn up front
            for idx in torch.randperm(len(roll), device=device).chunk(args.minibatches)
        ]
        kept = [idx[advantages[idx] != 0] if (advantages[idx] != 0).any() else idx[:1] for idx in minibatches]
        first_on_policy = not routing.blocks
        old_logp, entropy = torch.zeros(mask.shape, device=device), torch.zeros(mask.shape, device=device)  # [B, T]
        needs_pass = torch.ones(len(roll), dtype=torch.bool, device=device)  # every row, for the entropy
        needs_pass[kept[0]] = not first_on_policy
        rows = needs_pass.nonzero().squeeze(1)
        with torch.no_grad(), routing.record():
            if len(rows):
                old_logp[rows], entropy[rows] = common.completion_logprobs(model, roll[rows], args.temperature)

        # 3. Updates: epochs x minibatches; after the first, the policy is off-policy w.r.t. pi_old.
        model.train()
        step_stats, n_updates = [], 0
        for k, (idx, rows) in enumerate(zip(minibatches, kept)):
            # --routing-replay: the old-logp pass's experts, also in any recompute during backward
            with routing.replay(routing.indices if args.routing_replay else None, rows):
                logp, token_entropy = train_model(roll[rows], args.temperature)
                if k == 0 and first_on_policy:
                    old_logp[rows], entropy[rows] = logp.detach(), token_entropy
                loss, stats = gspo_loss(
                    logp,
                    old_logp[rows],
                    advantages[rows],
                    mask[rows],
                    args.eps_low,
                    args.eps_high,
                    args.variant,
                    denominator=len(idx),
                )
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
            # skipped rows are never clipped: the clip fraction is over the whole minibatch's
            # sequences (GSPO) or tokens (GSPO-token)
            n_kept, n_all = (
                (len(rows), len(idx))
                if args.variant == "sequence"
                else (mask[rows].sum().item(), mask[idx].sum().item())
            )
            stats["clip_frac"] *= n_kept / max(1, n_all)
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
            common.save_checkpoint(logger.out, "gspo", args, model, tok, state)
        if common.stop_requested():
            break

    interrupted = progress.step < args.steps
    if not interrupted:
        logger.save_model(model, tok)
    logger.summary(
        {
            "algo": "gspo",
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
    common.main(train, Args, "gspo")
