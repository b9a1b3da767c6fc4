"""The gpu tier (`python -m pytest -q -m gpu`): the real CUDA paths where a GPU is visible, one reason line elsewhere.
RLREF_GPU_TIER_DEVICE=cpu runs the tier's own logic on a CPU at small shapes (a check of the tests, not of CUDA)."""

import copy
import json
import os
import subprocess
import sys
import time

import pytest
import torch
from helpers import ROOT, assert_within, greedy_generate, logit_scale, logit_tol, logprob_tol, torchrun_cmd
from safetensors.torch import load_file

import common

sys.path.insert(0, str(ROOT / "benchmarks"))

DEVICE = os.environ.get("RLREF_GPU_TIER_DEVICE") or ("cuda" if torch.cuda.is_available() else None)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE is None, reason="gpu tier: no CUDA device visible (CI has none)"),
]
SCRIPTS = ("gspo", "grpo", "ppo")
TINY = ["--model", "tiny", "--eval-every", "0", "--eval-size", "8", "--prompts-per-step", "4", "--no-anneal-lr"]
# at the 0.5B shape: 4 prompts x 4 samples x 32 new tokens, a reward with variance (a random model never answers)
REAL = ["--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "32", "--minibatches", "2",
        "--eval-every", "0", "--eval-size", "4", "--lr", "1e-6"]  # fmt: skip
if DEVICE == "cpu":  # RLREF_GPU_TIER_DEVICE=cpu: the tier's logic at a CPU's sizes
    REAL[REAL.index("--max-new-tokens") + 1] = "8"
RUN_LIMIT_S = 170 if DEVICE == "cuda" else 1500  # every run together: the tier's budget is 3 minutes


@pytest.fixture(scope="module")
def device():
    return torch.device(DEVICE)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: (exit status, out dir, output)} of every script run, launched at once and awaited together."""
    import gpu  # benchmarks/gpu.py: the random Qwen2.5-0.5B-shaped checkpoint and its --data

    work = tmp_path_factory.mktemp("gpu-tier")
    shape = gpu.QWEN25_05B if DEVICE == "cuda" else gpu.SMOKE_SHAPE
    checkpoint, data, _ = gpu.build_model_and_data(shape, work)
    reward = f"{ROOT / 'benchmarks' / 'real_size.py'}:completion_length"
    real = ["--model", str(checkpoint), "--data", str(data), "--reward", reward, *REAL]
    py = [sys.executable]
    cmds = {}
    for s in SCRIPTS:
        cmds[f"{s} tiny"] = [[*py, f"{s}.py", *TINY, "--steps", "3"]]
        cmds[f"{s} 0.5b"] = [[*py, f"{s}.py", *real, "--steps", "3"]]
    # stopped after step 1 (its checkpoint), then resumed to step 3: against "gspo tiny"
    cmds["gspo resumed"] = [[*py, "gspo.py", *TINY, "--steps", "1", "--save-every", "1"],
                            [*py, "gspo.py", "--resume", "{out}", "--steps", "3"]]  # fmt: skip
    one = [*torchrun_cmd(), "--standalone", "--nproc_per_node", "1"]
    cmds["torchrun gspo"] = [[*one, "gspo.py", *TINY, "--steps", "2"]]
    cmds["torchrun gspo --fsdp"] = [[*one, "gspo.py", *TINY, "--steps", "2", "--fsdp"]]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    procs = {}
    for name, steps in cmds.items():
        out = work / name.replace(" ", "_")
        shell = " && ".join(
            subprocess.list2cmdline([*(a.replace("{out}", str(out)) for a in c), *(["--out", str(out)] if
                                    "--resume" not in c else []), "--device", DEVICE])
            for c in steps
        )  # fmt: skip
        log = open(work / f"{name.replace(' ', '_')}.log", "w")
        procs[name] = (subprocess.Popen(shell, shell=True, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT),
                       out, log)  # fmt: skip
    deadline, results = time.monotonic() + RUN_LIMIT_S, {}
    for name, (proc, out, log) in procs.items():
        try:
            status = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            status = f"timeout after {RUN_LIMIT_S} s"
        log.close()
        results[name] = (status, out, (work / f"{name.replace(' ', '_')}.log").read_text())
    return results


def finished(runs, name, steps):
    status, out, output = runs[name]
    assert status == 0, f"{name}: exit {status}\n{output[-3000:]}"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "loss" in r]
    assert [r["step"] for r in trained] == list(range(1, steps + 1)), name
    assert all(torch.isfinite(torch.tensor(float(r["loss"]))) for r in trained), name
    return out


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("size", ["tiny", "0.5b"])
def test_three_steps_of_each_script(runs, script, size):
    out = finished(runs, f"{script} {size}", 3)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["peak_mem_mb"] > 0
    assert (out / "final" / "model.safetensors").is_file()


def test_stop_and_resume_is_bit_for_bit(runs):
    straight, resumed = finished(runs, "gspo tiny", 3), finished(runs, "gspo resumed", 3)
    a, b = (load_file(d / "final" / "model.safetensors") for d in (straight, resumed))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k}: the resumed run's final weights differ from the straight run's"


@pytest.mark.parametrize("name", ["torchrun gspo", "torchrun gspo --fsdp"])
def test_torchrun_on_one_process(runs, name):
    out = finished(runs, name, 2)
    assert (out / "final" / "model.safetensors").is_file()


# --- in process: the sampler against HF generate, and the bf16-autocast training forward ---


@pytest.fixture(scope="module")
def tiny(device):
    model, tok = common.load_model("tiny", device)
    return model.eval(), tok


def greedy_against_generate(model, tok):
    """(prompts, common.sample's greedy completions, HF generate's) of 32 arith prompts, 24 new tokens, each
    completion cut after its first EOS, both in `model`'s dtype."""
    train, _ = common.arith_split()
    prompts = common.encode_prompts(tok, train[:32])
    eos, pad, T = common.eos_token_ids(model, tok), tok.pad_token_id, 24
    ours = common.sample(model, prompts, T, eos, pad, greedy=True).completion_lists()
    return prompts, ours, greedy_generate(model, prompts, T, eos, pad)


def test_greedy_samples_equal_hf_generate_in_float32(tiny):
    """The tiny checkpoint's greedy completions, rows stopping at different steps, are generate's token for
    token (float32: the fused kernels' roundings do not flip a trained model's greedy choices)."""
    _, ours, theirs = greedy_against_generate(*tiny)
    assert ours == theirs


@pytest.mark.skipif(DEVICE != "cuda", reason="--cuda-graph records a CUDA graph")
def test_cuda_graph_samples_what_the_eager_step_samples(tiny):
    """--cuda-graph with a real CUDA graph (tests/test_cuda_graph.py runs a CPU stand-in): from the same seed, the tiny
    checkpoint's completions at temperature 1, rows stopping at different steps, are the eager step's."""
    model, tok = tiny
    prompts = common.encode_prompts(tok, common.arith_split()[0][:32])
    eos, pad = common.eos_token_ids(model, tok), tok.pad_token_id
    rolls = [common.sample(model, prompts, 24, eos, pad, generator=torch.Generator(DEVICE).manual_seed(0),
                           cuda_graph=graphed) for graphed in (False, True)]  # fmt: skip
    lengths = rolls[0].completion_mask.sum(1)
    assert lengths.min() < lengths.max(), "fixture: rows stop at different steps"
    assert rolls[1].completion_lists() == rolls[0].completion_lists()


def test_greedy_samples_in_bf16_part_from_hf_generate_only_at_near_ties(tiny):
    """Where a bf16 greedy row parts from generate's, the two tokens are a near-tie: their float32 logits within
    twice logit_tol at bfloat16 (capped at half the logit scale) plus float32's own."""
    model, tok = tiny
    prompts, ours, theirs = greedy_against_generate(copy.deepcopy(model).to(torch.bfloat16), tok)
    roll = common.Rollout.from_lists(prompts, ours, tok.pad_token_id, device=model.device)
    length, max_logit = logit_scale(model, roll)
    # at bfloat16's 2^-8 the first-order bound passes the logit scale itself: capped at half of it, as
    # test_gpu_paths.py caps the bf16 log-prob bound (a token picked by mistake is most often further off)
    bound = min(logit_tol(model.config, length, max_logit, torch.bfloat16), 0.5 * max_logit)
    bound += logit_tol(model.config, length, max_logit)
    parted = [(i, next(j for j, (a, b) in enumerate(zip(o, t)) if a != b)) for i, (o, t) in enumerate(zip(ours, theirs))
              if o != t]  # fmt: skip
    for i, j in parted:  # (two rows that agree token for token until one ends equal: the same EOS at the same step)
        prefix = torch.tensor([prompts[i] + ours[i][:j]], device=model.device)
        with torch.no_grad():
            z = model(input_ids=prefix).logits[0, -1].float()
        gap = (z[ours[i][j]] - z[theirs[i][j]]).abs().item()
        assert gap <= bound, f"row {i} parts from generate at token {j} by a logit gap of {gap:.3g} > {bound:.3g}"
    print(f"bf16 greedy: {len(parted)} of {len(ours)} rows part from generate's, each at a near-tie")


def test_bf16_autocast_training_logprobs_against_float32(tiny):
    """The training forward's bf16 autocast (the default on CUDA) against the same forward in float32:
    within logprob_tol at bfloat16's roundoff (capped: see test_gpu_paths.py), and not equal to it."""
    model, tok = tiny
    train, _ = common.arith_split()
    prompts = common.encode_prompts(tok, train[:16])
    roll = common.sample(model, prompts, 16, common.eos_token_ids(model, tok), tok.pad_token_id,
                         generator=torch.Generator(model.device).manual_seed(0))  # fmt: skip
    base, head = model.get_decoder(), model.get_output_embeddings().weight
    autocast = None if model.device.type == "cuda" else True  # CUDA's default; asked for on a CPU
    with torch.no_grad():
        low = common.logprobs_from_hidden(common.completion_hidden_states(base, roll, bf16=autocast), head,
                                          roll.completion_ids)[0]  # fmt: skip
        high = common.logprobs_from_hidden(common.completion_hidden_states(base, roll, bf16=False), head,
                                           roll.completion_ids)[0]  # fmt: skip
    mask = roll.completion_mask.bool()
    assert not torch.equal(low[mask], high[mask]), "the default CUDA forward ran in float32: no autocast"
    length, max_logit = logit_scale(model, roll)
    bound = min(logprob_tol(model.config, length, max_logit, torch.bfloat16), 0.5 * max_logit)
    assert_within(low[mask].cpu(), high[mask].cpu(), bound, "bf16-autocast log-probs against float32")
