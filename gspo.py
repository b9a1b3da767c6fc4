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
nothing; it stays in the batch (unless --filter-groups, DAPO's dynamic sampling, replaces it: step 3),
and an update forwards only its rows with A != 0 (`rows_with_signal`; all of them with --entropy-coef),
or, when its minibatch has none, one stand-in row that no logged number counts.

What this file leaves out, as all three do (a separate inference engine, tensor parallelism, ...):
docs/scope.md.

Where to read: `gspo_loss` (the objective), `seq_log_ratio`, `group_advantages`, then `train()`,
whose numbered steps are the algorithm and make every logged number; `common.py` holds the runtime
(sampling, log-probs, rewards, evaluation, checkpoints, torchrun).

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

import collections
import math
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
    share clipped (clip_frac_seqs: of sequences; clip_frac: of tokens, GSPO-token), the sequence ratios'
    statistics and the tokens' log-ratio statistics, each with what it counts (ratio_seqs, tokens).
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
    log_ratio = (logp.detach() - old_logp)[mask].double()  # [N] each token's log(pi / pi_old): how far it moved
    n_tokens = max(1, len(log_ratio))
    info = {
        "ratio": ratio.detach(),
        "clipped": is_clipped,
        **clip_frac,
        "ratio_seqs": int(mask.any(1).sum()),  # the sequences the ratio statistics are of
        "ratio_mean": seq_ratio.mean().item(),
        "ratio_std": seq_ratio.std(unbiased=False).item(),  # spread of the sequence ratios
        "ratio_max_dev": (seq_ratio - 1).abs().max().item(),
        # the same token-level yardstick in all three scripts: the spread of log(pi / pi_old) and the share of tokens
        # whose own ratio is outside [0.8, 1.2], GRPO's usual clip (GSPO's 1e-4 band would flag every token)
        "tokens": len(log_ratio),
        "log_ratio_mean": log_ratio.sum().item() / n_tokens,
        "log_ratio_std": log_ratio.std(unbiased=False).item() if len(log_ratio) else 0.0,
        "ratio_outside_grpo_clip": ((log_ratio.exp() < 0.8) | (log_ratio.exp() > 1.2)).sum().item() / n_tokens,
    }
    return loss, info


def rows_with_signal(idx: torch.Tensor, advantages: torch.Tensor, entropy_coef: float) -> tuple[torch.Tensor, bool]:
    """(rows, real): the rows of minibatch `idx` an update forwards. A row whose advantage is 0 adds exactly 0 to the
    loss and its gradient, so only the others are (the loss still divides by len(idx)), unless --entropy-coef gives
    every row a gradient. With none left the first row stands in (real False), so that the update runs on every rank:
    it adds 0 to the loss, and the step's logged numbers count none of it. A default step forwarding every row
    instead takes 1.36 times as long (docs/results.md, 2026-12-07)."""
    rows = idx if entropy_coef > 0 else idx[advantages[idx] != 0]
    return (rows, True) if len(rows) else (idx[:1], False)


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
    shuffle = torch.Generator().manual_seed(args.seed)  # the minibatches' order (the same on every rank)
    guard = common.NonFiniteGuard()
    progress = common.Progress()  # the step, the evaluations, the warnings given
    # all that moves during a run besides the weights: a checkpoint saves each, --resume restores it bit for bit
    # (common.start_run; the global RNGs too, which nothing here draws from but your own --reward might)
    state = dict(optimizer=optimizer, stream=stream, sampling_gen=rng, shuffle_gen=shuffle, guard=guard,
                 progress=progress)  # fmt: skip
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
            # 2. Score (env.reward_fn, a common.Rewards): the weighted sum of the --reward functions and --reward-model;
            #    the default, --reward exact, is `common.score`: 1 if the answer after the last '####' is the record's.
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

        # 5. pi_old: the log-probs of the weights that sampled the batch (no update has run since: the current weights),
        #    without gradient, over every row, once per rollout. --old-logp rollout: the sampler's own, no forward.
        if args.old_logp == "rollout":  # (of its whole distribution: with --top-p < 1 like with like)
            old_logp = roll.sample_logp_full * mask  # [B, T]
        else:
            with torch.no_grad(), common.recording_experts(moe, roll):  # MoE: each token's experts, into roll.experts
                old_logp = common.completion_logprobs(model, roll, args.temperature)[0]  # [B, T]
        is_weights = None  # --is-correction: weigh the loss by pi_old / mu, one weight per sequence (variant sequence)
        if args.is_correction != "none":
            precision = common.extra("rollout_precision", "--is-correction")
            is_weights = precision.is_weights(old_logp, roll.sample_logp, mask, args.is_correction, args.is_cap,
                                              per=args.variant)  # fmt: skip

        # 6. Updates: epochs x minibatches of the clipped sequence-level objective (Eq. 5), each epoch a fresh order of
        #    the rows drawn from `shuffle`. --trace-every: a few groups token by token (OUT/traces.jsonl).
        trace = common.start_trace(args, env, tok, sampler, step, roll, records, rewards, parts, advantages, old_logp)
        # mu recorded (--rollout-dtype, --old-logp rollout, --is-correction): the sampler against pi_old (mismatch_*)
        mismatch = {}
        if sampler.records:  # (None under --old-logp rollout: no pi_old forward to compare; the first update's is)
            precision = common.extra("rollout_precision", "--rollout-dtype")
            mismatch = precision.rollout_mismatch(roll, old_logp, is_weights, args)
        model.train()
        totals, max_dev = collections.Counter(), 0.0  # the updates' numbers, summed with their weights (step 7)
        orders = [torch.randperm(len(roll), generator=shuffle).to(env.device) for _ in range(args.epochs)]  # [B] each
        minibatches = [idx for order in orders for idx in order.chunk(args.minibatches)]  # each epoch's in turn
        for k, idx in enumerate(minibatches):
            on_policy = k == 0  # this forward runs at the weights that sampled the batch (the first update's)
            rows, real = rows_with_signal(idx, advantages, args.entropy_coef)  # real: False for a stand-in row
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
            if not guard.ok(step, loss, grad_norm):  # a non-finite loss or gradient skips the update
                totals["skipped"] += 1
                continue
            optimizer.step()
            # this update's numbers, each times the count it is a mean of (a stand-in row counts 0): step 7 divides
            seqs, tokens = real * info["ratio_seqs"], real * info["tokens"]  # the loss's sequences and tokens
            sequence = args.variant == "sequence"  # its clip share is of sequences (GSPO-token's: of tokens)
            clipped = real * len(rows) * info["clip_frac_seqs"] if sequence else tokens * info["clip_frac"]
            totals.update(updates=1, loss=loss.item(), grad_norm=grad_norm.item(),  # per update
                          minibatch_seqs=len(idx), minibatch_tokens=mask[idx].sum().item(), clipped=clipped,
                          seqs=seqs, ratio=seqs * info["ratio_mean"],
                          ratio_sq=seqs * (info["ratio_std"] ** 2 + info["ratio_mean"] ** 2),
                          tokens=tokens, log_ratio=tokens * info["log_ratio_mean"],
                          log_ratio_sq=tokens * (info["log_ratio_std"] ** 2 + info["log_ratio_mean"] ** 2),
                          outside=tokens * info["ratio_outside_grpo_clip"])  # fmt: skip
            max_dev = max(max_dev, real * info["ratio_max_dev"])
            if mismatch is None and on_policy:  # --old-logp rollout: mu against the trainer at mu's weights
                mismatch = precision.mismatch_stats(logp.detach(), roll.sample_logp[rows], loss_mask[rows] * real)
            if trace is not None:  # the ratio and clip decisions of each traced row (a stand-in row left out)
                trace.update(rows if real else rows[:0], logp, entropy, info, on_policy)

        # 7. The step's metrics, means over every rank: of everything sampled (--filter-groups trains part of it), of
        #    the updates (each number's sum over updates and ranks divided by its count), of the policy where asked.
        s_roll, s_rewards, s_parts = sampled
        s_mask = s_roll.completion_mask
        groups = s_rewards.view(-1, args.group_size)  # [groups, G] every group sampled this step
        constant = groups.max(1).values == groups.min(1).values  # all rewards equal: A = 0, nothing to learn from
        totals.update(groups_sampled=len(groups), groups_kept=(advantages.view(-1, args.group_size) != 0).any(1).sum())
        t = common.global_sums(totals)  # each sum over the ranks
        ratio_mean = t["ratio"] / t["seqs"] if t["seqs"] else 1.0  # (no sequence: ratio 1)
        log_ratio_mean = t["log_ratio"] / max(t["tokens"], 1)
        lowest, _ = common.global_range(s_rewards)
        row = {
            "step": step,
            "lr": optimizer.param_groups[0]["lr"],
            **common.global_means({"reward": s_rewards, **s_parts}),  # reward/<name> per --reward; accuracy, ...
            "truncated_frac": common.global_mean((~common.completion_ends(s_roll, sampler.eos_ids)).float()),
            "loss": t["loss"] / max(t["updates"], 1),  # means over the updates that stepped
            "grad_norm": t["grad_norm"] / max(t["updates"], 1),
            "skipped_updates": t["skipped"] / env.world,  # the non-finite guard's, per rank
            # of every minibatch's sequences (tokens, GSPO-token), as TRL and verl count it: a row left out never clips
            **({"clip_frac_seqs": t["clipped"] / max(t["minibatch_seqs"], 1)} if args.variant == "sequence"
               else {"clip_frac": t["clipped"] / max(t["minibatch_tokens"], 1)}),
            "ratio_mean": ratio_mean,  # the sequence ratios s_i of every update: their mean, spread, largest |s - 1|
            "ratio_std": math.sqrt(max(0.0, t["ratio_sq"] / max(t["seqs"], 1) - ratio_mean**2)),
            "ratio_max_dev": common.global_range(max_dev)[1],
            "log_ratio_std": math.sqrt(max(0.0, t["log_ratio_sq"] / max(t["tokens"], 1) - log_ratio_mean**2)),
            "ratio_outside_grpo_clip": t["outside"] / max(t["tokens"], 1),
            "entropy": common.global_token_mean(s_roll.entropy, s_mask),  # of the sampling distribution, per token
            "response_len": common.global_mean(s_mask.sum(1)),
            "tokens_per_s": common.tokens_per_s(s_roll),  # every rank's sampled tokens per second of sampling
            "zero_std_frac": common.global_mean(constant.float()),  # groups whose rewards are all equal
            # ... all at the batch's lowest reward (all failed, unless the whole batch is solved: the collapse warning)
            "zero_std_low_frac": common.global_mean((constant & (groups[:, 0] == lowest)).float()),
            "sample_rounds": s_roll.draws,  # --filter-groups: rounds sampled to fill the step; groups sampled, trained
            "groups_sampled": round(t["groups_sampled"]),
            "groups_kept": round(t["groups_kept"]),
            **(mismatch or {}),  # mu against pi_old: mismatch_*, is_* (--rollout-dtype, --old-logp, --is-correction)
        }  # fmt: skip
        if ref_model is not None:  # --reward-model: how far the policy moved from where it started
            row.update(common.extra("reward_model", "--reward-model").kl_to_init(ref_model, roll, old_logp,
                                                                                 args.temperature))  # fmt: skip
        if moe is not None:  # MoE: the share of tokens whose experts the step's updates changed
            row.update(moe.drift(model, roll, args.temperature))

        # 8. Evaluate (every --eval-every steps and after the last), warn once if the run looks stuck (no signal: every
        #    group's rewards equal) or collapsed, write the row, and checkpoint (every --save-every steps, on Ctrl-C).
        samples = common.evaluate_if_due(args, env, model, tok, progress, row)  # eval_*: greedy, held-out prompts
        row["step_time_s"] = time.perf_counter() - started  # the whole step, its evaluation included
        no_signal = not common.on_any_rank(bool(advantages.any()))
        common.log_step(args, env, progress, writer, bar, row, s_rewards, no_signal, samples, trace)
        if common.save_checkpoint_if_due(args, env, model, tok, state, step):
            break  # a stop signal came: checkpoint saved
    return common.finish(args, env, model, tok, progress, writer)


if __name__ == "__main__":
    common.main(train, Args)
