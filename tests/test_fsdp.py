"""--fsdp (FSDP2) on CPU with gloo, 2 ranks, against one process or DDP."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import ROOT, assert_within, free_port, main_in_process, needs_torchrun, torchrun_cmd
from test_distributed import WORLD

import common
import grpo
import gspo
import ppo
from extras import fsdp as fsdp_extra

pytestmark = pytest.mark.slow  # subprocess or torchrun runs: the quick tier (-m "not slow") leaves them out

CPU = torch.device("cpu")
BF16_REL = 2**-2  # test_bf16_gathered_weights_...: why this is not derived from bfloat16's roundoff
TIMEOUT = 600  # seconds for the 2-rank worker: a collective that one rank skips would hang, not fail


def fixed_batch(tok, B=8, T=6, seed=0):
    """A rollout with completions of different lengths (so token counts differ between ranks),
    pi_old log-probs off from the current policy's, advantages and scores."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 90, (int(n),), generator=g).tolist() for n in torch.randint(2, 6, (B,), generator=g)]
    lengths = [1, 6, 2, 5, 6, 1, 3, 6]  # rank 0 takes rows 0, 2, 4, 6 (12 tokens), rank 1 the rest (18)
    completions = [torch.randint(3, 90, (n,), generator=g).tolist() for n in lengths]
    roll = common.Rollout.from_lists(prompts, completions, tok.pad_token_id)
    return {
        "roll": roll,
        "old_shift": 0.3 * torch.randn(B, T, generator=g),
        "adv": torch.randn(B, generator=g),
        "token_adv": torch.randn(B, T, generator=g),
    }


def token_mean_loss(train_model, batch, rows):
    """grpo.py's token-mean loss of `rows`, as its update computes it under torchrun (the denominator all ranks')."""
    roll, mask = batch["roll"][rows], batch["roll"].completion_mask[rows]
    logp, _ = train_model(roll, 1.0)
    old = (logp.detach() + batch["old_shift"][rows]) * mask
    denominator = common.mean_denominator(mask.sum())
    return grpo.grpo_loss(logp, old, batch["adv"][rows], mask, agg="token-mean", denominator=denominator)[0]


def sgd_step(model_dir, batch, rows, fsdp: bool, dtype=torch.float32) -> dict:
    """One SGD step (lr 1, no clipping) of grpo's token-mean loss on `rows`: loss, grad_norm, gathered weights."""
    model = common.load_model(model_dir, CPU)[0].train()
    train_model = common.CompletionLogprobs(model)
    if fsdp:
        train_model = fsdp_extra.shard(train_model, dtype)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    loss = token_mean_loss(train_model, batch, rows)
    loss.backward()
    norm = common.clip_grad_norm_(model.parameters(), math.inf)  # the total norm (all ranks'), no clipping
    opt.step()
    mean_loss = common.all_reduce_sum(loss.detach()) / WORLD if fsdp else loss.detach()
    return {"loss": mean_loss, "grad_norm": norm, "weights": common.full_state_dict(model)}


def critic_step(model_dir, batch, rows, fsdp: bool, dtype=torch.float32) -> dict:
    """One SGD step of PPO's clipped value loss through the Critic (trunk and head)."""
    critic = ppo.Critic(model_dir, CPU)
    with torch.no_grad():  # a head that is not 0, so that the step reaches the trunk
        critic.head.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    if fsdp:
        fsdp_extra.shard(critic, dtype)
    roll, mask = batch["roll"][rows], batch["roll"].completion_mask[rows]
    opt = torch.optim.SGD(critic.parameters(), lr=1.0)
    old_values, returns = batch["token_adv"][rows] * 0.1, batch["token_adv"][rows]
    loss = ppo.value_loss(critic(roll), old_values, returns, mask, clip=0.2)[0]
    loss = loss * common.token_mean_scale(mask)  # the script's torchrun scale
    loss.backward()
    norm = common.clip_grad_norm_(critic.parameters(), math.inf)
    opt.step()
    mean_loss = common.all_reduce_sum(loss.detach()) / WORLD if fsdp else loss.detach()
    return {"loss": mean_loss, "grad_norm": norm, "weights": common.full_state_dict(critic)}


def rollouts(model, tok, sampler):
    """Greedy completions of a few arithmetic prompts, and a bf16 Sampler's sampled ones (seeded)."""
    prompts = [tok.encode(f"{a}+{b}=") for a, b in ((12, 34), (5, 7), (40, 41), (9, 90))]
    eos = common.eos_token_ids(model, tok)
    greedy = common.sample(model, prompts, 6, eos, tok.pad_token_id, greedy=True)
    bf16 = sampler.sample(prompts, torch.Generator().manual_seed(0))  # 6 new tokens, temperature and top-p 1
    return greedy.completion_ids, bf16.completion_ids, bf16.sample_logp


def evaluation(model, tok):
    """evaluate() on 5 records in batches of 2: under 2 ranks, rank 0 holds 3 (2 batches), rank 1 2 (1 batch)."""
    records = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in ((1, 2), (30, 4), (22, 22), (7, 70), (5, 5))]
    return common.evaluate(model, tok, records, 6, system_prompt="", batch_size=2)


def bf16_sampler(model, tok):
    args = SimpleNamespace(rollout_dtype="bfloat16", old_logp="recompute", is_correction="none",
                           max_new_tokens=6, temperature=1.0, top_p=1.0, cuda_graph=False)  # fmt: skip
    return common.Sampler(model, tok, args)


def _worker(rank, port, model_dir, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        tok = common.load_model(model_dir, CPU)[1]
        batch = fixed_batch(tok)
        mine = slice(rank, None, WORLD)
        results = {}
        model = common.load_model(model_dir, CPU)[0].eval()
        sampler = bf16_sampler(model, tok)  # made before shard, as the scripts make it
        fsdp_extra.shard(common.CompletionLogprobs(model))
        results["rollouts"] = rollouts(model, tok, sampler)
        results["evaluation"] = evaluation(model, tok)
        results["weights_still_sharded"] = common.sharded(model)  # gathered() resharded after sampling
        # bf16 gathered weights (a MixedPrecisionPolicy, as on CUDA with --rollout-dtype bfloat16), on CPU
        results["bf16 step"] = sgd_step(model_dir, batch, mine, fsdp=True, dtype=torch.bfloat16)
        results["bf16 critic"] = critic_step(model_dir, batch, mine, fsdp=True, dtype=torch.bfloat16)
        model = common.load_model(model_dir, CPU)[0].eval()
        sampler = bf16_sampler(model, tok)
        fsdp_extra.shard(common.CompletionLogprobs(model), torch.bfloat16)
        results["bf16 rollouts"] = rollouts(model, tok, sampler)
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded_results(tmp_path_factory, tiny_path):
    out = tmp_path_factory.mktemp("fsdp") / "results.pt"
    ctx = mp.start_processes(_worker, args=(free_port(), tiny_path, str(out)), nprocs=WORLD, join=False)
    deadline = time.monotonic() + TIMEOUT
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the 2-rank FSDP worker did not finish in {TIMEOUT} s (a collective only some ranks reached)")
    return torch.load(out)


def test_sharded_rollouts_and_uneven_evaluation_equal_unsharded(sharded_results, tiny_path):
    model, tok = common.load_model(tiny_path, CPU)
    model.eval()
    greedy, bf16, bf16_logp = rollouts(model, tok, bf16_sampler(model, tok))
    sharded_greedy, sharded_bf16, sharded_bf16_logp = sharded_results["rollouts"]
    assert torch.equal(sharded_greedy, greedy)
    assert torch.equal(sharded_bf16, bf16)  # the bf16 copy is cast from the gathered weights
    torch.testing.assert_close(sharded_bf16_logp, bf16_logp, rtol=0, atol=0)
    # the evaluation finished on both ranks (rank 0: 2 batches, rank 1: 1) and its means are all 5 records'
    assert sharded_results["evaluation"] == pytest.approx(evaluation(model, tok), abs=1e-6)
    assert sharded_results["weights_still_sharded"]


# --- the scripts under torchrun ---------------------------------------------------------------------------

SCRIPT_FLAGS = {  # small runs that reach every sharded forward: grpo's reference, ppo's critic and reference,
    # gspo's bf16 sampler; a trace every 2 steps (its forward is a collective under --fsdp)
    "gspo": ["--rollout-dtype", "bfloat16"],
    "grpo": ["--kl-coef", "0.05"],
    "ppo": [],
}


def torchrun(algo, out, *flags, nproc=WORLD, check=True):
    cmd = [*torchrun_cmd(), "--nproc_per_node", str(nproc), "--master_port", str(free_port()),
           str(ROOT / f"{algo}.py"),
           "--device", "cpu", "--prompts-per-step", "8", "--minibatches", "2", "--max-new-tokens", "6",
           "--eval-size", "7", "--eval-every", "2", "--trace-every", "2", "--no-anneal-lr", "--out", str(out),
           *SCRIPT_FLAGS[algo],
           *flags]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RLREF_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def final_weights(out) -> dict:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(Path(out) / "final").state_dict()  # a standard checkpoint


@needs_torchrun
def test_script_under_fsdp_equals_ddp_and_resumes_exactly(tmp_path, capsys):
    # ppo.py, whose state is the others' and more (a critic, its optimizer and checkpoint); each script's own sharded
    # update against one process's: test_distributed_flags.py's test_script_update_under_fsdp_on_two_ranks_...
    algo = "ppo"
    sharded, ddp, resumed = tmp_path / "fsdp", tmp_path / "ddp", tmp_path / "resumed"
    torchrun(algo, sharded, "--fsdp", "--steps", "3")
    torchrun(algo, ddp, "--steps", "3", "--save-every", "3")  # (its checkpoint: resumed by one process below)
    # the same sampling streams, so the same rollouts: every step's metrics and the weights agree to float rounding
    a, b = metrics(sharded), metrics(ddp)
    assert [r["step"] for r in a] == [1, 2, 3]
    for ra, rb in zip(a, b):
        for key in ("reward", "loss", "grad_norm", "eval_accuracy", "value_loss", "critic_grad_norm"):
            if key in rb:
                assert ra[key] == pytest.approx(rb[key], rel=1e-4, abs=1e-6), (ra["step"], key)
    fa, fb = final_weights(sharded), final_weights(ddp)
    for k, v in fb.items():
        torch.testing.assert_close(fa[k], v, rtol=1e-5, atol=1e-5, msg=k)
    ca, cb = torch.load(sharded / "final" / "critic.pt"), torch.load(ddp / "final" / "critic.pt")
    for k, v in cb.items():
        torch.testing.assert_close(ca[k], v, rtol=1e-5, atol=1e-5, msg=f"critic {k}")
    assert len((sharded / "traces.jsonl").read_text().splitlines()) > 0  # rank 0 traced; the others took part
    # stopped after step 2 with a checkpoint, resumed to step 3: the uninterrupted run's weights and metrics (at a
    # constant learning rate: under --anneal-lr the rate depends on --steps, so a 2-step run extended is another run)
    torchrun(algo, resumed, "--fsdp", "--steps", "2", "--save-every", "2")
    assert json.loads((resumed / "checkpoint" / "meta.json").read_text())["world"] == WORLD
    torchrun(algo, resumed, "--resume", str(resumed), "--steps", "3")
    fr = final_weights(resumed)
    assert all(torch.equal(fr[k], fa[k]) for k in fa)
    timing = ("step_time_s", "tokens_per_s")
    assert [{k: v for k, v in r.items() if k not in timing} for r in metrics(resumed)] == [
        {k: v for k, v in r.items() if k not in timing} for r in a
    ]
    # the 2-rank run's checkpoint resumed by one process: refused in one line (each rank resumes its own stream)
    capsys.readouterr()
    status, _, err = main_in_process(ppo, ["--resume", ddp, "--steps", 4], capsys)
    assert status == 2 and err == (
        f"error: --resume {ddp}: the checkpoint was written by 2 processes, this run has 1 process; each rank "
        "resumes its own sampling stream: run it with torchrun --nproc_per_node 2\n"
    ), err


def test_fsdp_without_torchrun_and_with_lora_is_refused(tmp_path, capsys, monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    argv = ["--fsdp", "--steps", "1", "--out", tmp_path / "a"]
    status, _, err = main_in_process(gspo, argv, capsys)
    assert status == 2 and err.strip().startswith("error: --fsdp shards the model over torchrun's processes"), err
    monkeypatch.setenv("WORLD_SIZE", "2")  # as under torchrun: checked before it joins
    status, _, err = main_in_process(gspo, [*argv, "--lora-rank", "4"], capsys)
    assert status == 2 and err.strip().startswith("error: --fsdp with --lora-rank is not supported"), err
    assert not (tmp_path / "a").exists()


@needs_torchrun
def test_fsdp_refuses_a_model_its_sampler_cannot_run(tmp_path):
    moe = torchrun("gspo", tmp_path / "moe", "--fsdp", "--model", "tiny-moe", "--steps", "1", nproc=1, check=False)
    assert moe.returncode != 0 and "exitcode  : 2" in moe.stderr, moe.stderr[-2000:]  # torchrun: the rank's status
    assert "error: --fsdp: the sampler runs on gathered weights through its own decoder" in moe.stderr
    assert "this model is qwen3_moe" in moe.stderr


def test_bf16_gathered_weights_sample_as_the_bf16_sampler_and_train_to_bf16_precision(sharded_results, tiny_path):
    """bf16 gathered weights sample as the bf16 Sampler does, and step as float32 does to bf16 precision."""
    model, tok = common.load_model(tiny_path, CPU)
    model.eval()
    greedy, bf16, bf16_logp = rollouts(model, tok, bf16_sampler(model, tok))
    _, sharded_bf16, sharded_bf16_logp = sharded_results["bf16 rollouts"]
    assert torch.equal(sharded_bf16, bf16)
    torch.testing.assert_close(sharded_bf16_logp, bf16_logp, rtol=0, atol=0)
    batch = fixed_batch(tok)
    policy_before = common.load_model(tiny_path, CPU)[0].state_dict()
    critic = ppo.Critic(tiny_path, CPU)
    with torch.no_grad():  # critic_step's head
        critic.head.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    for name, single, before in (
        ("bf16 step", sgd_step(tiny_path, batch, slice(None), fsdp=False), policy_before),
        ("bf16 critic", critic_step(tiny_path, batch, slice(None), fsdp=False), critic.state_dict()),
    ):
        sharded = sharded_results[name]
        # Not derivable (bfloat16's probable gamma over the forward's roundings exceeds 1): relative to each
        # quantity's own size, so a missing, halved or doubled update fails. Measured (issue 48, 2-core Xeon): updates
        # within 0.091 (policy), 0.072 (critic) of their largest, loss 0.017, grad norm 0.0056; BF16_REL = 2^-2.
        torch.testing.assert_close(sharded["loss"], single["loss"], rtol=BF16_REL, atol=0, msg=name)
        torch.testing.assert_close(sharded["grad_norm"], single["grad_norm"], rtol=BF16_REL, atol=0, msg=name)
        assert single["grad_norm"] > 1e-3, name  # the step moves the weights
        for k, v in single["weights"].items():
            assert sharded["weights"][k].dtype == torch.float32, k  # the master weights stay float32
            step, sharded_step = v - before[k], sharded["weights"][k] - before[k]
            if not step.any():
                assert not sharded_step.any(), f"{name}: {k}"
                continue
            scale = step.abs().max().item()
            assert_within(sharded_step, step, BF16_REL * scale, f"{name}: the update of {k}")


RELEASE = """
import gc, os, sys, weakref
import torch
import torch.distributed as dist
sys.path.insert(0, {root!r})
import common
from extras import fsdp

dist.init_process_group("gloo", rank=0, world_size=1)
model = common.load_model("tiny", torch.device("cpu"))[0]
root = fsdp.shard(common.CompletionLogprobs(model))
assert fsdp.LOGPROBS_ROOT.get(model) is root  # the sampler and completion_logprobs find the root
refs = [weakref.ref(root), weakref.ref(model)]
del root, model
gc.collect()
print([r() is None for r in refs])  # the registry still holds them: the run may look its root up
from extras import distributed
distributed.leave_process_group(None)  # main()'s end under torchrun
print([r() is None for r in refs])
"""


def test_the_fsdp_root_registry_lets_a_finished_runs_model_go(tmp_path):
    """leave_process_group frees the FSDP roots' registry (before, gloo aborted finished ranks now and then)."""
    script = tmp_path / "release.py"
    script.write_text(RELEASE.format(root=str(ROOT)))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RLREF_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[-3:-1] == ["[False, False]", "[True, True]"], proc.stdout
