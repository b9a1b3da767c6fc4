"""Benchmark: peak resident memory of whole runs at Qwen's vocabulary, like for like, and of one training step.

    python benchmarks/memory.py                       # the three scripts' whole runs, side by side
    python benchmarks/memory.py --phases              # also where each run's memory goes, phase by phase
    python benchmarks/memory.py --step                # one training step, chunked log-probs against naive
    python benchmarks/memory.py --step --only chunked # skip the memory-hungry naive runs (~10+ GB)

Whole runs (the default): a randomly initialised Qwen3 with the embedded tiny model's trunk (hidden
128, 4 layers, tied embeddings) and Qwen's 151,936-token vocabulary (a word-level tokenizer of that
size), saved as a local checkpoint; then each script, through its normal command line, in a process
of its own: one step of 8 prompts x 8 samples x 256 new tokens, one minibatch, evaluation on 8
prompts before and after. The reward is `text_hash_reward` (through --reward), a pseudo-random
function of the completion's text: a random model earns no exact-match reward, and with it GRPO and
GSPO would skip every row (advantage 0) and flatter themselves. The run's zero_std_frac (0: every
row is updated) is printed beside its peak RSS, the child's ru_maxrss (os.wait4). --phases runs each
script under a profiler (`profile`) that samples RSS every 2 ms in a thread and prints the RSS after
each phase (model loading, sampling, reward, log-probs, forward, backward, optimizer step,
evaluation) and the peak inside it.

One step (--step): the previous measure, a tiny trunk (hidden 64, 2 layers) at the same vocabulary and
a fixed rollout of --batch completions of --tokens tokens each (every token real: the worst case).
One training step of each script's loss (`training_step`):
  old log-probs of the whole rollout (no grad; PPO also the frozen reference's and the critic's values),
  then one minibatch (--batch / --minibatches completions): log-probs with grad, the script's loss
  (gspo.gspo_loss, grpo.grpo_loss, ppo.ppo_policy_loss + ppo.value_loss through a ppo.Critic),
  backward, gradient clipping and an AdamW step (the other minibatches would only repeat it).
Log-probs go through common.completion_logprobs with chunk_tokens="auto" ("chunked":
common.LOGITS_CHUNK_ELEMENTS logits per chunk) or None ("naive": the whole [tokens, vocabulary]
float32 logits at once). The naive pass over all 64 completions at once would need about 30 GB, so
its old log-probs are taken minibatch by minibatch (the update's own size); the chunked path takes
them all at once, as the scripts do. Each configuration runs in a fresh subprocess and reports its
peak RSS (resource.getrusage ru_maxrss) and the RSS before the step (model, optimizer, rollout).
The child limits its own address space (--limit-gb) so that a naive run that would exhaust the
machine fails with an allocation error instead of waking the OOM killer. Not collected by pytest.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
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
    if given, is called after each phase. Returns the last loss. Shared with benchmarks/gpu.py."""
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

        sys.path.insert(0, str(ROOT / "tools"))
        from build_checkpoints import build_char_tokenizer

        ref_model = Qwen3ForCausalLM(config).eval().requires_grad_(False)
        ref_model.load_state_dict(model.state_dict())
        with tempfile.TemporaryDirectory() as tmp:  # ppo.Critic loads its trunk from a checkpoint
            model.save_pretrained(tmp)
            build_char_tokenizer().save_pretrained(tmp)
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


def text_hash_reward(prompts, completions, **fields) -> list[float]:
    """A reward with variance for a random model (a --reward function): the completion text's CRC32,
    scaled to [0, 1). Deterministic, so every script sees the same rewards for the same text."""
    import zlib

    return [zlib.crc32(c.encode()) % 1000 / 1000 for c in completions]


def build_vocab_checkpoint(path: Path) -> Path:
    """The embedded tiny Qwen3's configuration with Qwen's vocabulary, random weights, and a
    word-level tokenizer of that size (the tiny model's characters first, so arith prompts encode)."""
    sys.path.insert(0, str(ROOT))
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    sys.path.insert(0, str(ROOT / "tools"))
    import recipes

    names = [recipes.PAD, recipes.EOS] + recipes.TINY_CHARS + ["<unk>"]
    names += [f"<t{i}>" for i in range(VOCAB - len(names))]
    core = Tokenizer(models.WordLevel({t: i for i, t in enumerate(names)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=recipes.PAD, eos_token=recipes.EOS,
                                  unk_token="<unk>", padding_side="left")  # fmt: skip
    config = {**recipes.TINY_CONFIG, "vocab_size": VOCAB, "max_position_embeddings": 1024}
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**config, pad_token_id=0, eos_token_id=1, bos_token_id=None))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def run_command(algo: str, model_dir: Path, out: Path, args) -> list[str]:
    """The script's normal command line for one step at the benchmark's shape."""
    return [
        f"{algo}.py", "--model", str(model_dir), "--steps", "1", "--prompts-per-step", str(args.prompts),
        "--group-size", str(args.samples), "--max-new-tokens", str(args.tokens), "--minibatches", "1",
        "--reward", f"{Path(__file__).resolve()}:text_hash_reward", "--eval-size", str(args.eval_size),
        "--eval-every", "0", "--out", str(out),
    ]  # fmt: skip


@functools.cache
def _mallinfo2():
    """glibc's mallinfo2 with its result type, or None (not glibc, or glibc before 2.33)."""
    import ctypes

    fields = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except AttributeError:
        return None
    mallinfo2.restype = type("mallinfo2", (ctypes.Structure,), {"_fields_": [(f, ctypes.c_size_t) for f in fields]})
    return mallinfo2


def live_bytes() -> int:
    """Bytes that malloc has handed out and not had back (mallinfo2: in-use heap chunks plus mmapped
    ones), 0 without mallinfo2. RSS above it is memory freed but kept by the allocator."""
    mallinfo2 = _mallinfo2()
    if mallinfo2 is None:
        return 0
    m = mallinfo2()
    return m.uordblks + m.hblkhd


PHASE_FUNCTIONS = ("load_model", "sample", "evaluate", "completion_logprobs")


def profile(argv: list[str]):
    """Run the script `argv[0]` with its arguments in this process, printing each phase's RSS after it
    and the peak RSS inside it (GB), sampled every 2 ms by a thread: the calls to common's
    PHASE_FUNCTIONS, Rewards.__call__, Tensor.backward and AdamW.step (tracemalloc would not see
    torch's allocations). Beside each, the bytes malloc has handed out and not had back (`live_bytes`),
    after the phase and at its peak: RSS minus live is memory the allocator keeps after a free."""
    import runpy
    import threading

    import psutil

    sys.path.insert(0, str(ROOT))
    import torch

    import common

    process, peak, live_peak, phases = psutil.Process(), [0], [0], []

    def poll():
        while True:
            peak[0] = max(peak[0], process.memory_info().rss)
            live_peak[0] = max(live_peak[0], live_bytes())
            time.sleep(0.002)

    def mark(name):
        rss, live = process.memory_info().rss, live_bytes()
        phases.append((name, rss / 2**30, max(peak[0], rss) / 2**30, live / 2**30, max(live_peak[0], live) / 2**30))
        peak[0], live_peak[0] = rss, live

    def wrapped(owner, name, label):
        fn = getattr(owner, name)

        def call(*a, **k):
            mark(f"(before {label})")
            out = fn(*a, **k)
            mark(label)
            return out

        setattr(owner, name, call)

    threading.Thread(target=poll, daemon=True).start()
    for name in PHASE_FUNCTIONS:
        wrapped(common, name, name)
    wrapped(common.Rewards, "__call__", "reward")
    wrapped(torch.Tensor, "backward", "backward")
    wrapped(torch.optim.AdamW, "step", "AdamW.step")
    mark("imports")
    sys.argv = argv
    try:
        runpy.run_path(str(ROOT / argv[0]), run_name="__main__")
    finally:
        mark("end")
        print("PHASES " + json.dumps(phases), flush=True)


def run_script(algo: str, model_dir: Path, args) -> dict:
    """One whole run in a process of its own: its peak RSS (ru_maxrss of that child alone), wall time,
    zero_std_frac and loss (metrics.jsonl) and, with --phases, its phase lines."""
    with tempfile.TemporaryDirectory() as out:
        argv = run_command(algo, model_dir, Path(out) / algo, args)
        cmd = [sys.executable, __file__, "--profile", *argv] if args.phases else [sys.executable, *argv]
        log = Path(out) / "log"
        t0 = time.perf_counter()
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage (RUSAGE_CHILDREN: the max of all)
            proc.returncode = os.waitstatus_to_exitcode(status)
        result = {"algo": algo, "peak_gb": usage.ru_maxrss / 2**20, "wall_s": time.perf_counter() - t0}
        stdout, metrics = log.read_text(), Path(out) / algo / "metrics.jsonl"
        if proc.returncode or not metrics.is_file():
            tail = (stdout.strip().splitlines() or ["?"])[-1]
            return {**result, "error": f"exit {proc.returncode}: {tail[:160]}"}
        row = json.loads(metrics.read_text().splitlines()[-1])
        result.update(zero_std_frac=row.get("zero_std_frac"), loss=row.get("loss"))
        for line in stdout.splitlines():
            if line.startswith("PHASES "):
                result["phases"] = json.loads(line[len("PHASES ") :])
    return result


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


def whole_runs(args):
    """The default: each script's whole run at the benchmark's shape, peak RSS side by side."""
    algos = args.algos.split(",")
    print(
        f"Qwen3 (hidden 128, 4 layers) with a {VOCAB:,}-token vocabulary, random weights; one step of {args.prompts} "
        f"prompts x {args.samples} samples x {args.tokens} new tokens, 1 minibatch, eval on {args.eval_size} prompts; "
        f"reward text_hash_reward; {args.jobs} run(s) at a time"
    )
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_vocab_checkpoint(Path(tmp) / "qwen3-vocab")
        print("  " + " ".join(["python"] + run_command("ALGO", model_dir, Path("OUT"), args)), flush=True)
        with ThreadPoolExecutor(args.jobs) as pool:
            results = dict(zip(algos, pool.map(lambda a: run_script(a, model_dir, args), algos)))
    for algo in algos:
        r = results[algo]
        print(f"\n{algo}: " + (r["error"] if "error" in r else f"peak {r['peak_gb']:.2f} GB, {r['wall_s']:.0f} s"))
        for name, rss, peak, live, live_peak in r.get("phases", []):
            print(f"  {name:34} RSS after {rss:5.2f} GB   peak inside {peak:5.2f} GB   "
                  f"live after {live:5.2f} GB   peak inside {live_peak:5.2f} GB")  # fmt: skip
    print(f"\n{'':28}" + "".join(f"{a:>8}" for a in algos))
    table = [("peak RSS, GB", "peak_gb", "{:.2f}"), ("zero_std_frac (0: all rows)", "zero_std_frac", "{:g}"),
             ("loss", "loss", "{:.4f}"), ("wall, s", "wall_s", "{:.0f}")]  # fmt: skip
    for label, key, fmt in table:
        cells = ["-" if results[a].get(key) is None else fmt.format(results[a][key]) for a in algos]
        print(f"{label:28}" + "".join(f"{c:>8}" for c in cells))


def main():
    if sys.argv[1:2] == ["--profile"]:  # a child of --phases: run the script given after it under `profile`
        profile(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", nargs=2, metavar=("ALGO", "MODE"), help=argparse.SUPPRESS)
    ap.add_argument("--algos", default=",".join(ALGOS))
    ap.add_argument("--phases", action="store_true", help="whole runs: also RSS phase by phase (profile)")
    ap.add_argument("--jobs", type=int, default=1, help="whole runs: how many run at once (each its own process)")
    ap.add_argument("--prompts", type=int, default=8, help="whole runs: prompts per step")
    ap.add_argument("--samples", type=int, default=8, help="whole runs: samples per prompt")
    ap.add_argument("--eval-size", type=int, default=8, help="whole runs: evaluation prompts")
    ap.add_argument("--step", action="store_true", help="one training step, chunked against naive (the old measure)")
    ap.add_argument("--only", choices=("chunked", "naive"), default=None, help="--step: one of the two")
    ap.add_argument("--batch", type=int, default=64, help="--step: completions")
    ap.add_argument("--tokens", type=int, default=256, help="completion tokens (whole runs: --max-new-tokens)")
    ap.add_argument("--minibatches", type=int, default=4, help="--step: minibatches")
    ap.add_argument("--prompt-len", type=int, default=16, help="--step: prompt tokens")
    ap.add_argument(
        "--chunk-tokens",
        type=lambda s: s if s == "auto" else int(s),
        default="auto",
        help="--step: chunk size of the chunked path (default: common's auto sizing)",
    )
    ap.add_argument("--limit-gb", type=float, default=20.0, help="--step: address-space limit of each child")
    args = ap.parse_args()
    if args.child:
        child(*args.child, args.batch, args.tokens, args.minibatches, args.prompt_len, args.chunk_tokens)
    elif args.step:
        one_step(args)
    else:
        whole_runs(args)


def one_step(args):
    """--step: one training step of each algorithm, chunked and naive log-probs."""
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
