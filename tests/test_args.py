"""The three scripts' command lines: Args instances share no mutable default, every script lists its
own flags first and then the shared ones in common.SHARED_FLAGS' order, and --help shows them in
titled groups, each flag exactly once."""

import dataclasses
import re
import subprocess
import sys

import pytest

import common
import grpo
import gspo
import ppo

SCRIPTS = {"ppo": ppo, "grpo": grpo, "gspo": gspo}
SHARED = [name for names in common.SHARED_FLAGS.values() for name in names]


@pytest.mark.parametrize("name", SCRIPTS)
def test_two_args_instances_share_no_list(name):
    a, b = SCRIPTS[name].Args(), SCRIPTS[name].Args()
    a.reward.append("x")
    a.reward_weights.append(2.0)
    a.lora_targets.append("lm_head")
    assert b.reward == [] and b.reward_weights == []
    assert "lm_head" not in b.lora_targets and "lm_head" not in common.LORA_TARGETS
    assert a.lora_targets is not common.LORA_TARGETS and b.lora_targets is not common.LORA_TARGETS
    assert b.lora_targets == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("name", SCRIPTS)
def test_own_flags_first_then_the_shared_ones_in_one_order(name):
    fields = [f.name for f in dataclasses.fields(SCRIPTS[name].Args)]
    own = fields[: len(fields) - len(SHARED)]
    assert fields[len(own) :] == SHARED
    assert own and not set(own) & set(SHARED)
    assert {"eps_low", "eps_high"} <= set(own)  # the clip ranges are each paper's own


def test_the_shared_flags_are_exactly_those_all_three_have():
    names = [{f.name for f in dataclasses.fields(m.Args)} for m in SCRIPTS.values()]
    common_to_all = set.intersection(*names) - {"eps_low", "eps_high"}
    assert common_to_all == set(SHARED) and len(SHARED) == len(set(SHARED))


def help_groups(script: str) -> list[tuple[str, list[str]]]:
    """(title, flags) of each group of `python script --help`, in order, the usage line left out."""
    proc = subprocess.run([sys.executable, script, "--help"], cwd=common.SHIPPED_CHECKPOINTS.parent,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    groups, body = [], proc.stdout.split("\n\n", 2)[2]  # after the usage and the description
    for line in body.splitlines():
        if re.fullmatch(r"\S.*:", line):
            groups.append((line[:-1], []))
        elif m := re.match(r"  (--[a-z][a-z0-9-]*|-h)", line):
            groups[-1][1].append(m.group(1))
    return groups


def test_help_shows_titled_groups_in_the_same_order_each_flag_once():
    seen = {}
    for name, module in SCRIPTS.items():
        groups = help_groups(f"{name}.py")
        titles = [t for t, _ in groups]
        assert titles == ["options", f"{name}.py's own flags (the paper's defaults)", *common.SHARED_FLAGS]
        flags = [f for _, fs in groups for f in fs]
        expected = ["-h"] + ["--" + f.name.replace("_", "-") for f in dataclasses.fields(module.Args)]
        assert sorted(flags) == sorted(expected) and len(flags) == len(set(flags))
        assert [fs for t, fs in groups[2:]] == [["--" + n.replace("_", "-") for n in names]
                                                for names in common.SHARED_FLAGS.values()]  # fmt: skip
        seen[name] = groups[2:]
    assert seen["ppo"] == seen["grpo"] == seen["gspo"]
