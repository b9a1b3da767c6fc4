"""The traps a new user met making the scripts their own, each reproduced and then shown fixed."""

from __future__ import annotations

import importlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest
import torch
from helpers import ROOT, SCRIPTS, entropy_tol, import_file, logit_scale, main_in_process, recorded_rows, traits

import common
import grpo
from extras import data_files

sys.path.insert(0, str(ROOT / "tools"))  # conftest does too; be explicit
import recipes  # noqa: E402  (tools/recipes.py: the tiny tokenizer's characters)

MODULES = {name: importlib.import_module(name) for name in SCRIPTS}
# The scripts that score completions against their group: every one but PPO (whose critic's baseline
# leaves advantages nonzero when every reward is equal)
GROUP_SCRIPTS = [name for name in SCRIPTS if traits(name).skips_zero_advantage]  # A = 0 rows left out
TINY_RUN = ["--prompts-per-step", "4", "--group-size", "2", "--minibatches", "1", "--max-new-tokens", "4",
            "--eval-size", "8", "--eval-every", "0"]  # fmt: skip


def run_main(name, argv, capsys):
    """common.main of script `name` in this process: (exit status, stdout, stderr)."""
    return main_in_process(MODULES[name], argv, capsys)


def one_line_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# --- characters the tokenizer cannot represent ---


def test_the_tiny_tokenizer_drops_what_it_cannot_represent():
    """The trap itself: 'ä' becomes <unk>, and decoding drops it, so two prompts that differ only
    in such characters are one prompt to the model."""
    tok = common.load_tokenizer("tiny")
    a, b = tok("Reverse: ab")["input_ids"], tok("Reverse: äöb")["input_ids"]
    assert tok.unk_token_id in b and tok.unk_token_id not in a
    assert tok.decode(b, skip_special_tokens=True) == "Reverse: b"
    assert data_files.unknown_characters(tok, "Reverse: äöb\n") == {"ä", "ö"}
    assert data_files.unknown_characters(tok, "".join(recipes.TINY_CHARS)) == set()
    assert data_files.unknown_characters(tok, "tab\there") == {"\t"}  # printable ASCII and newline only


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--data", "--eval-data"])
def test_unknown_characters_stop_the_run_before_anything_is_written(tmp_path, capsys, flag):
    ascii_rows = [{"prompt": f"Reverse: {w}\n", "answer": w[::-1]} for w in ["abc", "hello", "xyz"] * 4]
    bad_rows = ascii_rows[:3] + [{"prompt": "Reverse: über\n", "answer": "rebü"}] + ascii_rows[3:]
    bad_rows.append({"prompt": "Reverse: café\n", "answer": "éfac"})
    data = write_jsonl(tmp_path / "data.jsonl", bad_rows if flag == "--data" else ascii_rows)
    argv = ["--data", data, "--out", tmp_path / "out", *TINY_RUN]
    if flag == "--eval-data":
        argv += ["--eval-data", write_jsonl(tmp_path / "eval.jsonl", bad_rows)]
    status, _, err = run_main("gspo", argv, capsys)
    line = one_line_error(err)
    assert status == 2
    source = data if flag == "--data" else tmp_path / "eval.jsonl"
    assert line.startswith(f"error: {flag} {source}: record 4 (prompt 'Reverse: über\\n')"), line  # file order
    assert "'ü' (U+00FC)" in line and "printable ASCII and newline" in line and "<unk>" in line
    assert "2 of 14 records" in line
    assert not (tmp_path / "out").exists()


def test_a_byte_level_tokenizer_has_nothing_to_report():
    class ByteLevel:  # Qwen's tokenizers: no unknown token, every character has bytes
        unk_token_id = None

    assert data_files.unknown_characters(ByteLevel(), "äöü 漢字 🙂") == set()
    data_files.check_characters(ByteLevel(), "Qwen/Qwen2.5-0.5B", "--data x", [{"prompt": "漢字", "answer": "ü"}])


# --- a reward that gives no learning signal ---

CONSTANT = "def constant(prompts, completions, **kw):\n    return [1.0] * len(completions)\n"
SPREAD = (
    "import zlib\n"
    "def spread(prompts, completions, **kw):\n"
    "    return [zlib.crc32(c.encode()) % 7 for c in completions]\n"
)


STREAK = 3  # common.NO_SIGNAL_STEPS made short: the rule is the same at 3 steps as at 20, 7 times fewer steps run


@pytest.mark.slow
@pytest.mark.parametrize("name", SCRIPTS)
def test_no_signal_for_a_streak_of_steps_warns_once_and_the_run_goes_on(tmp_path, capsys, monkeypatch, name):
    monkeypatch.setattr(common, "NO_SIGNAL_STEPS", STREAK)
    (tmp_path / "rewards.py").write_text(CONSTANT)
    extra = list(traits(name).test_flags)  # ppo: --kl-coef 0, no per-token KL reward either
    argv = ["--reward", f"{tmp_path}/rewards.py:constant", "--steps", STREAK + 1, "--out", tmp_path / "out",
            *TINY_RUN, *extra]  # fmt: skip
    status, _, err = run_main(name, argv, capsys)
    assert status == 0, err
    warnings = [line for line in err.splitlines() if "no learning signal" in line]
    assert len(warnings) == 1, err
    assert f"{STREAK} steps in a row (steps 1-{STREAK})" in warnings[0] and "partial credit" in warnings[0]
    assert ("every group's rewards were equal" in warnings[0]) == traits(name).grouped
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["no_signal"] == {"from_step": 1, "warned_at_step": STREAK}
    assert summary["no_signal_steps"] == STREAK + 1 and summary["step"] == STREAK + 1


@pytest.mark.slow
def test_a_reward_that_separates_completions_gets_no_warning(tmp_path, capsys, monkeypatch, name="grpo"):
    monkeypatch.setattr(common, "NO_SIGNAL_STEPS", STREAK)
    (tmp_path / "rewards.py").write_text(SPREAD)  # a hash of the text: different completions, different rewards
    argv = ["--reward", f"{tmp_path}/rewards.py:spread", "--steps", 2 * STREAK, "--out", tmp_path / "out", *TINY_RUN]
    argv[argv.index("--group-size") + 1] = "4"
    status, _, err = run_main(name, argv, capsys)
    assert status == 0 and "no learning signal" not in err, err
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["no_signal"] is None and summary["no_signal_steps"] < STREAK


@pytest.mark.slow
def test_the_no_signal_streak_survives_resume(tmp_path, capsys, monkeypatch):
    """A streak cut by a checkpoint continues after --resume: the warning comes at the same step."""
    monkeypatch.setattr(common, "NO_SIGNAL_STEPS", STREAK)
    (tmp_path / "rewards.py").write_text(CONSTANT)
    argv = ["--reward", f"{tmp_path}/rewards.py:constant", "--out", tmp_path / "out", "--save-every", 2, *TINY_RUN]
    assert run_main("gspo", [*argv, "--steps", 2], capsys)[0] == 0
    status, _, err = run_main("gspo", ["--resume", tmp_path / "out", "--steps", STREAK + 1], capsys)
    assert status == 0 and f"steps 1-{STREAK}" in err, err
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["no_signal"]["warned_at_step"] == STREAK


# --- the entropy bonus ---


@pytest.fixture(scope="module")
def tiny():
    model, tok = common.load_model("tiny", torch.device("cpu"))
    return model, tok


def rollout(tok, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [tok(p)["input_ids"] for p in ["1+2=", "13+4=", "7+80=", "5+5="]]
    completions = [torch.randint(10, 60, (n,), generator=g).tolist() for n in (3, 1, 5, 2)]
    return common.Rollout.from_lists(prompts, completions, tok.pad_token_id)


def entropy_f64(model, roll, temperature):
    """[B][T] entropies -sum_v p log p by a plain loop over rows and positions, float64: a float64
    copy of the model, a full forward of each unpadded row, no chunking, no mask arithmetic."""
    m64 = model.double()
    out = []
    for i in range(len(roll)):
        p = roll.prompt_ids[i][roll.prompt_mask[i].bool()]
        n = int(roll.completion_mask[i].sum())
        ids = torch.cat([p, roll.completion_ids[i, :n]])[None]
        logits = m64(input_ids=ids).logits[0, len(p) - 1 : len(p) - 1 + n] / temperature
        row = []
        for t in range(n):
            logq = torch.log_softmax(logits[t], -1)
            row.append(-(logq.exp() * logq).sum())
        out.append(row)
    return out


# the bonus in float64 from [b][t] entropies, as helpers.TRAITS says a script averages it at its defaults (grpo as
# its --loss-agg): per sequence then over sequences, or a token mean
AGGREGATE_F64 = {
    "sequence-mean": lambda ent: sum(sum(r) / len(r) for r in ent) / len(ent),
    "token-mean": lambda ent: sum(sum(r) for r in ent) / sum(len(r) for r in ent),
}
# each case's script, flags and aggregation (the extra case's id names no script: test_forks counts by "[<script>"),
# and its log-probs whole (None: the CPU's one chunk) or in chunks of 2 tokens, in turn: each aggregation both ways
BONUS_CASES = {name: (name, [], traits(name).entropy_bonus) for name in SCRIPTS}
BONUS_CASES["token-mean-grpo"] = ("grpo", ["--loss-agg", "token-mean"], "token-mean")
BONUS_CASES = {case: (*value, (None, 2)[i % 2]) for i, (case, value) in enumerate(BONUS_CASES.items())}
ZERO = "def zero(prompts, completions, **kw):\n    return [0.0] * len(completions)\n"


class RecordingAdamW(torch.optim.AdamW):
    """AdamW that keeps, from the first of its kind made (a script's policy optimizer) and its first step, the
    gradient it is stepped with."""

    first = None

    def step(self, closure=None):
        if RecordingAdamW.first in (None, self) and not hasattr(self, "grads"):
            RecordingAdamW.first = self
            self.grads = [p.grad.detach().clone() for group in self.param_groups for p in group["params"]]
        return super().step(closure)


@pytest.mark.numeric
@pytest.mark.parametrize("case", BONUS_CASES)
def test_the_entropy_bonus_gradient_equals_float64(tmp_path, capsys, monkeypatch, case):
    """train() with --entropy-coef 1, every reward 0 (so every advantage 0) and log-probs in chunks: the first
    update's loss and gradient are minus float64's through a plain loop's entropies, aggregated as the script does."""
    name, flags, aggregation, chunk_tokens = BONUS_CASES[case]
    module, temperature = MODULES[name], 0.7
    model64, _ = common.load_model("tiny", torch.device("cpu"))  # the weights train() starts from
    if chunk_tokens is not None:  # chunk_tokens="auto" on a CPU: LOGITS_CHUNK_ELEMENTS // vocabulary
        monkeypatch.setattr(common, "LOGITS_CHUNK_ELEMENTS", chunk_tokens * model64.config.vocab_size)
    seen = {"rolls": []}
    forward = common.CompletionLogprobs.forward

    def recording_forward(self, roll, *args, **kwargs):
        if kwargs.get("entropy_grad"):  # an update's forward (pi_old's and the sampler's have no entropy gradient)
            seen["rolls"].append(roll)
        return forward(self, roll, *args, **kwargs)

    monkeypatch.setattr(common.CompletionLogprobs, "forward", recording_forward)
    rows = recorded_rows(monkeypatch)  # the step's row as logged, before rounding: its loss is the one update's
    monkeypatch.setattr(torch.optim, "AdamW", RecordingAdamW)
    monkeypatch.setattr(RecordingAdamW, "first", None)
    (tmp_path / "rewards.py").write_text(ZERO)
    argv = ["--reward", f"{tmp_path}/rewards.py:zero", "--prompts-per-step", 4, "--group-size", 2, "--minibatches", 1,
            "--epochs", 1, "--max-new-tokens", 6, "--steps", 1, "--eval-every", 0, "--eval-size", 1, "--temperature",
            temperature, "--entropy-coef", 1, "--max-grad-norm", 1e30, *traits(name).test_flags, *flags,
            "--out", tmp_path / "out"]  # fmt: skip
    status, _, err = main_in_process(module, argv, capsys)
    assert status == 0 and RecordingAdamW.first is not None, err
    roll, loss, grads = seen["rolls"][0], rows[0]["loss"], RecordingAdamW.first.grads
    assert len({int(n) for n in roll.completion_mask.sum(1)}) > 1, "one length: the aggregations would agree"
    length, max_z = logit_scale(model64, roll, temperature)  # (the float32 model's)
    m64 = model64.double()
    ref = AGGREGATE_F64[aggregation](entropy_f64(m64, roll, temperature))
    ref.backward()
    # float32 against float64 (issue 42: the old fixed bounds depended on the CPU model): each token's entropy
    # within helpers.entropy_tol (a bound for two float32 forwards, so twice what one needs), their mean too
    assert abs(-loss - ref.item()) <= entropy_tol(m64.config, length, max_z), (loss, ref.item())
    assert len(grads) == len(list(m64.parameters()))
    for (weight, p64), g in zip(m64.named_parameters(), grads):
        # Not yet derived (issue 42): a parameter's gradient sums terms whose sizes this test does not know (the
        # tied embedding gathers the LM head's and the inputs' over every token, with cancellation), so the bound
        # stays the one measured: a few 1e-6 of rounding (4.7e-6 in the embedding on an AMD EPYC of family 25,
        # 2.3e-5 on a 2-core Intel Xeon, where the tensor's largest |g| is 0.62)
        torch.testing.assert_close(-g.double(), p64.grad, rtol=1e-3, atol=2e-5, msg=weight)


def test_the_entropy_is_detached_unless_asked_for(tiny):
    """The trap: `logp, ent = policy(...)` then `loss -= c * ent.mean()` moved nothing, because the
    entropy is a diagnostic computed without a graph; entropy_grad=True gives it one."""
    model, tok = tiny
    policy = common.CompletionLogprobs(model)
    logp, entropy = policy(rollout(tok), 1.0)
    assert logp.requires_grad and not entropy.requires_grad
    logp, entropy = policy(rollout(tok), 1.0, entropy_grad=True)
    assert entropy.requires_grad
    with torch.no_grad():
        assert not policy(rollout(tok), 1.0, entropy_grad=True)[1].requires_grad


def final_weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(out / "final" / "model.safetensors")


# --- a reward of the wrong length ---

PER_PROMPT = "def per_prompt(prompts, completions, **kw):\n    return [1.0 for _ in dict.fromkeys(prompts)]\n"


@pytest.mark.slow
@pytest.mark.parametrize("name", SCRIPTS)
def test_a_reward_of_the_wrong_length_stops_before_out_is_written(tmp_path, capsys, name):
    """One value per distinct prompt fits the step-0 evaluation (one greedy completion per prompt);
    the check on a real grouped batch catches it first, before --out exists."""
    (tmp_path / "rewards.py").write_text(PER_PROMPT)
    argv = ["--reward", f"{tmp_path}/rewards.py:per_prompt", "--out", tmp_path / "out", *TINY_RUN]
    status, _, err = run_main(name, argv, capsys)
    assert status == 2
    assert "returned 4 values for 8 completions" in one_line_error(err)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_reward_check_moves_no_random_stream(tmp_path, capsys, monkeypatch):
    """A run with the check and one without it end with the same weights and metrics."""
    outs = {}
    for checked in (True, False):
        if not checked:
            monkeypatch.setattr(common, "check_rewards", lambda *a: None)
        out = outs[checked] = tmp_path / f"checked-{checked}"
        assert run_main("gspo", ["--steps", 2, "--out", out, *TINY_RUN], capsys)[0] == 0
    a, b = final_weights(outs[True]), final_weights(outs[False])
    assert all(torch.equal(a[k], b[k]) for k in a)

    def metrics(out):
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if k not in ("step_time_s", "tokens_per_s")} for r in rows]

    assert metrics(outs[True]) == metrics(outs[False])


@pytest.mark.slow
def test_the_eval_shape_is_checked_on_resume(tmp_path, capsys, monkeypatch):
    """On --resume the reward check scores an evaluation batch too, before the first step."""
    (tmp_path / "rewards.py").write_text(
        "import os\n"
        "def picky(prompts, completions, **kw):\n"
        "    if os.environ.get('PICKY') and len(completions) != 8:\n"
        "        return [0.0]\n"
        "    return [1.0] * len(completions)\n"
    )
    argv = ["--reward", f"{tmp_path}/rewards.py:picky", "--out", tmp_path / "out", "--save-every", 1, *TINY_RUN]
    argv[argv.index("--eval-size") + 1] = "6"
    assert run_main("grpo", [*argv, "--steps", 1], capsys)[0] == 0
    before = (tmp_path / "out" / "metrics.jsonl").read_text()
    monkeypatch.setenv("PICKY", "1")
    status, _, err = run_main("grpo", ["--resume", tmp_path / "out", "--steps", 2], capsys)
    assert status == 2 and "returned 1 values for 6 completions" in one_line_error(err)
    assert (tmp_path / "out" / "metrics.jsonl").read_text() == before


# --- flags: choices, no abbreviations, unknown flags ---


@pytest.mark.parametrize(
    "name, argv, expected",
    [
        ("gspo", ["--variant", "tokn"], "invalid choice 'tokn' for argument '--variant'"),
        ("grpo", ["--loss-agg", "token_mean"], "invalid choice 'token_mean' for argument '--loss-agg'"),
        ("grpo", ["--scale-rewards", "max"], "invalid choice 'max' for argument '--scale-rewards'"),
        ("ppo", ["--report-to", "mlflow"], "invalid choice 'mlflow' for argument '--report-to'"),
        ("ppo", ["--is-correction", "tiss"], "invalid choice 'tiss' for argument '--is-correction'"),
        ("gspo", ["--lr", "abc"], "--lr"),
        ("grpo", ["--prompts-per-step", "1.5"], "--prompts-per-step"),
        ("ppo", ["--prompts-per-step", "0"], "error: --prompts-per-step must be >= 1, got 0"),
        ("gspo", ["--lr", "nan"], "error: --lr must be a number, got nan"),
        *[("grpo", ["--entropy-coef", value], "--entropy-coef") for value in ("-0.1", "inf", "nan")],
        ("gspo", ["--step", "1"], "error: Unrecognized options: --step"),  # no abbreviation of --steps
        ("grpo", ["--eval-evry=5"], "error: Unrecognized options: --eval-evry=5"),
        ("ppo", ["--lr", "1e-3", "extra"], "extra"),
    ],
    ids=lambda v: "-".join(v) if isinstance(v, list) else "",  # by the argv, not the script (test_forks counts
)  # the tests of each script by "[<script>" in their ids, and this table is not run for every script)
def test_bad_flags_and_values_are_one_line_naming_them(tmp_path, capsys, name, argv, expected):
    status, _, err = run_main(name, [*argv, "--out", tmp_path / "out"], capsys)
    assert status == 2 and err.strip() == one_line_error(err) and expected in err, err
    assert not (tmp_path / "out").exists()


def test_a_forks_own_fixed_set_flag_gets_the_same_check(capsys):
    """A fork adds `advantage: Literal["grpo", "rloo"] = "grpo"`: a bad value given on the command line, saved
    in a checkpoint or passed to Args directly is a one-line error."""

    @dataclass
    class ForkArgs(grpo.Args):
        advantage: Literal["grpo", "rloo"] = "grpo"

    ForkArgs.__module__ = grpo.__name__
    with pytest.raises(common.UsageError, match=r"invalid choice 'rlooo' for argument '--advantage'"):
        common.parse_args(ForkArgs, ["--advantage", "rlooo"])
    with pytest.raises(common.UsageError, match="--advantage must be one of grpo, rloo, got 'x'"):
        common.check_common_args(ForkArgs(advantage="x"), needs_group=True)
    assert common.parse_args(ForkArgs, ["--advantage", "rloo"]).advantage == "rloo"


def test_the_tools_parsers_refuse_abbreviations_too(capsys):
    import plan_memory  # tools/plan_memory.py, its parser tools/cli.py's

    with pytest.raises(SystemExit) as e:
        plan_memory.plan_memory_cli(["--alg", "grpo"])
    assert (
        e.value.code == 2 and capsys.readouterr().err == "error: unrecognized argument --alg (did you mean --algo?)\n"
    )


# --- What a script logs stays true when a fork changes its loop (issue 46) ---


def first_row(out: Path) -> dict:
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[0])


@pytest.mark.slow
@pytest.mark.parametrize("name", GROUP_SCRIPTS)
def test_forwarding_zero_advantage_rows_leaves_the_clip_fraction_as_it_was(tmp_path, capsys, name):
    """A clip fraction is a share of the minibatch, not of the forwarded rows (0.0897 vs 0.0324 before issue 46).
    The script's clip (TRAITS: its flags and the metric it logs) narrowed to at most 0.05 a side, so that it acts
    whatever the defaults (a token clipped, which a row with A = 0 never is: it has no term to clip)."""
    clip = traits(name)
    if clip.clip is None or clip.clip_metric is None:
        pytest.skip(f"{name} declares no clip (or no clip share logged) in tests/helpers.py's TRAITS")
    defaults = MODULES[name].Args()
    narrow = [a for f in clip.clip_flags if f is not None
              for a in ("--" + f.replace("_", "-"), min(getattr(defaults, f), 0.05))]  # fmt: skip
    argv = ["--steps", 1, "--prompts-per-step", 16, "--seed", 5, "--eval-every", 0, "--eval-size", 8, *narrow]
    rows = {}
    for coef in (0.0, 1e-9):
        assert run_main(name, [*argv, "--entropy-coef", coef, "--out", tmp_path / str(coef)], capsys)[0] == 0
        rows[coef] = first_row(tmp_path / str(coef))
    keys = [k for k in rows[0.0] if k.startswith(clip.clip_metric)]  # it and its parts (grpo: clip_frac_low, _high)
    assert clip.clip_metric in keys and all(0 <= rows[0.0][k] <= 1 for k in keys), rows[0.0]
    one_token = 1 / (16 * defaults.group_size)  # a sequence's share; a token's is smaller
    assert rows[0.0][clip.clip_metric] > 0, "nothing clipped: the comparison would be vacuous"
    for k in keys:
        assert abs(rows[0.0][k] - rows[1e-9][k]) <= one_token, (k, rows[0.0][k], rows[1e-9][k])


def fork_module(tmp_path, name: str, edit) -> object:
    """The script `name`, its text changed by `edit`, imported from a file of its own in tmp_path (a fork)."""
    source = (ROOT / f"{name}.py").read_text()
    changed = edit(source)
    assert changed != source, "the edit no longer matches the script's text"
    path = tmp_path / f"{name}_fork.py"
    path.write_text(changed)
    return import_file(path)


@pytest.mark.parametrize("name", GROUP_SCRIPTS)
def test_skipped_updates_counts_skips_not_the_updates_a_fork_left_out(tmp_path, capsys, name):
    """A fork that runs only the first planned update of each step skips nothing: skipped_updates is 0
    (it used to be epochs x minibatches minus the updates that stepped: 1 here, a skip that never happened)."""
    module = fork_module(tmp_path, name, lambda s: s.replace("enumerate(minibatches):", "enumerate(minibatches[:1]):"))
    argv = [*TINY_RUN, "--minibatches", 2, "--steps", 1, "--out", tmp_path / "out"]
    status, _, err = main_in_process(module, argv, capsys)
    assert status == 0, err
    assert first_row(tmp_path / "out")["skipped_updates"] == 0
