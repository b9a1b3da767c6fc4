"""experiments/sums_task.py: the long `sums` task of the staleness and rollout-mismatch studies, whose
completions' length depends on the problem (docs/staleness.md), and the data tiny-sums was warm-started on.

The scripts read it as two JSONL files (`write_split`) with the flags the task needs (`task_flags`):
    python grpo.py $(python experiments/sums_task.py data) --steps 20     (writes data/sums_*.jsonl once)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

# --- The built-in `sums` task: long completions whose length depends on the problem ------
# "7+5+9+4=" -> "7+5=12 12+9=21 21+4=25 #### 25": the running total after each term, then the final
# answer. 2-6 one-digit terms, so a correct completion is 12-46 characters (tokens, with the
# character tokenizer; 36 on average) and grows with the number of terms (docs/staleness.md); the
# exact reward reads the number after '####'. Prompts are distinct, so few have 2 or 3 terms.

SUMS_GENERATOR = dict(seed=4321, train_size=20000, eval_size=500, min_terms=2, max_terms=6, max_term=9)


def sums_reference(prompt: str) -> str:
    """The reference completion of a `sums` prompt: each running total written out, then '#### total'."""
    terms = [int(x) for x in prompt.rstrip("=").split("+")]
    steps, total = [], terms[0]
    for x in terms[1:]:
        steps.append(f"{total}+{x}={total + x}")
        total += x
    return " ".join(steps) + f" #### {total}"


def sums_split():
    """(train, held-out eval) of the `sums` task: distinct prompts drawn once from a fixed seed, so
    the two parts never share a prompt and every run sees the same split."""
    g = SUMS_GENERATOR
    rng = np.random.RandomState(g["seed"])
    seen, examples = set(), []
    while len(examples) < g["train_size"] + g["eval_size"]:
        terms = rng.randint(0, g["max_term"] + 1, rng.randint(g["min_terms"], g["max_terms"] + 1))
        prompt = "+".join(str(x) for x in terms) + "="
        if prompt not in seen:
            seen.add(prompt)
            examples.append({"prompt": prompt, "answer": str(int(terms.sum()))})
    return examples[g["eval_size"] :], examples[: g["eval_size"]]


# The flags the task needs (flags given after them win): the arithmetic defaults would break `sums` (8 new
# tokens cut every completion short; at lr 3e-4 on-policy GRPO fell from 0.265 to 0.135 held-out in 20
# steps, at 1e-4 it rose to 0.280; docs/staleness.md).
TASK_DEFAULTS = {"model": "tiny-sums", "max_new_tokens": 64, "lr": 1e-4}


def task_flags(folder) -> list[str]:
    """The command-line flags that train on `sums` from the split `write_split(folder)` wrote: --data and
    --eval-data, then TASK_DEFAULTS."""
    defaults = [str(x) for k, v in TASK_DEFAULTS.items() for x in ("--" + k.replace("_", "-"), v)]
    return ["--data", str(Path(folder) / "sums_train.jsonl"), "--eval-data", str(Path(folder) / "sums_eval.jsonl"),
            *defaults]  # fmt: skip


def write_split(folder):
    """`sums_split()` as FOLDER/sums_train.jsonl and FOLDER/sums_eval.jsonl (once: files already there stay)."""
    for part, records in zip(("train", "eval"), sums_split(), strict=True):
        path = Path(folder) / f"sums_{part}.jsonl"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.with_suffix(".tmp").write_text("".join(json.dumps(r) + "\n" for r in records))
            path.with_suffix(".tmp").replace(path)  # never a half-written file for a later run to read


if __name__ == "__main__":  # python experiments/sums_task.py DIR: writes the split to DIR, prints the flags
    folder = sys.argv[1] if len(sys.argv) > 1 else "data"
    write_split(folder)
    print(" ".join(task_flags(folder)))
