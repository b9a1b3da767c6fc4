"""extras/tensorboard_log.py: --report-to tensorboard, every number of metrics.jsonl also in OUT/tensorboard.

Imported by common.RunLogger only for that flag; metrics.jsonl stays the record, TensorBoard a view of it.
"""

from __future__ import annotations

from pathlib import Path

from torch.utils.tensorboard import SummaryWriter


class Board:
    """OUT/tensorboard's event files; resumed from a checkpoint at step `resumed`, the events after it dropped."""

    def __init__(self, out: Path, resumed: int | None):
        self.writer = SummaryWriter(str(out / "tensorboard"), purge_step=None if resumed is None else resumed + 1)

    def log(self, row: dict):
        """The very values metrics.jsonl holds (its rounded row), each number at the row's step."""
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                self.writer.add_scalar(k, v, row["step"])
        self.writer.flush()

    def close(self):
        self.writer.close()
