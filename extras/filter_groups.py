"""extras/filter_groups.py: --filter-groups, DAPO's dynamic sampling (Yu et al. 2025, section 3.2): after a step's
first round, more rounds of the prompt stream's next prompts until every rank holds its share of groups whose rewards
differ, or --max-sample-rounds have run; the ranks agree through one all-reduce a round."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common import Rollout, all_reduce_sum


def constant_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[B / G] bool: the groups (G consecutive rows) whose rewards are all equal, max == min, as each script's
    group_advantages decides it (their advantages are exactly 0)."""
    r = rewards.view(-1, group_size)
    return r.max(1).values == r.min(1).values


def concat(rolls: list[Rollout], pad_id: int) -> Rollout:
    """The rows of `rolls`, in order, as one Rollout, prompts re-padded on the left and completions on the right to
    the widest; seconds, sampled_tokens and draws add up; a field some part lacks is None, and so is `experts`
    (positions moved: the joined batch's pi_old forward records them)."""
    P, T = max(r.prompt_ids.shape[1] for r in rolls), max(r.completion_ids.shape[1] for r in rolls)

    def joined(name, left=None, value=0):  # left None: a sum; True / False: padded on that side
        xs = [getattr(r, name) for r in rolls]
        if any(x is None for x in xs) or left is None:
            return None if any(x is None for x in xs) else sum(xs)
        return torch.cat([F.pad(x, (P - x.shape[1], 0) if left else (0, T - x.shape[1]), value=value) for x in xs])

    return Rollout(joined("prompt_ids", True, pad_id), joined("prompt_mask", True),
                   joined("completion_ids", False, pad_id), joined("completion_mask", False),
                   joined("entropy", False), joined("sample_logp", False), joined("sample_logp_full", False),
                   joined("seconds"), joined("sampled_tokens"), joined("draws"))  # fmt: skip


def keep_groups(rewards: torch.Tensor, group_size: int, n: int) -> torch.Tensor:
    """Row indices of the first `n` groups (G consecutive rows) whose rewards are not all equal (max != min,
    exact: `constant_groups`), each group's rows together and in order; fewer when fewer have signal."""
    signal = (~constant_groups(rewards, group_size)).nonzero().squeeze(1)[:n]  # group numbers
    return (signal[:, None] * group_size + torch.arange(group_size, device=signal.device)).reshape(-1)


def groups_to_train(agreed: int, share: int, group_size: int, minibatches: int) -> int:
    """How many groups with signal each rank trains: `agreed`, the fewest any rank holds, at most `share`, less any
    that --minibatches could not split evenly; the same on every rank, so each runs the same updates (DDP, FSDP)."""
    n = min(agreed, share)
    while n and n * group_size % minibatches:
        n -= 1
    return n


def fill(args, world: int, pad_id: int, sample_round, first: tuple) -> tuple:
    """((roll, records, rewards, parts) to train on, (roll, rewards, parts) of every round joined: the step's rollout
    metrics read it). `first` is the step's first round, `sample_round()` samples and scores the next. What trains:
    the first `groups_to_train` groups with signal, in order; if none, the first round (a step without signal)."""
    share, G = args.prompts_per_step // world, args.group_size
    rounds, held = [first], 0

    def count(rewards):  # groups with signal held on this rank, and the fewest any rank holds
        nonlocal held
        held += int((~constant_groups(rewards, G)).sum())
        return int(all_reduce_sum(torch.tensor(float(held)), op="MIN").item())

    agreed = count(first[2])
    while len(rounds) < args.max_sample_rounds and agreed < share:
        rounds.append(sample_round())
        agreed = count(rounds[-1][2])
    if len(rounds) == 1:
        joined = first
    else:
        rolls, records, rewards, parts = zip(*rounds)
        joined = (concat(list(rolls), pad_id), sum(records, []), torch.cat(rewards),
                  {k: torch.cat([p[k] for p in parts]) for k in parts[0]})  # fmt: skip
    sampled = joined[0], joined[2], joined[3]
    n = groups_to_train(agreed, share, G, args.minibatches)
    if n == 0:
        return first, sampled
    roll, records, rewards, parts = joined
    rows = keep_groups(rewards, G, n)
    kept = roll[rows], [records[i] for i in rows.tolist()], rewards[rows], {k: v[rows] for k, v in parts.items()}
    return kept, sampled
