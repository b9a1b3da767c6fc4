"""GSPO: Group Sequence Policy Optimization (Zheng et al. 2025, Qwen, arXiv 2507.18071).

Objective (paper Eq. 5), for G completions y_i of each prompt x, maximised:

    J(theta) = E[ 1/G sum_i min( s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i ) ]
    s_i = ( pi_theta(y_i|x) / pi_old(y_i|x) ) ^ (1/|y_i|) = exp( mean_t (logp_t - old_t) )
    A_i = (R_i - mean_j R_j) / std_j R_j                       (group advantage, Eq. 6)

The importance ratio is one number per *sequence*, length-normalised, and the clip acts on whole
sequences, where GRPO clips token by token. GSPO-token (section 4.3) gives every token the same
ratio value, log s_it = sg[log s_i] + logp_t - sg[logp_t], so that per-token advantages can be
used; with one advantage per sequence its loss and gradient equal GSPO's. As in the paper there
is no KL term and no reference model. A group whose rewards are all equal has A_i = 0 and adds
nothing; it stays in the batch (no DAPO-style resampling) but is not forwarded.

What this file leaves out, as all three do (a separate inference engine, tensor parallelism, ...):
docs/scope.md.

Where to read: `gspo_loss` (the objective), `seq_log_ratio`, `group_advantages`, then `train()`,
whose numbered steps are the algorithm; `common.py` holds everything else.

Run (CPU, embedded tiny Qwen3, about 5 minutes on 2 cores):   python gspo.py
Stop with Ctrl-C (it saves a checkpoint), then continue:   python gspo.py --resume runs/gspo
A real Qwen on a GPU:   python gspo.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k \
    --data gsm8k_train.jsonl --max-new-tokens 512 --prompts-per-step 32 --lr 1e-6
Data parallel on N GPUs (each rank samples prompts-per-step / N prompts; gradients averaged):
    torchrun --nproc_per_node N gspo.py ...same flags...   (on CPU: gloo, --device cpu)
    torchrun --nproc_per_node N gspo.py --fsdp ...   (weights, gradients, AdamW state sharded: FSDP2)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

import common
from common import arg, masked_mean

LOG_RATIO_CLAMP = (-20.0, 10.0)  # sequence log-ratio bounds before exp (GSPO: <= 10)


@dataclass
class Args:
    eps_low: float = arg(3e-4, "lower clip range of the sequence ratio (paper: 3e-4)")
    eps_high: float = arg(4e-4, "upper clip range of the sequence ratio (paper: 4e-4)")
    variant: str = arg(
        "sequence", "sequence (GSPO, Eq. 5) or token (GSPO-token, section 4.3)", choices=("sequence", "token")
    )
    mask_truncated: bool = arg(
        False, "leave completions cut at --max-new-tokens (no EOS) out of the policy loss (DAPO overlong filtering)"
    )
    # the flags every script shares (common.SHARED_FLAGS: the same order in all three)
    model: str = arg(
        "tiny", "'tiny' (Qwen3, shipped in checkpoints/), 'tiny-moe' (its Qwen3-MoE twin) or a local dir / hub id"
    )
    task: str = arg(
        None,
        "arith (default), sums (long; sets --model, --max-new-tokens), gsm8k, jsonl (implied by --data alone)",
        choices=common.TASKS,
    )
    data: str = arg(None, "JSONL file of {prompt, answer, ...} or GSM8K {question, answer} records")
    eval_data: str = arg(None, "JSONL file to evaluate on (e.g. GSM8K's test split) instead of 10% held out of --data")
    system_prompt: str = arg(
        None, "instruction a chat template puts before each prompt (default: asks for the answer as --reward reads it)"
    )
    reward: list[str] = arg(
        [],
        "exact, boxed, format, module:function or file.py:function; several add up ([]: exact, or none "
        "with --reward-model)",
    )
    reward_weights: list[float] = arg([], "one weight per --reward (default: 1 each)")
    reward_model: str = arg(
        None, "learned reward: tiny-rm (embedded) or a sequence-classification checkpoint (docs/reward_model.md)"
    )
    reward_model_weight: float = arg(1.0, "weight of --reward-model in the weighted sum")
    reward_model_norm: bool = arg(False, "whiten the reward model's scores per batch (mean 0, std 1)")
    steps: int = arg(1000, "number of rollout + update steps (about 5 minutes on 2 CPU cores)")
    prompts_per_step: int = arg(64, "prompts sampled per step")
    group_size: int = arg(4, "completions per prompt (G); the group is the advantage baseline")
    max_new_tokens: int = arg(8, "maximum completion length in tokens")
    temperature: float = arg(1.0, "sampling temperature; log-probs use the same temperature")
    top_p: float = arg(1.0, "nucleus sampling threshold (1 = off)")
    lr: float = arg(6e-4, "AdamW learning rate at step 1 (a real 0.5B-7B Qwen wants about 1e-6)")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    max_grad_norm: float = arg(1.0, "gradient-norm clipping threshold")
    anneal_lr: bool = arg(True, "decay the learning rate linearly to about 0 over --steps (--no-anneal-lr: constant)")
    minibatches: int = arg(
        2,
        "minibatch updates per epoch over each rollout (the paper uses 4; every update after the first is off-policy)",
    )
    epochs: int = arg(1, "passes over each rollout")
    grad_checkpointing: bool = arg(False, "recompute activations in backward (less memory, about 30% slower)")
    entropy_coef: float = arg(0.0, "weight of an entropy bonus in the loss, on every row (0: none, as in the paper)")
    eval_every: int = arg(10, "evaluate every N steps (0: only before and after training)")
    eval_size: int = arg(500, "held-out prompts used for evaluation")
    eval_samples: int = arg(0, "also sample N >= 2 completions per eval prompt: eval_pass@1 and eval_pass@N (0: off)")
    report_to: str = arg(
        "none",
        "tensorboard: also write every metric to OUT/tensorboard (beside metrics.jsonl)",
        choices=common.REPORT_TO,
    )
    trace_every: int | None = arg(
        None, "write per-token traces to OUT/traces.jsonl every N steps (none: at each evaluation; 0: off)"
    )
    trace_groups: int = arg(4, "groups (PPO: prompts) of a traced step's rollout that its trace keeps")
    seed: int = arg(0, "random seed (data order, sampling, init)")
    out: str = arg("runs/gspo", "output directory")
    save_every: int = arg(0, "write a checkpoint to OUT/checkpoint every N steps and at the end (0: off)")
    resume: str = arg(
        None, "continue the run in this --out directory (or its checkpoint/); its flags are reused, --steps may grow"
    )
    max_consecutive_skips: int = arg(3, "stop (exit status 3) after this many non-finite updates in a row")
    device: str = arg("auto", "auto, cpu or cuda")
    fsdp: bool = arg(
        False, "under torchrun: shard weights, gradients and AdamW state over the ranks (FSDP2), not a copy on each"
    )
    lora_rank: int = arg(0, "LoRA: train rank-r adapters (peft) on the frozen base instead of every weight (0: off)")
    lora_alpha: float | None = arg(None, "LoRA: the adapters' update is scaled by alpha / r (none: 2 x --lora-rank)")
    lora_targets: list[str] = arg(common.LORA_TARGETS, "LoRA: the projections that get adapters (attention and MLP)")
    merge_lora: bool = arg(False, "LoRA: also write OUT/final/merged, a standard checkpoint, adapters merged in")
    rollout_dtype: str = arg(
        "float32", "dtype the sampler runs in: bfloat16 samples from a bf16 copy of the policy", common.ROLLOUT_DTYPES
    )
    old_logp: str = arg(
        "recompute", "pi_old: the trainer's forward (recompute) or the sampler's log-probs (rollout)", common.OLD_LOGP
    )
    is_correction: str = arg(
        "none",
        "weigh the loss by pi_old / mu: token-level truncated IS (tis) or a sequence mask",
        common.IS_CORRECTIONS,
    )
    is_cap: float = arg(2.0, "--is-correction's cap C: tis truncates pi_old / mu at C, mask drops sequences above it")


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
    logp,
    old_logp,
    advantages,
    mask,
    eps_low=3e-4,
    eps_high=4e-4,
    variant="sequence",
    denominator: int | None = None,
    weights=None,
    trace=None,
):
    """GSPO's clipped surrogate as a loss to minimise; `logp`, `old_logp`, `mask` are [B, T]. The
    mean over sequences divides by `denominator` (default B): pass the whole minibatch's size when
    `logp` covers only some of its rows (the others contributing 0). `weights` [B, T], detached
    (--is-correction, one value per sequence for variant="sequence"), multiply each term.

    variant="sequence": paper Eq. 5, one clipped ratio per sequence, advantages [B].
    variant="token": GSPO-token (section 4.3), advantages [B] or [B, T], clipped per token and
    aggregated as the mean over sequences of the mean over each sequence's tokens.
    `trace` (--trace-every; a dict or None) receives the ratios and clip decisions ([B] or [B, T])."""
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
    if weights is not None:  # [B, T]; a sequence's weight is the same on each of its tokens
        per_item = per_item * (weights[:, 0] if variant == "sequence" else weights)
    # the clip is active (and the gradient zero) exactly where the clipped branch is the larger
    is_clipped = ((adv > 0) & (ratio > 1 + eps_high)) | ((adv < 0) & (ratio < 1 - eps_low))
    if trace is not None:
        trace.update(ratio=ratio.detach(), clipped=is_clipped)
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
    env = common.setup(args, "gspo", needs_group=True)  # flag checks, torchrun, data, --reward, --resume, seeds
    model, tok = common.load_model(args.model, env.device, args.grad_checkpointing)
    model = common.add_lora(model, args)  # --lora-rank r: only rank-r adapters train; else model itself
    eos_ids = common.eos_token_ids(model, tok)
    sampler = common.Sampler(model, args)  # --rollout-dtype bfloat16: a bf16 copy; records mu when read
    # roll -> (logp, entropy) [B, T]; under torchrun data parallel (DDP, or with --fsdp sharded: FSDP2)
    policy = common.data_parallel(common.CompletionLogprobs(model), env.device, args)
    routing = common.RoutingReplay(model)  # MoE models: notes each token's experts, for routing_drift
    # with --reward-model, a frozen initial policy for kl_to_init (the over-optimisation axis); else none
    # (with LoRA: the policy with its adapters disabled, no second copy)
    init_model = common.reference_model(model, args.model, env.device, args) if args.reward_model else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, fused=True)
    stream = common.PromptStream(env.train_set, args.seed)
    rng = torch.Generator(env.device).manual_seed(args.seed + env.rank)  # sampling's own; each rank its own samples
    guard = common.NonFiniteGuard(args.max_consecutive_skips)
    # metrics, evaluation, checkpoints and --resume; a checkpoint saves the policy and these objects:
    run = common.Run("gspo", args, env, model, tok, optimizer=optimizer, stream=stream, sampling_gen=rng, guard=guard)

    for step in run.steps():
        lr_frac = common.anneal_lr(args, step, (optimizer, args.lr))  # --anneal-lr: linear decay to ~0
        # 1. Sample G completions of each prompt from the current policy, which is pi_old.
        model.eval()
        examples = stream.next(args.prompts_per_step)[env.rank :: env.world]  # under torchrun: this rank's share
        prompts, records = common.prompts_and_records(tok, examples, args.group_size, env.system_prompt)  # G rows each
        t0 = time.perf_counter()
        roll = sampler.sample(
            prompts, args.max_new_tokens, eos_ids, tok.pad_token_id, args.temperature, args.top_p, rng
        )
        sample_time = time.perf_counter() - t0
        mask = roll.completion_mask  # [B, T] 1 on completion tokens, the EOS token included

        # 2. Score: the weighted sum of the --reward functions and --reward-model (default: 1 if the answer is right).
        rewards, parts = env.reward_fn(tok, roll, records)  # [B]; parts: each component [B], accuracy, format_rate
        truncated = ~common.completion_ends(roll, eos_ids)  # [B] cut at --max-new-tokens, no EOS
        # --mask-truncated (DAPO's overlong filtering): such rows leave the loss, not their group's statistics
        loss_mask = mask * ~truncated[:, None] if args.mask_truncated else mask

        # 3. Advantages: each completion against its group (Eq. 6).
        advantages = group_advantages(rewards, args.group_size).to(env.device)  # [B]

        # 4. Log-probs of pi_old, once per rollout, without gradient, for the rows the updates will forward:
        #    the minibatches are drawn first, and a row whose advantage is 0 adds nothing, so it is left out.
        #    (--entropy-coef: the bonus has a gradient on every row, so every row is forwarded)
        skip_by = advantages if args.entropy_coef == 0 else None
        plan = common.plan_updates(len(roll), args.epochs, args.minibatches, env.device, skip_by)  # [(idx, rows)]
        with torch.no_grad(), routing.record():  # (MoE: every row, to record its experts)
            old_logp = common.old_logprobs(  # --old-logp rollout: the sampler's, no forward
                model, roll, plan, args.temperature, args.old_logp, bool(routing.blocks) or init_model is not None
            )
        # --rollout-dtype bfloat16 (or a correction): how far the sampler mu is from pi_old, and the loss weights
        is_weights, mismatch = common.rollout_correction(old_logp, roll, plan, args, per=args.variant)
        trace = run.trace(roll, records, rewards, parts, advantages, old_logp, plan)  # --trace-every: a few groups

        # 5. Updates: epochs x minibatches of the clipped sequence-level objective (Eq. 5).
        model.train()
        updates = []
        for idx, rows in plan:
            logp, entropy = policy(roll[rows], args.temperature, entropy_grad=args.entropy_coef > 0)
            if mismatch is None:  # --old-logp rollout: this first forward is the trainer at the rollout's weights
                mismatch = common.mismatch_stats(logp.detach(), roll.sample_logp[rows], loss_mask[rows])
            weights = None if is_weights is None else is_weights[rows]  # --is-correction
            # divided by the whole minibatch's size, len(idx)
            loss, stats = gspo_loss(logp, old_logp[rows], advantages[rows], loss_mask[rows], args.eps_low,
                                    args.eps_high, args.variant, len(idx), weights,
                                    trace=trace.update(rows, logp, entropy))  # fmt: skip
            if args.entropy_coef > 0:  # minus c x entropy, as the loss averages: per sequence, then over sequences
                loss = loss - args.entropy_coef * masked_mean(entropy, loss_mask[rows], dim=1).sum() / len(idx)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = common.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            if guard.ok(step, loss, grad_norm):  # a non-finite loss or gradient skips the update
                optimizer.step()
                ratio_stats = common.token_ratio_stats(logp, old_logp[rows], loss_mask[rows])  # the same in all three
                updates.append({**stats, **ratio_stats, "loss": loss.item(), "grad_norm": grad_norm.item()})

        # 6. Log (evaluating every --eval-every steps) and checkpoint (every --save-every steps, and on Ctrl-C).
        zero_std_frac = common.global_mean((rewards.view(-1, args.group_size).std(1) == 0).float())  # all ranks'
        run.log(
            {
                "step": step,
                "lr": args.lr * lr_frac,
                "reward": common.global_mean(rewards),  # means over all ranks' completions
                **common.global_means(parts),  # reward/<name> per --reward; accuracy, format_rate
                "truncated_frac": common.global_mean(truncated.float()),
                **common.kl_to_init(init_model, roll, old_logp, args.temperature),
                **common.mean_over_updates(updates, args.epochs * args.minibatches),  # loss, clip_frac, ratio_*
                **routing.drift(model, roll, args.temperature),  # MoE: share of tokens whose experts changed
                **mismatch,  # mismatch_* between mu and pi_old, is_* of the correction (when mu is recorded)
                "entropy": masked_mean(roll.entropy, mask).item(),  # of pi_old, recorded while sampling
                "response_len": mask.sum(1).mean().item(),
                "zero_std_frac": zero_std_frac,
                "tokens_per_s": mask.sum().item() / sample_time,
            },
            no_signal=zero_std_frac == 1,  # every group's rewards equal: every advantage 0, no gradient
        )
        run.save_checkpoint_if_due(step)
    return run.finish()


if __name__ == "__main__":
    common.main(train, Args, "gspo")
