"""A fork registered in tests/helpers.py is checked by every shared test (issue 46), tried on generated forks.

In a copy of the project, a script is copied to a fork and registered as a user would (README, "Fork it"): its
name added to SCRIPTS and its parent's line copied in TRAITS. The shared tests that iterate SCRIPTS then run it:
  - gspo.py copied to rloo.py: the unchanged copy passes them; a copy whose loss returns a bare tensor (no info)
    fails them (the smoke run); a copy that stops passing its sampling generator to Run fails the shared resume
    test, since the resumed run then samples from a reseeded generator and ends with other weights;
  - grpo.py made one-step off-policy (the batch trained at step t was sampled at step t-1, as verl's one-step
    off-policy trainer does; pi_old taken right after sampling and carried with the batch): it passes the quick
    tier; the same fork taking pi_old from the current weights when it trains (the defining mistake of such a
    fork) fails tests/test_pi_old.py, saying so.
Each check runs pytest in the copy, in a subprocess (a minute or more each on 2 cores): slow tier. The
quick tier keeps the cheap half: every name in SCRIPTS has its TRAITS line and its file, and the one-step
off-policy edit still applies to grpo.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import ROOT, SCRIPTS, TRAITS

FORK = "rloo"
OFF_POLICY = "offgrpo"  # one-step off-policy GRPO
SHARED_QUICK = ["tests/test_smoke.py", "tests/test_args.py", "tests/test_layout.py", "tests/test_pi_old.py",
                "tests/test_fork_traps.py"]  # fmt: skip


def test_every_script_has_its_traits_and_its_file():
    assert set(TRAITS) >= set(SCRIPTS), f"scripts without a TRAITS line: {sorted(set(SCRIPTS) - set(TRAITS))}"
    assert all((ROOT / f"{name}.py").is_file() for name in SCRIPTS)


def project_with_fork(tmp_path: Path, edit=None, parent: str = "gspo", fork: str = FORK) -> Path:
    """A copy of the project with fork.py = edit(parent.py's text) (None: unchanged but for its loss's name, as
    the README says: `<fork>_loss`), registered in the copy's
    tests/helpers.py: its name added to SCRIPTS and its parent's TRAITS line copied, by lines appended after
    both are defined, so that it works however the SCRIPTS line is written."""
    root = tmp_path / "project"
    ignore = shutil.ignore_patterns(".git", "runs", "__pycache__", ".hypothesis", ".ruff_cache")
    shutil.copytree(ROOT, root, ignore=ignore)
    source = (root / f"{parent}.py").read_text()
    text = source if edit is None else edit(source)
    assert edit is None or text != source, f"the edit no longer matches {parent}.py's text"
    (root / f"{fork}.py").write_text(text.replace(f"{parent}_loss", f"{fork}_loss"))  # its loss named after it
    helpers = root / "tests" / "helpers.py"
    registered = f'\nSCRIPTS = (*SCRIPTS, "{fork}")\nTRAITS["{fork}"] = TRAITS["{parent}"]\n'
    helpers.write_text(helpers.read_text() + registered)
    return root


CARRIED = "roll, records, rewards, parts, mask, loss_mask, advantages, plan, has_old, old_logp, is_weights, ref_logp"


def one_step_off_policy(source: str, broken: bool = False) -> str:
    """grpo.py made one-step off-policy: each step samples a batch and takes its pi_old at once (steps 1-5, the
    weights that sampled it), carries it, and trains the batch the previous step sampled; the first step samples
    two (both with the initial weights) and trains the first, as verl's one-step off-policy trainer starts.
    `broken`: pi_old retaken from the current weights when the carried batch is trained."""
    start = source.index("        # 1. Sample G completions")
    end = source.index("        run.rollout(roll, records, rewards, parts, advantages, old_logp, has_old")
    fork = (
        "        # one-step off-policy: sample now (pi_old from the sampling weights), train the previous step's\n"
        "        for _ in range(1 if carried else 2):\n"
        + textwrap.indent(source[start:end], "    ")
        + f"            carried.append(({CARRIED}))\n"
        + "        sampled = rounds.sampled()  # this step's (last) sampling: the metrics that read the sampled batch\n"
        + f"        {CARRIED} = carried.pop(0)\n"
    )
    if broken:
        fork += (
            "        with torch.no_grad():  # the mistake: pi_old from the current weights, not those that sampled it\n"
            "            old_logp = common.logprobs_of_rows(model, roll, has_old, args.temperature)\n"
        )
    text = source[:start] + fork + source[end:]
    for old, new in [
        ("    run = common.Run(", "    carried = []  # batches sampled, with their pi_old, not yet trained (per rank)\n"
                                "    run = common.Run("),
        ("guard=guard)  # fmt: skip", "guard=guard, carried=carried)  # fmt: skip"),  # checkpointed: exact --resume
        ("is_weights, rounds.sampled(),", "is_weights, sampled,"),
        ("on_policy=k == 0)", "on_policy=False)"),  # no update runs at the weights that sampled its batch
    ]:  # fmt: skip
        assert old in text, f"grpo.py no longer has {old!r}"
        text = text.replace(old, new)
    return text


def test_the_one_step_off_policy_edit_applies_to_grpo():
    source = (ROOT / "grpo.py").read_text()
    for broken in (False, True):
        compile(one_step_off_policy(source, broken), f"{OFF_POLICY}.py", "exec")


def pytest_in(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "RLREF_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=1200)


def fork_results(proc, name: str = FORK) -> tuple[list[str], list[str]]:
    """(passed, failed) ids of the tests run for script `name`, from pytest's -rA summary."""
    lines = proc.stdout.splitlines()
    passed = [line for line in lines if line.startswith("PASSED") and f"[{name}" in line]
    failed = [line for line in lines if line.startswith("FAILED") and f"[{name}" in line]
    return passed, failed


@pytest.mark.slow
def test_a_registered_copy_of_gspo_passes_the_shared_tests(tmp_path):
    root = project_with_fork(tmp_path)
    proc = pytest_in(root, "-rA", "-m", "not slow", *SHARED_QUICK)  # (the slow layout tests copy a git tree)
    assert proc.returncode == 0, proc.stdout[-4000:]
    passed, failed = fork_results(proc)
    # the fork was run by every shared test that runs gspo, not only listed
    assert passed and not failed and len(passed) == len(fork_results(proc, "gspo")[0]), proc.stdout[-4000:]


@pytest.mark.slow
def test_a_copy_whose_loss_returns_a_bare_tensor_fails_them(tmp_path):
    def bare_loss(source: str) -> str:
        return source.replace("    return loss, info\n", "    return loss\n", 1)

    root = project_with_fork(tmp_path, bare_loss)
    proc = pytest_in(root, "-rA", "tests/test_smoke.py")
    assert proc.returncode == 1, proc.stdout[-4000:]
    passed, failed = fork_results(proc)
    assert failed and not passed, proc.stdout[-4000:]
    assert all(f"[{FORK}" in line for line in proc.stdout.splitlines() if line.startswith("FAILED"))


@pytest.mark.slow
def test_a_copy_that_keeps_its_generator_out_of_the_checkpoint_fails_the_resume_test(tmp_path):
    def unsaved_generator(source: str) -> str:
        return source.replace("stream=stream, sampling_gen=rng,", "stream=stream,", 1)

    root = project_with_fork(tmp_path, unsaved_generator)
    proc = pytest_in(root, "-rA", "tests/test_reliability.py", "-k", "resume_equals_uninterrupted")
    passed, failed = fork_results(proc)
    assert proc.returncode == 1 and failed and not passed, proc.stdout[-4000:]
    others = [line for line in proc.stdout.splitlines() if line.startswith("PASSED")]
    assert len(others) == len(SCRIPTS), proc.stdout[-4000:]  # ppo, grpo and gspo still resume exactly


@pytest.mark.slow
def test_a_one_step_off_policy_grpo_passes_the_quick_tier(tmp_path):
    root = project_with_fork(tmp_path, one_step_off_policy, parent="grpo", fork=OFF_POLICY)
    proc = pytest_in(root, "-rA", "-m", "not slow", *SHARED_QUICK)
    assert proc.returncode == 0, proc.stdout[-4000:]
    passed, failed = fork_results(proc, OFF_POLICY)
    assert passed and not failed and len(passed) == len(fork_results(proc, "grpo")[0]), proc.stdout[-4000:]


@pytest.mark.slow
def test_a_one_step_off_policy_grpo_with_pi_old_from_the_current_weights_fails_the_pi_old_test(tmp_path):
    def broken(source: str) -> str:
        return one_step_off_policy(source, broken=True)

    root = project_with_fork(tmp_path, broken, parent="grpo", fork=OFF_POLICY)
    proc = pytest_in(root, "-rA", "tests/test_pi_old.py", "-k", "weights_that_sampled")
    passed, failed = fork_results(proc, OFF_POLICY)
    assert proc.returncode == 1 and failed and not passed, proc.stdout[-4000:]
    assert "pi_old was taken from the current weights" in proc.stdout, proc.stdout[-4000:]
    others = [line for line in proc.stdout.splitlines() if line.startswith("PASSED")]
    assert len(others) == len(SCRIPTS), proc.stdout[-4000:]  # ppo, grpo and gspo still pass
