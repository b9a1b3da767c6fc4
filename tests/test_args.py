"""The scripts' command lines (every script in helpers.SCRIPTS), each Args read by tyro."""

import importlib
import json
import sys
from pathlib import Path

import pytest
from helpers import SCRIPTS

import common

MODULES = {name: importlib.import_module(name) for name in SCRIPTS}


@pytest.mark.parametrize("name", SCRIPTS)
def test_two_args_instances_share_no_list(name):
    a, b = MODULES[name].Args(), MODULES[name].Args()
    a.reward.append("x")
    a.reward_weights.append(2.0)
    a.lora_targets.append("lm_head")
    assert b.reward == [] and b.reward_weights == []
    assert "lm_head" not in b.lora_targets and "lm_head" not in common.LORA_TARGETS
    assert a.lora_targets is not common.LORA_TARGETS and b.lora_targets is not common.LORA_TARGETS


def write_checkpoint(out: Path, args: dict) -> Path:
    """A run directory whose checkpoint/ holds what find_checkpoint reads (meta.json, the files' names)."""
    (out / "checkpoint").mkdir(parents=True)
    meta = {"algo": "gspo", "step": 3, "model": "tiny", "config": {}, "args": args}
    (out / "checkpoint" / "meta.json").write_text(json.dumps(meta))
    for name in ("policy", "trainer.pt", "metrics.jsonl"):
        (out / "checkpoint" / name).touch()
    return out


def test_resume_takes_the_checkpoints_flags_and_lets_only_some_change(tmp_path):
    out = str(write_checkpoint(tmp_path / "run", {"lr": 0.1, "variant": "token", "steps": 3, "eval_every": 5}))
    args = common.parse_args(MODULES["gspo"].Args, ["--resume", out, "--steps", "6", "--eval-every", "2"])
    assert (args.lr, args.variant, args.steps, args.eval_every, args.out) == (0.1, "token", 6, 2, out)
    assert common.parse_args(MODULES["gspo"].Args, ["--resume", out, "--lr", "0.1"]).lr == 0.1  # the same: allowed
    with pytest.raises(common.UsageError, match=r"--lr 0.0006 differs from the checkpoint's 0.1: .* \(only --steps,"):
        common.parse_args(MODULES["gspo"].Args, ["--resume", out, "--lr", "6e-4"])  # the script's default, given
    with pytest.raises(common.UsageError, match="--variant sequence differs from the checkpoint's token"):
        common.parse_args(MODULES["gspo"].Args, ["--resume", out, "--variant", "sequence"])


def test_list_flags_take_several_values_given_once_or_repeated_and_None_is_a_numbers_none():
    args = common.parse_args(MODULES["ppo"].Args, ["--reward", "exact", "a.py:f", "--lr", "-1e-3", "--reward=b.py:g",
                                                   "--reward-weights", "1", "-0.5", "--dual-clip", "None"])  # fmt: skip
    assert args.reward == ["exact", "a.py:f", "b.py:g"] and args.reward_weights == [1.0, -0.5]
    assert args.lr == -1e-3 and args.dual_clip is None
    assert common.parse_args(MODULES["ppo"].Args, ["--dual-clip=2.5", "--report-to", "none"]).dual_clip == 2.5


FORK = """from __future__ import annotations
from dataclasses import dataclass
import common


@dataclass
class Args(common.SharedArgs):
{fields}


def train(args):
    print("trained", args)


if __name__ == "__main__":
    common.main(train, Args)
"""
RECIPE_FIELDS = {"steps": "int = 3", "prompts_per_step": "int = 4", "group_size": "int = 2",
                 "max_new_tokens": "int = 4", "temperature": "float = 1.0", "lr": "float = 1e-3",
                 "weight_decay": "float = 0.0", "max_grad_norm": "float = 1.0", "anneal_lr": "bool = True",
                 "minibatches": "int = 1", "epochs": "int = 1"}  # fmt: skip


def write_fork(tmp_path, fields: dict):
    """fork.py, a minimal fork whose Args has `fields`, in a temporary folder."""
    body = "\n".join(f"    {name}: {decl}" for name, decl in fields.items()) or "    pass"
    (tmp_path / "fork.py").write_text(FORK.format(fields=body))
    return tmp_path / "fork.py"


def fork_in_process(tmp_path, fields: dict, capsys, *argv):
    """The same fork's common.main in this process (no interpreter start-up): (exit status, stdout, stderr)."""
    from helpers import import_file, main_in_process

    try:
        return main_in_process(import_file(write_fork(tmp_path, fields)), argv, capsys)
    finally:
        sys.modules.pop("fork", None)


@pytest.mark.parametrize("missing", sorted(RECIPE_FIELDS))
def test_each_recipe_field_is_required(tmp_path, capsys, missing):
    status, _, err = fork_in_process(tmp_path, {k: v for k, v in RECIPE_FIELDS.items() if k != missing}, capsys)
    assert status == 2 and f"lacks the recipe field {common._flag(missing)}:" in err, err


def test_a_fork_with_the_whole_recipe_parses_its_flags(tmp_path, capsys):
    fields = {**RECIPE_FIELDS, "beta": "float | None = None"}
    status, out, err = fork_in_process(tmp_path, fields, capsys, "--lr", "0.5", "--beta", "None", "--no-anneal-lr")
    assert status == 0 and "lr=0.5" in out and "beta=None" in out and "anneal_lr=False" in out, err
