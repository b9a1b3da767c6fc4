"""The share of a training step's wall-clock that sampling (`Sampler.sample`) and scoring (the reward)
take, in one process: both wrapped in timers, their sums set against metrics.jsonl's step_time_s
(evaluations excluded). Prints one JSON line. docs/results.md (dynamic sampling) quotes it:

    RLREF_THREADS=1 python experiments/step_share.py grpo --steps 40 --eval-every 0 --eval-size 8 --out /tmp/share
    RLREF_THREADS=1 python experiments/step_share.py grpo --filter-groups --steps 40 ... --out /tmp/share-f

Every flag after the script's name is the script's own.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import common  # noqa: E402


def main(argv: list[str]):
    script, flags = importlib.import_module(argv[0]), argv[1:]
    spent = {"sample": 0.0, "score": 0.0}
    sample, setup = common.Sampler.sample, common.setup

    def timed_sample(self, *a, **k):  # training's sampling only: evaluation calls common.sample itself
        t = time.perf_counter()
        roll = sample(self, *a, **k)
        spent["sample"] += time.perf_counter() - t
        return roll

    def timed_setup(*a, **k):
        env = setup(*a, **k)
        reward_fn = env.reward_fn

        class Timed:  # the reward, timed in the steps only (evaluation's scoring is outside step_time_s)
            def __getattr__(self, name):
                return getattr(reward_fn, name)

            def __call__(self, *x, **y):
                t = time.perf_counter()
                out = reward_fn(*x, **y)
                if getattr(common.Sampler, "_in_step", False):  # the round's scoring, once: the step's
                    spent["score"] += time.perf_counter() - t
                common.Sampler._in_step = False
                return out

        env.reward_fn = Timed()
        return env

    def stepping(self, *a, **k):  # a training round: the sample, then its scoring, are the step's
        common.Sampler._in_step = True
        return timed_sample(self, *a, **k)

    common.Sampler.sample, common.setup = stepping, timed_setup
    try:
        common.main(script.train, script.Args, argv=flags)
    except SystemExit as e:
        if e.code:
            raise
    out = common.parse_args(script.Args, flags).out
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    step = sum(r["step_time_s"] for r in rows)
    print(json.dumps({"steps": len(rows), "step_s": round(step, 2), "sample_s": round(spent["sample"], 2),
                      "score_s": round(spent["score"], 2), "sample_share": round(spent["sample"] / step, 3),
                      "score_share": round(spent["score"] / step, 4)}))  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
