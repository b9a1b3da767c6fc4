"""docs/running.md's real-Qwen commands, and each script's docstring one (the first a GPU user copies), parsed by
each script's Args, state the peak tools/plan_memory.py plans and fit a 24 GB GPU with docs/memory.md's 15% margin."""

import ast
import re
import shlex

import plan_memory  # tools/, on sys.path through conftest.py
import pytest
from helpers import ROOT, import_file

import common

TEXT = (ROOT / "docs" / "running.md").read_text()
CARD_GB, MARGIN = 24, 1.15  # one 24 GB GPU; docs/memory.md: budget 15% over the planner's figure


def real_model_commands(text: str = TEXT, where: str = "docs/running.md") -> list[tuple[str, list[str], str]]:
    """(script, its arguments, the stated planned peak) of every `python <script>.py --model Qwen/...` line."""
    joined = text.replace("\\\n", " ")  # continuation lines joined (a docstring's are joined already)
    lines = [line.strip() for line in joined.splitlines()]
    found = []
    for line in lines:
        m = re.match(r"python (ppo|grpo|gspo)\.py (.*--model Qwen/.*)$", line)
        if m:
            command, _, comment = m.group(2).partition("#")
            stated = re.fullmatch(r" planned peak: (\d+\.\d\d) GB", comment)
            assert stated, f"{where}: `python {m.group(1)}.py {command}` states no planned peak"
            found.append((m.group(1), shlex.split(command), stated.group(1)))
    return found


def planner_inputs() -> tuple[int, int]:
    """The --prompt-tokens and --gpu-memory the page says its figures were planned with."""
    m = re.search(r"--prompt-tokens (\d+) --gpu-memory (\d+)`", " ".join(TEXT.split()))
    assert m, "docs/running.md no longer says which --prompt-tokens and --gpu-memory its figures assume"
    return int(m.group(1)), int(m.group(2))


COMMANDS = real_model_commands()
DOCSTRING_COMMANDS = [command for script in ("grpo", "gspo", "ppo") for command in real_model_commands(
    ast.get_docstring(ast.parse((ROOT / f"{script}.py").read_text())), f"{script}.py's docstring")]  # fmt: skip


def test_the_page_has_the_three_scripts_commands():
    assert sorted(script for script, _, _ in COMMANDS) == ["grpo", "gspo", "ppo"]
    assert planner_inputs()[1] == CARD_GB


def test_each_scripts_docstring_command_is_the_pages_sized_one():
    assert sorted(DOCSTRING_COMMANDS) == sorted(COMMANDS)


@pytest.mark.parametrize("script, argv, stated", COMMANDS + DOCSTRING_COMMANDS,
                         ids=[c[0] for c in COMMANDS] + [f"{c[0]}-docstring" for c in DOCSTRING_COMMANDS])  # fmt: skip
def test_a_real_model_command_states_its_planned_peak_and_fits_24_gb(script, argv, stated, capsys):
    args = common.parse_args(import_file(ROOT / f"{script}.py").Args, argv)
    model = args.model.split("/")[-1].lower().removesuffix("-instruct")  # Qwen/Qwen2.5-0.5B-Instruct: qwen2.5-0.5b
    assert model in plan_memory.QWEN_CONFIGS, f"{args.model}: no named config in tools/plan_memory.py"
    assert args.reward_model is None and args.fsdp is False  # what the plan below leaves out
    prompt_tokens, gpu_memory = planner_inputs()
    planner = ["--model", model, "--algo", script, "--prompts-per-step", args.prompts_per_step, "--group-size",
               args.group_size, "--minibatches", args.minibatches, "--max-new-tokens", args.max_new_tokens,
               "--lora-rank", args.lora_rank, "--kl-coef", getattr(args, "kl_coef", 0.0), "--rollout-dtype",
               args.rollout_dtype, "--prompt-tokens", prompt_tokens, "--gpu-memory", gpu_memory]  # fmt: skip
    planner += ["--grad-checkpointing"] * args.grad_checkpointing
    capsys.readouterr()
    plan_memory.plan_memory_cli([str(a) for a in planner])
    printed = capsys.readouterr().out.splitlines()[-1]
    assert printed.startswith("peak:"), printed
    peak = printed.split()[-1]
    assert peak == stated, f"{script}.py: docs/running.md states {stated} GB, the planner prints {peak} GB"
    assert float(peak) * MARGIN <= CARD_GB, f"{script}.py: {peak} GB planned, over {CARD_GB} GB with 15% added"
