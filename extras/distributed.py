"""extras/distributed.py: under torchrun (WORLD_SIZE set), its process group joined and left, and what common.py's
all-reduce helpers, DDP wrapping and checkpoints do there (without one, common.py's helpers return their input)."""

from __future__ import annotations

import gc
import os
import signal
import sys

import torch


def init_distributed(device: str = "auto") -> tuple[int, int, int]:
    """common.setup under torchrun: (rank, world, local_rank), the process group joined (NCCL on CUDA,
    gloo on CPU) and cuda:local_rank made this process's GPU."""
    import torch.distributed as dist

    rank, world, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    cuda = torch.cuda.is_available() and device != "cpu"
    if cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return rank, world, local_rank


def leave_process_group(exiting: BaseException | None):
    """main()'s last step under torchrun: destroy the process group. A rank ending with an exit status first drops
    the tracebacks behind it, which hold train()'s frames and through them the model and the group (gloo's threads
    would live on into shutdown and can abort it), and ignores the SIGTERM torchrun sends once one rank failed (this
    rank would be reported killed)."""
    if isinstance(exiting, SystemExit) and exiting.code not in (None, 0):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        error, seen = exiting.__context__, set()
        while error is not None and id(error) not in seen:  # the chain of errors behind the exit
            seen.add(id(error))
            error.__traceback__ = None
            error = error.__cause__ or error.__context__
    fsdp = sys.modules.get("extras.fsdp")
    if fsdp is not None:  # --fsdp: its registry of roots holds the sharded model (alive into shutdown: SIGABRT)
        fsdp.LOGPROBS_ROOT.clear()
    gc.collect()  # whatever holds a process group in reference cycles (a finished run's FSDP model and its hooks)
    torch.distributed.destroy_process_group()


def data_parallel(module: torch.nn.Module, device: torch.device, args=None) -> torch.nn.Module:
    """`module` in DistributedDataParallel, which averages the gradients of what runs through its forward over
    the ranks, or with --fsdp (`args.fsdp`) sharded by FSDP2 instead (extras/fsdp.py)."""
    if args is not None and args.fsdp:
        from extras import fsdp

        return fsdp.shard(module, fsdp.gathered_dtype(device, args))
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)


def collective_device(backend: str) -> str:
    """Where a collective's tensor must be: NCCL reduces GPU tensors only (this process's GPU, set by
    init_distributed), gloo CPU ones."""
    return "cuda" if backend == "nccl" else "cpu"


def all_reduce(x: torch.Tensor, op: str = "SUM") -> torch.Tensor:
    """common.all_reduce_sum under torchrun: `x` reduced over the ranks (op: SUM, MAX or MIN), a new tensor."""
    dist = torch.distributed
    device = x.device
    x = x.detach().to(collective_device(dist.get_backend()), copy=True)
    dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
    return x.to(device)


def rank_means(values: dict) -> dict:
    """common.rank_means under torchrun: each number averaged over the ranks (the largest for a *_max_dev), in one
    all-reduce. Every rank calls it with the same names."""
    x = torch.tensor([float(v) for v in values.values()], dtype=torch.float64)
    mean, largest = all_reduce(x) / torch.distributed.get_world_size(), all_reduce(x, op="MAX")
    return {k: (largest if k.endswith("_max_dev") else mean)[i].item() for i, k in enumerate(values)}


def global_sums(totals: dict) -> dict:
    """common.global_sums under torchrun: the names every rank holds (gathered: a rank whose updates were all skipped
    may lack some), then their sums in one float64 all-reduce."""
    names = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(names, sorted(totals))
    names = sorted(set().union(*names))
    summed = all_reduce(torch.tensor([float(totals.get(n, 0.0)) for n in names], dtype=torch.float64))
    return dict(zip(names, summed.tolist(), strict=True))


def raise_if_any_rank_failed(error: Exception | None):
    """common.raise_on_every_rank under torchrun: when another rank failed (its error is on stderr) and this one
    did not, a UsageError naming it, so that one rank's failure stops the job instead of leaving the others
    waiting in their next all-reduce."""
    from common import UsageError

    dist = torch.distributed
    failed = torch.zeros(dist.get_world_size())
    failed[dist.get_rank()] = float(error is not None)
    failed = all_reduce(failed)
    if error is None and failed.any():
        raise UsageError(f"stopped because rank {int(failed.nonzero()[0])} failed (its error is above)")


def save_rank_state(path, trainer: dict, state: dict):
    """common.save_checkpoint_if_due under torchrun: this rank's RNG states and each `state` object that is not the
    same on every rank (its generators, the stream, a carried batch) into checkpoint.tmp/rank<r>.pt, once rank 0 has
    made the directory; returns once every rank has written its own."""
    torch.distributed.barrier()
    # modules and optimizers are the same on every rank (--fsdp gathers them): rank 0's trainer.pt holds them
    mine = [n for n, obj in state.items() if not isinstance(obj, (torch.nn.Module, torch.optim.Optimizer))]
    own = {n: trainer["state"][n] for n in mine if not getattr(state[n], "same_on_every_rank", False)}
    torch.save({"rng": trainer["rng"], "state": own}, path)
    torch.distributed.barrier()
