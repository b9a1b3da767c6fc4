"""bf16 rollouts: mu against independent recomputations, log(pi_old / mu) = log(kept mass) under top-p, the
correction's weights by hand, no change without mismatch, --old-logp rollout's ratio 1, --resume under bf16."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from helpers import F64, SCRIPTS, assert_within, gamma, logit_scale, logit_tol, logprob_tol, traits, unit_roundoff
from test_fork_traps import TINY_RUN, final_weights, run_main

import common
import grpo
import gspo
import ppo
from extras import rollout_precision


@pytest.fixture(scope="module")
def tiny():
    return common.load_model("tiny", torch.device("cpu"))


def args_for(**kw):
    return gspo.Args(**kw)


def arith_prompts(tok, n=6, copies=4):
    examples = common.arith_split()[0][:n]
    return [ids for ids in common.encode_prompts(tok, examples, "") for _ in range(copies)]


def draw(model, tok, prompts, temperature=1.0, top_p=1.0, seed=0, record=True):
    eos = common.eos_token_ids(model, tok)
    g = torch.Generator().manual_seed(seed)
    return common.sample(model, prompts, 8, eos, tok.pad_token_id, temperature, top_p, generator=g, record_logp=record)


def test_recording_mu_changes_no_sample(tiny):
    model, tok = tiny
    prompts = arith_prompts(tok)
    a, b = draw(model, tok, prompts, 0.8, 0.9, record=False), draw(model, tok, prompts, 0.8, 0.9, record=True)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.completion_mask, b.completion_mask)
    assert a.sample_logp is None and b.sample_logp is not None


def test_the_default_sampler_is_the_policy_itself(tiny):
    model, tok = tiny
    sampler = common.Sampler(model, tok, args_for())
    assert sampler.copy is None and not sampler.records


@pytest.mark.numeric
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_float32_mu_equals_pi_old(tiny, temperature):
    """At --rollout-dtype float32 the sampler's mu is the trainer's pi_old up to the sampler's own
    arithmetic (KV cache, fused projections), not exactly: two float32 forwards (helpers.logprob_tol)."""
    model, tok = tiny
    roll = draw(model, tok, arith_prompts(tok), temperature)
    with torch.no_grad():
        old = common.completion_logprobs(model, roll, temperature)[0] * roll.completion_mask
    length, max_z = logit_scale(model, roll, temperature)
    assert_within(roll.sample_logp, old, logprob_tol(model.config, length, max_z), "mu vs pi_old")
    torch.testing.assert_close(roll.sample_logp_full, roll.sample_logp, atol=0, rtol=0)  # top_p = 1


def kept_mass_f64(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """[V] -> scalar: the probability of the nucleus, from float64 probabilities sorted by hand:
    keep tokens while the mass before them is below top_p."""
    probs = torch.softmax(logits.double(), -1).sort(descending=True).values.tolist()
    total, kept = 0.0, 0.0
    for p in probs:
        if total >= top_p:
            break
        kept += p
        total += p
    return torch.tensor(kept, dtype=torch.float64)


@pytest.mark.numeric
def test_top_p_log_ratio_is_the_log_of_the_kept_mass(tiny):
    """TRL #6789: at --top-p 0.8, log(pi_old / mu) = log(kept mass) on every token (helpers.logprob_tol)."""
    model, tok = tiny
    top_p = 0.8
    roll = draw(model, tok, arith_prompts(tok, 4, 2), top_p=top_p)
    m = roll.completion_mask.bool()
    with torch.no_grad():
        old = common.completion_logprobs(model, roll, 1.0)[0]
        ids = torch.cat([roll.prompt_ids, roll.completion_ids], 1)
        attn = torch.cat([roll.prompt_mask, roll.completion_mask.long()], 1)
        logits = model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(1) - 1).clamp(min=0)).logits
    P = roll.prompt_ids.shape[1]
    # old - mu: two float32 forwards (the trainer's, the sampler's), within logprob_tol; log(kept mass) from a
    # third forward's logits moves by at most 2 max|dz|, half of that again: logit_tol
    lp_tol = logprob_tol(model.config, ids.shape[1], logits.abs().max().item())
    mass_tol = lp_tol + logit_tol(model.config, ids.shape[1], logits.abs().max().item())
    checked = 0
    for i in range(len(roll)):
        for t in range(int(m[i].sum())):
            mass = kept_mass_f64(logits[i, P - 1 + t], top_p)
            assert_within(old[i, t] - roll.sample_logp[i, t], math.log(mass), mass_tol, f"{i, t}")
            assert_within(old[i, t], roll.sample_logp_full[i, t], lp_tol, f"{i, t}")  # the ratio's pi_old: untruncated
            checked += 1
    assert checked > 10 and (old - roll.sample_logp)[m].abs().max() > 1e-3  # the nucleus did cut somewhere


@pytest.mark.numeric
def test_bf16_mu_equals_a_float64_recomputation_of_the_bf16_sampler(tiny):
    """mu against a plain bf16 forward taken to float64, and not float32's pi_old.

    Bound from bf16's u = 2^-8: each computation rounds every logit (<= u |z|), a log-prob moves by twice the
    largest logit error, doubled for the layers before: 8u max|z| per token; in RMS the errors spread (u|z| / sqrt(3)
    each): 2u RMS. Measured on a 2-core Xeon: 3.6u max|z|, 0.63u RMS."""
    model, tok = tiny
    sampler = common.Sampler(model, tok, args_for(rollout_dtype="bfloat16"))  # 8 new tokens, temperature 1, top-p 1
    assert sampler.records and sampler.copy is not None
    g = torch.Generator().manual_seed(0)
    roll = sampler.sample(arith_prompts(tok), g)
    m = roll.completion_mask.bool()
    ref = torch.zeros_like(roll.sample_logp, dtype=torch.float64)
    largest = torch.zeros_like(ref)
    with torch.no_grad():
        for i in range(len(roll)):
            p = roll.prompt_ids[i][roll.prompt_mask[i].bool()]
            n = int(m[i].sum())
            ids = torch.cat([p, roll.completion_ids[i, :n]])[None]
            logits = bf16_twin(model)(input_ids=ids).logits[0, len(p) - 1 : len(p) - 1 + n].double()
            ref[i, :n] = torch.log_softmax(logits, -1).gather(-1, roll.completion_ids[i, :n, None]).squeeze(-1)
            largest[i, :n] = logits.abs().max(-1).values  # max_j |z_j| at each position
        old = common.completion_logprobs(model, roll, 1.0)[0]
    diff = (roll.sample_logp.double() - ref)[m]  # (ref: through bf16_twin, the copy as it sampled)
    u = 2.0**-8  # bf16's unit roundoff (8 significant bits)
    assert (diff.abs() <= 8 * u * largest[m]).all(), (diff.abs() / (u * largest[m])).max()
    assert diff.pow(2).mean().sqrt() <= 2 * u * largest[m].pow(2).mean().sqrt()
    assert (roll.sample_logp - old)[m].abs().max() > 1e-3  # bf16 is not float32


def bf16_twin(model):
    """The policy with its parameters cast to bf16 and its buffers kept (what Sampler samples from)."""
    twin = copy.deepcopy(model)
    for p in twin.parameters():
        p.data = p.data.to(torch.bfloat16)
    return twin


def test_the_bf16_copy_follows_the_policy_and_is_freed_after_sampling(tiny, monkeypatch):
    model, tok = tiny
    model = copy.deepcopy(model)
    sampler = common.Sampler(model, tok, args_for(rollout_dtype="bfloat16", max_new_tokens=2))
    seen = {}
    real_sample = common.sample

    def spy(m, *a, **kw):  # the parameters the sampler runs with, as it runs
        seen["params"] = [p.detach().clone() for p in m.parameters()]
        seen["buffers"] = {n: b.dtype for n, b in m.named_buffers()}
        return real_sample(m, *a, **kw)

    monkeypatch.setattr(common, "sample", spy)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # an update: the next rollout must see it
    sampler.sample(arith_prompts(tok, 1, 1), None)
    for a, b in zip(seen["params"], model.parameters()):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b.detach().to(torch.bfloat16))
    rope = [dtype for name, dtype in seen["buffers"].items() if "inv_freq" in name]
    assert rope and all(d == torch.float32 for d in rope)  # buffers stay float32
    assert all(p.numel() == 0 for p in sampler.copy.module.parameters())  # freed between rollouts


# --- the correction's weights, hand-worked ---


# The error of hand_case's float32 log(pi_old / mu): d rounded to float32, old = mu + d and old - mu each round
# once, relative to sizes <= 1.1 (ln 3 the largest |d|, |old| <= 1.1): <= 3.3u, under 4u.
D_ERR = 4 * unit_roundoff(torch.float32)
U32 = unit_roundoff(torch.float32)


def hand_case():
    """Two rows; row 0: log(pi_old / mu) = ln 3, ln 0.6, (pad); row 1: ln 1.5, ln 1.2, ln 1.9."""
    d = torch.tensor([[math.log(3), math.log(0.6), 0.7], [math.log(1.5), math.log(1.2), math.log(1.9)]])
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 1]])
    mu = -torch.rand(2, 3, generator=torch.Generator().manual_seed(0))
    return mu + d, mu, mask


@pytest.mark.numeric
def test_tis_weights_hand_worked():
    old, mu, mask = hand_case()
    w = rollout_precision.is_weights(old, mu, mask, "tis", 2.0)
    expected = torch.tensor([[2.0, 0.6, 1.0], [1.5, 1.2, 1.9]], dtype=F64)  # min(ratio, 2); padding 1
    # exp of d within D_ERR (or of the float32 log 2, within u), exp's own 2u: relative expm1(D_ERR + 2u)
    assert_within(w, expected, math.expm1(D_ERR + 2 * U32) * expected, "tis weights")


@pytest.mark.numeric
def test_sequence_tis_weights_hand_worked():
    """GSPO's per-sequence weight: min(geometric mean of the token ratios, cap)."""
    old, mu, mask = hand_case()
    w = rollout_precision.is_weights(old, mu, mask, "tis", 1.4, per="sequence")
    row0 = min((3 * 0.6) ** 0.5, 1.4)  # 1.342
    row1 = min((1.5 * 1.2 * 1.9) ** (1 / 3), 1.4)  # 1.507 -> 1.4
    expected = torch.tensor([[row0, row0, 1.0], [row1] * 3], dtype=F64)
    # the row's mean of d: D_ERR, its sum and division 3 roundings of sizes <= 1.1 (3.3u), exp 2u: under 10u
    assert_within(w, expected, math.expm1(D_ERR + 6 * U32) * expected, "sequence tis weights")


def test_sequence_mask_hand_worked():
    """TRL's one-sided sequence_mask: drop a sequence whose product of ratios exceeds the cap."""
    old, mu, mask = hand_case()
    w = rollout_precision.is_weights(old, mu, mask, "mask", 2.0)  # row 0: 1.8 <= 2 kept; row 1: 3.42 > 2 dropped
    assert torch.equal(w, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    assert torch.equal(rollout_precision.is_weights(old, mu, mask, "mask", 4.0), torch.ones(2, 3))
    assert rollout_precision.is_weights(old, mu, mask, "none", 2.0) is None


@pytest.mark.numeric
def test_mismatch_stats_hand_worked():
    old, mu, mask = hand_case()
    stats = rollout_precision.mismatch_stats(old, mu, mask)
    d = [math.log(3), math.log(0.6), math.log(1.5), math.log(1.2), math.log(1.9)]
    mean = sum(d) / 5
    # each d is float32's, within D_ERR; the statistics are then float64's (20 roundings of sizes <= 4: gamma_80)
    f64 = gamma(80, F64)
    assert_within(stats["mismatch_log_ratio_mean"], mean, D_ERR + f64, "mean")
    # a (population) std is a seminorm: std(d + e) - std(d) <= std(e) <= max|e|
    assert_within(stats["mismatch_log_ratio_std"], math.sqrt(sum((x - mean) ** 2 for x in d) / 5), D_ERR + f64, "std")
    # k3's terms e^d - d - 1 have slope e^d - 1, at most 2 for d <= ln 3
    assert_within(stats["mismatch_k3"], sum(math.exp(x) - x - 1 for x in d) / 5, 2 * D_ERR + f64, "k3")
    assert stats["mismatch_frac_beyond_ln2"] == 1 / 5  # ln 3 alone is beyond ln 2 in size; 1.0 / 5 rounds alike
    seq = [1.8, 3.42]
    # a row's float64 sum of <= 3 d's errs by 3 D_ERR, exp(sum) <= 3.42 scales it; std: as above
    seq_err = 3.42 * 3 * D_ERR
    assert_within(stats["mismatch_seq_ratio_std"], abs(seq[0] - seq[1]) / 2, seq_err + f64, "sequence ratio std")
    # the float64 mean of a row's d's: within D_ERR; exp(mean) <= 3.42^(1/3) = 1.51 scales it
    geo_err = 1.51 * D_ERR
    assert_within(stats["mismatch_geo_ratio_max_dev"], 3.42 ** (1 / 3) - 1, geo_err + f64, "geo ratio max dev")


# --- no mismatch: the corrections change nothing ---


def losses(case, logp, old, adv, mask, weights):
    if case == "grpo":
        return grpo.grpo_loss(logp, old, adv, mask, weights=weights)[0]
    if case == "gspo":
        return gspo.gspo_loss(logp, old, adv, mask, eps_low=0.05, eps_high=0.05, weights=weights)[0]
    if case == "gspo-token":
        return gspo.gspo_loss(logp, old, adv, mask, eps_low=0.05, eps_high=0.05, variant="token", weights=weights)[0]
    return ppo.ppo_policy_loss(logp, old, adv[:, None].expand_as(logp), mask, weights=weights)[0]


@pytest.mark.parametrize("case", ["grpo", "gspo", "gspo-token", "ppo"])
@pytest.mark.parametrize("mode", ["tis", "mask"])
def test_with_float32_rollouts_the_correction_changes_nothing(tiny, case, mode):
    model, tok = tiny
    roll = draw(model, tok, arith_prompts(tok))
    mask = roll.completion_mask
    with torch.no_grad():
        old = common.completion_logprobs(model, roll, 1.0)[0] * mask
    adv = torch.randn(len(roll), generator=torch.Generator().manual_seed(1))
    per = "sequence" if case == "gspo" else "token"
    weights = rollout_precision.is_weights(old, roll.sample_logp, mask, mode, 2.0, per)
    length, max_z = logit_scale(model, roll)  # pi_old and mu: two float32 forwards, within logprob_tol
    dev = (weights - 1).abs().max().item()
    assert dev <= math.expm1(logprob_tol(model.config, length, max_z) + 2 * unit_roundoff(torch.float32))
    shift = 0.05 * torch.randn(old.shape, generator=torch.Generator().manual_seed(2))
    results = []
    for w in (None, weights):
        logp = (old + shift).clone().requires_grad_(True)  # a policy a little off pi_old
        loss = losses(case, logp, old, adv, mask, w)
        loss.backward()
        results.append((loss.detach(), logp.grad))
    (l0, g0), (l1, g1) = results
    if mode == "mask":
        assert torch.equal(weights, torch.ones_like(weights)) and torch.equal(l0, l1) and torch.equal(g0, g1)
    else:
        # the loss and its gradient are linear in the weights: |l1 - l0| <= dev sum_t |dl/dw_t| and
        # |g1 - g0| <= dev |g1|; each float32 evaluation adds its sums' rounding, gamma_n of the same sizes
        w = weights.clone().requires_grad_(True)
        per_weight = torch.autograd.grad(losses(case, old + shift, old, adv, mask, w), w)[0]  # dl/dw [B, T]
        n = mask.numel()
        loss_tol = (dev + 2 * gamma(n + 4, torch.float32)) * per_weight.abs().sum().item()
        assert_within(l1, l0, loss_tol, "loss")
        assert_within(g1, g0, (dev + 2 * gamma(n + 4, torch.float32)) * g1.abs() + loss_tol / n, "gradient")


@pytest.mark.slow
@pytest.mark.parametrize("name", SCRIPTS)
def test_old_logp_rollout_with_float32_gives_ratio_one_on_the_first_update(tmp_path, capsys, name):
    argv = ["--steps", 1, "--old-logp", "rollout", "--out", tmp_path / "out", *TINY_RUN]
    assert run_main(name, argv, capsys)[0] == 0
    row = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert row.get("ratio_max_dev", 0.0) < 1e-5 and row["log_ratio_std"] < 1e-5  # (grpo's and gspo's max |r - 1|)
    # mismatch_* is measured on the update the script marks on_policy (its forward at the weights that sampled the
    # batch), and not logged where none is: each of these three marks its first; a fork that trains an older batch
    # may mark none (docs/forks.md), and is checked where it logs it
    if name in ("ppo", "grpo", "gspo"):
        assert "mismatch_log_ratio_mean" in row
    if "mismatch_log_ratio_mean" in row:
        assert abs(row["mismatch_log_ratio_mean"]) < 1e-5 and row["mismatch_log_ratio_std"] < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("name", SCRIPTS)
def test_bf16_rollouts_log_the_mismatch_and_the_correction_and_trace_mu(tmp_path, capsys, name):
    argv = ["--steps", 2, "--rollout-dtype", "bfloat16", "--is-correction", "tis", "--out", tmp_path / "out", *TINY_RUN]
    assert run_main(name, argv, capsys)[0] == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        assert 1e-4 < r["mismatch_log_ratio_std"] < 0.2 and r["mismatch_k3"] >= 0
        assert 0.5 < r["is_weight_mean"] < 2 and 0 <= r["is_truncated_frac"] <= 1
        clip = traits(name).clip_metric  # (GSPO's sequence variant: a share of sequences; a fork's own name)
        assert clip is None or 0 <= r[clip] <= 1, (clip, sorted(r))
    # traces.jsonl's `mu` (traced at the last step) is the bf16 sampler's log-prob: near pi_old's, not equal to it
    completions = [c for line in (tmp_path / "out" / "traces.jsonl").read_text().splitlines()
                   for c in json.loads(line)["completions"]]  # fmt: skip
    diffs = [m - o for c in completions if c["old_logp"] for m, o in zip(c["mu"], c["old_logp"])]  # null: no pi_old
    assert diffs and max(abs(d) for d in diffs) < 0.5 and any(abs(d) > 1e-4 for d in diffs)
    assert all(len(c["mu"]) == len(c["ids"]) for c in completions)  # (null without: test_traces' recomputation)


@pytest.mark.slow
def test_resume_is_exact_with_bf16_rollouts(tmp_path, capsys):
    base = ["--rollout-dtype", "bfloat16", "--is-correction", "mask", "--no-anneal-lr", *TINY_RUN]
    assert run_main("gspo", [*base, "--steps", 4, "--out", tmp_path / "straight"], capsys)[0] == 0
    assert run_main("gspo", [*base, "--steps", 2, "--save-every", 2, "--out", tmp_path / "cut"], capsys)[0] == 0
    assert run_main("gspo", ["--resume", tmp_path / "cut", "--steps", 4], capsys)[0] == 0
    a, b = final_weights(tmp_path / "straight"), final_weights(tmp_path / "cut")
    assert all(torch.equal(a[k], b[k]) for k in a)

    def metrics(out: Path):
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        # (the cut run's step 2 was its last: it also holds that step's evaluation)
        return [{k: v for k, v in r.items() if k not in ("step_time_s", "tokens_per_s") and not k.startswith("eval_")}
                for r in rows]  # fmt: skip

    assert metrics(tmp_path / "straight") == metrics(tmp_path / "cut")
