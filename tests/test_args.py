"""The scripts' command lines (every script in helpers.SCRIPTS): Args instances share no mutable default,
every script's Args subclasses common.SharedArgs, so its fields are the shared ones first (in
common.HELP_GROUPS' order) and then its own, and --help shows them in titled groups, each flag
exactly once."""

import dataclasses
import importlib
import re
import subprocess
import sys

import pytest
from helpers import SCRIPTS

import common

MODULES = {name: importlib.import_module(name) for name in SCRIPTS}
SHARED = [name for names in common.HELP_GROUPS.values() for name in names.split()]


@pytest.mark.parametrize("name", SCRIPTS)
def test_two_args_instances_share_no_list(name):
    a, b = MODULES[name].Args(), MODULES[name].Args()
    a.reward.append("x")
    a.reward_weights.append(2.0)
    a.lora_targets.append("lm_head")
    assert b.reward == [] and b.reward_weights == []
    assert "lm_head" not in b.lora_targets and "lm_head" not in common.LORA_TARGETS
    assert a.lora_targets is not common.LORA_TARGETS and b.lora_targets is not common.LORA_TARGETS
    assert b.lora_targets == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_shared_flags_first_in_one_order_then_the_scripts_own(name):
    """The shared flags in HELP_GROUPS' order (a script redeclaring one, for its default, keeps its
    place), then the script's own; the clip ranges are each paper's own."""
    assert issubclass(MODULES[name].Args, common.SharedArgs)
    fields = [f.name for f in dataclasses.fields(MODULES[name].Args)]
    own = fields[len(SHARED) :]
    assert fields[: len(SHARED)] == SHARED
    assert own and not set(own) & set(SHARED)
    assert {"eps_low", "eps_high"} <= set(own)


def test_the_shared_flags_are_exactly_those_all_scripts_have():
    names = [{f.name for f in dataclasses.fields(m.Args)} for m in MODULES.values()]
    common_to_all = set.intersection(*names) - {"eps_low", "eps_high"}
    assert common_to_all == set(SHARED) and len(SHARED) == len(set(SHARED))
    assert [f.name for f in dataclasses.fields(common.SharedArgs)] == SHARED


@pytest.mark.parametrize("name", SCRIPTS)
def test_algo_is_the_scripts_file_stem_and_out_defaults_to_runs_algo(name):
    args = MODULES[name].Args()
    assert args.algo == name and args.out == f"runs/{name}"
    assert MODULES[name].Args(out="elsewhere").out == "elsewhere"


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
    for name, module in MODULES.items():
        groups = help_groups(f"{name}.py")
        titles = [t for t, _ in groups]
        assert titles == ["options", f"{name}.py's own flags (the paper's defaults)", *common.HELP_GROUPS]
        flags = [f for _, fs in groups for f in fs]
        expected = ["-h"] + ["--" + f.name.replace("_", "-") for f in dataclasses.fields(module.Args)]
        assert sorted(flags) == sorted(expected) and len(flags) == len(set(flags))
        assert [fs for t, fs in groups[2:]] == [["--" + n.replace("_", "-") for n in names.split()]
                                                for names in common.HELP_GROUPS.values()]  # fmt: skip
        seen[name] = groups[2:]
    assert all(groups == seen[SCRIPTS[0]] for groups in seen.values())


def help_of_each_flag(script: str) -> tuple[list[str], dict[str, str]]:
    """(the lines of `python script --help` at a width where nothing wraps, {flag: its help text})."""
    import os

    wide = {**os.environ, "COLUMNS": "1000"}  # argparse wraps at the terminal's width
    proc = subprocess.run([sys.executable, script, "--help"], cwd=common.SHIPPED_CHECKPOINTS.parent,
                          capture_output=True, text=True, timeout=120, env=wide)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines, helps, flag = proc.stdout.splitlines(), {}, None
    for line in lines:  # "  --flag METAVAR  help", or the help alone on the next line, indented
        if m := re.match(r"  (--[a-z][a-z0-9-]*|-h)\b.*?(?:\s{2,}(.*))?$", line):
            flag = m.group(1)
            helps[flag] = m.group(2) or ""
        elif flag and line.startswith("   "):  # a help text on the line below a long flag
            helps[flag] = (helps[flag] + " " + line.strip()).strip()
        else:
            flag = None
    return lines, helps


def stated_default(value) -> str:
    """How a default reads as typed on the command line (written here, not taken from common)."""
    if value is True or value is False:
        return {True: "on", False: "off"}[value]
    if isinstance(value, list):
        return " ".join(str(v) for v in value)
    return str(value)


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_states_each_default_once_and_truly_after_a_one_line_usage(name):
    """--help opens with a one-line usage, then the description; every flag's help says "default" once, as
    "(default: X)" at its end, and X is the default the flag really has: the value of the script's Args
    (on / off for a switch, a list as its items) or, where that value is None or [] and the run fills it in,
    what the field declares it means."""
    lines, helps = help_of_each_flag(f"{name}.py")
    assert lines[0] == f"usage: {name}.py [flags]   (python {name}.py --help lists them, grouped)"
    assert lines[1] == "" and lines[2] and not lines[2].startswith(" ")  # the description comes next
    fields = {common._flag(f.name): f for f in dataclasses.fields(MODULES[name].Args)}
    assert set(helps) == {"-h", *fields}
    defaults = MODULES[name].Args()
    for flag, f in fields.items():
        text = helps[flag]
        assert text.lower().count("default") == 1, (flag, text)
        m = re.search(r"\(default: (.*?)(; may change on --resume)?\)$", text)
        assert m, (flag, text)
        value = getattr(defaults, f.name)
        if value is None or value == []:
            assert m.group(1) == f.metadata["shown"] or (f.metadata["shown"] is None and m.group(1) == "none"), flag
        elif isinstance(value, float):
            assert float(m.group(1)) == value, (flag, text)
        else:
            assert m.group(1) == stated_default(value), (flag, text)
        assert bool(m.group(2)) == (f.name in common.RESUME_MAY_CHANGE), flag
    assert re.search(r"\(default: arith; jsonl with --data alone\)$", helps["--task"])
    assert helps["--out"].endswith(f"(default: runs/{name}; may change on --resume)")
