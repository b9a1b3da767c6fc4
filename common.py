"""common.py: the runtime ppo.py, grpo.py and gspo.py share (command line, data, models, sampling, rewards, log-probs,
evaluation, logging, checkpoints, torchrun), as plain functions each script's train() calls where they act, in
numbered sections from the command line (1) to torchrun (11). The algorithms, their losses, advantages and
metrics, are in the scripts.

What a flag (or the model) switches on lives in extras/, one module per capability, imported through
`extra(name, flag)` only when asked for (a missing one is a one-line error naming it). tools/, experiments/ and
benchmarks/ import this file, never the other way round.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import fcntl
import functools
import importlib.util
import io
import itertools
import json
import math
import os
import random
import re
import resource
import shutil
import signal
import sys
import time
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm

STARTED = time.perf_counter()  # the script's start (its import of this file): summary.json's wall_time_s counts from it

# ---------------------------------------------------------------------------------------------
# 1. Command line: each script's Args dataclass read by tyro, checks with one-line errors (exit status 2), main()
# ---------------------------------------------------------------------------------------------


class UsageError(Exception):
    """Bad input from the user: reported as one line on stderr, exit status 2."""


def die(message: str, status: int = 2, prefix: str = "error"):
    # one line in one write: under torchrun the ranks share stderr, and two writes can interleave with another's
    sys.stderr.write(f"{prefix}: " + re.sub(r"\s*\n\s*", " ", message.strip()) + "\n")
    sys.stderr.flush()
    sys.exit(status)


ROLLOUT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # --rollout-dtype's values
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # attention and MLP


def script_name(args_cls) -> str:
    """The name of the script that declares `args_cls` (gspo for gspo.py): a fork is named by its file."""
    return Path(getattr(sys.modules[args_cls.__module__], "__file__", args_cls.__module__)).stem


# The training recipe: fields every script's own Args declares with its defaults (CleanRL's Args); checked at start
RECIPE = ("steps", "prompts_per_step", "group_size", "max_new_tokens", "temperature", "lr", "weight_decay",
          "max_grad_norm", "anneal_lr", "minibatches", "epochs")  # fmt: skip
# The flags that do not change what a step trains, each with why: every other field of a script's Args must change
# its update when set (tests/test_flags_reach_update.py runs one step per flag). A script adds its own such flags
# in a NOT_IN_UPDATE dict of its own beside its Args.
NOT_IN_UPDATE = {
    "eval_every": "when to evaluate", "eval_size": "how many prompts to evaluate on",
    "eval_samples": "what evaluation samples", "report_to": "where metrics go", "trace_every": "when to trace",
    "trace_groups": "what a trace keeps", "out": "where outputs go", "overwrite": "whether --out may be replaced",
    "save_every": "when to checkpoint", "resume": "where a run starts (resume is exact: test_reliability.py)",
    "device": "where, not what", "cuda_graph": "how a step runs, not what it samples (tests/test_cuda_graph.py)",
    "grad_checkpointing": "recomputes the same activations in backward", "merge_lora": "writes a merged copy",
    "fsdp": "shards what DDP replicates (the same update: test_fsdp.py)",
}  # fmt: skip


@dataclass
class SharedArgs:
    """The flags every script shares; its Args adds RECIPE and its own. A field's docstring is its flag's --help."""

    model: str = "tiny"
    """tiny (Qwen3, in checkpoints/), tiny-moe (its MoE twin), tiny-qwen3 (Qwen3's tokenizer), a local dir / hub id"""
    data: str | None = None
    """JSONL file of {prompt, answer, ...} or GSM8K {question, answer} records (none: the built-in arith task)"""
    eval_data: str | None = None
    """JSONL file to evaluate on (e.g. GSM8K's test split) instead of 10% held out of --data"""
    system_prompt: str | None = None
    """instruction a chat template puts before each prompt ('': none; None: one asking for what --reward reads)"""
    thinking: Literal["off", "on"] = "off"
    """Qwen3's enable_thinking: on reasons in <think>...</think>, the answer read after it; off: an empty think"""
    reward: list[str] = field(default_factory=list)
    """exact, boxed, format, module:function or file.py:function; several add up (none: exact, or --reward-model)"""
    reward_weights: list[float] = field(default_factory=list)
    """one weight per --reward (none given: 1 each)"""
    reward_model: str | None = None
    """learned reward: tiny-rm (embedded) or a sequence-classification checkpoint (docs/reward_model.md)"""
    reward_model_weight: float = 1.0
    """weight of --reward-model in the weighted sum"""
    top_p: float = 1.0
    """nucleus sampling threshold (1 = off)"""
    grad_checkpointing: bool = False
    """recompute activations in backward (less memory, more compute)"""
    entropy_coef: float = 0.0
    """weight of an entropy bonus in the loss, on every row (0: none, as in the paper)"""
    eval_every: int = 10
    """evaluate every N steps (0: only before and after training)"""
    eval_size: int = 500
    """held-out prompts used for evaluation"""
    eval_samples: int = 0
    """also sample N >= 2 completions per eval prompt: eval_pass@1 and eval_pass@N (0: off)"""
    report_to: Literal["none", "tensorboard", "wandb", "trackio"] = "none"
    """also send every metric to a tracker (beside metrics.jsonl): tensorboard (OUT/tensorboard), wandb, trackio"""
    trace_every: int | None = None
    """write per-token traces to OUT/traces.jsonl every N steps (0: off; None: at each evaluation)"""
    trace_groups: int = 4
    """groups (PPO: prompts) of a traced step's rollout that its trace keeps, those with signal first"""
    seed: int = 0
    """random seed (data order, sampling)"""
    out: str | None = None
    """output directory (runs/ and the script's name, so that a fork writes its own)"""
    overwrite: bool = False
    """replace the run --out holds even if another script wrote it (a non-run directory is never deleted)"""
    save_every: int = 0
    """write a checkpoint to OUT/checkpoint every N steps and at the end (0: off)"""
    resume: str | None = None
    """continue the run in this --out directory (or its checkpoint/); its flags are reused, --steps may grow"""
    device: str = "auto"
    """auto, cpu or cuda"""
    cuda_graph: bool = False
    """replay each decode step as one CUDA graph (CUDA device, hand-written decoder only); not yet run on a GPU"""
    fsdp: bool = False
    """under torchrun: shard weights, gradients and AdamW state over the ranks (FSDP2), not a copy on each"""
    lora_rank: int = 0
    """LoRA: train rank-r adapters (peft) on the frozen base instead of every weight (0: off)"""
    lora_alpha: float | None = None
    """LoRA: the adapters' update is scaled by alpha / r (None: 2 x --lora-rank)"""
    lora_targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """LoRA: the projections that get adapters (attention and MLP)"""
    merge_lora: bool = False
    """LoRA: also write OUT/final/merged, a standard checkpoint, adapters merged in"""
    rollout_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype the sampler runs in: bfloat16 samples from a bf16 copy of the policy"""
    old_logp: Literal["recompute", "rollout"] = "recompute"
    """pi_old: the trainer's forward (recompute) or the sampler's log-probs (rollout)"""
    is_correction: Literal["none", "tis", "mask"] = "none"
    """weigh the loss by pi_old / mu: token-level truncated IS (tis) or a sequence mask"""
    is_cap: float = 2.0
    """--is-correction's cap C: tis truncates pi_old / mu at C, mask drops sequences above it"""

    def __post_init__(self):
        if self.out is None:
            self.out = f"runs/{self.algo}"

    @property
    def algo(self) -> str:  # the script's name: what its checkpoints, summary and traces are labelled with
        return script_name(type(self))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _cli(args_cls, argv: list[str], defaults):
    """tyro.cli over `argv` with `defaults` (an Args instance): --help exits 0, a bad flag or value is one line."""
    import tyro

    may_change = ", ".join(_flag(n) for n in RESUME_MAY_CHANGE if n != "resume")
    description = (sys.modules[args_cls.__module__].__doc__ or "").split("\n")[0]
    description += f"\nWith --resume, the checkpoint's flags are the defaults; of them only {may_change} may change."
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return tyro.cli(args_cls, args=argv, default=defaults, description=description)
    except SystemExit as e:
        if not e.code:
            raise
        # tyro's error box as one line: its first paragraph, after the title, and the flags it suggests
        lines = [re.sub(r"\x1b\[[\d;]*m", "", line).strip(" │|╭╮╰╯") for line in err.getvalue().strip().splitlines()]
        lines = ["" if re.fullmatch(r"[─-]*", line) else line for line in lines[1:]]
        paragraphs = [list(p) for filled, p in itertools.groupby(lines, bool) if filled]
        message = " ".join(paragraphs[0] if paragraphs else [])
        near = [line.split()[0] for p in paragraphs[1:] if re.match(r"Perhaps you meant|Arguments similar", p[0])
                for line in p[1:] if line.startswith("--")]  # fmt: skip
        message += f"; did you mean {' or '.join(sorted(set(near)))}?" if near else ""
        raise UsageError(message or f"bad command line (python {sys.argv[0]} --help)") from None


def _choices(hint) -> tuple | None:
    """The values a Literal[...] annotation allows (and None where it is optional); None for any other type."""
    parts = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if not any(typing.get_origin(p) is Literal for p in parts):
        return None
    return tuple(v for p in parts for v in (typing.get_args(p) if typing.get_origin(p) is Literal else (None,)))


def _tyro_argv(args_cls, argv: list[str]) -> list[str]:
    """The command line as tyro reads it, but for a list flag given more than once: "--reward a --reward b" is
    "--reward a b" (tyro would keep only the last list)."""
    lists = {_flag(n) for n, h in typing.get_type_hints(args_cls).items() if typing.get_origin(h) is list}
    out, values, flag = [], {}, None
    for a in argv:
        if a.startswith("--"):
            flag, eq, value = a.partition("=")
            if flag in lists:
                values.setdefault(flag, []).extend([value] if eq else [])
                continue
        elif flag in lists:
            values[flag].append(a)
            continue
        out.append(a)
    return out + [a for flag, given in values.items() for a in (flag, *given)]


def parse_args(args_cls, argv=None):
    """The script's Args from its command line (tyro). With --resume DIR the checkpoint's flags are the defaults
    (extras/resume.py: only RESUME_MAY_CHANGE may differ from them)."""
    missing = [name for name in RECIPE if not hasattr(args_cls, name)]  # (a field with a default is a class attribute)
    if missing:
        raise UsageError(f"{script_name(args_cls)}.py's Args lacks the recipe field {_flag(missing[0])}: every script "
                         f"declares its training recipe ({', '.join(map(_flag, RECIPE))})")  # fmt: skip
    argv = _tyro_argv(args_cls, list(sys.argv[1:] if argv is None else argv))
    args = _cli(args_cls, argv, args_cls())
    if args.resume:
        return extra("resume", "--resume").resumed_args(args_cls, args.resume, lambda d: _cli(args_cls, argv, d))
    return args


def check_common_args(args, needs_group: bool):
    """Range checks shared by the three scripts, before any model loads or output is written: the first that fails
    is a UsageError naming its flag. A Literal field is checked whether given, resumed or passed to Args."""
    nan = [n for n, v in vars(args).items() if any(isinstance(x, float) and math.isnan(x) for x in
                                                    (v if isinstance(v, list) else [v]))]  # fmt: skip
    finite = (lambda v: 0 <= v < math.inf, "a finite number >= 0")
    ranges = {  # each flag: the test its value passes, and the message's "must be ..."
        **{n: (lambda v: v >= 1, ">= 1") for n in
           "steps prompts_per_step max_new_tokens minibatches epochs eval_size".split()},
        "group_size": (lambda v: v >= 1 + needs_group,
                       ">= 2 (group advantages need at least two samples per prompt)" if needs_group else ">= 1"),
        "temperature": (lambda v: v > 0, "> 0"),
        "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
        "lr": finite,
        "weight_decay": finite,
        "max_grad_norm": (lambda v: v > 0, "> 0 (inf: no clipping)"),
        "eval_every": (lambda v: v >= 0, ">= 0 (0 turns periodic evaluation off)"),
        "trace_every": (lambda v: v is None or v >= 0, ">= 0 (0: no traces; None: with each evaluation)"),
        "trace_groups": (lambda v: v >= 1, ">= 1"),
        "save_every": (lambda v: v >= 0, ">= 0 (0: no periodic checkpoints)"),
        "eval_samples": (lambda v: v == 0 or v >= 2, "0 (off) or >= 2 (pass@n needs n samples)"),
        "entropy_coef": finite,
        "seed": (lambda v: 0 <= v <= MAX_SEED, f"in [0, {MAX_SEED}]"),
    }  # fmt: skip
    batch, world = args.prompts_per_step * args.group_size, int(os.environ.get("WORLD_SIZE", 1))  # torchrun's
    gpu = re.fullmatch(r"cuda(?::(\d+))?", args.device)
    gpus = torch.cuda.device_count() if gpu else 0
    out = Path(args.out)
    existing = next(p for p in (out, *out.parents) if p.exists())  # "." or "/" at the latest
    choices = {n: c for n, h in typing.get_type_hints(type(args)).items() if (c := _choices(h))}  # Literal fields
    problems = [  # (whether it fails, its message), in the order they are checked
        (nan, f"{_flag(nan[0])} must be a number, got nan" if nan else ""),
        *((not holds(getattr(args, n)), f"{_flag(n)} must be {what}, got {getattr(args, n)}")
          for n, (holds, what) in ranges.items()),
        (batch % max(1, args.minibatches), f"--minibatches {args.minibatches} does not divide the batch of {batch} "
         "completions (--prompts-per-step x --group-size)"),
        (args.prompts_per_step % world or args.prompts_per_step // world * args.group_size % max(1, args.minibatches),
         f"--prompts-per-step {args.prompts_per_step} must split into {world} equal shares whose completions "
         f"--minibatches {args.minibatches} divides"),
        (args.device != "auto" and not gpu and args.device != "cpu",
         f"--device must be auto, cpu or cuda[:N], got {args.device!r}"),
        (gpu and int(gpu[1] or 0) >= gpus, f"--device {args.device}: only {gpus} CUDA device(s) visible"),
        (not existing.is_dir(), f"--out {args.out}: {existing} is a file, expected a directory (or a path to create)"),
        (not os.access(existing, os.W_OK) or existing != out and not can_create_in(existing),
         f"--out {args.out}: {existing} is not writable (cannot create {out} there)"),
        *((getattr(args, n) not in allowed, f"{_flag(n)} must be one of "  # --report-to, --variant, a fork's ...
           f"{', '.join(str(v) for v in allowed if v is not None)}, got {getattr(args, n)!r}")
          for n, allowed in choices.items()),
    ]  # fmt: skip
    for failed, message in problems:
        if failed:
            raise UsageError(message)
    if args.model not in (*TINY_MODELS, TINY_QWEN3):  # a checkpoint directory, or a hub id's shape
        extra("hub", f"--model {args.model}").check_model_name(args.model)
    switched_on = [  # each optional capability, imported only when one of its flags is set, checks its own flags
        ("pass_at_k", "--eval-samples", args.eval_samples),
        ("lora", "--lora-rank", args.lora_rank or args.merge_lora or args.lora_alpha is not None
         or args.lora_targets != LORA_TARGETS),
        ("rollout_precision", "--rollout-dtype / --old-logp / --is-correction",
         (args.rollout_dtype, args.old_logp, args.is_correction, args.is_cap) != ("float32", "recompute", "none", 2.0)),
        ("fsdp", "--fsdp", args.fsdp),
        ("cuda_graph", "--cuda-graph", args.cuda_graph),
        ("traces", "--trace-every", args.trace_every),  # (the default, none: at each evaluation, if traces.py is there)
        ("trackers", f"--report-to {args.report_to}", args.report_to != "none"),
    ]  # fmt: skip
    for name, flag, on in switched_on:
        if on and hasattr(module := extra(name, flag), "check_args"):
            module.check_args(args)


def can_create_in(directory: Path) -> bool:
    """Whether a directory can be made in `directory`, tried (os.access passes root, and /proc): made and removed."""
    with contextlib.suppress(OSError):
        (probe := directory / f".rlref-probe-{os.getpid()}").mkdir()
        return probe.rmdir() is None
    return False


def check_clip(eps_low: float, eps_high: float):
    """A script's --eps-low / --eps-high: the ratio's clip range [1 - eps_low, 1 + eps_high]."""
    for name, value in (("eps_low", eps_low), ("eps_high", eps_high)):
        if not 0 <= value < math.inf:
            raise UsageError(f"{_flag(name)} must be a finite number >= 0, got {value}")
    if eps_low >= 1:
        raise UsageError(f"--eps-low must be < 1 (the ratio's lower clip is 1 - eps_low), got {eps_low}")


EXTRAS = Path(__file__).resolve().parent / "extras"  # one module per optional capability


def extra(name: str, flag: str):
    """extras/<name>.py, the optional capability that `flag` switches on; missing, a UsageError naming it."""
    if not (EXTRAS / f"{name}.py").is_file():
        raise UsageError(f"{flag} needs extras/{name}.py, which this copy of the project does not have "
                         "(copy it from the project's extras/ folder, or drop the flag)")  # fmt: skip
    return importlib.import_module(f"extras.{name}")


def _loaded(name: str):
    """extras/<name>.py if a flag has imported it, else None: nothing of it can be in use."""
    return sys.modules.get(f"extras.{name}")


def _describe(e: Exception, first_sentence: bool = True) -> str:
    """An exception as one short line: its class and its first line (cut at its first sentence's end)."""
    line = (str(e).strip().splitlines() or [""])[0]
    return f"{e.__class__.__name__}: {line.split('. ')[0] if first_sentence else line}"


def main(train, args_cls, argv=None):
    """The scripts' entry point. Exit status: 0 done; 2 bad input (one line on stderr); 3 stopped by the non-finite
    guard; 128 + the signal's number (130, 143, 129) stopped by SIGINT / SIGTERM / SIGHUP after a checkpoint."""
    # nohup's SIGHUP stays ignored: a run it started outlives its terminal, as asked
    previous = {s: signal.signal(s, _request_stop) for s in STOP_SIGNALS if signal.getsignal(s) != signal.SIG_IGN}
    _stop["signum"] = None
    streams, console = (sys.stdout, sys.stderr), Console()  # what both print, for OUT/console.log
    # a closed reader never costs a checkpoint
    sys.stdout, sys.stderr = Unbroken(sys.stdout, console), Unbroken(sys.stderr, console)
    try:
        train(parse_args(args_cls, argv))
    except (UsageError, NonFiniteError) as e:
        die(str(e), 3 if isinstance(e, NonFiniteError) else 2)
    except Interrupted as e:
        die(str(e), 128 + _stop["signum"], signal.Signals(_stop["signum"]).name)
    except KeyboardInterrupt:  # the second SIGINT / SIGTERM
        die("stopped at once, without a checkpoint", 128 + (_stop["signum"] or signal.SIGINT), "interrupted")
    finally:
        for stream in (sys.stdout, sys.stderr):  # what a closed pipe still buffers fails here, not as exit status 120
            stream.flush()
        release_out()
        sys.stdout, sys.stderr = streams
        console.close()
        for s, handler in previous.items():
            signal.signal(s, handler)
        if "WORLD_SIZE" in os.environ and torch.distributed.is_initialized():
            _loaded("distributed").leave_process_group(sys.exc_info()[1])


# ---------------------------------------------------------------------------------------------
# 2. Setup: what a run needs before its model: checks, torchrun, data, rewards, --resume, device, seeds
# ---------------------------------------------------------------------------------------------


@dataclass
class Setup:
    """What `setup` found out before any model is loaded."""

    rank: int  # under torchrun (0 without)
    world: int  # number of processes (1 without torchrun)
    device: torch.device
    train_set: list  # records: "prompt", "answer" (where the task has one) and the file's other fields
    eval_set: list  # at most --eval-size: --eval-data, or a held-out part of the training data
    resume_from: Path | None  # the checkpoint directory to continue (--resume), or None
    reward_fn: Rewards  # the --reward functions, weighted by --reward-weights
    system_prompt: str  # what a chat template puts before every prompt ('' for nothing)
    eval_overlap: int  # evaluation prompts that also occur in the training data (warned about)
    needs_group: bool  # the advantage compares each prompt's completions (GRPO, GSPO), or not (PPO)
    replaces: str | None = None  # the earlier run in --out that this one replaces whole (check_out), or None


def setup(args, needs_group: bool = True) -> Setup:
    """Everything a run needs before its model, each failure a one-line error before anything is written.
    `needs_group`: the advantage compares a prompt's completions (--group-size >= 2)."""
    getattr(args, "check", lambda: None)()  # the script's own flags' range checks (its Args.check: UsageError)
    check_common_args(args, needs_group)
    rank, world, local_rank = 0, 1, 0
    if "WORLD_SIZE" in os.environ:  # torchrun's: its process group joined
        rank, world, local_rank = extra("distributed", "torchrun").init_distributed(args.device)
    # --out and --resume's checkpoint before the tokenizer and data: a refusal that needs no model comes early
    resume = extra("resume", "--resume") if args.resume else None
    replaces = check_out(args, resume and resume.find_checkpoint(args.resume, args.algo)[0], rank)
    resume_from = resume and resume.open_checkpoint(args, args.algo, world)
    specs = args.reward or ([] if args.reward_model else ["exact"])  # --reward-model alone: the only component
    needs_answer = any(spec in BUILTIN_REWARDS for spec in specs)
    pin_mmap_threshold()  # before the first large tensor: freed activations leave RSS
    quiet_transformers()  # before the first model loads (the reward model's, the policy's)
    tok = load_tokenizer(args.model)  # the data's characters are checked against it as it loads
    check = lambda where, records: extra("data_files", where).check_characters(tok, args.model, where, records)  # noqa: E731
    train_set, eval_set = load_task(args.data, args.eval_data, needs_answer=needs_answer, check=check)
    eval_set = eval_set[: args.eval_size]
    device = resolve_device(args.device, local_rank)
    reward_model = None
    if args.reward_model:  # checked (one line, exit 2) before anything is written
        learned = extra("reward_model", "--reward-model")
        learned.check(args.reward_model)
        reward_model = learned.RewardModel(args.reward_model, device, thinking=args.thinking)
    reward_fn = Rewards(specs, args.reward_weights, train_set + eval_set, reward_model, args.reward_model_weight)
    if args.eval_samples and not reward_fn.scores_answers:
        raise UsageError("--eval-samples: pass@n counts correct answers, and these records have no 'answer' field")
    seen = {ex["prompt"].strip() for ex in train_set}
    overlap = sum(ex["prompt"].strip() in seen for ex in eval_set)  # evaluation prompts that measure memory
    if overlap and rank == 0:
        print(f"warning: {overlap} of the {len(eval_set)} evaluation prompts also occur in the training data "
              f"({'--eval-data ' + args.eval_data if args.eval_data else '--data'})", file=sys.stderr)  # fmt: skip
    system_prompt = args.system_prompt if args.system_prompt is not None else SYSTEM_PROMPTS[reward_fn.parser]
    if declares_experts(args.model):  # known from config.json, so a missing extras/moe.py stops before loading
        extra("moe", f"--model {args.model} (MoE)")
    if not _StaticKVDecoder.supports_config(local_config(args.model) or {"model_type": "llama"}):  # (hub id: later)
        extra("hf_decoder", f"--model {args.model} (outside the hand-written decoder's {_StaticKVDecoder.MODEL_TYPES})")
    if args.lora_rank:
        extra("lora", "--lora-rank").check_targets(args)
    if getattr(tok, "chat_template", None) and tok.unk_token_id is not None:  # (a byte-level one represents all)
        extra("data_files", "--system-prompt").check_system_prompt(tok, args.model, system_prompt)
    seed_everything(args.seed)
    return Setup(rank, world, device, train_set, eval_set, resume_from, reward_fn, system_prompt, overlap, needs_group,
                 replaces)  # fmt: skip


def check_out(args, resume_from: Path | None, rank: int = 0) -> str | None:
    """The earlier run in --out that --overwrite replaces whole (start_run does), or None: nothing to replace, or
    the run --resume continues; else a UsageError (extras/resume.py: a directory that holds no run is never deleted).
    A live run's directory, --out or the one --resume reads, is refused first (hold_out)."""
    out = Path(args.out)
    hold_out(out, rank, create=False)
    if resume_from is not None:
        hold_out(resume_from.parent, rank, create=False)
    if resume_from is not None and out.resolve() == resume_from.resolve().parent:
        return None  # --resume continues the run in its own directory
    if not out.is_dir() or not any(p.name != LOCK for p in out.iterdir()):
        return None
    return extra("resume", f"--out {args.out} (it holds files: --resume, --overwrite)").check_out(args, resume_from)


LOCK = ".lock"  # OUT/.lock: flock()ed by the one process writing OUT (rank 0 under torchrun), its PID and command in it
_held = {}  # OUT (resolved) -> the open lock file this process holds, until release_out()


def hold_out(out, rank: int = 0, create: bool = True):
    """One writer per --out: rank 0 holds OUT/.lock (flock: the kernel lets go when the process dies, so a killed run
    resumes at once) from start_run to the run's end, its PID written in; `create` False only tries an existing lock
    file (nothing written). Held by a live process: a UsageError on every rank, naming its PID."""
    path, error = Path(out) / LOCK, None
    if rank == 0 and path.parent.resolve() not in _held and (create or path.is_file()):
        path.parent.mkdir(parents=True, exist_ok=True)
        file = open(path, "a+")  # noqa: SIM115 (held open until release_out)
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            pid, _, command = (file.read().strip() or "?").partition("\n")
            error = UsageError(f"{path.parent} is in use by the run in process {pid} ({command or '?'}): one process "
                               f"writes a run directory at a time; wait for it to end, or stop it (kill {pid} "
                               "saves a checkpoint), or choose another --out")  # fmt: skip
        if create and error is None:
            _held[path.parent.resolve()] = file
            file.truncate(0)
            file.write(f"{os.getpid()}\n{' '.join([Path(sys.argv[0]).name, *sys.argv[1:]])}\n")
            file.flush()
        else:
            file.close()
    raise_on_every_rank(error)


def release_out():
    """Let go of every --out this process holds (at the run's end; a process that ends lets go anyway)."""
    while _held:
        _held.popitem()[1].close()


def resolve_device(device: str = "auto", local_rank: int = 0) -> torch.device:
    """--device as a torch.device; auto or cuda under torchrun: this rank's GPU, LOCAL_RANK (DDP needs the index)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(f"cuda:{local_rank}" if device == "cuda" else device)


def seed_everything(seed: int):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# 3. Data: the built-in `arith` task (files: extras/), the prompt stream, prompts as token ids
# ---------------------------------------------------------------------------------------------


MAX_SEED = 2**32 // 1000 - 1  # PromptStream seeds numpy with seed * 1000 + epoch: must fit 32 bits
ARITH_EVAL_SEED, ARITH_EVAL_SIZE = 1234, 500  # the held-out set: fixed, the same for every run seed


def arith_split(max_operand: int = 99):
    """All `a+b=` pairs with 0 <= a, b <= max_operand, split once into (train, held-out eval)."""
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    order = np.random.RandomState(ARITH_EVAL_SEED).permutation(len(pairs))
    examples = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in (pairs[i] for i in order)]
    return examples[ARITH_EVAL_SIZE:], examples[:ARITH_EVAL_SIZE]


def load_task(data: str | None, eval_data: str | None = None, eval_fraction: float = 0.1, needs_answer=True,
              check=None):  # fmt: skip
    """(train_examples, eval_examples): the built-in arith task's fixed split, or, given files, extras/data_files.py's:
    --eval-data to evaluate on, else a fixed `eval_fraction` of --data held out; `check(where, records)` sees each."""
    if not data and not eval_data:
        return arith_split()
    return extra("data_files", "--data / --eval-data").load_task(data, eval_data, eval_fraction, needs_answer, check)


class PromptStream:
    """Deterministic, resumable stream of training examples: a fresh permutation each epoch."""

    def __init__(self, examples, seed: int):
        self.examples, self.seed, self.epoch, self.pos = examples, seed, 0, 0
        self._order = self._permutation()

    def _permutation(self):
        return np.random.RandomState(self.seed * 1000 + self.epoch).permutation(len(self.examples))

    def next(self, n: int):
        batch = []
        while len(batch) < n:
            if self.pos == len(self.examples):
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._permutation()
            batch.append(self.examples[self._order[self.pos]])
            self.pos += 1
        return batch

    def state_dict(self):
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state):
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._order = self._permutation()


SYSTEM_PROMPT = "Solve the problem step by step, then write the final answer as a number after '####'."

# The instruction every prompt carries (through a chat template) is part of the task: it must ask for
# the answer in the form the reward reads. --system-prompt replaces it; by default it follows --reward.
SYSTEM_PROMPTS = {
    "exact": SYSTEM_PROMPT,
    "boxed": "Solve the problem step by step, then put the final answer in \\boxed{}.",
}


def thinking_kwargs(tok, thinking: str = "off") -> dict:
    """apply_chat_template's enable_thinking for --thinking, where the template reads it (Qwen3's)."""
    return {"enable_thinking": thinking == "on"} if "enable_thinking" in (tok.chat_template or "") else {}


def encode_prompts(tok, examples, system_prompt: str = SYSTEM_PROMPT, thinking: str = "off") -> list[list[int]]:
    """Token ids per prompt: through the chat template (after `system_prompt` unless '') when the tokenizer has
    one, as plain text otherwise (the tiny model, base checkpoints)."""
    if getattr(tok, "chat_template", None):
        system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        kwargs = dict(add_generation_prompt=True, tokenize=True, return_dict=False, **thinking_kwargs(tok, thinking))
        chats = [[*system, {"role": "user", "content": ex["prompt"]}] for ex in examples]
        return [tok.apply_chat_template(chat, **kwargs) for chat in chats]
    return [tok(ex["prompt"], add_special_tokens=False)["input_ids"] for ex in examples]


def prompts_and_records(tok, examples, group_size: int, system_prompt: str = SYSTEM_PROMPT, thinking: str = "off"):
    """Each example's prompt ids `group_size` times in a row (a group), and every row's record."""
    prompts = [ids for ids in encode_prompts(tok, examples, system_prompt, thinking) for _ in range(group_size)]
    return prompts, [ex for ex in examples for _ in range(group_size)]


# ---------------------------------------------------------------------------------------------
# 4. Models: loading a checkpoint, its EOS ids, and the embedded tiny checkpoints (shipped, keyed by recipe)
# ---------------------------------------------------------------------------------------------


def load_model(name: str, device: torch.device, grad_checkpointing: bool = False):
    """(model, tokenizer) of --model. Weights stay float32 (AdamW's master copy: in bf16 most of a 1e-6 update
    rounds away); on CUDA the training forward runs under bf16 autocast and matmuls may use TF32."""
    from transformers import AutoModelForCausalLM

    path = model_path(name)
    if "RLREF_THREADS" in os.environ or (device.type == "cpu" and name in TINY_MODELS):
        # a 0.8M-parameter model's matmuls are too small to split across cores: threads only add synchronisation
        torch.set_num_threads(int(os.environ.get("RLREF_THREADS", 1)))
    use_tf32(device)
    tok = load_tokenizer(name)
    model = _from_pretrained(AutoModelForCausalLM, name, path, dtype=torch.float32)
    if grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.to(device), tok


def use_tf32(device: torch.device) -> None:
    """On CUDA, float32 matmuls outside the training forward's bf16 autocast may use TF32 (a 10-bit mantissa)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True


def pin_mmap_threshold(nbytes: int = 1 << 20) -> None:
    """Keep glibc's malloc serving blocks of >= `nbytes` by mmap, so that a freed activation goes back to the OS
    (glibc would raise the threshold to each freed block's size, then keep freed pages resident: docs/memory.md)."""
    import ctypes

    if sys.platform.startswith("linux") and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        with contextlib.suppress(OSError, AttributeError):  # musl and other C libraries: their own allocator
            ctypes.CDLL("libc.so.6").mallopt(-3, nbytes)  # M_MMAP_THRESHOLD


def quiet_transformers():
    """Turn off transformers' own progress bars ("Loading weights", ...); the hub's download bars stay."""
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars
    from transformers.utils import logging

    downloads_shown = not are_progress_bars_disabled()
    logging.disable_progress_bar()  # (it turns the hub's off too)
    if downloads_shown:
        enable_progress_bars()


def is_moe(model) -> bool:
    """Whether `model` has sparse mixture-of-experts blocks (a module with a router `gate` and `experts`)."""
    return any(hasattr(m, "gate") and hasattr(m, "experts") for m in model.modules())


def local_config(name: str) -> dict:
    """--model `name`'s config.json, read before any weights load ({} for a hub id)."""
    config = Path(model_path(name, ask_hub=False)) / "config.json"
    return json.loads(config.read_text()) if config.is_file() else {}


def declares_experts(name: str) -> bool:
    """Whether --model `name` (a local directory) has sparse MoE blocks, by its config's own field."""
    return any(local_config(name).get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts"))


def model_path(name: str, ask_hub: bool = True) -> str:
    """Where --model `name` loads from: an embedded checkpoint, tiny-qwen3's (built on first use), or (extras/hub.py)
    a local directory or a hub id's source (the id itself with ask_hub=False)."""
    if name in TINY_MODELS:
        return tiny_checkpoint(name)
    if name == TINY_QWEN3:
        return extra("qwen3_tokenizer", f"--model {name}").tiny_qwen3()
    return extra("hub", f"--model {name}").model_path(name, ask_hub)


def add_lora(model, args):
    """--lora-rank r > 0: `model` training rank-r adapters on its frozen weights (extras/lora.py); else itself."""
    return extra("lora", "--lora-rank").add_lora(model, args) if args.lora_rank else model


def load_tokenizer(name: str):
    """The tokenizer of --model `name`, left-padding, with a pad token."""
    from transformers import AutoTokenizer

    tok = _from_pretrained(AutoTokenizer, name, model_path(name))  # (tiny-qwen3: built on first use)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def _from_pretrained(auto, name: str, path: str, **kwargs):
    """`auto`.from_pretrained(path); a user's --model that does not load is one line, exit 2 (extras/hub.py)."""
    if name in TINY_MODELS:
        return auto.from_pretrained(path, **kwargs)
    return extra("hub", f"--model {name}").from_pretrained(auto, name, path, **kwargs)


def eos_token_ids(model, tok) -> list[int]:
    """Every id that ends a completion: the generation config may list several (Qwen3 does)."""
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tok.eos_token_id is not None and tok.eos_token_id not in ids:
        ids.append(tok.eos_token_id)
    return ids


TINY_MODELS = ("tiny", "tiny-moe", "tiny-sums")

# The shipped checkpoints' directories, each name with a hash of its recipe (tools/recipes.py's checkpoint_key;
# tests/test_common.py checks that they agree): a changed recipe is a new key, so a stale one is never reused.
TINY_KEYS = {
    "tiny": "tiny-qwen3-6ef631b1222a",
    "tiny-moe": "tiny-qwen3moe-b2ca914f64f3",
    "tiny-sums": "tiny-qwen3-sums-be8fdd9ce3ea",
    "tiny-rm": "tiny-rm-24a0eee23632",
}
TINY_QWEN3 = "tiny-qwen3"  # random weights, Qwen3's real tokenizer and generation config: built, not shipped
TINY_RM = "tiny-rm"  # the tiny policy's trunk plus a scalar head (--reward-model tiny-rm; tools/train_reward_model.py)

SHIPPED_CHECKPOINTS = Path(__file__).resolve().parent / "checkpoints"


def cache_root() -> Path:
    return Path(os.environ.get("RLREF_CACHE", Path.home() / ".cache" / "rl-reference"))


def tiny_checkpoint(name: str = "tiny") -> str:
    """Path of an embedded checkpoint (tools/recipes.py holds their recipes), shipped in checkpoints/ so that every
    machine starts from the same weights, or cached under $RLREF_CACHE; else one line naming how to build it."""
    key = TINY_KEYS[name]
    for path in (SHIPPED_CHECKPOINTS / key, cache_root() / key):
        if (path / "config.json").is_file():
            return str(path)
    raise UsageError(
        f"{name}: its checkpoint {key} is neither shipped in checkpoints/ nor cached in {cache_root()} "
        f"(its recipe changed?); build it with: python tools/build_checkpoints.py {name}"
    )


# ---------------------------------------------------------------------------------------------
# 5. Sampling: batched generation with a KV cache: left padding, temperature, top-p, several EOS ids
# ---------------------------------------------------------------------------------------------


@dataclass
class Rollout:
    """A batch of prompts (left-padded) and completions (right-padded): prompt ++ completion is contiguous per row."""

    prompt_ids: torch.Tensor  # [B, P]
    prompt_mask: torch.Tensor  # [B, P] 1 on real prompt tokens
    completion_ids: torch.Tensor  # [B, T]
    completion_mask: torch.Tensor  # [B, T] 1 on generated tokens, the EOS token included
    entropy: torch.Tensor | None = None  # [B, T] the sampling distribution's entropy at each token (sample())
    sample_logp: torch.Tensor | None = None  # [B, T] log mu of each token as drawn, after top-p (record_logp)
    sample_logp_full: torch.Tensor | None = None  # [B, T] log mu before top-p (equal when top_p = 1)
    seconds: float | None = None  # Sampler.sample's time and completion tokens, over `draws` calls (tokens_per_s)
    sampled_tokens: int | None = None
    draws: int | None = None
    # an MoE model's experts of each token in the pi_old forward (recording_experts): [layers, B, P + T, k]; it
    # travels with the batch, so a batch trained steps later replays its own experts
    experts: torch.Tensor | None = None

    def __getitem__(self, idx):
        pick = lambda x: None if x is None else x[idx]  # noqa: E731
        return Rollout(self.prompt_ids[idx], self.prompt_mask[idx], self.completion_ids[idx], self.completion_mask[idx],
                       pick(self.entropy), pick(self.sample_logp), pick(self.sample_logp_full), self.seconds,
                       self.sampled_tokens, self.draws,
                       None if self.experts is None else self.experts[:, idx])  # fmt: skip

    def __len__(self):
        return self.prompt_ids.shape[0]

    @staticmethod
    def from_lists(prompts, completions, pad_id: int, device="cpu"):
        T = max(1, max(map(len, completions)))
        ids = torch.tensor([list(c) + [pad_id] * (T - len(c)) for c in completions], dtype=torch.long, device=device)
        mask = torch.tensor([[1.0] * len(c) + [0.0] * (T - len(c)) for c in completions], device=device)
        return Rollout(*_left_pad(prompts, pad_id, device), ids, mask)

    def completion_lists(self) -> list[list[int]]:
        lengths = self.completion_mask.sum(1).long().tolist()
        return [row[:n] for row, n in zip(self.completion_ids.tolist(), lengths)]


# When the decode loop reads the device (is any row alive?). On a GPU a read waits for every queued kernel: after
# EARLY_READS tokens, then once per READ_EVERY (rows that end in between decode masked padding, their draws rewound).
# On a CPU a read waits for nothing: after every token.
READ_EVERY, EARLY_READS = 16, (4, 8)
READS_EACH_TOKEN_ON = ("cpu",)


def decode_reads(device_type: str, max_new_tokens: int) -> list[bool]:
    """reads[t]: whether the decode loop reads the device after its token t (0-based), on `device_type`."""
    if device_type in READS_EACH_TOKEN_ON:
        return [True] * max_new_tokens
    return [(t + 1) % READ_EVERY == 0 or t + 1 in EARLY_READS for t in range(max_new_tokens)]


def sample(model, prompts: list[list[int]], max_new_tokens: int, eos_ids: list[int], pad_id: int,
           temperature: float = 1.0, top_p: float = 1.0, greedy: bool = False, generator=None,
           record_logp: bool = False, cuda_graph: bool = False) -> Rollout:  # fmt: skip
    """Batched sampling with a KV cache of token-id `prompts` (repeat a prompt n times for n samples). A row stops at
    its first EOS id, the EOS inside the completion mask. Greedy output equals `model.generate`'s. record_logp: keep
    mu's log-probs (Rollout.sample_logp*). Finished rows are dropped when a read of the device finds half the batch
    done; whatever the read schedule (`decode_reads`), the tokens, the draws left in `generator` and the width are a
    per-token loop's. cuda_graph: the decoder's steps replayed as one CUDA graph (extras/cuda_graph.py)."""
    lora = _loaded("lora")
    if lora is not None:  # LoRA: the transformers model whose projections apply the adapters
        model = lora.lora_base(model)
    device = next(model.parameters()).device
    B = len(prompts)
    out = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros(B, max_new_tokens, device=device)
    roll = Rollout(*_left_pad(prompts, pad_id, device), out, mask)  # the completions are filled in below
    if not greedy and generator is None:  # the device's default stream, as an explicit generator (rewound below)
        generator = default_generator(device)
    stats = {name: torch.zeros(B, max_new_tokens, device=device) for name in
             ["entropy"] * (not greedy) + ["sample_logp", "sample_logp_full"] * record_logp}  # fmt: skip
    precision = extra("rollout_precision", "--rollout-dtype") if record_logp else None
    # --fsdp: whole weights while sampling (gathered outside inference mode: FSDP2 reuses their storage)
    with gathered(model), torch.inference_mode():  # no autograd bookkeeping at all; `out` and `mask` stay normal
        decoder, logits = _prefill(model, roll, prompts, pad_id, max_new_tokens)
        graphed = cuda_graph and isinstance(decoder, _StaticKVDecoder)  # only the model forward is in the graph
        step = extra("cuda_graph", "--cuda-graph").GraphedStep(decoder) if graphed else decoder.step
        drops = isinstance(decoder, _StaticKVDecoder) and not graphed  # a graph's batch is fixed
        rows = torch.arange(B, device=device)  # the batch rows still decoded, in the decoder's order
        eos = torch.tensor(eos_ids, dtype=torch.long, device=device)
        alive = torch.ones(B, dtype=torch.bool, device=device)  # per decoded row: no EOS yet
        width = torch.zeros((), dtype=torch.long, device=device)  # steps that some row was alive for
        draws = []  # (step, generator state before its draw) since the last read
        reads = decode_reads(device.type, max_new_tokens)
        for t in range(max_new_tokens):
            if not greedy:
                draws.append((t, generator.get_state()))
            token = torch.where(alive, _next_token(logits, rows, B, temperature, top_p, greedy, generator), pad_id)
            out[rows, t], mask[rows, t] = token, alive.float()
            if not greedy:  # the entropy of logits / temperature before top-p, as completion_logprobs computes it
                scaled = logits.float() / temperature
                stats["entropy"][rows, t] = (scaled.logsumexp(-1) - (scaled.softmax(-1) * scaled).sum(-1)) * alive
            if record_logp:  # mu's log-probs of the token, 0 where done
                for name, value in precision.token_logps(logits, token, alive, temperature, top_p).items():
                    stats[name][rows, t] = value
            width += alive.any()
            alive &= ~torch.isin(token, eos)
            if t == max_new_tokens - 1:
                break
            if reads[t]:  # the loop's one read of the device
                alive_now = _host(alive)
                if not any(alive_now):
                    break
                draws.clear()
                if drops and 2 * sum(alive_now) <= len(rows):  # drop finished rows
                    keep = torch.tensor([i for i, a in enumerate(alive_now) if a], device=device)
                    decoder.keep(keep)
                    rows, alive, token = rows[keep], alive[keep], token[keep]
            logits = step(token)
        width = _host(width)  # every row had ended by then: the completions' width
    rewind = dict(draws).get(width)  # undo the draws past the last row's end, as if the loop had stopped there
    if rewind is not None:
        generator.set_state(rewind)
    return Rollout(roll.prompt_ids, roll.prompt_mask, out[:, :width], mask[:, :width],
                   **{name: x[:, :width] for name, x in stats.items()})  # fmt: skip


class Sampler:
    """The policy as the rollout samples it, with the run's sampling flags. --rollout-dtype bfloat16: a bf16 copy cast
    from it at every rollout (extras/rollout_precision.py; under --fsdp from the gathered weights: make the Sampler
    before `data_parallel`). It records mu (Rollout.sample_logp) whenever anything reads it."""

    def __init__(self, model, tok, args):
        self.model, self.args, self.dtype = model, args, ROLLOUT_DTYPES[args.rollout_dtype]
        self.eos_ids, self.pad_id = eos_token_ids(model, tok), tok.pad_token_id
        self.records = (args.rollout_dtype, args.old_logp, args.is_correction) != ("float32", "recompute", "none")
        self.copy = None
        if self.dtype != torch.float32:
            self.copy = extra("rollout_precision", "--rollout-dtype").LowPrecisionCopy(model, self.dtype)

    def sample(self, prompts: list[list[int]], generator) -> Rollout:
        a, t0 = self.args, time.perf_counter()
        flags = (a.max_new_tokens, self.eos_ids, self.pad_id, a.temperature, a.top_p)
        with gathered(self.model):  # --fsdp: whole weights (bf16 ones under its bf16 MixedPrecisionPolicy)
            with self.copy.cast_from(self.model) if self.copy else contextlib.nullcontext(self.model) as policy:
                roll = sample(
                    policy, prompts, *flags, generator=generator, record_logp=self.records, cuda_graph=a.cuda_graph
                )
        roll.seconds, roll.sampled_tokens, roll.draws = time.perf_counter() - t0, int(roll.completion_mask.sum()), 1
        return roll


def _prefill(model, roll: Rollout, prompts, pad_id: int, max_new_tokens: int):
    """(decoder, next-token logits [B, V]): a Llama-family model through `_StaticKVDecoder`, each distinct prompt
    prefilled once; any other through its own forward (extras/hf_decoder.py)."""
    if not _StaticKVDecoder.supports(model):
        decoder = extra("hf_decoder", f"--model {type(model).__name__}").HFDecoder(model, roll, max_new_tokens)
        return decoder, decoder.prefill()
    first, copies = _distinct_rows(prompts, pad_id)
    if len(first) == len(prompts):
        decoder = _StaticKVDecoder(model, roll, max_new_tokens)
        return decoder, decoder.prefill()
    device = roll.prompt_ids.device
    decoder = _StaticKVDecoder(model, roll[torch.tensor(first, device=device)], max_new_tokens)
    logits = decoder.prefill()
    copies = torch.tensor(copies, device=device)
    decoder.keep(copies)
    return decoder, logits.index_select(0, copies)


def default_generator(device: torch.device) -> torch.Generator:
    """The generator a random call on `device` draws from when given none."""
    if device.type == "cuda":
        return torch.cuda.default_generators[torch.cuda.current_device() if device.index is None else device.index]
    return torch.default_generator


def _host(x: torch.Tensor):
    """`x` as Python values: the decode loop's one way to read the device (the tests count its calls)."""
    return x.tolist()


def _distinct_rows(prompts: list[list[int]], pad_id: int) -> tuple[list[int], list[int]]:
    """(first, copies): a row index of each distinct prompt, in the order its left-padded ids and mask sort
    (torch.unique's), and copies[i], the place of row i's prompt in `first`: prompts[first[copies[i]]] == prompts[i]."""
    P = max(map(len, prompts))
    key = lambda p: ([pad_id] * (P - len(p)) + list(p), len(p))  # noqa: E731 (ids left-padded, then the mask)
    places = {}
    for i, p in enumerate(prompts):
        places.setdefault(tuple(p), i)
    first = sorted(places.values(), key=lambda i: key(prompts[i]))
    place = {tuple(prompts[i]): n for n, i in enumerate(first)}
    return first, [place[tuple(p)] for p in prompts]


def _next_token(logits, rows, batch_size: int, temperature: float, top_p: float, greedy: bool, generator):
    """One token for each row in `rows` from its logits [len(rows), V]: torch.multinomial's own method (argmax of
    probs / Exp(1) noise), the noise drawn for the whole batch so that a row's draws do not depend on the others."""
    if greedy:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_p < 1.0:
        logits = _top_p_filter(logits, top_p)
    noise = torch.empty(batch_size, logits.shape[-1], device=logits.device).exponential_(generator=generator)
    return (logits.softmax(-1) / noise[rows]).argmax(-1)


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability reaches top_p (nucleus sampling)."""
    sorted_logits, order = logits.sort(-1, descending=True)
    cum = sorted_logits.softmax(-1).cumsum(-1)
    drop = cum - sorted_logits.softmax(-1) >= top_p  # tokens entirely beyond the nucleus
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def _left_pad(prompts: list[list[int]], pad_id: int, device):
    """([B, P] ids left-padded with pad_id, [B, P] mask of the real tokens)."""
    P = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (P - len(p)) + list(p) for p in prompts], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long, device=device)
    return ids, mask


class _StaticKVDecoder:
    """Prefill and one-token steps of a Llama-family decoder through the model's own modules, with the HF forward's
    arithmetic (the attention's rounding differs), over one `sample` call's buffers: k, v [B, kv_heads, C, head_dim]
    per layer (slot s holds position s; C grows GROW slots at a time, so a step attends over about the slots
    written), `bias` [B, 1, 1, P + T] (-inf on left padding and unwritten slots), cos/sin (RoPE from each row's first
    real token). On CPU (FUSED_ON) q, k, v are one matmul, as are the MLP's gate and up."""

    GROW = 16
    FUSED_ON = ("cpu",)
    MODEL_TYPES = ("qwen2", "qwen3", "llama")

    @classmethod
    def supports(cls, model) -> bool:
        from transformers import PreTrainedModel

        return isinstance(model, PreTrainedModel) and cls.supports_config(model.config.to_dict())

    @classmethod
    def supports_config(cls, config: dict) -> bool:
        """A config.json's fields: a Llama-family model whose layers all attend fully (no sliding window)."""
        layer_types = set(config.get("layer_types") or ["full_attention"])
        return config.get("model_type") in cls.MODEL_TYPES and layer_types == {"full_attention"}

    def __init__(self, model, roll: Rollout, max_new_tokens: int):
        config, self.base, self.lm_head = model.config, model.get_decoder(), model.get_output_embeddings()
        self.prompt_ids, (B, P), device = roll.prompt_ids, roll.prompt_ids.shape, roll.prompt_ids.device
        L, attn = P + max_new_tokens, self.base.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, attn.head_dim
        kv_shape = (B, self.kv_heads, min(L, P + self.GROW), self.head_dim)
        self.k = [torch.zeros(kv_shape, dtype=attn.k_proj.weight.dtype, device=device) for _ in self.base.layers]
        self.v = [torch.zeros_like(k) for k in self.k]
        valid = F.pad(roll.prompt_mask.bool(), (0, max_new_tokens))  # [B, L]
        self.bias = torch.where(valid[:, None, None], 0.0, -math.inf).to(self.k[0].dtype)  # [B, 1, 1, L]
        positions = (F.pad(roll.prompt_mask, (0, max_new_tokens), value=1).cumsum(1) - 1).clamp(min=0)
        self.cos, self.sin = self.base.rotary_emb(self.k[0], positions)  # [B, L, head_dim]
        half = self.head_dim // 2  # rotate_half(x) * sin == x.roll(half) * [-sin[:half], sin[half:]]
        self.sin = torch.cat([-self.sin[..., :half], self.sin[..., half:]], -1)
        self.slot = P
        self.weights = [_layer_weights(layer, self.heads, self.kv_heads, device.type in self.FUSED_ON)
                        for layer in self.base.layers]  # fmt: skip

    def prefill(self) -> torch.Tensor:
        """Run the prompts into slots 0..P-1; next-token logits [B, V] (float32)."""
        P, device = self.prompt_ids.shape[1], self.prompt_ids.device
        causal = torch.ones(P, P, dtype=torch.bool, device=device).tril()
        # a padding query sees itself too, so that no softmax row is empty (its output is unused)
        visible = causal & ((self.bias[..., :P] == 0) | torch.eye(P, dtype=torch.bool, device=device))
        bias = torch.zeros(visible.shape, dtype=self.bias.dtype, device=device).masked_fill_(~visible, -math.inf)
        # one row per (query head of a group, position), as _layer_forward lays the queries out
        return self._forward(self.prompt_ids, 0, bias.repeat(1, 1, self.heads // self.kv_heads, 1))

    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Feed one token per row [B]; next-token logits [B, V] (float32). The slot: an int, or a CUDA graph's [1]
        tensor, advanced in place over a whole cache."""
        if isinstance(self.slot, int) and self.slot == self.k[0].shape[2]:  # full: GROW more slots (up to P + T)
            more = (0, 0, 0, min(self.GROW, self.bias.shape[-1] - self.slot))
            for i in range(len(self.k)):
                self.k[i], self.v[i] = F.pad(self.k[i], more), F.pad(self.v[i], more)
        self.bias[..., self.slot] = 0.0  # the new token's slot becomes visible
        logits = self._forward(token[:, None], self.slot, self.bias[..., : self.k[0].shape[2]])
        self.slot += 1
        return logits

    def keep(self, rows: torch.Tensor):
        """Keep the rows `rows` of every buffer, in that order (drops finished rows, or copies prefilled prompts)."""
        take = lambda x: x.index_select(0, rows)  # noqa: E731 (several times faster than x[rows] on CPU)
        self.k, self.v = [take(k) for k in self.k], [take(v) for v in self.v]
        self.bias, self.cos, self.sin = take(self.bias), take(self.cos), take(self.sin)

    def _forward(self, ids, first, bias):
        """`ids` [B, S] into slots first..first+S-1, attending with `bias` [B, 1, G * S or 1, N]: the last's logits."""
        h = self.base.embed_tokens(ids)
        at = slice(first, first + ids.shape[1]) if isinstance(first, int) else first  # the slots (a [1] tensor: one)
        rope = self.cos[:, at, None], self.sin[:, at, None]
        for i, (layer, k_cache, v_cache) in enumerate(zip(self.base.layers, self.k, self.v)):
            h = _layer_forward(layer, self.weights[i], h, rope, k_cache, v_cache, at, bias, i == len(self.k) - 1)
        return self.lm_head(self.base.norm(h[:, -1])).float()  # the module itself: its hooks run


def _layer_weights(layer, heads: int, kv_heads: int, fuse: bool) -> tuple:
    """(heads, qkv, gate_up, qk_norm) of a layer: with `fuse`, the q, k, v projections as one (weight, bias), a gated
    MLP's gate and up as one (else None); Qwen3's q_norm and k_norm weights as one [heads + kv_heads, D]."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = _concat_linears(attn.q_proj, attn.k_proj, attn.v_proj) if fuse else None
    gated = type(mlp).__name__ in ("Qwen2MLP", "Qwen3MLP", "LlamaMLP")  # down_proj(act_fn(gate_proj(x)) * up_proj(x))
    gate_up = _concat_linears(mlp.gate_proj, mlp.up_proj) if fuse and gated else None
    qk_norm = None
    if hasattr(attn, "q_norm"):
        qk_norm = torch.cat([attn.q_norm.weight.expand(heads, -1), attn.k_norm.weight.expand(kv_heads, -1)])
    return heads, qkv, gate_up, qk_norm


def _layer_forward(layer, weights, h, rope, k_cache, v_cache, at, bias, last: bool):
    """One decoder layer on hidden states `h` [B, S, hidden], its keys and values written into the cache slots `at`
    (a slice, or a [1] tensor); the last layer (`last`), once they are cached, runs for the last token only."""
    (H, qkv, gate_up, qk_norm), attn = weights, layer.self_attn
    (B, S, _), D, Hkv, N = h.shape, attn.head_dim, k_cache.shape[1], bias.shape[-1]
    x = _rms_norm(h, layer.input_layernorm)
    if qkv is None:
        qk, v = torch.cat([attn.q_proj(x), attn.k_proj(x)], -1), attn.v_proj(x)
    else:
        qk, v = F.linear(x, *qkv).split([(H + Hkv) * D, Hkv * D], -1)
    qk = qk.unflatten(-1, (H + Hkv, D))  # queries and keys [B, S, H + Hkv, D]: one norm, one rotation
    if qk_norm is not None:
        qk = qk_norm * F.rms_norm(qk.float(), (D,), eps=attn.q_norm.variance_epsilon).to(qk.dtype)
    qk = torch.addcmul(qk * rope[0], qk.roll(D // 2, -1), rope[1])
    k_cache[:, :, at] = qk[:, :, H:].transpose(1, 2)
    v_cache[:, :, at] = v.unflatten(-1, (Hkv, D)).transpose(1, 2)
    # query heads h*G .. h*G+G-1 share KV head h (HF's repeat_kv order): [B, Hkv, G * S, D]
    q = qk[:, :, :H].transpose(1, 2).reshape(B, Hkv, H // Hkv * S, D)
    if S > 1 and last:  # its keys and values are cached: the rest matters for the last token only
        q, bias = q.unflatten(2, (H // Hkv, S))[:, :, :, -1:].flatten(2, 3), bias[..., S - 1 :: S, :]
        h, S = h[:, -1:], 1
    out = _attention(q, k_cache[:, :, :N], v_cache[:, :, :N], bias, attn.scaling)
    # reshape, not view: SDPA's output on CUDA is strided ([B, Hkv, M, D] laid out as [B, M, Hkv, D])
    h = h + attn.o_proj(out.reshape(B, H, S, D).transpose(1, 2).reshape(B, S, H * D))
    x = _rms_norm(h, layer.post_attention_layernorm)
    if gate_up is None:
        return h + layer.mlp(x)
    gate, up = F.linear(x, *gate_up).chunk(2, -1)  # down(act(gate(x)) * up(x)), as the MLP's forward
    return h + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)


def _rms_norm(x, norm):
    """`norm` (an HF RMSNorm module) applied as HF does: float32 statistics, cast back to x's
    dtype, then the weight (for float32 x, inside the same call: bit for bit the same)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, x.shape[-1:], norm.weight, eps=norm.variance_epsilon)
    return norm.weight * F.rms_norm(x.float(), x.shape[-1:], eps=norm.variance_epsilon).to(x.dtype)


def _concat_linears(*linears) -> tuple:
    """(weight, bias) of one nn.Linear equal to `linears` applied side by side (outputs concatenated).
    A LoRA layer's weight is its effective one, adapters included (its `.weight` is the base's)."""
    bias = None if linears[0].bias is None else torch.cat([m.bias for m in linears])
    lora = _loaded("lora")
    weight = lora.effective_weight if lora is not None else (lambda linear: linear.weight)
    return torch.cat([weight(m) for m in linears]), bias


def _attention(q, k, v, bias, scale: float, fused: bool | None = None):
    """softmax(q k^T * scale + bias) v per KV head: q [B, Hkv, M, D], k and v [B, Hkv, N, D], bias broadcastable to
    [B, Hkv, M, N]. `fused` (default: on CUDA): SDPA, whose output may be strided; else plain matmuls (faster on CPU
    for one-token queries)."""
    if q.is_cuda if fused is None else fused:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    scores = (q @ k.transpose(-1, -2)) * scale + bias
    return scores.softmax(-1, dtype=torch.float32).to(v.dtype) @ v


def completion_ends(roll: Rollout, eos_ids: list[int]) -> torch.Tensor:
    """[B] bool: the completion ended with an EOS token (False: cut at --max-new-tokens). Only real tokens
    count: the pad id may itself be an EOS id (Qwen3's <|endoftext|>), and padding is not an ending."""
    eos = torch.isin(roll.completion_ids, torch.tensor(eos_ids, device=roll.completion_ids.device))
    return (eos & roll.completion_mask.bool()).any(1)


# ---------------------------------------------------------------------------------------------
# 6. Rewards and evaluation: the --reward functions (built-ins and your own), greedy evaluation, pass@k
# ---------------------------------------------------------------------------------------------


_NUMBER = re.compile(r"[-+]?\d[\d,]*(\.\d+)?|[-+]?\.\d+")


def normalize_number(s: str) -> str | None:
    """'1,234' -> '1234', '12.0' -> '12', '+5' -> '5'; None if `s` is not exactly one number."""
    s = s.strip().replace("$", "")
    if not _NUMBER.fullmatch(s):
        return None
    s = s.replace(",", "").lstrip("+")
    if s.startswith((".", "-.")):  # '.5' -> '0.5', '-.5' -> '-0.5'
        s = s.replace(".", "0.", 1)
    if "." in s:
        s = s.rstrip("0").rstrip(".")
    if s in ("-0", "-", ""):
        s = "0"
    return s


def after_thinking(completion: str) -> str | None:
    """The part of a completion that states its answer: the text after the last </think> (--thinking on), else the
    whole completion; None when it opens <think> and never closes it (its answer is still inside its reasoning)."""
    if "</think>" in completion:
        return completion.rsplit("</think>", 1)[1]
    return None if "<think>" in completion else completion


def score(completion: str, answer: str, parser: str = "exact") -> tuple[float, float]:
    """(reward, format_ok): reward 1.0 iff the final answer `parser` reads (after </think>: `after_thinking`) equals
    the gold answer, format_ok 1.0 iff it reads one. "exact": the text after the last '####' (or the whole text);
    "boxed": the last \\boxed{}'s content. A numeric gold needs exactly one number there, compared normalised
    ('1,234' = '1234.0'); any other, the stripped text."""
    completion = after_thinking(completion)
    if completion is None:
        return 0.0, 0.0
    if parser == "boxed":  # --reward boxed
        text = extra("reward_functions", "--reward boxed").extract_boxed(completion)
    else:
        text = completion.rsplit("####", 1)[-1]
    gold = normalize_number(answer)
    numeric = gold is not None  # else an exact string match after stripping
    gold = gold if numeric else answer.strip()
    pred = None if text is None else normalize_number(text) if numeric else text.strip() or None
    return float(pred is not None and pred == gold), float(pred is not None)


def score_rollout(tok, roll: Rollout, answers: list[str], parser: str = "exact"):
    """(correct [B], format_ok [B]) for a rollout whose row i answers answers[i] (`score`)."""
    texts = tok.batch_decode(roll.completion_lists(), skip_special_tokens=True)
    scored = [score(text, ans, parser) for text, ans in zip(texts, answers)]
    return torch.tensor([s[0] for s in scored]), torch.tensor([s[1] for s in scored])


BUILTIN_REWARDS = ("exact", "boxed", "format")  # --reward NAME (SharedArgs.reward); each reads a record's "answer"


class RewardError(UsageError):
    """A --reward function failed or returned something that is not a reward: exit status 2."""


def _clip(text, width: int = 40) -> str:
    """repr(text), its middle cut to keep it about `width` characters."""
    text = repr(text)
    return text if len(text) <= width else text[: width // 2 - 2] + "..." + text[-(width // 2 - 1) :]


class Rewards:
    """The run's reward, reward_i = sum_k w_k f_k(row i), over --reward f_1 .. f_K with --reward-weights w_k (default
    1). By default f is --reward exact alone: `score`, 1.0 when the completion's answer (after its last '####')
    equals the record's. The built-ins score the run's answer parser (`score`); `accuracy` and `format_rate` are
    reported whenever every record has an answer, so that "correct" means the same in training and in evaluation.
    All but exact or format alone load extras/reward_functions.py (docs/rewards.md)."""

    def __init__(self, specs=("exact",), weights=(), records=(), reward_model=None, reward_model_weight: float = 1.0):
        self.names, self.fns, self.weights = list(specs), [None] * len(specs), [1.0] * len(specs)
        if list(specs) not in (["exact"], ["format"]) or weights or reward_model is not None:
            mixed = extra("reward_functions", "--reward (boxed, several, your own), --reward-weights, --reward-model")
            self.names, self.fns, self.weights = mixed.load_rewards(specs, weights, reward_model, reward_model_weight)
        self.parser = "boxed" if "boxed" in specs else "exact"
        self.columns = list(dict.fromkeys(k for r in records for k in r if k != "prompt"))  # every record's fields
        self.scores_answers = all(isinstance(r.get("answer"), str) for r in records)

    def __call__(self, tok, roll: Rollout, records: list[dict]) -> tuple[torch.Tensor, dict]:
        """`score`; under torchrun, a failure on any rank stops every rank (else they would wait in an all-reduce)."""
        error, result = None, None
        try:
            result = self.score(tok, roll, records)
        except RewardError as e:
            error = e
        raise_on_every_rank(error)
        return result

    def score(self, tok, roll: Rollout, records: list[dict]) -> tuple[torch.Tensor, dict]:
        """(rewards [B], parts) for a rollout whose row i comes from records[i], on this rank alone: parts holds each
        component as "reward/<name>" [B] and, when records have answers, "accuracy" and "format_rate" [B]."""
        answers = [r.get("answer") for r in records]
        scored = functools.cache(lambda parser: score_rollout(tok, roll, answers, parser))  # (correct, format_ok)
        parts, own = {}, extra("reward_functions", "--reward") if any(f is not None for f in self.fns) else None
        for name, fn in zip(self.names, self.fns):
            if fn is None:  # a built-in
                correct, formats = scored(self.parser if name == "format" else name)
                parts[f"reward/{name}"] = formats if name == "format" else correct
            else:
                parts[f"reward/{name}"] = own.call(name, fn, records, tok, roll, self.columns)
        rewards = sum(w * parts[f"reward/{name}"].double() for name, w in zip(self.names, self.weights)).float()
        if self.scores_answers:
            parts["accuracy"], parts["format_rate"] = scored(self.parser)
            if "reward/reward_model" in parts:  # how well the learned reward ranks this batch's answers
                learned = _loaded("reward_model")
                parts["reward_model_pair_acc"] = learned.pair_accuracy(parts["reward/reward_model"], parts["accuracy"])
        return rewards, parts


@torch.no_grad()
def evaluate(model, tok, examples, max_new_tokens: int, reward_fn: Rewards | None = None,
             system_prompt: str = SYSTEM_PROMPT, n_samples: int = 0, temperature: float = 1.0, top_p: float = 1.0,
             generator=None, show: int = 0, batch_size: int = 256, thinking: str = "off") -> dict:  # fmt: skip
    """The means over greedy completions of `examples` of reward (`reward_fn`'s, default exact), reward/reward_model
    (with --reward-model) and, when records have answers, accuracy and format_rate; pass@1 and pass@n with n_samples
    = n >= 2 (extras/pass_at_k.py); with show = k > 0, the first k examples' "samples". Under torchrun each rank
    evaluates every world-th example and the means are over all ranks."""
    reward_fn = reward_fn or Rewards()
    was_training = model.training
    model.eval()
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        examples = examples[dist.get_rank() :: dist.get_world_size()]
    keys = ["accuracy", "format_rate"] * reward_fn.scores_answers + ["reward"]
    keys += ["reward/reward_model"] * ("reward_model" in reward_fn.names)  # the proxy's own score, when mixed
    keys += ["pass@1", f"pass@{n_samples}"] if n_samples else []
    per_row = {k: [torch.zeros(0)] for k in keys}  # the same keys on every rank, however few its examples
    eos, error, samples = eos_token_ids(model, tok), None, []
    per_batch = max(1, batch_size // max(1, n_samples))
    try:
        with gathered(model):  # --fsdp: whole weights, gathered once, however many batches this rank has
            for s in range(0, len(examples), per_batch):
                batch = examples[s : s + per_batch]
                prompts = encode_prompts(tok, batch, system_prompt, thinking)
                roll = sample(model, prompts, max_new_tokens, eos, tok.pad_token_id, greedy=True)
                rewards, parts = reward_fn.score(tok, roll, batch)
                if s == 0 and show:
                    samples = _described(tok, roll[:show], batch[:show], rewards, parts, eos)
                rates = extra("pass_at_k", "--eval-samples").pass_rates(model, tok, prompts, batch, reward_fn,
                    n_samples, max_new_tokens, eos, temperature, top_p, generator) if n_samples else {}  # fmt: skip
                for k, v in {"reward": rewards, **parts, **rates}.items():
                    if k in per_row:
                        per_row[k].append(v.float())
    except RewardError as e:
        error = e
    raise_on_every_rank(error)
    model.train(was_training)
    result = {k: global_mean(torch.cat(v)) for k, v in per_row.items()}
    return {**result, "samples": samples} if show else result


def _described(tok, roll: Rollout, records, rewards, parts, eos) -> list[dict]:
    texts = tok.batch_decode(roll.completion_lists(), skip_special_tokens=True)
    ends = completion_ends(roll, eos).tolist()
    components = {k.removeprefix("reward/"): v for k, v in parts.items() if k.startswith("reward/")}
    return [{"prompt": rec["prompt"], "completion": text, "reward": rewards[i].item(),
             "rewards": {name: v[i].item() for name, v in components.items()}, "answer": rec.get("answer"),
             "truncated": not ends[i]} for i, (rec, text) in enumerate(zip(records, texts))]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# 7. Log-probs: per-token log-probs and entropy in float32, chunked over the vocabulary; the training forward
# ---------------------------------------------------------------------------------------------


def completion_logprobs(model, roll: Rollout, temperature: float = 1.0, chunk_tokens: int | str | None = "auto",
                        entropy_grad: bool = False):  # fmt: skip
    """(logp [B, T], entropy [B, T]) of the completion tokens under `model` (a *ForCausalLM), finite on padding
    (multiply by `roll.completion_mask`); the entropy detached unless `entropy_grad` (--entropy-coef). Under --fsdp
    through the model's CompletionLogprobs root, whose forward gathers the weights it holds."""
    fsdp = _loaded("fsdp")
    forward = fsdp.LOGPROBS_ROOT.get(model) if fsdp is not None else None
    return (forward or CompletionLogprobs(model).forward)(roll, temperature, entropy_grad, chunk_tokens)


class CompletionLogprobs(torch.nn.Module):
    """`completion_logprobs` as a module's forward, which the scripts wrap: DDP averages the gradients of what runs
    through its module's forward, FSDP2 gathers its root's weights there (its outputs are views: change them out of
    place)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, roll: Rollout, temperature: float = 1.0, entropy_grad: bool = False, chunk_tokens="auto"):
        hidden = completion_hidden_states(self.model.get_decoder(), roll)
        weight = self.model.get_output_embeddings().weight
        return logprobs_from_hidden(hidden, weight, roll.completion_ids, temperature, chunk_tokens, entropy_grad)


def completion_hidden_states(backbone, roll: Rollout, bf16: bool | None = None) -> torch.Tensor:
    """[B, T, H] final hidden states at the positions that predict each completion token; `bf16` (default: on CUDA)
    runs the forward under bf16 autocast (tests use a CPU's)."""
    ids = torch.cat([roll.prompt_ids, roll.completion_ids], 1)
    attn = torch.cat([roll.prompt_mask, roll.completion_mask.long()], 1)
    positions = (attn.cumsum(1) - 1).clamp(min=0)
    bf16 = ids.is_cuda if bf16 is None else bf16
    # bf16 compute, fp32 weights. Under --fsdp autocast's cache would keep every gathered layer's bf16 cast until
    # the forward ends, a whole copy of the model; uncached, --grad-checkpointing frees each with its layer
    cache = bf16 and not sharded(backbone)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=bf16, cache_enabled=cache):
        hidden = backbone(input_ids=ids, attention_mask=attn, position_ids=positions).last_hidden_state
    P, T = roll.prompt_ids.shape[1], roll.completion_ids.shape[1]
    return hidden[:, P - 1 : P + T - 1].float()  # the log-probs and the loss are float32


LOGITS_CHUNK_ELEMENTS = 2**24  # a CPU's: 64 MB of float32 logits, ~110 tokens of Qwen's vocabulary (docs/memory.md)
LOGITS_CHUNK_GPU_SHARE = 32


def logits_chunk_elements(device: torch.device | str, gpu_memory: int | None = None) -> int:
    """Float32 logits per log-prob chunk (chunk_tokens="auto") on `device`. CUDA: the largest power of two whose
    chunk peak (4 float32 copies of the logits) fits in 1/LOGITS_CHUNK_GPU_SHARE of the GPU's total memory (not
    the free: the same chunk every step, known to tools/plan_memory.py), never less than a CPU's."""
    device = torch.device(device)
    if device.type != "cuda":
        return LOGITS_CHUNK_ELEMENTS
    gpu_memory = gpu_memory or torch.cuda.get_device_properties(device).total_memory
    fits = gpu_memory // (LOGITS_CHUNK_GPU_SHARE * 4 * 4)
    return max(LOGITS_CHUNK_ELEMENTS, 1 << (max(fits, 1).bit_length() - 1))


def logprobs_from_hidden(hidden, weight, targets, temperature: float = 1.0, chunk_tokens: int | str | None = "auto",
                         entropy_grad=False):  # fmt: skip
    """Per-token log p(target) and entropy in float32 of logits / temperature, from hidden states [..., H] and the
    output projection `weight` [V, H]. The logits are made `chunk_tokens` tokens at a time ("auto":
    `logits_chunk_elements`; None: one chunk), each recomputed in backward, so no [B, T, V] tensor exists."""
    h, y = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    if chunk_tokens == "auto":
        chunk_tokens = max(1, logits_chunk_elements(h.device) // weight.shape[0])
    n = h.shape[0]
    size = n if chunk_tokens is None or n <= chunk_tokens else chunk_tokens
    recompute = size < n and torch.is_grad_enabled()
    chunks = [(h[s : s + size], weight, y[s : s + size], temperature, entropy_grad) for s in range(0, n, max(size, 1))]
    out = [checkpoint(_logp_entropy_chunk, *c, use_reentrant=False) if recompute else _logp_entropy_chunk(*c)
           for c in chunks] or [_logp_entropy_chunk(h, weight, y, temperature, entropy_grad)]  # fmt: skip
    return tuple(torch.cat(x).view(targets.shape) for x in zip(*out))


def _logp_entropy_chunk(hidden, weight, targets, temperature: float, entropy_grad: bool = False):
    # [n, V] float32, one chunk only (a bf16 weight, gathered by --fsdp's MixedPrecisionPolicy, is cast per chunk)
    logits = (hidden @ weight.T.to(hidden.dtype)).float() / temperature
    logz = logits.logsumexp(-1)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - logz
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):  # else a diagnostic: no graph kept
        entropy = logz - (logits.softmax(-1) * logits).sum(-1)  # H = log Z - sum_v p_v z_v
    return logp, entropy


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean of x over mask == 1 (same mask in numerator and denominator); 0 where mask is empty."""
    mask = mask.to(x.dtype)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


# ---------------------------------------------------------------------------------------------
# 8. Updates: the non-finite guard, the learning-rate schedule, the trace, MoE routing, the step's sums over ranks
# ---------------------------------------------------------------------------------------------


def token_mean_scale(mask: torch.Tensor) -> torch.Tensor:
    """Factor for a loss that is a token mean over this rank's minibatch `mask` [B, T]: under torchrun the rank's
    share of all ranks' tokens, so that DDP's average of the gradients is the whole batch's token mean; else 1."""
    return mask.sum().clamp(min=1) / mean_denominator(mask.sum())


def anneal_lr(args, step: int, *optimizers: tuple) -> float:
    """--anneal-lr: each (optimizer, base_lr)'s learning rate set to base_lr * frac, frac falling linearly from 1 at
    step 1 to 1/steps at the last (CleanRL's schedule); returns frac (1 when off). Stateless: --resume continues it."""
    frac = 1.0 - (step - 1) / args.steps if args.anneal_lr else 1.0
    for optimizer, base_lr in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = base_lr * frac
    return frac


class NonFiniteError(Exception):
    """Too many updates in a row had a non-finite loss or gradient norm: exit status 3."""


class NonFiniteGuard:
    """Lets an update step the optimizer only if its loss and gradient norms are finite (a skipped update leaves the
    weights and AdamW's state exactly as they were); `limit` skips in a row stop the run (NonFiniteError: exit 3)."""

    limit = 3

    def __init__(self):
        self.in_a_row = 0

    def ok(self, step: int, *values: torch.Tensor) -> bool:
        finite = all(torch.isfinite(v).all() for v in values)
        self.in_a_row = 0 if finite else self.in_a_row + 1
        if not finite and self.in_a_row >= self.limit:
            raise NonFiniteError(f"loss or gradient norm not finite in {self.in_a_row} consecutive updates (step "
                                 f"{step}); stopping with the weights of the last finite update: lower --lr or check "
                                 "the data")  # fmt: skip
        return finite

    def state_dict(self):  # (its own, so that a checkpoint of a default run needs nothing from extras/)
        return {"in_a_row": self.in_a_row}

    def load_state_dict(self, state):
        self.in_a_row = state["in_a_row"]


def check_filter_groups(args):
    """grpo.py's and gspo.py's --filter-groups and --max-sample-rounds."""
    if args.max_sample_rounds < 1:
        raise UsageError(f"--max-sample-rounds must be >= 1, got {args.max_sample_rounds}")
    if args.filter_groups and args.group_size < 2:
        raise UsageError(f"--filter-groups keeps groups whose rewards differ: --group-size must be >= 2, "
                         f"got {args.group_size}")  # fmt: skip
    if args.filter_groups:  # (its module, before anything is written)
        extra("filter_groups", "--filter-groups")


def trace_due(args, step: int) -> bool:
    """--trace-every N: every N steps; none (the default): at each evaluation (--eval-every and the last step),
    where this copy of the project has extras/traces.py; 0: never."""
    if args.trace_every is not None:
        return bool(args.trace_every) and step % args.trace_every == 0
    evaluates = bool(args.eval_every and step % args.eval_every == 0) or step == args.steps
    return evaluates and (EXTRAS / "traces.py").is_file()


def start_trace(args, env, tok, sampler, step, roll, records, rewards, parts, advantages, old_logp, **per_token):
    """On a step `trace_due` names (rank 0): extras/traces.py's Trace of the rollout as sampled, scored and handed to
    the updates (`per_token`: ref_logp, value, token_reward), which each update adds to; else None."""
    if env.rank > 0 or not trace_due(args, step):
        return None
    per_token = {"ref_logp": None, "value": None, "token_reward": None, **per_token}
    return extra("traces", "--trace-every").Trace(args, tok, sampler.eos_ids, step, roll, records, rewards, parts,
                                                  advantages, old_logp, per_token)  # fmt: skip


def routing(model):
    """An MoE model's RoutingReplay (extras/moe.py: pi_old's experts, routing_drift, --routing-replay); dense: None."""
    return extra("moe", "an MoE --model").RoutingReplay(model) if is_moe(model) else None


def recording_experts(moe, roll: Rollout):
    """Context for pi_old's forward of `roll`: an MoE model's `moe` (`routing`) records its experts (roll.experts)."""
    return contextlib.nullcontext() if moe is None else moe.recording(roll)


def tokens_per_s(roll: Rollout) -> float:
    """Every completion token sampled for `roll` on all ranks, per second of this rank's sampling (Sampler.sample)."""
    return all_reduce_sum(torch.tensor(float(roll.sampled_tokens))).item() / roll.seconds


def global_token_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    """The mean of `x` [B, T] over every rank's tokens where `mask` is 1."""
    return (all_reduce_sum((x * mask).sum()) / all_reduce_sum(mask.sum()).clamp(min=1)).item()


# ---------------------------------------------------------------------------------------------
# 9. The run: its start (--resume, or step 0's evaluation), each step's row and warnings, its end (summary.json)
# ---------------------------------------------------------------------------------------------


SAMPLES_SHOWN = 3  # evaluation prompts whose completions are printed and kept in samples.jsonl
SHOWN = ("clip_frac", "clip_frac_seqs")  # printed beside each evaluation, with the script's `shown`


def start_run(args, env: Setup, model, tok, state: dict) -> RunLogger:
    """Before the first step: the reward tried on the run's shapes, then --resume's checkpoint loaded into `model`,
    each `state` object and the RNG states, or else step 0 evaluated; only then --out replaced and opened. Resume is
    exact only if `state` holds all that moves during the run (a generator, a scheduler, a carried batch)."""
    for name, obj in state.items():  # each restored in place on --resume
        instance = dataclasses.is_dataclass(obj) and not isinstance(obj, type)
        if not (instance or isinstance(obj, (torch.Generator, list, dict)) or hasattr(obj, "load_state_dict")):
            raise ValueError(f"start_run: state {name}={type(obj).__name__} cannot be checkpointed: pass a "
                             "generator, an object with load_state_dict(), or a list, dict or dataclass")  # fmt: skip
    progress, samples = state["progress"], []
    check_rewards(args, env, model, tok)
    if env.resume_from:
        extra("resume", "--resume").load_checkpoint(env.resume_from, model, checkpointed(state, model), env.rank,
                                                    env.world, env.device)  # fmt: skip
    else:
        progress.eval_before, samples = evaluate_run(args, env, model, tok, 0)
        progress.last_eval = progress.eval_before
        if env.rank == 0:
            tqdm.write(f"step 0: {describe_eval(progress.eval_before)}")
    hold_out(args.out, env.rank)  # only now: a run that failed its checks has written nothing
    if env.resume_from and env.rank == 0:
        tqdm.write(extra("resume", "--resume").resuming(env.resume_from, args))
    if env.replaces is not None and env.rank == 0:  # only now: a run that failed its checks has deleted nothing
        for p in Path(args.out).iterdir():  # all but the lock this run holds
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        print(f"--out {args.out}: --overwrite: replacing the earlier {env.replaces} there whole", file=sys.stderr)
    writer = RunLogger(args.out, env.resume_from, env.rank == 0, args.report_to, dataclasses.asdict(args))
    writer.t_start = STARTED - progress.wall_time_s  # from the script's start; a resumed run adds its own
    writer.show(samples)
    return writer


def evaluate_run(args, env: Setup, model, tok, step: int) -> tuple[dict, list]:
    """(metrics, samples) of `evaluate` on the evaluation set, from a generator of its own (--eval-samples)."""
    generator = torch.Generator(env.device).manual_seed(args.seed * 1_000_003 + step * 1_009 + env.rank)
    metrics = evaluate(model, tok, env.eval_set, args.max_new_tokens, env.reward_fn, env.system_prompt,
                       args.eval_samples, args.temperature, args.top_p, generator, SAMPLES_SHOWN,
                       thinking=args.thinking)  # fmt: skip
    return metrics, [{"step": step, **s} for s in metrics.pop("samples")]


def check_rewards(args, env: Setup, model, tok):
    """The reward called on batches of the run's shapes before anything is written (a training batch; on --resume,
    which skips step 0's evaluation, an evaluation batch too), on greedy completions: no random stream moves."""
    n = args.prompts_per_step // env.world
    shapes = [(env.train_set[: n * env.world][env.rank :: env.world], args.group_size)]
    if env.resume_from:  # evaluate()'s first batch, and its pass@n batch
        share = env.eval_set[env.rank :: env.world][: max(1, 256 // max(1, args.eval_samples))]
        shapes += [(share, 1)] + [(share, args.eval_samples)] * (args.eval_samples > 0)
    eos = eos_token_ids(model, tok)
    with gathered(model):  # --fsdp: whole weights, gathered once on every rank
        for examples, copies in shapes:
            if not examples:  # a rank without evaluation prompts still joins the reward's check on every rank
                raise_on_every_rank(None)
                continue
            prompts, records = prompts_and_records(tok, examples, 1, env.system_prompt, args.thinking)
            roll = sample(model, prompts, args.max_new_tokens, eos, tok.pad_token_id, greedy=True)
            rows = torch.arange(len(roll), device=roll.prompt_ids.device).repeat_interleave(copies)
            env.reward_fn(tok, roll[rows], [r for r in records for _ in range(copies)])


def progress_bar(args, env: Setup, progress: Progress):
    """The steps still to run, as rank 0's progress bar: redrawn on a terminal (not kept in OUT/console.log), else
    (a file, a pipe) one line at most every BAR_EVERY_S seconds (kept)."""
    first, tty = progress.step + 1, sys.stderr.isatty()
    return tqdm(range(first, args.steps + 1), initial=first - 1, total=args.steps, desc=args.algo,
                file=sys.stderr if tty else BarLines(sys.stderr), dynamic_ncols=tty, ascii=not tty,
                disable=env.rank > 0)  # fmt: skip


BAR_EVERY_S = 10.0


class BarLines:
    """A progress bar's redraws as lines for a stream that is no terminal, at most one per BAR_EVERY_S seconds, and
    its last one when it closes (tqdm's closing newline)."""

    def __init__(self, stream):
        self.stream, self.last, self.unwritten = stream, -math.inf, None

    def write(self, text: str):
        line = text.replace("\r", "").strip()  # a redraw; a clear (spaces) is none
        if text == "\n" and self.unwritten or line and time.monotonic() - self.last >= BAR_EVERY_S:
            self.stream.write((line or self.unwritten) + "\n")
            self.last, self.unwritten = time.monotonic(), None
        elif line:
            self.unwritten = line

    def flush(self):
        self.stream.flush()


def evaluate_if_due(args, env: Setup, model, tok, progress: Progress, row: dict, shown: tuple = ()) -> list:
    """Every --eval-every steps and after the last: `evaluate` on the held-out prompts, its numbers into `row` as
    eval_*, one line printed (with the step's clip share and `shown` metrics); returns the samples to keep."""
    step = row["step"]
    if not ((args.eval_every and step % args.eval_every == 0) or step == args.steps):
        return []
    progress.last_eval, samples = evaluate_run(args, env, model, tok, step)
    row.update({f"eval_{k}": v for k, v in progress.last_eval.items()})
    printed = "  ".join(f"{k} {row[k]:.3f}" for k in (*SHOWN, *shown) if k in row)
    if env.rank == 0:
        tqdm.write(f"step {step}: reward {row['reward']:.3f}  {describe_eval(progress.last_eval)}  {printed}")
    return samples


def log_step(args, env: Setup, progress: Progress, writer: RunLogger, bar, row: dict, rewards: torch.Tensor,
             no_signal: bool, samples: list = (), trace=None):  # fmt: skip
    """The end of a step: the warnings (`no_signal`: the step's rewards [B] gave the update nothing to learn from),
    `row` to metrics.jsonl, the trace and evaluation `samples` to their files, the progress bar."""
    step = row["step"]
    writer.clip_key = "clip_frac_seqs" if "clip_frac_seqs" in row else "clip_frac"
    progress.clip_fracs.append(row.get(writer.clip_key, 0.0))
    if getattr(args, "filter_groups", False) and row["groups_kept"] < args.prompts_per_step:
        warn(env, progress, "sample_cap", f"step {step} reached --max-sample-rounds {row['sample_rounds']} with "
             f"{row['groups_kept']} of --prompts-per-step {args.prompts_per_step} groups with signal; such steps "
             "train on what they have (said once; the run goes on)")  # fmt: skip
    # PPO, whose baseline is no group, counts its steps without signal as flat; a batch all at the highest reward
    # the run has sampled is not (a collapse falls from something better), and solved if the run has sampled worse
    lowest, highest = global_range(rewards)
    progress.reward_low, progress.reward_high = min(progress.reward_low, lowest), max(progress.reward_high, highest)
    flat = 0.0 if lowest == progress.reward_high else row["zero_std_low_frac"] if env.needs_group else float(no_signal)
    solved = progress.reward_low < lowest == progress.reward_high
    watch(env, progress, step, no_signal, flat, row.get("eval_accuracy"), solved)
    writer.log(row)
    if trace is not None:
        writer.write("traces.jsonl", trace.records())
    writer.show(samples)
    last = progress.last_eval  # the bar: this step's training reward, the last evaluation's held-out number
    held_out = {"eval_acc": last["accuracy"]} if "accuracy" in last else {"eval_reward": last["reward"]}
    bar.set_postfix(reward=f"{row['reward']:.3f}", **{k: f"{v:.3f}" for k, v in held_out.items()})
    progress.step, progress.wall_time_s = step, time.perf_counter() - writer.t_start


NO_SIGNAL_STEPS = 20  # steps in a row without a learning signal before the run warns (once)
NO_SIGNAL_ENTROPY = 0.01  # nats per token: below it, ppo.py counts a step as one without signal
COLLAPSE_DROP, COLLAPSE_EVALS = 0.1, 2  # held-out accuracy this far below step 0's, at this many evaluations in a row
FLAT_WINDOW, FLAT_SHARE = 50, 0.9  # more than this share of this many steps' groups all failed: the run warns (once)
COLLAPSE = ("the policy may be collapsing; likely causes: the learning rate (--lr), stale minibatches without a clip "
            "(--minibatches or --epochs > 1 update off-policy, safe only with the ratio clip), or the reward "
            "(the run goes on)")  # fmt: skip


def warn(env: Setup, progress: Progress, key: str, message: str, where=True):
    """One line on stderr (rank 0) the first time `key` happens in a run; progress.warned[key] keeps `where`."""
    if key not in progress.warned:
        progress.warned[key] = where
        if env.rank == 0:
            tqdm.write(f"warning: {message}", file=sys.stderr)


def watch(env: Setup, progress: Progress, step: int, no_signal: bool, flat: float, accuracy: float | None,
          solved: bool = False):  # fmt: skip
    """The warnings of a run that goes wrong, each once (kept in summary.json): NO_SIGNAL_STEPS steps in a row
    without signal; held-out `accuracy` COLLAPSE_DROP below step 0's at COLLAPSE_EVALS evaluations in a row; more
    than FLAT_SHARE of the last FLAT_WINDOW steps' groups all at the batch's lowest reward (`flat`: this step's
    share; all-equal at any value would count a learning run's solved prompts: docs/metrics.md). `solved`: this
    step's every reward is the highest the run has sampled, and it has sampled lower (the no-signal warning says so)."""
    progress.no_signal_steps += bool(no_signal)
    progress.no_signal_streak = progress.no_signal_streak + 1 if no_signal else 0
    if progress.no_signal_streak == NO_SIGNAL_STEPS:
        first = step - NO_SIGNAL_STEPS + 1
        why = ("every completion scored the highest reward the run has sampled: the task may be solved" if solved
               else "every group's rewards were equal, so every advantage was 0 and the updates had no gradient"
               if env.needs_group else "every reward in the batch was equal, or the policy's entropy stayed below "
               f"{NO_SIGNAL_ENTROPY} nats (a prompt's completions all alike): nothing tells the update which "
               "completion is better")  # fmt: skip
        warn(env, progress, "no_signal", f"no learning signal for {NO_SIGNAL_STEPS} steps in a row (steps "
             f"{first}-{step}): {why}; try a reward that gives partial credit, a higher --temperature or a larger "
             "--group-size (the run goes on)", {"from_step": first, "warned_at_step": step})  # fmt: skip
    before = (progress.eval_before or {}).get("accuracy")
    progress.flat_window = [*progress.flat_window, flat][-FLAT_WINDOW:]
    if accuracy is not None and before is not None:
        fell = progress.eval_accuracies = [*progress.eval_accuracies, [step, accuracy]][-COLLAPSE_EVALS:]
        if accuracy_collapsed(before, [a for _, a in fell]):
            at = ", ".join(f"step {s} {a:.3f}" for s, a in fell)
            warn(env, progress, "accuracy_drop", f"held-out accuracy fell {COLLAPSE_DROP} or more below its step-0 "
                 f"{before:.3f} at {COLLAPSE_EVALS} evaluations in a row ({at}): {COLLAPSE}",
                 {"before": before, "evals": fell, "warned_at_step": step})  # fmt: skip
    if mostly_flat(progress.flat_window):
        first, share = step - FLAT_WINDOW + 1, sum(progress.flat_window) / FLAT_WINDOW
        what = ("groups of the last {} steps had all-equal rewards, the batch's lowest" if env.needs_group
                else "last {} steps had no learning signal").format(FLAT_WINDOW)  # fmt: skip
        warn(env, progress, "flat_groups", f"{share:.0%} of the {what} (steps {first}-{step}): {COLLAPSE}",
             {"share": share, "from_step": first, "warned_at_step": step})  # fmt: skip


def accuracy_collapsed(before: float, accuracies: list, drop: float = COLLAPSE_DROP, evals: int = COLLAPSE_EVALS):
    """Whether the last `evals` held-out `accuracies` are each at least `drop` below `before` (the 1e-9 keeps a
    drop of exactly `drop`, 0.3 to 0.2, a drop in floats)."""
    recent = accuracies[-evals:]
    return len(recent) == evals and all(before - a >= drop - 1e-9 for a in recent)


def mostly_flat(flat: list, window: int = FLAT_WINDOW, share: float = FLAT_SHARE) -> bool:
    """Whether the last `window` steps' shares of flat groups average more than `share` (exactly `share`, 45 of 50,
    stays below, though float sums of shares such as 1/3 land a little above it: the 1e-9)."""
    return len(flat) >= window and sum(flat[-window:]) / window > share + 1e-9


def finish(args, env: Setup, model, tok, progress: Progress, writer: RunLogger, **also_save) -> dict:
    """Write final/ (the policy; each `also_save` module or state dict as final/NAME.pt; --merge-lora: final/merged)
    and summary.json; return the last evaluation. A run a signal stopped raises Interrupted instead."""
    interrupted = progress.step < args.steps
    if not interrupted:  # a standard checkpoint of the policy (--fsdp: gathered from every rank)
        state_dict = pretrained_state(model)
        if writer.enabled:
            model.save_pretrained(writer.out / "final", state_dict=state_dict)
            tok.save_pretrained(writer.out / "final")
        for name, obj in also_save.items():  # a module's state dict (under --fsdp gathered on every rank)
            state_dict = full_state_dict(obj) if isinstance(obj, torch.nn.Module) else obj
            if writer.enabled:
                torch.save(state_dict, writer.out / "final" / f"{name}.pt")
        if args.merge_lora and writer.enabled:
            extra("lora", "--merge-lora").save_merged(model, tok, writer.out / "final" / "merged")
    before, after = progress.eval_before, progress.last_eval
    wall_time_s = time.perf_counter() - writer.t_start
    measured = rounded({
        "algo": args.algo, "model": args.model, "task": "jsonl" if args.data else "arith",
        "seed": args.seed, "steps": args.steps, "step": progress.step, "interrupted": interrupted,
        "eval_accuracy_before": before.get("accuracy"), "eval_accuracy_after": after.get("accuracy"),
        "eval_format_rate_after": after.get("format_rate"), "eval_reward_before": before.get("reward"),
        "eval_after": after,  # every evaluation metric after training (pass@n with --eval-samples)
        "eval_size": len(env.eval_set),
        "eval_overlap": env.eval_overlap,  # evaluation prompts also in the training data
        "wall_time_s": wall_time_s,  # since the script started: model loading and evaluations included
        "peak_mem_mb": peak_memory_mb(env.device),
        f"mean_{writer.clip_key}": sum(progress.clip_fracs) / max(1, len(progress.clip_fracs)),
        # where each warning was given (null: not given), and how many steps had no learning signal
        "no_signal": progress.warned.get("no_signal"), "no_signal_steps": progress.no_signal_steps,
        "accuracy_drop": progress.warned.get("accuracy_drop"), "flat_groups": progress.warned.get("flat_groups"),
    })  # fmt: skip
    summary = {**measured, "args": dataclasses.asdict(args)}  # the flags as given, unrounded
    if writer.enabled:
        (writer.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    writer.close()
    release_out()
    if interrupted:
        raise Interrupted(f"stopped after step {progress.step}; checkpoint in {writer.out / 'checkpoint'}; "
                          f"continue with --resume {writer.out}")  # fmt: skip
    if writer.enabled:
        print(closing_line(args.algo, before, after, wall_time_s, writer.out), flush=True)
    return progress.last_eval


def all_equal(x: torch.Tensor) -> bool:
    """Whether every element of `x` on every rank is the same value."""
    smallest, largest = global_range(x)
    return smallest == largest


def rounded(value, decimals: int = 6):
    """`value` with each float in it (in dicts and lists too) rounded as metrics.jsonl rounds."""
    if isinstance(value, float):
        return round(value, decimals)
    if isinstance(value, dict):
        return {k: rounded(v, decimals) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded(v, decimals) for v in value]
    return value


def duration(seconds: float) -> str:
    """'45 s', '2 min 17 s', '1 h 3 min'."""
    s = round(seconds)
    return f"{s} s" if s < 60 else f"{s // 60} min {s % 60} s" if s < 3600 else f"{s // 3600} h {s % 3600 // 60} min"


# What a run may write into --out, in the order the closing line names them
OUTPUTS = ("summary.json", "metrics.jsonl", "samples.jsonl", "traces.jsonl", "console.log", "final", "checkpoint",
           "tensorboard", "wandb")  # fmt: skip


def closing_line(algo: str, before: dict, after: dict, seconds: float, out: Path) -> str:
    """The run's last line: "gspo: held-out accuracy 0.222 -> 0.640 in 2 min 17 s; wrote runs/gspo (summary.json,
    ...)" (the reward where the task has no accuracy; an empty traces.jsonl not named)."""
    key = "accuracy" if "accuracy" in after else "reward"
    paths = [out / name for name in OUTPUTS]
    written = [p.name + "/" * p.is_dir() for p in paths if p.is_dir() or (p.is_file() and p.stat().st_size)]
    return (f"{algo}: held-out {key} {before[key]:.3f} -> {after[key]:.3f} in {duration(seconds)}; "
            f"wrote {out} ({', '.join(written)})")  # fmt: skip


def describe_eval(metrics: dict) -> str:
    """One evaluation as "eval accuracy 0.412  format 0.953  reward 0.412  pass@1 ..." for the console."""
    names = {"accuracy": "eval accuracy", "format_rate": "format", "reward": "eval reward"}
    return "  ".join(f"{names.get(k, k)} {v:.3f}" for k, v in metrics.items())


@dataclass
class Progress:
    """What a training loop carries from step to step; checkpoints save it."""

    step: int = 0
    eval_before: dict | None = None
    last_eval: dict | None = None
    clip_fracs: list = field(default_factory=list)
    wall_time_s: float = 0.0
    no_signal_streak: int = 0  # steps in a row without a learning signal
    no_signal_steps: int = 0
    flat_window: list = field(default_factory=list)  # the last FLAT_WINDOW steps' zero_std_low_frac (PPO: no signal)
    reward_low: float = math.inf  # the lowest and highest rewards sampled so far: a batch all at the highest is
    reward_high: float = -math.inf  # not flat (and solved, if the run has sampled lower)
    eval_accuracies: list = field(default_factory=list)  # [step, held-out accuracy] of the last COLLAPSE_EVALS evals
    warned: dict = field(default_factory=dict)  # each warning given (`warn`), and where

    def state_dict(self):
        return dataclasses.asdict(self)

    def load_state_dict(self, state):
        for name, value in state.items():
            setattr(self, name, value)


class RunLogger:
    """OUT's metrics.jsonl, samples.jsonl, traces.jsonl and --report-to's tracker (`config`: the args), on rank 0.
    Resumed, each starts with the checkpoint's rows (TensorBoard's later steps purged): a crash leaves no step twice."""

    def __init__(self, out: str, resume_from: Path | None = None, enabled=True, report_to="none", config=None):
        self.out, self.enabled, self.tracker = Path(out), enabled, None
        self.t_start, self.clip_key = STARTED, "clip_frac"  # summary.json's wall_time_s and mean clip fraction
        if enabled:
            self.out.mkdir(parents=True, exist_ok=True)
        if isinstance(sys.stdout, Unbroken) and sys.stdout.console:  # under main(): what it printed, and will print
            sys.stdout.console.keep(self.out / "console.log" if enabled else None)
        names = ("metrics.jsonl", "samples.jsonl", "traces.jsonl")
        self.files = {name: open(self.out / name if enabled else os.devnull, "w") for name in names}
        resumed = extra("resume", "--resume").copy_rows(resume_from, self.files) if enabled and resume_from else None
        if enabled and report_to != "none":
            trackers = extra("trackers", f"--report-to {report_to}")
            self.tracker = trackers.open_tracker(report_to, self.out, resumed, config or {})

    def write(self, name: str, rows: list):
        for row in rows:
            self.files[name].write(json.dumps(row) + "\n")
        self.files[name].flush()

    def log(self, metrics: dict):
        clean = rounded(metrics)
        self.write("metrics.jsonl", [clean])
        if self.tracker is not None:
            self.tracker.log(clean)

    def show(self, samples: list):
        """Print each evaluation sample on one line and append them to samples.jsonl (rank 0)."""
        if not self.enabled:
            return
        for s in samples:
            parts = ", ".join(f"{k} {v:g}" for k, v in s["rewards"].items())
            answer = f"  answer {_clip(s['answer'], 24)}" if s["answer"] is not None else ""
            cut = "  (truncated)" if s["truncated"] else ""
            cut += "  (<think> never closed: no answer)" if after_thinking(s["completion"]) is None else ""
            tqdm.write(
                f"  {_clip(s['prompt'])} -> {_clip(s['completion'], 60)}  reward {s['reward']:g} ({parts}){answer}{cut}"
            )
        self.write("samples.jsonl", samples)

    def close(self):
        for file in self.files.values():
            file.close()
        if self.tracker is not None:
            self.tracker.close()


def peak_memory_mb(device: torch.device) -> float:
    """Peak GPU memory allocated on CUDA; peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024 if sys.platform != "darwin" else kb / 2**20


def finite_or(x: float, default: float = float("nan")) -> float:
    return x if math.isfinite(x) else default


# ---------------------------------------------------------------------------------------------
# 10. Checkpoints and stop signals: atomic checkpoints (--resume reads them: extras/resume.py), SIGINT / SIGTERM
# ---------------------------------------------------------------------------------------------


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # Ctrl-C; kill, a scheduler; the terminal closed

# flags a resumed run may change: of them only --steps alters the trajectory; --device keeps its type (docs/running.md)
RESUME_MAY_CHANGE = (
    "steps", "save_every", "eval_every", "device", "out", "overwrite", "resume", "report_to", "merge_lora",
    "trace_every", "trace_groups", "cuda_graph",
)  # fmt: skip


class Interrupted(Exception):
    """A stop signal ended the run after its checkpoint: exit status 128 + the signal's number."""


_stop = {"signum": None}  # set by the handler `main` installs, read by the training loops


class Console:
    """What the run prints, for OUT/console.log: held until RunLogger opens --out (`keep`), then appended there, each
    write flushed, so the file keeps what a closed terminal or a `| tee` that died with the run lost."""

    def __init__(self):
        self.file, self.held = None, []

    def write(self, text: str):
        if "\r" in text:  # a progress bar's redraw on a terminal: not a line
            return
        if self.held is not None:
            self.held.append(text)
        elif self.file is not None:
            self.file.write(text)
            self.file.flush()

    def keep(self, path: Path | None):  # None: a rank without files, nothing kept; --resume: appended
        held, self.held, self.file = "".join(self.held), None, path and open(path, "a")
        self.write(held)

    def close(self):
        if self.file is not None:
            self.file.close()
        self.file = None


class Unbroken:
    """stdout or stderr, each write also kept in `console`, whose first failed write (a closed pipe: `| tee` stopped by
    the same Ctrl-C; a closed terminal) points its file at /dev/null, so that the step finishes and its checkpoint is
    still written."""

    def __init__(self, stream, console: Console | None = None):
        self.stream, self.console = stream, console

    def write(self, text: str) -> int:
        if self.console is not None:
            self.console.write(text)
        try:
            return self.stream.write(text)
        except OSError:
            self.to_devnull()
            return len(text)

    def flush(self):
        try:
            self.stream.flush()
        except OSError:
            self.to_devnull()

    def to_devnull(self):
        with contextlib.suppress(OSError, ValueError):  # no file descriptor (a test's captured stream)
            os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())

    def __getattr__(self, name):  # isatty, fileno, encoding, ...: the stream's own
        return getattr(self.stream, name)


def _request_stop(signum, frame):
    if _stop["signum"] is not None:  # the second signal: stop at once, without a checkpoint
        raise KeyboardInterrupt
    _stop["signum"] = signum
    print(f"\n{signal.Signals(signum).name}: finishing this step, then saving a checkpoint and stopping "
          "(send it again to stop at once)", file=sys.stderr)  # fmt: skip


def model_signature(config) -> dict:
    """The config values a checkpoint's weights depend on; resuming onto another model is refused."""
    keys = "model_type vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads "
    return {k: getattr(config, k, None) for k in (keys + "num_key_value_heads tie_word_embeddings").split()}


def rng_state() -> dict:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
             "torch": torch.get_rng_state()}  # fmt: skip
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _state_of(obj):
    """What a checkpoint keeps of a `state` object: a generator's state, a state_dict(), or a plain value."""
    if isinstance(obj, torch.Generator):
        return obj.get_state()
    if hasattr(obj, "state_dict"):
        return obj.state_dict()
    return extra("resume", "a list, dict or dataclass in a run's state").plain_value(obj)


def save_checkpoint_if_due(args, env: Setup, model, tok, state: dict, step: int) -> bool:
    """OUT/checkpoint/ every --save-every steps, after the last, and when a stop signal came (on any rank): returns
    whether one came, which makes this step the last. Written into checkpoint.tmp/, then renamed (atomic); what it
    holds: docs/running.md, "Resume"."""
    stopping = on_any_rank(_stop["signum"] is not None)
    if not stopping and not (args.save_every > 0 and (step % args.save_every == 0 or step == args.steps)):
        return False
    out, state = Path(args.out), checkpointed(state, model)  # --fsdp: sharded state gathered as it is saved
    final, tmp, old = out / "checkpoint", out / "checkpoint.tmp", out / "checkpoint.old"
    policy = pretrained_state(model)  # --fsdp: gathered from every rank
    trainer = {"state": {name: _state_of(obj) for name, obj in state.items()}, "rng": rng_state()}
    if env.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier save
        tmp.mkdir(parents=True)
    if env.world > 1:
        extra("distributed", "torchrun").save_rank_state(tmp / f"rank{env.rank}.pt", trainer, state)
    if env.rank == 0:
        model.save_pretrained(tmp / "policy", state_dict=policy)
        tok.save_pretrained(tmp / "policy")
        torch.save(trainer, tmp / "trainer.pt")
        for name in ("metrics.jsonl", "samples.jsonl", "traces.jsonl"):
            if (out / name).is_file():
                shutil.copyfile(out / name, tmp / name)
        meta = {"algo": args.algo, "step": state["progress"].step, "world": env.world,
                "device": next(model.parameters()).device.type,  # a resumed run's must be the same type
                "model": args.model, "config": model_signature(model.config),
                "args": dataclasses.asdict(args)}  # fmt: skip
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            os.rename(final, old)
        os.rename(tmp, final)  # only now does --resume see the new checkpoint
        shutil.rmtree(old, ignore_errors=True)
    if env.world > 1:
        torch.distributed.barrier()
    return stopping


# ---------------------------------------------------------------------------------------------
# 11. Several processes (torchrun): nothing here does anything unless torchrun set WORLD_SIZE (extras/distributed.py)
# ---------------------------------------------------------------------------------------------


def _torchrun():
    """extras/distributed.py when this process is one of torchrun's (its process group is up), else None."""
    dist = torch.distributed
    return extra("distributed", "torchrun") if dist.is_available() and dist.is_initialized() else None


def data_parallel(module: torch.nn.Module, device: torch.device, args=None) -> torch.nn.Module:
    """Under torchrun `module` in DistributedDataParallel (--fsdp: sharded by FSDP2); without, `module` itself."""
    return module if _torchrun() is None else _torchrun().data_parallel(module, device, args)


# --fsdp's hooks: each does nothing (and imports nothing) unless --fsdp has loaded extras/fsdp.py


def sharded(module) -> bool:
    """Whether --fsdp shards `module`'s parameters."""
    fsdp = _loaded("fsdp")
    return fsdp is not None and fsdp.sharded(module)


def gathered(model):
    """Context: under --fsdp every weight of `model` whole on this rank inside it (a collective)."""
    fsdp = _loaded("fsdp")
    return fsdp.gathered(model) if fsdp is not None else contextlib.nullcontext()


def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_, its norm a plain tensor (under --fsdp torch returns a DTensor)."""
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def full_state_dict(module) -> dict:
    """`module.state_dict()`; under --fsdp whole tensors gathered to rank 0 (a collective; others get {})."""
    return _loaded("fsdp").full_state_dict(module) if sharded(module) else module.state_dict()


def pretrained_state(model) -> dict | None:
    """What save_pretrained writes of `model`: None (its own state dict) or, under --fsdp, the gathered one."""
    return _loaded("fsdp").pretrained_state(model) if sharded(model) else None


def checkpointed(state: dict, model) -> dict:
    """A run's `state` as a checkpoint saves it (--fsdp: sharded modules and optimizers gathered when saved)."""
    fsdp = _loaded("fsdp")
    return fsdp.checkpointed(state, model) if fsdp is not None else state


def on_any_rank(flag: bool) -> bool:
    """Whether `flag` is true on at least one rank."""
    return bool(all_reduce_sum(torch.tensor([float(flag)]), op="MAX")[0] > 0)


def all_reduce_sum(x: torch.Tensor, op: str = "SUM") -> torch.Tensor:
    """Sum (op "MAX" / "MIN": elementwise maximum / minimum) of `x` over the ranks; without torchrun `x` itself."""
    return x if _torchrun() is None else _torchrun().all_reduce(x, op)


def global_sums(totals: dict) -> dict:
    """{name: sum over the ranks} of the numbers each rank added up, in one all-reduce in float64 (a name some rank
    lacks counts 0 there; one no rank has reads 0): how a script's step pools its updates' numbers."""
    totals = {name: float(value) for name, value in totals.items()}
    return collections.Counter(totals if _torchrun() is None else _torchrun().global_sums(totals))


def global_range(x) -> tuple[float, float]:
    """(smallest, largest) element of `x` (a tensor or a number) over every rank, in one all-reduce."""
    x = torch.as_tensor(x, dtype=torch.float64)
    largest, minus_smallest = all_reduce_sum(torch.stack([x.max(), -x.min()]), op="MAX").tolist()
    return -minus_smallest, largest


def global_mean(x: torch.Tensor) -> float:
    """Mean of `x` over every element on every rank (ranks may hold different numbers of elements)."""
    return global_means({"x": x})["x"]


def global_means(values: dict) -> dict:
    """{name: mean over all ranks' elements} of tensors that all have one length, in one all-reduce."""
    x = torch.stack([v.float().sum() for v in values.values()])
    count = torch.tensor(float(next(iter(values.values())).numel()))
    total = all_reduce_sum(torch.cat([x.cpu(), count[None]]))
    return {name: (total[i] / total[-1].clamp(min=1)).item() for i, name in enumerate(values)}


def rank_means(values: dict) -> dict:
    """{name: number} averaged over the ranks (the largest for a *_max_dev); `values` itself without torchrun."""
    return values if not values or _torchrun() is None else _torchrun().rank_means(values)


def raise_on_every_rank(error: Exception | None):
    """Raise `error` if there is one; under torchrun every rank raises when one does (every rank calls it)."""
    if _torchrun() is not None:
        _torchrun().raise_if_any_rank_failed(error)
    if error is not None:
        raise error


def mean_denominator(local_count: torch.Tensor) -> torch.Tensor:
    """A rank's denominator such that, once DDP averages the W ranks' gradients, the step is one process's over
    the whole batch: (sum of local_count over ranks) / W. Without torchrun: local_count."""
    world = torch.distributed.get_world_size() if _torchrun() is not None else 1
    return (all_reduce_sum(local_count.float()) / world).clamp(min=1 / world)


def reference_model(model, device: torch.device, args):
    """The frozen initial policy (KL terms, kl_to_init): with LoRA `model` with its adapters off (extras/lora.py),
    else a frozen copy of --model (--fsdp: sharded as the policy is)."""
    lora = _loaded("lora")
    if lora is not None and lora.is_lora(model):
        return lora.AdaptersOff(model)
    reference = load_model(args.model, device)[0].eval().requires_grad_(False)
    if args.fsdp:
        fsdp = extra("fsdp", "--fsdp")
        fsdp.shard(CompletionLogprobs(reference), fsdp.gathered_dtype(device, args))
    return reference
