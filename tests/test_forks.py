"""A fork registered in tests/helpers.py is checked by every shared test (issue 46), tried on generated forks.

In a copy of the project, gspo.py is copied to rloo.py and registered as a user would: its name added to
SCRIPTS and its parent's line copied in TRAITS. The shared tests that iterate SCRIPTS then run it, and
  - the unchanged copy passes them;
  - a copy whose loss returns a bare tensor (no info) fails them (the smoke run);
  - a copy that stops passing its sampling generator to Run fails the shared resume test, since the
    resumed run then samples from a reseeded generator and ends with other weights.
Each check runs pytest in the copy, in a subprocess (a minute or more each on 2 cores): slow tier. The
quick tier keeps the cheap half: every name in SCRIPTS has its TRAITS line and its file.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, SCRIPTS, TRAITS

FORK = "rloo"
SHARED_QUICK = ["tests/test_smoke.py", "tests/test_args.py", "tests/test_layout.py"]


def test_every_script_has_its_traits_and_its_file():
    assert set(TRAITS) >= set(SCRIPTS), f"scripts without a TRAITS line: {sorted(set(SCRIPTS) - set(TRAITS))}"
    assert all((ROOT / f"{name}.py").is_file() for name in SCRIPTS)


def project_with_fork(tmp_path: Path, edit=None) -> Path:
    """A copy of the project with rloo.py = edit(gspo.py's text) (None: unchanged), registered in the copy's
    tests/helpers.py."""
    root = tmp_path / "project"
    ignore = shutil.ignore_patterns(".git", "runs", "__pycache__", ".hypothesis", ".ruff_cache")
    shutil.copytree(ROOT, root, ignore=ignore)
    source = (root / "gspo.py").read_text()
    fork = source if edit is None else edit(source)
    assert edit is None or fork != source, "the edit no longer matches gspo.py's text"
    (root / f"{FORK}.py").write_text(fork)
    helpers = (root / "tests" / "helpers.py").read_text()
    helpers, n = re.subn(
        r'SCRIPTS = \("ppo", "grpo", "gspo"\)', f'SCRIPTS = ("ppo", "grpo", "gspo", "{FORK}")', helpers
    )
    assert n == 1, "tests/helpers.py's SCRIPTS line changed: update this test's registration"
    gspo_line = next(line for line in helpers.splitlines() if line.strip().startswith('"gspo": Traits('))
    helpers = helpers.replace(gspo_line, gspo_line + "\n" + gspo_line.replace('"gspo"', f'"{FORK}"'))
    (root / "tests" / "helpers.py").write_text(helpers)
    return root


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
