"""Benchmark: gspo.py and grpo.py against TRL's GRPOTrainer (GSPO: importance_sampling_level="sequence";
GRPO: token level) on the same tiny checkpoint, prompts and sizes, CPU.

    pip install trl==1.16.0 -c <(pip freeze | grep -E '^(torch|transformers|tokenizers|numpy)==')
    python benchmarks/speed.py [--algos gspo,grpo] [--rounds 3] [--steps 4]

Ours against another copy of ours, no TRL needed (the same flags, alternating):

    python benchmarks/speed.py --against DIR [--defaults] [--algos gspo,grpo,ppo] [--rounds 3] [--steps 10]

DIR is another checkout (a `git worktree add` of an earlier commit, or a copy with one change); `--defaults` runs
each script at its own recipe (only --steps, --eval-every 0 and --eval-size 16 given; the last step, which
evaluates, is dropped with the first). Printed: each side's median step time and their ratio.

TRL is needed only for the comparison with TRL (it is not in requirements.txt); the constraint keeps pip from touching
torch and transformers (TRL 1.16.0 runs on transformers 5.23; its new dependencies are
accelerate, datasets, pandas, pyarrow and a few small ones).

One training step, both sides: 16 arith prompts x 8 completions (128), at most 32 new tokens,
temperature 1, the old log-probs of the rollout, then 4 minibatch updates of 32 completions
(AdamW, lr 3e-4 constant, grad-norm clip 1, no KL, no reference model), float32, no activation
checkpointing (TRL defaults to bf16 autocast and gradient checkpointing: both turned off here so
the two do the same work). GSPO clips at (3e-4, 4e-4), GRPO at 0.2 with the per-sequence token
mean (TRL loss_type="grpo").
  ours  `python gspo.py --steps N+1 --prompts-per-step 16 --group-size 8 --max-new-tokens 32
        --minibatches 4 --eval-every 0 --eval-size 16 --out TMP`, step_time_s from metrics.jsonl
  TRL   GRPOTrainer with generation_batch_size 128, per_device_train_batch_size 32,
        steps_per_generation 4 (so one generation feeds 4 optimizer steps), use_cpu; a callback
        times each cycle of 4 optimizer steps, a wrapper around model.generate times generation
Both run as fresh subprocesses at one torch thread (what common.load_model sets for the tiny
model), alternating ours/TRL --rounds times so machine drift hits both alike; the first step of
every process is warm-up and dropped. Printed: median step time, generated tokens per second
(completion tokens, EOS included, over the sampling time) and the ratios. Not collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS_PER_STEP, GROUP, MAX_NEW, MINIBATCHES = 16, 8, 32, 4
CLIP = {"gspo": (3e-4, 4e-4), "grpo": (0.2, 0.2)}


def run_ours(algo: str, steps: int, root: Path = ROOT, defaults: bool = False) -> dict:
    shape = [] if defaults else ["--prompts-per-step", PROMPTS_PER_STEP, "--group-size", GROUP, "--max-new-tokens",
                                 MAX_NEW, "--minibatches", MINIBATCHES]  # fmt: skip
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, root / f"{algo}.py", "--steps", steps + 1 + defaults, *shape, "--eval-every", 0,
               "--eval-size", 16, "--out", out, "--device", "cpu"]  # fmt: skip
        proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=root)
        if proc.returncode != 0:
            raise RuntimeError(f"{algo}.py failed: {proc.stderr.strip().splitlines()[-1:]}")
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    rows = rows[1 : len(rows) - defaults]  # the first step is warm-up; --defaults: the last evaluates
    return {
        "step_s": [r["step_time_s"] for r in rows],
        "tokens_per_s": [r["tokens_per_s"] for r in rows],
        "response_len": [r["response_len"] for r in rows],
    }


def against(args):
    """This tree's scripts and DIR's, alternating, at the same flags: median step times and their ratio."""
    other = Path(args.against).resolve()
    shape = "each script's defaults" if args.defaults else f"{PROMPTS_PER_STEP} prompts x {GROUP}, <= {MAX_NEW} tokens"
    print(f"{ROOT} against {other}; {shape}; {args.rounds} alternating rounds x {args.steps} timed steps")
    for algo in args.algos.split(","):
        steps = {"this": [], "other": []}
        for r in range(args.rounds):
            for side, root in (("this", ROOT), ("other", other)):
                res = run_ours(algo, args.steps, root, args.defaults)
                steps[side] += res["step_s"]
                print(f"  {algo} round {r + 1} {side:5}: step {statistics.median(res['step_s']):.4f} s", flush=True)
        this, that = statistics.median(steps["this"]), statistics.median(steps["other"])
        print(f"{algo}: this {this:.4f} s, other {that:.4f} s, this/other {this / that:.3f}")


def run_trl(algo: str, steps: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, __file__, "--trl-child", algo, "--steps", str(steps), "--result", f.name]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0:
            raise RuntimeError(f"TRL {algo} failed: {proc.stderr.strip().splitlines()[-3:]}")
        return json.loads(Path(f.name).read_text())


def trl_child(algo: str, steps: int, result: str):
    """One GRPOTrainer run of steps + 1 generation cycles (4 optimizer steps each)."""
    sys.path.insert(0, str(ROOT))
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import common

    common.seed_everything(0)
    model, tok = common.load_model("tiny", torch.device("cpu"))  # one thread, as gspo.py gets
    threads = torch.get_num_threads()
    eos_ids = common.eos_token_ids(model, tok)
    train, _ = common.arith_split()
    cycles = steps + 1
    dataset = Dataset.from_list(
        [{"prompt": ex["prompt"], "answer": ex["answer"]} for ex in train[: PROMPTS_PER_STEP * cycles]]
    )

    def reward(prompts, completions, answer, **kwargs):
        return [common.score(c, a)[0] for c, a in zip(completions, answer)]

    gen_times, gen_tokens, gen_threads = [], [], []
    generate = model.generate

    def timed_generate(*args, **kwargs):  # TRL calls unwrapped_model.generate(input_ids=..., ...)
        gen_threads.append(torch.get_num_threads())
        t0 = time.perf_counter()
        out = generate(*args, **kwargs)
        gen_times.append(time.perf_counter() - t0)
        completions = out[:, kwargs["input_ids"].shape[1] :]
        is_eos = torch.isin(completions, torch.tensor(eos_ids))
        first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, completions.shape[1])
        gen_tokens.append(int(first.sum()))
        return out

    model.generate = timed_generate
    stamps = []

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

    eps_low, eps_high = CLIP[algo]
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out,
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            eval_strategy="no",
            logging_steps=10_000,
            disable_tqdm=True,
            seed=0,
            data_seed=0,
            dataloader_num_workers=0,
            max_steps=MINIBATCHES * cycles,
            learning_rate=3e-4,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            max_grad_norm=1.0,
            num_generations=GROUP,
            max_completion_length=MAX_NEW,
            generation_batch_size=PROMPTS_PER_STEP * GROUP,
            per_device_train_batch_size=PROMPTS_PER_STEP * GROUP // MINIBATCHES,
            gradient_accumulation_steps=1,
            num_iterations=1,
            temperature=1.0,
            top_p=1.0,
            beta=0.0,
            epsilon=eps_low,
            epsilon_high=eps_high,
            loss_type="grpo",
            scale_rewards="group",
            importance_sampling_level="sequence" if algo == "gspo" else "token",
            log_completions=False,
            bf16=False,
            fp16=False,
            gradient_checkpointing=False,  # TRL's defaults differ: same work as ours
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=config,
            train_dataset=dataset,
            processing_class=tok,
            callbacks=[Clock()],
        )
        trainer.train()
    assert len(stamps) == MINIBATCHES * cycles + 1, len(stamps)
    cycle_s = [stamps[MINIBATCHES * (k + 1)] - stamps[MINIBATCHES * k] for k in range(cycles)]
    Path(result).write_text(
        json.dumps(
            {
                "step_s": cycle_s[1:],
                "tokens_per_s": [n / t for n, t in zip(gen_tokens, gen_times)][1:],
                "response_len": [n / (PROMPTS_PER_STEP * GROUP) for n in gen_tokens][1:],
                "threads": threads,
                "threads_at_generation": sorted(set(gen_threads)),
            }
        )
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--algos", default="gspo,grpo")
    ap.add_argument("--rounds", type=int, default=3, help="ours/TRL alternations per algorithm")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per process (plus one warm-up)")
    ap.add_argument("--against", help="another checkout of this project: compare with it instead of TRL")
    ap.add_argument("--defaults", action="store_true", help="with --against: each script's own default recipe")
    ap.add_argument("--trl-child", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_child:
        trl_child(args.trl_child, args.steps, args.result)
        return
    if args.against:
        against(args)
        return

    import trl

    print(
        f"TRL {trl.__version__}; {PROMPTS_PER_STEP} prompts x {GROUP} completions, <= {MAX_NEW} new tokens, "
        f"{MINIBATCHES} minibatch updates per step; {args.rounds} alternating rounds x {args.steps} timed steps"
    )
    summary = []
    for algo in args.algos.split(","):
        runs = {"ours": [], "trl": []}
        for r in range(args.rounds):
            for side, fn in (("ours", run_ours), ("trl", run_trl)):
                res = fn(algo, args.steps)
                runs[side].append(res)
                print(
                    f"  {algo} round {r + 1} {side:4}: step {statistics.median(res['step_s']):.2f} s, "
                    f"{statistics.median(res['tokens_per_s']):.0f} generated tok/s, "
                    f"mean completion {statistics.mean(res['response_len']):.1f} tokens",
                    flush=True,
                )
        med = {
            side: {k: statistics.median(x for res in rs for x in res[k]) for k in ("step_s", "tokens_per_s")}
            for side, rs in runs.items()
        }
        summary.append((algo, med))

    print(
        f"\n{'algo':5} {'ours step s':>12} {'TRL step s':>11} {'ours/TRL':>9} "
        f"{'ours tok/s':>11} {'TRL tok/s':>10} {'ratio':>6}"
    )
    for algo, med in summary:
        o, t = med["ours"], med["trl"]
        print(
            f"{algo:5} {o['step_s']:12.2f} {t['step_s']:11.2f} {o['step_s'] / t['step_s']:8.2f}x "
            f"{o['tokens_per_s']:11.0f} {t['tokens_per_s']:10.0f} {o['tokens_per_s'] / t['tokens_per_s']:5.2f}x"
        )
    print("ours/TRL step time: lower is better (target <= 0.8); tok/s ratio: higher is better")


if __name__ == "__main__":
    main()
