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
nothing; it stays in the batch (no DAPO-style resampling), and the updates do not forward its rows
unless --entropy-coef gives them a gradient (pi_old's forward still covers them where a measurement
reads every row: an MoE model's routing, --reward-model's kl_to_init).

What this file leaves out, as all three do (a separate inference engine, tensor parallelism, ...):
docs/scope.md.

Where to read: `gspo_loss` (the objective), `seq_log_ratio`, `group_advantages`, then `train()`,
whose numbered steps are the algorithm; `common.py` holds everything else.

Run (CPU, embedded tiny Qwen3, about 5 minutes on 2 cores):   python gspo.py
Stop with Ctrl-C (it saves a checkpoint), then continue:   python gspo.py --resume runs/gspo
A real Qwen on one 24 GB GPU, on GSM8K (python tools/gsm8k.py writes data/gsm8k_*.jsonl first; docs/running.md):
    python gspo.py --model Qwen/Qwen2.5-0.5B-Instruct --data data/gsm8k_train.jsonl \
      --eval-data data/gsm8k_test.jsonl --steps 200 --prompts-per-step 32 --group-size 8 --minibatches 8 \
      --max-new-tokens 512 --lr 1e-6 --grad-checkpointing --eval-every 20 --eval-size 500 \
      --save-every 20 --out runs/gspo-gsm8k   # planned peak: 13.36 GB
Data parallel on N GPUs (each rank samples prompts-per-step / N prompts; gradients averaged):
    torchrun --nproc_per_node N gspo.py ...same flags...   (on CPU: gloo, --device cpu)
    torchrun --nproc_per_node N gspo.py --fsdp ...   (weights, gradients, AdamW state sharded: FSDP2)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import torch

import common
from common import masked_mean

LOG_RATIO_CLAMP = (-20.0, 10.0)  # (low, high) bounds of a log-ratio before exp: the sequence ratio (GSPO: <= 10)


@dataclass
class Args(common.SharedArgs):  # the flags every script shares (model, data, output, ...), then GSPO's own
    # The training recipe: batch shape, sampling, optimiser and schedule
    steps: int = 1000
    """number of rollout + update steps (about 5 minutes on 2 CPU cores)"""
    prompts_per_step: int = 64
    """prompts sampled per step"""
    group_size: int = 4
    """completions per prompt (G); the group is the advantage baseline"""
    max_new_tokens: int = 8
    """maximum completion length in tokens"""
    temperature: float = 1.0
    """sampling temperature; log-probs use the same temperature"""
    lr: float = 6e-4
    """AdamW learning rate at step 1 (a real 0.5B-7B Qwen wants about 1e-6)"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient-norm clipping threshold"""
    anneal_lr: bool = True
    """decay the learning rate linearly to about 0 over --steps (--no-anneal-lr: constant)"""
    minibatches: int = 2
    """minibatch updates per epoch over each rollout (each after the first: off-policy)"""
    epochs: int = 1
    """passes over each rollout"""
    # and how a step fills its batch (DAPO's dynamic sampling; off: the paper's algorithm)
    filter_groups: bool = False
    """DAPO dynamic sampling: train only groups whose rewards differ, sampling more prompts to fill the step"""
    max_sample_rounds: int = 3
    """--filter-groups: at most this many sampling rounds a step"""
    # GSPO's own
    eps_low: float = 3e-4
    """lower clip range of the sequence ratio (paper: 3e-4)"""
    eps_high: float = 4e-4
    """upper clip range of the sequence ratio (paper: 4e-4)"""
    variant: Literal["sequence", "token"] = "sequence"
    """sequence (GSPO, Eq. 5) or token (GSPO-token, section 4.3)"""
    mask_truncated: bool = False
    """leave completions cut at --max-new-tokens (no EOS) out of the policy loss (DAPO overlong filtering)"""

    def check(self):
        common.check_clip(self.eps_low, self.eps_high)
        common.check_filter_groups(self)  # --max-sample-rounds >= 1; --filter-groups needs --group-size >= 2


# --------------------------------------------------------------------------------------------
# The algorithm: pure tensor functions (tests/test_gspo.py checks each against a plain loop)
# --------------------------------------------------------------------------------------------


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "std", eps: float = 1e-6) -> torch.Tensor:
    """[B] -> [B]: R - group mean, divided by (group std + eps) when scale="std" (Bessel's std).
    Rewards come group by group. A group whose rewards are all equal gets exactly 0."""
    if group_size < 2:  # a completion alone is its own baseline: every advantage would be 0 and nothing would train
        raise ValueError(f"group_size must be >= 2 (the group is the baseline), got {group_size}")
    r = rewards.float().view(-1, group_size)  # [B/G, G]
    adv = r - r.mean(1, keepdim=True)
    if scale == "std":
        adv = adv / (r.std(1, keepdim=True) + eps)
    elif scale != "none":
        raise ValueError(f"scale must be 'std' or 'none', got {scale!r}")
    constant = r.max(1, keepdim=True).values == r.min(1, keepdim=True).values
    return torch.where(constant, torch.zeros_like(adv), adv).view(-1)


def seq_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B]: log s_i = mean over completion tokens of (logp - old_logp). The mean, not
    the sum: a summed log-ratio shrinks or explodes with length (TRL #5814)."""
    mask = mask.bool()
    diff = torch.where(mask, logp - old_logp, torch.zeros_like(logp))  # padding never reaches exp
    return diff.sum(1) / mask.sum(1).clamp(min=1)


def gspo_loss(
    logp, old_logp, advantages, mask, *, eps_low=3e-4, eps_high=4e-4, variant="sequence", denominator=None, weights=None
):
    """GSPO's clipped surrogate as a loss to minimise; `logp`, `old_logp`, `mask` are [B, T]. The
    mean over sequences divides by `denominator` (default B): pass the whole minibatch's size when
    `logp` covers only some of its rows (the others contributing 0). `weights` [B, T], detached
    (--is-correction, one value per sequence for variant="sequence"), multiply each term.

    variant="sequence": paper Eq. 5, one clipped ratio per sequence, advantages [B].
    variant="token": GSPO-token (section 4.3), advantages [B] or [B, T], clipped per token and
    aggregated as the mean over sequences of the mean over each sequence's tokens.
    Returns (loss, info): info holds the ratio and the clip decisions, detached ([B] or [B, T]), the
    share clipped (clip_frac_seqs: of sequences; clip_frac: of tokens, GSPO-token) and ratio statistics.
    Argument order: (logp, old_logp, ...), then keywords only. verl's compute_policy_loss_gspo takes
    (old_log_prob, log_prob, advantages, response_mask, ...): pi_old first; TRL computes it inside
    GRPOTrainer._compute_loss (importance_sampling_level="sequence") from named inputs. Port by name."""
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
    n_seqs = denominator if denominator is not None else logp.shape[0]
    if variant == "sequence":
        loss = (per_item * mask.any(1)).sum() / n_seqs  # an empty row contributes 0, as in GSPO-token
        clip_frac = {"clip_frac_seqs": is_clipped.float().mean().item()}  # a share of sequences
    else:
        loss = masked_mean(per_item, mask, dim=1).sum() / n_seqs
        clip_frac = {"clip_frac": masked_mean(is_clipped.float(), mask).item()}  # a share of tokens
    seq_ratio = log_s.detach().exp()[mask.any(1)] if mask.any() else torch.ones(1)  # empty rows left out
    info = {
        "ratio": ratio.detach(),
        "clipped": is_clipped,
        **clip_frac,
        "ratio_mean": seq_ratio.mean().item(),
        "ratio_max_dev": (seq_ratio - 1).abs().max().item(),
        "ratio_std": seq_ratio.std(unbiased=False).item(),  # spread of the sequence ratios
        "ratio_seqs": int(mask.any(1).sum()),  # the sequences they are of: Run pools them by it, not by tokens
    }
    return loss, info


# --------------------------------------------------------------------------------------------
# Training loop
# --------------------------------------------------------------------------------------------


def train(args: Args):
    env = common.setup(args)  # flag checks, torchrun, data, --reward, --resume's checkpoint, seeds
    model, tok = common.load_model(args.model, env.device, args.grad_checkpointing)
    model = common.add_lora(model, args)  # --lora-rank r: only rank-r adapters train; else model itself
    sampler = common.Sampler(model, tok, args)  # --rollout-dtype bfloat16: a bf16 copy; records mu when read
    # roll -> (logp, entropy) [B, T]; under torchrun data parallel (DDP, or with --fsdp sharded: FSDP2)
    policy = common.data_parallel(common.CompletionLogprobs(model), env.device, args)
    # a frozen initial policy for kl_to_init with --reward-model; LoRA: the policy, adapters off; else none
    ref_model = common.reference_model(model, env.device, args) if args.reward_model else None
    moe = common.routing(model)  # an MoE model's experts, recorded in pi_old's forward (routing_drift); else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, fused=True)
    stream = common.PromptStream(env.train_set, args.seed)
    rng = torch.Generator(env.device).manual_seed(args.seed + env.rank)  # sampling's own; each rank its own samples
    guard = common.NonFiniteGuard()
    progress = common.Progress()  # the step, the evaluations, the warnings given
    # what a checkpoint saves beside the policy's weights (--resume restores each, and the RNG states, bit for bit)
    state = dict(optimizer=optimizer, stream=stream, sampling_gen=rng, guard=guard, progress=progress)
    writer = common.start_run(args, env, model, tok, state)  # --resume: loads state; else evaluates step 0. Opens OUT

    for step in (bar := common.progress_bar(args, env, progress)):
        started = time.perf_counter()
        common.anneal_lr(args, step, (optimizer, args.lr))  # --anneal-lr: linear decay to ~0
        # 1. Sample G completions of each prompt from the current policy, which is pi_old.
        model.eval()

        def sample_round():  # (--filter-groups samples more than one round: step 3)
            examples = stream.next(args.prompts_per_step)[env.rank :: env.world]  # under torchrun: this rank's share
            prompts, records = common.prompts_and_records(  # G rows each
                tok, examples, args.group_size, env.system_prompt, args.thinking
            )
            roll = sampler.sample(prompts, rng)
            # 2. Score: the weighted sum of the --reward functions and --reward-model (1 if the answer is right).
            rewards, parts = env.reward_fn(tok, roll, records)  # [B]; parts: each component [B], accuracy, ...
            return roll, records, rewards, parts

        roll, records, rewards, parts = sample_round()
        sampled = roll, rewards, parts  # everything sampled this step: its metrics (step 7) read it

        # 3. --filter-groups (DAPO's dynamic sampling): train only groups whose rewards differ; rounds of the stream's
        #    next prompts until --prompts-per-step of them (or --max-sample-rounds). Metrics read all that was sampled.
        if args.filter_groups:
            dapo = common.extra("filter_groups", "--filter-groups")
            (roll, records, rewards, parts), sampled = dapo.fill(args, env.world, sampler.pad_id, sample_round,
                                                                 (roll, records, rewards, parts))  # fmt: skip
        mask = roll.completion_mask  # [B, T] 1 on completion tokens, the EOS token included
        truncated = ~common.completion_ends(roll, sampler.eos_ids)  # [B] cut at --max-new-tokens, no EOS
        # --mask-truncated (DAPO's overlong filtering): such rows leave the loss, not their group's statistics
        loss_mask = mask * ~truncated[:, None] if args.mask_truncated else mask

        # 4. Advantages: each completion against its group (Eq. 6).
        advantages = group_advantages(rewards, args.group_size).to(env.device)  # [B]

        # 5. pi_old: the log-probs of the weights that sampled the batch (no update has run since, so the current
        #    weights), without gradient, once per rollout, over the rows the updates will forward. The minibatches
        #    are drawn first; a row whose advantage is 0 adds exactly 0 to the loss and its gradient, so an update
        #    forwards only its rows with signal (the loss still divides by the whole minibatch), unless
        #    --entropy-coef gives every row a gradient. A measurement that reads every row (an MoE model's routing,
        #    --reward-model's kl_to_init) has pi_old on all of them. --old-logp rollout: the sampler's own log-probs.
        plan = []  # (idx, rows): each update's minibatch and the rows it forwards
        for idx in common.minibatches(len(roll), args.epochs, args.minibatches, env.device):
            rows = idx[advantages[idx] != 0] if args.entropy_coef == 0 else idx
            plan.append((idx, rows if len(rows) else idx[:1]))  # at least one row: every update (and rank) runs
        has_old = torch.zeros(len(roll), dtype=torch.bool, device=env.device)  # [B] the rows pi_old is computed on
        has_old[torch.cat([rows for _, rows in plan])] = True
        has_old |= moe is not None or ref_model is not None
        if args.old_logp == "rollout":  # (of its whole distribution: with --top-p < 1 like with like)
            old_logp = torch.where(has_old[:, None] & mask.bool(), roll.sample_logp_full, 0.0)  # [B, T]
        else:
            old_logp = torch.zeros_like(mask)  # [B, T], 0 on the rows no update forwards
            with torch.no_grad(), common.recording_experts(moe, roll):  # MoE: each token's experts, into roll.experts
                old_logp[has_old] = common.completion_logprobs(model, roll[has_old], args.temperature)[0]
        is_weights = None  # --is-correction: weigh the loss by pi_old / mu, one weight per sequence (variant sequence)
        if args.is_correction != "none":
            precision = common.extra("rollout_precision", "--is-correction")
            is_weights = precision.is_weights(old_logp, roll.sample_logp, mask * has_old[:, None], args.is_correction,
                                              args.is_cap, per=args.variant)  # fmt: skip

        # 6. Updates: epochs x minibatches of the clipped sequence-level objective (Eq. 5).
        # --trace-every: every token of a few groups, as sampled, scored and updated (OUT/traces.jsonl)
        trace = common.start_trace(args, env, tok, sampler, step, roll, records, rewards, parts, advantages, old_logp,
                                   has_old)  # fmt: skip
        # mu recorded (--rollout-dtype, --old-logp rollout, --is-correction): the sampler against pi_old (mismatch_*)
        mismatch = {}
        if sampler.records:  # (None under --old-logp rollout: no pi_old forward to compare; the first update's is)
            precision = common.extra("rollout_precision", "--rollout-dtype")
            mismatch = precision.rollout_mismatch(roll, old_logp, has_old, is_weights, args)
        model.train()
        updates, skipped = [], 0  # what each update measured; those the non-finite guard skipped
        for k, (idx, rows) in enumerate(plan):
            on_policy = k == 0  # this forward runs at the weights that sampled the batch (the first update's)
            logp, entropy = policy(roll[rows], args.temperature, entropy_grad=args.entropy_coef > 0)
            weights = None if is_weights is None else is_weights[rows]
            # divided by the whole minibatch's size, len(idx)
            loss, info = gspo_loss(logp, old_logp[rows], advantages[rows], loss_mask[rows], eps_low=args.eps_low,
                                   eps_high=args.eps_high, variant=args.variant, denominator=len(idx),
                                   weights=weights)  # fmt: skip
            if args.entropy_coef > 0:  # minus c x entropy, as the loss averages: per sequence, then over sequences
                loss = loss - args.entropy_coef * masked_mean(entropy, loss_mask[rows], dim=1).sum() / len(idx)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = common.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            if guard.ok(step, loss, grad_norm):  # a non-finite loss or gradient skips the update
                optimizer.step()
                info.update(loss=loss.item(), grad_norm=grad_norm.item())
                # this update's numbers, each with what it counts (tokens, sequences): `pool` adds them up below
                updates.append(common.update_terms(info, logp, old_logp[rows], loss_mask[rows], mask[idx], len(rows)))
            else:
                skipped += 1
            if mismatch is None and on_policy:  # --old-logp rollout: mu against the trainer at mu's weights
                mismatch = precision.mismatch_stats(logp.detach(), roll.sample_logp[rows], loss_mask[rows])
            if trace is not None:  # the ratio and clip decisions of each traced row
                trace.update(rows, logp, entropy, info, on_policy)

        # 7. The step's metrics, means over every rank: of everything sampled (--filter-groups trains part of it),
        #    of the updates (pooled by what each number counts), and of the policy where a flag asks.
        s_roll, s_rewards, s_parts = sampled
        s_mask = s_roll.completion_mask
        row = {
            "step": step,
            "lr": optimizer.param_groups[0]["lr"],
            **common.global_means({"reward": s_rewards, **s_parts}),  # reward/<name> per --reward; accuracy, ...
            "truncated_frac": common.global_mean((~common.completion_ends(s_roll, sampler.eos_ids)).float()),
            **common.pool(updates, skipped),  # loss, grad_norm, clip_frac_seqs, ratio_*: pooled over updates, ranks
            "entropy": common.global_token_mean(s_roll.entropy, s_mask),  # of the sampling distribution, per token
            "response_len": common.global_mean(s_mask.sum(1)),
            "tokens_per_s": common.tokens_per_s(s_roll),  # every rank's sampled tokens per second of sampling
            # zero_std_frac: groups whose rewards are all equal (A = 0); groups_kept: those trained (--filter-groups)
            **common.group_metrics(s_rewards, rewards, s_roll.draws, args.group_size),
            **(mismatch or {}),  # mu against pi_old: mismatch_*, is_* (--rollout-dtype, --old-logp, --is-correction)
        }
        if ref_model is not None:  # --reward-model: how far the policy moved from where it started
            row.update(common.extra("reward_model", "--reward-model").kl_to_init(ref_model, roll, old_logp,
                                                                                 args.temperature))  # fmt: skip
        if moe is not None:  # MoE: the share of tokens whose experts the step's updates changed
            row.update(moe.drift(model, roll, args.temperature))

        # 8. Evaluate (every --eval-every steps and after the last), warn once if the run looks stuck (no signal: every
        #    group's rewards equal) or collapsed, write the row, and checkpoint (every --save-every steps, on Ctrl-C).
        no_signal = not common.on_any_rank(bool(advantages.any()))
        common.log_step(args, env, model, tok, progress, writer, bar, row, no_signal, started, trace)
        if common.save_checkpoint_if_due(args, env, model, tok, state, step):
            break  # a stop signal came: checkpoint saved
    return common.finish(args, env, model, tok, progress, writer)


if __name__ == "__main__":
    common.main(train, Args)
