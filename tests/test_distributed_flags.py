"""A script's own train() on 2 gloo ranks against one process on the same rollout, beyond the default flags (torchrun);
the ranks hold unequal numbers of loss tokens (checked), so a denominator taken per rank fails here."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import (
    LOGGED_TOL,
    SCRIPTS,
    assert_within,
    forward_roundings,
    free_port,
    needs_torchrun,
    probable_gamma,
    torchrun_cmd,
    traits,
    unit_roundoff,
)
from test_distributed import ROOT, WORLD
from test_real_checkpoints import graded_reward

import common

pytestmark = pytest.mark.slow

# Runs `<algo>.py`'s own train() through common.main, changing two things from outside: the Sampler returns
# completions fixed by each prompt (so 2 ranks and 1 process train on the same rollout, whatever the ranks'
# sampling streams), and every AdamW saves the gradients it is stepped with, and the weights before and after
# (under --fsdp gathered whole on every rank).
FIXED_ROLLOUT_RUN = """
import importlib, os, sys, zlib
import torch
sys.path.insert(0, {root!r})
import common

algo = importlib.import_module(sys.argv[1])
OUT, RANK = os.environ["RECORD_DIR"], int(os.environ.get("RANK", "0"))


class FixedSampler(common.Sampler):
    def sample(self, prompts, generator):
        completions, seen = [], {{}}
        for p in prompts:  # G rows per prompt; the k-th of a prompt's rows gets the k-th fixed completion
            k = seen[tuple(p)] = seen.get(tuple(p), -1) + 1
            g = torch.Generator().manual_seed(zlib.crc32(repr(p).encode()) * 64 + k % self.args.group_size)
            n = int(torch.randint(1, self.args.max_new_tokens, (1,), generator=g))
            completions.append(torch.randint(2, 97, (n,), generator=g).tolist() + [self.eos_ids[0]])
        roll = common.Rollout.from_lists(prompts, completions, self.pad_id)
        with torch.no_grad():  # the sampling distribution's entropy, which sample() records (--fsdp: via its root)
            roll.entropy = common.completion_logprobs(self.model, roll, self.args.temperature)[1]
        roll.seconds, roll.sampled_tokens = 1.0, int(roll.completion_mask.sum())  # what tokens_per_s reads
        return roll


def whole(t):  # --fsdp: a parameter or gradient is this rank's shard of a DTensor; every rank gathers it whole
    if t is None:  # (--lora-rank: a frozen weight has no gradient)
        return None
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t.clone()


class RecordingAdamW(torch.optim.AdamW):
    made = 0

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.id, self.steps = RecordingAdamW.made, 0
        RecordingAdamW.made += 1

    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"]]
        record = dict(grads=[whole(p.grad) for p in params], before=[whole(p) for p in params],
                      sharded=any(hasattr(p, "full_tensor") for p in params))
        out = super().step(closure)
        record["after"] = [whole(p) for p in params]
        torch.save(record, os.path.join(OUT, f"opt{{self.id}}-step{{self.steps}}-rank{{RANK}}.pt"))
        self.steps += 1
        return out


common.Sampler = FixedSampler
torch.optim.AdamW = RecordingAdamW
common.main(algo.train, algo.Args, argv=sys.argv[2:])
"""


MAX_NEW_TOKENS = 8
# FIXED_ROLLOUT_RUN's sampler with every third row of a prompt cut (MAX_NEW_TOKENS tokens, no EOS), and each rank's
# rollout written down: (its completion tokens, those of rows that end with an EOS)
ENDS = "completions.append(torch.randint(2, 97, (n,), generator=g).tolist() + [self.eos_ids[0]])"
CUT = """cut = k % 3 == 2
            ids = torch.randint(2, 97, (self.args.max_new_tokens if cut else n,), generator=g).tolist()
            completions.append(ids if cut else ids + [self.eos_ids[0]])"""
RETURN = "        return roll\n"
RECORD = """        ends = common.completion_ends(roll, self.eos_ids)
        mask = roll.completion_mask
        torch.save((int(mask.sum()), int((mask * ends[:, None]).sum())), os.path.join(OUT, f"tokens-rank{{RANK}}.pt"))
        torch.save(dict(prompt_ids=roll.prompt_ids, prompt_mask=roll.prompt_mask, completion_ids=roll.completion_ids,
                        completion_mask=mask), os.path.join(OUT, f"rollout-rank{{RANK}}.pt"))
        return roll
"""
# An off-policy first update (test_distributed_metrics' too): --old-logp rollout reads the sampler's log-probs, set
# here to the model's own plus a fixed offset per (prompt, the k-th of its rows, position), uniform in [-x, x]
# ("{offset}" replaced by x), so that at the starting weights each token's ratio is exp(-offset) to rounding
OFFSET = 0.4  # ratios 0.67-1.49: outside GRPO's and PPO's clip range [0.8, 1.2] for about half of the tokens
OFF_POLICY_PI_OLD = """        logp = common.CompletionLogprobs(self.model)(roll, self.args.temperature)[0]
        offsets, seen = [], {{}}
        for p in prompts:  # a fixed offset per (prompt, the k-th of its rows, position), as the completions are
            k = seen[tuple(p)] = seen.get(tuple(p), -1) + 1
            g = torch.Generator().manual_seed(zlib.crc32(repr(p).encode()) * 64 + 32 + k % self.args.group_size)
            offsets.append((torch.rand(self.args.max_new_tokens, generator=g) * 2 - 1) * {offset})
        offsets = torch.stack(offsets)[:, : logp.shape[1]]
        roll.sample_logp = roll.sample_logp_full = (logp.detach() + offsets) * roll.completion_mask
"""

# (grpo token-mean with --mask-truncated is grpo-token-mean+entropy's update: the bonus shares the loss's denominator)
CASES = {
    "grpo-sum-norm": ("grpo", ["--loss-agg", "seq-mean-token-sum-norm", "--mask-truncated"]),
    # --entropy-coef: the bonus, aggregated as each script aggregates its loss (grpo: by --loss-agg, with the loss's
    # denominator; gspo: per sequence, then over the minibatch's rows; ppo: a token mean, scaled to all ranks' tokens)
    "grpo-token-mean+entropy": ("grpo", ["--loss-agg", "token-mean", "--mask-truncated", "--entropy-coef", "0.5"]),
    "grpo-seq-mean-token-mean+entropy": ("grpo", ["--loss-agg", "seq-mean-token-mean", "--entropy-coef", "0.5"]),
    "gspo+entropy": ("gspo", ["--entropy-coef", "0.5"]),
    "ppo+entropy": ("ppo", ["--entropy-coef", "0.5"]),
}
# --lora-rank: the bonus's updates training rank-4 adapters on frozen weights (ppo: the critic's too), made non-zero
# first (NONZERO_LORA), so that the step's gradient reaches both adapter matrices; the same flags without LoRA run
# under --fsdp below (FSDP_CASES), so each script's bonus is checked on 2 ranks both ways. The LoRA runs also carry
# gspo's token variant and ppo's --lam and --missing-eos-penalty (WITH_LORA)
FSDP_CASES = ["grpo-token-mean+entropy", "gspo+entropy", "ppo+entropy"]  # (sharded alike whatever --loss-agg)
WITH_LORA = {"gspo+entropy": ["--variant", "token", "--mask-truncated"],
             "ppo+entropy": ["--lam", "0.5", "--missing-eos-penalty", "0.5"]}  # fmt: skip
DDP_CASES = {case: CASES[case] for case in CASES if case not in FSDP_CASES}
DDP_CASES |= {f"{case}+lora": (algo, [*flags, *WITH_LORA.get(case, ()), "--lora-rank", "4"])
              for case, (algo, flags) in CASES.items() if case in FSDP_CASES}  # fmt: skip
# every other script registered in helpers.SCRIPTS (a fork), at its defaults: each torchrun check runs every script
DDP_CASES |= {name: (name, []) for name in SCRIPTS if name not in {algo for algo, _ in CASES.values()}}

# peft starts each lora_B at 0, where the adapted model is the base model and lora_A's gradient is exactly 0 (a step
# that lost it would pass): every lora_B gets seeded values, the same in every process, as test_lora's adapters do
NONZERO_LORA = """
add_lora = common.add_lora


def nonzero_lora(model, args):
    model = add_lora(model, args)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


common.add_lora = nonzero_lora
"""
MAIN = "common.main(algo.train"


RUNS = {}  # the arguments of a run -> its record directory: each run made once (test_distributed_metrics reuses)


def run(tmp_path, algo, flags, nproc, torchrun_flags=(), offset=None, name="", reward=None):
    key = (algo, tuple(flags), nproc, tuple(torchrun_flags), offset, name, reward)
    if key not in RUNS:
        RUNS[key] = launch(tmp_path, algo, flags, nproc, torchrun_flags, offset, name, reward)
    return RUNS[key]


def launch(tmp_path, algo, flags, nproc, torchrun_flags=(), offset=None, name="", reward=None):
    """One update on the fixed rollout (nproc 0: one process, else torchrun's): its record-{nproc}{name} directory.
    `reward`: a --reward in place of the graded one, which varies within every group."""
    assert all(s in FIXED_ROLLOUT_RUN for s in (ENDS, RETURN, MAIN))
    script = tmp_path / f"fixed_cut_rollout_run{name}.py"
    pi_old = "" if offset is None else OFF_POLICY_PI_OLD.replace("{offset}", repr(float(offset)))
    text = FIXED_ROLLOUT_RUN.replace(ENDS, CUT).replace(RETURN, pi_old + RECORD).format(root=str(ROOT))
    script.write_text(text.replace(MAIN, NONZERO_LORA + MAIN))
    record = tmp_path / f"record-{nproc}{name}"
    record.mkdir()
    flags = [*flags, *(() if offset is None else ("--old-logp", "rollout"))]
    launcher = [*torchrun_cmd(), "--nproc_per_node", str(nproc), "--master_port", str(free_port())] if nproc else []
    cmd = [*(launcher or [sys.executable]), str(script), algo, "--device", "cpu", "--steps", "1", "--prompts-per-step",
           "4", "--group-size", "4", "--minibatches", "1", "--epochs", "1", "--max-new-tokens", str(MAX_NEW_TOKENS),
           "--max-grad-norm", "1e30", "--no-anneal-lr", "--eval-size", "1", "--eval-every", "0", "--reward",
           reward or graded_reward(tmp_path), *flags, *(torchrun_flags if nproc else ()),
           "--out", str(tmp_path / f"out-{nproc}{name}")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RLREF_THREADS": "1", "RECORD_DIR": str(record)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return record


@needs_torchrun
@pytest.mark.parametrize("case", sorted(DDP_CASES))
def test_script_update_with_flags_on_two_ranks_equals_one_process(tmp_path, tiny_path, case):
    assert_two_ranks_equal_one_process(tmp_path, tiny_path, case, *DDP_CASES[case])


# --fsdp (FSDP2: each rank holds a shard of every weight, gradient and AdamW moment; the gradients reduce-scattered):
# each script with its entropy bonus (ppo's critic sharded too), gathered whole where the optimizer is stepped


@needs_torchrun
@pytest.mark.parametrize("case", FSDP_CASES)
def test_script_update_under_fsdp_on_two_ranks_equals_one_process(tmp_path, tiny_path, case):
    assert_two_ranks_equal_one_process(tmp_path, tiny_path, case, *CASES[case], ["--fsdp"])


# An off-policy first update (OFF_POLICY_PI_OLD): the cases above update on-policy (every ratio 1, nothing clips);
# here the ratios are exp(-offset), and a share of the tokens (GSPO: of the sequences) is clipped
OFF_POLICY_CASES = {
    "grpo-token-mean": ("grpo", ["--loss-agg", "token-mean", "--mask-truncated"]),
    "gspo-sequence": ("gspo", ["--variant", "sequence"]),
    "ppo": ("ppo", []),
}


# a registered fork, its clip flags (TRAITS' clip_flags) at most 0.2, inside the offsets' reach, whatever its defaults
def narrowed_clip(name: str) -> list[str]:
    defaults = importlib.import_module(name).Args()
    return [a for f in traits(name).clip_flags if f is not None
            for a in ("--" + f.replace("_", "-"), str(min(getattr(defaults, f), 0.2)))]  # fmt: skip


OFF_POLICY_CASES |= {name: (name, narrowed_clip(name)) for name in SCRIPTS if traits(name).clip is not None
                     and name not in {algo for algo, _ in OFF_POLICY_CASES.values()}}  # fmt: skip
MIN_CLIPPED = 0.1  # the least share clipped that a case accepts (rows of a group with equal rewards have A = 0: none)


@needs_torchrun
@pytest.mark.parametrize("case", sorted(OFF_POLICY_CASES))
def test_clipped_update_on_two_ranks_equals_one_process(tmp_path, tiny_path, case):
    """pi_old offset (OFF_POLICY_PI_OLD): the update clips, 2 ranks equal one process, and differ from on-policy."""
    algo, flags = OFF_POLICY_CASES[case]
    single, ddp, records = assert_two_ranks_equal_one_process(tmp_path, tiny_path, case, algo, flags, offset=OFFSET)
    on_policy = run(tmp_path, algo, flags, 0, offset=0.0, name="-on-policy")
    one, two, on = (first_row(r) for r in (single, ddp, on_policy))
    key = traits(algo).clip_metric  # its clip share (GSPO's sequence ratio: a share of sequences; a fork's own name)
    if key is not None:  # (a clip that logs no share: the gradients below alone)
        assert one[key] >= MIN_CLIPPED and on[key] == 0, (key, one[key], on[key])
        # the same tokens clipped: a count, equal unless a ratio lies within rounding of a clip bound (test_distributed_
        # metrics); then the float32 share's rounding, and metrics.jsonl's
        assert abs(two[key] - one[key]) <= 4 * unit_roundoff(torch.float32) + LOGGED_TOL, (key, two[key], one[key])
    tol = gradient_tol(tiny_path)
    for r in records:
        off, on = (torch.load(d / f"{r}-rank0.pt")["grads"] for d in (single, on_policy))
        moved = [bool((a - b).abs().max() > tol * a.abs().max()) for a, b in zip(off, on) if a is not None and a.any()]
        assert moved and all(moved), (r, moved)


def first_row(record) -> dict:
    """The first metrics.jsonl row of the run whose record directory is `record`."""
    out = record.with_name(record.name.replace("record-", "out-", 1))
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[0])


def gradient_tol(tiny_path):
    """test_distributed's bound, relative to a gradient tensor's largest element: the first-order model of logit_tol
    over the backward's chains and the B x L positions a weight's gradient collects, two such sums in other orders."""
    from transformers import AutoConfig

    B, L = 16, max(len(e["prompt"]) for e in common.arith_split()[0]) + MAX_NEW_TOKENS
    return 2 * probable_gamma(forward_roundings(AutoConfig.from_pretrained(tiny_path), L) + B * L + 1)


ONE_PROCESS = {}  # (algo, flags, offset) -> a one-process run's record directory


def assert_two_ranks_equal_one_process(tmp_path, tiny_path, case, algo, flags, torchrun_flags=(), offset=None):
    """Each optimizer's gradient on each of 2 ranks equals one process's on the same rollout, to rounding."""
    key = (algo, tuple(flags), offset)  # one process's run, the same under --fsdp: made once
    single = ONE_PROCESS.get(key) or ONE_PROCESS.setdefault(key, run(tmp_path, algo, flags, 0, offset=offset))
    ddp = run(tmp_path, algo, flags, WORLD, torchrun_flags, offset=offset)
    total, ended = torch.load(single / "tokens-rank0.pt")
    ranks = [torch.load(ddp / f"tokens-rank{k}.pt") for k in range(WORLD)]
    assert 0 < ended < total  # some rows cut, some not
    assert [sum(r[i] for r in ranks) for i in (0, 1)] == [total, ended]  # the ranks split the same rollout
    assert ranks[0][1] != ranks[1][1] and ranks[0][0] != ranks[1][0]  # ... into unequal token counts
    records = sorted(f.name.removesuffix("-rank0.pt") for f in single.glob("opt*-rank0.pt"))
    assert records == [f"opt{i}-step0" for i in range(len(records))] and records, records  # ppo: policy, critic
    tol = gradient_tol(tiny_path)
    for r in records:
        one, two = torch.load(single / f"{r}-rank0.pt"), [torch.load(ddp / f"{r}-rank{k}.pt") for k in range(WORLD)]
        assert not one["sharded"] and two[0]["sharded"] == ("--fsdp" in torchrun_flags), r
        # a gradient on the same tensors (--lora-rank: the adapters'), one averaged gradient on every rank
        frozen = [g is None for g in one["grads"]]
        assert [g is None for g in two[0]["grads"]] == [g is None for g in two[1]["grads"]] == frozen, r
        assert ("+lora" in case) == any(frozen), r
        if "+lora" in case and r == "opt0-step0":  # the policy's every adapter matrix, A and B, has a gradient
            assert all(g.any() for g in one["grads"] if g is not None), r  # (ppo's critic: its head starts at 0)
        assert all(a is None or torch.equal(a, b) for a, b in zip(two[1]["grads"], two[0]["grads"])), r
        assert any(g.abs().max() > 0 for g in one["grads"] if g is not None), r
        for i, (g1, g2) in enumerate(zip(one["grads"], two[0]["grads"])):
            if g1 is not None:
                assert_within(g2, g1, tol * g1.abs().max().item(), f"{case} {r} gradient {i}")
        # the step was applied alike on every rank (under --fsdp each to its shards), to every tensor with a gradient
        assert all(torch.equal(a, b) for a, b in zip(two[1]["after"], two[0]["after"])), r
        for i, (a, b, g) in enumerate(zip(two[0]["after"], two[0]["before"], two[0]["grads"])):
            assert torch.equal(a, b) == (g is None or not g.any()), (r, i)
    return single, ddp, records
