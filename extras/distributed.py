"""extras/distributed.py: torchrun's process group, joined at the start of a run and left at its end.

Imported by common.py only under torchrun (WORLD_SIZE set). The all-reduce helpers that the scripts call
every step stay in common.py: without a process group they return their input.
"""

from __future__ import annotations

import gc
import os
import signal
import sys

import torch


def init_distributed(device: str = "auto") -> tuple[int, int, int]:
    """(rank, world, local_rank). Under torchrun: joins the process group (NCCL on CUDA, gloo on
    CPU) and makes cuda:local_rank this process's GPU. Without torchrun: (0, 1, 0), no group."""
    if "WORLD_SIZE" not in os.environ:
        return 0, 1, 0
    import torch.distributed as dist

    rank, world, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    cuda = torch.cuda.is_available() and device != "cpu"
    if cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return rank, world, local_rank


def leave_process_group(exiting: BaseException | None):
    """main()'s last step under torchrun: destroy the process group. When the rank stops with an
    exit status (`exiting` is the SystemExit of die() or of a stop by signal; its message is already
    on stderr), two things first:
    - the stopped run's frames are released. The exception that led to the exit (SystemExit's
      __context__) holds train()'s frames in its traceback, and through them the DDP model, which
      holds the process group: destroy_process_group() alone only unregisters it, and gloo's threads
      and sockets then live on into interpreter shutdown, where they can abort the process (SIGABRT,
      "terminate called without an active exception", seen once in 20 runs on a loaded machine);
    - SIGTERM is ignored from here on: torchrun sends it to every rank still running as soon as one
      has exited with a failure, and a rank that is already ending with its own status would be
      reported as killed by SIGTERM instead. If this teardown ever hung, torchrun's SIGKILL follows.
    Any other exception (a bug) keeps its traceback, for Python to print. Whatever the ending, --fsdp's
    registry of roots (extras/fsdp.py) lets its sharded model go, and a collection frees what the run has let
    go, so that no model holding the process group lives on into shutdown."""
    if isinstance(exiting, SystemExit) and exiting.code not in (None, 0):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        error, seen = exiting.__context__, set()
        while error is not None and id(error) not in seen:  # the chain of errors behind the exit
            seen.add(id(error))
            error.__traceback__ = None
            error = error.__cause__ or error.__context__
    fsdp = sys.modules.get("extras.fsdp")
    if fsdp is not None:  # --fsdp: the registry of roots holds the sharded model
        fsdp.forget_roots()
    gc.collect()  # whatever holds a process group in reference cycles (a finished run's FSDP model and its hooks)
    torch.distributed.destroy_process_group()
