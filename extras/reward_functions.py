"""extras/reward_functions.py: --reward boxed's answer parser, several --reward functions, --reward-weights, your own
functions and --reward-model (common.Rewards). A function has TRL's signature (docs/rewards.md), f(prompts=[str] * B,
completions=[str] * B, **fields) -> [float | None] * B; whatever is not a reward stops the run naming the row (exit 2).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
import os
from pathlib import Path

import numpy as np
import torch

from common import BUILTIN_REWARDS, RewardError, UsageError, _clip, _describe


def load_rewards(specs, weights, reward_model, reward_model_weight: float):
    """(names, functions, weights) of --reward `specs` (a built-in's function None: common.Rewards scores it) with
    their --reward-weights, and --reward-model's (one more component, weighed like the others) when given."""
    loaded = [(spec, None) if spec in BUILTIN_REWARDS else load_function(spec) for spec in specs]
    names = [name for name, _ in loaded]
    names = [name if names.count(name) == 1 else spec for name, spec in zip(names, specs)]  # a.py:f, b.py:f
    if len(set(names)) < len(names):
        raise UsageError(f"--reward: {', '.join(specs)} names a function twice; weigh it with --reward-weights")
    weights = list(weights) or [1.0] * len(specs)
    if len(weights) != len(specs):
        raise UsageError(f"--reward-weights: {len(weights)} weights for {len(specs)} rewards ({', '.join(specs)})")
    if not all(math.isfinite(w) for w in weights):
        raise UsageError(f"--reward-weights must be finite numbers, got {' '.join(map(str, weights))}")
    fns = [fn for _, fn in loaded]
    if reward_model is not None:
        if not math.isfinite(reward_model_weight):
            raise UsageError(f"--reward-model-weight must be a finite number, got {reward_model_weight}")
        names, fns, weights = names + ["reward_model"], fns + [reward_model], weights + [reward_model_weight]
    return names, fns, weights


def extract_boxed(completion: str) -> str | None:
    """The content of the last \\boxed{...}, braces balanced ("\\boxed{\\frac{1}{2}}" -> "\\frac{1}{2}");
    None when there is none or the last one is never closed."""
    start = completion.rfind("\\boxed{")
    if start < 0:
        return None
    depth, first = 1, start + len("\\boxed{")
    for i in range(first, len(completion)):
        depth += {"{": 1, "}": -1}.get(completion[i], 0)
        if depth == 0:
            return completion[first:i]
    return None


def load_function(spec: str):
    """(name, function) of --reward "package.module:function" or "path/to/file.py:function"."""
    source, _, attr = spec.rpartition(":")
    if not source or not attr:
        raise UsageError(f"--reward {spec}: unknown; expected {', '.join(BUILTIN_REWARDS)}, module:function or "
                         "file.py:function")  # fmt: skip
    try:
        if source.endswith(".py") or "/" in source or os.sep in source:
            path = Path(source).expanduser()
            if not path.is_file():
                raise UsageError(f"--reward {spec}: file {source} not found")
            module_spec = importlib.util.spec_from_file_location(f"reward_{path.stem}", path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(source)
    except UsageError:
        raise
    except Exception as e:  # ImportError, SyntaxError, or whatever the module raised at import
        raise UsageError(f"--reward {spec}: cannot import {source} ({_describe(e, first_sentence=False)})") from e
    fn = getattr(module, attr, None)
    if fn is None:
        raise UsageError(f"--reward {spec}: {source} has no function {attr!r}")
    if not callable(fn):
        raise UsageError(f"--reward {spec}: {attr} is a {type(fn).__name__}, not a function")
    return attr, fn


def call(name, fn, records, tok, roll, columns) -> torch.Tensor:
    """[B] float rewards of `fn` on the completions of `roll` (decoded without special tokens) of `records`, their
    `columns` passed by name (default: every field); None counts 0; anything not a reward raises RewardError."""
    completions = tok.batch_decode(roll.completion_lists(), skip_special_tokens=True)
    columns = columns or list(dict.fromkeys(k for r in records for k in r if k != "prompt"))
    prompts = [r["prompt"] for r in records]
    fields = {k: [r.get(k) for r in records] for k in columns}
    B = len(completions)

    def at(i):
        return f"row {i} (prompt {_clip(prompts[i])}, completion {_clip(completions[i])})"

    try:
        values = fn(prompts=prompts, completions=completions, **fields)
    except Exception as e:
        row = next((i for i in range(B) if _raises(fn, prompts, completions, fields, i)), None)
        where = f"on {at(row)}" if row is not None else f"on a batch of {B} (no single row raises alone)"
        raise RewardError(f"--reward {name} raised {_describe(e, first_sentence=False)} {where}") from e
    if isinstance(values, (torch.Tensor, np.ndarray)):
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise RewardError(f"--reward {name} returned {type(values).__name__}, expected a list of {B} numbers or None")
    if len(values) != B:
        raise RewardError(f"--reward {name} returned {len(values)} values for {B} completions (one per completion)")
    for i, v in enumerate(values):
        if v is not None and not isinstance(v, numbers.Real):
            raise RewardError(f"--reward {name} returned {_clip(v)} ({type(v).__name__}) for {at(i)}: expected a "
                              "number or None")  # fmt: skip
        if v is not None and not math.isfinite(v):
            raise RewardError(f"--reward {name} returned {v} for {at(i)}: rewards must be finite (None: not "
                              "applicable)")  # fmt: skip
    return torch.tensor([0.0 if v is None else float(v) for v in values])


def _raises(fn, prompts, completions, fields, i) -> bool:
    """Does `fn` raise on row i alone? (to name the row an exception came from)"""
    one = slice(i, i + 1)
    try:
        fn(prompts=prompts[one], completions=completions[one], **{k: v[one] for k, v in fields.items()})
    except Exception:
        return True
    return False
