"""PPO for language models: actor-critic with a learned value function (Schulman et al. 2017;
the RLHF recipe of Ouyang et al. 2022 and Huang et al., "The N+ implementation details of RLHF
with PPO").

Objective, per completion token t of completion y (policy loss minimised, critic regressed):

    r_t   = -beta (old_t - ref_t)  [+ score(y) on the last real token]   reward (KL-in-reward, InstructGPT)
    A_t   = GAE(gamma, lambda) of r with the critic's V_t                             (GAE paper Eq. 16)
    rho_t = pi_theta(y_t | x, y_<t) / pi_old(y_t | x, y_<t)                            importance ratio
    L_pi  = token-mean of max(-W_t rho_t, -W_t clip(rho_t, 1 - eps_low, 1 + eps_high))  (PPO Eq. 7),
            and for W_t < 0 the dual clip min(that, -c W_t)                          (Ye et al. 2020),
            W = A whitened over the batch
    L_V   = 0.5 token-mean of max((V - R)^2, (clip(V, V_old +- cv) - R)^2),  R = A + V_old (A not whitened)

The critic is a *separate* transformer initialised from the policy checkpoint, with a scalar head,
as in verl, OpenRLHF and TRL: sharing the trunk couples the value and policy gradients (one
loss's scale then tunes the other) and makes the policy checkpoint non-standard. The price is a
second model's weights, gradients and AdamW state (about 4x the parameter bytes again) plus its
activations; the frozen reference adds one more copy of the weights (none at --kl-coef 0, unless
--reward-model loads it for kl_to_init). That
memory is what GRPO and GSPO save by using the group as the baseline.

Why the KL penalty is 0.1, and how the critic meets LoRA: docs/ppo_design.md.

What this file leaves out, as all three do (a separate inference engine, tensor parallelism, ...):
docs/scope.md.

Where to read: `token_rewards`, `gae`, `whiten`, `ppo_policy_loss`, `value_loss`, `Critic`, then
`train()`, whose numbered steps are the algorithm and make every logged number; `common.py` holds the
runtime (sampling, log-probs, rewards, evaluation, checkpoints, torchrun).

Run (CPU, embedded tiny Qwen3; 531 s on 2 cores, docs/results.md):   python ppo.py
Stop with Ctrl-C (it saves a checkpoint), then continue:   python ppo.py --resume runs/ppo
A real Qwen on one 24 GB GPU, on GSM8K (python tools/gsm8k.py writes data/gsm8k_*.jsonl first; docs/running.md):
    python ppo.py --model Qwen/Qwen2.5-0.5B-Instruct --data data/gsm8k_train.jsonl \
      --eval-data data/gsm8k_test.jsonl --steps 200 --prompts-per-step 64 --group-size 1 --minibatches 8 \
      --max-new-tokens 512 --lr 1e-6 --critic-lr 1e-5 --kl-coef 0.001 --grad-checkpointing --eval-every 20 \
      --eval-size 500 --save-every 20 --out runs/ppo-gsm8k   # planned peak: 19.07 GB
Data parallel on N GPUs (each rank samples prompts-per-step / N prompts; gradients averaged):
    torchrun --nproc_per_node N ppo.py ...same flags...   (on CPU: gloo, --device cpu)
    torchrun --nproc_per_node N ppo.py --fsdp ...   (weights, gradients, AdamW state sharded: FSDP2)
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass

import torch
from torch import nn

import common
from common import masked_mean

LOG_RATIO_CLAMP = (-20.0, 20.0)  # (low, high) bounds of a log-ratio before exp: token ratios, +-20 as verl


@dataclass
class Args(common.SharedArgs):  # the flags every script shares (model, data, output, ...), then PPO's own
    # The training recipe: batch shape, sampling, optimiser and schedule
    steps: int = 500
    """number of rollout + update steps"""
    prompts_per_step: int = 128
    """prompts sampled per step"""
    group_size: int = 1
    """completions per prompt (PPO needs no group; any value works)"""
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
    minibatches: int = 4
    """minibatch updates per epoch over each rollout"""
    epochs: int = 1
    """passes over each rollout"""
    # PPO's own
    critic_lr: float = 1e-3
    """critic AdamW learning rate (no value-loss coefficient: the critic's own AdamW would normalise it away)"""
    eps_low: float = 0.2
    """lower clip range of the token ratio"""
    eps_high: float = 0.2
    """upper clip range of the token ratio"""
    dual_clip: float | None = 3.0
    """dual-clip constant c for negative advantages (None: off)"""
    kl_coef: float = 0.1
    """beta of the per-token KL penalty in the reward (k1, to a frozen reference; 0: none, and no reference unless
    --reward-model's kl_to_init needs one)"""
    gamma: float = 1.0
    """discount"""
    lam: float = 0.95
    """GAE lambda"""
    cliprange_value: float = 0.2
    """value clipping range around the rollout's values"""
    missing_eos_penalty: float = 0.0
    """subtracted from the score of completions that never emit EOS"""

    def check(self):
        common.check_clip(self.eps_low, self.eps_high)
        for name in ("critic_lr", "kl_coef", "cliprange_value", "missing_eos_penalty"):
            if getattr(self, name) < 0:
                raise common.UsageError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            raise common.UsageError(f"--gamma and --lam must be in [0, 1], got {self.gamma}, {self.lam}")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise common.UsageError(f"--dual-clip must be > 1 (or None), got {self.dual_clip}")


# --------------------------------------------------------------------------------------------
# The algorithm: pure tensor functions (tests/test_ppo.py checks each against a plain loop)
# --------------------------------------------------------------------------------------------


def token_rewards(scores, old_logp, ref_logp, mask, kl_coef):
    """[B, T]: -kl_coef * (old - ref) on every completion token (k1 KL estimate, InstructGPT),
    plus the sequence's scalar score on its last real token (the EOS token when there is one).
    ref_logp None (kl_coef 0: no reference model is loaded) leaves the score alone."""
    if ref_logp is None and kl_coef != 0:
        raise ValueError(f"token_rewards: kl_coef {kl_coef} needs the reference's log-probs")
    mask = mask.float()
    rewards = torch.zeros_like(old_logp) if ref_logp is None else -kl_coef * (old_logp - ref_logp) * mask
    lengths = mask.sum(1).long()  # completions are right-padded: the last real token is len - 1
    rows = torch.nonzero(lengths > 0).squeeze(1)
    rewards[rows, lengths[rows] - 1] += scores[rows].to(rewards.dtype)
    return rewards


def gae(rewards, values, mask, gamma=1.0, lam=0.95):
    """Generalised advantage estimation over right-padded [B, T] tensors:
    delta_t = r_t + gamma V_{t+1} - V_t (V after the last real token is 0),
    A_t = delta_t + gamma lam A_{t+1};  returns R_t = A_t + V_t. Zero on padding; not whitened."""
    rewards = torch.where(mask.bool(), rewards, torch.zeros_like(rewards))  # padding never enters
    values = torch.where(mask.bool(), values, torch.zeros_like(values))
    mask = mask.float()
    T = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    next_adv = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = (delta + gamma * lam * next_adv) * mask[:, t]
        advantages[:, t] = adv_t
        # where position t is padding, the step "after" t-1 is terminal: carry zeros backwards
        next_value = values[:, t] * mask[:, t]
        next_adv = adv_t
    returns = (advantages + values) * mask
    return advantages, returns


def whiten(x, mask, eps=1e-8):
    """[B, T]: (x - mean) / sqrt(var + eps) over mask == 1 (unbiased var); 0 on padding. Under
    torchrun the mean and variance are those of all ranks' tokens: a batch-level statistic."""
    x = torch.where(mask.bool(), x, torch.zeros_like(x))  # padding values never enter the sums
    mask = mask.float()
    total, count = common.all_reduce_sum(torch.stack([x.sum(), mask.sum()]))  # local sums without torchrun
    mean = total / count.clamp(min=1)
    var = common.all_reduce_sum(((x - mean) ** 2 * mask).sum()) / (count - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def ppo_policy_loss(logp, old_logp, advantages, mask, *, eps_low=0.2, eps_high=0.2, dual_clip=3.0, weights=None):
    """Token-mean clipped surrogate with dual-clip for negative advantages; [B, T] inputs. `weights`
    [B, T], detached (--is-correction), multiply each token's term. Returns (loss, info): info holds
    each token's ratio and clip decision, detached, the shares of tokens clipped and dual-clipped,
    approx_kl, the mean ratio and log-ratio statistics, each a mean over `tokens` tokens. Argument
    order: (logp, old_logp, ...), then keywords only. verl's
    compute_policy_loss_vanilla takes (old_log_prob, log_prob, advantages, response_mask, ...): pi_old
    first; TRL's PPOTrainer computes it inline in its training loop. Port by name."""
    mask = mask.bool()
    log_ratio = torch.where(mask, logp - old_logp, torch.zeros_like(logp))
    ratio = log_ratio.clamp(*LOG_RATIO_CLAMP).exp()
    per_token = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - eps_low, 1 + eps_high))
    dual = torch.zeros_like(mask)
    if dual_clip is not None:
        # with A < 0 and a huge ratio the clipped loss grows without bound: cap it at -c A
        dual = (advantages < 0) & (per_token > -dual_clip * advantages) & mask
        per_token = torch.where(advantages < 0, torch.minimum(per_token, -dual_clip * advantages), per_token)
    if weights is not None:
        per_token = per_token * weights
    loss = masked_mean(per_token, mask)
    clipped = (((advantages > 0) & (ratio > 1 + eps_high)) | ((advantages < 0) & (ratio < 1 - eps_low))) & mask
    moved = (logp.detach() - old_logp)[mask].double()  # [N] each token's log(pi / pi_old): how far the update moved
    info = {
        "ratio": ratio.detach(),  # [B, T]
        "clipped": clipped,  # [B, T]
        "clip_frac": masked_mean(clipped.float(), mask).item(),
        "dual_clip_frac": masked_mean(dual.float(), mask).item(),
        "approx_kl": masked_mean((ratio - 1 - log_ratio).detach(), mask).item(),  # k3(old || new)
        "ratio_mean": masked_mean(ratio.detach(), mask).item(),
        # the same token-level yardstick in all three scripts: the spread of log(pi / pi_old) and the share of tokens
        # whose own ratio is outside [0.8, 1.2], GRPO's usual clip (whatever this run's --eps-low / --eps-high)
        "tokens": len(moved),  # the tokens every number here is a mean over
        "log_ratio_mean": moved.sum().item() / max(1, len(moved)),
        "log_ratio_std": moved.std(unbiased=False).item() if len(moved) else 0.0,
        "ratio_outside_grpo_clip": ((moved.exp() < 0.8) | (moved.exp() > 1.2)).sum().item() / max(1, len(moved)),
    }
    return loss, info


def value_loss(values, old_values, returns, mask, *, clip=0.2):
    """0.5 * token-mean of max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2). Argument order: (values,
    old_values, returns, mask), then keywords only; verl's compute_value_loss takes (vpreds, returns,
    values, response_mask, cliprange_value): returns before the old values; TRL's PPOTrainer computes it
    inline. Port by name."""
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    loss_plain = (values - returns) ** 2
    loss_clipped = (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(loss_plain, loss_clipped), mask)
    return loss, {"vf_clip_frac": masked_mean((loss_clipped > loss_plain).float(), mask).item()}


def explained_variance(values, returns, mask):
    """1 - Var[R - V] / Var[R] over real tokens: 1 is a perfect critic, 0 no better than a constant."""
    var_r = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    diff = returns - values
    var_d = masked_mean((diff - masked_mean(diff, mask)) ** 2, mask)
    return (1 - var_d / var_r).item() if var_r > 0 else float("nan")


def ppo_metrics(old_values, returns, mask, old_logp, ref_logp) -> dict:
    """PPO's own metrics of a step: the critic's explained variance and mean value, and the KL to the
    reference (the mean over completion tokens of log pi_old - log pi_ref) when there is one."""
    metrics = {"explained_variance": common.finite_or(explained_variance(old_values, returns, mask)),
               "value_mean": masked_mean(old_values, mask).item()}  # fmt: skip
    if ref_logp is not None:
        metrics["kl_to_ref"] = masked_mean(old_logp - ref_logp, mask).item()
    return metrics


class Critic(nn.Module):
    """V(x, y_<t) for every completion position: a transformer trunk initialised from the policy
    checkpoint, with a scalar head initialised to zero (so V starts at 0 everywhere). With
    --lora-rank (`lora` the run's args) the trunk is frozen and trains adapters of its own."""

    def __init__(self, model_name: str, device, grad_checkpointing: bool = False, lora=None):
        super().__init__()
        lm, _ = common.load_model(model_name, device, grad_checkpointing)
        if lora is not None:
            lm = common.add_lora(lm, lora)
        self.trunk = lm.get_decoder()
        self.head = nn.Linear(lm.config.hidden_size, 1, device=device)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, roll: common.Rollout) -> torch.Tensor:
        hidden = common.completion_hidden_states(self.trunk, roll)  # [B, T, H]
        return self.head(hidden.to(self.head.weight.dtype)).float().squeeze(-1)  # [B, T] (--fsdp may gather bf16)


# --------------------------------------------------------------------------------------------
# Training loop
# --------------------------------------------------------------------------------------------


def train(args: Args):
    env = common.setup(args, needs_group=False)  # flag checks, torchrun, data, --reward, --resume's checkpoint, seeds
    model, tok = common.load_model(args.model, env.device, args.grad_checkpointing)
    model = common.add_lora(model, args)  # --lora-rank r: only rank-r adapters train; else model itself
    # a frozen initial policy for the KL in the reward (and kl_to_init); LoRA: the policy, adapters off
    ref_model = common.reference_model(model, env.device, args) if args.kl_coef or args.reward_model else None
    critic = Critic(args.model, env.device, args.grad_checkpointing, lora=args)
    sampler = common.Sampler(model, tok, args)  # --rollout-dtype bfloat16: a bf16 copy; records mu when read
    # roll -> (logp, entropy) [B, T] and roll -> values [B, T]; under torchrun data parallel (DDP, or --fsdp: FSDP2)
    policy = common.data_parallel(common.CompletionLogprobs(model), env.device, args)
    value = common.data_parallel(critic, env.device, args)
    moe = common.routing(model)  # an MoE model's experts, recorded in pi_old's forward (routing_drift); else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, fused=True)
    critic_optimizer = torch.optim.AdamW(
        critic.parameters(), lr=args.critic_lr, weight_decay=args.weight_decay, fused=True
    )
    stream = common.PromptStream(env.train_set, args.seed)
    rng = torch.Generator(env.device).manual_seed(args.seed + env.rank)  # sampling's own; each rank its own samples
    shuffle = torch.Generator().manual_seed(args.seed)  # the minibatches' order (the same on every rank)
    guard = common.NonFiniteGuard()
    progress = common.Progress()  # the step, the evaluations, the warnings given
    # all that moves during a run besides the policy's weights: a checkpoint saves each, --resume restores it exactly
    # (common.start_run; the global RNGs too, which nothing here draws from but your own --reward might)
    state = dict(optimizer=optimizer, stream=stream, sampling_gen=rng, shuffle_gen=shuffle, guard=guard, critic=critic,
                 critic_optimizer=critic_optimizer, progress=progress)  # fmt: skip
    writer = common.start_run(args, env, model, tok, state)  # --resume: loads state; else evaluates step 0. Opens OUT

    for step in (bar := common.progress_bar(args, env, progress)):
        started = time.perf_counter()
        common.anneal_lr(args, step, (optimizer, args.lr), (critic_optimizer, args.critic_lr))  # --anneal-lr: both
        # 1. Sample completions of each prompt (one unless --group-size says more) from the current policy.
        model.eval()
        examples = stream.next(args.prompts_per_step)[env.rank :: env.world]  # under torchrun: this rank's share
        prompts, records = common.prompts_and_records(tok, examples, args.group_size, env.system_prompt, args.thinking)
        roll = sampler.sample(prompts, rng)
        mask = roll.completion_mask  # [B, T] 1 on completion tokens, the EOS token included

        # 2. Score (env.reward_fn, a common.Rewards): the weighted --reward functions and --reward-model; the default,
        #    --reward exact, is `common.score`: 1 if the answer after the last '####' is the record's.
        rewards, parts = env.reward_fn(tok, roll, records)  # [B]; parts: each component [B], accuracy, format_rate
        ends = common.completion_ends(roll, sampler.eos_ids)  # [B]
        scores = rewards.to(env.device) - args.missing_eos_penalty * (~ends).float()  # minus a penalty without EOS

        # 3. pi_old (the log-probs of the weights that sampled the batch: no update has run since), the reference's and
        #    the critic's values, without gradient, over every row; then per-token rewards and their GAE advantages.
        if args.old_logp == "rollout":  # the sampler's own (of its whole distribution), no forward
            old_logp = roll.sample_logp_full * mask  # [B, T]
        else:
            with torch.no_grad(), common.recording_experts(moe, roll):  # MoE: each token's experts, into roll.experts
                old_logp = common.completion_logprobs(model, roll, args.temperature)[0]  # [B, T]
        is_weights = None  # --is-correction: weigh each token's loss by pi_old / mu
        if args.is_correction != "none":
            precision = common.extra("rollout_precision", "--is-correction")
            is_weights = precision.is_weights(old_logp, roll.sample_logp, mask, args.is_correction, args.is_cap)
        with torch.no_grad():  # (--kl-coef 0: no reference forward)
            ref_logp = common.completion_logprobs(ref_model, roll, args.temperature)[0] if args.kl_coef else None
            old_values = critic(roll) * mask  # [B, T]
            per_token_rewards = token_rewards(scores, old_logp, ref_logp, mask, args.kl_coef)  # [B, T]
            advantages, returns = gae(per_token_rewards, old_values, mask, args.gamma, args.lam)
            advantages = whiten(advantages, mask)

        # 4. Updates of the policy and the critic: epochs x minibatches, each epoch a fresh order drawn from `shuffle`.
        # --trace-every: every token of a few completions, as sampled, scored and updated (OUT/traces.jsonl)
        trace = common.start_trace(args, env, tok, sampler, step, roll, records, rewards, parts, advantages, old_logp,
                                   ref_logp=ref_logp, value=old_values,
                                   token_reward=per_token_rewards)  # fmt: skip
        # mu recorded (--rollout-dtype, --old-logp rollout, --is-correction): the sampler against pi_old (mismatch_*)
        mismatch = {}
        if sampler.records:  # (None under --old-logp rollout: no pi_old forward to compare; the first update's is)
            precision = common.extra("rollout_precision", "--rollout-dtype")
            mismatch = precision.rollout_mismatch(roll, old_logp, is_weights, args)
        model.train()
        critic.train()  # (no dropout in Qwen) train mode: gradient checkpointing applies only there
        totals = collections.Counter()  # the updates' numbers, summed with their weights (step 5)
        orders = [torch.randperm(len(roll), generator=shuffle).to(env.device) for _ in range(args.epochs)]  # [B] each
        minibatches = [idx for order in orders for idx in order.chunk(args.minibatches)]  # each epoch's in turn
        for k, idx in enumerate(minibatches):
            on_policy = k == 0  # this forward runs at the weights that sampled the batch (the first update's)
            optimizer.zero_grad(set_to_none=True)
            critic_optimizer.zero_grad(set_to_none=True)
            scale = common.token_mean_scale(mask[idx])  # torchrun: the whole batch's token mean
            # loss = pg_loss + v_loss: no shared parameter, so a backward each, one model's activations at a time. No
            # weight on v_loss: the critic's own AdamW would normalise it away (its step is --critic-lr's)
            values = value(roll[idx])  # [b, T]
            v_loss, v_info = value_loss(values, old_values[idx], returns[idx], mask[idx], clip=args.cliprange_value)
            (v_loss * scale).backward()
            logp, entropy = policy(roll[idx], args.temperature, entropy_grad=args.entropy_coef > 0)
            weights = None if is_weights is None else is_weights[idx]
            pg_loss, info = ppo_policy_loss(logp, old_logp[idx], advantages[idx], mask[idx], eps_low=args.eps_low,
                                            eps_high=args.eps_high, dual_clip=args.dual_clip,
                                            weights=weights)  # fmt: skip
            if args.entropy_coef > 0:  # minus c2 x entropy (Eq. 9), a token mean as the policy loss is
                pg_loss = pg_loss - args.entropy_coef * masked_mean(entropy, mask[idx])
            (pg_loss * scale).backward()
            grad_norm = common.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            critic_grad_norm = common.clip_grad_norm_(critic.parameters(), args.max_grad_norm)
            if not guard.ok(step, pg_loss, v_loss, grad_norm, critic_grad_norm):  # a non-finite one skips the update
                totals["skipped"] += 1
                continue
            optimizer.step()
            critic_optimizer.step()
            # this update's numbers, each times the count it is a mean of: step 5 divides
            tokens = info["tokens"]
            totals.update(updates=1, loss=pg_loss.item(), value_loss=v_loss.item(), grad_norm=grad_norm.item(),
                          critic_grad_norm=critic_grad_norm.item(), tokens=tokens, clipped=tokens * info["clip_frac"],
                          dual_clipped=tokens * info["dual_clip_frac"], vf_clipped=tokens * v_info["vf_clip_frac"],
                          approx_kl=tokens * info["approx_kl"], ratio=tokens * info["ratio_mean"],
                          log_ratio=tokens * info["log_ratio_mean"],
                          log_ratio_sq=tokens * (info["log_ratio_std"] ** 2 + info["log_ratio_mean"] ** 2),
                          outside=tokens * info["ratio_outside_grpo_clip"])  # fmt: skip
            if mismatch is None and on_policy:  # --old-logp rollout: mu against the trainer at mu's weights
                mismatch = precision.mismatch_stats(logp.detach(), roll.sample_logp[idx], mask[idx])
            if trace is not None:  # the ratio and clip decisions of each traced row
                trace.update(idx, logp, entropy, info, on_policy)

        # 5. The step's metrics, means over every rank: of the rollout, of the updates (each number's sum over updates
        #    and ranks divided by its count), PPO's own (the critic's, the KL to the reference), the policy's if asked.
        t = common.global_sums(totals)  # each sum over the ranks
        n, n_updates = max(t["tokens"], 1), max(t["updates"], 1)  # the updates' tokens, the updates that stepped
        log_ratio_mean = t["log_ratio"] / n
        row = {
            "step": step,
            "lr": optimizer.param_groups[0]["lr"],
            **common.global_means({"reward": rewards, **parts}),  # reward/<name> per --reward; accuracy, ...
            "truncated_frac": common.global_mean((~ends).float()),
            "loss": t["loss"] / n_updates,  # means over the updates
            "value_loss": t["value_loss"] / n_updates,
            "grad_norm": t["grad_norm"] / n_updates,
            "critic_grad_norm": t["critic_grad_norm"] / n_updates,
            "skipped_updates": t["skipped"] / env.world,  # the non-finite guard's, per rank
            "clip_frac": t["clipped"] / n,  # means over the updates' tokens
            "dual_clip_frac": t["dual_clipped"] / n,
            "vf_clip_frac": t["vf_clipped"] / n,
            "approx_kl": t["approx_kl"] / n,
            "ratio_mean": t["ratio"] / t["tokens"] if t["tokens"] else 1.0,
            "log_ratio_std": math.sqrt(max(0.0, t["log_ratio_sq"] / n - log_ratio_mean**2)),
            "ratio_outside_grpo_clip": t["outside"] / n,
            "entropy": common.global_token_mean(roll.entropy, mask),  # of the sampling distribution, per token
            "response_len": common.global_mean(mask.sum(1)),
            "tokens_per_s": common.tokens_per_s(roll),  # every rank's sampled tokens per second of sampling
            **(mismatch or {}),  # mu against pi_old: mismatch_*, is_* (--rollout-dtype, --old-logp, --is-correction)
            **common.rank_means(ppo_metrics(old_values, returns, mask, old_logp, ref_logp)),  # each rank's, averaged
        }
        if args.group_size > 1:  # completions of one prompt: the groups whose rewards are all equal
            groups = rewards.view(-1, args.group_size)  # [groups, G]
            constant = groups.max(1).values == groups.min(1).values
            row["zero_std_frac"] = common.global_mean(constant.float())
            lowest, _ = common.global_range(rewards)  # ... all at the batch's lowest reward (all failed, unless solved)
            row["zero_std_low_frac"] = common.global_mean((constant & (groups[:, 0] == lowest)).float())
        if args.reward_model:  # --reward-model: how far the policy moved from where it started
            row.update(common.extra("reward_model", "--reward-model").kl_to_init(ref_model, roll, old_logp,
                                                                                 args.temperature))  # fmt: skip
        if moe is not None:  # MoE: the share of tokens whose experts the step's updates changed
            row.update(moe.drift(model, roll, args.temperature))

        # 6. Evaluate (every --eval-every steps and after the last), warn once if the run looks stuck or collapsed,
        #    write the row, and checkpoint (every --save-every steps, on Ctrl-C).
        samples = common.evaluate_if_due(args, env, model, tok, progress, row, shown=("explained_variance",))  # eval_*
        row["step_time_s"] = time.perf_counter() - started  # the whole step, its evaluation included
        # no signal: every score in the batch equal, or no exploration left (entropy near 0: completions all alike)
        no_signal = common.all_equal(scores) or row["entropy"] < common.NO_SIGNAL_ENTROPY  # (all ranks' tokens)
        common.log_step(args, env, progress, writer, bar, row, scores, no_signal, samples, trace)
        if common.save_checkpoint_if_due(args, env, model, tok, state, step):
            break  # a stop signal came: checkpoint saved
    return common.finish(args, env, model, tok, progress, writer, critic=critic)  # final/critic.pt beside the policy


if __name__ == "__main__":
    common.main(train, Args)
