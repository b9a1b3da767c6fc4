"""ppo.py's pure functions and Critic against plain float64 loops, numpy and hand-worked cases."""

import json
import math

import numpy as np
import pytest
import torch
from helpers import gamma as gamma_n
from helpers import logit_tol, unit_roundoff
from hypothesis import example, given, settings
from hypothesis import strategies as st

import common
import ppo

SETTINGS = settings(max_examples=60, deadline=None)
F64 = torch.float64
F32 = torch.float32

# Tolerances (issue 42): float64 code against float64 loops, each within gamma_n of exact relative to its terms'
# sizes, the two within twice that. padded_batch(): T <= 7, entries |x| <= 5.
# GAE: delta_t = r + gamma V' - V (3 roundings, |delta| <= 15), A_t = delta_t + gamma lam A_{t+1} (3 more): 6 a
# step over <= 7 steps, the terms summing to <= 7 * 15; the returns A + V one more, |V| <= 5.
GAE_TOL = 2 * gamma_n(6 * 7 + 1) * (7 * 15 + 5)
# the hand-worked losses: r = exp(log r) (the log u |log r| <= 1.7u, exp 2u) and <= 4 products, of size <= 5
HAND_TOL = gamma_n(8) * 5.0


# --- Helpers (plain Python, independent of ppo.py) ---


def as_mask(lengths, T, dtype=torch.float32):
    """A right-padded 0/1 mask, from plain lists."""
    return torch.tensor([[1 if t < n else 0 for t in range(T)] for n in lengths]).to(dtype)


def gae_loop(rewards, values, lengths, gamma, lam):
    """Written from the formula: delta_t = r_t + gamma V_{t+1} - V_t (V after the last real
    token is 0), A_t = delta_t + gamma lam A_{t+1}; R_t = A_t + V_t; 0 on padding."""
    B, T = len(rewards), len(rewards[0])
    adv = [[0.0] * T for _ in range(B)]
    ret = [[0.0] * T for _ in range(B)]
    for i in range(B):
        n = lengths[i]
        a_next = 0.0
        for t in reversed(range(n)):
            v_next = values[i][t + 1] if t + 1 < n else 0.0
            delta = rewards[i][t] + gamma * v_next - values[i][t]
            a_next = delta + gamma * lam * a_next
            adv[i][t] = a_next
            ret[i][t] = a_next + values[i][t]
    return adv, ret


def close(actual, expected, atol, rtol=0.0):
    actual = torch.as_tensor(actual).double()
    expected = torch.as_tensor(expected, dtype=F64)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


@st.composite
def padded_batch(draw, max_b=4, max_t=7, lo=-5.0, hi=5.0):
    """(lengths, T, grid_a, grid_b): right-padded batches with random lengths (0 and T included);
    padded entries of the grids hold random values too (garbage the code must ignore)."""
    B = draw(st.integers(1, max_b))
    T = draw(st.integers(1, max_t))
    lengths = draw(st.lists(st.integers(0, T), min_size=B, max_size=B))
    fl = st.floats(lo, hi, allow_nan=False, allow_infinity=False)
    grid = st.lists(st.lists(fl, min_size=T, max_size=T), min_size=B, max_size=B)
    return lengths, T, draw(grid), draw(grid)


MASK_DTYPES = st.sampled_from([torch.float32, torch.long, torch.bool])
UNIT = st.floats(0.0, 1.0, allow_nan=False)


# --- GAE ---


@pytest.mark.numeric
@SETTINGS
@given(batch=padded_batch(), gamma=UNIT, lam=UNIT, mask_dtype=MASK_DTYPES)
@example(
    batch=([0, 3, 1], 3, [[1.0, 2, 3], [0.5, -1, 2], [4, 4, 4]], [[9.0, 9, 9], [1, 2, 3], [-2, 7, 7]]),
    gamma=0.9,
    lam=0.95,
    mask_dtype=torch.float32,
)
def test_gae_matches_python_double_loop(batch, gamma, lam, mask_dtype):
    lengths, T, rewards, values = batch
    adv, ret = ppo.gae(
        torch.tensor(rewards, dtype=F64), torch.tensor(values, dtype=F64), as_mask(lengths, T, mask_dtype), gamma, lam
    )
    exp_adv, exp_ret = gae_loop(rewards, values, lengths, gamma, lam)
    close(adv, exp_adv, atol=GAE_TOL)
    close(ret, exp_ret, atol=GAE_TOL)


@pytest.mark.parametrize("dtype", [F64, F32])  # float32: the training dtype, the same answer to its precision
def test_gae_hand_worked(dtype):
    # r = [1, 0, 2], V = [0.5, 1, 1.5], one padded slot holding garbage; gamma 0.9, lam 0.5.
    # delta_2 = 2 + 0 - 1.5 = 0.5                 A_2 = 0.5
    # delta_1 = 0 + 0.9*1.5 - 1 = 0.35            A_1 = 0.35 + 0.45*0.5 = 0.575
    # delta_0 = 1 + 0.9*1 - 0.5 = 1.4             A_0 = 1.4 + 0.45*0.575 = 1.65875
    rewards = torch.tensor([[1.0, 0.0, 2.0, 7.0]], dtype=dtype)
    values = torch.tensor([[0.5, 1.0, 1.5, -3.0]], dtype=dtype)
    adv, ret = ppo.gae(rewards, values, as_mask([3], 4), gamma=0.9, lam=0.5)
    assert adv.dtype == ret.dtype == dtype
    # 3 steps of 6 roundings, the terms summing to 4.2 (2.4 + 0.45 * 2.35 + 0.2025 * 3.5), the returns 1 more
    close(adv, [[1.65875, 0.575, 0.5, 0.0]], atol=gamma_n(19, dtype) * 4.2)
    close(ret, [[2.15875, 1.575, 2.0, 0.0]], atol=gamma_n(19, dtype) * 4.2)


@SETTINGS
@given(
    batch=padded_batch(),
    gamma=UNIT,
    lam=UNIT,
    garbage=st.sampled_from([1e30, -1e30, 1e6, -123.0, float("inf"), float("nan")]),
)
def test_gae_ignores_garbage_in_padding(batch, gamma, lam, garbage):
    """Whatever the padding holds, huge or not finite: the real tokens' values are those with zeros there."""
    lengths, T, rewards, values = batch
    m = as_mask(lengths, T)
    r, v = torch.tensor(rewards), torch.tensor(values)
    clean = ppo.gae(r * m, v * m, m, gamma, lam)
    pad = m == 0
    dirty = ppo.gae(r.masked_fill(pad, garbage), v.masked_fill(pad, -garbage), m, gamma, lam)
    for c, d in zip(clean, dirty):
        assert torch.equal(c, d)


# --- token_rewards ---


@SETTINGS
@given(batch=padded_batch(), kl_coef=st.floats(0.0, 1.0), data=st.data())
def test_token_rewards_matches_loop(batch, kl_coef, data):
    lengths, T, old, ref = batch  # padded entries of old / ref are random garbage
    scores = data.draw(st.lists(st.floats(-3, 3), min_size=len(lengths), max_size=len(lengths)))
    out = ppo.token_rewards(
        torch.tensor(scores, dtype=F64),
        torch.tensor(old, dtype=F64),
        torch.tensor(ref, dtype=F64),
        as_mask(lengths, T),
        kl_coef,
    )
    expected = [[0.0] * T for _ in lengths]
    for i, n in enumerate(lengths):
        for t in range(n):
            expected[i][t] = -kl_coef * (old[i][t] - ref[i][t]) + (scores[i] if t == n - 1 else 0.0)
    close(out, expected, atol=2 * gamma_n(3) * 13)  # 3 roundings each side, of size <= 10 + 3


def test_token_rewards_hand_worked():
    # kl_coef 0.1; row 0 length 3, row 1 length 1, row 2 length 0 (nothing, no crash).
    old = torch.tensor([[-1.0, -2.0, -0.5, 9.0], [-0.2, 4.0, 4.0, 4.0], [-1.0, -1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5, -9.0], [-0.7, 0.0, 0.0, 0.0], [-3.0, -3.0, -3.0, -3.0]])
    scores = torch.tensor([1.0, -0.5, 7.0])
    out = ppo.token_rewards(scores, old, ref, as_mask([3, 1, 0], 4), 0.1)
    # row 0: -0.1*0.5 = -0.05, -0.1*(-1) = 0.1, 0 + score 1 -> 1.0
    # row 1: -0.1*0.5 + (-0.5) = -0.55
    close(out, [[-0.05, 0.1, 1.0, 0.0], [-0.55, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], atol=gamma_n(4, F32) * 1.0)


def test_token_rewards_without_reference_is_the_score_alone():
    # --kl-coef 0 loads no reference: ref_logp None puts each score on its last real token, nothing else
    old = torch.tensor([[-1.0, -2.0, 5.0], [-0.2, 4.0, 4.0]])
    out = ppo.token_rewards(torch.tensor([1.0, -0.5]), old, None, as_mask([2, 3], 3), 0.0)
    close(out, [[0.0, 1.0, 0.0], [0.0, 0.0, -0.5]], atol=0)
    with pytest.raises(ValueError, match="reference"):
        ppo.token_rewards(torch.tensor([1.0, -0.5]), old, None, as_mask([2, 3], 3), 0.01)


# --- whiten ---


def whiten_tol(real, dtype=F64, eps=1e-8):
    """|whiten(x) - exact| on the real entries `real` (N of them, |x| <= big) in `dtype`: x - mean errs by the
    mean's N + 1 roundings of size <= big and the subtraction's of <= 2 big (gamma_{N+2} 2 big = e); the
    variance sum_i d_i^2 / (N - 1) by (2 sum |d| e + N e^2) / (N - 1) and its own N + 3 roundings; rsqrt and the
    product 4 more: each output by e / sigma + max|d| / sigma (d var / (2 (var + eps)) + gamma_4)."""
    n, big = len(real), max(abs(v) for v in real)
    mean = sum(real) / n
    d = [v - mean for v in real]
    var = sum(v * v for v in d) / (n - 1)
    e = gamma_n(n + 2, dtype) * 2 * big
    var_err = (2 * sum(abs(v) for v in d) * e + n * e * e) / (n - 1) + gamma_n(n + 4, dtype) * (var + eps)
    sigma = math.sqrt(var + eps)
    return e / sigma + max(abs(v) for v in d) / sigma * (var_err / (2 * (var + eps)) + gamma_n(4, dtype))


def whiten_loop(x, lengths, eps=1e-8):
    real = [x[i][t] for i, n in enumerate(lengths) for t in range(n)]
    out = [[0.0] * len(x[0]) for _ in x]
    if len(real) < 2:
        return out  # x - mean is 0 for a single entry; nothing to whiten for none
    mean = sum(real) / len(real)
    var = sum((v - mean) ** 2 for v in real) / (len(real) - 1)
    for i, n in enumerate(lengths):
        for t in range(n):
            out[i][t] = (x[i][t] - mean) / math.sqrt(var + eps)
    return out


@pytest.mark.numeric
@SETTINGS
@given(batch=padded_batch(lo=-50, hi=50), mask_dtype=MASK_DTYPES)
def test_whiten_matches_loop_and_is_standardised(batch, mask_dtype):
    lengths, T, x, _ = batch
    out = ppo.whiten(torch.tensor(x, dtype=F64), as_mask(lengths, T, mask_dtype))
    real = np.array([x[i][t] for i, n in enumerate(lengths) for t in range(n)])
    tol = 2 * whiten_tol(real.tolist()) if len(real) >= 2 else 0.0  # code and loop, each within whiten_tol
    close(out, whiten_loop(x, lengths), atol=tol)
    got = np.array([out[i, t].item() for i, n in enumerate(lengths) for t in range(n)])
    if len(real) >= 2 and real.var(ddof=1) > 1e-2:
        assert abs(got.mean()) <= tol  # the exact outputs' mean is 0
        # their std is sqrt(var / (var + eps)) >= 1 - eps / (2 var); a std moves by <= sqrt(2) max|d out|
        assert got.std(ddof=1) == pytest.approx(1.0, abs=math.sqrt(2) * tol + 1e-8 / real.var(ddof=1))
    for i, n in enumerate(lengths):
        for t in range(n, T):
            assert out[i, t].item() == 0.0


@pytest.mark.parametrize("garbage", [1e6, -1e6, 1e15, 1e30, -1e30, float("inf"), float("nan")])
def test_whiten_padding_values_do_not_matter(garbage):
    x = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
    m = as_mask([3, 1], 4)
    out = ppo.whiten(x.masked_fill(m == 0, garbage), m)
    # values: [1, 2, 3, 4], mean 2.5, unbiased var 5/3
    want = [(v - 2.5) / math.sqrt(5 / 3 + 1e-8) for v in (1, 2, 3, 4)]
    close(out[m == 1], want, atol=whiten_tol([1.0, 2.0, 3.0, 4.0], F32))
    assert (out[m == 0] == 0).all()


# --- ppo_policy_loss ---


def policy_loss_grad(logp, old, adv, lengths, eps_low, eps_high, dual_clip, clamp=20.0):
    """Per-token loss and d loss / d logp written out from the formula (token-mean)."""
    n_tok = sum(lengths)
    T = len(logp[0])
    total, grad = 0.0, [[0.0] * T for _ in logp]
    for i, n in enumerate(lengths):
        for t in range(n):
            a = adv[i][t]
            lr = logp[i][t] - old[i][t]
            lr_c = min(max(lr, -clamp), clamp)
            r = math.exp(lr_c)
            dr = r if -clamp < lr < clamp else 0.0  # d r / d logp
            r_clip = min(max(r, 1 - eps_low), 1 + eps_high)
            unclipped, clipped = -a * r, -a * r_clip
            if unclipped >= clipped:
                loss, g = unclipped, -a * dr
            else:  # then r lies outside the clip range: the clipped branch is constant
                loss, g = clipped, 0.0
            if dual_clip is not None and a < 0 and loss > -dual_clip * a:
                loss, g = -dual_clip * a, 0.0
            total += loss
            grad[i][t] = g / max(n_tok, 1)
    return total / max(n_tok, 1), grad


def run_policy_loss(logp, old, adv, mask, **kw):
    logp = torch.as_tensor(logp, dtype=F64).clone().requires_grad_(True)
    loss, stats = ppo.ppo_policy_loss(
        logp, torch.as_tensor(old, dtype=F64), torch.as_tensor(adv, dtype=F64), mask, **kw
    )
    loss.backward()
    return loss, logp.grad, stats


# Worked by hand, one token (ratio r = e^(logp - old)): the clipped loss max(-A r, -A clip(r, 1 - eps_low,
# 1 + eps_high)), capped at -c A for A < 0 by the dual clip c; d/dlogp is -A r where the unclipped term is the max
# and 0 where a clip holds it constant
@pytest.mark.parametrize(
    "adv, ratio, eps, dual_clip, want_loss, want_grad, clip_frac",
    [
        (1.0, 1.5, (0.2, 0.2), 3.0, -1.2, 0.0, 1.0),  # A > 0, r > 1 + eps: clipped at 1.2, constant
        (2.0, 3.0, (0.2, 0.2), None, -2.4, 0.0, 1.0),
        (-1.0, 0.5, (0.2, 0.2), 3.0, 0.8, 0.0, 1.0),  # A < 0, r < 1 - eps: clipped at 0.8, constant
        (-0.5, 0.1, (0.2, 0.2), None, 0.4, 0.0, 1.0),
        (1.0, 0.5, (0.2, 0.2), 3.0, -0.5, -0.5, 0.0),  # A > 0, r < 1 - eps: the unclipped term, gradient flows
        (-1.0, 1.5, (0.2, 0.2), 3.0, 1.5, 1.5, 0.0),  # A < 0, 1 + eps < r < c: unclipped, gradient flows
        (1.0, 1.1, (0.2, 0.2), 3.0, -1.1, -1.1, 0.0),
        (-2.0, 0.9, (0.2, 0.2), 3.0, 1.8, 1.8, 0.0),
        (1.0, 1.25, (0.1, 0.3), 3.0, -1.25, -1.25, 0.0),  # inside 1 + eps_high = 1.3: not clipped
        (1.0, 1.35, (0.1, 0.3), 3.0, -1.3, 0.0, 1.0),  # beyond 1.3: clipped
        (-1.0, 0.95, (0.1, 0.3), 3.0, 0.95, 0.95, 0.0),  # inside 1 - eps_low = 0.9: not clipped
        (-1.0, 0.85, (0.1, 0.3), 3.0, 0.9, 0.0, 1.0),  # below 0.9: clipped
        (-1.0, 5.0, (0.2, 0.2), None, 5.0, 5.0, 0.0),  # A < 0, r = 5: max(5, 1.2) = 5, the gradient -A r
        (-1.0, 5.0, (0.2, 0.2), 3.0, 3.0, 0.0, 0.0),  # ... capped by the dual clip at -c A = 3, a constant
    ],
)
def test_policy_loss_hand_worked(adv, ratio, eps, dual_clip, want_loss, want_grad, clip_frac):
    loss, grad, stats = run_policy_loss(
        [[math.log(ratio)]], [[0.0]], [[adv]], torch.ones(1, 1), eps_low=eps[0], eps_high=eps[1], dual_clip=dual_clip
    )
    assert loss.item() == pytest.approx(want_loss, abs=HAND_TOL)
    assert grad.item() == pytest.approx(want_grad, abs=HAND_TOL)
    if want_grad == 0.0:
        assert grad.item() == 0.0  # a clip's constant: no gradient at all, not a small one
    assert stats["clip_frac"] == clip_frac
    assert stats["dual_clip_frac"] == (1.0 if dual_clip is not None and adv < 0 and ratio > dual_clip else 0.0)


def test_policy_loss_clip_frac_hand_worked():
    # clipped: (A=1, r=1.5) and (A=-1, r=0.5); not clipped: (A=1, r=1), (A=-1, r=1.5);
    # a padded token that would be clipped does not count: 2 / 4.
    ratios = [[1.5, 0.5, 1.0, 1.5, 3.0]]
    adv = [[1.0, -1.0, 1.0, -1.0, 1.0]]
    _, _, stats = run_policy_loss([[math.log(r) for r in ratios[0]]], [[0.0] * 5], adv, as_mask([4], 5))
    assert stats["clip_frac"] == 0.5  # 2 / 4: exact
    assert stats["clipped"].tolist() == [[True, True, False, False, False]]  # the padded token: no decision
    close(stats["ratio"][:, :4], [ratios[0][:4]], atol=HAND_TOL)


def random_policy_case(seed, B, T):
    """(old, logp, adv) [B][T] as lists: seeded log-probs, logp within about 0.6 of old, advantages."""
    g = torch.Generator().manual_seed(seed)
    old = (torch.randn(B, T, generator=g, dtype=F64) - 2).tolist()
    logp = (torch.tensor(old, dtype=F64) + 0.6 * torch.randn(B, T, generator=g, dtype=F64)).tolist()
    adv = (1.5 * torch.randn(B, T, generator=g, dtype=F64)).tolist()
    return old, logp, adv


@pytest.mark.numeric
@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    B=st.integers(1, 4),
    T=st.integers(1, 6),
    data=st.data(),
    eps_low=st.floats(0.05, 0.5),
    eps_high=st.floats(0.05, 0.5),
    dual_clip=st.one_of(st.none(), st.floats(1.5, 5.0)),
)
def test_policy_loss_and_gradient_match_loop(seed, B, T, data, eps_low, eps_high, dual_clip):
    lengths = data.draw(st.lists(st.integers(0, T), min_size=B, max_size=B))
    old, logp, adv = random_policy_case(seed, B, T)
    loss, grad, _ = run_policy_loss(
        logp, old, adv, as_mask(lengths, T), eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip
    )
    want_loss, want_grad = policy_loss_grad(logp, old, adv, lengths, eps_low, eps_high, dual_clip)
    # each token's term: the log-ratio (1), exp (2), the clips and products (<= 5), of size <= |A| max(r, c);
    # the loss a mean over <= 24 of them (the loop sums, the code sums and divides): each side gamma_32
    scale = max([abs(adv[i][t]) * max(math.exp(logp[i][t] - old[i][t]), 1 + eps_high, dual_clip or 0.0)
                 for i, n in enumerate(lengths) for t in range(n)] or [0.0])  # fmt: skip
    assert loss.item() == pytest.approx(want_loss, abs=2 * gamma_n(32) * scale)
    close(grad, want_grad, atol=2 * gamma_n(12) * scale)  # a gradient element: its term's chain and 1 / n


# --- value_loss ---


def run_value_loss(values, old, returns, mask, clip):
    v = torch.as_tensor(values, dtype=F64).clone().requires_grad_(True)
    loss, stats = ppo.value_loss(
        v, torch.as_tensor(old, dtype=F64), torch.as_tensor(returns, dtype=F64), mask, clip=clip
    )
    loss.backward()
    return loss, v.grad, stats


def test_value_loss_hand_worked():
    # clip 0.2; token d is padding with garbage.
    #  a: V=1.0 Vo=0.5 R=0.0 -> plain 1,    clipped V 0.7 -> 0.49: plain wins (1), grad (V-R)/3 = 1/3
    #  b: V=1.0 Vo=0.0 R=1.1 -> plain 0.01, clipped V 0.2 -> 0.81: clipped wins (0.81), V outside
    #     [Vo - c, Vo + c] so the clipped branch is constant: grad 0
    #  c: V=2.0 Vo=1.9 R=1.0 -> V inside the range: both 1.0, grad (V-R)/3 = 1/3
    # loss = 0.5 * (1 + 0.81 + 1) / 3 = 0.4683333...; vf_clip_frac = 1/3
    values = [[1.0, 1.0, 2.0, 50.0]]
    old = [[0.5, 0.0, 1.9, -50.0]]
    returns = [[0.0, 1.1, 1.0, 1e6]]
    loss, grad, stats = run_value_loss(values, old, returns, as_mask([3], 4), 0.2)
    assert loss.item() == pytest.approx(0.5 * 2.81 / 3, abs=HAND_TOL)
    close(grad, [[1 / 3, 0.0, 1 / 3, 0.0]], atol=HAND_TOL)
    assert stats["vf_clip_frac"] == pytest.approx(1 / 3, abs=unit_roundoff(F32))  # a float32 mean of flags


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    B=st.integers(1, 4),
    T=st.integers(1, 6),
    clip=st.floats(0.05, 1.0),
    data=st.data(),
    mask_dtype=MASK_DTYPES,
)
def test_value_loss_matches_loop(seed, B, T, clip, data, mask_dtype):
    lengths = data.draw(st.lists(st.integers(0, T), min_size=B, max_size=B))
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(B, T, generator=g, dtype=F64).tolist()
    values = (torch.tensor(old, dtype=F64) + 0.5 * torch.randn(B, T, generator=g, dtype=F64)).tolist()
    returns = (torch.tensor(old, dtype=F64) + torch.randn(B, T, generator=g, dtype=F64)).tolist()
    loss, grad, stats = run_value_loss(values, old, returns, as_mask(lengths, T, mask_dtype), clip)
    n = sum(lengths)
    total, n_clip = 0.0, 0
    want_grad = [[0.0] * T for _ in range(B)]
    for i, L in enumerate(lengths):
        for t in range(L):
            v, vo, r = values[i][t], old[i][t], returns[i][t]
            v_clip = min(max(v, vo - clip), vo + clip)
            plain, clipped = (v - r) ** 2, (v_clip - r) ** 2
            total += max(plain, clipped)
            if clipped > plain:
                n_clip += 1
                assert not (vo - clip < v < vo + clip)  # clipped can only win outside the range
                want_grad[i][t] = 0.0
            else:
                want_grad[i][t] = (v - r) / n
    # each term: the clip (2), a difference and its square (2), of size <= largest, where |v_clip - r| <=
    # |v - r| + |v - v_old| + clip; a mean of <= 24, the 0.5 (1)
    largest = max([(abs(values[i][t] - returns[i][t]) + abs(values[i][t] - old[i][t]) + clip) ** 2
                   for i, L in enumerate(lengths) for t in range(L)] or [0.0])  # fmt: skip
    assert loss.item() == pytest.approx(0.5 * total / max(n, 1), abs=2 * gamma_n(30) * largest)
    close(grad, want_grad, atol=2 * gamma_n(6) * math.sqrt(largest))  # (v - r) / n: 3 roundings each side
    assert stats["vf_clip_frac"] == pytest.approx(n_clip / max(n, 1), abs=unit_roundoff(F32))  # float32 flags


def test_value_loss_all_masked():
    values = torch.tensor([[1.0, 2.0], [1e6, -1e6]], requires_grad=True)
    old = torch.tensor([[1.0, 2.0], [0.0, 0.0]])
    returns = torch.tensor([[0.0, 0.0], [1e6, 1e6]])
    loss, _ = ppo.value_loss(values, old, returns, as_mask([2, 0], 2), clip=0.2)
    loss.backward()
    # row 0: 0.5 * (1 + 4) / 2 = 1.25; gradients (V - R) / 2
    assert loss.item() == 1.25  # 0.5 * (1 + 4) / 2 and its gradient (v - r) / 2: exact in float32
    close(values.grad, [[0.5, 1.0], [0.0, 0.0]], atol=0)
    values.grad = None
    loss, stats = ppo.value_loss(values, old, returns, torch.zeros(2, 2), clip=0.2)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(values.grad, torch.zeros(2, 2))
    assert math.isfinite(stats["vf_clip_frac"])


# --- explained_variance ---


def ev_numpy(values, returns, mask):
    m = mask.bool().numpy()
    v, r = values.double().numpy()[m], returns.double().numpy()[m]
    return 1 - np.var(r - v) / np.var(r)


def test_explained_variance_perfect_constant_and_undefined():
    g = torch.Generator().manual_seed(1)
    returns = torch.randn(3, 5, generator=g)
    m = as_mask([5, 2, 0], 5)
    garbage = returns.masked_fill(m == 0, 1e3)
    assert ppo.explained_variance(garbage, returns, m) == 1.0  # R - V = 0 exactly on the real tokens
    real = returns[m.bool()].double()
    const = torch.full_like(returns, real.mean().item())
    # Var[R - c] = Var[R] exactly; in float32 each variance is within gamma_{N+4} of its value (N = 7 terms,
    # the mean's error second order), so the ratio is within 2 gamma_{N+4} + u of 1
    assert ppo.explained_variance(const, returns, m) == pytest.approx(0.0, abs=2 * gamma_n(11, F32) + gamma_n(1, F32))
    assert math.isnan(ppo.explained_variance(torch.zeros(1, 3), torch.ones(1, 3), torch.ones(1, 3)))  # Var[R] = 0


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 4), T=st.integers(2, 6), data=st.data())
def test_explained_variance_matches_numpy(seed, B, T, data):
    lengths = data.draw(st.lists(st.integers(0, T), min_size=B, max_size=B).filter(lambda ls: sum(ls) >= 2))
    g = torch.Generator().manual_seed(seed)
    returns = torch.randn(B, T, generator=g, dtype=F64) * 2
    values = returns + torch.randn(B, T, generator=g, dtype=F64)
    m = as_mask(lengths, T)
    want = ev_numpy(values, returns, m)
    # each variance within gamma_{N+4} of its value (N <= 24), each side: the ratio 1 - EV within 4 gamma_28
    assert ppo.explained_variance(values, returns, m) == pytest.approx(want, abs=4 * gamma_n(29) * abs(1 - want))


# --- Critic (the cached tiny checkpoint) ---


@pytest.fixture(scope="module")
def critic():
    torch.manual_seed(0)
    return ppo.Critic("tiny", torch.device("cpu"))


def make_roll(completions):
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]][: len(completions)]
    return common.Rollout.from_lists(prompts, completions, pad_id=0)


def test_critic_is_zero_at_init_and_gradients_reach_head_and_trunk(critic):
    roll = make_roll([[14, 15, 16], [17], [18, 19, 20, 21, 22]])
    m = roll.completion_mask
    critic.zero_grad(set_to_none=True)
    v = critic(roll)
    assert v.dtype == torch.float32 and torch.equal(v, torch.zeros(3, 5))  # [B, T], zero at init
    ((v - 1.0) ** 2 * m).sum().backward()
    # d/dbias = sum 2 (0 - 1) m = -2 * 9 tokens
    assert critic.head.bias.grad.item() == -18.0  # a sum of 9 exact -2s
    assert critic.head.weight.grad.abs().sum() > 0
    trunk = list(critic.trunk.named_parameters())
    assert trunk and all(p.requires_grad for _, p in trunk)
    assert all(p.grad is not None for _, p in trunk)  # connected (zero while the head is zero)
    # one SGD step on the head (what the first update does), then the trunk gets signal too
    with torch.no_grad():
        critic.head.weight -= 0.1 * critic.head.weight.grad
        critic.head.bias -= 0.1 * critic.head.bias.grad
    critic.zero_grad(set_to_none=True)
    ((critic(roll) - 1.0) ** 2 * m).sum().backward()
    no_grad = [
        name for name, p in trunk if p.grad is None or not torch.isfinite(p.grad).all() or p.grad.abs().sum() == 0
    ]
    assert not no_grad, f"trunk parameters without gradient: {no_grad}"


def test_critic_value_t_depends_only_on_prefix(critic):
    # V_t = V(x, y_<t): changing completion token y_2 changes V_3.. and leaves V_0..V_2 alone.
    with torch.no_grad():
        saved = critic.head.weight.clone(), critic.head.bias.clone()
        torch.manual_seed(1)
        critic.head.weight.normal_()
        try:
            a = critic(make_roll([[14, 15, 16, 17, 18]]))
            b = critic(make_roll([[14, 15, 30, 17, 18]]))
        finally:
            critic.head.weight.copy_(saved[0])
            critic.head.bias.copy_(saved[1])
    # the same prefix in two float32 forwards (other rows beside it in the matmuls): helpers.logit_tol's model
    tol = logit_tol(critic.trunk.config, 3 + 5, a.abs().max().item())
    torch.testing.assert_close(a[:, :3], b[:, :3], rtol=0, atol=tol)
    assert (a[:, 3:] - b[:, 3:]).abs().min() > 1e-6


# --- The script's own flags (its smoke run from the command line: test_smoke.py) ---


def test_kl_coef_0_loads_and_runs_no_reference(tmp_path, monkeypatch):
    # --kl-coef 0 (as in grpo.py): no frozen reference is built or run and no kl_to_ref is logged;
    # at the default 0.1 the reference is built once, and at step 1 (no update yet) the KL is 0.
    built = []
    real = common.reference_model
    monkeypatch.setattr(common, "reference_model", lambda *a, **k: built.append(a[2].model) or real(*a, **k))
    flags = ["--steps", "2", "--prompts-per-step", "8", "--minibatches", "2", "--eval-size", "8", "--eval-every", "0"]

    def rows(out):
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]

    ppo.train(common.parse_args(ppo.Args, [*flags, "--kl-coef", "0", "--out", str(tmp_path / "kl0")]))
    assert built == []
    assert [r["step"] for r in rows(tmp_path / "kl0")] == [1, 2]
    assert all("kl_to_ref" not in r and math.isfinite(r["loss"]) for r in rows(tmp_path / "kl0"))

    ppo.train(common.parse_args(ppo.Args, [*flags, "--out", str(tmp_path / "kl")]))
    assert built == ["tiny"]
    first, second = rows(tmp_path / "kl")
    assert first["kl_to_ref"] == 0.0 and second["kl_to_ref"] != 0.0  # the policy moved in step 1's updates
