"""Step time of each script under torchrun, data parallel (DDP) against sharded (--fsdp), side by side.

    python benchmarks/fsdp.py                        # 2 ranks on CPU (gloo), the shipped tiny model
    python benchmarks/fsdp.py --nproc 4 --device cuda --model DIR --steps 10 -- --max-new-tokens 256

Each run is `torchrun --nproc_per_node N <script>.py [--fsdp] --steps S --eval-every 0 ...` in its own
process group; the table gives the median of metrics.jsonl's step_time_s over the steps after the first
(the first holds FSDP2's lazy initialisation), the rollout's tokens/s and the peak memory of rank 0
(summary.json). The runs sample the same completions with and without --fsdp, so the difference is
what sharding costs: an all-gather of each layer in every forward and backward, a reduce-scatter of
its gradients, and the whole policy gathered for each rollout. Arguments after `--` go to every run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(script: str, fsdp: bool, args, extra: list[str], out: Path) -> dict:
    cmd = ["torchrun", "--standalone", "--nproc_per_node", str(args.nproc), str(ROOT / f"{script}.py"),
           "--model", args.model, "--device", args.device, "--steps", str(args.steps), "--eval-every", "0",
           "--eval-size", str(args.nproc), "--trace-every", "0", "--out", str(out), *extra]  # fmt: skip
    if fsdp:
        cmd.append("--fsdp")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=args.timeout)
    if proc.returncode != 0:
        return {"status": f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1][:80]}"}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    return {
        "status": "ok",
        "step_s": statistics.median(r["step_time_s"] for r in rows[1:]),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows[1:]),
        "peak_mb": summary["peak_mem_mb"],
        "final_reward": rows[-1]["reward"],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--scripts", default="gspo,grpo,ppo")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per run")
    args, extra = ap.parse_known_args()
    extra = [a for a in extra if a != "--"]
    print(f"torchrun --nproc_per_node {args.nproc}, --model {args.model}, --device {args.device}, "
          f"{args.steps} steps, each script's defaults {' '.join(extra)}", flush=True)  # fmt: skip
    print(f"{'script':<6} {'mode':<5} {'step s (median)':>15} {'rollout tok/s':>13} {'peak MB r0':>10} {'reward':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for script in args.scripts.split(","):
            for fsdp in (False, True):
                r = run(script, fsdp, args, extra, Path(tmp) / f"{script}-{fsdp}")
                mode = "fsdp" if fsdp else "ddp"
                if r["status"] != "ok":
                    print(f"{script:<6} {mode:<5} {r['status']}", flush=True)
                    continue
                print(f"{script:<6} {mode:<5} {r['step_s']:>15.3f} {r['tokens_per_s']:>13.0f} {r['peak_mb']:>10.0f} "
                      f"{r['final_reward']:>7.3f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
