"""--trace-every and tools/show_traces.py: the trace against a recomputation from the saved rollout, traced runs
train as untraced ones, resume, which groups are traced, and the page in a real browser (chromium)."""

from __future__ import annotations

import importlib
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import helpers
import numpy as np
import pytest
import show_traces
import torch
from helpers import ROOT
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file

import common

pytestmark = pytest.mark.slow  # subprocess or torchrun runs: the quick tier (-m "not slow") leaves them out

SCRIPTS = {name: importlib.import_module(name) for name in helpers.SCRIPTS}  # a fork: add its name to helpers
gspo = SCRIPTS.get("gspo") or importlib.import_module("gspo")
# two epochs of two minibatches: every row is in two updates, the second of them off-policy; narrow
# clip ranges and a high learning rate, so that the second update's ratios cross them
RUN = ["--prompts-per-step", "4", "--group-size", "2", "--minibatches", "2", "--epochs", "2", "--max-new-tokens", "4",
       "--eval-size", "8", "--eval-every", "0", "--lr", "3e-3", "--trace-groups", "4"]  # fmt: skip
OWN = {
    "ppo": ["--group-size", "2", "--eps-low", "0.01", "--eps-high", "0.01"],
    "grpo": ["--eps-low", "0.01", "--eps-high", "0.01", "--kl-coef", "0.05"],  # a reference: ref_logp
    "gspo": [],  # its own clip range (3e-4, 4e-4) is narrow already; rows with A = 0 are not forwarded
}  # a script not named here (a fork) runs with its own defaults
REQUIRE_BROWSER = os.environ.get("RLREF_REQUIRE_BROWSER") == "1"  # .ci/run: a missing browser fails


def train(name, out, *extra):
    module = SCRIPTS[name]
    common.main(module.train, module.Args, argv=[*RUN, *OWN.get(name, []), *map(str, extra), "--out", str(out)])
    return out


def traces(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "traces.jsonl").read_text().splitlines() if line.strip()]


def metrics_without_timing(out) -> list[dict]:
    """metrics.jsonl without timings, and without the evaluation that a run's stop at step 1 adds to that row."""
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not (k == "tokens_per_s" or k.endswith("_s"))
             and not (k.startswith("eval_") and r is not rows[-1])} for r in rows]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per script, two steps untraced, and traced: step 1 alone, a stale trace line appended (a crash after the
    checkpoint), then --resume to step 2; the weights after step 1 kept aside, and each sampling's weights."""
    root = tmp_path_factory.mktemp("traces")
    out = {}
    for name in SCRIPTS:
        untraced = train(name, root / f"{name}-untraced", "--steps", 2, "--trace-every", 0)
        with pytest.MonkeyPatch.context() as patch:  # a copy of the weights at each sampling: pi_old as it must be
            sampling = helpers.SamplingWeights(patch)
            traced = train(name, root / f"{name}-traced", "--steps", 1, "--trace-every", 1, "--save-every", 1)
            shutil.copytree(traced / "final", root / f"{name}-after-step-1")
            with open(traced / "traces.jsonl", "a") as f:
                f.write(json.dumps({"step": 2, "stale": True}) + "\n")
            common.main(SCRIPTS[name].train, SCRIPTS[name].Args, argv=["--resume", str(traced), "--steps", "2"])
        out[name] = {"full": traced, "untraced": untraced, "after1": root / f"{name}-after-step-1",
                     "sampling": sampling}  # fmt: skip
    return out


def logprobs(model, record, completion) -> torch.Tensor:
    """[n] log-probs of one traced completion under `model`, from its token ids alone."""
    roll = common.Rollout.from_lists([record["prompt"]["ids"]], [completion["ids"]], pad_id=0)
    with torch.no_grad():
        return common.completion_logprobs(model, roll)[0][0]


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_trace_matches_a_recomputation_from_the_saved_rollout(runs, name):
    records = traces(runs[name]["full"])
    args = common.parse_args(SCRIPTS[name].Args, [*RUN, *OWN.get(name, [])])  # the flags the runs were given
    low, high = helpers.clip_bounds(name, args) if helpers.traits(name).clip else (None, None)  # (TRAITS' clip_flags)
    kept = min(args.trace_groups, args.prompts_per_step)  # all 4 prompts here, groups with A = 0 too
    assert [r["step"] for r in records] == [1] * kept + [2] * kept
    device = torch.device("cpu")
    initial, tok = common.load_model("tiny", device)
    reference, eos_ids = initial, common.eos_token_ids(initial, tok)
    # the weights each step starts from: its first update's forward runs at them (whichever step sampled the batch)
    starting = {1: initial, 2: common.load_model(str(runs[name]["after1"]), device)[0]}
    seen = {"clipped": 0, "not_clipped": 0, "not_forwarded": 0}
    for record in records:
        assert (
            record["algo"] == name
            and record["updates_planned"] == args.epochs * args.minibatches
            and record["prompt"]["text"]
        )
        assert len(record["completions"]) == 2
        assert len({len(c["ids"]) + c["pad"] for c in record["completions"]}) == 1  # each padded to the batch's T
        for c in record["completions"]:
            n = len(c["ids"])
            assert len(c["tokens"]) == n and c["mu"] is None and c["entropy"] is not None
            assert c["eos"] == (c["ids"][-1] in eos_ids) and (c["eos"] or n == 4)  # no EOS: cut at 4 tokens
            assert c["tokens"] == [tok.decode([i]) for i in c["ids"]]
            if c["old_logp"] is None:  # the script computed no pi_old for it: a row that no update forwards
                assert c["updates"] is None, "a forwarded row's trace has no old_logp"
            # pi_old: the log-probs of the weights that sampled the row (copied at each sampling), from its token ids
            old = torch.tensor(c["old_logp"] or [float("nan")] * n)
            if c["old_logp"] is not None:
                roll = common.Rollout.from_lists([record["prompt"]["ids"]], [c["ids"]], pad_id=0)
                sampled_by, _ = runs[name]["sampling"].expected(roll, args.temperature)
                assert any(torch.allclose(old, e, atol=2e-5) for e in sampled_by[0]), (
                    f"step {record['step']}: the trace's old_logp is not the log-probs of the weights that sampled it"
                )
            if name == "grpo":
                assert torch.allclose(torch.tensor(c["ref_logp"]), logprobs(reference, record, c), atol=2e-5)
            if name == "ppo":
                assert len(c["advantage"]) == n and len(c["value"]) == n
                # per-token reward: -beta (old - ref), plus the score on the last token (ppo.token_rewards)
                kl = -args.kl_coef * (old - torch.tensor(c["ref_logp"]))
                kl[-1] += c["reward"] - args.missing_eos_penalty * (not c["eos"])
                assert torch.allclose(torch.tensor(c["token_reward"]), kl, atol=1e-5)
            else:
                assert isinstance(c["advantage"], float) and c["value"] is None
            if c["updates"] is None:  # a row left out of every update: only one whose advantage is 0
                assert helpers.traits(name).skips_zero_advantage and c["advantage"] == 0
                seen["not_forwarded"] += 1
                continue
            # one per epoch; a row with A = 0 only where it stood in for an all-zero minibatch (rows_with_signal)
            assert len(c["updates"]) == 2 or (c["advantage"] == 0 and len(c["updates"]) == 1)
            for u in c["updates"]:
                logp = torch.tensor(u["logp"], dtype=torch.float64)
                diff = logp - old.double()
                if name == "gspo":  # one length-normalised ratio for the whole completion, on every token
                    assert len(set(u["ratio"])) == 1
                    expected = torch.full(
                        (n,), math.exp(diff.mean().clamp(*gspo.LOG_RATIO_CLAMP).item()), dtype=torch.float64
                    )
                else:
                    expected = diff.clamp(-20, 20).exp()
                ratio = torch.tensor(u["ratio"], dtype=torch.float64)
                assert torch.allclose(ratio, expected, rtol=1e-6, atol=1e-6)
                adv = torch.tensor(c["advantage"] if name == "ppo" else [c["advantage"]] * n, dtype=torch.float64)
                if helpers.traits(name).clip is None:  # no clip: nothing is marked clipped
                    rule = torch.zeros_like(ratio, dtype=torch.bool)
                else:  # the rule TRAITS declares the script's clip to follow (on the update, or on a weight)
                    rule = helpers.clip_rule(name, args, adv, ratio)
                near = torch.zeros_like(rule)  # (a ratio within rounding of a bound: either way)
                for bound in [1 + x for x in (high,) if x is not None] + [1 - x for x in (low,) if x is not None]:
                    near |= (ratio - bound).abs() < 1e-6
                assert (torch.tensor(u["clipped"]) == rule)[~near].all()
                seen["clipped"] += sum(u["clipped"])
                seen["not_clipped"] += n - sum(u["clipped"])
                # an update the script marks on_policy ran at the weights that sampled the row: pi_old's log-probs
                # (the three scripts mark each step's first; a fork, what its loop runs)
                assert u["on_policy"] == (u["update"] == 0) or name not in ("ppo", "grpo", "gspo")
                if u["on_policy"]:
                    assert torch.allclose(torch.tensor(u["logp"]), old, atol=2e-5), "an on_policy update is not"
            # the step's first update runs before its first optimizer step: its log-probs (the train-mode forward)
            # are those of the weights the step started from, recomputed here: pi_old's too where the step trains
            # what it has just sampled (the three scripts), not where a fork trains an older batch (one-step
            # off-policy), which this check holds for all the same
            if c["updates"][0]["update"] == 0:
                at_start = logprobs(starting[record["step"]], record, c)
                assert torch.allclose(torch.tensor(c["updates"][0]["logp"]), at_start, atol=2e-5), (
                    f"step {record['step']}: the first update's log-probs are not those of the step's starting weights"
                )
    # the clip rule was tested both ways (a script without a clip: no token marked clipped)
    assert (seen["clipped"] or helpers.traits(name).clip is None) and seen["not_clipped"], seen
    if helpers.traits(name).skips_zero_advantage and "--kl-coef" not in OWN.get(name, []):  # (a KL term: every row)
        assert seen["not_forwarded"], "no row with advantage 0 was traced: the null path went untested"


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_traced_and_resumed_run_trains_exactly_as_an_untraced_one(runs, name):
    full, untraced = runs[name]["full"], runs[name]["untraced"]
    assert not traces(untraced) and traces(full) and not any("stale" in r for r in traces(full))  # resume cut it
    assert metrics_without_timing(full) == metrics_without_timing(untraced)
    a, b = load_file(full / "final" / "model.safetensors"), load_file(untraced / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_default_traces_at_each_evaluation(tmp_path):
    args = gspo.Args(steps=25, eval_every=10)
    assert [s for s in range(1, 26) if common.trace_due(args, s)] == [10, 20, 25]
    args.trace_every = 4
    assert [s for s in range(1, 13) if common.trace_due(args, s)] == [4, 8, 12]
    args.trace_every = 0
    assert not any(common.trace_due(args, s) for s in range(1, 26))


# --- The page ---

MAYBE_REWARD = '''
def maybe(prompts, completions, **fields):
    """None (not applicable) for every second completion; 1 for the others that start with a 1."""
    return [None if i % 2 else float(c.startswith("1")) for i, c in enumerate(completions)]
'''


@pytest.fixture(scope="module")
def page(runs, tmp_path_factory):
    """The page of the GRPO and GSPO runs and of a GRPO run whose reward returns None and whose
    completions are all cut at 2 tokens (no EOS)."""
    root = tmp_path_factory.mktemp("page")
    (root / "maybe.py").write_text(MAYBE_REWARD)
    odd = train("grpo", root / "grpo-none-truncated", "--steps", 2, "--trace-every", 1, "--max-new-tokens", 2,
                "--reward", f"{root / 'maybe.py'}:maybe")  # fmt: skip
    run_dirs = [runs["grpo"]["full"], runs["gspo"]["full"], odd]
    html = root / "traces.html"
    show_traces.main([*map(str, run_dirs), "--out", str(html)])
    return html, [traces(d) for d in run_dirs]


def test_the_page_is_self_contained(page):
    html, run_traces = page
    text = html.read_text()
    assert not re.search(r"https?://", text)
    assert "<link" not in text and "src=" not in text  # no stylesheet, script or image to fetch
    odd = [c for r in run_traces[2] for c in r["completions"]]
    assert sum(not c["eos"] for c in odd) > len(odd) / 2  # most completions cut at 2 tokens (truncated)
    assert all(c["rewards"]["maybe"] == 0 for c in odd if c["row"] % 2)  # None counts 0


def shows_rounded(shown: str, value: float, digits: int) -> bool:
    """`shown` is `value` rounded to at most `digits` significant digits (and within half a unit of the last)."""
    mantissa = re.sub(r"e.*$", "", shown.lstrip("-")).replace(".", "").lstrip("0")
    if value == 0:
        return float(shown) == 0
    unit = 10 ** (math.floor(math.log10(abs(value))) - digits + 1)
    return len(mantissa) <= digits and abs(float(shown) - value) <= 0.5 * unit * (1 + 1e-9)


def browser():
    """The headless chromium, or a skip (a failure under .ci/run) when it is missing."""
    missing = [p for p in (show_traces.CHROMIUM, show_traces.CHROMEDRIVER) if not Path(p).exists()]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("selenium (pip)")
    if missing:
        message = f"the browser test needs {', '.join(missing)}: apt-get install chromium chromium-driver"
        if REQUIRE_BROWSER:
            pytest.fail(message)
        pytest.skip(message)
    return show_traces.headless_chromium()


def test_the_page_in_a_real_browser(page):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    html, run_traces = page
    driver = browser()
    try:
        driver.get(html.as_uri())
        # offline: the page fetched nothing besides itself
        assert driver.execute_script("return performance.getEntriesByType('resource').length") == 0
        for step in (1, 2):
            Select(driver.find_element(By.ID, "step")).select_by_value(str(step))
            columns = driver.find_elements(By.CSS_SELECTOR, "#runs > .run")
            assert len(columns) == 3
            for column, records in zip(columns, run_traces):
                shown = [r for r in records if r["step"] == step]
                completions = [c for r in shown for c in r["completions"]]
                spans = column.find_elements(By.CSS_SELECTOR, ".tok")
                assert len(spans) == sum(len(c["ids"]) for c in completions)  # one span per completion token
                assert [s.text for s in spans] == [t.strip() for c in completions for t in c["tokens"]]
                pads = sum(c["pad"] for c in completions) + sum(r["prompt"]["pad"] for r in shown)
                assert len(column.find_elements(By.CSS_SELECTOR, ".pad")) == pads
                prompt_tokens = sum(len(r["prompt"]["ids"]) for r in shown)
                assert len(column.find_elements(By.CSS_SELECTOR, ".prompt")) == prompt_tokens
                assert len(column.find_elements(By.CSS_SELECTOR, ".eos")) == sum(c["eos"] for c in completions)
        for quantity in ("advantage", "ratio", "clipped", "entropy", "kl", "log_ratio"):
            Select(driver.find_element(By.ID, "quantity")).select_by_value(quantity)
        # hover the second token of GSPO's first forwarded completion (a traced step may have none: every group
        # constant, and a stand-in row is not traced): the tooltip shows its numbers
        step, c = next((r["step"], c) for r in run_traces[1] for c in r["completions"] if c["updates"])
        Select(driver.find_element(By.ID, "step")).select_by_value(str(step))
        gspo_column = driver.find_elements(By.CSS_SELECTOR, "#runs > .run")[1]
        token = gspo_column.find_element(By.CSS_SELECTOR, f'.tok[data-row="{c["row"]}"][data-t="1"]')
        ActionChains(driver).move_to_element(token).perform()
        tip = driver.find_element(By.ID, "tip")
        assert tip.is_displayed()
        assert "null" not in tip.text  # GSPO has no mu, ref_logp, value or token_reward: those lines are left out
        lines = dict(line.split(" ", 1) for line in tip.text.splitlines())
        assert shows_rounded(lines["old_logp"], c["old_logp"][1], 4)
        assert shows_rounded(lines["entropy"], c["entropy"][1], 4)
        assert not {"mu", "ref_logp", "value", "token_reward"} & lines.keys()
        update_lines = [line for line in tip.text.splitlines() if line.startswith("update ")]
        assert len(update_lines) == len(c["updates"])
        for line, u in zip(update_lines, c["updates"]):
            k, on_policy, logp, ratio, clipped = re.fullmatch(
                r"update (\d+)( \(on-policy\))?: logp (\S+)  ratio (\S+)  clipped (yes|no)", line
            ).groups()
            assert int(k) == u["update"] and bool(on_policy) == u["on_policy"]
            assert shows_rounded(logp, u["logp"][1], 4) and shows_rounded(ratio, u["ratio"][1], 6)
            assert clipped == ("yes" if u["clipped"][1] else "no")
        severe = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not severe, severe  # no console error
    finally:
        driver.quit()


# --- show_traces.py's command line ---


def show_traces_cli(capsys, *argv):
    """(exit status, stdout, stderr) of tools/show_traces.py's main in this process (run_all.sh runs the command)."""
    return helpers.in_process(show_traces.main, argv, capsys)


def page_data(html: Path) -> dict:
    """The inline JSON a page renders from (the page escapes "<" and "/" inside its script)."""
    text = html.read_text()
    inline = re.search(r'<script type="application/json" id="traces">(.*?)</script>', text, re.S).group(1)
    return json.loads(inline)


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--quantity", "foo"], r"error: argument --quantity: invalid choice: 'foo' \(choose from .*'ratio'.*\)"),
        (["--step", "7"], r"error: --step 7: no run has a trace at that step \(traced steps: 1, 2\)"),
        (["--height", "0"], r"error: --height must be >= 1, got 0"),
        (["--width", "0"], r"error: --width must be >= 1, got 0"),
        (["--quantity", "kl"], r"error: --quantity kl: no run has a reference model \(ref_logp; .*\)"),
        (["--stp", "1"], r"error: unrecognized argument --stp \(did you mean --step\?\)"),
    ],
)
def test_show_traces_bad_input_is_one_line_exit_2(runs, tmp_path, capsys, argv, expected):
    html = tmp_path / "page.html"
    status, out, err = show_traces_cli(capsys, runs["gspo"]["full"], *argv, "--out", html)
    assert status == 2 and len(err.strip().splitlines()) == 1, err
    assert re.fullmatch(expected, err.strip()), err
    assert not html.exists()  # nothing written


def test_show_traces_without_traces_is_one_line_exit_2(tmp_path, capsys):
    status, _, err = show_traces_cli(capsys, tmp_path)
    assert status == 2 and err.strip() == f"error: {tmp_path / 'traces.jsonl'} does not exist (run the script " \
        "with --trace-every, or its default)"  # fmt: skip


def test_show_traces_opens_on_the_ratio_at_the_chosen_step(runs, tmp_path, capsys):
    """By default the page opens on the ratio at its first step; --step and --quantity choose others."""
    html = tmp_path / "page.html"
    assert show_traces_cli(capsys, runs["gspo"]["full"], "--out", html)[0] == 0
    data = page_data(html)
    assert (data["quantity"], data["step"]) == ("ratio", None)
    assert [r["step"] for r in data["runs"][0]["records"]] == [r["step"] for r in traces(runs["gspo"]["full"])]
    assert show_traces_cli(capsys, runs["gspo"]["full"], "--out", html, "--step", 2, "--quantity", "entropy")[0] == 0
    assert (page_data(html)["quantity"], page_data(html)["step"]) == ("entropy", 2)


def test_run_all_writes_the_page_beside_its_report(runs, tmp_path):
    out = tmp_path / "compare"
    for name in SCRIPTS:
        shutil.copytree(runs[name]["full"], out / f"{name}-seed0")
    env = {**os.environ, "STEPS": "2", "SEEDS": "0", "OUT": str(out), "MPLBACKEND": "Agg", "PYTHON": sys.executable}
    proc = subprocess.run(["bash", "run_all.sh", "--report-only"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "results.md").is_file()
    text = (out / "traces.html").read_text()
    assert all(f"{name}  ({name}-seed0)" in text for name in SCRIPTS)  # the three runs' labels


# --- Which groups a trace keeps: those with signal first ---


def test_groups_with_signal_against_a_loop():
    from extras import traces as extra_traces

    grouped = torch.tensor([0.0, 0.0, 1.5, -1.5, 0.0, 0.7, 0.0, 0.0])  # GRPO/GSPO: [B], groups of 2
    assert extra_traces.groups_with_signal(grouped, torch.ones(8, 3), 2) == [False, True, True, False]
    # PPO: [B, T] per-token advantages; a nonzero value on padding (mask 0) is no signal
    per_token = torch.tensor([[0.0, 0.3, 0.0], [0.0, 0.0, 2.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 1]])
    expected = [any(per_token[r, t] != 0 and mask[r, t] for t in range(3)) for r in range(3)]  # a plain loop
    assert expected == [True, False, False]
    assert extra_traces.groups_with_signal(per_token, mask, 1) == expected


@given(
    signal=st.lists(st.booleans(), min_size=1, max_size=40),
    n=st.integers(1, 12),
    seed=st.integers(0, 1000),
    step=st.integers(1, 10_000),
)
def test_traced_groups_prefer_signal_and_move_no_random_stream(signal, n, seed, step):
    from extras import traces as extra_traces

    streams = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    chosen = extra_traces.traced_groups(signal, n, seed, step)
    assert torch.equal(torch.get_rng_state(), streams[0]) and random.getstate() == streams[1]
    assert (np.random.get_state()[1] == streams[2]).all()  # training's streams did not move
    assert chosen == sorted(set(chosen)) and len(chosen) == min(n, len(signal))  # in rollout order, distinct
    assert all(0 <= g < len(signal) for g in chosen)
    with_signal = sum(signal[g] for g in chosen)
    assert with_signal == min(len(chosen), sum(signal))  # a group without signal only once all with signal are in
    assert extra_traces.traced_groups(signal, n, seed, step) == chosen  # the same draw again (as on --resume)


def test_traced_groups_are_drawn_anew_at_each_step():
    """16 groups, all with signal, 4 traced: over 20 steps the draws differ, and every group is drawn at
    some step (the first 4 groups every time was the old rule)."""
    from extras import traces as extra_traces

    draws = [tuple(extra_traces.traced_groups([True] * 16, 4, 0, step)) for step in range(1, 21)]
    assert len(set(draws)) > 1 and {g for d in draws for g in d} == set(range(16))
    assert draws != [tuple(extra_traces.traced_groups([True] * 16, 4, 1, step)) for step in range(1, 21)]  # seed


# the scripts whose groups can lack signal (PPO's group is one prompt, nearly every one with signal: docs/traces.md)
GROUPED = [name for name in SCRIPTS if helpers.traits(name).grouped]


@pytest.fixture(scope="module")
def default_runs(tmp_path_factory):
    """`<script>.py --steps 1` for each grouped script, its other flags the defaults (traced at its evaluation)."""
    root = tmp_path_factory.mktemp("default")
    for name in GROUPED:
        common.main(SCRIPTS[name].train, SCRIPTS[name].Args, argv=["--steps", "1", "--out", str(root / name)])
    return {name: root / name for name in GROUPED}


def signal_of(completions) -> bool:
    """A group has signal when its rewards are not all equal."""
    return len({c["reward"] for c in completions}) > 1


@pytest.mark.parametrize("name", GROUPED)
def test_a_default_run_traces_groups_with_signal(default_runs, name):
    records = traces(default_runs[name])
    args = common.parse_args(SCRIPTS[name].Args, [])
    assert {r["step"] for r in records} == {1}  # its evaluation (the schedule: test_the_default_traces_...)
    assert len(records) == args.trace_groups and len({r["group"] for r in records}) == len(records)
    for r in records:
        assert r["signal"] == signal_of(r["completions"])
        rows = [r["group"] * args.group_size + i for i in range(args.group_size)]  # the group's own rows
        assert [c["row"] for c in r["completions"]] == rows
    # the trace prefers groups with signal: it keeps one without only when the rollout had too few
    assert sum(r["signal"] for r in records) == min(len(records), records[0]["groups_with_signal"])
    assert any(r["signal"] for r in records)
    # the band [1 - eps_low, 1 + eps_high] where the script's clip has those flags (extras/traces.py reads them), else
    # none is drawn
    has_band = helpers.traits(name).clip_flags == ("eps_low", "eps_high")
    bounds = [1 - args.eps_low, 1 + args.eps_high] if has_band else None
    assert all(r["clip_range"] == (pytest.approx(bounds) if has_band else None) for r in records)


def browser_at(width, height, phone):
    browser()  # the skip (or failure) when selenium or chromium is missing
    return show_traces.headless_chromium(width, height, phone=phone)


def ratio_scale(records_of_runs) -> float:
    """The shared colour scale of the ratio: the largest |log ratio| of any traced token's last update."""
    logs = [abs(math.log(x)) for records in records_of_runs for r in records for c in r["completions"]
            if c["updates"] for x in c["updates"][-1]["ratio"]]  # fmt: skip
    return max(logs)


@pytest.mark.parametrize("width, height, phone", [(1400, 1000, False), (400, 900, True)])
def test_the_page_at_a_desktops_and_a_phones_width(default_runs, tmp_path, width, height, phone):
    """No sideways scroll; the key's ends, clip bounds and marks, on-policy labels; columns stack below 800 px."""
    from selenium.webdriver.common.by import By

    html = tmp_path / "page.html"
    show_traces.main([*map(str, default_runs.values()), "--out", str(html)])
    run_traces = [traces(d) for d in default_runs.values()]
    scale = ratio_scale(run_traces)
    driver = browser_at(width, height, phone)
    try:
        driver.get(html.as_uri())
        assert driver.execute_script("return document.documentElement.scrollWidth <= innerWidth")
        columns = driver.find_elements(By.CSS_SELECTOR, "#runs > .run")
        lefts = {c.rect["x"] for c in columns}
        assert len(lefts) == (1 if phone else len(columns))  # stacked on the phone, side by side on the desktop
        step = int(driver.find_element(By.ID, "step").get_attribute("value"))
        for column, records, name in zip(columns, run_traces, default_runs):
            args = common.parse_args(SCRIPTS[name].Args, [])
            ticks = [float(t.text) for t in column.find_elements(By.CSS_SELECTOR, ".key .ticks span")]
            assert ticks[0] == pytest.approx(math.exp(-scale), rel=1e-3) and ticks[1] == 1
            assert ticks[2] == pytest.approx(math.exp(scale), rel=1e-3)
            if helpers.traits(name).clip_flags != ("eps_low", "eps_high"):  # (a fork's own clip: no band drawn)
                assert not column.find_elements(By.CSS_SELECTOR, ".key .clip, .key .bar .mark")
            else:
                clip = column.find_element(By.CSS_SELECTOR, ".key .clip").text
                low, high = map(float, re.match(r"clip bounds (\S+) and (\S+)", clip).groups())
                assert (low, high) == pytest.approx((1 - args.eps_low, 1 + args.eps_high), abs=1e-9)
                marks = column.find_elements(By.CSS_SELECTOR, ".key .bar .mark")
                bar = column.find_element(By.CSS_SELECTOR, ".key .bar")
                for mark, bound in zip(marks, (low, high)):  # the mark at the bound's place on the log scale
                    x = max(-1, min(1, math.log(bound) / scale))
                    centre = mark.rect["x"] + mark.rect["width"] / 2 - bar.rect["x"] - 1  # inside the 1 px border
                    assert abs(centre - (bar.rect["width"] - 2) * (1 + x) / 2) < 2
                assert len(marks) == 2
            # on-policy rows: those whose (last) update the script marked on_policy (the step's first, here)
            shown = [c for r in records if r["step"] == step for c in r["completions"]]
            lines = [e.text for e in column.find_elements(By.CSS_SELECTOR, ".group .line")]
            labelled = [text for text in lines if "on-policy (update 0: ratio 1)" in text]
            assert len(labelled) == sum(bool(c["updates"]) and c["updates"][-1]["on_policy"] for c in shown)
        severe = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not severe, severe
    finally:
        driver.quit()


def test_a_tapped_token_shows_its_numbers_inside_the_window(default_runs, tmp_path):
    """On the phone, a tap on a token near the bottom of the screen (no hover there) shows its numbers,
    rounded, without null fields, in a tooltip inside the viewport; a second tap hides it."""
    from selenium.webdriver.common.by import By

    html = tmp_path / "page.html"
    show_traces.main([str(default_runs["grpo"]), "--out", str(html)])
    records = traces(default_runs["grpo"])
    driver = browser_at(400, 900, phone=True)
    try:
        driver.get(html.as_uri())
        inside = "const r = arguments[0].getBoundingClientRect(); return r.top >= 0 && r.bottom <= innerHeight"
        token = [t for t in driver.find_elements(By.CSS_SELECTOR, ".tok") if driver.execute_script(inside, t)][-1]
        box = token.rect
        assert box["y"] + box["height"] > 900 - 150  # near the bottom: a tooltip below it would leave the window

        def tap():
            point = {"x": box["x"] + box["width"] / 2, "y": box["y"] + box["height"] / 2}
            driver.execute_cdp_cmd("Input.dispatchTouchEvent", {"type": "touchStart", "touchPoints": [point]})
            driver.execute_cdp_cmd("Input.dispatchTouchEvent", {"type": "touchEnd", "touchPoints": []})

        tap()
        tip = driver.find_element(By.ID, "tip")
        assert tip.is_displayed()
        left, top, right, bottom = driver.execute_script(
            "const r = document.getElementById('tip').getBoundingClientRect();return [r.left, r.top, r.right, r.bottom]"
        )
        assert 0 <= left and right <= 400 and 0 <= top and bottom <= 900
        step = int(driver.find_element(By.ID, "step").get_attribute("value"))
        row, t = int(token.get_attribute("data-row")), int(token.get_attribute("data-t"))
        c = next(c for r in records if r["step"] == step for c in r["completions"] if c["row"] == row)
        assert "null" not in tip.text
        lines = dict(line.split(" ", 1) for line in tip.text.splitlines())
        assert shows_rounded(lines["old_logp"], c["old_logp"][t], 4)
        assert shows_rounded(lines["advantage"], c["advantage"], 4)
        assert shows_rounded(lines["entropy"], c["entropy"][t], 4)
        tap()
        assert not tip.is_displayed()
        severe = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not severe, severe
    finally:
        driver.quit()


def test_controls_that_change_nothing_are_hidden(default_runs, runs, tmp_path):
    """GSPO at its defaults (one epoch: each row in one update) without a reference: no update selector,
    no KL colour. The test runs (two epochs, GRPO with a reference) have both."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    lone, both = tmp_path / "gspo.html", tmp_path / "both.html"
    show_traces.main([str(default_runs["gspo"]), "--out", str(lone)])
    show_traces.main([str(runs["grpo"]["full"]), str(runs["gspo"]["full"]), "--out", str(both)])
    assert all(len(c["updates"] or []) <= 1 for r in traces(default_runs["gspo"]) for c in r["completions"])
    driver = browser_at(1400, 1000, phone=False)
    try:
        for html, shown in ((lone, False), (both, True)):
            driver.get(html.as_uri())
            quantity = Select(driver.find_element(By.ID, "quantity"))
            assert quantity.first_selected_option.get_attribute("value") == "ratio"  # the default, once options exist
            options = [o.get_attribute("value") for o in quantity.options]
            assert ("kl" in options) == shown and driver.find_element(By.ID, "update").is_displayed() == shown
            assert [q for q in show_traces.QUANTITIES if q != "kl" or shown] == options
    finally:
        driver.quit()


def test_the_page_says_when_no_group_had_signal(runs, tmp_path):
    """A step whose groups all had equal rewards (here: the GSPO run's records with every group marked
    so) is summarised as such, each group labelled, instead of a grey page with no word."""
    from selenium.webdriver.common.by import By

    flat = tmp_path / "flat"
    shutil.copytree(runs["gspo"]["full"], flat)
    records = traces(flat)
    for r in records:
        r["signal"], r["groups_with_signal"] = False, 0
    (flat / "traces.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    html = tmp_path / "page.html"
    show_traces.main([str(flat), "--out", str(html)])
    driver = browser_at(1400, 1000, phone=False)
    try:
        driver.get(html.as_uri())
        text = driver.find_element(By.CSS_SELECTOR, "#runs > .run .summary").text
        traced = sum(r["step"] == 1 for r in records)
        assert f"0 of {traced} traced groups have signal" in text and "nothing to learn from at this step" in text
        labels = [e.text for e in driver.find_elements(By.CSS_SELECTOR, ".group .note")]
        assert sum(label == "no signal: rewards all equal" for label in labels) == traced
    finally:
        driver.quit()
