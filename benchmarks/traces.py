"""Benchmark: the cost of --trace-every, on traced steps and on the others.

    python benchmarks/traces.py [--script gspo] [--steps 20] [--threads 1] [any script flag ...]

Runs the script in this process with --trace-every 2 (every other step traced; the default
traces only at evaluations) and --eval-every 0, timing the tracing code itself (extras/traces.py): Trace's constructor
(its no-grad forward of traced rows no update forwards), every trace.update call, and the records
written to traces.jsonl. Prints, for traced and untraced steps, the median step time (the step's
step_time_s plus the records' time, which log() spends after measuring it) and the median time
inside the tracing code, with its share of the step; and the size of traces.jsonl. CPU time of
this process is what it times (the machine may be shared). Not collected by pytest.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
from extras import traces  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--script", default="gspo", choices=("ppo", "grpo", "gspo"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args, rest = parser.parse_known_args()
    torch.set_num_threads(args.threads)
    module = importlib.import_module(args.script)
    spent = defaultdict(float)  # step -> seconds inside the tracing code

    def timed(fn, step_of):
        def wrapper(self, *a, **k):
            t0 = time.process_time()
            try:
                return fn(self, *a, **k)
            finally:
                spent[step_of(self)] += time.process_time() - t0

        return wrapper

    traces.Trace.__init__ = timed(traces.Trace.__init__, lambda trace: trace.step)
    traces.Trace.update = timed(traces.Trace.update, lambda trace: trace.step)
    traces.Trace.records = timed(traces.Trace.records, lambda trace: trace.step)
    step_cpu = {}  # step -> CPU seconds of the whole step
    original_log, original_bar = common.log_step, common.progress_bar

    def log(*a, **k):  # the step's CPU time, records included
        original_log(*a, **k)
        step = a[7]["step"] if len(a) > 7 else k["row"]["step"]  # log_step(args, env, model, tok, progress, ...)
        step_cpu[step] = time.process_time() - started[0]

    started = [0.0]

    def bar(*a, **k):
        for step in original_bar(*a, **k):
            started[0] = time.process_time()
            yield step

    common.log_step, common.progress_bar = log, bar
    with tempfile.TemporaryDirectory() as out:
        argv = ["--steps", str(args.steps), "--eval-every", "0", "--trace-every", "2", *rest, "--out", out]
        common.main(module.train, module.Args, argv=argv)
        size = (Path(out) / "traces.jsonl").stat().st_size
        traced = {json.loads(line)["step"] for line in (Path(out) / "traces.jsonl").read_text().splitlines()}
    rows = []
    for kind, steps_of_kind in (("traced", sorted(traced)), ("untraced", sorted(set(step_cpu) - traced))):
        steps_of_kind = [s for s in steps_of_kind if s not in (1, args.steps)]  # warm-up; the last evaluates
        step_time = statistics.median(step_cpu[s] for s in steps_of_kind)
        tracing = statistics.median(spent.get(s, 0.0) for s in steps_of_kind)
        rows.append((kind, len(steps_of_kind), step_time, tracing))
    print(f"{args.script}, {args.steps} steps, CPU time of this process ({args.threads} thread(s)):")
    print("| steps | n | median step time | median tracing time | share |")
    print("|---|---|---|---|---|")
    for kind, n, step_time, tracing in rows:
        print(
            f"| {kind} | {n} | {step_time * 1000:.0f} ms | {tracing * 1000:.2f} ms | {100 * tracing / step_time:.1f}% |"
        )
    print(
        f"traces.jsonl: {size / 1024:.0f} KiB for {len(traced)} traced steps ({size / 1024 / len(traced):.1f} KiB each)"
    )


if __name__ == "__main__":
    main()
