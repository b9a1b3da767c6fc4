"""extras/trackers.py: --report-to tensorboard, wandb or trackio: every number of metrics.jsonl also in a tracker.

Imported by common (its checks, RunLogger) only for that flag, and each tracker's package only for its own value:
a missing package is one line naming its install (exit status 2), before the model loads. metrics.jsonl stays the
record, the tracker a view of it: each row as metrics.jsonl holds it (rounded), every number at the row's step.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from common import UsageError

INSTALL = {"tensorboard": "pip install -r requirements.txt", "wandb": "pip install -r requirements-trackers.txt",
           "trackio": "pip install -r requirements-trackers.txt"}  # fmt: skip
PROJECT = "rl-reference"  # the wandb (WANDB_PROJECT overrides it) and trackio project; each run named by --out


def check_args(args):
    if importlib.util.find_spec(args.report_to) is None:
        raise UsageError(f"--report-to {args.report_to} needs the {args.report_to} package, not installed here: "
                         f"{INSTALL[args.report_to]}")  # fmt: skip


def numbers(row: dict) -> dict:
    """The row's numbers but its step: what a tracker plots."""
    return {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def open_tracker(name: str, out: Path, resumed: int | None, config: dict):
    """--report-to `name`'s tracker for the run in `out` (`resumed`: the checkpoint's step, else None)."""
    return {"tensorboard": TensorBoard, "wandb": Wandb, "trackio": Trackio}[name](out, resumed, config)


class TensorBoard:
    """OUT/tensorboard's event files; resumed from a checkpoint at step `resumed`, the events after it dropped."""

    def __init__(self, out: Path, resumed: int | None, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(out / "tensorboard"), purge_step=None if resumed is None else resumed + 1)

    def log(self, row: dict):
        for k, v in numbers(row).items():
            self.writer.add_scalar(k, v, row["step"])
        self.writer.flush()

    def close(self):
        self.writer.close()


class Wandb:
    """A Weights & Biases run, its files in OUT/wandb/ (WANDB_MODE=offline: only there, for `wandb sync`), the args
    as its config. Resumed, a new run of the same name from the checkpoint's step on (an offline run cannot resume).
    Its console capture is off: OUT/console.log keeps the console."""

    def __init__(self, out: Path, resumed: int | None, config: dict):
        import wandb

        project = os.environ.get("WANDB_PROJECT", PROJECT)
        settings = wandb.Settings(console="off")
        self.run = wandb.init(project=project, name=out.name, dir=out, config=config, settings=settings)

    def log(self, row: dict):
        self.run.log(numbers(row), step=row["step"])

    def close(self):
        self.run.finish()


class Trackio:
    """A trackio run in trackio's local store ($TRACKIO_DIR, by default ~/.cache/huggingface/trackio; `trackio show`
    draws it), the args as its config. Resumed, the same run continues (trackio's resume="allow" by name)."""

    def __init__(self, out: Path, resumed: int | None, config: dict):
        import trackio

        resume = "never" if resumed is None else "allow"
        self.run = trackio.init(project=PROJECT, name=out.name, config=config, resume=resume)

    def log(self, row: dict):
        self.run.log(numbers(row), step=row["step"])

    def close(self):
        self.run.finish()
