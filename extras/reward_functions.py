"""extras/reward_functions.py: your own --reward functions (module:function or file.py:function) and
--reward-model, imported and called with every check a user's code needs (common.Rewards, docs/rewards.md).

A function has TRL's signature and is called by keyword, once per batch of B completions:

    f(prompts=[str] * B, completions=[str] * B, **fields) -> [float | None] * B

NaN, infinity, a value that is not a number, a list of the wrong length or an exception inside it stop
the run: RewardError, one line naming the function, the problem and the row, exit status 2.
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

from common import RewardError, UsageError, _clip, _describe


def import_function(spec: str, source: str, attr: str):
    """The function `attr` of module `source` ("package.module" or "path/to/file.py") of --reward `spec`."""
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
    return fn


def call(name, fn, records, completions, columns) -> torch.Tensor:
    """[B] float rewards of `fn` on `completions` of `records` (each record's `columns` passed by name; None:
    does not apply, counted 0); anything that is not a reward raises RewardError naming the row."""
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
            raise RewardError(
                f"--reward {name} returned {_clip(v)} ({type(v).__name__}) for {at(i)}: expected a number or None"
            )
        if v is not None and not math.isfinite(v):
            raise RewardError(
                f"--reward {name} returned {v} for {at(i)}: rewards must be finite (None: not applicable)"
            )
    return torch.tensor([0.0 if v is None else float(v) for v in values])


def _raises(fn, prompts, completions, fields, i) -> bool:
    """Does `fn` raise on row i alone? (to name the row an exception came from)"""
    try:
        fn(
            prompts=prompts[i : i + 1],
            completions=completions[i : i + 1],
            **{k: v[i : i + 1] for k, v in fields.items()},
        )
    except Exception:
        return True
    return False
