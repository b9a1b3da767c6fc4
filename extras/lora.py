"""extras/lora.py: --lora-rank, peft LoRA adapters on a frozen base (docs/lora.md). The reference of a LoRA run is
the policy with its adapters disabled (`AdaptersOff`): the base never trains, so no second copy is loaded. The
sampler reads the adapters through `lora_base` and `effective_weight`; a checkpoint's policy/ holds them only.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import torch

import common
from common import LORA_TARGETS, UsageError


def check_args(args):
    """--lora-rank, --lora-alpha, --lora-targets and --merge-lora; raises UsageError naming the flag."""
    if args.lora_rank < 0:
        raise UsageError(f"--lora-rank must be >= 0 (0: off, train every weight), got {args.lora_rank}")
    if args.lora_alpha is not None and not 0 < args.lora_alpha < math.inf:
        raise UsageError(f"--lora-alpha must be a finite number > 0, got {args.lora_alpha}")
    if not args.lora_targets:
        raise UsageError("--lora-targets needs at least one module name, e.g. q_proj v_proj")
    if args.merge_lora and not args.lora_rank:
        raise UsageError("--merge-lora merges LoRA adapters: it needs --lora-rank > 0")
    if args.lora_rank and importlib.util.find_spec("peft") is None:
        raise UsageError("--lora-rank needs the peft package: pip install -r requirements.txt")


def check_targets(args):
    """--lora-targets against --model's module names (built on the meta device): every name given must exist; of the
    defaults, one (a Qwen3-MoE's experts are fused tensors: its attention is adapted)."""
    if not args.lora_rank:
        return
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(common.model_path(args.model))
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
    except Exception:
        return
    names = {name.rpartition(".")[2] for name, _ in skeleton.named_modules()}
    missing = [t for t in args.lora_targets if t not in names]
    if len(missing) == len(args.lora_targets) or (missing and args.lora_targets != LORA_TARGETS):
        raise UsageError(f"--lora-targets: {config.model_type} has no module named {', '.join(missing)}")


def add_lora(model, args):
    """With --lora-rank r > 0: `model` as a peft model whose --lora-targets carry rank-r adapters, W x + (alpha / r)
    B A x, the rest frozen, B = 0 at first. No dropout: pi_old's and the update's log-probs are one function."""
    if not args.lora_rank:
        return model
    from peft import LoraConfig, get_peft_model

    alpha = args.lora_alpha if args.lora_alpha is not None else 2 * args.lora_rank
    config = LoraConfig(r=args.lora_rank, lora_alpha=alpha, target_modules=list(args.lora_targets), lora_dropout=0.0)
    return get_peft_model(model, config)


def is_lora(model) -> bool:
    """`model` is a peft model (the transformers model inside one is not: it calls its adapters)."""
    peft = sys.modules.get("peft")  # not imported yet: no peft model exists
    return peft is not None and isinstance(model, peft.PeftModel)


class AdaptersOff:
    """A peft model with its adapters disabled, as `completion_logprobs` uses a model: its decoder called inside
    peft's disable_adapter(), its output embeddings (never adapted)."""

    def __init__(self, peft_model):
        self.peft_model = peft_model

    def get_decoder(self):
        decoder = self.peft_model.get_decoder()

        def without_adapters(**inputs):
            with self.peft_model.disable_adapter():
                return decoder(**inputs)

        return without_adapters

    def get_output_embeddings(self):
        return self.peft_model.get_output_embeddings()


def lora_base(model):
    """The transformers model under a peft model (calling its projections applies the adapters), or `model`."""
    return model.get_base_model() if is_lora(model) else model


def effective_weight(linear) -> torch.Tensor:
    """The weight `linear` applies: for a peft LoRA layer with its adapters on and not merged, W + (alpha / r) B A
    (peft's get_delta_weight), not its `.weight` (the base's)."""
    if not hasattr(linear, "lora_A") or linear.merged or linear.disable_adapters:
        return linear.weight
    active = [a for a in linear.active_adapters if a in linear.lora_A]
    return linear.weight + sum(linear.get_delta_weight(a) for a in active)


def load_lora_weights(model, directory: Path):
    """Load the adapter weights a peft `save_pretrained` wrote in `directory` into `model`."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    result = set_peft_model_state_dict(model, load_file(directory / "adapter_model.safetensors"))
    if result.unexpected_keys:
        raise ValueError(f"adapter weights that the model has no place for: {result.unexpected_keys[:3]}")


def save_merged(model, tok, directory: Path):
    """A standard checkpoint of the policy, W + (alpha / r) B A in every adapted projection, merged in place (a copy
    would need the memory LoRA saves): call it last; `model` is spent."""
    merged = model.merge_and_unload()
    merged.save_pretrained(directory)
    tok.save_pretrained(directory)
