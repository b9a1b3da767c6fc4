"""Properties every script's loss must have, one test each over all of them (LOSSES); each script's own formulas are
checked against a plain loop in its own file (test_<name>.py). A fork adds its loss to LOSSES (docs/forks.md)."""

import math
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
from helpers import LIGHT, batches, is_clipped, t64, unit_roundoff
from helpers import gamma as gamma_n
from hypothesis import assume, given
from hypothesis import strategies as st

import grpo
import gspo
import ppo


class Loss(NamedTuple):
    """A loss as the shared properties call it: fn(logp, old_logp, advantages, mask, **kw) -> (loss, info)."""

    fn: Callable
    kw: dict  # its keywords
    agg: str  # how it averages its per-token terms: "seq" = mean over rows of each row's token mean, "token" = mean
    # over all tokens, "sum-norm" = sum over B * max_len (its on-policy gradient, -A w, has these weights w)
    value: str | None = "surrogate"  # its value on-policy (every ratio 1): "surrogate", -sum w A (the ratio times A,
    # PPO-style); "reinforce", -sum w A logp (a detached weight times log-probs, as CISPO's); None: no property


LOSSES = {
    "grpo-seq-mean-token-mean": Loss(grpo.grpo_loss, dict(agg="seq-mean-token-mean"), "seq"),
    "grpo-token-mean": Loss(grpo.grpo_loss, dict(agg="token-mean"), "token"),
    "grpo-seq-mean-token-sum-norm": Loss(grpo.grpo_loss, dict(agg="seq-mean-token-sum-norm"), "sum-norm"),
    "gspo-sequence": Loss(gspo.gspo_loss, dict(variant="sequence"), "seq"),
    "gspo-token": Loss(gspo.gspo_loss, dict(variant="token"), "seq"),
    "ppo": Loss(ppo.ppo_policy_loss, dict(dual_clip=3.0), "token"),
    "ppo-no-dual-clip": Loss(ppo.ppo_policy_loss, dict(dual_clip=None), "token"),
}
NAMES = list(LOSSES)
GARBAGE = st.sampled_from([float("inf"), float("-inf"), float("nan"), 1e30, -1e30, 123.0, -7.5, 0.0])
# GSPO-token's ratio is s_i on every column, padding's included: its gradient path is the column's own logp
FINITE_GARBAGE = st.sampled_from([1e30, -1e30, 123.0, -7.5, 0.0, -50.0])


def loss_of(name, logp, old, adv, mask, ref=None, **kw):
    """(loss, info) of the named loss; `adv` [B] (given to PPO per token, as ppo.py does) or [B, T]; `ref` to GRPO's
    KL term."""
    fn, own = LOSSES[name][:2]
    if name.startswith("ppo") and adv.dim() == 1:
        adv = adv[:, None].expand_as(logp)
    if name.startswith("grpo") and ref is not None:
        kw = dict(kw, ref_logp=ref, kl_coef=0.1)
    return fn(logp, old, adv, mask, **own, **kw)


def loss_and_grad(name, logp, old, adv, mask, **kw):
    x = logp.clone().requires_grad_(True)
    loss, info = loss_of(name, x, old, adv, mask, **kw)
    (g,) = torch.autograd.grad(loss, x)
    return loss, g, info


def scalars(info):
    """The loss's scalar statistics: info also holds the detached tensors "ratio" and "clipped"."""
    return {k: v for k, v in info.items() if not isinstance(v, torch.Tensor)}


def reinforce_weights(agg, mask):
    """[B, T] w of each token in REINFORCE's -sum w A logp, by the loss's aggregation (1 / (|y_i| B), 1 / sum m or
    1 / (B T)), written out."""
    B, T = mask.shape
    return {"seq": mask / (mask.sum(1, keepdim=True) * B), "token": mask / mask.sum(), "sum-norm": mask / (B * T)}[agg]


def on_policy(name, b, mask_dtype=torch.float64):
    """The named loss at old = logp (every ratio 1): (loss, its gradient, info, REINFORCE's gradient -A w)."""
    mask, adv, logp = t64(b["mask"]), t64(b["adv"]), t64(b["logp"])
    loss, g, info = loss_and_grad(name, logp, logp, adv, mask.to(mask_dtype))
    return loss, g, info, -adv[:, None] * reinforce_weights(LOSSES[name].agg, mask)


# each gradient element: <= 6 roundings each side, |A| <= 2
GRAD_TOL = 2 * gamma_n(6) * 2.0


@pytest.mark.parametrize("name", NAMES)
@LIGHT
@given(b=batches(), mask_dtype=st.sampled_from([torch.float64, torch.long, torch.bool]))
def test_on_policy_gradient_equals_reinforce(name, b, mask_dtype):
    """With old = logp every ratio is 1: nothing clips, and the gradient is REINFORCE's, -A_i w_it per token, w the
    aggregation's weight. A gradient property, whatever the loss's value (PPO-style clips, GSPO, CISPO's detached
    weight alike); a weight of the ratio left attached to the graph adds -A w logp d(weight)/d(logp) and fails here."""
    _, g, info, want_grad = on_policy(name, b, mask_dtype)
    torch.testing.assert_close(g, want_grad, rtol=0, atol=GRAD_TOL)
    assert info["ratio_mean"] == 1.0 and info.get("ratio_max_dev", 0.0) == 0.0 and info.get("approx_kl", 0.0) == 0.0
    assert all(v == 0.0 for k, v in info.items() if "clip_frac" in k), info
    assert not info["clipped"].any()


@pytest.mark.parametrize("name", [n for n in NAMES if LOSSES[n].value is not None])
@LIGHT
@given(b=batches())
def test_on_policy_loss_value(name, b):
    """The loss's value at old = logp, as LOSSES declares it: -sum w A (a surrogate of the ratio) or -sum w A logp (a
    detached weight times the log-probs), w the aggregation's weights."""
    loss, _, _, want_grad = on_policy(name, b)
    logp = t64(b["logp"]).masked_fill(t64(b["mask"]) == 0, 0.0)
    want = want_grad.sum() if LOSSES[name].value == "surrogate" else (want_grad * logp).sum()
    size = 2.0 * (6.0 if LOSSES[name].value == "reinforce" else 1.0)  # |A| <= 2 (times |logp| <= 6)
    assert loss.item() == pytest.approx(want.item(), abs=2 * gamma_n(30) * size)  # a sum of <= 24 terms


def test_a_weight_left_attached_fails_the_gradient_property():
    """The check above can fail: a CISPO-style loss whose clipped IS weight is not detached (the planted bug), and the
    same loss detached, which passes."""

    def cispo_like(logp, old, adv, mask, detach=True):
        ratio = torch.where(mask.bool(), logp - old, torch.zeros_like(logp)).exp()
        weight = ratio.clamp(max=1.2)
        per_token = -(weight.detach() if detach else weight) * adv[:, None] * logp
        info = {"ratio": ratio.detach(), "clipped": (ratio > 1.2) & mask.bool(), "ratio_mean": 1.0}
        return torch.where(mask.bool(), per_token, 0.0).sum() / mask.sum(), info

    b = dict(mask=[[1, 1, 0], [1, 1, 1]], adv=[0.5, -1.5], logp=[[-1.0, -2.0, -0.5], [-0.3, -4.0, -1.0]])
    for detach in (True, False):
        LOSSES["planted"] = Loss(lambda *a, detach=detach: cispo_like(*a, detach=detach), {}, "token", "reinforce")
        try:
            _, g, _, want = on_policy("planted", b)
        finally:
            del LOSSES["planted"]
        assert torch.allclose(g, want, rtol=0, atol=GRAD_TOL) == detach, (detach, g, want)


@pytest.mark.parametrize("name", NAMES)
@LIGHT
@given(b=batches(), k=st.integers(1, 3), with_ref=st.booleans(), data=st.data())
def test_padding_columns_change_nothing(name, b, k, with_ref, data):
    """Garbage (even inf / nan) in padded logp, old_logp and ref_logp changes neither the loss, the statistics, the
    clip decisions nor the real tokens' gradient (sum-norm with a fixed max_len); padding gets exactly 0."""
    T, L = b["T"], b["T"] + 3
    draw = lambda: data.draw(FINITE_GARBAGE if name == "gspo-token" else GARBAGE)  # noqa: E731
    pad = lambda rows: t64([r + [draw() for _ in range(k)] for r in rows])  # noqa: E731
    ref = [[x + 0.3 for x in row] for row in b["logp"]] if with_ref else None
    kw = dict(max_len=L) if name.startswith("grpo") else {}
    adv = t64(b["adv"])
    l0, g0, s0 = loss_and_grad(name, t64(b["logp"]), t64(b["old"]), adv, t64(b["mask"]), ref=ref and t64(ref), **kw)
    pmask = t64([r + [0] * k for r in b["mask"]])
    l1, g1, s1 = loss_and_grad(name, pad(b["logp"]), pad(b["old"]), adv, pmask, ref=ref and pad(ref), **kw)
    assert torch.isfinite(l1) and torch.isfinite(g1).all()
    # the largest of the three losses' derivations (grpo.py's: a token's term rounds <= 16 times, a loss sums <= 54
    # terms, of size <= |A| e^2 + the KL's 0.1 (e^1.5 - 1)); a gradient element its term's chain, <= 22
    size = 2.0 * math.exp(2.0) + 0.1 * (math.exp(1.5) - 1)
    torch.testing.assert_close(l1, l0, rtol=0, atol=2 * gamma_n(70) * size)
    torch.testing.assert_close(g1[:, :T], g0, rtol=0, atol=2 * gamma_n(22) * size)
    assert torch.equal(g1[:, T:], torch.zeros_like(g1[:, T:]))
    assert torch.equal(s1["clipped"][..., :T] if s1["clipped"].dim() == 2 else s1["clipped"], s0["clipped"])
    for key, v in scalars(s0).items():  # counts exactly; means of <= 24 terms of size <= e^2 summed in another order
        assert s1[key] == (v if "clip_frac" in key else pytest.approx(v, abs=2 * gamma_n(40) * math.exp(2))), key


@pytest.mark.parametrize("name", NAMES)
def test_an_empty_row_adds_nothing_but_its_place_in_b(name):
    """A row with no token (-inf log-probs, huge A) adds nothing but its place in B; all-empty: loss 0."""
    logp, old = t64([[-1.1, -1.9, -3.0], [-math.inf] * 3]), t64([[-1.0, -2.0, -3.0], [-math.inf] * 3])
    mask, adv, ref = t64([[1, 1, 0], [0, 0, 0]]), t64([0.7, -1e6]), t64([[-1.0, -1.5, 0.0], [0.0] * 3])
    kw = dict(max_len=3) if name.startswith("grpo") else {}
    loss, g, info = loss_and_grad(name, logp, old, adv, mask, ref=ref, **kw)
    alone, g_alone, _ = loss_and_grad(name, logp[:1], old[:1], adv[:1], mask[:1], ref=ref[:1], **kw)
    share = 1.0 if LOSSES[name].agg == "token" else 0.5
    assert torch.isfinite(loss) and torch.isfinite(g).all() and torch.isfinite(info["ratio"]).all()
    assert all(math.isfinite(v) for v in scalars(info).values()), info
    assert torch.equal(g[1], torch.zeros(3, dtype=torch.float64))
    # halving is exact in binary; the two sums add the same terms, one of them 0
    assert loss.item() == share * alone.item() and torch.equal(g[0], share * g_alone[0])
    empty = torch.zeros_like(mask)
    loss, g, info = loss_and_grad(name, logp, old, adv, empty, ref=ref, **kw)
    assert loss.item() == 0.0 and torch.equal(g, torch.zeros_like(g))
    assert all(math.isfinite(v) for v in scalars(info).values()), info
    assert not info["clipped"].any()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_extreme_log_ratios_are_finite(name, dtype):
    """Log-ratios of +-100 (past float32's exp overflow at ~88.7), KL log-ratios of +-200: finite loss and gradient."""
    old = torch.zeros(4, 3, dtype=dtype)
    logp = torch.tensor([[100.0] * 3, [-100.0] * 3, [100.0, -100.0, 100.0], [-100.0, 100.0, 0.0]], dtype=dtype)
    assert dtype != torch.float32 or torch.isinf(logp.exp()).any()  # (beyond the overflow, where it applies)
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1]], dtype=dtype)
    for adv in ([1.0, 1.0, -1.0, -1.0], [-1.0, -1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]):
        loss, g, info = loss_and_grad(name, logp, old, torch.tensor(adv, dtype=dtype), mask, ref=-logp)
        assert torch.isfinite(loss), (adv, loss)
        assert torch.isfinite(g).all(), (adv, g)
        assert all(math.isfinite(v) for v in scalars(info).values()), info
        assert torch.isfinite(info["ratio"]).all()


@pytest.mark.parametrize("name", ["grpo-token-mean", "ppo", "ppo-no-dual-clip"])
@LIGHT
@given(b=batches(), eps=st.sampled_from([(0.2, 0.2), (0.2, 0.28)]), data=st.data())
def test_info_holds_each_tokens_ratio_and_clip_decision(name, b, eps, data):
    """info's per-token ratio and clipped (the rule written out, False on padding), detached; clip_frac counts them."""
    adv = [[data.draw(st.floats(-2.0, 2.0, allow_nan=False)) for _ in range(b["T"])] for _ in range(b["B"])]
    real = [(i, t) for i, row in enumerate(b["mask"]) for t, m in enumerate(row) if m]
    ratios = {(i, t): math.exp(b["logp"][i][t] - b["old"][i][t]) for i, t in real}
    assume(all(abs(r - 1 - eps[1]) > 1e-9 and abs(r - 1 + eps[0]) > 1e-9 for r in ratios.values()))  # no tie
    _, _, info = loss_and_grad(
        name, t64(b["logp"]), t64(b["old"]), t64(adv), t64(b["mask"]), eps_low=eps[0], eps_high=eps[1]
    )
    ratio, clipped = info["ratio"], info["clipped"]
    assert ratio.shape == clipped.shape == (b["B"], b["T"])
    assert not ratio.requires_grad and clipped.dtype == torch.bool
    rule = {(i, t): is_clipped(adv[i][t], r, *eps) for (i, t), r in ratios.items()}
    assert {tuple(ij) for ij in clipped.nonzero().tolist()} == {k for k, c in rule.items() if c}
    for (i, t), r in ratios.items():
        assert ratio[i, t].item() == pytest.approx(r, rel=2 * gamma_n(3))  # one subtraction, one exp (2u)
    # a float32 mean of 0/1 flags: the count exact, one division; the expected one more
    frac_tol = unit_roundoff(torch.float32) + unit_roundoff(torch.float64)
    assert info["clip_frac"] == pytest.approx(sum(rule.values()) / len(real), abs=frac_tol)


@pytest.mark.numeric
@pytest.mark.parametrize("name", NAMES)
def test_log_ratio_statistics_hand_worked(name):
    """Every loss's info measures how far an update moved the same way: the population std of its tokens'
    log(pi / pi_old) and the share of tokens whose ratio is outside [0.8, 1.2], counted over `tokens` tokens.
    Row 0: log-ratios 0.1, -0.3 and a padded slot (ignored, however far off); row 1: 0.25, 0.0."""
    old = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.5, -9.0]])
    logp = old + torch.tensor([[0.1, -0.3, 50.0], [0.25, 0.0, -50.0]])
    mask, adv = torch.tensor([[1, 1, 0], [1, 1, 0]]), torch.tensor([1.0, -1.0])
    info = loss_of(name, logp, old, adv, mask)[1]
    d = [0.1, -0.3, 0.25, 0.0]
    mean = sum(d) / 4
    std = math.sqrt(sum((x - mean) ** 2 for x in d) / 4)  # the population std, by hand
    # float32: d back from old + d within u (|old + d| <= 3.3 + 0.3) and the literal's own u 0.3: 4u each; a std is
    # a seminorm (moved by <= max|e|), and rounds <= 10 times itself
    f32 = torch.float32
    assert info["tokens"] == 4
    assert info["log_ratio_mean"] == pytest.approx(mean, abs=4 * unit_roundoff(f32) + gamma_n(10, f32) * 0.3)
    assert info["log_ratio_std"] == pytest.approx(std, abs=4 * unit_roundoff(f32) + gamma_n(10, f32) * std)
    # exp(0.1) = 1.105 inside; exp(-0.3) = 0.741 < 0.8; exp(0.25) = 1.284 > 1.2; exp(0) = 1 inside
    assert info["ratio_outside_grpo_clip"] == 0.5
    still = loss_of(name, old, old, adv, mask)[1]
    assert (still["log_ratio_std"], still["ratio_outside_grpo_clip"]) == (0.0, 0.0)
    empty = loss_of(name, logp, old, adv, torch.zeros_like(mask))[1]
    assert (empty["tokens"], empty["log_ratio_std"], empty["ratio_outside_grpo_clip"]) == (0, 0.0, 0.0)
