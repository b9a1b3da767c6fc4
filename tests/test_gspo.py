"""gspo.py's formulas against float64 plain loops, REINFORCE written separately, or hand-worked numbers."""

import math

import pytest
import torch
from helpers import (
    F64,
    LIGHT,
    batches,
    clipped_objective,
    is_clipped,
    loop_geo_mean_ratio,
    loop_seq_ratio,
    t64,
    unit_roundoff,
)
from helpers import gamma as gamma_n
from hypothesis import assume, given
from hypothesis import strategies as st

import gspo

EPS_LOW, EPS_HIGH = 3e-4, 4e-4  # the paper's (and gspo_loss's default) clip range
F32 = torch.float32
FRAC_TOL = unit_roundoff(F32) + unit_roundoff(F64)  # a float32 mean of 0/1 flags: exact count, one division each

# Tolerances (issue 42). gspo_loss in float64 against float64 loops: each within gamma_n of exact, relative to
# its terms' sizes, and the two within twice that. s = exp(mean_t (logp - old)) over <= 6 tokens (+ 3 padding
# zeros) with |logp - old| <= 2 (batches()): the mean errs by gamma_10 * 2 absolutely, exp by 2u: s is within
# relative gamma_22 each side. A loss: -A s or -A clip(s) per row (2 roundings), a mean over <= 6 rows (7);
# a gradient element -A s / (|y| B): 4 more (backward's products), |A| <= 2, s <= e^2.
S_REL = 2 * gamma_n(22)
SCALE = 2.0 * math.exp(2.0)
LOSS_TOL = 2 * gamma_n(22 + 9) * SCALE
GRAD_TOL = 2 * gamma_n(22 + 6) * SCALE
VARIANTS = ("sequence", "token")
# the share clipped, by unit: the sequence variant clips whole sequences, GSPO-token clips tokens
CLIP_KEY = {"sequence": "clip_frac_seqs", "token": "clip_frac"}


def clip_frac(stats, variant):
    """The loss's clipped share in its own unit; the other unit's key is absent (a share of sequences is
    never reported under the token-level name, or the reverse)."""
    other = CLIP_KEY["token" if variant == "sequence" else "sequence"]
    assert other not in stats, f"variant={variant} reports {other}"
    return stats[CLIP_KEY[variant]]


def _grad(loss, x):
    (g,) = torch.autograd.grad(loss, x)
    return g


def _away_from_clip_edges(s_list, eps_low, eps_high, tol=1e-9):
    """At exactly s = 1 +- eps the two branches tie and torch.maximum splits the gradient."""
    return all(abs(s - (1 + eps_high)) > tol and abs(s - (1 - eps_low)) > tol for s in s_list)


def _loss_and_grad(logp_rows, old_rows, adv, mask_rows, variant, **kw):
    logp = t64(logp_rows).requires_grad_(True)
    loss, stats = gspo.gspo_loss(logp, t64(old_rows), adv, t64(mask_rows), variant=variant, **kw)
    return loss, _grad(loss, logp), stats


# --- The sequence ratio ---


@pytest.mark.numeric
@LIGHT
@given(batches())
def test_seq_ratio_is_geometric_mean_of_token_ratios(b):
    logp, old, mask = t64(b["logp"]), t64(b["old"]), t64(b["mask"])
    s = gspo.seq_log_ratio(logp, old, mask).exp().tolist()
    exp_mean = loop_seq_ratio(b["logp"], b["old"], b["mask"])
    geo = loop_geo_mean_ratio(b["logp"], b["old"], b["mask"])
    for got, e1, e2 in zip(s, exp_mean, geo):
        assert math.isclose(got, e1, rel_tol=S_REL, abs_tol=0)
        # the loop's product of <= 6 exps (3 roundings each, 5 products) to the power 1 / n (2): gamma_25
        assert math.isclose(got, e2, rel_tol=S_REL / 2 + gamma_n(25), abs_tol=0)
    # the loss reports the same ratio: a mean of <= 4 of them (5 more roundings), each <= e^2
    _, stats = gspo.gspo_loss(logp, old, t64(b["adv"]), mask)
    assert math.isclose(stats["ratio_mean"], sum(exp_mean) / len(exp_mean), abs_tol=(S_REL + gamma_n(10)) * SCALE)
    assert math.isclose(stats["ratio_max_dev"], max(abs(x - 1) for x in exp_mean), abs_tol=(S_REL + gamma_n(2)) * SCALE)


# --- Clipping and the gradient ---


def _hand_grad(b, s_list, eps_low, eps_high):
    """d loss / d logp_it = -A_i s_i / (|y_i| B) on real tokens of unclipped sequences, else 0."""
    B = b["B"]
    out = []
    for i in range(B):
        n = sum(b["mask"][i])
        a, s = b["adv"][i], s_list[i]
        g = 0.0 if is_clipped(a, s, eps_low, eps_high) else -a * s / (n * B)
        out.append([g if m else 0.0 for m in b["mask"][i]])
    return t64(out)


@pytest.mark.numeric
@LIGHT
@given(batches(), st.sampled_from([(EPS_LOW, EPS_HIGH), (0.2, 0.27), (0.0, 0.0)]), st.sampled_from(VARIANTS))
def test_loss_and_gradient_match_hand_computation(b, eps, variant):
    eps_low, eps_high = eps
    s = loop_seq_ratio(b["logp"], b["old"], b["mask"])
    assume(_away_from_clip_edges(s, eps_low, eps_high))
    loss, g, _ = _loss_and_grad(
        b["logp"], b["old"], t64(b["adv"]), b["mask"], variant, eps_low=eps_low, eps_high=eps_high
    )
    expected_loss = sum(clipped_objective(a, si, eps_low, eps_high) for a, si in zip(b["adv"], s)) / b["B"]
    assert loss.item() == pytest.approx(expected_loss, abs=LOSS_TOL)
    torch.testing.assert_close(g, _hand_grad(b, s, eps_low, eps_high), rtol=0, atol=GRAD_TOL)


@pytest.mark.parametrize("variant", VARIANTS)
def test_reference_example(variant):
    """Log-ratios [0.01, -0.02, 0.04]: s = exp(0.01) = 1.0100502, clipped for A > 0 (no gradient, loss
    -A (1 + eps_high)), not for A < 0 (gradient -A s / 3 per token, loss -A s)."""
    old = t64([[-1.0, -2.0, -0.5]])
    d = [0.01, -0.02, 0.04]
    logp0 = old + t64([d])
    mask = torch.ones(1, 3, dtype=torch.float64)
    s = math.exp(sum(d) / 3)
    assert s == pytest.approx(1.0100502, abs=5e-8)  # the hand-worked figure, rounded to 7 decimals
    # logp0 - old gives d back to within u |old| each (old + d rounded once): a mean off by 2u, exp 2u more
    assert gspo.seq_log_ratio(logp0, old, mask).exp().item() == pytest.approx(s, rel=gamma_n(12))

    logp = logp0.clone().requires_grad_(True)
    loss, stats = gspo.gspo_loss(logp, old, t64([1.0]), mask, eps_low=EPS_LOW, eps_high=EPS_HIGH, variant=variant)
    assert loss.item() == pytest.approx(-(1 + EPS_HIGH), rel=gamma_n(4))  # 1 + eps (1), -A (1), mean (2)
    assert torch.equal(_grad(loss, logp), torch.zeros(1, 3, dtype=torch.float64))
    assert clip_frac(stats, variant) == 1.0

    for a in (-1.0, -0.37):
        logp = logp0.clone().requires_grad_(True)
        loss, stats = gspo.gspo_loss(logp, old, t64([a]), mask, eps_low=EPS_LOW, eps_high=EPS_HIGH, variant=variant)
        assert loss.item() == pytest.approx(-a * s, rel=gamma_n(24))  # s's 12 (above), each side
        expected = torch.full((1, 3), -a * s / 3, dtype=torch.float64)
        torch.testing.assert_close(_grad(loss, logp), expected, rtol=gamma_n(32), atol=0)  # + 4 per gradient
        assert clip_frac(stats, variant) == 0.0


def test_clip_frac_hand_counted_sequence_variant():
    """5 sequences, of which exactly rows 0 and 3 are clipped -> clip_frac_seqs 2/5."""
    mask = t64([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    # per-sequence mean log-ratio
    lr = [0.001, 0.001, -0.001, -0.001, 0.0002]
    adv = [1.0, -1.0, 1.0, -1.0, 1.0]  # clipped: A>0 & s>1+4e-4 (row 0); A<0 & s<1-3e-4 (row 3)
    old = torch.zeros(5, 3, dtype=torch.float64)
    logp = t64([[x] * 3 for x in lr]) * mask
    _, stats = gspo.gspo_loss(logp, old, t64(adv), mask, eps_low=EPS_LOW, eps_high=EPS_HIGH, variant="sequence")
    assert clip_frac(stats, "sequence") == pytest.approx(2 / 5, abs=FRAC_TOL)
    assert stats["clipped"].tolist() == [True, False, False, True, False]
    expected_ratio_mean = sum(math.exp(x) for x in lr) / 5
    # s: a mean of exact products (3 roundings), exp (2); the mean of 5: 5 more; each side, of size ~1
    assert stats["ratio_mean"] == pytest.approx(expected_ratio_mean, rel=2 * gamma_n(10))
    # s - 1 ~ 1e-3 from s ~ 1 within gamma_5: relative to 1e-3, 1000 times that
    assert stats["ratio_max_dev"] == pytest.approx(math.exp(0.001) - 1, abs=2 * gamma_n(6))
    # equal lengths: a per-sequence and a per-token fraction agree, so GSPO-token must say 2/5 too
    full = torch.ones(5, 3, dtype=torch.float64)
    logp_full = t64([[x] * 3 for x in lr])
    _, st_tok = gspo.gspo_loss(logp_full, old, t64(adv), full, eps_low=EPS_LOW, eps_high=EPS_HIGH, variant="token")
    _, st_seq = gspo.gspo_loss(logp_full, old, t64(adv), full, eps_low=EPS_LOW, eps_high=EPS_HIGH, variant="sequence")
    assert clip_frac(st_tok, "token") == pytest.approx(2 / 5, abs=FRAC_TOL)
    assert clip_frac(st_seq, "sequence") == pytest.approx(2 / 5, abs=FRAC_TOL)


@LIGHT
@given(batches(), st.sampled_from([(EPS_LOW, EPS_HIGH), (0.2, 0.27), (0.0, 0.0)]), st.sampled_from(VARIANTS))
def test_info_holds_each_ratio_and_clip_decision(b, eps, variant):
    """info's ratio and clipped, detached: per sequence (s_i, the loop's rule), or on each real token (GSPO-token)."""
    s = loop_seq_ratio(b["logp"], b["old"], b["mask"])
    assume(_away_from_clip_edges(s, *eps))
    logp = t64(b["logp"]).requires_grad_(True)
    _, info = gspo.gspo_loss(
        logp, t64(b["old"]), t64(b["adv"]), t64(b["mask"]), eps_low=eps[0], eps_high=eps[1], variant=variant
    )
    ratio, clipped = info["ratio"], info["clipped"]
    assert not ratio.requires_grad and clipped.dtype == torch.bool
    rule = [is_clipped(a, si, *eps) for a, si in zip(b["adv"], s)]
    lengths = [sum(row) for row in b["mask"]]
    if variant == "sequence":
        assert ratio.shape == clipped.shape == (b["B"],)
        for got, expected in zip(ratio.tolist(), s):
            assert got == pytest.approx(expected, rel=S_REL)
        assert clipped.tolist() == rule
        assert clip_frac(info, variant) == pytest.approx(sum(rule) / b["B"], abs=FRAC_TOL)  # (a float32 mean)
    else:
        assert ratio.shape == clipped.shape == (b["B"], b["T"])
        for i, row in enumerate(b["mask"]):
            for t, m in enumerate(row):
                if m:
                    assert ratio[i, t].item() == pytest.approx(s[i], rel=S_REL + 2 * gamma_n(3))  # s pi / sg(pi)
                    assert clipped[i, t].item() == rule[i], (i, t)
        share = sum(n for n, c in zip(lengths, rule) if c) / sum(lengths)
        assert clip_frac(info, variant) == pytest.approx(share, abs=FRAC_TOL)


def test_unknown_variant_raises():
    z = torch.zeros(1, 2)
    with pytest.raises(ValueError):
        gspo.gspo_loss(z, z, torch.zeros(1), torch.ones(1, 2), variant="tokens")


# --- GSPO-token == GSPO when every token of a sequence has the sequence's advantage ---


@LIGHT
@given(batches(), st.sampled_from([(EPS_LOW, EPS_HIGH), (0.2, 0.27)]), st.data())
def test_token_variant_with_per_token_advantages(b, eps, data):
    """GSPO-token with A_it: d loss / d logp_it = -A_it s_i / (|y_i| B) unless that token is clipped."""
    s = loop_seq_ratio(b["logp"], b["old"], b["mask"])
    assume(_away_from_clip_edges(s, *eps))
    A = [[data.draw(st.floats(-2, 2, allow_nan=False)) for _ in range(b["T"])] for _ in range(b["B"])]
    loss, g, _ = _loss_and_grad(b["logp"], b["old"], t64(A), b["mask"], "token", eps_low=eps[0], eps_high=eps[1])
    B = b["B"]
    exp_loss, exp_grad = 0.0, []
    for i in range(B):
        n = sum(b["mask"][i])
        row = []
        for t in range(b["T"]):
            if not b["mask"][i][t]:
                row.append(0.0)
                continue
            a = A[i][t]
            exp_loss += clipped_objective(a, s[i], *eps) / (n * B)
            row.append(0.0 if is_clipped(a, s[i], *eps) else -a * s[i] / (n * B))
        exp_grad.append(row)
    assert loss.item() == pytest.approx(exp_loss, abs=LOSS_TOL)
    torch.testing.assert_close(g, t64(exp_grad), rtol=0, atol=GRAD_TOL)


@pytest.mark.parametrize("mean_log_ratio", [12.0, 50.0])
def test_token_variant_equals_sequence_variant_beyond_the_log_ratio_clamp(mean_log_ratio):
    """With A_it = A_i GSPO-token equals GSPO past the log-ratio clamp too (A < 0: the unclipped branch)."""
    old = torch.zeros(2, 3, dtype=torch.float64)
    mask = t64([[1, 1, 1], [1, 1, 0]])
    logp = t64([[mean_log_ratio] * 3, [0.0, 0.0, 0.0]])
    adv = t64([-1.0, 0.5])
    l_seq, g_seq, _ = _loss_and_grad(logp.tolist(), old.tolist(), adv, mask.tolist(), "sequence")
    l_tok, g_tok, _ = _loss_and_grad(logp.tolist(), old.tolist(), adv, mask.tolist(), "token")
    # beyond the clamp s = e^10 (|A| <= 1): the two formulas, each within gamma_22 + 12 of it
    torch.testing.assert_close(l_tok, l_seq, rtol=2 * gamma_n(34), atol=0)
    torch.testing.assert_close(g_tok, g_seq, rtol=0, atol=2 * gamma_n(34) * math.exp(10))


# --- Numerics (and tests/test_losses.py, each script's loss) ---


def test_ratio_statistics_leave_empty_rows_out():
    """A row with no token in the loss's mask (--mask-truncated's rows) has no sequence ratio: its exp(0) = 1
    used to pull ratio_mean toward 1 and ratio_std down. Hand-worked: rows 0 and 2 real, row 1 empty."""
    mask = t64([[1, 1], [0, 0], [1, 0]])
    lr = [0.002, 0.5, -0.004]  # row 1's log-ratio is masked out entirely
    logp, old = t64([[x, x] for x in lr]), torch.zeros(3, 2, dtype=torch.float64)
    _, stats = gspo.gspo_loss(
        logp, old, t64([1.0, 1.0, -1.0]), mask, eps_low=EPS_LOW, eps_high=EPS_HIGH, variant="sequence"
    )
    real = [math.exp(0.002), math.exp(-0.004)]
    mean = sum(real) / 2
    # a mean of 2 exact values (1 rounding), exp (2): gamma_4 relative
    assert stats["ratio_mean"] == pytest.approx(mean, rel=gamma_n(4))
    assert stats["ratio_std"] == pytest.approx(math.sqrt(sum((r - mean) ** 2 for r in real) / 2), rel=1e-9)
    assert stats["ratio_max_dev"] == pytest.approx(1 - math.exp(-0.004), rel=1e-9)
    _, none_real = gspo.gspo_loss(
        logp, old, t64([1.0, 1.0, -1.0]), mask * 0, eps_low=EPS_LOW, eps_high=EPS_HIGH, variant="sequence"
    )
    assert none_real["ratio_mean"] == 1.0 and none_real["ratio_std"] == 0.0  # no row: no movement to report
