"""The core and its extras (issue 39): a tree without extras/ trains and refuses each capability in one line; forks."""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import LIGHT, ROOT, SCRIPTS, main_in_process, traits
from hypothesis import given
from hypothesis import strategies as st

import common
import extras

SMALL = ["--prompts-per-step", "4", "--group-size", "2", "--max-new-tokens", "6", "--eval-size", "8",
         "--minibatches", "2", "--eval-every", "0"]  # fmt: skip
MODULES = {name: importlib.import_module(name) for name in SCRIPTS}  # every registered script, a fork too


def env():
    e = dict(os.environ, RLREF_THREADS="1", HF_HUB_OFFLINE="1")  # one core each; never reach the network
    e.pop("PYTHONWARNINGS", None)
    return e


def run(cwd, script, *argv, timeout=300):
    cmd = [sys.executable, script if script.endswith(".py") else f"{script}.py", *map(str, argv)]
    return subprocess.run(cmd, cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout)


def ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def one_line_refusal(proc, *expected):
    """Exit status 2 and a stderr of exactly one 'error: ...' line holding each of `expected`."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    assert len(lines) == 1 and lines[0].startswith("error: "), f"stderr is not one 'error: ...' line:\n{proc.stderr}"
    for text in expected:
        assert text in lines[0], (text, lines[0])
    return lines[0]


def jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def copy_tree(dest: Path, skip: str | None = None) -> Path:
    """The project's files as a clone would have them (tracked, plus new files not yet committed and not
    ignored), copied to `dest`, leaving out the folder `skip`."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        src = ROOT / name
        if (skip and name.startswith(skip.rstrip("/") + "/")) or not src.is_file():
            continue
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / name)
    return dest


# --- 1. Hidden extras: the core runs without them; each capability's flag names what is missing ---


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """A copy of the project without extras/ (checkpoints/ kept)."""
    tree = copy_tree(tmp_path_factory.mktemp("bare"), skip="extras")
    assert not (tree / "extras").exists() and (tree / "checkpoints").is_dir() and (tree / "gspo.py").is_file()
    return tree


DEFAULT_RUN = ["--steps", "2", "--eval-every", "0", "--eval-size", "16", "--prompts-per-step", "8"]


@pytest.mark.slow
def test_without_extras_the_default_run_trains(bare):
    out = bare / "runs" / "gspo"
    ok(run(bare, "gspo", *DEFAULT_RUN))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["algo"] == "gspo"
    assert [r["step"] for r in jsonl(out / "metrics.jsonl")] == [1, 2]
    traces = out / "traces.jsonl"  # the default traces at each evaluation only when extras/traces.py is there
    assert not traces.exists() or not traces.read_text().strip()


# (flag, the extras module it needs). The refusal comes before any model is loaded; --model tiny-moe's from its
# config.json (common.declares_experts), and tiny-moe (qwen3_moe) samples through extras/hf_decoder.py.
CAPABILITIES = [
    (("--lora-rank", "4"), "lora"),
    (("--rollout-dtype", "bfloat16"), "rollout_precision"),
    (("--old-logp", "rollout"), "rollout_precision"),
    (("--is-correction", "tis"), "rollout_precision"),
    (("--fsdp",), "fsdp"),
    (("--cuda-graph",), "cuda_graph"),
    (("--model", "tiny-moe"), "moe"),
    (("--model", "tiny-moe"), "hf_decoder"),
    (("--model", "tiny-qwen3"), "qwen3_tokenizer"),
    (("--reward-model", "tiny-rm"), "reward_model"),
    (("--trace-every", "1"), "traces"),
    (("--data", "some.jsonl"), "data_files"),
    (("--reward", "some_file.py:fn"), "reward_functions"),
    (("--resume", "a-run"), "resume"),
    (("--eval-samples", "4"), "pass_at_k"),
    (("--filter-groups",), "filter_groups"),
    (("--report-to", "tensorboard"), "trackers"),
    (("--model", "Qwen/Qwen2.5-0.5B"), "hub"),
]
NOT_FLAG_SWITCHED = {"distributed": "torchrun (WORLD_SIZE) imports it"}


def test_every_extras_module_has_a_refusal_case():
    """A new module in extras/ gets its flag in CAPABILITIES (or says in NOT_FLAG_SWITCHED why none)."""
    modules = {p.stem for p in (ROOT / "extras").glob("*.py") if p.stem != "__init__"}
    covered = {module for _, module in CAPABILITIES} | set(NOT_FLAG_SWITCHED)
    assert modules == covered, f"extras/ without a case: {sorted(modules - covered)}; gone: {sorted(covered - modules)}"


@pytest.mark.parametrize("flag, module", CAPABILITIES, ids=lambda v: " ".join(v) if isinstance(v, tuple) else v)
def test_without_its_extras_module_each_capability_is_refused_in_one_line(tmp_path, capsys, monkeypatch, flag, module):
    """In this process, extras/<module>.py made unimportable (as in a copy without it): exit 2, one line naming it."""
    monkeypatch.setitem(sys.modules, f"extras.{module}", None)
    monkeypatch.delattr(extras, module, raising=False)
    copy = tmp_path / "extras"  # the folder as such a copy has it: every module's file but this one's
    copy.mkdir()
    for path in common.EXTRAS.glob("*.py"):
        if path.stem != module:
            (copy / path.name).touch()
    monkeypatch.setattr(common, "EXTRAS", copy)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "some.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    (tmp_path / "some_file.py").write_text("def fn(completions, **kwargs):\n    return [0.0 for _ in completions]\n")
    (tmp_path / "a-run").mkdir()
    status, _, err = main_in_process(MODULES["gspo"], [*DEFAULT_RUN, *flag, "--out", tmp_path / "out"], capsys)
    line = one_line_refusal(SimpleNamespace(returncode=status, stderr=err), f"extras/{module}.py", flag[0])
    assert "Loading weights" not in err and not (tmp_path / "out").exists(), line


# --- The scripts the shared tests run are listed in one place ---


def scripts_at_root(root: Path) -> set[str]:
    return {p.stem for p in root.glob("*.py") if "common.main(" in p.read_text()}


def test_every_script_at_the_root_is_in_SCRIPTS(tmp_path):
    found = scripts_at_root(ROOT)
    assert {"ppo", "grpo", "gspo"} <= found, f"the scan found {sorted(found)}: does it still see the scripts?"
    missing = sorted(found - set(SCRIPTS))
    assert not missing, (
        f"{', '.join(f'{m}.py' for m in missing)} calls common.main( but is not in tests/helpers.py's SCRIPTS: "
        "add it there, so that the shared reliability, argument and trace tests run it"
    )
    assert all((ROOT / f"{s}.py").is_file() for s in SCRIPTS), f"SCRIPTS names a file that is gone: {SCRIPTS}"
    (tmp_path / "rloo.py").write_text((ROOT / "gspo.py").read_text())  # and the scan sees an unregistered fork
    assert scripts_at_root(tmp_path) == {"rloo"}


def test_the_environment_the_readme_creates_is_left_out_of_git_and_of_tree_copies():
    """The README's `python -m venv DIR` (1.4 GB with torch): DIR in .gitignore, and in helpers.TREE_IGNORE, what
    test_forks' copies of the project leave out."""
    from helpers import TREE_IGNORE

    made = re.findall(r"python -m venv (\S+)", (ROOT / "README.md").read_text())
    assert made, "the README no longer says where it creates the environment"
    ignored = {line.strip().strip("/") for line in (ROOT / ".gitignore").read_text().splitlines()}
    for folder in made:
        assert folder in ignored, f"{folder}/ (the README's environment) is not in .gitignore"
        assert folder in TREE_IGNORE, f"{folder} is not in tests/helpers.py's TREE_IGNORE"


BASE_SCRIPTS = ("ppo", "grpo", "gspo")  # the project's own: a field none of them has is a fork's new flag


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_registered_script_has_done_each_step_of_docs_forks(name):
    """docs/forks.md's "Register it", each step checked: its TRAITS line, its loss named after it and in test_losses'
    LOSSES, its own tests/test_<name>.py, and a case in test_flags_reach_update's CASES for each new flag."""
    import test_flags_reach_update
    import test_losses

    module, page = MODULES[name], "docs/forks.md, Register it"
    traits(name)  # step 1 (SCRIPTS itself: test_every_script_at_the_root_is_in_SCRIPTS)
    losses = [getattr(module, f) for f in (f"{name}_loss", f"{name}_policy_loss") if hasattr(module, f)]
    assert len(losses) == 1, f"{name}.py has no one loss named {name}_loss (or {name}_policy_loss): {page}"
    assert any(entry.fn is losses[0] for entry in test_losses.LOSSES.values()), (
        f"{losses[0].__name__} is not in tests/test_losses.py's LOSSES: {page}, step 2"
    )
    assert (ROOT / "tests" / f"test_{name}.py").is_file(), f"tests/test_{name}.py is missing: {page}, step 3"
    import dataclasses

    base = {f.name for s in BASE_SCRIPTS for f in dataclasses.fields(importlib.import_module(s).Args)}
    new = {f.name for f in dataclasses.fields(module.Args)} - base - set(test_flags_reach_update.declared(module))
    missing = sorted(new - set(test_flags_reach_update.CASES))
    assert not missing, f"{name}.py's new flags {missing} have no case in test_flags_reach_update.CASES: {page}, step 4"


# --- The fixes of issue 39, section 4 ---


@pytest.mark.slow
def test_moe_with_rollout_old_logp_runs(tmp_path, capsys):
    """tiny-moe and --old-logp rollout (no pi_old forward to record routes from) used to stack Nones."""
    argv = [*SMALL, "--steps", "2", "--model", "tiny-moe", "--old-logp", "rollout", "--out", tmp_path]
    status, _, err = main_in_process(MODULES["grpo"], argv, capsys)
    assert status == 0, err
    rows = jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)


def test_routing_replay_refuses_rollout_old_logp(tmp_path, capsys):
    argv = [*SMALL, "--routing-replay", "--old-logp", "rollout", "--model", "tiny-moe", "--out", tmp_path / "out"]
    status, _, err = main_in_process(MODULES["grpo"], argv, capsys)
    one_line_refusal(SimpleNamespace(returncode=status, stderr=err), "--routing-replay", "--old-logp rollout")
    assert not (tmp_path / "out").exists()


def loop_constant_groups(rewards, group_size):
    return [max(g) == min(g) for g in (rewards[i : i + group_size] for i in range(0, len(rewards), group_size))]


REWARDS = st.sampled_from([0.0, 1.0, 0.1, 0.2, 0.3, 0.1 + 0.2, 1 / 3, -0.5, 1e-8])


@LIGHT
@given(group_size=st.integers(1, 4), n_groups=st.integers(1, 4), data=st.data())
def test_constant_groups_is_max_equals_min(group_size, n_groups, data):
    """One constant group: --filter-groups' constant_groups, a plain loop's, and group_advantages' exact 0s."""
    from extras.filter_groups import constant_groups

    flat = data.draw(st.lists(REWARDS, min_size=group_size * n_groups, max_size=group_size * n_groups))
    if data.draw(st.booleans()):  # ties: whole groups of one repeated value (0.1 x G: its float32 mean is not 0.1)
        flat = [flat[i - i % group_size] for i in range(len(flat))]
    rewards = torch.tensor(flat, dtype=torch.float32)  # as the reward functions return them
    expected = loop_constant_groups(rewards.tolist(), group_size)
    assert constant_groups(rewards, group_size).tolist() == expected
    grouped = [name for name in SCRIPTS if traits(name).grouped]  # (a group of one is refused: test_group_advantages)
    for name, scale in [(name, scale) for name in grouped for scale in ("std", "none") if group_size > 1]:
        adv = MODULES[name].group_advantages(rewards, group_size, scale).view(-1, group_size)
        assert (adv == 0).all(1).tolist() == expected, (name, scale, flat)


def test_experts_are_known_from_the_config_before_loading(tmp_path):
    """common.declares_experts reads config.json (each family's own field), so a missing extras/moe.py
    stops the run before any weights load; a name that is no local directory says nothing."""
    for field in ("num_experts", "num_local_experts", "n_routed_experts"):
        (tmp_path / field).mkdir()
        (tmp_path / field / "config.json").write_text(json.dumps({field: 4, "num_experts_per_tok": 2}))
        assert common.declares_experts(str(tmp_path / field)), field
    (tmp_path / "dense").mkdir()
    (tmp_path / "dense" / "config.json").write_text(json.dumps({"num_experts": 0, "num_experts_per_tok": 2}))
    assert not common.declares_experts(str(tmp_path / "dense"))
    assert common.declares_experts("tiny-moe") and not common.declares_experts("tiny")
    assert not common.declares_experts("Qwen/Qwen3-0.6B")  # a hub id: only the loaded model can tell (is_moe)


def test_which_models_the_hand_written_decoder_takes_is_read_from_the_config():
    take = common._StaticKVDecoder.supports_config
    assert take({"model_type": "qwen3"}) and take({"model_type": "llama", "layer_types": ["full_attention"] * 2})
    assert not take({"model_type": "qwen3", "layer_types": ["full_attention", "sliding_attention"]})
    assert not take({"model_type": "qwen3_moe"}) and not take({})
    assert not take(common.local_config("tiny-moe")) and take(common.local_config("tiny"))
