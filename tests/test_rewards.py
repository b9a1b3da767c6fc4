"""The reward API (`Rewards`, `--reward`, `--reward-weights`) on hand-made completions of the character tokenizer:
built-ins, custom functions by keyword, one-line failures at start-up and mid-run, and extract_boxed."""

from __future__ import annotations

import json
import math
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import common
import gspo
from extras import reward_functions


def rollout(tok, texts, prompts=None):
    """A Rollout whose completions decode to `texts` (each followed by EOS, which decoding drops)."""
    prompts = prompts or ["1+1="] * len(texts)
    return common.Rollout.from_lists(
        [tok(p, add_special_tokens=False)["input_ids"] for p in prompts],
        [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts],
        tok.pad_token_id,
    )


def records(answers, **columns):
    return [{"prompt": f"q{i}", "answer": a, **{k: v[i] for k, v in columns.items()}} for i, a in enumerate(answers)]


def reward_file(tmp_path, source, name="my_rewards.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


# --- Built-ins, weights, accuracy ---

TEXTS = ["#### 4", "4 or 5", "so \\boxed{4}", "5", "\\boxed{4.0} then \\boxed{5}"]
ANSWERS = ["4"] * 5


def test_exact_and_format_weighted(char_tok):
    recs = records(ANSWERS)
    rewards, parts = common.Rewards(["exact", "format"], [2.0, 0.5], recs)(char_tok, rollout(char_tok, TEXTS), recs)
    # exact: a number after '####' or the whole completion; "4 or 5" and the boxed texts have none
    assert parts["reward/exact"].tolist() == [1, 0, 0, 0, 0]
    assert parts["reward/format"].tolist() == [1, 0, 0, 1, 0]
    assert rewards.tolist() == [2.5, 0, 0, 0.5, 0]
    assert parts["accuracy"].tolist() == [1, 0, 0, 0, 0] and parts["format_rate"].tolist() == [1, 0, 0, 1, 0]


def test_boxed_sets_the_answer_parser_of_accuracy_and_format(char_tok):
    recs = records(ANSWERS)
    fn = common.Rewards(["boxed", "format"], [], recs)
    assert fn.parser == "boxed"
    rewards, parts = fn(char_tok, rollout(char_tok, TEXTS), recs)
    assert parts["reward/boxed"].tolist() == [0, 0, 1, 0, 0]  # the last box of the last text holds 5
    assert parts["reward/format"].tolist() == [0, 0, 1, 0, 1]
    assert parts["accuracy"].tolist() == [0, 0, 1, 0, 0] and parts["format_rate"].tolist() == [0, 0, 1, 0, 1]
    assert rewards.tolist() == [0, 0, 2, 0, 1]


def test_records_without_answers_log_no_accuracy(char_tok, tmp_path):
    path = reward_file(tmp_path, "def short(prompts, completions, **kw):\n    return [-len(c) for c in completions]\n")
    recs = [{"prompt": "a"}, {"prompt": "b", "answer": "1"}]  # one record lacks an answer: no accuracy at all
    rewards, parts = common.Rewards([f"{path}:short"], [], recs)(char_tok, rollout(char_tok, ["xyz", ""]), recs)
    assert rewards.tolist() == [-3, 0] and set(parts) == {"reward/short"}


# --- Your own functions: keyword call, one list per column, None, module form ---

CUSTOM = """
calls = []

def by_difficulty(prompts, completions, answer, difficulty, **kwargs):
    calls.append(dict(prompts=prompts, completions=completions, answer=answer, difficulty=difficulty, **kwargs))
    return [None if d is None else 0.25 * d for d in difficulty]

def length(prompts, completions, **kwargs):
    return [len(c) for c in completions]
"""


def test_custom_reward_gets_every_column_by_keyword(char_tok, tmp_path):
    path = reward_file(tmp_path, CUSTOM)
    recs = records(["4", "5", "6"], difficulty=[2, None, 4], source=["a", "b", "c"])
    fn = common.Rewards([f"{path}:by_difficulty", f"{path}:length", "exact"], [2.0, -0.5, 1.0], recs)
    texts = ["4", "no", "#### 6"]
    rewards, parts = fn(char_tok, rollout(char_tok, texts), recs)
    (call,) = fn.fns[0].__globals__["calls"]
    assert call == dict(
        prompts=["q0", "q1", "q2"],
        completions=texts,
        answer=["4", "5", "6"],
        difficulty=[2, None, 4],
        source=["a", "b", "c"],
    )
    assert parts["reward/by_difficulty"].tolist() == [0.5, 0.0, 1.0]  # None: not applicable, counts as 0
    assert parts["reward/length"].tolist() == [1, 2, 6]
    assert parts["reward/exact"].tolist() == [1, 0, 1]
    # 2 * 0.25 d - 0.5 len + exact, by hand
    assert rewards.tolist() == [2 * 0.5 - 0.5 * 1 + 1, 0 - 0.5 * 2 + 0, 2 * 1.0 - 0.5 * 6 + 1]


def test_module_form_and_column_missing_in_some_records(char_tok, tmp_path, monkeypatch):
    reward_file(tmp_path, CUSTOM, "forked_task_rewards.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    recs = [{"prompt": "a", "answer": "1", "difficulty": 3}, {"prompt": "b", "answer": "2"}]
    fn = common.Rewards(["forked_task_rewards:by_difficulty"], [], recs)
    rewards, _ = fn(char_tok, rollout(char_tok, ["1", "2"]), recs)
    assert fn.fns[0].__globals__["calls"][0]["difficulty"] == [3, None]
    assert rewards.tolist() == [0.75, 0.0]


def test_same_function_name_from_two_files_is_told_apart(tmp_path):
    a = reward_file(tmp_path, CUSTOM, "a.py")
    b = reward_file(tmp_path, CUSTOM, "b.py")
    fn = common.Rewards([f"{a}:length", f"{b}:length"], [], [])
    assert fn.names == [f"{a}:length", f"{b}:length"]


# --- Failure modes: one line naming the function, the problem and the row ---

BAD = """
import math

def short(prompts, completions, **kwargs):
    return [1.0] * (len(completions) - 1)

def not_a_list(prompts, completions, **kwargs):
    return 1.0

def word(prompts, completions, **kwargs):
    return [1.0 if i != 1 else "yes" for i in range(len(completions))]

def nan(prompts, completions, **kwargs):
    return [math.nan if p == "q2" else 0.0 for p in prompts]

def inf(prompts, completions, **kwargs):
    return [-math.inf if p == "q1" else 0.0 for p in prompts]

def raises(prompts, completions, answer, **kwargs):
    return [1.0 / (int(a) - 5) for a in answer]

def pairs_only(prompts, completions, **kwargs):
    if len(completions) > 1 and len(completions) % 2:  # fine alone, wrong on the batch
        raise ValueError("completions come in pairs")
    return [0.0] * len(completions)

not_callable = 3
"""


@pytest.mark.parametrize(
    "name, expected",
    [
        ("short", "--reward short returned 2 values for 3 completions"),
        ("not_a_list", "--reward not_a_list returned float, expected a list of 3 numbers or None"),
        (
            "word",
            "--reward word returned 'yes' (str) for row 1 (prompt 'q1', completion 'b'): expected a number or None",
        ),
        ("nan", "--reward nan returned nan for row 2 (prompt 'q2', completion 'c'): rewards must be finite"),
        ("inf", "--reward inf returned -inf for row 1 (prompt 'q1', completion 'b'): rewards must be finite"),
        (
            "raises",
            "--reward raises raised ZeroDivisionError: float division by zero on row 1 (prompt 'q1', completion 'b')",
        ),
        (
            "pairs_only",
            "--reward pairs_only raised ValueError: completions come in pairs on a batch of 3 (no single row",
        ),
    ],
)
def test_bad_return_values_and_exceptions(char_tok, tmp_path, name, expected):
    path = reward_file(tmp_path, BAD)
    recs = records(["4", "5", "6"])
    fn = common.Rewards([f"{path}:{name}"], [], recs)
    with pytest.raises(common.RewardError) as err:
        fn(char_tok, rollout(char_tok, ["a", "b", "c"]), recs)
    message = str(err.value)
    assert message.startswith(expected), message
    assert "\n" not in message
    assert isinstance(err.value, common.UsageError)  # main() turns it into exit status 2


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("{tmp}/missing.py:score", "file {tmp}/missing.py not found"),
        ("no_such_module_xyz:score", "cannot import no_such_module_xyz (ModuleNotFoundError: No module named"),
        ("{tmp}/broken.py:score", "cannot import {tmp}/broken.py (SyntaxError"),
        ("{tmp}/bad.py:missing", "{tmp}/bad.py has no function 'missing'"),
        ("{tmp}/bad.py:not_callable", "not_callable is a int, not a function"),
        ("exactt", "--reward exactt: unknown; expected exact, boxed, format, module:function or file.py:function"),
    ],
)
def test_not_importable(tmp_path, spec, expected):
    reward_file(tmp_path, BAD, "bad.py")
    reward_file(tmp_path, "def score(prompts, completions:\n", "broken.py")
    spec, expected = spec.format(tmp=tmp_path), expected.format(tmp=tmp_path)
    with pytest.raises(common.UsageError) as err:
        common.Rewards([spec])
    assert str(err.value).startswith(f"--reward {spec}") and expected in str(err.value), str(err.value)


def test_weights_must_match_and_be_finite():
    with pytest.raises(common.UsageError, match=r"--reward-weights: 1 weights for 2 rewards \(exact, format\)"):
        common.Rewards(["exact", "format"], [1.0])
    with pytest.raises(common.UsageError, match="--reward-weights must be finite"):
        common.Rewards(["exact"], [math.inf])
    with pytest.raises(common.UsageError, match="names a function twice"):
        common.Rewards(["exact", "exact"])


# A reward that is fine for the check before the run (common.check_rewards: one training-shaped batch),
# the step-0 evaluation and step 1, then goes wrong in step 2 (its fourth call: --eval-every 0
# evaluates only before training and after the last step).
MID_RUN = """
calls = [0]

def flaky(prompts, completions, **kwargs):
    calls[0] += 1
    values = [float(i % 2) for i in range(len(completions))]
    if calls[0] < 4:
        return values
    raise RuntimeError("lookup table missing")
"""


@pytest.mark.slow  # (each bad value's message: test_bad_return_values_and_exceptions; what a run does: here)
def test_mid_run_failure_exits_2_and_keeps_the_last_checkpoint(tmp_path, capsys):
    path = reward_file(tmp_path, MID_RUN, "flaky.py")
    out = tmp_path / "run"
    argv = ["--reward", f"{path}:flaky", "--steps", "3", "--save-every", "1", "--eval-every", "0", "--out", str(out),
            "--prompts-per-step", "4", "--group-size", "2", "--max-new-tokens", "6", "--eval-size", "8"]  # fmt: skip
    with pytest.raises(SystemExit) as stop:
        common.main(gspo.train, gspo.Args, argv)
    assert stop.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("error: --reward flaky raised RuntimeError: lookup table missing on row 0 (prompt")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]  # step 1 logged, step 2 never finished
    assert json.loads((out / "checkpoint" / "meta.json").read_text())["step"] == 1
    assert (out / "checkpoint" / "metrics.jsonl").read_text() == (out / "metrics.jsonl").read_text()
    assert rows[0]["reward/flaky"] == 0.5  # rows alternate 0, 1


# --- extract_boxed ---

# text without braces or backslashes, and brace-balanced text built from it
plain = st.text(st.characters(blacklist_characters="{}\\", blacklist_categories=["Cs"]), max_size=8)
balanced = st.recursive(
    plain, lambda inner: st.builds(lambda a, b, c: a + "{" + b + "}" + c, inner, inner, inner), max_leaves=4
)


@given(before=plain, content=balanced, after=plain)
@settings(max_examples=200, deadline=None)
def test_boxed_content_with_nested_braces(before, content, after):
    assert reward_functions.extract_boxed(f"{before}\\boxed{{{content}}}{after}") == content


@given(first=balanced, last=balanced, middle=plain)
@settings(max_examples=100, deadline=None)
def test_the_last_box_counts(first, last, middle):
    assert reward_functions.extract_boxed(f"\\boxed{{{first}}}{middle}\\boxed{{{last}}}") == last


@given(text=st.text(max_size=30))
@settings(max_examples=200, deadline=None)
def test_no_box_no_answer(text):
    if "\\boxed{" not in text:
        assert reward_functions.extract_boxed(text) is None
        assert common.score(text, "4", "boxed") == (0.0, 0.0)


def test_boxed_hand_cases():
    assert reward_functions.extract_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert reward_functions.extract_boxed("\\boxed{3} and \\boxed{4") is None  # the last box is never closed
    assert reward_functions.extract_boxed("\\boxed{}") == ""
    assert common.score("so \\boxed{1,234.0}", "1234", "boxed") == (1.0, 1.0)  # numbers normalised as for exact
    assert common.score("\\boxed{}", "4", "boxed") == (0.0, 0.0)
    assert common.score("\\boxed{ Paris }", "Paris", "boxed") == (1.0, 1.0)
    assert common.score("#### 4", "4", "boxed") == (0.0, 0.0)


# --thinking on: Qwen3 writes <think>reasoning</think> before its answer; the parsers read only what follows
THINK_CASES = [
    # (completion, parser, gold, (reward, format_ok))
    ("<think>\n2+3 is 5\n</think>\n\n5", "exact", "5", (1.0, 1.0)),  # the case: it scored 0
    ("<think>\nthe answer is 5\n</think>\n\n6", "exact", "5", (0.0, 1.0)),  # the reasoning's number is not read
    ("<think>\n2+3 is 5\n</think>\n\n#### 5", "exact", "5", (1.0, 1.0)),
    ("<think>\n2+3 is 5\n</think>\n\n", "exact", "5", (0.0, 0.0)),  # reasoning only: no answer
    ("<think>\n2+3 is 5", "exact", "5", (0.0, 0.0)),  # never closed (cut at --max-new-tokens): no answer
    ("<think>\n#### 5\n", "exact", "5", (0.0, 0.0)),  # an answer inside unclosed reasoning is not one
    ("<think>\nmaybe \\boxed{4}\n</think>\nso \\boxed{5}", "boxed", "5", (1.0, 1.0)),
    ("<think>\n\\boxed{5}\n</think>\nfive", "boxed", "5", (0.0, 0.0)),
    ("<think>a</think>4<think>b</think>5", "exact", "5", (1.0, 1.0)),  # the text after the last </think>
    ("2+3 is 5\n</think>\n\n5", "exact", "5", (1.0, 1.0)),  # a template that opened <think> in the prompt
    ("5", "exact", "5", (1.0, 1.0)),  # no thinking: the whole completion, as before
]


@pytest.mark.parametrize("completion, parser, gold, expected", THINK_CASES)
def test_answers_are_read_after_thinking(completion, parser, gold, expected):
    assert common.score(completion, gold, parser) == expected


def test_an_unclosed_think_is_no_answer_in_the_batch_and_on_screen(char_tok, capsys, tmp_path):
    """Through Rewards (exact, format) and the samples a run prints: format 0, and the line says why."""
    records = [{"prompt": "1+1=", "answer": "2"}] * 2
    roll = rollout(char_tok, ["<think>1+1 is 2</think>2", "<think>1+1 is 2"])
    rewards, parts = common.Rewards(["exact", "format"], records=records)(char_tok, roll, records)
    assert rewards.tolist() == [2.0, 0.0] and parts["format_rate"].tolist() == [1.0, 0.0]
    samples = common._described(char_tok, roll, records, rewards, parts, [char_tok.eos_token_id])

    common.RunLogger(str(tmp_path)).show(samples)  # rank 0's writer: prints each, appends to samples.jsonl
    first, second = capsys.readouterr().out.strip().splitlines()
    assert "never closed" not in first and "(<think> never closed: no answer)" in second
