"""Each script's step pools its updates' numbers as one process that counts every token (sequence) of every update
would, not as a mean of the updates' means (TRL #6380), and a stand-in row (an update with no row of signal) enters
none of them: a run of train() against a float64 loop over what each update's loss was handed."""

import importlib
import math

import pytest
import torch
from helpers import SCRIPTS, clip_rule, gamma, main_in_process, recorded_rows, traits

import common

F32, F64 = torch.float32, torch.float64
# 4 prompts x 4 completions: the first two groups each hold one success, the last two none (A = 0 on 8 of 16 rows),
# so that some minibatch of 4 rows has no row with signal and its update forwards a stand-in row
REWARD = "def two_groups(prompts, completions, **kw):\n    return [float(i == 0) for i in range(len(completions))]\n"


def loss_name(module, name) -> str:
    """The script's loss, `<name>_loss` or `<name>_policy_loss` (docs/forks.md's contract)."""
    return next(f for f in (f"{name}_loss", f"{name}_policy_loss") if hasattr(module, f))


def record_updates(monkeypatch, module, name) -> list[dict]:
    """Every call of the script's loss, in order: its inputs (float64 copies), its loss, and, for a script that
    forwards only rows with signal, the minibatch and whether a real row or a stand-in was forwarded."""
    seen, loss_fn = [], getattr(module, loss_name(module, name))

    def loss(logp, old_logp, advantages, mask, **kw):
        out = loss_fn(logp, old_logp, advantages, mask, **kw)
        seen[-1].update(logp=logp.detach().to(F64), old=old_logp.to(F64), adv=advantages.to(F64),
                        mask=mask.bool(), loss=out[0].item(), kw=kw)  # fmt: skip
        return out

    monkeypatch.setattr(module, loss_name(module, name), loss)
    if traits(name).skips_zero_advantage:
        choose = module.rows_with_signal

        def rows_with_signal(idx, *args):
            rows, real = choose(idx, *args)
            seen.append({"minibatch": len(idx), "real": real})
            return rows, real

        monkeypatch.setattr(module, "rows_with_signal", rows_with_signal)
    else:  # PPO forwards every row of each minibatch
        monkeypatch.setattr(
            module, loss_name(module, name), lambda *a, **kw: seen.append({"real": True}) or loss(*a, **kw)
        )
    return seen


def float64_row(name, updates, minibatch_tokens, args=None) -> dict:
    """The step's update metrics from each update's inputs, by plain loops in float64; a fork's (a script not of the
    three, its `args` given): the shared ones and its clip share by its TRAITS (helpers.clip_rule)."""
    sums = dict.fromkeys(["clipped", "low", "high", "dual", "kl", "seqs", "tokens", "declared"], 0.0)
    fork = name not in ("ppo", "grpo", "gspo")
    ratios, log_ratios = [], []
    for u in updates:
        if not u["real"]:
            continue
        eps_low, eps_high = u["kw"].get("eps_low", 0.2), u["kw"].get("eps_high", 0.2)
        for i in range(len(u["mask"])):
            ts = [t for t in range(u["mask"].shape[1]) if u["mask"][i, t]]
            d = [(u["logp"][i, t] - u["old"][i, t]).item() for t in ts]
            # PPO's advantage is per token (GAE); GRPO's and GSPO's one per sequence
            adv = [(u["adv"][i, t] if u["adv"].dim() == 2 else u["adv"][i]).item() for t in ts]
            log_ratios += d
            if fork and traits(name).clip is not None:  # its clip's decisions, per token or per sequence
                x = torch.tensor(d, dtype=F64)
                seq = traits(name).clip_unit == "sequence"
                ratio = x.mean().exp()[None] if seq else x.exp()
                a = torch.tensor(adv[:1] if seq else adv, dtype=F64)
                sums["declared"] += clip_rule(name, args, a, ratio).sum().item() if d else 0
            if name == "gspo" or (
                fork and traits(name).clip_unit == "sequence"
            ):  # one ratio per sequence with a loss token: exp of the mean log-ratio (Eq. 7)
                if d:
                    s, a = math.exp(sum(d) / len(d)), adv[0]
                    ratios.append(s)
                    sums["clipped"] += (a > 0 and s > 1 + eps_high) or (a < 0 and s < 1 - eps_low)
                continue
            for x, a in zip(d, adv, strict=True):
                r = math.exp(x)
                ratios.append(r)
                sums["low"] += a < 0 and r < 1 - eps_low
                sums["high"] += a > 0 and r > 1 + eps_high
                sums["clipped"] += (a > 0 and r > 1 + eps_high) or (a < 0 and r < 1 - eps_low)
                clipped = min(max(r, 1 - eps_low), 1 + eps_high)
                sums["dual"] += name == "ppo" and a < 0 and max(-a * r, -a * clipped) > -3 * a  # PPO's --dual-clip 3
                sums["kl"] += r - 1 - x  # PPO's approx_kl, k3(old || new)
    n = len(ratios)
    mean = sum(ratios) / n
    lr_mean = sum(log_ratios) / len(log_ratios)
    row = {
        "loss": sum(u["loss"] for u in updates) / len(updates),
        "ratio_mean": mean,
        "log_ratio_std": math.sqrt(sum((x - lr_mean) ** 2 for x in log_ratios) / len(log_ratios)),
        "ratio_outside_grpo_clip": sum(not 0.8 <= math.exp(x) <= 1.2 for x in log_ratios) / len(log_ratios),
    }
    if traits(name).grouped:  # (PPO logs neither)
        row["ratio_std"] = math.sqrt(sum((r - mean) ** 2 for r in ratios) / n)
        row["ratio_max_dev"] = max(abs(r - 1) for r in ratios)
    if fork and traits(name).clip_metric is not None:  # a share of every minibatch's tokens (or sequences)
        units = sum(u["minibatch"] for u in updates) if traits(name).clip_unit == "sequence" else minibatch_tokens
        row[traits(name).clip_metric] = sums["declared"] / units
    elif name == "gspo":
        row["clip_frac_seqs"] = sums["clipped"] / sum(u["minibatch"] for u in updates)
    elif name == "grpo":
        row.update(clip_frac=sums["clipped"] / minibatch_tokens, clip_frac_low=sums["low"] / minibatch_tokens,
                   clip_frac_high=sums["high"] / minibatch_tokens)  # fmt: skip
    elif name == "ppo":
        row.update(clip_frac=sums["clipped"] / n, dual_clip_frac=sums["dual"] / n, approx_kl=sums["kl"] / n)
    return row


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_row_pools_every_token_of_every_update_and_no_stand_in(tmp_path, capsys, monkeypatch, name):
    """Two steps of 16 rows in 4 minibatches, 2 epochs (8 updates a step, the later ones off-policy, so ratios move):
    every update number of each step's row equals the float64 loop's over the updates' tokens (GSPO: sequences),
    clip shares over every minibatch's tokens (sequences). The case tells the counts apart: a stand-in row counted,
    or the mean of the updates' own means, would be another number."""
    module = importlib.import_module(name)
    (tmp_path / "rewards.py").write_text(REWARD)
    updates = record_updates(monkeypatch, module, name)
    rows = recorded_rows(monkeypatch)
    masks = []  # each step's completion mask, from pi_old's forward over the whole rollout
    forward = common.completion_logprobs
    monkeypatch.setattr(common, "completion_logprobs", lambda m, roll, *a, **k: masks.append(roll.completion_mask)
                        or forward(m, roll, *a, **k))  # fmt: skip
    argv = ["--reward", f"{tmp_path}/rewards.py:two_groups", "--steps", 2, "--prompts-per-step", 4, "--group-size", 4,
            "--minibatches", 4, "--epochs", 2, "--max-new-tokens", 6, "--lr", 3e-3, "--eval-every", 0, "--eval-size",
            2, "--seed", 1, "--out", tmp_path / "out", *traits(name).test_flags]  # fmt: skip
    status, _, err = main_in_process(module, argv, capsys)
    assert status == 0, err
    assert len(rows) == 2 and len(updates) == 16
    stand_ins = 0
    for step, row in enumerate(rows):
        mine = updates[8 * step : 8 * step + 8]
        stand_ins += sum(not u["real"] for u in mine)
        want = float64_row(name, mine, masks[step].sum().item() * 2, module.Args())  # 2 epochs: every token twice
        tokens = sum(int(u["mask"].sum()) for u in mine)
        for key, value in want.items():
            # float32 terms (an exp: 2u) summed in float32 within an update, pooled in float64: gamma of the count
            tol = gamma(4 * tokens + 16, F32) * 4 * max(1.0, abs(value))
            if key.endswith("_std"):  # from a difference of sums of squares: its error over the std bounds the std's
                tol = gamma(8 * tokens + 32, F32) * 8 / max(value, 1e-3)
            assert row[key] == pytest.approx(value, abs=tol), (step, key)
        counted = [u for u in mine if u["real"]]
        if name != "gspo":  # the mean of the updates' own mean ratios is another number (their token counts differ)
            by_update = sum(_mean_ratio(u) for u in counted) / len(counted)
            counts = [int(u["mask"].sum()) for u in counted]
            assert abs(by_update - want["ratio_mean"]) > 1e-5, f"token counts {counts}: the case cannot tell apart"
        if len(counted) < len(mine):  # a stand-in counted as a row would be another number too
            with_stand_ins = float64_row(name, [dict(u, real=True) for u in mine], masks[step].sum().item() * 2,
                                         module.Args())  # fmt: skip
            assert abs(with_stand_ins["ratio_mean"] - want["ratio_mean"]) > 1e-5
    assert stand_ins or not traits(name).skips_zero_advantage, "no stand-in row: the case does not test it"


def _mean_ratio(u) -> float:
    """One update's mean token ratio (float64)."""
    return (u["logp"] - u["old"]).exp()[u["mask"]].mean().item()
