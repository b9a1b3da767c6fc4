"""A fork registered in tests/helpers.py is checked by every shared test (issue 46): docs/forks.md's forks, made from
that page's text in a copy of the project, pass the shared tests, and the forks with a planted mistake fail them."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import ROOT, TREE_IGNORE

FORK, DAPO, BARE = "rloo", "dapo", "bareloss"
OFF_POLICY = (
    "offgrpo"  # one-step off-policy GRPO; with a planted mistake: pi_old from the current weights, or replaying
)
BROKEN, REPLAY = "stalepiold", "lastexperts"  # the last recorded experts (ids: none a prefix of another's)
# the shared tests of the quick tier that run each script in SCRIPTS (run in a copy for the fork and its parent
# alone, -k: the other scripts' cases are the main tree's own quick tier)
SHARED_QUICK = ["tests/test_smoke.py", "tests/test_args.py", "tests/test_layout.py", "tests/test_pi_old.py",
                "tests/test_fork_traps.py", "tests/test_flags_reach_update.py", "tests/test_temperature_training.py",
                "tests/test_routing_replay_through_train.py"]  # fmt: skip
# the slow shared tests that read pi_old, mismatch_* or the first update's log-probs (test_traces' browser tests read
# gspo's runs only), for a fork that trains an older batch
SHARED_OFF_POLICY_SLOW = [
    "tests/test_rollout_mismatch.py",
    "tests/test_traces.py",
    "-k",
    "first_update or log_the_mismatch or matches_a_recomputation or after_resume_equal",
]


def fork_section() -> str:
    """docs/forks.md, the fork recipe (the README links to it)."""
    return (ROOT / "docs" / "forks.md").read_text()


def registration() -> tuple[str, str, str, str]:
    """docs/forks.md's "Register it" code, for its example rloo (a copy of gspo.py): the lines that end
    tests/helpers.py, the import and the LOSSES line of tests/test_losses.py, and a new flag's CASES line."""
    section = fork_section().split("## Register it")[1].split("\n## ")[0]
    blocks = [textwrap.dedent(code) for _, code in re.findall(r"\n( *)```python\n(.*?)\n *```", section, re.S)]
    assert len(blocks) == 4, "docs/forks.md's Register it no longer has its four code blocks"
    lines = [textwrap.dedent(b.replace("\n" + " " * (len(b) - len(b.lstrip())), "\n")) for b in blocks]
    return tuple(lines)


def project_with_fork(tmp_path: Path, edit=None, parent: str = "gspo", fork: str = FORK, traits: str = "") -> Path:
    """A copy of the project with fork.py = edit(parent.py), registered by docs/forks.md's steps (registration()): its
    lines at the end of the copy's helpers.py (its parent's TRAITS, changed by `traits`), its loss in test_losses'
    LOSSES (the page's line for a copy of gspo; the parent's first line, renamed, for another parent), and
    tests/test_<fork>.py (the parent's, its module renamed)."""
    root = tmp_path / "project"
    if not root.exists():  # (a second fork joins the first's copy)
        shutil.copytree(ROOT, root, ignore=shutil.ignore_patterns(*TREE_IGNORE))
    source = (root / f"{parent}.py").read_text()
    text = source if edit is None else edit(source)
    assert edit is None or text != source, f"the edit no longer matches {parent}.py's text"
    (root / f"{fork}.py").write_text(text.replace(f"{parent}_loss", f"{fork}_loss"))  # its loss named after it
    in_helpers, import_line, loss_line, _ = registration()
    code = in_helpers.split("#")[0] if "#" in in_helpers.splitlines()[-1] else in_helpers  # (the comment: examples)
    code = code.replace('"rloo"', f'"{fork}"').replace('TRAITS["gspo"]', f'TRAITS["{parent}"]')
    if traits:
        code = code.replace(f'replace(TRAITS["{parent}"])', f'replace(TRAITS["{parent}"], {traits})')
    assert f'SCRIPTS = (*SCRIPTS, "{fork}")' in code and f'TRAITS["{fork}"] = ' in code, code
    helpers = root / "tests" / "helpers.py"
    helpers.write_text(helpers.read_text() + "\n" + code.strip() + "\n")
    losses = root / "tests" / "test_losses.py"
    text = losses.read_text()
    if parent == "gspo":
        line = loss_line.strip().replace("rloo", fork)
    else:
        line = next(x for x in text.splitlines() if f"Loss({parent}.{parent}_loss" in x).strip()
        line = re.sub(r'^"[^"]+"', f'"{fork}"', line).replace(f"{parent}.{parent}_loss", f"{fork}.{fork}_loss")
    assert import_line.strip() == "import rloo" and "LOSSES = {\n" in text, (import_line, "LOSSES")
    text = text.replace("\nimport ppo\n", f"\nimport ppo\nimport {fork}\n", 1)
    losses.write_text(text.replace("LOSSES = {\n", f"LOSSES = {{\n    {line}\n", 1))
    own = (root / "tests" / f"test_{parent}.py").read_text()
    own = own.replace(f"\nimport {parent}\n", f"\nimport {fork} as {parent}\n").replace(
        f"{parent}.{parent}_loss", f"{parent}.{fork}_loss"
    )
    (root / "tests" / f"test_{fork}.py").write_text(own)
    return root


def dapo_defaults() -> dict[str, str]:
    """The page's DAPO-style recipe, {field: its default as Python}: "`filter_groups` True, `eps_high` 0.28, ..."."""
    sentence = re.search(r"DAPO-style fork of grpo\.py makes DAPO's flags its defaults: ([^.]+(?:\.\d+[^.]*)*)\.",
                         " ".join(fork_section().split()))  # fmt: skip
    assert sentence, "docs/forks.md no longer gives a DAPO-style fork's defaults"
    pairs = dict(re.findall(r"`(\w+)` ([^,]+?)(?:,|$)", sentence.group(1)))
    assert len(pairs) >= 4, pairs
    return pairs


def dapo_traits() -> str:
    """The TRAITS change docs/forks.md gives a DAPO-style fork ("name=value")."""
    found = re.search(r'DAPO-style fork.{0,80}?`(\w+="[\w-]+")`', " ".join(fork_section().split()))
    assert found, "docs/forks.md no longer says what a DAPO-style fork changes in TRAITS"
    return found.group(1)


def dapo_style(source: str) -> str:
    """grpo.py with the page's DAPO defaults as its recipe: each field's default (`name: type = default`) replaced."""
    for name, value in dapo_defaults().items():
        pattern = re.compile(rf"(\n    {name}: [^=\n]+= )([^\n]+)(\n)")
        assert len(pattern.findall(source)) == 1, f"grpo.py's Args has no one field {name}"
        source = pattern.sub(lambda m, value=value: m.group(1) + value + m.group(3), source)
    return source


def off_policy_recipe() -> list[str]:
    """docs/forks.md's code block of a one-step off-policy fork, its lines at train()'s indentation (the block's
    first level is train()'s body, 4 spaces in)."""
    section = fork_section()
    blocks = re.findall(r"\n( *)```python\n(.*?)\n *```", section, re.S)
    recipes = [(indent, code) for indent, code in blocks if "carried.pop(0)" in code]
    assert len(recipes) == 1, "docs/forks.md has no one code block of the one-step off-policy fork"
    indent, code = recipes[0]
    return ["    " + line[len(indent) :] if line.strip() else "" for line in code.splitlines()]


def one_step_off_policy(source: str, broken: bool = False) -> str:
    """grpo.py made one-step off-policy by docs/forks.md's code block (`broken`: pi_old from the current weights)."""
    recipe = off_policy_recipe()
    at = lambda prefix: next(i for i, line in enumerate(recipe) if line.strip().startswith(prefix))  # noqa: E731
    loop, steps, rest = at("for _ in range("), at("...  # steps 1-5"), at("...  # steps 6-8")
    assert loop < steps < rest and "carried.pop(0)" in "".join(recipe[steps:rest]), recipe
    start = source.index("        # 1. Sample G completions")
    end = source.index("        # 6. Updates")
    fork = "\n".join(recipe[loop:steps]) + "\n" + textwrap.indent(source[start:end], "    ")
    fork += "\n".join(recipe[steps + 1 : rest]) + "\n"
    if broken:
        fork += (
            "        with torch.no_grad():  # the mistake: pi_old from the current weights, not those that sampled it\n"
            "            old_logp = common.completion_logprobs(model, roll, args.temperature)[0]\n"
        )
    text = source[:start] + fork + source[end:]
    carried = recipe[at("carried = []")]
    assert "carried=carried" in carried and "on_policy = False" in recipe[rest], recipe
    for old, new in [
        ("    state = dict(", f"{carried}\n    state = dict("),
        ("progress=progress)", "progress=progress, carried=carried)"),  # checkpointed: exact --resume
        ("on_policy = k == 0", "on_policy = False"),  # no update runs at the weights that sampled its batch
    ]:  # fmt: skip
        assert text.count(old) == 1, f"grpo.py no longer has one {old!r}"
        text = text.replace(old, new)
    return text


def test_the_readmes_fork_recipes_apply_to_grpo():
    source = (ROOT / "grpo.py").read_text()
    for name, text in [(DAPO, dapo_style(source)), (OFF_POLICY, one_step_off_policy(source)),
                       (OFF_POLICY, one_step_off_policy(source, broken=True))]:  # fmt: skip
        compile(text, f"{name}.py", "exec")
    assert re.fullmatch(r"\w+=\"[\w-]+\"", dapo_traits())
    # a new flag's CASES line, as test_flags_reach_update reads it: (values, each argv words; companions)
    case = eval("{" + registration()[3].strip().rstrip(",") + "}")  # noqa: S307 (the page's own text)
    [(values, companions)] = case.values()
    assert all(isinstance(v, tuple) and v[0].startswith("--") for v in values) and isinstance(companions, tuple)


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


def bare_loss(source: str) -> str:
    """A loss that returns a bare tensor, not (loss, info)."""
    return source.replace("    return loss, info\n", "    return loss\n", 1)


@pytest.mark.slow
def test_a_registered_copy_of_gspo_passes_the_shared_tests_and_one_whose_loss_returns_a_bare_tensor_fails_them(
    tmp_path,
):
    root = project_with_fork(tmp_path)
    project_with_fork(tmp_path, bare_loss, fork=BARE)  # in the same copy; its smoke run alone
    proc = pytest_in(root, "-rA", "-m", "not slow", "-k", f"gspo or {FORK} or ({BARE} and two_steps)", *SHARED_QUICK)
    passed, failed = fork_results(proc)
    # the fork was run by every shared test that runs gspo, not only listed
    assert passed and not failed and len(passed) == len(fork_results(proc, "gspo")[0]), proc.stdout[-4000:]
    passed, failed = fork_results(proc, BARE)
    assert proc.returncode == 1 and failed and not passed, proc.stdout[-4000:]
    assert all(f"[{BARE}" in line for line in proc.stdout.splitlines() if line.startswith("FAILED"))


def same_tests_as(proc, fork: str, parent: str) -> None:
    """The fork passed every test its parent passed (by test, not only by count) and failed none."""
    passed, failed = fork_results(proc, fork)
    strip = lambda lines, name: sorted(line.split(f"[{name}")[0] for line in lines)  # noqa: E731
    assert passed and not failed, proc.stdout[-4000:]
    assert strip(passed, fork) == strip(fork_results(proc, parent)[0], parent), proc.stdout[-4000:]


# grpo.py's replay of the trained batch's own experts: replaying the last recorded ones instead (the newer batch's, in
# a one-step off-policy fork) is the mistake the routing replay test must catch
OWN_EXPERTS = "moe.replay(roll.experts if args.routing_replay"


def last_recorded(source: str) -> str:
    """The one-step off-policy fork, each update replaying the last pi_old forward's experts (planted)."""
    text = one_step_off_policy(source)
    assert text.count(OWN_EXPERTS) == 1, "grpo.py no longer replays roll.experts"
    return text.replace(OWN_EXPERTS, "moe.replay(moe.indices if args.routing_replay")


@pytest.mark.slow
def test_a_dapo_style_and_a_one_step_off_policy_grpo_pass_the_shared_tests_and_planted_mistakes_fail_them(tmp_path):
    """The forks pass every shared test grpo passes; pi_old from the current weights fails the pi_old test, replaying
    the last recorded experts the routing replay test (grpo passes both here: a run that trains its last batch)."""
    root = project_with_fork(tmp_path, dapo_style, parent="grpo", fork=DAPO, traits=dapo_traits())
    for fork, edit in [(OFF_POLICY, one_step_off_policy), (BROKEN, lambda s: one_step_off_policy(s, broken=True)),
                       (REPLAY, last_recorded)]:  # fmt: skip
        project_with_fork(tmp_path, edit, parent="grpo", fork=fork)  # in the same copy
    planted = f"({BROKEN} and weights_that_sampled) or ({REPLAY} and routing_replay)"
    proc = pytest_in(root, "-rA", "-m", "not slow", "-k", f"grpo or {DAPO} or {planted}", *SHARED_QUICK)
    same_tests_as(proc, DAPO, "grpo")  # (grpo, offgrpo, dapo; and the two planted forks' guards)
    same_tests_as(proc, OFF_POLICY, "grpo")
    for fork in (BROKEN, REPLAY):
        passed, failed = fork_results(proc, fork)
        assert failed and not passed, proc.stdout[-4000:]
    failed = [line for line in proc.stdout.splitlines() if line.startswith("FAILED")]
    assert proc.returncode == 1 and all(f"[{BROKEN}" in line or f"[{REPLAY}" in line for line in failed), failed
    assert "pi_old was taken from the current weights" in proc.stdout, proc.stdout[-4000:]
    assert "routed to other experts than the pi_old forward of their batch chose" in proc.stdout, proc.stdout[-4000:]
    *files, k, expression = SHARED_OFF_POLICY_SLOW  # the slow tests that read pi_old: the off-policy fork's
    proc = pytest_in(root, "-rA", *files, k, f"({expression}) and (grpo or {OFF_POLICY}) and not {DAPO}")
    assert proc.returncode == 0, proc.stdout[-4000:]
    same_tests_as(proc, OFF_POLICY, "grpo")
