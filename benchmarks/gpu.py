"""GPU benchmark, the project's first GPU run: the three scripts end to end (tiny, and at Qwen2.5-0.5B's
shape against the memory planner), under torchrun with and without --fsdp, and the sampler against
Hugging Face's generate with one training step per loss. One table, within --time-budget seconds.

    bash benchmarks/gpu.sh                # one CUDA GPU, no network: about 5 minutes, hard-bound at 6
    python benchmarks/gpu.py --cpu-smoke  # every row at tiny sizes on CPU (1-2 minutes): does it run?

First (b)-(d)'s model is built: random weights from Qwen2.5-0.5B's published config (tools/plan_memory.py's
QWEN_CONFIGS: Qwen2ForCausalLM, hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864, vocabulary
151,936, tied embeddings), saved in a temporary directory with real_size.build_checkpoint's tokenizer
(the tiny char tokenizer's entries, then filler tokens up to 151,936: the char tokenizer alone decodes
every id past its 99 to '', so a random model's completions would all read as empty), and beside it
--data, 80 arith prompts. Then the rows, each in a subprocess of its own (killed with every process
it started at its time limit, ROW_LIMIT_S, or at the end of the budget): a failure or a timeout is that
row's status, with the line of its output that says why below the table, and the next row still
runs; a row with under MIN_ROW_S seconds of the budget left is skipped. In order:
 (a) gspo.py, grpo.py, ppo.py --model tiny --steps 3 --eval-size 16 (the shipped checkpoint).
 (b) the same scripts on that model: 3 steps of 8 prompts x 4 samples x 128 new tokens, 2 minibatches,
     --eval-size 8, --lr 1e-6. The reward is real_size.completion_length: a random model never answers
     correctly, and with exact-match rewards GRPO and GSPO would skip every row and never run backward.
 (d) torchrun --standalone --nproc_per_node 1 gspo.py at (b)'s shape and flags, without --fsdp and with
     it (FSDP2's fully_shard; until the scripts have the flag, that row shows their usage error).
 (c) one subprocess on the same model: rollouts of --batch (64) rows x --new-tokens (256) after
     left-padded random prompts of --prompt-len/2 .. --prompt-len (128) tokens, by common.sample
     (greedy, and at temperature 1, the training setting; greedy again with --cuda-graph, each decode step
     one replayed CUDA graph, against the eager step: on CUDA only, unmeasured so far) and HF model.generate
     (greedy), EOS disabled
     so that every row makes --new-tokens tokens; the median of --repeats (2) after one warm-up, and
     how many greedy rows generate makes identical to common.sample's (bf16 kernels can break
     near-ties differently: a few differing rows are not a bug). Then one training step of each loss
     (benchmarks/memory.py's `training_step`: old log-probs of the greedy rollout, then --minibatches
     (4) updates of backward and AdamW) with float32 log-probs through the output projection in
     chunks sized to the GPU ("chunked": common.logits_chunk_elements, ~1,770 tokens on a 139 GiB H200) or
     all at once ("naive"); the median of 2 after one warm-up.
     Each row is printed as it is measured, so a timeout keeps the rows before it.
Columns: wall s, the whole process (start-up, loading, evaluation and the final save included), or in
(c) one rollout or step; steps/s over the scripts' own step times (metrics.jsonl's step_time_s:
rollout, reward and update; evaluation excluded; step 1 includes the warm-up); tok/s, the median
step's rollout tokens per second (metrics.jsonl's tokens_per_s), in (c) generated or trained tokens
per second; peak GB, the run's summary.json peak_mem_mb (torch.cuda.max_memory_allocated on CUDA,
the peak RSS on CPU), in (c) the allocation peak of that rollout or step; plan GB,
tools/plan_memory.py's `plan_memory` for the same shape, flags and device (one training step: the
evaluation's sampling is smaller). --cpu-smoke: device cpu; the model a random Qwen2 of hidden 64, 2
layers and a 1,024-entry vocabulary; (b) and (d) at 2 prompts x 2 samples x 8 new tokens; (c) at 8 x 8.

Expected on one H200 (nothing here has run on a GPU yet): the checkpoint ~20 s, (a) ~40 s, (b) ~90 s,
(d) ~70 s, (c) ~75 s: about 5 minutes, within the 330 s default budget.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tools"))
import real_size  # noqa: E402
from memory import training_step  # noqa: E402
from plan_memory import QWEN_CONFIGS, count_parameters, model_shape, plan_memory  # noqa: E402

import common  # noqa: E402

SCRIPTS = ("gspo", "grpo", "ppo")
QWEN25_05B = QWEN_CONFIGS["qwen2.5-0.5b"]
SMOKE_SHAPE = dict(QWEN25_05B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=1024)  # fmt: skip
TINY_FLAGS = dict(model="tiny", steps=3, eval_size=16)  # (a)
SMOKE_TINY_FLAGS = dict(TINY_FLAGS, prompts_per_step=8, eval_size=8)  # (a) under --cpu-smoke: does it run?
# (b) and (d): every script's flags at the 0.5B shape, and --cpu-smoke's smaller ones
REAL_SHAPE_FLAGS = dict(
    steps=3, prompts_per_step=8, group_size=4, max_new_tokens=128, minibatches=2, eval_size=8, lr=1e-6, seed=0
)
SMOKE_FLAGS = dict(REAL_SHAPE_FLAGS, prompts_per_step=2, group_size=2, max_new_tokens=8, eval_size=4)
ROW_LIMIT_S = {"a": 45, "b": 90, "d": 90, "c": 120}  # each row's own time limit (the budget may cut it shorter)
MIN_ROW_S = 15  # a row is not started with less of the budget left
CHILD_ENV = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


@dataclasses.dataclass
class Row:
    part: str  # "a" .. "d", as in the docstring
    name: str
    status: str = "ok"  # ok, exit N, timeout N s, failed[: exception], skipped (out of time), interrupted
    wall_s: float | None = None
    steps_per_s: float | None = None
    tokens_per_s: float | None = None
    peak_gb: float | None = None
    planned_gb: float | None = None
    note: str = ""
    why: str = ""  # a failed row: the line of its output that says why


# ---- the rows: each a subprocess ----------------------------------------------------------------


def flags(values: dict) -> list[str]:
    return [arg for key, value in values.items() for arg in (f"--{key.replace('_', '-')}", str(value))]


def run_limited(cmd: list[str], limit_s: float, log: Path, stdout: Path | None = None) -> tuple[str, float]:
    """Run `cmd`, output to `log` (stdout to `stdout` if given), killed with every process it started
    after `limit_s` seconds: (status, wall seconds). In a session of its own, so that gpu.sh's SIGINT
    reaches this process alone, which then kills the row's processes and prints the table."""
    t0 = time.perf_counter()
    with open(log, "w") as log_file, open(stdout or os.devnull, "w") as stdout_file:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=CHILD_ENV, stdout=stdout_file if stdout else log_file,
                                stderr=log_file, start_new_session=True)  # fmt: skip
        try:
            code = proc.wait(timeout=limit_s)
            status = "ok" if code == 0 else f"exit {code}"
        except subprocess.TimeoutExpired:
            status = f"timeout {limit_s:.0f} s"
        finally:  # timed out, or this process interrupted
            if proc.poll() is None:
                for pid in process_tree(proc.pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                proc.wait()
    return status, time.perf_counter() - t0


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants, from /proc (Linux). A process group is not enough: torchrun starts
    its workers in sessions of their own, and they outlive a killed launcher."""
    children = collections.defaultdict(list)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # after "pid (name) state"
        except (OSError, IndexError, ValueError):  # a process that ended meanwhile
            continue
        children[parent].append(int(stat.parent.name))
    tree = [pid]
    for member in tree:  # grows as it goes: breadth first
        tree += children[member]
    return tree


def failure_reason(log: Path) -> str:
    """The line of a failed row's output that says why: the scripts' own one-line 'error: ...' (exit 2:
    bad flags or input), else the last line naming an exception (not torchrun's ChildFailedError,
    which only reports its worker's), else the last line."""
    lines = [line.strip() for line in re.split(r"[\r\n]", log.read_text(errors="replace")) if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    exceptions = [line for line in lines if re.match(r"[\w.]*(Error|Exception)\b", line) and "ChildFailed" not in line]
    return (errors[:1] or exceptions[-1:] or lines[-1:] or ["(no output)"])[0][:300]


def script_row(part: str, name: str, cmd: list[str], out: Path, limit_s: float, planned_gb=None) -> Row:
    """One script run: its status and wall time, and what its metrics.jsonl and summary.json hold
    (a run stopped by its time limit still shows the steps it finished)."""
    log = out.with_suffix(".log")
    status, wall = run_limited([*cmd, "--out", str(out)], limit_s, log)
    row = Row(part, name, status, wall, planned_gb=planned_gb)
    metrics_file, summary_file = out / "metrics.jsonl", out / "summary.json"
    steps = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
    if steps:
        row.steps_per_s = len(steps) / sum(step["step_time_s"] for step in steps)
        row.tokens_per_s = statistics.median(step["tokens_per_s"] for step in steps)
    if summary_file.exists():
        row.peak_gb = json.loads(summary_file.read_text())["peak_mem_mb"] / 1024
    if status != "ok":
        row.why = failure_reason(log)
    shutil.rmtree(out, ignore_errors=True)  # its final/ alone is 2 GB at the 0.5B shape
    return row


def in_process_rows(checkpoint: Path, work: Path, limit_s: float) -> list[Row]:
    """(c): this file again, with --in-process, which writes one JSON row per line to its stdout."""
    rows_file, log = work / "in_process.jsonl", work / "in_process.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--in-process", str(checkpoint)]
    status, wall = run_limited(cmd, limit_s, log, stdout=rows_file)
    lines = [line for line in rows_file.read_text().splitlines() if line.startswith("{")]
    rows = [Row(**json.loads(line)) for line in lines]
    if status != "ok":  # the rows it finished, then what stopped it
        rows.append(Row("c", "sampler and training step", status, wall, why=failure_reason(log)))
    return rows


# ---- (c), inside the --in-process subprocess ---------------------------------------------------------


def timed(fn, device, repeats: int):
    """Median seconds of fn() over `repeats` runs after one warm-up, and its last result."""
    out = fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_reset(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gb(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def emit(row: Row):
    print(json.dumps(dataclasses.asdict(row)), flush=True)


def failed(e: Exception) -> str:
    return f"failed: {e.__class__.__name__}"


def measure_in_process(args, checkpoint: str):
    """(c) on the model saved at `checkpoint`, float32 as the scripts keep it (load_model: TF32
    matmuls on CUDA; the training forward under bf16 autocast): rollouts, then training steps;
    each row printed (emit) as soon as it is measured."""
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    model, tok = common.load_model(checkpoint, device)
    pad = tok.pad_token_id
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.prompt_len // 2, args.prompt_len + 1, (args.batch,), generator=g).tolist()
    prompts = [torch.randint(2, model.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    T, B = args.new_tokens, args.batch

    gen = torch.Generator(device).manual_seed(0)
    samplers = {
        "common.sample": lambda: common.sample(model, prompts, T, [], pad, greedy=True).completion_ids,
        "common.sample, temperature 1": lambda: (
            common.sample(model, prompts, T, [], pad, temperature=1.0, generator=gen).completion_ids
        ),
    }
    graphed = "common.sample, --cuda-graph"  # the greedy rollout again, each decode step one replayed CUDA graph
    if device.type == "cuda":  # (--cpu-smoke: no such row)
        samplers[graphed] = lambda: (
            common.sample(model, prompts, T, [], pad, greedy=True, cuda_graph=True).completion_ids
        )
    if not args.skip_generate:
        batch = common.Rollout.from_lists(prompts, [[]] * B, pad, device)

        def generate():
            with torch.no_grad():
                out = model.generate(input_ids=batch.prompt_ids, attention_mask=batch.prompt_mask, max_new_tokens=T,
                                     do_sample=False, eos_token_id=[], pad_token_id=pad)  # fmt: skip
            return out[:, batch.prompt_ids.shape[1] :]

        samplers["HF model.generate"] = generate
    rollout_rows, outputs = {}, {}
    for name, fn in samplers.items():
        peak_reset(device)
        try:
            seconds, outputs[name] = timed(fn, device, args.repeats)
            rollout_rows[name] = Row("c", name, wall_s=seconds, tokens_per_s=B * T / seconds, peak_gb=peak_gb(device))
        except Exception as e:  # report it and measure the rest
            rollout_rows[name] = Row("c", name, failed(e), why=common._describe(e))
    generate_row = rollout_rows.get("HF model.generate")
    for row in rollout_rows.values():
        if row.tokens_per_s and generate_row is not None and generate_row.tokens_per_s:
            row.note = f"{row.tokens_per_s / generate_row.tokens_per_s:.2f}x generate"
    if "common.sample" in outputs and "HF model.generate" in outputs:
        same = int((outputs["HF model.generate"] == outputs["common.sample"]).all(1).sum())
        generate_row.note = f"{same}/{B} greedy rows as common.sample's"
    if graphed in outputs and "common.sample" in outputs and rollout_rows["common.sample"].tokens_per_s:
        same = int((outputs[graphed] == outputs["common.sample"]).all(1).sum())
        speedup = rollout_rows[graphed].tokens_per_s / rollout_rows["common.sample"].tokens_per_s
        note = f"{speedup:.2f}x the eager step, {same}/{B} rows as its"
        rollout_rows[graphed].note = "; ".join(filter(None, [note, rollout_rows[graphed].note]))
    for row in rollout_rows.values():
        emit(row)
    if "common.sample" not in outputs:
        return  # no rollout to train on: the rows above say why

    roll = common.Rollout.from_lists(prompts, outputs["common.sample"].tolist(), pad, device)  # full length, all real
    rewards = torch.randint(0, 2, (B,), generator=g).float().to(device)
    import ppo

    for algo in args.algos.split(","):
        # PPO: the frozen reference and the critic (a second trunk, as ppo.Critic loads it)
        ref_model = common.load_model(checkpoint, device)[0].requires_grad_(False) if algo == "ppo" else None
        critic = ppo.Critic(checkpoint, device) if algo == "ppo" else None
        for mode in args.modes.split(","):
            name = f"train step {algo} {mode}"
            params = list(model.parameters()) + (list(critic.parameters()) if critic is not None else [])
            optimizer = torch.optim.AdamW(params, lr=1e-6)
            # partial binds this configuration's objects now (a closure would read the loop variables,
            # and the names deleted below, whenever it ran)
            step = functools.partial(
                training_step,
                algo,
                model,
                roll,
                rewards,
                chunk_tokens="auto" if mode == "chunked" else None,
                minibatches=args.minibatches,
                updates=args.minibatches,
                optimizer=optimizer,
                ref_model=ref_model,
                critic=critic,
            )
            peak_reset(device)
            try:
                seconds, _ = timed(step, device, 1 if args.cpu_smoke else 2)
                note = f"old logp + {args.minibatches} updates"
                emit(Row("c", name, wall_s=seconds, tokens_per_s=B * T / seconds, peak_gb=peak_gb(device), note=note))
            except Exception as e:  # out of memory, or anything else: report it and measure the rest
                emit(Row("c", name, failed(e), why=common._describe(e)))
            del step, optimizer  # the AdamW state goes before the next configuration's peak is measured
            model.zero_grad(set_to_none=True)
            if critic is not None:
                critic.zero_grad(set_to_none=True)
        del ref_model, critic


# ---- the table -------------------------------------------------------------------------------------


def print_table(rows: list[Row]):
    def number(x, digits):
        return "-" if x is None else f"{x:.{digits}f}"

    header = ("part", "row", "status", "wall s", "steps/s", "tok/s", "peak GB", "plan GB", "note")
    print("\n{:4} {:36} {:12} {:>7} {:>8} {:>9} {:>8} {:>8}  {}".format(*header))
    for r in rows:
        figures = [number(r.wall_s, 1), number(r.steps_per_s, 2), number(r.tokens_per_s, 0)]
        figures += [number(r.peak_gb, 2), number(r.planned_gb, 2)]
        print("({})  {:36} {:12} {:>7} {:>8} {:>9} {:>8} {:>8}  {}".format(r.part, r.name, r.status, *figures, r.note))
    for r in rows:
        if r.why:
            print(f"({r.part}) {r.name}: {r.why}")


def build_model_and_data(shape: dict, work: Path) -> tuple[Path, Path, int]:
    """(b)-(d)'s random checkpoint and --data file in `work`, and the longest prompt in tokens."""
    checkpoint, data = work / "model", work / "arith.jsonl"
    real_size.build_checkpoint(shape, checkpoint)
    records = common.arith_split()[0][:80]
    data.write_text("".join(json.dumps(record) + "\n" for record in records))
    return checkpoint, data, max(len(record["prompt"]) for record in records)  # a character-level tokenizer


def jobs(args, work: Path, t_start: float) -> tuple[Row, list]:
    """The row of (b)-(d)'s checkpoint, built here, and every other row's job, in the order they run:
    (part, name, measure(limit_s) -> Row or [Row]). Without a checkpoint, (b)-(d) have no jobs."""
    device = "cpu" if args.cpu_smoke else "cuda"
    gpu_memory = None if args.cpu_smoke else torch.cuda.get_device_properties(0).total_memory  # sizes the chunks
    shape, script_flags = (SMOKE_SHAPE, SMOKE_FLAGS) if args.cpu_smoke else (QWEN25_05B, REAL_SHAPE_FLAGS)
    todo = []
    for script in SCRIPTS:
        name = f"{script}.py --model tiny"
        tiny = SMOKE_TINY_FLAGS if args.cpu_smoke else TINY_FLAGS
        cmd = [sys.executable, str(ROOT / f"{script}.py"), *flags(tiny), "--device", device]
        todo.append(("a", name, functools.partial(script_row, "a", name, cmd, work / f"a-{script}")))
    build = Row("b", "random checkpoint and --data")
    try:
        checkpoint, data, prompt_tokens = build_model_and_data(shape, work)
    except Exception as e:
        build.status, build.why = "failed", common._describe(e)
    build.wall_s = time.monotonic() - t_start
    if build.status != "ok":
        return build, todo

    reward = f"{ROOT / 'benchmarks' / 'real_size.py'}:completion_length"
    real_shape = ["--model", str(checkpoint), "--data", str(data), "--reward", reward, "--device", device]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
    runs = [("b", f"{script}.py", script, [sys.executable, str(ROOT / f"{script}.py")], None) for script in SCRIPTS]
    runs += [("d", "torchrun gspo.py", "gspo", [*torchrun, str(ROOT / "gspo.py")], "ddp")]
    runs += [("d", "torchrun gspo.py --fsdp", "gspo", [*torchrun, str(ROOT / "gspo.py"), "--fsdp"], "fsdp")]
    for part, name, algo, launch, parallel in runs:  # parallel: the planner's DDP or FSDP2 on one rank
        rows_per_step = script_flags["prompts_per_step"] * script_flags["group_size"]
        plan = plan_memory(shape, algo, rows_per_step, prompt_tokens, script_flags["max_new_tokens"],
                           script_flags["minibatches"], device=device, parallel=parallel,
                           gpu_memory=gpu_memory)  # fmt: skip
        cmd = [*launch, *real_shape, *flags(script_flags)]
        out = work / f"{part}-{name.replace(' ', '_')}"
        todo.append((part, name, functools.partial(script_row, part, name, cmd, out, planned_gb=plan["peak"] / 2**30)))
    todo.append(("c", "sampler and training step", functools.partial(in_process_rows, checkpoint, work)))
    return build, todo


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="every row at tiny sizes on CPU: checks that it runs")
    ap.add_argument("--time-budget", type=float, default=330, help="seconds for all rows; later rows are skipped")
    ap.add_argument("--algos", default="gspo,grpo,ppo", help="(c): the losses of the training-step rows")
    ap.add_argument("--modes", default="chunked,naive", help="(c): log-probs in chunks, or all at once")
    ap.add_argument("--batch", type=int, default=64, help="(c): rollout rows")
    ap.add_argument("--new-tokens", type=int, default=256, help="(c)")
    ap.add_argument("--prompt-len", type=int, default=128, help="(c): the longest prompt")
    ap.add_argument("--minibatches", type=int, default=4, help="(c): the training step's updates")
    ap.add_argument("--repeats", type=int, default=2, help="(c): rollouts timed after the warm-up")
    ap.add_argument("--skip-generate", action="store_true", help="(c): leave HF generate out")
    ap.add_argument("--in-process", metavar="CHECKPOINT", help="internal: run (c) here, rows to stdout")
    args = ap.parse_args()
    if args.cpu_smoke:
        args.batch, args.new_tokens, args.prompt_len, args.repeats = 8, 8, 8, 1
    elif not torch.cuda.is_available():
        sys.exit("error: no CUDA device (use --cpu-smoke to try it on CPU)")
    if args.in_process:
        return measure_in_process(args, args.in_process)

    t_start = time.monotonic()
    import transformers

    shape = SMOKE_SHAPE if args.cpu_smoke else QWEN25_05B
    params = sum(count_parameters(model_shape(shape)).values())
    where = "CPU (--cpu-smoke)" if args.cpu_smoke else torch.cuda.get_device_name(0)
    print(f"{where}; torch {torch.__version__}, transformers {transformers.__version__}; (b)-(d): a random Qwen2 of "
          f"{params / 1e6:.1f}M parameters; budget {args.time_budget:.0f} s", flush=True)  # fmt: skip
    rows: list[Row] = []

    def report(row: Row):
        rows.append(row)
        print(f"  ({row.part}) {row.name}: {row.status}, {row.wall_s or 0:.0f} s", flush=True)

    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as tmp:
        try:
            build, todo = jobs(args, Path(tmp), t_start)
            report(build)
            for part, name, measure in todo:
                left = args.time_budget - (time.monotonic() - t_start)
                if left < MIN_ROW_S:
                    report(Row(part, name, "skipped", why=f"out of time: {left:.0f} s of --time-budget left"))
                    continue
                new = measure(min(ROW_LIMIT_S[part], left))
                for row in new if isinstance(new, list) else [new]:
                    report(row)
        except KeyboardInterrupt:  # gpu.sh's hard bound: the table of what finished
            report(Row("-", "the rest", "interrupted"))
    print_table(rows)
    print(f"total {time.monotonic() - t_start:.0f} s")


if __name__ == "__main__":
    main()
