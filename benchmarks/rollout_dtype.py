"""Benchmark: rollouts in bfloat16 against float32 (--rollout-dtype), the scripts' own sampler.

    python benchmarks/rollout_dtype.py [--repeats 5] [--device cpu|cuda] [--threads 1]

The training shape (64 prompts x 4 samples from arith_split()'s training part, sampled at
temperature 1 with mu recorded, as the scripts do) through common.Sampler, for three models: the
shipped tiny checkpoint (8 new tokens), the same at 64 new tokens with EOS off, and a random Qwen3
of hidden size 512 (8 layers, about 25M parameters; 64 new tokens, EOS off), where reading the
weights and the cache weighs more. Each (model, dtype) runs in a fresh subprocess, so that
its peak memory is its own: generated tokens per second (median of --repeats after one warm-up)
and the peak memory added by sampling (CPU: peak resident set size over the resident size before
the first rollout; CUDA: torch.cuda.max_memory_allocated over the allocation before it). The CPU's
bf16 flags are printed first: without avx512_bf16 / amx_bf16 bf16 matmuls are emulated and may be
slower than float32. Not collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from cli import ArgumentParser  # noqa: E402  (one-line errors, exit status 2)

MODELS = {  # name -> (new tokens, EOS on)
    "tiny": (8, True),
    "tiny-64": (64, False),
    "qwen3-512": (64, False),
}
BIG = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
           num_key_value_heads=4, head_dim=64, max_position_embeddings=512, tie_word_embeddings=True)  # fmt: skip


def cpu_bf16_flags() -> str:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    wanted = ("avx512_bf16", "amx_bf16", "avx512f", "avx2")
    return ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in wanted)


def one(name: str, dtype: str, device: str, repeats: int) -> dict:
    dev = torch.device(device)
    model, tok = common.load_model("tiny", dev)
    if name == "qwen3-512":
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        config = AutoConfig.for_model("qwen3", vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                                      eos_token_id=tok.eos_token_id, **BIG)  # fmt: skip
        model = AutoModelForCausalLM.from_config(config).to(dev)
    new_tokens, eos_on = MODELS[name]
    flags = types.SimpleNamespace(rollout_dtype=dtype, old_logp="recompute", is_correction="tis",  # mu recorded
                                  max_new_tokens=new_tokens, temperature=1.0, top_p=1.0, cuda_graph=False)  # fmt: skip
    sampler = common.Sampler(model, tok, flags)
    sampler.eos_ids = sampler.eos_ids if eos_on else []  # without EOS: every row samples new_tokens
    examples = common.arith_split()[0][:64]
    prompts, _ = common.prompts_and_records(tok, examples, 4, "")
    g = torch.Generator(dev).manual_seed(0)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rates = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        roll = sampler.sample(prompts, g)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if i:  # the first is the warm-up
            rates.append(roll.completion_mask.sum().item() / (time.perf_counter() - t0))
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    params = sum(p.numel() for p in model.parameters())
    return {"tokens_per_s": statistics.median(rates), "peak_mb": peak / 2**20, "params": params}


def main():
    ap = ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--one", nargs=2, metavar=("MODEL", "DTYPE"), help=argparse.SUPPRESS)  # one setting, as JSON
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.one:
        print(json.dumps(one(*a.one, a.device, a.repeats)))
        return
    print(f"device {a.device}, torch {torch.__version__}, {a.threads} thread(s); CPU bf16 flags: {cpu_bf16_flags()}")
    print(f"{'model':12} {'params':>8} {'new tok':>8} {'f32 tok/s':>10} {'bf16 tok/s':>11} {'ratio':>6} "
          f"{'f32 peak MB':>12} {'bf16 peak MB':>13}")  # fmt: skip
    for name, (new_tokens, _) in MODELS.items():
        res = {}
        for dtype in ("float32", "bfloat16"):
            cmd = [sys.executable, __file__, "--one", name, dtype, "--device", a.device, "--repeats", str(a.repeats),
                   "--threads", str(a.threads)]  # fmt: skip
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            res[dtype] = json.loads(out.strip().splitlines()[-1])
        f, b = res["float32"], res["bfloat16"]
        print(f"{name:12} {f['params'] / 1e6:>7.1f}M {new_tokens:>8} {f['tokens_per_s']:>10.0f} "
              f"{b['tokens_per_s']:>11.0f} {b['tokens_per_s'] / f['tokens_per_s']:>6.2f} {f['peak_mb']:>12.1f} "
              f"{b['peak_mb']:>13.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
