"""Benchmark: common.sample against Hugging Face's model.generate on the same model, prompts and settings.

    python benchmarks/sampler.py [--batch 64] [--new-tokens 64] [--repeats 7] [--threads 1]

The embedded tiny checkpoint on CPU, `--batch` prompts from arith_split()'s training part, greedy,
`--new-tokens` new tokens. Three settings:
  no-eos  EOS disabled in both (eos ids []), so every row generates exactly --new-tokens tokens
  eos     the model's EOS in both: rows stop early and at different steps
  groups  the training shape: --batch / 8 prompts, each repeated 8 times (a GRPO group), with EOS
Both samplers run in this one process at the same thread count, alternating, after one warm-up
each; the table shows the median over --repeats of generated tokens per second and the ratio, by
wall-clock time and by this process's CPU time.
Greedy outputs are checked to be identical (a mismatch is reported and makes the exit status 1).
Not collected by pytest (no test_ prefix).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402


def sample_lists(model, prompts, T, eos, pad):
    """common.sample, greedy: the completion token lists."""
    return common.sample(model, prompts, T, eos, pad, greedy=True).completion_lists()


def generate_lists(model, prompts, T, eos, pad):
    """model.generate, greedy, on the same left-padded prompts: the completion token lists."""
    batch = common.Rollout.from_lists(prompts, [[]] * len(prompts), pad)
    with torch.no_grad():
        out = model.generate(
            input_ids=batch.prompt_ids,
            attention_mask=batch.prompt_mask,
            max_new_tokens=T,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=pad,
        )[:, batch.prompt_ids.shape[1] :].tolist()
    # the completion is everything up to and including the first EOS id
    return [row[: next((i + 1 for i, t in enumerate(row) if t in eos), len(row))] for row in out]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: load_model's, 1 for tiny)")
    args = ap.parse_args()

    model, tok = common.load_model("tiny", torch.device("cpu"))
    if args.threads:
        torch.set_num_threads(args.threads)
    model.eval()
    train, _ = common.arith_split()
    distinct = common.encode_prompts(tok, train[: args.batch])
    grouped = [p for p in distinct[: args.batch // 8] for _ in range(8)]
    pad, T = tok.pad_token_id, args.new_tokens
    print(
        f"tiny checkpoint, CPU, {torch.get_num_threads()} thread(s), {args.batch} prompts x {T} new tokens, "
        f"greedy, median of {args.repeats} alternating repeats (one warm-up each)"
    )

    ok = True
    rows = []
    eos_ids = common.eos_token_ids(model, tok)
    for setting, prompts, eos in (("no-eos", distinct, []), ("eos", distinct, eos_ids), ("groups", grouped, eos_ids)):
        fns = {
            "common.sample": functools.partial(sample_lists, model, prompts, T, eos, pad),
            "model.generate": functools.partial(generate_lists, model, prompts, T, eos, pad),
        }
        results = {name: fn() for name, fn in fns.items()}  # warm-up, and the outputs to compare
        same = results["common.sample"] == results["model.generate"]
        ok &= same
        n_tokens = sum(map(len, results["common.sample"]))
        wall, cpu = {name: [] for name in fns}, {name: [] for name in fns}
        for _ in range(args.repeats):
            for name, fn in fns.items():
                t0, c0 = time.perf_counter(), time.process_time()
                fn()
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
        rows.append(
            (
                setting,
                n_tokens,
                {k: statistics.median(v) for k, v in wall.items()},
                {k: statistics.median(v) for k, v in cpu.items()},
                same,
            )
        )

    # CPU time (process_time) is the steadier figure on a shared machine: a descheduled process
    # accrues wall time but not CPU time
    print(
        f"\n{'setting':8} {'tokens':>6} {'clock':>5} {'sample tok/s':>13} {'generate tok/s':>15} "
        f"{'speedup':>8}  greedy equal"
    )
    for setting, n, wall, cpu, same in rows:
        for clock, med in (("wall", wall), ("cpu", cpu)):
            a, b = n / med["common.sample"], n / med["model.generate"]
            print(f"{setting:8} {n:6d} {clock:>5} {a:13.0f} {b:15.0f} {a / b:7.2f}x  {'yes' if same else 'NO'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
