"""Shared helpers: float64 plain-loop references from the papers' equations, tolerances, strategies, SCRIPTS."""

from __future__ import annotations

import copy
import math
import os
import sys
from dataclasses import dataclass, replace  # noqa: F401 (replace: a fork's TRAITS line, docs/forks.md)
from pathlib import Path

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # conftest.py does this too; the helpers must not depend on it
    sys.path.insert(0, str(ROOT))

# The scripts that the shared tests (reliability, arguments, layout, smoke, traces, fork traps) run, by file
# stem: a fork (rloo.py beside gspo.py, say) is covered by them once its name is added here, with its line in
# TRAITS below (docs/forks.md; tests/README.md).
SCRIPTS = ("ppo", "grpo", "gspo")


@dataclass(frozen=True)
class Traits:
    """What the shared tests must know of a script and cannot ask its code, declared once here (docs/forks.md, "The
    contract"). A shared test that does not apply to a script by these skips it, saying why."""

    grouped: bool  # its advantage compares a prompt's --group-size completions (a constant group gets 0), not PPO's
    skips_zero_advantage: bool  # its updates leave out rows whose advantage is 0 (unless a flag gives them a gradient)
    test_flags: tuple = ()  # flags its shared tests add (PPO: --kl-coef 0, so a constant reward is no signal at all)
    entropy_bonus: str = "sequence-mean"  # how --entropy-coef's bonus averages at the defaults: or "token-mean"
    # where its clip acts: "update" (PPO-style, max(-A r, -A clip(r)): a token is clipped, its gradient 0, where A > 0
    # and r > 1 + high or A < 0 and r < 1 - low), "weight" (a detached weight clip(r, 1 - low, 1 + high) times the
    # REINFORCE term, CISPO's: clipped where r is outside the band, whatever A), or None (no clip)
    clip: str | None = "update"
    clip_flags: tuple = ("eps_low", "eps_high")  # the Args fields of (low, high); None for a side that has no flag
    clip_metric: str | None = "clip_frac"  # the logged share its clip acted on, in [0, 1] (gspo: of sequences)
    clip_unit: str = "token"  # what clip_metric is a share of: every minibatch's "token"s, or "sequence"s (gspo's)


TRAITS = {
    "ppo": Traits(grouped=False, skips_zero_advantage=False, test_flags=("--kl-coef", "0"), entropy_bonus="token-mean"),
    "grpo": Traits(grouped=True, skips_zero_advantage=True),
    "gspo": Traits(grouped=True, skips_zero_advantage=True, clip_metric="clip_frac_seqs", clip_unit="sequence"),
}


def clip_bounds(name: str, args) -> tuple[float | None, float | None]:
    """(low, high) of script `name`'s clip band [1 - low, 1 + high] as `args` sets it (TRAITS' clip_flags; None for a
    side without a flag: no bound there)."""
    return tuple(None if f is None else float(getattr(args, f)) for f in traits(name).clip_flags)


def clip_rule(name: str, args, adv: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """Where script `name`'s clip acts on tokens with advantages `adv` and ratios `ratio` (TRAITS' clip)."""
    low, high = clip_bounds(name, args)
    below = ratio < 1 - low if low is not None else torch.zeros_like(ratio, dtype=torch.bool)
    above = ratio > 1 + high if high is not None else torch.zeros_like(ratio, dtype=torch.bool)
    kind = traits(name).clip
    if kind == "update":
        return ((adv > 0) & above) | ((adv < 0) & below)
    assert kind == "weight", f"{name}: TRAITS' clip is {kind!r}, which a clip rule does not apply to"
    return (above | below) & (adv != 0)  # (a token with A = 0 has no term for the weight to cut)


# What a copy of the project leaves out (tests/test_forks.py's project_with_fork; any tree copy in tests/): git's own,
# the outputs of runs and tools, and the environment the README creates (.venv, ignored by .gitignore too)
TREE_IGNORE = (".git", ".venv", "venv", "runs", "__pycache__", ".hypothesis", ".ruff_cache", ".pytest_cache")


def traits(name: str) -> Traits:
    """TRAITS[name]; a script in SCRIPTS without a line there fails the test that asks, naming what to add."""
    assert name in TRAITS, f"{name} is in tests/helpers.py's SCRIPTS but not in TRAITS: copy its parent's line there"
    return TRAITS[name]


# Light hypothesis profile: no deadline (the machine is shared), a modest number of examples.
LIGHT = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

F64 = torch.float64


def t64(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


# --- Hypothesis strategies ---


@st.composite
def batches(
    draw, max_b=4, max_t=6, min_len=1, min_b=1, log_ratio_scales=(1e-4, 1e-3, 0.05, 0.5, 2.0), allow_zero_adv=True
):
    """A small batch as Python lists: mask [B][T] (0/1, any pattern, >= min_len real tokens per
    row), old [B][T], logp [B][T] = old + d with |d| <= scale (scale drawn so both in- and
    out-of-clip-range ratios occur), adv [B] (nonzero unless allow_zero_adv)."""
    B = draw(st.integers(min_b, max_b))
    T = draw(st.integers(max(1, min_len), max_t))
    row = st.lists(st.integers(0, 1), min_size=T, max_size=T).filter(lambda r: sum(r) >= min_len)
    mask = [draw(row) for _ in range(B)]
    scale = draw(st.sampled_from(log_ratio_scales))
    val = st.floats(-6.0, 0.0, allow_nan=False)
    dif = st.floats(-scale, scale, allow_nan=False)
    old = [[draw(val) for _ in range(T)] for _ in range(B)]
    logp = [[o + draw(dif) for o in r] for r in old]
    a = st.floats(-2.0, 2.0, allow_nan=False)
    if not allow_zero_adv:
        a = a.filter(lambda x: abs(x) > 1e-3)
    adv = [draw(a) for _ in range(B)]
    return dict(B=B, T=T, mask=mask, old=old, logp=logp, adv=adv)


# --- Plain-loop references (float64) ---


def loop_seq_ratio(logp, old, mask):
    """s_i = exp(sum_t m (logp - old) / sum_t m) per row (1 for an empty row)."""
    out = []
    for lr, orow, mrow in zip(logp, old, mask):
        n = sum(mrow)
        tot = sum(l - o for l, o, m in zip(lr, orow, mrow) if m)
        out.append(math.exp(tot / n) if n else 1.0)
    return out


def loop_geo_mean_ratio(logp, old, mask):
    """(prod_t r_t) ** (1/|y|) with r_t = exp(logp_t - old_t): the geometric mean of token ratios."""
    out = []
    for lr, orow, mrow in zip(logp, old, mask):
        rs = [math.exp(l - o) for l, o, m in zip(lr, orow, mrow) if m]
        out.append(math.prod(rs) ** (1.0 / len(rs)) if rs else 1.0)
    return out


def is_clipped(a, r, eps_low, eps_high):
    """The clipped branch of max(-A r, -A clip(r)) is active (and the gradient zero)."""
    return (a > 0 and r > 1 + eps_high) or (a < 0 and r < 1 - eps_low)


def clipped_objective(a, r, eps_low, eps_high):
    """max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) for Python floats."""
    c = min(max(r, 1 - eps_low), 1 + eps_high)
    return max(-a * r, -a * c)


def loop_group_advantages(rewards, group_size, scale="std", eps=1e-6):
    """(R - mean) / (Bessel std + eps) per group, exactly 0 for a constant group; float64."""
    out = []
    for g in range(0, len(rewards), group_size):
        grp = [float(x) for x in rewards[g : g + group_size]]
        if all(x == grp[0] for x in grp):
            out += [0.0] * len(grp)
            continue
        mean = sum(grp) / len(grp)
        if scale == "none":
            out += [x - mean for x in grp]
            continue
        std = math.sqrt(sum((x - mean) ** 2 for x in grp) / (len(grp) - 1))
        out += [(x - mean) / (std + eps) for x in grp]
    return out


def loop_grpo(b, eps_low, eps_high, agg, max_len=None, ref=None, kl_coef=0.0, adv=None):
    """GRPO's loss and d loss / d logp from plain loops over a `batches()` draw.
    Per token: max(-A r, -A clip(r)) + kl_coef * k3, r = exp(logp - old), k3 = e^x - x - 1 with
    x = ref - logp; weight w_it = 1 / (B |y_i|) (seq-mean-token-mean), 1 / sum m (token-mean),
    1 / (B * max_len) (seq-mean-token-sum-norm). `adv` may be [B] (default b["adv"]) or [B][T]."""
    B, T = b["B"], b["T"]
    adv = b["adv"] if adv is None else adv
    n_tok = sum(sum(r) for r in b["mask"])
    loss, grad = 0.0, []
    for i in range(B):
        n = sum(b["mask"][i])
        row = []
        for t in range(T):
            if not b["mask"][i][t]:
                row.append(0.0)
                continue
            a = adv[i][t] if isinstance(adv[i], (list, tuple)) else adv[i]
            r = math.exp(b["logp"][i][t] - b["old"][i][t])
            l = clipped_objective(a, r, eps_low, eps_high)
            g = 0.0 if is_clipped(a, r, eps_low, eps_high) else -a * r
            if ref is not None:
                x = ref[i][t] - b["logp"][i][t]
                l += kl_coef * (math.expm1(x) - x)
                g += kl_coef * (1.0 - math.exp(x))
            if agg == "seq-mean-token-mean":
                w = 1.0 / (B * n)
            elif agg == "token-mean":
                w = 1.0 / n_tok
            else:
                w = 1.0 / (B * (max_len or T))
            loss += w * l
            row.append(w * g)
        grad.append(row)
    return loss, grad


def float32_round(xs):
    """The float32 value of each Python float (the code casts rewards to float32)."""
    return torch.tensor(xs, dtype=torch.float32).double().tolist()


def group_mean_std(adv, group_size):
    """Per group: (mean, Bessel std) of the advantages, in float64."""
    out = []
    for g in range(0, len(adv), group_size):
        grp = adv[g : g + group_size]
        mean = sum(grp) / len(grp)
        std = math.sqrt(sum((x - mean) ** 2 for x in grp) / (len(grp) - 1))
        out.append((mean, std))
    return out


def import_file(path: Path):
    """The Python file `path` imported as a module named by its stem (a generated fork of a script), kept in
    sys.modules, where dataclasses look their module up by name."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def in_process(main, argv, capsys) -> tuple:
    """A command line's `main(argv)` (a script's or a tool's) in this process: (exit status, stdout, stderr)."""
    try:
        main([str(a) for a in argv])
        status = 0
    except SystemExit as e:
        status = e.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def main_in_process(module, argv, capsys) -> tuple:
    """common.main of a script module in this process: (exit status, stdout, stderr)."""
    import common

    return in_process(lambda a: common.main(module.train, module.Args, argv=a), argv, capsys)


def recorded_rows(monkeypatch) -> list[dict]:
    """A list that each metrics row a run writes is appended to, as its script made it (metrics.jsonl rounds)."""
    import common

    rows, log = [], common.RunLogger.log
    monkeypatch.setattr(common.RunLogger, "log", lambda self, row: rows.append(dict(row)) or log(self, row))
    return rows


def greedy_generate(model, prompts, T, eos, pad) -> list[list[int]]:
    """Hugging Face's generate, greedy, on the left-padded batch of `prompts` (on the model's device): each
    completion up to and including its first EOS id (the reference for common.sample's greedy completion_lists)."""
    import common

    batch = common.Rollout.from_lists(prompts, [[]] * len(prompts), pad, device=model.device)
    with torch.no_grad():
        out = model.generate(input_ids=batch.prompt_ids, attention_mask=batch.prompt_mask, max_new_tokens=T,
                             do_sample=False, eos_token_id=eos, pad_token_id=pad)  # fmt: skip
    rows = out[:, batch.prompt_ids.shape[1] :].tolist()
    return [r[: next((i + 1 for i, t in enumerate(r) if t in eos), len(r))] for r in rows]


# --- Subprocess smoke runs ---

SMOKE_ARGS = ["--steps", "2", "--prompts-per-step", "4", "--group-size", "4", "--minibatches", "2", "--eval-size", "16",
              "--eval-every", "1"]  # fmt: skip
# metrics.jsonl and summary.json round floats to 6 decimals (common.rounded): a summary's mean of the steps,
# rounded, against the mean of the rounded steps differs by at most two half-units of the 6th decimal (and a few
# float64 roundings)
LOGGED_TOL = 2 * 0.5e-6 + 1e-15

# ----------------------------------------------------------------------------------------------
# Tolerances from arithmetic (issue 42): each float comparison's bound follows from the dtype's unit
# roundoff and the size of the operation, so that it holds on any CPU's kernels, not on one.
# ----------------------------------------------------------------------------------------------


def unit_roundoff(dtype) -> float:
    """u = eps / 2: the largest relative error of one correctly rounded operation in `dtype`
    (2^-24 for float32, 2^-53 for float64, 2^-8 for bfloat16)."""
    return torch.finfo(dtype).eps / 2


def gamma(n, dtype=F64) -> float:
    """Higham's gamma_n = n u / (1 - n u): a sum or dot product of n terms, in any order, errs by at most
    gamma_n * sum |terms| (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., section 3.1).
    A library exp or log (glibc's, Sleef's u10 kernels) is within 1 ulp = 2u: count it as 2."""
    u = unit_roundoff(dtype)
    assert n * u < 1, (n, dtype)
    return n * u / (1 - n * u)


LAMBDA = 6.0  # probabilistic bounds below fail with probability <= 2 n exp(-LAMBDA^2 / 2) ~ 3e-8 n


def probable_gamma(n, dtype=torch.float32) -> float:
    """Higham and Mary's probabilistic gamma (SIAM J. Sci. Comput. 41(5), 2019, Theorem 2.4): with
    rounding errors independent and of mean zero, a sum of n terms errs by at most
    LAMBDA * sqrt(n) * u * sum |terms|, except with probability 2 n exp(-LAMBDA^2 / 2). The worst-case
    gamma_n is sqrt(n) / LAMBDA times larger and never attained by a network's thousands of sums."""
    return math.expm1(LAMBDA * math.sqrt(n) * unit_roundoff(dtype))


def sum_gamma(n, dtype=torch.float32) -> float:
    """The smaller of gamma_n and probable_gamma(n): the bound for one sum of n terms (the worst case for
    short sums, the probabilistic one where it is smaller, from n = 37 terms on)."""
    return min(gamma(n, dtype), probable_gamma(n, dtype))


def forward_roundings(config, length) -> int:
    """n for one logit of a forward through a Qwen decoder over `length` positions: the roundings on its
    longest chain of sums. Per layer: an RMSNorm (H squares), a q/k/v projection (H), a score (head_dim),
    the softmax's sum and the weighted sum of values (length each), the output projection
    (heads * head_dim), a second RMSNorm (H), gate/up (H) and down (intermediate); then the final RMSNorm
    (H) and the LM head (H). The residual stream adds the layers' errors (1 rounding per layer)."""
    H, I, heads = config.hidden_size, config.intermediate_size, config.num_attention_heads
    hd = getattr(config, "head_dim", None) or H // heads  # Qwen2's config has no head_dim
    per_layer = H + H + hd + 2 * length + heads * hd + H + H + I + 1
    return config.num_hidden_layers * per_layer + 2 * H


def logit_tol(config, length, max_abs_logit, dtype=torch.float32) -> float:
    """|z - z'| for two forwards of one model on one input that sum in different orders (KV cache or not,
    padded or not, batched or not, chunked or not, another CPU's kernels): each logit is within
    probable_gamma(n) * max|z| of the exact one (the first-order model: the sums' sizes are those of the
    logit scale the network keeps, RMSNorm resetting it every layer), so two are within twice that."""
    return 2 * probable_gamma(forward_roundings(config, length), dtype) * max_abs_logit


def logprob_tol(config, length, max_abs_logit, dtype=torch.float32) -> float:
    """|log p - log p'| from logits within logit_tol: log_softmax(z)_y = z_y - logsumexp(z) moves by at
    most |dz_y| + max|dz| = 2 max|dz|; the float32 log_softmax itself adds gamma(V) relative to max|z|,
    below the forward's share."""
    return 2 * logit_tol(config, length, max_abs_logit, dtype)


def entropy_tol(config, length, max_abs_logit, dtype=torch.float32) -> float:
    """|H - H'| from logits within logit_tol: dH/dz_j = -p_j (log p_j + H) and log p_j + H = z_j - E_p[z],
    at most 2 max|z| in size, so H moves by at most 2 max|z| * max|dz|."""
    return 2 * max_abs_logit * logit_tol(config, length, max_abs_logit, dtype)


def logit_scale(model, roll, temperature=1.0):
    """(sequence length, max |z|) of a rollout's logits / temperature, from one full forward: the sizes
    that logit_tol, logprob_tol and entropy_tol take."""
    ids = torch.cat([roll.prompt_ids, roll.completion_ids], 1)
    attn = torch.cat([roll.prompt_mask, roll.completion_mask.long()], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(1) - 1).clamp(min=0)).logits
    return ids.shape[1], (logits.abs().max() / temperature).item()


def logp_entropy_f64(hidden, weight, targets, temperature):
    """(log p of `targets`, entropy) of softmax(hidden @ weight.T / temperature) in float64, unchunked: the
    reference for logprobs_from_hidden (autograd flows through it when hidden or weight require it)."""
    logits = (hidden.double() @ weight.double().T) / temperature
    logp_all = torch.log_softmax(logits, -1)
    return logp_all.gather(-1, targets[..., None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


def log_softmax_bounds(hidden, weight, targets, temperature, coef=None, dtype=torch.float32):
    """Elementwise first-order error bounds of logprobs_from_hidden's computation in `dtype` against exact
    arithmetic, from Higham's gamma and the operands' sizes (computed here in float64):
    logits z = h W^T / tau: each errs by dz = gamma_{H+1} max_j sum_k |h_k W_jk| / tau;
    logsumexp: m = max z, then V exponentials of z - m (the subtraction u 2 max|z|, each exp 2u) summed (positive
    terms: relative sum_gamma(V)), a log (2u log V) and m added (u max|z|): within
    sum_gamma(V) + gamma_6 (1 + 2 max|z| + log V); log p = z_y - logsumexp: 2 dz + that + u |log p| = t;
    entropy log Z - sum_j p_j z_j, p = softmax(z) to relative expm1(t + 2u): 2 dz + the logsumexp's share
    + expm1(t + 2u) max|z| + sum_gamma(V + 1) max|z|;
    the gradient of sum_r c_r log p_r (with `coef` c [rows]): dL/dz_rj = c_r (1[j = y_r] - p_rj) / tau, each
    to relative gamma_4 + expm1(t + 2u), summed over V (d/dh) or over the rows (d/dW): with
    A = |c| (onehot + p) / tau, bounds (sum_gamma(V) + gamma_4 + expm1(t + 2u)) A |W| and the same with N rows
    for A^T |h|.
    Returns a dict of float64 tensors: logp and entropy [rows], grad_hidden [rows, H], grad_weight [V, H]."""
    h = hidden.detach().reshape(-1, hidden.shape[-1]).double()
    w, y = weight.detach().double(), targets.reshape(-1)
    N, H = h.shape
    V = w.shape[0]
    u = unit_roundoff(dtype)
    z = h @ w.T / temperature  # [N, V]
    max_z = z.abs().max(-1).values
    dz = gamma(H + 1, dtype) * (h.abs() @ w.abs().T).max(-1).values / temperature
    own_lse = sum_gamma(V, dtype) + gamma(6, dtype) * (1 + 2 * max_z + math.log(V))
    logp_all = torch.log_softmax(z, -1)
    t = 2 * dz + own_lse + u * logp_all.gather(-1, y[:, None]).squeeze(-1).abs()
    p_rel = torch.expm1(t + 2 * u)
    out = dict(
        logp=t.view(targets.shape),
        entropy=(2 * dz + own_lse + p_rel * max_z + sum_gamma(V + 1, dtype) * max_z).view(targets.shape),
    )
    if coef is not None:
        c = coef.detach().reshape(-1).double().abs()
        A = c[:, None] * (torch.nn.functional.one_hot(y, V).double() + logp_all.exp()) / temperature  # [N, V]
        each = gamma(4, dtype) + p_rel  # [N]: one term's relative error
        out["grad_hidden"] = ((sum_gamma(V, dtype) + each[:, None]) * (A @ w.abs())).view(hidden.shape)
        out["grad_weight"] = (sum_gamma(N, dtype) + each.max()) * (A.T @ h.abs())
    return out


def assert_within(actual, expected, bound, what=""):
    """|actual - expected| <= bound elementwise (bound a float or a tensor); on failure, the largest ratio."""
    diff = (torch.as_tensor(actual).double() - torch.as_tensor(expected).double()).abs()
    bound = torch.as_tensor(bound, dtype=torch.float64)
    ratio = (diff / bound.clamp(min=1e-300)).max().item() if diff.numel() else 0.0
    assert (diff <= bound).all(), f"{what}: |diff| reaches {ratio:.3g} x its derived bound (max {diff.max():.3g})"


def group_advantage_tol(group, scale="std", eps=1e-6) -> float:
    """|adv - adv_exact| for a group's float32 advantages (R - mean) / (std + eps) (or R - mean), against
    the float64 loop on the same float32 rewards `group` (G of them, |R| <= big): r - mean errs by the
    mean's G + 1 roundings of size <= big and the subtraction's of size <= 2 big (3 gamma_{G+1} big); the
    std by sqrt(G / (G - 1)) <= sqrt(2) times that and its own G + 3 roundings; the quotient, with
    |adv| <= sqrt(G), by (d dev + sqrt(G) d std) / (std + eps) and one more rounding."""
    G, big = len(group), max(abs(x) for x in group)
    dev_err = 3 * gamma(G + 1, torch.float32) * big
    if scale != "std":
        return dev_err
    std = torch.tensor(group, dtype=F64).std().item()
    std_err = math.sqrt(2) * dev_err + gamma(G + 3, torch.float32) * std
    return (dev_err + math.sqrt(G) * std_err) / (std + eps) + unit_roundoff(torch.float32) * math.sqrt(G)


# --- CI (issue 48): what may skip locally must fail there ---


def in_ci() -> bool:
    """The CI variable is set (GitHub Actions and .ci/run set CI=true): a test that would skip for want of a
    tool (torchrun, a browser) fails instead, and hypothesis draws CI's fixed examples (tests/conftest.py)."""
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def _has_torchrun() -> bool:
    import importlib.util

    return torch.distributed.is_available() and importlib.util.find_spec("torch.distributed.run") is not None


def torchrun_cmd() -> list[str]:
    """The torchrun of the Python running the tests, `python -m torch.distributed.run` (what the `torchrun`
    beside sys.executable runs), not a `torchrun` on PATH, which may belong to another environment or be
    missing from an unactivated one. Fails the test where this torch has none (needs_torchrun skipped it
    already, except under CI)."""
    import pytest

    if not _has_torchrun():
        pytest.fail("this torch has no torch.distributed.run (torchrun), and CI must run the torchrun tests")
    return [sys.executable, "-m", "torch.distributed.run"]


def free_port() -> int:
    """A TCP port free on this machine now, for torchrun's --master_port."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def needs_torchrun(test):
    """Skip a test that launches torchrun where this torch has none; under CI (in_ci()) it runs, and fails in
    torchrun_cmd(): a CI whose torchrun tests all skipped would pass without testing data parallelism."""
    import pytest

    return pytest.mark.skipif(not _has_torchrun() and not in_ci(), reason="this torch has no torchrun")(test)


def row_key(roll, i: int) -> tuple:
    """Row i of a Rollout as (prompt tokens, completion tokens) without padding: the same key wherever the row
    moves (picked out, concatenated, carried to a later step)."""
    prompt = roll.prompt_ids[i][roll.prompt_mask[i].bool()].tolist()
    completion = roll.completion_ids[i][roll.completion_mask[i].bool()].tolist()
    return tuple(prompt), tuple(completion)


class SamplingWeights:
    """The weights that sampled each row, recorded while a script runs in this process: `common.Sampler.sample`
    is wrapped (monkeypatch) to copy the sampler's weights at each call and note each row it returns, so that a
    test computes pi_old as it must be, the log-probs of the weights that sampled a row, whatever the loop's
    shape (a fork may train a batch sampled steps ago). `expected(roll, temperature)`: per row of `roll`, the
    log-probs [T] under each copy that sampled a row with its tokens (one, unless a step sampled it again)."""

    def __init__(self, monkeypatch):
        import common

        self.copies, self.sampled_by, self.model = [], {}, None
        sample = common.Sampler.sample

        def recording_sample(sampler, prompts, generator):
            if self.model is None:  # a scratch model that each copy is loaded into
                self.model = copy.deepcopy(sampler.model)
            weights = {k: v.detach().clone() for k, v in sampler.model.state_dict().items()}
            roll = sample(sampler, prompts, generator)
            self.copies.append(weights)
            for i in range(len(roll)):
                self.sampled_by.setdefault(row_key(roll, i), set()).add(len(self.copies) - 1)
            return roll

        monkeypatch.setattr(common.Sampler, "sample", recording_sample)

    def expected(self, roll, temperature: float) -> tuple[list[list[torch.Tensor]], float]:
        """(per row of `roll` the log-probs [T] of each copy that sampled it, logprob_tol of a forward of
        these rows), all without gradient; a row that no sampling returned fails here."""
        import common

        keys = [row_key(roll, i) for i in range(len(roll))]
        missing = [i for i, k in enumerate(keys) if k not in self.sampled_by]
        assert not missing, f"rows {missing} of an update were never returned by Sampler.sample"
        out, tol = [[] for _ in keys], 0.0
        for c in sorted(set().union(*(self.sampled_by[k] for k in keys))):
            rows = [i for i, k in enumerate(keys) if c in self.sampled_by[k]]
            self.model.load_state_dict(self.copies[c])
            with torch.no_grad():
                logp = common.completion_logprobs(self.model, roll[rows], temperature)[0]
            tol = max(tol, logprob_tol(self.model.config, *logit_scale(self.model, roll[rows], temperature)))
            for j, i in enumerate(rows):
                out[i].append(logp[j])
        return out, tol
