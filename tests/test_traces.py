"""--trace-every and tools/show_traces.py: the trace's numbers against a recomputation from the saved
rollout (pi_old from the weights at that step, the reference, the ratio and clip rule of each loss);
GSPO's one ratio per completion; a traced run's weights and metrics equal an untraced run's; traces
after --resume equal an uninterrupted run's; the page in a real browser (selenium, Debian's
chromium), offline, with one span per completion token and a hovered token's numbers."""

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

import helpers
import pytest
import show_traces
import torch
from helpers import ROOT
from safetensors.torch import load_file

import common

pytestmark = pytest.mark.slow  # subprocess or torchrun runs: the quick tier (-m "not slow") leaves them out

SCRIPTS = {name: importlib.import_module(name) for name in helpers.SCRIPTS}  # a fork: add its name to helpers
gspo = SCRIPTS.get("gspo") or importlib.import_module("gspo")
# two epochs of two minibatches: every row is in two updates, the second of them off-policy; narrow
# clip ranges and a high learning rate, so that the second update's ratios cross them
RUN = ["--prompts-per-step", "4", "--group-size", "2", "--minibatches", "2", "--epochs", "2", "--max-new-tokens", "4",
       "--eval-size", "8", "--eval-every", "0", "--lr", "3e-3", "--trace-groups", "3"]  # fmt: skip
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
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not (k == "tokens_per_s" or k.endswith("_s"))} for r in rows]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per script: a 2-step run traced at every step; the same run untraced; its first step alone
    (with the weights after it kept aside), then resumed to step 2."""
    root = tmp_path_factory.mktemp("traces")
    out = {}
    for name in SCRIPTS:
        full = train(name, root / f"{name}-full", "--steps", 2, "--trace-every", 1)
        untraced = train(name, root / f"{name}-untraced", "--steps", 2, "--trace-every", 0)
        part = train(name, root / f"{name}-part", "--steps", 1, "--trace-every", 1, "--save-every", 1)
        shutil.copytree(part / "final", root / f"{name}-after-step-1")
        module = SCRIPTS[name]
        common.main(module.train, module.Args, argv=["--resume", str(part), "--steps", "2"])
        out[name] = {"full": full, "untraced": untraced, "resumed": part, "after1": root / f"{name}-after-step-1"}
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
    eps_low, eps_high = args.eps_low, args.eps_high
    assert [r["step"] for r in records] == [1, 1, 1, 2, 2, 2]  # --trace-groups 3 of the 4 prompts
    device = torch.device("cpu")
    initial, tok = common.load_model("tiny", device)
    weights = {1: initial, 2: common.load_model(str(runs[name]["after1"]), device)[0]}  # pi_old of steps 1 and 2
    reference, eos_ids = initial, common.eos_token_ids(initial, tok)
    seen = {"clipped": 0, "not_clipped": 0, "not_forwarded": 0}
    for record in records:
        assert record["algo"] == name and record["updates_planned"] == 4 and record["prompt"]["text"]
        assert len(record["completions"]) == 2
        assert len({len(c["ids"]) + c["pad"] for c in record["completions"]}) == 1  # each padded to the batch's T
        for c in record["completions"]:
            n = len(c["ids"])
            assert len(c["tokens"]) == n and c["mu"] is None and c["entropy"] is not None
            assert c["eos"] == (c["ids"][-1] in eos_ids) and (c["eos"] or n == 4)  # no EOS: cut at 4 tokens
            assert c["tokens"] == [tok.decode([i]) for i in c["ids"]]
            # pi_old: the policy's log-probs at that step, recomputed from the token ids
            old = torch.tensor(c["old_logp"])
            assert torch.allclose(old, logprobs(weights[record["step"]], record, c), atol=2e-5)
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
            if c["updates"] is None:  # GSPO leaves rows with A = 0 out of every update
                assert name == "gspo" and c["advantage"] == 0
                seen["not_forwarded"] += 1
                continue
            # one per epoch; a row with A = 0 only where it stood in for an all-zero minibatch (rows_with_signal)
            assert len(c["updates"]) == 2 or (name == "gspo" and c["advantage"] == 0 and len(c["updates"]) == 1)
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
                rule = ((adv > 0) & (ratio > 1 + eps_high)) | ((adv < 0) & (ratio < 1 - eps_low))  # each loss's rule
                near = ((ratio - (1 + eps_high)).abs() < 1e-6) | ((ratio - (1 - eps_low)).abs() < 1e-6)
                assert (torch.tensor(u["clipped"]) == rule)[~near].all()
                seen["clipped"] += sum(u["clipped"])
                seen["not_clipped"] += n - sum(u["clipped"])
            # the first update of a rollout is on-policy: its log-probs are pi_old's (the train-mode forward)
            if c["updates"][0]["update"] == 0:
                assert torch.allclose(torch.tensor(c["updates"][0]["logp"]), old, atol=2e-5)
    assert seen["clipped"] and seen["not_clipped"], seen  # the clip rule was tested both ways
    if name == "gspo":
        assert seen["not_forwarded"], "no row with advantage 0 was traced: the null path went untested"


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_traced_run_trains_exactly_as_an_untraced_one(runs, name):
    full, untraced = runs[name]["full"], runs[name]["untraced"]
    assert not traces(untraced) and traces(full)
    assert metrics_without_timing(full) == metrics_without_timing(untraced)
    a, b = load_file(full / "final" / "model.safetensors"), load_file(untraced / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", SCRIPTS)
def test_traces_after_resume_equal_the_uninterrupted_runs(runs, name):
    resumed = (runs[name]["resumed"] / "traces.jsonl").read_text()
    assert resumed == (runs[name]["full"] / "traces.jsonl").read_text()


def test_resume_cuts_traces_back_to_the_checkpoint(tmp_path):
    out = train("gspo", tmp_path / "run", "--steps", 1, "--trace-every", 1, "--save-every", 1)
    with open(out / "traces.jsonl", "a") as f:  # what a crash after the checkpoint's step leaves
        f.write(json.dumps({"step": 2, "stale": True}) + "\n")
    common.main(gspo.train, gspo.Args, argv=["--resume", str(out), "--steps", "2", "--trace-every", "0"])
    assert [r["step"] for r in traces(out)] == [1, 1, 1] and not any("stale" in r for r in traces(out))


def test_the_default_traces_at_each_evaluation(tmp_path):
    args = gspo.Args(steps=25, eval_every=10)
    assert [s for s in range(1, 26) if common.trace_due(args, s)] == [10, 20, 25]
    args.trace_every = 4
    assert [s for s in range(1, 13) if common.trace_due(args, s)] == [4, 8, 12]
    args.trace_every = 0
    assert not any(common.trace_due(args, s) for s in range(1, 26))


@pytest.mark.parametrize("flag, value", [("--trace-every", "-1"), ("--trace-groups", "0")])
def test_bad_trace_flags_are_one_line_errors(tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit) as e:
        common.main(gspo.train, gspo.Args, argv=[*RUN, flag, value, "--out", str(tmp_path / "x")])
    assert e.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and flag in errors[0]
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------------------------------------
# The page
# ---------------------------------------------------------------------------------------------

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
        # hover the second token of GSPO's first forwarded completion at step 2: the tooltip shows its numbers
        Select(driver.find_element(By.ID, "step")).select_by_value("2")
        gspo_column = driver.find_elements(By.CSS_SELECTOR, "#runs > .run")[1]
        c = next(c for r in run_traces[1] if r["step"] == 2 for c in r["completions"] if c["updates"])
        token = gspo_column.find_element(By.CSS_SELECTOR, f'.tok[data-row="{c["row"]}"][data-t="1"]')
        ActionChains(driver).move_to_element(token).perform()
        tip = driver.find_element(By.ID, "tip")
        assert tip.is_displayed()
        lines = dict(line.split(" ", 1) for line in tip.text.splitlines())
        assert float(lines["old_logp"]) == c["old_logp"][1]
        assert float(lines["entropy"]) == c["entropy"][1]
        update_lines = [line for line in tip.text.splitlines() if line.startswith("update ")]
        assert len(update_lines) == len(c["updates"])
        for line, u in zip(update_lines, c["updates"]):
            k, logp, ratio, clipped = re.fullmatch(
                r"update (\d+): logp (\S+)  ratio (\S+)  clipped (\S+)", line
            ).groups()
            assert int(k) == u["update"] and float(logp) == u["logp"][1] and float(ratio) == u["ratio"][1]
            assert clipped == str(u["clipped"][1]).lower()
        severe = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not severe, severe  # no console error
    finally:
        driver.quit()


# ---------------------------------------------------------------------------------------------
# show_traces.py's command line
# ---------------------------------------------------------------------------------------------


def show_traces_cli(*argv):
    """(exit status, stdout, stderr) of `python tools/show_traces.py ARGV`, as a user runs it."""
    proc = subprocess.run([sys.executable, "tools/show_traces.py", *map(str, argv)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    return proc.returncode, proc.stdout, proc.stderr


def page_data(html: Path) -> dict:
    """The inline JSON a page renders from (the page escapes "<" and "/" inside its script)."""
    text = html.read_text()
    inline = re.search(r'<script type="application/json" id="traces">(.*?)</script>', text, re.S).group(1)
    return json.loads(inline)


def test_show_traces_help_is_the_whole_docstring():
    status, out, err = show_traces_cli("--help")
    assert status == 0, err
    words = " ".join(out.split())
    assert " ".join(show_traces.__doc__.split()) in words  # every line of it, not the first alone
    for flag in ("--out", "--step", "--quantity", "--screenshot", "--height"):
        assert flag in words


def test_show_traces_quantities_are_the_pages_own():
    """--quantity's choices are exactly the keys of the page script's QUANTITIES, in its order."""
    block = re.search(r"const QUANTITIES = \{(.*?)\};", show_traces.SCRIPT, re.S).group(1)
    assert tuple(re.findall(r"^\s*(\w+):", block, re.M)) == show_traces.QUANTITIES


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--quantity", "foo"], r"error: argument --quantity: invalid choice: 'foo' \(choose from .*'ratio'.*\)"),
        (["--step", "7"], r"error: --step 7: no run has a trace at that step \(traced steps: 1, 2\)"),
        (["--height", "0"], r"error: --height must be >= 1, got 0"),
        (["--stp", "1"], r"error: unrecognized argument --stp \(did you mean --step\?\)"),
    ],
)
def test_show_traces_bad_input_is_one_line_exit_2(runs, tmp_path, argv, expected):
    html = tmp_path / "page.html"
    status, out, err = show_traces_cli(runs["gspo"]["full"], *argv, "--out", html)
    assert status == 2 and len(err.strip().splitlines()) == 1, err
    assert re.fullmatch(expected, err.strip()), err
    assert not html.exists()  # nothing written


def test_show_traces_without_traces_is_one_line_exit_2(tmp_path):
    status, _, err = show_traces_cli(tmp_path)
    assert status == 2 and err.strip() == f"error: {tmp_path / 'traces.jsonl'} does not exist (run the script " \
        "with --trace-every, or its default)"  # fmt: skip


def test_show_traces_opens_on_the_ratio_at_the_chosen_step(runs, tmp_path):
    """By default the page opens on the ratio (the README's picture) at its first step; --step and
    --quantity choose others; the page's script selects DATA.quantity once its options exist."""
    html = tmp_path / "page.html"
    assert show_traces_cli(runs["gspo"]["full"], "--out", html)[0] == 0
    data = page_data(html)
    assert (data["quantity"], data["step"]) == ("ratio", None)
    assert [r["step"] for r in data["runs"][0]["records"]] == [r["step"] for r in traces(runs["gspo"]["full"])]
    assert show_traces_cli(runs["gspo"]["full"], "--out", html, "--step", 2, "--quantity", "entropy")[0] == 0
    assert (page_data(html)["quantity"], page_data(html)["step"]) == ("entropy", 2)
    script = show_traces.SCRIPT
    assert script.index("$('quantity').value = DATA.quantity") > script.index("$('quantity').add(")


def test_the_page_opens_on_the_ratio_in_a_real_browser(runs, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    html = tmp_path / "page.html"
    show_traces.main([str(runs["gspo"]["full"]), "--out", str(html)])
    driver = browser()
    try:
        driver.get(html.as_uri())
        assert Select(driver.find_element(By.ID, "quantity")).first_selected_option.get_attribute("value") == "ratio"
        assert "ratio" in driver.find_element(By.ID, "legend").text
    finally:
        driver.quit()


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
