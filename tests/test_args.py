"""The scripts' command lines (every script in helpers.SCRIPTS): Args instances share no mutable default,
every script's Args subclasses common.SharedArgs, so its fields are the shared ones first (in
common.HELP_GROUPS' order) and then its own: its training recipe (common.RECIPE, declared in its own
file) and its algorithm's flags; --help shows them in titled groups, each flag exactly once. A fork
whose Args lacks a recipe field, or declares a field the parser cannot read, stops at start-up."""

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
    # the recipe is declared in the script's own file (its class body), not inherited from common.py
    assert set(common.RECIPE) <= set(vars(MODULES[name].Args)["__annotations__"])
    assert not set(common.RECIPE) & {f.name for f in dataclasses.fields(common.SharedArgs)}


def test_the_shared_flags_are_exactly_those_all_scripts_have():
    names = [{f.name for f in dataclasses.fields(m.Args)} for m in MODULES.values()]
    common_to_all = set.intersection(*names) - {"eps_low", "eps_high"} - set(common.RECIPE)
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


@pytest.mark.slow  # 3 subprocesses (--help)
def test_help_shows_titled_groups_in_the_same_order_each_flag_once():
    seen = {}
    for name, module in MODULES.items():
        groups = help_groups(f"{name}.py")
        titles = [t for t, _ in groups]
        assert titles == ["options", f"{name}.py's training recipe", f"{name}.py's own flags",
                          *common.HELP_GROUPS]  # fmt: skip
        flags = [f for _, fs in groups for f in fs]
        expected = ["-h"] + ["--" + f.name.replace("_", "-") for f in dataclasses.fields(module.Args)]
        assert sorted(flags) == sorted(expected) and len(flags) == len(set(flags))
        assert sorted(groups[1][1]) == sorted(common._flag(n) for n in common.RECIPE)
        assert [fs for t, fs in groups[3:]] == [["--" + n.replace("_", "-") for n in names.split()]
                                                for names in common.HELP_GROUPS.values()]  # fmt: skip
        seen[name] = groups[3:]
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


@pytest.mark.slow  # a subprocess (--help)
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


FORK = """from __future__ import annotations
from dataclasses import dataclass
import common
from common import arg


@dataclass
class Args(common.SharedArgs):
{fields}


def train(args):
    print("trained", args)


if __name__ == "__main__":
    common.main(train, Args)
"""
RECIPE_FIELDS = {
    "steps": "int = arg(3, 'steps')",
    "prompts_per_step": "int = arg(4, 'prompts')",
    "group_size": "int = arg(2, 'group')",
    "max_new_tokens": "int = arg(4, 'tokens')",
    "temperature": "float = arg(1.0, 'temperature')",
    "lr": "float = arg(1e-3, 'lr')",
    "weight_decay": "float = arg(0.0, 'wd')",
    "max_grad_norm": "float = arg(1.0, 'clip')",
    "anneal_lr": "bool = arg(True, 'anneal')",
    "minibatches": "int = arg(1, 'minibatches')",
    "epochs": "int = arg(1, 'epochs')",
}


def write_fork(tmp_path, fields: dict):
    """fork.py, a minimal fork whose Args has `fields`, in a temporary folder."""
    body = "\n".join(f"    {name}: {decl}" for name, decl in fields.items()) or "    pass"
    (tmp_path / "fork.py").write_text(FORK.format(fields=body))
    return tmp_path / "fork.py"


def run_fork(tmp_path, fields: dict, *argv):
    """`python fork.py ARGV` in its own process, importing common (as a user runs it)."""
    import os

    write_fork(tmp_path, fields)
    env = {**os.environ, "PYTHONPATH": str(common.SHIPPED_CHECKPOINTS.parent)}
    return subprocess.run([sys.executable, "fork.py", *argv], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env=env)  # fmt: skip


def fork_in_process(tmp_path, fields: dict, capsys, *argv):
    """The same fork's common.main in this process (no interpreter start-up): (exit status, stdout, stderr)."""
    from helpers import import_file, main_in_process

    try:
        return main_in_process(import_file(write_fork(tmp_path, fields)), argv, capsys)
    finally:
        sys.modules.pop("fork", None)


def one_error_line(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (proc.returncode, proc.stderr)
    return lines[0]


def test_recipe_is_the_fields_the_issue_names():
    """Written out here, so that a field quietly dropped from common.RECIPE (and from a script) fails."""
    assert set(common.RECIPE) == set(RECIPE_FIELDS)


@pytest.mark.slow  # a subprocess
def test_a_fork_without_a_recipe_field_stops_at_start_up_naming_it(tmp_path):
    """In its own process, as a user meets it: one line, exit status 2."""
    fields = {k: v for k, v in RECIPE_FIELDS.items() if k != "lr"}
    line = one_error_line(run_fork(tmp_path, fields))
    assert "fork.py's Args lacks the recipe field --lr" in line


@pytest.mark.parametrize("missing", sorted(RECIPE_FIELDS))
def test_each_recipe_field_is_required(tmp_path, capsys, missing):
    status, _, err = fork_in_process(tmp_path, {k: v for k, v in RECIPE_FIELDS.items() if k != missing}, capsys)
    assert status == 2 and f"lacks the recipe field {common._flag(missing)}:" in err, err


@pytest.mark.slow  # a subprocess
def test_a_fork_with_the_whole_recipe_parses_its_flags(tmp_path):
    proc = run_fork(tmp_path, {**RECIPE_FIELDS, "beta": "float | None = arg(None, 'beta')"}, "--lr", "0.5",
                    "--beta", "none", "--no-anneal-lr")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "lr=0.5" in proc.stdout and "beta=None" in proc.stdout and "anneal_lr=False" in proc.stdout


@pytest.mark.parametrize(
    "decl", ["bool | None = arg(None, 'x')", "tuple[int, int] = arg((1, 2), 'x')", "dict = arg({}, 'x')"]
)
def test_an_annotation_the_parser_cannot_read_stops_at_start_up(tmp_path, capsys, decl):
    """Refused even when the flag is not given: the parser used to guess by substring ("false" kept as a
    truthy string for bool | None, a tuple[int, int] read as one int)."""
    status, _, err = fork_in_process(tmp_path, {**RECIPE_FIELDS, "odd": decl}, capsys)
    assert status == 2 and len(err.strip().splitlines()) == 1, err
    assert "field odd is annotated" in err and "supported: bool, int, float" in err


def test_annotations_are_read_exactly_whether_strings_or_types():
    import typing

    def field(t):
        return dataclasses.make_dataclass("A", [("x", t)]).__dataclass_fields__["x"]

    for t, how in [(int, "value"), ("int", "value"), (typing.Optional[float], "value"), (float | None, "value"),  # noqa: UP045
                   (list[str], "list"), ("list[float]", "list"), (bool, "bool"), ("bool", "bool")]:  # fmt: skip
        assert common._parser_of(field(t), "x")[0] == how, t
    assert common._parser_of(field("int | None"), "x")[1]("none") is None
    assert common._parser_of(field("int | None"), "x")[1]("3") == 3
    for t in ("bool | None", typing.Optional[bool], bool | None, "tuple[int, int]", "list[int] | None", "set[str]"):  # noqa: UP045
        with pytest.raises(common.UsageError, match="cannot parse"):
            common._parser_of(field(t), "x")
