"""Benchmark: peak resident memory of one training step, chunked log-probs against the plain ones.

    python tests/bench_memory.py                 # every algorithm, chunked and naive (naive needs ~10+ GB)
    python tests/bench_memory.py --only chunked  # skip the memory-hungry naive runs

A randomly initialised Qwen3 with Qwen's 151,936-token vocabulary but a tiny trunk (hidden 64,
2 layers, tied embeddings) on CPU, and a rollout of --batch completions of --tokens tokens each
(every token real: the worst case). One training step of each script's loss (`training_step`):
  old log-probs of the whole rollout (no grad; PPO also the frozen reference's and the critic's values),
  then one minibatch (--batch / --minibatches completions): log-probs with grad, the script's loss
  (gspo.gspo_loss, grpo.grpo_loss, ppo.ppo_policy_loss + ppo.value_loss through a ppo.Critic),
  backward, gradient clipping and an AdamW step (the other minibatches would only repeat it).
Log-probs go through common.completion_logprobs with chunk_tokens="auto" ("chunked": ~440 tokens
per chunk at this vocabulary) or None ("naive": the whole [tokens, vocabulary] float32 logits at
once). The naive pass over all 64 completions at once would need about 30 GB, so its old log-probs
are taken minibatch by minibatch (the update's own size); the chunked path takes them all at once,
as the scripts do.

Each configuration runs in a fresh subprocess (so one's peak cannot hide another's), and reports
its peak RSS (resource.getrusage ru_maxrss) and the RSS before the step (model, optimizer, rollout).
The child limits its own address space (--limit-gb) so that a naive run that would exhaust the
machine fails with an allocation error instead of waking the OOM killer. Not collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALGOS = ("gspo", "grpo", "ppo")
VOCAB = 151_936


def rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def current_rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def training_step(
    algo: str,
    model,
    roll,
    rewards,
    *,
    chunk_tokens,
    minibatches: int,
    optimizer,
    updates: int = 1,
    ref_model=None,
    critic=None,
    group: int = 8,
    mark=None,
) -> float:
    """One training step of `algo` as its script runs it, on a fixed rollout: old log-probs of the
    whole rollout (PPO also the reference's log-probs, the critic's values and GAE), then `updates`
    of the `minibatches` minibatch updates (log-probs with grad, the script's loss, backward,
    gradient clipping, optimizer step). With chunk_tokens=None the old log-probs are taken one
    minibatch at a time (the whole rollout at once would need about 4x the memory). `mark(phase)`,
    if given, is called after each phase. Returns the last loss. Shared with tests/gpu_bench.py."""
    import torch

    import common
    import grpo
    import gspo
    import ppo

    mark = mark or (lambda phase: None)
    mask = roll.completion_mask
    order = torch.arange(len(roll), device=mask.device).chunk(minibatches)

    def logprobs(m, r):
        return common.completion_logprobs(m, r, 1.0, chunk_tokens=chunk_tokens)[0]

    def whole_rollout(m):
        return logprobs(m, roll) if chunk_tokens is not None else torch.cat([logprobs(m, roll[idx]) for idx in order])

    with torch.no_grad():
        old_logp = whole_rollout(model)
        if algo == "ppo":
            ref_logp = whole_rollout(ref_model)
            old_values = critic(roll) * mask
            token_rewards = ppo.token_rewards(rewards, old_logp, ref_logp, mask, 0.01)
            advantages, returns = ppo.gae(token_rewards, old_values, mask)
            advantages = ppo.whiten(advantages, mask)
        else:
            advantages = (gspo if algo == "gspo" else grpo).group_advantages(rewards, group)
    mark("old_logprobs")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for idx in order[:updates]:
        mb = roll[idx]
        logp = logprobs(model, mb)
        if algo == "gspo":
            loss, _ = gspo.gspo_loss(logp, old_logp[idx], advantages[idx], mask[idx])
        elif algo == "grpo":
            loss, _ = grpo.grpo_loss(logp, old_logp[idx], advantages[idx], mask[idx], max_len=mask.shape[1])
        else:
            pg_loss, _ = ppo.ppo_policy_loss(logp, old_logp[idx], advantages[idx], mask[idx])
            v_loss, _ = ppo.value_loss(critic(mb), old_values[idx], returns[idx], mask[idx])
            loss = pg_loss + 0.1 * v_loss
        mark("forward")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        mark("backward")
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
    return loss.item()


def child(algo: str, mode: str, batch: int, tokens: int, minibatches: int, prompt_len: int, chunk_tokens: int):
    """One training step in this fresh process; prints a JSON line with the memory figures."""
    sys.path.insert(0, str(ROOT))
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import common

    torch.manual_seed(0)
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    model = Qwen3ForCausalLM(config)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, VOCAB, (batch, prompt_len), generator=g).tolist()
    completions = torch.randint(2, VOCAB, (batch, tokens), generator=g).tolist()
    roll = common.Rollout.from_lists(prompts, completions, pad_id=0)
    rewards = torch.randint(0, 2, (batch,), generator=g).float()
    params = list(model.parameters())
    ref_model = critic = None
    if algo == "ppo":
        import ppo

        ref_model = Qwen3ForCausalLM(config).eval().requires_grad_(False)
        ref_model.load_state_dict(model.state_dict())
        with tempfile.TemporaryDirectory() as tmp:  # ppo.Critic loads its trunk from a checkpoint
            model.save_pretrained(tmp)
            common.build_char_tokenizer().save_pretrained(tmp)
            critic = ppo.Critic(tmp, torch.device("cpu"))
        params += list(critic.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-5)

    before = current_rss_gb()
    phases = {}  # the running peak after each phase: which one sets it

    def mark(phase):
        phases[phase] = rss_gb()

    t0 = time.perf_counter()
    loss = training_step(
        algo,
        model,
        roll,
        rewards,
        chunk_tokens=chunk_tokens if mode == "chunked" else None,
        minibatches=minibatches,
        optimizer=optimizer,
        ref_model=ref_model,
        critic=critic,
        mark=mark,
    )
    print(
        json.dumps(
            {
                "algo": algo,
                "mode": mode,
                "before_gb": before,
                "peak_gb": rss_gb(),
                "phases": phases,
                "step_s": time.perf_counter() - t0,
                "loss": loss,
            }
        )
    )


def mem_available_gb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return float("inf")


def run_child(algo, mode, args):
    limit = int(args.limit_gb * 2**30)

    def set_limit():  # in the child, before exec: an allocation past it fails, the OOM killer stays asleep
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    cmd = [
        sys.executable,
        __file__,
        "--child",
        algo,
        mode,
        "--batch",
        str(args.batch),
        "--tokens",
        str(args.tokens),
        "--minibatches",
        str(args.minibatches),
        "--prompt-len",
        str(args.prompt_len),
        "--chunk-tokens",
        str(args.chunk_tokens),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=set_limit)
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            return json.loads(line)
    tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
    return {"algo": algo, "mode": mode, "error": f"exit {proc.returncode}: {tail[:160]}"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", nargs=2, metavar=("ALGO", "MODE"), help=argparse.SUPPRESS)
    ap.add_argument("--algos", default=",".join(ALGOS))
    ap.add_argument("--only", choices=("chunked", "naive"), default=None)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--minibatches", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument(
        "--chunk-tokens",
        type=lambda s: s if s == "auto" else int(s),
        default="auto",
        help="chunk size of the chunked path (default: common's auto sizing)",
    )
    ap.add_argument("--limit-gb", type=float, default=20.0, help="address-space limit of each child")
    args = ap.parse_args()
    if args.child:
        child(*args.child, args.batch, args.tokens, args.minibatches, args.prompt_len, args.chunk_tokens)
        return

    modes = [m for m in ("chunked", "naive") if args.only in (None, m)]
    print(
        f"Qwen3 vocab {VOCAB}, hidden 64, 2 layers; {args.batch} completions x {args.tokens} tokens "
        f"(+{args.prompt_len} prompt), one step with a {args.batch // args.minibatches}-completion minibatch update"
    )
    results = {}
    for algo in args.algos.split(","):
        for mode in modes:
            if mode == "naive" and mem_available_gb() < 14:
                results[algo, mode] = {"error": f"skipped: only {mem_available_gb():.1f} GB available"}
                continue
            r = run_child(algo, mode, args)
            results[algo, mode] = r
            detail = (
                f"peak {r['peak_gb']:.2f} GB (before the step {r['before_gb']:.2f}; running peak after "
                + ", ".join(f"{k} {v:.2f}" for k, v in r["phases"].items())
                + f"), {r['step_s']:.0f} s"
                if "error" not in r
                else r["error"]
            )
            print(f"  {algo:5} {mode:8} {detail}", flush=True)

    def cell(r):
        return f"{r['peak_gb']:.2f}" if "error" not in r else "failed"

    print(f"\npeak RSS of one training step, GB (chunked: chunk_tokens={args.chunk_tokens})")
    print(f"{'algo':6} {'chunked':>8} {'naive':>8}")
    for algo in args.algos.split(","):
        print(
            f"{algo:6} "
            + " ".join(f"{cell(results[algo, m]) if (algo, m) in results else '-':>8}" for m in ("chunked", "naive"))
        )


if __name__ == "__main__":
    main()
