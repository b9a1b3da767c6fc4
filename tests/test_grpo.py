"""grpo.py's formulas against float64 plain loops, REINFORCE written separately, or hand-worked numbers."""

import math

import pytest
import torch
from helpers import (
    F64,
    LIGHT,
    batches,
    loop_grpo,
    t64,
    unit_roundoff,
)
from helpers import gamma as gamma_n
from hypothesis import assume, event, example, given
from hypothesis import strategies as st

import grpo

AGGS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")
EPS_PAIRS = [(0.2, 0.2), (0.2, 0.28)]
F32 = torch.float32
U32 = unit_roundoff(F32)
KL_CLAMP = 20.0  # as verl: a token log-ratio is clamped to [-20, 20] before exp

# Tolerances (issue 42). grpo_loss in float64 against helpers' float64 loops: both evaluate one formula, so each
# is within gamma_n of the exact value, relative to the sizes of its terms, and the two within twice that. One
# token's term rounds at most 16 times (log-ratio 1, exp 2, clip and products 3, k3 and its coefficient 7, the
# weight 3); a loss sums at most 6 rows x (6 + 3 padding) tokens: n = 16 + 54 = 70. Sizes: sum_t w_t |l_t| <=
# max_t |l_t| (the weights sum to <= 1), with |A| <= max_adv, r <= e^2 (batches()), kl_coef <= 0.5 and both k3
# and its slope 1 - e^x <= e^1.5 - 1 (REF_OFFSET). One gradient element is one term's chain (+ 6 for backward).


def term_scale(max_adv=2.0):
    return max_adv * math.exp(2.0) + 0.5 * (math.exp(1.5) - 1)


def loss_tol(max_adv=2.0):
    return 2 * gamma_n(70) * term_scale(max_adv)


def grad_tol(max_adv=2.0):
    return 2 * gamma_n(22) * term_scale(max_adv)


FRAC_TOL = U32 + unit_roundoff(F64)  # a float32 mean of 0/1 flags: the count exact, one division; expected: one


def _grad(loss, x):
    (g,) = torch.autograd.grad(loss, x)
    return g


def _away_from_clip_edges(b, eps_low, eps_high, tol=1e-9):
    """At exactly r = 1 +- eps the two branches tie and torch.maximum splits the gradient."""
    for lr, orow, mrow in zip(b["logp"], b["old"], b["mask"]):
        for l, o, m in zip(lr, orow, mrow):
            r = math.exp(l - o)
            if m and (abs(r - 1 - eps_high) < tol or abs(r - 1 + eps_low) < tol):
                return False
    return True


def _run(b, agg, eps=(0.2, 0.2), ref=None, kl_coef=0.0, max_len=None, adv=None, denominator=None):
    logp = t64(b["logp"]).requires_grad_(True)
    adv = t64(b["adv"] if adv is None else adv)
    loss, stats = grpo.grpo_loss(logp, t64(b["old"]), adv, t64(b["mask"]), eps_low=eps[0], eps_high=eps[1],
                                 ref_logp=None if ref is None else t64(ref), kl_coef=kl_coef, agg=agg,
                                 max_len=max_len, denominator=denominator)  # fmt: skip
    return loss, _grad(loss, logp), stats


REF_OFFSET = st.floats(-1.5, 1.5, allow_nan=False)


# --- Token ratios, the clipped surrogate, the KL term: loss and gradient against a plain loop ---


@pytest.mark.numeric
@LIGHT
@given(batches(), st.sampled_from(AGGS), st.sampled_from(EPS_PAIRS), st.booleans(), st.data())
def test_loss_and_gradient_match_loop(b, agg, eps, with_ref, data):
    assume(_away_from_clip_edges(b, *eps))
    ref, kl_coef = None, 0.0
    if with_ref:
        ref = [[l + data.draw(REF_OFFSET) for l in row] for row in b["logp"]]
        kl_coef = data.draw(st.sampled_from([0.04, 0.5]))
    max_len = data.draw(st.sampled_from([None, b["T"] + 3]))
    adv, max_adv = None, 2.0
    if data.draw(st.booleans()):  # advantages [B, T]: each token uses its own A_it, |A_it| <= 2 (1 + 0.5 * 5)
        adv, max_adv = [[a * (1 + 0.5 * t) * (-1) ** t for t in range(b["T"])] for a in b["adv"]], 2.0 * 3.5
    loss, g, stats = _run(b, agg, eps, ref, kl_coef, max_len, adv)
    exp_loss, exp_grad = loop_grpo(b, eps[0], eps[1], agg, max_len, ref, kl_coef, adv)
    assert loss.item() == pytest.approx(exp_loss, abs=loss_tol(max_adv))
    torch.testing.assert_close(g, t64(exp_grad), rtol=0, atol=grad_tol(max_adv))
    if with_ref:
        k3 = [
            math.expm1(r - l) - (r - l)
            for rr, lr, mr in zip(ref, b["logp"], b["mask"])
            for r, l, m in zip(rr, lr, mr)
            if m
        ]
        assert stats["kl"] == pytest.approx(sum(k3) / len(k3), abs=2 * gamma_n(34) * (math.exp(1.5) - 1))
    else:
        assert stats["kl"] == 0.0


# --- Clipping ---

# one token per case: (A, r) and whether it is clipped under (0.2, 0.2) and under (0.2, 0.28)
CLIP_CASES = [
    (1.0, 1.25, True, False),  # above 1.2, below 1.28
    (1.0, 1.30, True, True),  # above both upper bounds
    (0.5, 0.50, False, False),  # A > 0, r small: the unclipped branch is the pessimistic one
    (-1.0, 0.79, True, True),  # A < 0, r < 0.8
    (-0.7, 0.81, False, False),
    (-1.5, 2.00, False, False),  # A < 0, r large: not clipped (no dual clip in GRPO)
    (2.0, 1.10, False, False),
    (-2.0, 0.95, False, False),
]


@pytest.mark.parametrize("eps_high, col", [(0.2, 2), (0.28, 3)])
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_clipping_is_per_token_and_asymmetric(eps_high, col, per_token_adv):
    """8 one-token rows, or one row of 8 tokens with per-token A: the gradient is 0 where clipped, else -A r / 8."""
    n = len(CLIP_CASES)
    adv = [c[0] for c in CLIP_CASES]
    lr = [math.log(c[1]) for c in CLIP_CASES]
    expected = [0.0 if c[col] else -c[0] * c[1] / n for c in CLIP_CASES]
    shape, agg = ((1, n), "token-mean") if per_token_adv else ((n, 1), "seq-mean-token-mean")
    logp = t64(lr).view(shape).requires_grad_(True)
    loss, stats = grpo.grpo_loss(logp, torch.zeros(shape, dtype=torch.float64), t64([adv] if per_token_adv else adv),
                                 torch.ones(shape), eps_low=0.2, eps_high=eps_high, agg=agg)  # fmt: skip
    g = _grad(loss, logp).flatten()
    for i, (gi, ei) in enumerate(zip(g.tolist(), expected)):
        if ei == 0.0:
            assert gi == 0.0, (CLIP_CASES[i], gi)
        else:
            assert gi == pytest.approx(ei, rel=2 * gamma_n(8)), (CLIP_CASES[i], gi)  # r = exp(log r): 3, products 5
    n_low = sum(1 for c in CLIP_CASES if c[col] and c[0] < 0)
    n_high = sum(1 for c in CLIP_CASES if c[col] and c[0] > 0)
    assert stats["clip_frac_low"] == pytest.approx(n_low / n, abs=FRAC_TOL)
    assert stats["clip_frac_high"] == pytest.approx(n_high / n, abs=FRAC_TOL)
    assert stats["clip_frac"] == pytest.approx((n_low + n_high) / n, abs=FRAC_TOL)


def test_clip_fractions_hand_counted_with_padding():
    """Row 0 (A = +1) r = [1.5, 1.0, 0.5]: one high clip; row 1 (A = -1) r = [0.5, 0.7]: two low; a padded
    column of r = 100 not counted: clip_frac_high 1/5, clip_frac_low 2/5, clip_frac 3/5."""
    r = [[1.5, 1.0, 0.5, 100.0], [0.5, 0.7, 100.0, 100.0]]
    logp = t64([[math.log(x) for x in row] for row in r])
    mask = t64([[1, 1, 1, 0], [1, 1, 0, 0]])
    _, stats = grpo.grpo_loss(logp, torch.zeros(2, 4, dtype=torch.float64), t64([1.0, -1.0]), mask)
    assert stats["clip_frac_high"] == pytest.approx(1 / 5, abs=FRAC_TOL)
    assert stats["clip_frac_low"] == pytest.approx(2 / 5, abs=FRAC_TOL)
    assert stats["clip_frac"] == pytest.approx(3 / 5, abs=FRAC_TOL)
    assert stats["clipped"].tolist() == [[True, False, False, False], [True, True, False, False]]
    # r = exp(log r): 3 roundings each (log, subtraction, exp 2), of size <= 1.5; the mean 5 more
    assert stats["ratio_mean"] == pytest.approx((1.5 + 1.0 + 0.5 + 0.5 + 0.7) / 5, abs=gamma_n(8) * 1.5)
    assert stats["ratio_max_dev"] == pytest.approx(0.5, abs=gamma_n(4) * 1.5)


# --- Aggregation ---


def test_aggregation_anchors():
    """Worked by hand: per-sequence losses [1, -1], lengths [10, 30]: seq-mean-token-mean 0,
    token-mean -0.5; sum-norm with L_max = 30: (10 - 30) / (2 * 30) = -1/3."""
    T = 30
    per_token = t64([[1.0] * T, [-1.0] * T])
    mask = t64([[1] * 10 + [0] * 20, [1] * 30])
    # sums of +-1 are exact, and so are 10 / 10, 30 / 30, -20 / 40 and -20 / 80; -20 / 60 rounds as -1 / 3 does
    assert grpo.aggregate(per_token, mask, "seq-mean-token-mean").item() == 0.0
    assert grpo.aggregate(per_token, mask, "token-mean").item() == -0.5
    assert grpo.aggregate(per_token, mask, "seq-mean-token-sum-norm", max_len=30).item() == -1 / 3
    assert grpo.aggregate(per_token, mask, "seq-mean-token-sum-norm", max_len=40).item() == -0.25
    with pytest.raises(ValueError):
        grpo.aggregate(per_token, mask, "sum")


# --- Micro-batch accumulation (a classic mistake: averaging micro-batch means instead of the batch's) ---


def _full_denominator(agg, mask, max_len):
    B = len(mask)
    if agg == "seq-mean-token-mean":
        return float(B)
    if agg == "token-mean":
        return float(sum(sum(r) for r in mask))
    return float(B * max_len)


def _accumulate(b, agg, pieces, max_len, ref, with_denominator):
    """Sum of the micro-batch gradients (and losses), each piece a contiguous row slice."""
    logp = t64(b["logp"]).requires_grad_(True)
    old, mask, adv = t64(b["old"]), t64(b["mask"]), t64(b["adv"])
    refl = t64(ref) if ref is not None else None
    den = _full_denominator(agg, b["mask"], max_len) if with_denominator else None
    total = 0.0
    for lo, hi in pieces:
        loss, _ = grpo.grpo_loss(logp[lo:hi], old[lo:hi], adv[lo:hi], mask[lo:hi], eps_low=0.2, eps_high=0.28,
                                 ref_logp=None if refl is None else refl[lo:hi], kl_coef=0.05, agg=agg,
                                 max_len=max_len, denominator=den)  # fmt: skip
        loss.backward()
        total += loss.item()
    return total, logp.grad


@LIGHT
@given(batches(min_b=3, max_b=6), st.sampled_from(AGGS), st.booleans(), st.data())
def test_micro_batches_with_denominator_reproduce_full_batch(b, agg, with_ref, data):
    B = b["B"]
    c1 = data.draw(st.integers(1, B - 2))
    c2 = data.draw(st.integers(c1 + 1, B - 1))
    pieces = [(0, c1), (c1, c2), (c2, B)]
    max_len = b["T"] + 2
    ref = [[l - 0.2 * (t % 3) for t, l in enumerate(row)] for row in b["logp"]] if with_ref else None
    full_loss, full_grad = _accumulate(b, agg, [(0, B)], max_len, ref, with_denominator=False)
    acc_loss, acc_grad = _accumulate(b, agg, pieces, max_len, ref, with_denominator=True)
    torch.testing.assert_close(acc_grad, full_grad, rtol=0, atol=grad_tol())  # (k3's x <= 0.4 here)
    assert acc_loss == pytest.approx(full_loss, abs=loss_tol())  # the pieces' sum: 2 more roundings, inside 70
    # and the full-batch gradient itself is the loop's
    _, loop_grad = loop_grpo(b, 0.2, 0.28, agg, max_len, ref, 0.05)
    assume(_away_from_clip_edges(b, 0.2, 0.28))
    torch.testing.assert_close(full_grad, t64(loop_grad), rtol=0, atol=grad_tol())


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean"])
def test_micro_batches_without_denominator_are_wrong(agg):
    """Shows the test above is meaningful: 3 uneven pieces (1, 2, 3 rows, different lengths)
    without the whole-minibatch denominator give a different gradient."""
    gen = torch.Generator().manual_seed(3)
    B, T = 6, 5
    old = -torch.rand(B, T, dtype=torch.float64, generator=gen) * 3
    logp = old + 0.05 * torch.randn(B, T, dtype=torch.float64, generator=gen)
    mask = [[1] * n + [0] * (T - n) for n in (5, 1, 3, 2, 4, 5)]
    b = dict(B=B, T=T, logp=logp.tolist(), old=old.tolist(), mask=mask, adv=[1.0, -0.5, 0.3, 2.0, -1.2, 0.7])
    pieces = [(0, 1), (1, 3), (3, 6)]
    _, full = _accumulate(b, agg, [(0, B)], T, None, with_denominator=False)
    _, good = _accumulate(b, agg, pieces, T, None, with_denominator=True)
    _, bad = _accumulate(b, agg, pieces, T, None, with_denominator=False)
    torch.testing.assert_close(good, full, rtol=0, atol=grad_tol())  # |A| <= 2, r = e^(0.05 z): inside e^2
    assert (bad - full).abs().max().item() > 1e-3


def test_zero_advantage_rows_carry_the_kl_gradient():
    """With a KL term an A = 0 row has a gradient: 0.1 * (1 - e^-0.5) at logp -1, ref -1.5, beta 0.1."""
    b = dict(B=1, T=1, logp=[[-1.0]], old=[[-1.0]], mask=[[1]], adv=[0.0])
    _, grad, _ = _run(b, "seq-mean-token-mean", ref=[[-1.5]], kl_coef=0.1)
    assert grad.item() == pytest.approx(0.1 * (1 - math.exp(-0.5)), rel=2 * gamma_n(10))  # exp 2, k3's chain 8


# --- The k3 KL estimator ---


@pytest.mark.numeric
@LIGHT
@given(  # log-probs of a real size, or huge (whose float32 spacing swallows a small diff)
    st.one_of(st.floats(-30, 0, width=32), st.floats(-1e4, 1e4, allow_nan=False, width=32)),
    st.one_of(st.floats(-1e-6, 1e-6), st.floats(-20, 20), st.floats(-60, 60), st.floats(-1e4, 1e4)),
)
@example(0.0, 1e-7)
@example(-3.0, -1e-8)
@example(-1e4, 1e4)
@example(0.0, 25.0)  # the clamp region on each side: k3 of x = +-20 exactly
@example(-2.0, -25.0)
@example(0.0, 19.5)  # just inside it
@example(0.0, -19.5)
def test_kl_k3_never_negative_and_matches_loop(logp, diff):
    lp32 = torch.tensor([[logp]], dtype=torch.float32)
    ref32 = lp32 + diff
    k = grpo.kl_k3(lp32, ref32).item()
    assert k >= 0.0 and math.isfinite(k)
    x = ref32.double().item() - lp32.double().item()  # the difference the float32 inputs hold
    c = min(max(x, -KL_CLAMP), KL_CLAMP)  # as verl: a log-ratio is clamped to [-20, 20] before exp
    event("clamped" if abs(x) > KL_CLAMP else "|x| > 1" if abs(x) > 1 else "|x| <= 1")
    expected = math.expm1(c) - c
    # x rounds once (u |x|, moving k3 by e^c u |c|, the clamp being 1-Lipschitz), expm1 within 2u |e^c - 1|,
    # the subtraction u k3
    k3_tol = gamma_n(4, F32) * (math.exp(c) * abs(c) + abs(math.expm1(c)) + expected)
    assert k == pytest.approx(expected, abs=k3_tol)
    # float64 is not negative either, and is exact against the loop: the same x (one float64 subtraction on both
    # sides); expm1 2u and the subtraction u each
    k64 = grpo.kl_k3(lp32.double(), ref32.double()).item()
    assert k64 >= 0.0
    assert k64 == pytest.approx(expected, abs=2 * gamma_n(3) * (abs(math.expm1(c)) + expected))


def test_kl_term_added_per_token():
    """On-policy (r = 1) with A = 0 the surrogate is 0, so the loss is kl_coef * agg(k3)."""
    logp = t64([[-1.0, -2.0, -0.5], [-3.0, -0.1, -4.0]])
    ref = t64([[-1.5, -2.0, 0.3], [-2.0, -0.6, 9.0]])
    mask = t64([[1, 1, 1], [1, 1, 0]])
    k3 = [[math.expm1(r - l) - (r - l) for r, l in zip(rr, lr)] for rr, lr in zip(ref.tolist(), logp.tolist())]
    seq = [(k3[0][0] + k3[0][1] + k3[0][2]) / 3, (k3[1][0] + k3[1][1]) / 2]
    expected = {
        "seq-mean-token-mean": sum(seq) / 2,
        "token-mean": (sum(k3[0]) + k3[1][0] + k3[1][1]) / 5,
        "seq-mean-token-sum-norm": (sum(k3[0]) + k3[1][0] + k3[1][1]) / (2 * 4),
    }
    for agg in AGGS:
        loss, stats = grpo.grpo_loss(
            logp, logp, torch.zeros(2, dtype=torch.float64), mask, ref_logp=ref, kl_coef=0.3, agg=agg, max_len=4
        )
        # k3 <= e^9 here: 6 roundings each (x, expm1 2, subtraction, the clamp and mask exact), <= 5 summed, 3
        # more for the weights and kl_coef; on both sides
        tol = 2 * gamma_n(14) * sum(abs(k) for row in k3 for k in row)
        assert loss.item() == pytest.approx(0.3 * expected[agg], abs=0.3 * tol), agg
        assert stats["kl"] == pytest.approx(expected["token-mean"], abs=tol)
    # no reference: no KL, whatever kl_coef says
    loss, stats = grpo.grpo_loss(logp, logp, torch.zeros(2, dtype=torch.float64), mask, kl_coef=0.3)
    assert loss.item() == 0.0 and stats["kl"] == 0.0
