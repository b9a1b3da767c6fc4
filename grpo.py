"""GRPO: Group Relative Policy Optimization (Shao et al. 2024, DeepSeekMath, arXiv 2402.03300).

Objective, for G completions y_i of each prompt x, maximised (DeepSeekMath Eq. 3, with the
loss aggregation as a choice):

    J(theta) = E[ agg_{i,t} ( min( r_it A_i, clip(r_it, 1 - eps_low, 1 + eps_high) A_i ) - beta KL_it ) ]
    r_it = pi_theta(y_it | x, y_i<t) / pi_old(y_it | x, y_i<t)          (one ratio per *token*)
    A_i  = (R_i - mean_j R_j) / std_j R_j       (Dr. GRPO: R_i - mean_j R_j, --scale-rewards none)
    KL_it = k3 = exp(ref - logp) - (ref - logp) - 1   (only with --kl-coef > 0: a frozen reference; its value
            estimates KL(pi || ref), its gradient as a loss is that of KL(ref || pi): `kl_k3`)

No critic: the other completions of the same prompt are the baseline. The aggregation decides how
tokens of different sequences are weighted: "seq-mean-token-mean" (the paper: every sequence
counts once), "token-mean" (DAPO: every token counts once), "seq-mean-token-sum-norm" (Dr. GRPO:
a constant normaliser, no length bias).

The defaults are the paper's aggregation and beta = 0 (no reference model in memory; the
measurements behind them are in docs/results.md). A group whose rewards are all equal has A_i = 0
and adds nothing; it stays in the batch, and an update forwards only its rows with A != 0
(`rows_with_signal`; all of them when the KL term or --entropy-coef gives them a gradient), or, when
its minibatch has none, one stand-in row that no logged number counts. --filter-groups drops such groups and samples the
stream's next prompts until the step is full (DAPO's dynamic sampling, step 3), so DAPO (Yu et al.
2025, arXiv 2503.14476) is
    python grpo.py --filter-groups --eps-high 0.28 --loss-agg token-mean --mask-truncated

What this file leaves out, as all three do (a separate inference engine, tensor parallelism, ...):
docs/scope.md.

Where to read: `grpo_loss` (the objective), `aggregate`, `kl_k3`, `group_advantages`, then
`train()`, whose numbered steps are the algorithm and make every logged number; `common.py` holds the
runtime (sampling, log-probs, rewards, evaluation, checkpoints, torchrun).

Run (CPU, embedded tiny Qwen3, about 5 minutes on 2 cores):   python grpo.py
Stop with Ctrl-C (it saves a checkpoint), then continue:   python grpo.py --resume runs/grpo
A real Qwen on one 24 GB GPU, on GSM8K (python tools/gsm8k.py writes data/gsm8k_*.jsonl first; docs/running.md):
    python grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --data data/gsm8k_train.jsonl \
      --eval-data data/gsm8k_test.jsonl --steps 200 --prompts-per-step 32 --group-size 8 --minibatches 8 \
      --max-new-tokens 512 --lr 1e-6 --kl-coef 0.001 --grad-checkpointing --eval-every 20 --eval-size 500 \
      --save-every 20 --out runs/grpo-gsm8k   # planned peak: 15.20 GB
Data parallel on N GPUs (each rank samples prompts-per-step / N prompts; gradients averaged):
    torchrun --nproc_per_node N grpo.py ...same flags...   (on CPU: gloo, --device cpu)
    torchrun --nproc_per_node N grpo.py --fsdp ...   (weights, gradients, AdamW state sharded: FSDP2)
"""

from __future__ import annotations

import collections
import contextlib
import math
import time
from dataclasses import dataclass
from typing import Literal

import torch

import common
from common import masked_mean

LOG_RATIO_CLAMP = (-20.0, 20.0)  # (low, high) bounds of a log-ratio before exp: token ratios, +-20 as verl
AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")


@dataclass
class Args(common.SharedArgs):  # the flags every script shares (model, data, output, ...), then GRPO's own
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
    lr: float = 3e-4
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
    # GRPO's own
    eps_low: float = 0.2
    """lower clip range of the token ratio"""
    eps_high: float = 0.2
    """upper clip range of the token ratio (DAPO clip-higher: 0.28)"""
    kl_coef: float = 0.0
    """beta of the k3 KL penalty to a frozen reference (0: no reference in memory)"""
    loss_agg: Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"] = "seq-mean-token-mean"
    """seq-mean-token-mean (paper), token-mean (DAPO) or seq-mean-token-sum-norm (Dr. GRPO)"""
    scale_rewards: Literal["std", "none"] = "std"
    """std (group z-score, the paper) or none (Dr. GRPO: R - mean)"""
    mask_truncated: bool = False
    """leave completions cut at --max-new-tokens (no EOS) out of the policy loss (DAPO overlong filtering)"""
    routing_replay: bool = False
    """MoE models: route every update forward through the experts of the old-logp pass (GSPO paper 5.3)"""

    def check(self):
        common.check_clip(self.eps_low, self.eps_high)
        common.check_filter_groups(self)  # --max-sample-rounds >= 1; --filter-groups needs --group-size >= 2
        if not 0 <= self.kl_coef < float("inf"):
            raise common.UsageError(f"--kl-coef must be a finite number >= 0, got {self.kl_coef}")
        if self.routing_replay and self.old_logp == "rollout":
            raise common.UsageError("--routing-replay replays the experts of the pi_old forward, which --old-logp "
                                    "rollout skips")  # fmt: skip


# --------------------------------------------------------------------------------------------
# The algorithm: pure tensor functions (tests/test_grpo.py checks each against a plain loop)
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


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """[B, T]: k3 = exp(x) - x - 1 with x = ref - logp (Schulman's k3), non-negative: its value over tokens
    sampled from pi is an unbiased estimate of KL(pi || ref), but as a loss term (the sampling not
    differentiated) its expected gradient is that of KL(ref || pi), the reverse direction (pi - ref weighs
    grad log pi: tests/test_kl_direction.py enumerates it). expm1 keeps it >= 0 in float32 where exp(x) - 1
    would not."""
    x = (ref_logp - logp).clamp(*LOG_RATIO_CLAMP)
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


def grpo_loss(logp, old_logp, advantages, mask, *, eps_low=0.2, eps_high=0.2, ref_logp=None, kl_coef=0.0,
              agg="seq-mean-token-mean", max_len=None, denominator=None, weights=None):  # fmt: skip
    """GRPO's per-token clipped surrogate (plus beta * k3 to the reference) as a loss to minimise.
    `logp`, `old_logp`, `mask` (and `ref_logp`) are [B, T]; `advantages` is [B] or [B, T].
    `weights` [B, T], detached (--is-correction), multiply each token's surrogate term, not the KL.
    Returns (loss, info): info holds each token's ratio and clip decision, detached, the shares of
    tokens clipped (clip_frac, _low, _high), ratio and log-ratio statistics and the mean KL, each a mean
    over `tokens` tokens (the ratio's largest deviation, ratio_max_dev, a maximum).
    Argument order: (logp, old_logp, ...), then keywords only. verl's compute_policy_loss_vanilla takes
    (old_log_prob, log_prob, advantages, response_mask, ...): pi_old first; TRL computes it inside
    GRPOTrainer._compute_loss from named inputs (old_per_token_logps, advantages). Port by name."""
    mask = mask.bool()
    log_ratio = torch.where(mask, logp - old_logp, torch.zeros_like(logp))  # padding never reaches exp
    ratio = log_ratio.clamp(*LOG_RATIO_CLAMP).exp()  # [B, T]
    adv = advantages if advantages.dim() == 2 else advantages[:, None]
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps_low, 1 + eps_high))
    if weights is not None:
        per_token = per_token * weights
    kl = torch.zeros_like(per_token)
    if ref_logp is not None:
        kl = torch.where(mask, kl_k3(logp, ref_logp), torch.zeros_like(logp))
        per_token = per_token + kl_coef * kl
    loss = aggregate(per_token, mask, agg, max_len, denominator)
    # the clip is active (and the token's gradient zero) where the clipped branch is the larger
    clip_low = (adv < 0) & (ratio < 1 - eps_low) & mask
    clip_high = (adv > 0) & (ratio > 1 + eps_high) & mask
    moved = (logp.detach() - old_logp)[mask].double()  # [N] each token's log(pi / pi_old): how far the update moved
    info = {
        "ratio": ratio.detach(),  # [B, T]
        "clipped": clip_low | clip_high,  # [B, T]
        "clip_frac": masked_mean((clip_low | clip_high).float(), mask).item(),
        "clip_frac_low": masked_mean(clip_low.float(), mask).item(),
        "clip_frac_high": masked_mean(clip_high.float(), mask).item(),
        "ratio_mean": masked_mean(ratio.detach(), mask).item(),
        "ratio_max_dev": ((ratio.detach() - 1).abs() * mask).max().item() if mask.any() else 0.0,
        "ratio_std": masked_mean((ratio.detach() - masked_mean(ratio.detach(), mask)) ** 2, mask).sqrt().item(),
        "kl": masked_mean(kl.detach(), mask).item(),
        # the same token-level yardstick in all three scripts: the spread of log(pi / pi_old) and the share of tokens
        # whose own ratio is outside [0.8, 1.2], GRPO's usual clip (whatever this run's --eps-low / --eps-high)
        "tokens": len(moved),  # the tokens every number here is a mean over
        "log_ratio_mean": moved.sum().item() / max(1, len(moved)),
        "log_ratio_std": moved.std(unbiased=False).item() if len(moved) else 0.0,
        "ratio_outside_grpo_clip": ((moved.exp() < 0.8) | (moved.exp() > 1.2)).sum().item() / max(1, len(moved)),
    }
    return loss, info


def loss_denominator(agg: str, minibatch_mask: torch.Tensor, max_len: int) -> torch.Tensor | int:
    """What the loss of a minibatch with completion mask `minibatch_mask` [B, T] divides by, however
    few of its rows are forwarded (`aggregate`'s default for the whole minibatch): B for
    seq-mean-token-mean, B * max_len for seq-mean-token-sum-norm, and its number of tokens for
    token-mean, which under torchrun is all ranks' tokens / world (each rank's B is already B / world)."""
    if agg == "token-mean":
        return common.mean_denominator(minibatch_mask.sum())
    return minibatch_mask.shape[0] * (max_len if agg == "seq-mean-token-sum-norm" else 1)


def rows_with_signal(idx: torch.Tensor, advantages: torch.Tensor, other_terms: float) -> tuple[torch.Tensor, bool]:
    """(rows, real): the rows of minibatch `idx` an update forwards. A row whose advantage is 0 adds exactly 0 to the
    surrogate and its gradient, so only the others are (the loss still divides by the whole minibatch's
    denominator), unless another term (`other_terms`: --kl-coef + --entropy-coef) gives every row a gradient. With
    none left the first row stands in (real False), so that the update runs on every rank: it adds 0 to the loss,
    and the step's logged numbers count none of it. A default step forwarding every row instead takes 1.06-1.32
    times as long (two runs under load: docs/results.md, 2026-12-07)."""
    rows = idx if other_terms > 0 else idx[advantages[idx] != 0]
    return (rows, True) if len(rows) else (idx[:1], False)


# --------------------------------------------------------------------------------------------
# Training loop
# --------------------------------------------------------------------------------------------


def train(args: Args):
    env = common.setup(args)  # flag checks, torchrun, data, --reward, --resume's checkpoint, seeds
    model, tok = common.load_model(args.model, env.device, args.grad_checkpointing)
    model = common.add_lora(model, args)  # --lora-rank r: only rank-r adapters train; else model itself
    if args.routing_replay and not common.is_moe(model):
        raise common.UsageError(f"--routing-replay: --model {args.model} has no MoE layers")
    sampler = common.Sampler(model, tok, args)  # --rollout-dtype bfloat16: a bf16 copy; records mu when read
    # roll -> (logp, entropy) [B, T]; under torchrun data parallel (DDP, or with --fsdp sharded: FSDP2)
    policy = common.data_parallel(common.CompletionLogprobs(model), env.device, args)
    # a frozen initial policy for the KL term (and kl_to_init); LoRA: the policy, adapters off; else none
    ref_model = common.reference_model(model, env.device, args) if args.kl_coef or args.reward_model else None
    moe = common.routing(model)  # an MoE model's experts, recorded in pi_old's forward (drift, --routing-replay)
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

        # 4. Advantages: each completion against its group.
        advantages = group_advantages(rewards, args.group_size, args.scale_rewards).to(env.device)  # [B]

        # 5. pi_old: the log-probs of the weights that sampled the batch (no update has run since: the current weights),
        #    without gradient, over every row, once per rollout, and the reference's. --old-logp rollout: mu's own.
        if args.old_logp == "rollout":  # (of its whole distribution: with --top-p < 1 like with like)
            old_logp = roll.sample_logp_full * mask  # [B, T]
        else:
            with torch.no_grad(), common.recording_experts(moe, roll):  # MoE: each token's experts, into roll.experts
                old_logp = common.completion_logprobs(model, roll, args.temperature)[0]  # [B, T]
        is_weights = None  # --is-correction: weigh each token's surrogate by pi_old / mu
        if args.is_correction != "none":
            is_weights = common.extra("rollout_precision", "--is-correction").is_weights(
                old_logp, roll.sample_logp, mask, args.is_correction, args.is_cap)  # fmt: skip
        with torch.no_grad():  # [B, T] (--kl-coef 0: no reference forward)
            ref_logp = common.completion_logprobs(ref_model, roll, args.temperature)[0] if args.kl_coef else None

        # 6. Updates: epochs x minibatches of the clipped token-level objective (Eq. 3), each epoch a fresh order of the
        #    rows drawn from `shuffle` (--routing-replay: roll.experts). --trace-every: a few groups token by token.
        trace = common.start_trace(args, env, tok, sampler, step, roll, records, rewards, parts, advantages, old_logp,
                                   ref_logp=ref_logp)  # fmt: skip
        mismatch = {}  # mu recorded (--rollout-dtype, --old-logp rollout, --is-correction): mu against pi_old
        if sampler.records:  # (None under --old-logp rollout: no pi_old forward to compare; the first update's is)
            precision = common.extra("rollout_precision", "--rollout-dtype")
            mismatch = precision.rollout_mismatch(roll, old_logp, is_weights, args)
        model.train()
        totals, max_dev = collections.Counter(), 0.0  # the updates' numbers, summed with their weights (step 7)
        orders = [torch.randperm(len(roll), generator=shuffle).to(env.device) for _ in range(args.epochs)]  # [B] each
        minibatches = [idx for order in orders for idx in order.chunk(args.minibatches)]  # each epoch's in turn
        for k, idx in enumerate(minibatches):
            on_policy = k == 0  # this forward runs at the weights that sampled the batch (the first update's)
            rows, real = rows_with_signal(idx, advantages, args.kl_coef + args.entropy_coef)  # real: False, a stand-in
            weights = None if is_weights is None else is_weights[rows]
            denominator = loss_denominator(args.loss_agg, loss_mask[idx], args.max_new_tokens)  # the whole minibatch's
            with moe.replay(roll.experts if args.routing_replay else None, rows) if moe else contextlib.nullcontext():
                logp, entropy = policy(roll[rows], args.temperature, entropy_grad=args.entropy_coef > 0)
                loss, info = grpo_loss(logp, old_logp[rows], advantages[rows], loss_mask[rows], eps_low=args.eps_low,
                                       eps_high=args.eps_high, ref_logp=None if ref_logp is None else ref_logp[rows],
                                       kl_coef=args.kl_coef, agg=args.loss_agg, max_len=args.max_new_tokens,
                                       denominator=denominator, weights=weights)  # fmt: skip
                if args.entropy_coef > 0:  # minus c x entropy, aggregated as the loss is (--loss-agg)
                    bonus = aggregate(entropy, loss_mask[rows], args.loss_agg, args.max_new_tokens, denominator)
                    loss = loss - args.entropy_coef * bonus
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
            grad_norm = common.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            if not guard.ok(step, loss, grad_norm):  # a non-finite loss or gradient skips the update
                totals["skipped"] += 1
                continue
            optimizer.step()
            # this update's numbers, each times the count it is a mean of (a stand-in row counts 0): step 7 divides
            tokens = real * info["tokens"]
            totals.update(updates=1, loss=loss.item(), grad_norm=grad_norm.item(),  # per update
                          tokens=tokens, minibatch_tokens=mask[idx].sum().item(),  # the counts
                          clipped=tokens * info["clip_frac"], clipped_low=tokens * info["clip_frac_low"],
                          clipped_high=tokens * info["clip_frac_high"], kl=tokens * info["kl"],
                          ratio=tokens * info["ratio_mean"],
                          ratio_sq=tokens * (info["ratio_std"] ** 2 + info["ratio_mean"] ** 2),
                          log_ratio=tokens * info["log_ratio_mean"],
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
        n = max(t["tokens"], 1)  # the updates' tokens (no token: each mean 0, the ratio's 1)
        ratio_mean, log_ratio_mean = t["ratio"] / t["tokens"] if t["tokens"] else 1.0, t["log_ratio"] / n
        lowest, _ = common.global_range(s_rewards)
        row = {
            "step": step,
            "lr": optimizer.param_groups[0]["lr"],
            **common.global_means({"reward": s_rewards, **s_parts}),  # reward/<name> per --reward; accuracy, ...
            "truncated_frac": common.global_mean((~common.completion_ends(s_roll, sampler.eos_ids)).float()),
            "loss": t["loss"] / max(t["updates"], 1),  # means over the updates that stepped
            "grad_norm": t["grad_norm"] / max(t["updates"], 1),
            "skipped_updates": t["skipped"] / env.world,  # the non-finite guard's, per rank
            # of every minibatch's tokens, as TRL and verl count it: a row left out never clips
            "clip_frac": t["clipped"] / max(t["minibatch_tokens"], 1),
            "clip_frac_low": t["clipped_low"] / max(t["minibatch_tokens"], 1),
            "clip_frac_high": t["clipped_high"] / max(t["minibatch_tokens"], 1),
            "ratio_mean": ratio_mean,  # the token ratios of every update: their mean, spread, largest |r - 1|
            "ratio_std": math.sqrt(max(0.0, t["ratio_sq"] / n - ratio_mean**2)),
            "ratio_max_dev": common.global_range(max_dev)[1],
            "kl": t["kl"] / n,  # k3 to the reference, per token (0 without --kl-coef)
            "log_ratio_std": math.sqrt(max(0.0, t["log_ratio_sq"] / n - log_ratio_mean**2)),
            "ratio_outside_grpo_clip": t["outside"] / n,
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
        }
        if args.reward_model:  # --reward-model: how far the policy moved from where it started
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
