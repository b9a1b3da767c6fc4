"""common.pool over every token of every update on every rank, as one process counts them, not a mean of
means (TRL #6380): hand-worked cases and float64 loops; a second rank simulated by its all_reduce_sum."""

import math
import types

import pytest
import torch
from helpers import gamma, unit_roundoff

import common
import grpo
import gspo

F64 = torch.float64
EPS = 0.2  # both losses' clip, low and high


def test_a_hand_worked_step_pools_tokens_not_update_means():
    """Two updates with unequal tokens: update 1 forwards 2 of its minibatch's 4 tokens and clips 1, update 2 all 4
    and clips 1: 2 clipped of 8 = 0.25 (the mean of the two shares, 1/4 and 1/4, agrees); its kl is 0.6 over 2
    tokens and 0.3 over 4: (1.2 + 1.2) / 6 = 0.4, where the mean of the means says 0.45. Ratios (1, 2) and
    (1, 1, 1, 1): mean 7/6, population std sqrt(9/6 - 49/36) = sqrt(5)/6 (the mean of the stds says 1/4). loss:
    the mean of the two updates'; ratio_max_dev the larger."""
    first = common.update_stat_terms(
        {"clip_frac": 0.5, "kl": 0.6, "ratio_mean": 1.5, "ratio_std": 0.5, "ratio_max_dev": 1.0, "loss": 2.0},
        {"tokens": 2, "forwarded tokens": 2, "minibatch tokens": 4, "ratio items": 2},
    )
    second = common.update_stat_terms(
        {"clip_frac": 0.25, "kl": 0.3, "ratio_mean": 1.0, "ratio_std": 0.0, "ratio_max_dev": 0.0, "loss": 4.0},
        {"tokens": 4, "forwarded tokens": 4, "minibatch tokens": 4, "ratio items": 4},
    )
    got = common.pool([first, second], skipped=1)
    assert got["clip_frac"] == 0.25 and got["loss"] == 3.0 and got["ratio_max_dev"] == 1.0
    assert got["skipped_updates"] == 1.0
    assert got["kl"] == pytest.approx(0.4, abs=gamma(4) * 2.4)
    assert got["ratio_mean"] == pytest.approx(7 / 6, abs=gamma(4) * 7)
    assert got["ratio_std"] == pytest.approx(math.sqrt(5) / 6, abs=gamma(8) * 9 / (math.sqrt(5) / 6))


def test_a_metric_whose_weighting_is_undeclared_is_refused():
    """A fork's new info number must say how it is counted: update_terms names it."""
    with pytest.raises(ValueError, match="'my_new_frac'.*UPDATE_STAT_UNITS"):
        common.update_stat_terms({"my_new_frac": 0.1}, {"tokens": 3})


def test_a_fork_declares_its_metric_in_its_own_file(monkeypatch):
    """What the refusal asks for works from the fork's file, common.py untouched: two updates of 1 and 3 loss
    tokens with "tokens" means 0.5 and 0.1 pool to (0.5 + 0.3) / 4, not the mean of means 0.3."""
    monkeypatch.setitem(common.UPDATE_STAT_UNITS, "my_new_frac", "tokens")
    updates = [common.update_stat_terms({"my_new_frac": m}, {"tokens": n}) for m, n in ((0.5, 1), (0.1, 3))]
    got = common.pool(updates, skipped=0)["my_new_frac"]
    assert got == pytest.approx(0.8 / 4, abs=gamma(4) * 0.8)


def fake_run(completion_mask):
    """One rank's step without a model: its rollout's completion mask, the updates' terms as a script keeps them."""
    return types.SimpleNamespace(completion_mask=completion_mask, updates=[], skipped=0)


def rank_updates(run, logp, old, adv, mask, ref, updates, loss):
    """Each (minibatch, forwarded rows) of `updates` through the script's own loss and common.update_terms."""
    for idx, rows in updates:
        if loss == "grpo":
            _, info = grpo.grpo_loss(logp[rows], old[rows], adv[rows], mask[rows], eps_low=EPS, eps_high=EPS,
                                     ref_logp=ref[rows], kl_coef=0.1)  # fmt: skip
        else:
            _, info = gspo.gspo_loss(logp[rows], old[rows], adv[rows], mask[rows], eps_low=EPS, eps_high=EPS,
                                     denominator=len(idx))  # fmt: skip
        info.update(loss=1.0, grad_norm=1.0)
        run.updates.append(common.update_terms(info, logp[rows], old[rows], mask[rows], run.completion_mask[idx],
                                               len(rows)))  # fmt: skip


def pooled_over_two_ranks(monkeypatch, runs):
    """common.pool on rank 0 with all_reduce_sum adding (taking the max of) rank 1's own sums."""
    other = []
    monkeypatch.setattr(common, "all_reduce_sum", lambda x, op="SUM": other.append(x.clone()) or x)
    common.pool(runs[1].updates, runs[1].skipped)
    sums, maxima = other
    combine = {"SUM": lambda x: x + sums, "MAX": lambda x: torch.maximum(x, maxima)}
    monkeypatch.setattr(common, "all_reduce_sum", lambda x, op="SUM": combine[op](x))
    return common.pool(runs[0].updates, runs[0].skipped)


def batch(seed, b, t):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=F64) * 2
    old = logp + (torch.rand(b, t, generator=g, dtype=F64) - 0.5) * 0.8
    ref = logp + (torch.rand(b, t, generator=g, dtype=F64) - 0.5)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).to(F64)
    adv = torch.randn(b, generator=g, dtype=F64)
    return logp, old, ref, mask, adv


def pooled_moments(values):
    """(mean, population std, max |x - 1|) of a list of floats, a plain float64 loop."""
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((x - mean) ** 2 for x in values) / len(values)), max(abs(x - 1) for x in values)


@pytest.mark.parametrize("loss", ["grpo", "gspo"])
def test_two_ranks_with_unequal_tokens_log_what_one_process_counts(monkeypatch, loss):
    """Rank 0: 6 rows, two minibatches of 3 of which updates forward 2 and 3 rows; rank 1: 4 rows, one minibatch
    whose update forwards 1; lengths drawn, so the token counts differ. The pooled clip fraction is every clipped
    token (sequence) over every minibatch token (sequence); the ratio, log-ratio and kl statistics are over every
    forwarded token (GSPO: the ratios of every forwarded sequence with a loss token), as a float64 loop over all
    of them at once computes them."""
    data = [batch(1, 6, 5), batch(2, 4, 7)]
    plans = [[(torch.arange(3), torch.tensor([0, 2])), (torch.arange(3, 6), torch.arange(3, 6))],
             [(torch.arange(4), torch.tensor([1]))]]  # fmt: skip
    runs = [fake_run(d[3]) for d in data]
    for run, (logp, old, ref, mask, adv), plan in zip(runs, data, plans, strict=True):
        rank_updates(run, logp, old, adv, mask, ref, plan, loss)
    got = pooled_over_two_ranks(monkeypatch, runs)

    clipped = minibatch_items = 0.0
    ratios, log_ratios, kls, tokens = [], [], [], 0
    for (logp, old, ref, mask, adv), plan in zip(data, plans, strict=True):
        for idx, rows in plan:
            minibatch_items += len(idx) if loss == "gspo" else mask[idx].sum().item()
            for i in rows.tolist():
                n = int(mask[i].sum().item())
                log_ratio = [(logp[i, t] - old[i, t]).item() for t in range(n)]
                log_ratios += log_ratio
                tokens += n
                a = adv[i].item()
                if loss == "gspo":  # one ratio per sequence, exp of the mean log-ratio (GSPO Eq. 7)
                    s = math.exp(sum(log_ratio) / n)
                    ratios.append(s)
                    clipped += (a > 0 and s > 1 + EPS) or (a < 0 and s < 1 - EPS)
                    continue
                for t, x in enumerate(log_ratio):
                    r = math.exp(x)
                    ratios.append(r)
                    clipped += (a > 0 and r > 1 + EPS) or (a < 0 and r < 1 - EPS)
                    k = (ref[i, t] - logp[i, t]).item()
                    kls.append(math.exp(k) - k - 1)
    clip_key = "clip_frac_seqs" if loss == "gspo" else "clip_frac"
    # the loss's share is a float32 mean of exact counts (one rounding, u32), pooled in float64
    assert got[clip_key] == pytest.approx(clipped / minibatch_items, abs=unit_roundoff(torch.float32) + gamma(4))
    ratio_mean, ratio_std, max_dev = pooled_moments(ratios)
    n = len(ratios)
    # per-token terms (exp: 2u) summed (gamma_n) per update, then pooled: the std from a difference of sums of
    # squares, whose error over the std bounds the std's
    mean_tol = gamma(2 * n + 8) * max(ratios)
    assert got["ratio_mean"] == pytest.approx(ratio_mean, abs=mean_tol)
    assert got["ratio_std"] == pytest.approx(ratio_std, abs=gamma(4 * n + 16) * 3 * max(ratios) ** 2 / ratio_std)
    assert got["ratio_max_dev"] == pytest.approx(max_dev, abs=gamma(4) * max(ratios))
    lr_mean, lr_std, _ = pooled_moments(log_ratios)
    largest = max(abs(x) for x in log_ratios)
    assert got["log_ratio_std"] == pytest.approx(lr_std, abs=gamma(4 * tokens + 16) * 3 * largest**2 / lr_std)
    outside = sum(not (0.8 <= math.exp(x) <= 1.2) for x in log_ratios)
    assert got["ratio_outside_grpo_clip"] == pytest.approx(outside / tokens, abs=gamma(4 * tokens))
    if loss == "grpo":
        assert got["kl"] == pytest.approx(sum(kls) / len(kls), abs=gamma(2 * n + 8) * max(kls) * 2)
    # the case tells the counts apart: the mean over ranks of each rank's mean over its updates is another number
    rank_means = [sum(u["ratio_mean"][0] / u["ratio_mean"][1] for u in r.updates) / len(r.updates) for r in runs]
    assert abs(sum(rank_means) / 2 - ratio_mean) > 100 * mean_tol, (rank_means, ratio_mean)
