"""extras/fsdp.py: --fsdp, PyTorch FSDP2 under torchrun (docs/running.md, "Models that do not fit one GPU"), reached
through common.py's `sharded`, `gathered`, `data_parallel` and checkpoint functions: the scripts do not change."""

from __future__ import annotations

import contextlib
import os
import weakref

import torch

import common
from common import CompletionLogprobs, UsageError

# a model -> its CompletionLogprobs wrapper, its FSDP root (common.completion_logprobs), until the process group is
# left (extras/distributed.py); and the roots whose weights `gathered` holds whole right now
LOGPROBS_ROOT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_GATHERED: weakref.WeakSet = weakref.WeakSet()


def check_args(args):
    """--fsdp: under torchrun, without LoRA (check_common_args: before anything is loaded)."""
    if args.fsdp and "WORLD_SIZE" not in os.environ:
        raise UsageError("--fsdp shards the model over torchrun's processes: run under torchrun "
                         "(torchrun --nproc_per_node N gspo.py --fsdp ...; N may be 1)")  # fmt: skip
    if args.fsdp and args.lora_rank:
        raise UsageError("--fsdp with --lora-rank is not supported: LoRA trains adapters small enough to keep "
                         "whole on every rank; drop --fsdp (torchrun then runs DDP) or --lora-rank")  # fmt: skip


def gathered_dtype(device: torch.device, args) -> torch.dtype:
    """The dtype --fsdp gathers the weights in: bf16 on CUDA with --rollout-dtype bfloat16, else float32."""
    return torch.bfloat16 if device.type == "cuda" and args.rollout_dtype == "bfloat16" else torch.float32


def shard(module: torch.nn.Module, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """--fsdp: FSDP2 (`fully_shard`) on each decoder layer of `module`, then on `module`, the root (its forward gathers
    the rest: embeddings, final norm, output projection, a critic's head). Master weights stay float32; gathered ones
    are `dtype`: bf16 through a MixedPrecisionPolicy (gradients reduced in float32), or float32 (the forward then runs
    under bf16 autocast on CUDA, as without --fsdp). Returns `module`, now the root, registered for its model."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    inner = module.model if isinstance(module, CompletionLogprobs) else module
    if hasattr(inner, "config") and not common._StaticKVDecoder.supports(inner):  # (a critic has no sampler)
        raise UsageError(f"--fsdp: the sampler runs on gathered weights through its own decoder, which takes "
                         f"Qwen2, Qwen3 and Llama models with full attention; this model is "
                         f"{inner.config.model_type}: drop --fsdp (torchrun then runs DDP)")  # fmt: skip
    options = {}
    if dtype != torch.float32:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in [m for m in module.modules() if type(m).__name__.endswith("DecoderLayer")]:
        fully_shard(layer, **options)
    fully_shard(module, **options)
    if isinstance(module, CompletionLogprobs):
        LOGPROBS_ROOT[module.model] = module
    return module


def sharded(module) -> bool:
    """Whether --fsdp shards `module`'s parameters (they are DTensors)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


@contextlib.contextmanager
def gathered(model):
    """--fsdp: every weight of `model` whole on this rank inside the block, for the sampler (which calls the model's
    modules directly); sharded again after. A collective: every rank enters it at the same point; nested, or
    without --fsdp, it does nothing."""
    root = LOGPROBS_ROOT.get(model)
    if root is None or root in _GATHERED:
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    groups = [m for m in root.modules() if isinstance(m, FSDPModule)]
    for m in groups:
        m.unshard()
    _GATHERED.add(root)
    try:
        yield
    finally:
        _GATHERED.discard(root)
        for m in groups:
            m.reshard()


def full_state_dict(module) -> dict:
    """A sharded `module`'s state_dict() with whole tensors, gathered to rank 0 on CPU (a collective; others: {})."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def pretrained_state(model) -> dict | None:
    """What save_pretrained writes of a sharded `model`: its state dict gathered (a collective), a tied output
    embedding left out as save_pretrained leaves it out."""
    state = full_state_dict(model)
    output = model.get_output_embeddings()
    if output is not None and output.weight is model.get_input_embeddings().weight:
        state.pop(next(name for name, m in model.named_modules() if m is output) + ".weight", None)
    return state


class GatheredState:
    """A module or optimizer --fsdp shards, as a checkpoint saves it: state_dict() gathers whole tensors to rank 0 (a
    collective), load_state_dict() takes the whole state dict (every rank reads it) and keeps this rank's shards. An
    optimizer's is keyed by parameter name (torch.distributed.checkpoint's format), not by position."""

    same_on_every_rank = True  # (extras/distributed.save_rank_state: rank 0's trainer.pt holds it)

    def __init__(self, module, optimizer=None):
        self.module, self.optimizer = module, optimizer

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        if self.optimizer is None:
            return full_state_dict(self.module)
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(self.module, self.optimizer, options=options)

    def load_state_dict(self, state: dict):
        from torch.distributed.checkpoint import state_dict as dcp

        options = dcp.StateDictOptions(full_state_dict=True)
        if self.optimizer is None:
            dcp.set_model_state_dict(self.module, state, options=options)
        else:
            dcp.set_optimizer_state_dict(self.module, self.optimizer, state, options=options)


def checkpointed(state: dict, model) -> dict:
    """A run's `state` with each module and optimizer --fsdp shards as a GatheredState (an optimizer with the module
    whose parameters it updates: `model` or a module of `state`); the rest unchanged."""
    modules = [model] + [obj for obj in state.values() if isinstance(obj, torch.nn.Module)]
    out = {}
    for name, obj in state.items():
        if isinstance(obj, torch.nn.Module) and sharded(obj):
            obj = GatheredState(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            params = {id(p) for group in obj.param_groups for p in group["params"]}
            owner = next((m for m in modules if params <= {id(p) for p in m.parameters()}), None)
            if owner is not None and sharded(owner):
                obj = GatheredState(owner, obj)
        out[name] = obj
    return out


def load_policy(model, directory, rank: int):
    """--resume: rank 0 reads the saved policy; every rank receives its shards of it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoModelForCausalLM

    whole = {}
    if rank == 0:
        whole = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).state_dict()
    set_model_state_dict(model, whole, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
