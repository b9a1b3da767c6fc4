"""extras/resume.py: --resume, continuing a run exactly from its checkpoint (docs/running.md, "Resume"): found and
checked before any model loads (a damaged file named with what can still be done), its flags the command line's
defaults, then the weights, the optimizers, the streams and every random state restored, saying from which step.
Also what --out may replace and the state of the run there (`check_out`), and a fork's plain state (`plain_value`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import struct
import time
import zipfile
from pathlib import Path

import numpy as np
import torch

import common
from common import RESUME_MAY_CHANGE, UsageError, _describe, _flag


def set_rng_state(state: dict):
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _restore(obj, state, device):
    """Load `state` into `obj` in place: a generator's state, load_state_dict(), or a list's, dict's or
    dataclass's value (plain_value), its tensors onto `device`."""
    if isinstance(obj, torch.Generator):
        obj.set_state(state)
    elif hasattr(obj, "load_state_dict"):
        obj.load_state_dict(state)
    elif isinstance(obj, list):
        obj[:] = _value(state, device)
    elif isinstance(obj, dict):
        obj.clear()
        obj.update(_value(state, device))
    else:  # a dataclass
        value = _value(state, device)
        for f in dataclasses.fields(obj):
            setattr(obj, f.name, getattr(value, f.name))


# the dataclasses a checkpoint can hold, by name (trainer.pt is loaded weights_only)
STATE_DATACLASSES = {"Rollout": common.Rollout}


def plain_value(x):
    """`x` with each dataclass in it (STATE_DATACLASSES) as a tagged dict, so that trainer.pt loads weights_only
    (`_value` turns them back, their tensors onto the run's device); another class is refused."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        if type(x).__name__ not in STATE_DATACLASSES:
            raise ValueError(f"a checkpoint cannot hold a {type(x).__name__}: give it state_dict() / load_state_dict()")
        fields = {f.name: plain_value(getattr(x, f.name)) for f in dataclasses.fields(x)}
        return {"__dataclass__": type(x).__name__, **fields}
    if isinstance(x, (list, tuple)):
        return type(x)(plain_value(v) for v in x)
    return {k: plain_value(v) for k, v in x.items()} if isinstance(x, dict) else x


def _value(x, device):
    """The inverse of plain_value: tagged dicts back to their dataclass, tensors onto `device`."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, dict) and "__dataclass__" in x:
        fields = {k: _value(v, device) for k, v in x.items() if k != "__dataclass__"}
        return STATE_DATACLASSES[x["__dataclass__"]](**fields)
    if isinstance(x, (list, tuple)):
        return type(x)(_value(v, device) for v in x)
    return {k: _value(v, device) for k, v in x.items()} if isinstance(x, dict) else x


def find_checkpoint(path: str, algo: str) -> tuple[Path, dict]:
    """(checkpoint directory, its meta.json) for --resume PATH: a checkpoint or a run's --out."""
    p = Path(path)
    if not p.is_dir():
        raise UsageError(f"--resume {path}: {'not a directory' if p.exists() else 'no such directory'}; expected a "
                         "run's --out directory or its checkpoint/")  # fmt: skip
    # checkpoint.old is the previous checkpoint if a crash came between save_checkpoint_if_due's renames
    found = next((d for d in (p, p / "checkpoint", p / "checkpoint.old") if (d / "meta.json").is_file()), None)
    if found is None:
        raise UsageError(f"--resume {path}: no checkpoint (no meta.json there or in {p / 'checkpoint'}); runs write "
                         "one with --save-every N or when stopped by SIGINT/SIGTERM")  # fmt: skip
    try:
        meta = json.loads((found / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"--resume {path}: unreadable {found / 'meta.json'} ({_describe(e)})") from e
    if not isinstance(meta, dict) or {"algo", "step", "model", "config", "args"} - meta.keys():
        raise UsageError(f"--resume {path}: {found / 'meta.json'} lacks algo, step, model, config or args")
    if meta["algo"] != algo:
        raise UsageError(f"--resume {path}: the checkpoint was written by {meta['algo']}.py, not {algo}.py")
    missing = [n for n in ("policy", "trainer.pt", "metrics.jsonl") if not (found / n).exists()]
    if missing:
        raise UsageError(f"--resume {path}: incomplete checkpoint, {found} has no {', '.join(missing)}; "
                         f"{what_else(found, algo, meta.get('world', 1))}")  # fmt: skip
    return found, meta


LOGS = ("metrics.jsonl", "samples.jsonl", "traces.jsonl")  # a run's logs; a checkpoint holds their rows up to its step


def log_rows(path: Path) -> tuple[list[int], list[int]]:
    """The steps of the rows of a run's log, and the numbers of its lines that are not a JSON row with a step (torn by
    a crash while writing, or by two processes writing); a missing file: neither."""
    steps, bad = [], []
    for n, line in enumerate(path.read_bytes().splitlines() if path.is_file() else [], 1):
        try:
            row = json.loads(line)  # (not UTF-8: a UnicodeDecodeError, a ValueError)
        except ValueError:
            row = None
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            steps.append(row["step"])
        elif line.strip():
            bad.append(n)
    return steps, bad


def safetensors_damage(path: Path) -> str | None:
    """What is wrong with a .safetensors file (shorter than its header says, or no header), or None."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n)) if 8 + n <= size else None
        end = 8 + n + max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, TypeError, KeyError, AttributeError):
        return "is truncated or not safetensors (its header is unreadable)"
    return f"is truncated ({size} of its {end} bytes)" if size < end else None


def damage(found: Path, world: int = 1) -> tuple[Path, str] | None:
    """The first damaged file of checkpoint `found` and what is wrong with it, or None: a file missing or truncated
    (policy/'s weights against their headers, a .pt's zip directory, which is at its end), not JSON, or a line of a
    log that is not a JSON row."""
    policy = found / "policy"
    config = policy / ("adapter_config.json" if (policy / "adapter_config.json").is_file() else "config.json")  # LoRA
    index = policy / "model.safetensors.index.json"  # sharded weights
    single = "pytorch_model.bin" if (policy / "pytorch_model.bin").is_file() else "model.safetensors"  # (unsafe)
    shards = _json(index).get("weight_map", {}).values() if index.is_file() else [single]
    weights = [policy / n for n in shards] if config.name == "config.json" else [policy / "adapter_model.safetensors"]
    ranks = [found / f"rank{r}.pt" for r in range(world)] if world > 1 else []
    for path in [config, *dict.fromkeys(weights), found / "trainer.pt", *ranks, found / "metrics.jsonl"]:
        if not path.is_file():
            return path, "is missing"
    for path in policy.glob("*.json"):
        try:
            json.loads(path.read_text())
        except (OSError, ValueError):
            return path, "is not JSON (truncated?)"
    for path in policy.glob("*.safetensors"):
        if why := safetensors_damage(path):
            return path, why
    for path in [found / "trainer.pt", *ranks]:
        try:
            zipfile.ZipFile(path).close()
        except (zipfile.BadZipFile, OSError):
            return path, "is truncated (torch.save's zip archive has no directory at its end)"
    for name in LOGS:
        if bad := log_rows(found / name)[1]:
            return found / name, f"line {bad[0]} is not a JSON row with a step (torn by a crash, or two writers)"
    return None


def what_else(found: Path, algo: str, world: int = 1) -> str:
    """What can still be done with a run whose checkpoint `found` is damaged: the last good one, if any."""
    old = found.parent / "checkpoint.old"
    if old != found and (old / "meta.json").is_file() and damage(old, world) is None:
        step = json.loads((old / "meta.json").read_text())["step"]
        return f"the previous checkpoint is whole: --resume {old} continues from its step {step}"
    return (f"no earlier checkpoint is kept, so the run cannot continue: python {algo}.py --overwrite --out "
            f"{found.parent} starts it again")  # fmt: skip


def check_files(given: str, found: Path, algo: str, world: int = 1):
    """open_checkpoint: every file of checkpoint `found` whole, else a UsageError naming the first damaged one (and its
    line) and what can still be done."""
    if (hit := damage(found, world)) is None:
        return
    path, why = hit
    if why.startswith("line"):  # only a log: the weights and the training state are whole
        then = "the weights and training state are whole: delete or repair the line (its row leaves the log), resume"
    else:
        then = what_else(found, algo, world)
    raise UsageError(f"--resume {given}: damaged checkpoint: {path} {why}; {then}")


def resuming(found: Path, args) -> str:
    """start_run's line on --resume: from which step of how many, the checkpoint's time, and what is discarded past
    it (the rows the run logged after its checkpoint, which its run repeats)."""
    meta = found / "meta.json"
    step, written = json.loads(meta.read_text())["step"], meta.stat().st_mtime
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(written))
    ago = common.duration(time.time() - written)
    line = f"resuming from step {step} of {args.steps}: {found}, written {when} ({ago} ago)"
    out = Path(args.out)
    if out.resolve() != found.resolve().parent:
        return line + f"; the run continues in --out {out}"
    later, torn = log_rows(out / "metrics.jsonl")
    later = [s for s in later if s > step]
    dropped = [f"step {later[0]}" if len(later) == 1 else f"steps {later[0]}-{later[-1]}"] if later else []
    dropped += [f"{len(torn)} torn line{'s' * (len(torn) > 1)}"] if torn else []
    return line + (f"; discarding what {out / 'metrics.jsonl'} logged past it: {', '.join(dropped)}" if dropped else "")


def _json(path: Path) -> dict:
    """A JSON object file's contents; {} if it is absent, unreadable or not an object."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def run_state(out: Path, algo: str | None) -> str:
    """What the run in `out` came to, for check_out's refusal: finished (its step and final accuracy), stopped at step
    k (the command that continues it), or ended (killed, crashed) without a checkpoint past step k."""
    summary, steps = _json(out / "summary.json"), log_rows(out / "metrics.jsonl")[0]
    meta = _json(out / "checkpoint" / "meta.json") or _json(out / "checkpoint.old" / "meta.json")
    last, k, world = max(steps, default=0), meta.get("step"), meta.get("world", 1)
    again = f"{f'torchrun --nproc_per_node {world}' if world > 1 else 'python'} {algo}.py --resume {out}"
    if isinstance(summary.get("step"), int) and summary["step"] >= last:  # the summary is the run's last word
        if summary.get("interrupted"):
            return f"a {algo}.py run stopped at step {summary['step']} of {summary.get('steps')} (continue it: {again})"
        accuracy, reward = summary.get("eval_accuracy_after"), (summary.get("eval_after") or {}).get("reward")
        score = f"accuracy {accuracy}" if accuracy is not None else f"reward {reward}"  # (a task without answers)
        return f"a finished {algo}.py run (step {summary['step']}, held-out {score}; {again} --steps N trains further)"
    if algo is None:
        return f"a run that no summary.json or checkpoint names (a crashed run?), logged to step {last}"
    if isinstance(k, int):
        return (f"a {algo}.py run that ended at step {last} without a checkpoint past step {k} (killed or crashed?; "
                f"{again} continues from step {k})")  # fmt: skip
    return f"a {algo}.py run that ended at step {last} without a checkpoint (killed or crashed?), so it cannot resume"


def resumed_args(args_cls, path: str, parse):
    """The flags of a resumed run: `parse(defaults)` with the checkpoint's flags as the defaults, so that those
    given on the command line override them; they may differ from the checkpoint's only for RESUME_MAY_CHANGE.
    The run continues in the checkpoint's run directory unless --out says otherwise."""
    for directory in (Path(path), Path(path).parent):  # a live run's directory (DIR or DIR/..) before its checkpoint
        common.hold_out(directory, int(os.environ.get("RANK", 0)), create=False)
    found, meta = find_checkpoint(path, common.script_name(args_cls))
    names = {f.name for f in dataclasses.fields(args_cls)} - {"overwrite"}  # overwrite: this command's (check_out)
    saved = {**{k: v for k, v in meta["args"].items() if k in names}, "out": str(found.parent)}
    args = parse(args_cls(**saved))
    for name, value in saved.items():
        if name not in RESUME_MAY_CHANGE and getattr(args, name) != value:
            may_change = ", ".join(_flag(n) for n in RESUME_MAY_CHANGE if n != "resume")
            raise UsageError(f"{_flag(name)} {getattr(args, name)} differs from the checkpoint's {value}: a resumed "
                             f"run keeps its settings (only {may_change} may change)")  # fmt: skip
    return args


def open_checkpoint(args, algo: str, world: int = 1) -> Path:
    """--resume's checkpoint directory, checked before any model is loaded: of `algo`, from this --model (by name and
    by config), short of --steps, written by as many processes as this run has (each rank resumes its own stream),
    its files whole (`damage`)."""
    found, meta = find_checkpoint(args.resume, algo)
    saved_world, saved_device = meta.get("world", 1), meta.get("device")
    device = common.resolve_device(args.device).type
    ranks = lambda n: f"{n} process" + "es" * (n > 1)  # noqa: E731
    how = (f"torchrun --nproc_per_node {saved_world}" if saved_world > 1
           else "one (python, or torchrun --nproc_per_node 1)")  # fmt: skip
    problems = [  # (whether it fails, what follows "--resume DIR: "), in the order they are checked
        (saved_world != world, f"the checkpoint was written by {ranks(saved_world)}, this run has {ranks(world)}; "
         f"each rank resumes its own sampling stream: run it with {how}"),
        (saved_device is not None and saved_device != device,  # its generators' states are the device type's own
         f"the checkpoint was trained on {saved_device}, this run is on {device}; resume it on {saved_device} "
         f"(--device {saved_device}): its sampling generator is {saved_device}'s"),
        (meta["model"] != args.model, f"the checkpoint was trained from --model {meta['model']}, not {args.model}"),
        (meta["step"] >= args.steps, f"the checkpoint is at step {meta['step']}, which --steps {args.steps} does not "
         "exceed; pass a larger --steps to train further"),
    ]  # fmt: skip
    for failed, message in problems:
        if failed:
            raise UsageError(f"--resume {args.resume}: {message}")
    check_files(args.resume, found, algo, saved_world)
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(common.model_path(args.model))
    except Exception as e:
        raise UsageError(f"--model {args.model}: cannot load its config ({_describe(e)})") from e
    saved = meta["config"]
    diff = [f"{k} {saved.get(k)} vs {v}" for k, v in common.model_signature(config).items() if saved.get(k) != v]
    if diff:
        raise UsageError(f"--resume {args.resume}: incompatible model, checkpoint vs --model: {'; '.join(diff)}")
    return found


def load_checkpoint(found: Path, model, state: dict, rank: int = 0, world: int = 1, device="cpu"):
    """Restore the policy weights, each object in `state` and the RNG states from a checkpoint that open_checkpoint
    accepted (the inverse of save_checkpoint_if_due; every rank calls it, and under torchrun loads its rank<r>.pt)."""
    from transformers import AutoModelForCausalLM

    try:
        lora = common._loaded("lora")
        if lora is not None and lora.is_lora(model):  # policy/ holds the adapters; the base is --model's, frozen
            lora.load_lora_weights(model, found / "policy")
        elif common.sharded(model):  # rank 0 reads the policy; every rank receives its shards of it
            common._loaded("fsdp").load_policy(model, found / "policy", rank)
        else:
            saved_policy = AutoModelForCausalLM.from_pretrained(found / "policy", dtype=model.dtype)
            model.load_state_dict(saved_policy.state_dict())
        # mapped under torchrun: each rank reads only the tensors it keeps (--fsdp: its shards of the optimizer state)
        saved = torch.load(found / "trainer.pt", map_location="cpu", weights_only=True, mmap=world > 1)
        if world > 1:  # this rank's own random streams and state objects
            own = torch.load(found / f"rank{rank}.pt", map_location="cpu", weights_only=True)
            saved["rng"] = own["rng"]
            saved["state"].update(own["state"])
        for name, obj in state.items():
            _restore(obj, saved["state"][name], device)
    except Exception as e:  # a damaged checkpoint: one line, exit 2
        raise UsageError(f"--resume {found}: cannot restore it ({_describe(e)})") from e
    set_rng_state(saved["rng"])


def copy_rows(found: Path, files: dict) -> int:
    """common.RunLogger on --resume: the rows of the checkpoint's metrics.jsonl, samples.jsonl and traces.jsonl up
    to its step, written into the run's new `files` (so that a crash leaves no step twice); returns that step."""
    step = json.loads((found / "meta.json").read_text())["step"]
    for name, file in files.items():
        saved = found / name
        for line in saved.read_text().splitlines() if saved.is_file() else []:
            if line.strip() and json.loads(line)["step"] <= step:
                file.write(line + "\n")
        file.flush()
    return step


RUN_MARKS = ("summary.json", "metrics.jsonl", "checkpoint", "checkpoint.old")  # what only a run's --out holds


def check_out(args, resume_from: Path | None) -> str:
    """common.check_out for a non-empty --out that --resume does not continue: the earlier run --overwrite
    replaces, or a UsageError saying how to continue or replace it (a directory that holds no run: never deleted)."""
    out = Path(args.out)
    if resume_from is not None and resume_from.resolve().is_relative_to(out.resolve()):
        raise UsageError(f"--out {args.out} holds the checkpoint --resume reads ({resume_from}); choose another --out")
    if not any((out / name).exists() for name in RUN_MARKS):
        raise UsageError(f"--out {args.out} is a directory that holds no run (no summary.json, metrics.jsonl or "
                         "checkpoint/), so it is not replaced; choose another --out, or empty it")  # fmt: skip
    scripts = set()  # the scripts that summary.json and the checkpoint name
    for name in ("summary.json", "checkpoint/meta.json", "checkpoint.old/meta.json"):
        try:
            algo = json.loads((out / name).read_text()).get("algo")
        except (OSError, ValueError, AttributeError):  # absent, unreadable, or not an object
            continue
        if isinstance(algo, str):
            scripts.add(algo)
    if not args.overwrite:
        others = sorted(scripts - {args.algo})
        if others:
            held = f"a {' and '.join(f'{o}.py' for o in others)} run, not {args.algo}.py's"
        else:  # this script's run, or one no file names
            held = run_state(out, args.algo if scripts else None)
        raise UsageError(f"--out {args.out} holds {held}; add --overwrite to replace it, or choose another --out")
    return f"{' and '.join(f'{s}.py' for s in sorted(scripts))} run" if scripts else "run (no file names its script)"
