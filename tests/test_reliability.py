"""The scripts as programs, in subprocesses: bad input exits 2 with one line; --resume equals an
uninterrupted run and refuses another run's checkpoint; signals checkpoint; non-finite updates are skipped."""

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import ROOT, SCRIPTS, gamma, main_in_process
from safetensors.torch import load_file

import common
import gspo

pytestmark = pytest.mark.slow  # subprocess or torchrun runs: the quick tier (-m "not slow") leaves them out

SMALL = ["--prompts-per-step", "4", "--group-size", "2", "--max-new-tokens", "6", "--eval-size", "8",
         "--minibatches", "2", "--eval-every", "3"]  # fmt: skip


def env():
    e = dict(os.environ, RLREF_THREADS="1", HF_HUB_OFFLINE="1")  # one core each; never reach the network
    e.pop("PYTHONWARNINGS", None)
    return e


def run(script, *argv, timeout=300):
    cmd = [sys.executable, f"{script}.py", *map(str, argv)]
    return subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)


def ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def is_timing(key):
    return key == "tokens_per_s" or key.endswith("_s") or "time" in key


def metrics(out):
    """metrics.jsonl rows without the timing keys."""
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if not is_timing(k)} for r in rows]


def weights(model_dir):
    return load_file(str(Path(model_dir) / "model.safetensors"))


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# --- Bad input: exit 2, one line naming the flag or file, nothing written ---


def write(path, text):
    path.write_text(text)
    return path


def bad_inputs(tmp):
    """(script, argv, what stderr must contain), one case per kind of check; the shared ones rotate over SCRIPTS."""
    broken = tmp / "broken-model"
    broken.mkdir()
    write(broken / "config.json", "{ not json")
    a_file = write(tmp / "a-file.txt", "x")
    good = json.dumps({"prompt": "1+1=", "answer": "2"})
    no_ckpt = tmp / "empty-run"
    no_ckpt.mkdir()
    shared = [
        (["--model", tmp / "missing-model"], "--model"),
        (["--model", broken], "cannot load"),
        (["--data", tmp / "missing.jsonl"], "file not found"),
        (["--data", write(tmp / "badjson.jsonl", good + "\n{oops\n")], "badjson.jsonl:2: invalid JSON"),
        (
            ["--data", write(tmp / "noanswer.jsonl", good + "\n" + good + '\n{"prompt": "2+2="}\n')],
            "noanswer.jsonl:3: missing field 'answer'",
        ),
        (["--reward", tmp / "nope.py:score"], f"--reward {tmp}/nope.py:score: file {tmp}/nope.py not found"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--prompts-per-step", "3", "--minibatches", "4"], "--minibatches 4 does not divide the batch of 6"),
        (["--temperature", "0"], "--temperature must be > 0"),
        (["--out", a_file], "is a file"),
        (["--out", a_file / "out"], f"--out {a_file}/out: {a_file} is a file"),
        (["--resume", no_ckpt], "no checkpoint"),
        (["--no-such-flag", "1"], "Unrecognized options: --no-such-flag"),
        (
            ["--steeps", "2", "--seeed", "1"],
            "Unrecognized options: --steeps, 2, --seeed, 1; did you mean --seed or --steps?",
        ),
        # a directory no one can create (a path under /proc, even for root), refused before the model loads
        *(
            [(["--out", "/proc/rlref/out"], "--out /proc/rlref/out: /proc is not writable")]
            if Path("/proc").is_dir()
            else []
        ),
    ]
    own = [  # (a script's own flags: a fork registered in SCRIPTS need not have them)
        ("grpo", ["--eps-low", "-0.1"], "--eps-low must be"),
        ("gspo", ["--group-size", "1"], "--group-size must be >= 2"),
        ("ppo", ["--critic-lr", "-1"], "--critic-lr must be >= 0"),
        ("gspo", ["--trace-every", "-1"], "--trace-every"),
        ("gspo", ["--trace-groups", "0"], "--trace-groups"),
        ("gspo", ["--old-logp", "rollout", "--is-correction", "tis"], "with --old-logp rollout pi_old is mu"),
        ("grpo", ["--is-cap", "0.5"], "--is-cap must be a finite number >= 1, got 0.5"),
        ("ppo", ["--rollout-dtype", "bf16"], "invalid choice 'bf16' for argument '--rollout-dtype'"),
        ("grpo", ["--is-correction", "trunc"], "invalid choice 'trunc' for argument '--is-correction'"),
        ("ppo", ["--merge-lora"], "--merge-lora merges LoRA adapters: it needs --lora-rank > 0"),
        ("grpo", ["--routing-replay"], "no MoE layers"),  # the tiny model is dense
        ("gspo", ["--cuda-graph", "--device", "cpu"], "--cuda-graph needs a CUDA device"),
        (
            "gspo",
            ["--lora-rank", "4", "--lora-targets", "q_proj", "qkv"],
            "--lora-targets: qwen3 has no module named qkv",
        ),
    ]
    return [(SCRIPTS[i % len(SCRIPTS)], argv, expected) for i, (argv, expected) in enumerate(shared)] + [
        case for case in own if case[0] in SCRIPTS
    ]


def test_bad_input_exits_2_with_one_line(tmp_path, capsys):
    """Each check through common.main in this process; the first case also from the command line."""
    failures = []
    for i, (script, argv, expected) in enumerate(bad_inputs(tmp_path)):
        out = tmp_path / f"out{i}"
        if "--out" not in argv:
            argv = [*argv, "--out", out]
        argv = [*SMALL, "--steps", "2", *argv]
        if i == 0:
            proc = run(script, *argv, timeout=120)
            status, err = proc.returncode, proc.stderr
        else:
            status, _, err = main_in_process(__import__(script), argv, capsys)
        lines = err.strip().splitlines()
        problem = None
        if status != 2:
            problem = f"exit {status}"
        elif len(lines) != 1 or not lines[0].startswith("error: "):
            problem = "stderr is not one 'error: ...' line"
        elif expected not in lines[0]:
            problem = f"stderr lacks {expected!r}"
        elif out.exists():
            problem = "left an output directory"
        if problem:
            failures.append(f"{script} {' '.join(map(str, argv))}: {problem}\n{err[-1500:]}")
    assert not failures, "\n\n".join(failures)


# --- Runs shared by the resume, refusal, interrupt and determinism tests (each made once) ---


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """runs(script, kind) -> out dir: "full" 6 steps, "part" stopped at 3 with a checkpoint (both at a constant lr:
    annealing depends on --steps), "annealed" 6 steps at the default schedule; in this process (one thread, as on
    the command line: common.load_model). The tests resume them, and the signalled runs, from the command line."""
    base, cache = tmp_path_factory.mktemp("runs"), {}
    kinds = {"full": ["--steps", "6", "--no-anneal-lr"], "annealed": ["--steps", "6"],
             "part": ["--steps", "3", "--save-every", "3", "--no-anneal-lr"]}  # fmt: skip

    def get(script, kind):
        if (script, kind) not in cache:
            out = base / f"{script}-{kind}"
            # its console output is not the asking test's: a test that reads stderr sees only its own
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                train_in_process(__import__(script), *kinds[kind], "--out", out)
            cache[script, kind] = out
        return cache[script, kind]

    return get


@pytest.mark.parametrize("script", SCRIPTS)
def test_resume_equals_uninterrupted_run(runs, tmp_path, script):
    full, part = runs(script, "full"), runs(script, "part")
    resumed = tmp_path / "resumed"
    shutil.copytree(part, resumed)  # the stored run stays at step 3 for the other tests
    assert json.loads((resumed / "checkpoint" / "meta.json").read_text())["step"] == 3
    # resuming needs only the directory: the other flags come from the checkpoint; --steps extends
    proc = ok(run(script, "--resume", resumed, "--steps", "6"))
    assert "Traceback" not in proc.stderr

    assert [r["step"] for r in metrics(resumed)] == [1, 2, 3, 4, 5, 6]
    assert metrics(resumed) == metrics(full)  # rows 1-3: another process, same seed; rows 4-6: resumed
    assert_same_weights(weights(resumed / "final"), weights(full / "final"))
    saved = sorted(p.name for p in (full / "final").glob("*.pt"))  # what else the script saves (PPO: its critic)
    assert saved == sorted(p.name for p in (resumed / "final").glob("*.pt"))
    for name in saved:
        assert_same_weights(torch.load(resumed / "final" / name), torch.load(full / "final" / name))
    summary, summary_full = (json.loads((d / "summary.json").read_text()) for d in (resumed, full))
    assert summary["eval_accuracy_before"] == summary_full["eval_accuracy_before"]
    assert summary["eval_accuracy_after"] == summary_full["eval_accuracy_after"]
    assert summary["step"] == 6 and summary["interrupted"] is False
    assert json.loads((resumed / "checkpoint" / "meta.json").read_text())["step"] == 6  # saved at the end


def test_resume_truncates_metrics_after_the_checkpoint(runs, tmp_path):
    resumed = tmp_path / "resumed"
    shutil.copytree(runs("gspo", "part"), resumed)
    with open(resumed / "metrics.jsonl", "a") as f:  # rows a crash left after the checkpoint's step
        f.write(json.dumps({"step": 4, "reward": -1.0}) + "\n" + json.dumps({"step": 5, "reward": -1.0}) + "\n")
    # (in this process: test_resume_equals_uninterrupted_run resumes from the command line); DIR may be the checkpoint
    common.main(gspo.train, gspo.Args, ["--resume", str(resumed / "checkpoint"), "--steps", "4"])
    rows = metrics(resumed)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[3]["reward"] >= 0
    full = metrics(runs("gspo", "full"))
    assert rows[:3] == full[:3]
    assert {k: v for k, v in rows[3].items() if not k.startswith("eval_")} == full[3]  # step 4 is now the last


def edited_meta(part, to, edit):
    """A copy of the run `part` whose checkpoint/meta.json is changed by `edit`."""
    shutil.copytree(part, to)
    meta = json.loads((to / "checkpoint" / "meta.json").read_text())
    edit(meta)
    (to / "checkpoint" / "meta.json").write_text(json.dumps(meta))
    return to


def test_resume_refuses_another_runs_checkpoint_in_one_line(runs, tmp_path, tiny_path, capsys):
    """Refused in one line before anything loads (in this process; the command line's exit 2: above)."""
    part = runs("gspo", "part")
    before = (part / "metrics.jsonl").read_text()
    assert json.loads((part / "checkpoint" / "meta.json").read_text())["device"] == "cpu"  # what it trained on
    wider = edited_meta(
        part, tmp_path / "wider", lambda m: m["config"].update(hidden_size=2 * m["config"]["hidden_size"])
    )
    on_cuda = edited_meta(part, tmp_path / "cuda", lambda m: m.update(device="cuda"))  # no GPU here
    others = [s for s in SCRIPTS if s != "gspo"]  # gspo's checkpoint offered to each other script
    cases = [(s, [part if i % 2 == 0 else part / "checkpoint", "--steps", 6], [f"written by gspo.py, not {s}.py"])
             for i, s in enumerate(others)]  # fmt: skip
    cases += [
        (
            "gspo",
            [part, "--steps", 6, "--model", tiny_path],
            ["--model", "differs from the checkpoint's"],
        ),  # same weights
        ("gspo", [wider, "--steps", 6], ["incompatible model", "hidden_size"]),  # the model directory replaced
        ("gspo", [part, "--steps", 6, "--lr", 0.1], ["--lr 0.1 differs from the checkpoint's 0.0006"]),
        ("gspo", [part], ["at step 3", "--steps 3", "larger --steps"]),  # no work left
        ("gspo", [on_cuda, "--steps", 6, "--device", "cpu"], ["trained on cuda, this run is on cpu"]),
    ]
    for script, argv, expected in cases:
        status, _, err = main_in_process(__import__(script), ["--resume", *argv], capsys)
        lines = err.strip().splitlines()
        assert status == 2 and len(lines) == 1 and lines[0].startswith("error: "), (argv, err[-2000:])
        assert all(text in lines[0] for text in expected), lines[0]
    assert all((d / "metrics.jsonl").read_text() == before for d in (part, wider, on_cuda))


# --- SIGINT / SIGTERM ---


def start(out, *flags, **env_vars):
    """Start gspo in a subprocess; return it once metrics.jsonl has a row."""
    cmd = [sys.executable, "gspo.py", *SMALL, *map(str, flags), "--out", str(out)]
    # SIGINT as a terminal leaves it: a pytest started in the background (`pytest &`) ignores SIGINT, and so would the
    # run it starts, which then finishes (the tests below skipped)
    default_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**env(), **env_vars}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=default_sigint)  # fmt: skip
    deadline = time.monotonic() + 240
    while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().strip()):
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline, "no metrics row within 240 s"
        time.sleep(0.02)
    return proc


def start_and_signal(out, signum, steps=40):
    """Start gspo for `steps` steps, send `signum` once metrics.jsonl has a row, wait for the exit."""
    proc = start(out, "--steps", steps)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=240)
    return proc.returncode, stderr


def test_sigint_saves_a_checkpoint_and_resume_completes_the_run(runs, tmp_path):
    out = tmp_path / "run"
    status, stderr = start_and_signal(out, signal.SIGINT, steps=6)  # the learning rate annealed over 6 steps
    if status == 0:  # the 6 steps finished before the signal landed (the machine stalled this test)
        pytest.skip("the run finished before SIGINT arrived")
    assert status == 130, stderr[-2000:]
    assert "Traceback" not in stderr and f"--resume {out}" in stderr
    summary = json.loads((out / "summary.json").read_text())
    k = summary["step"]
    assert summary["interrupted"] is True and 1 <= k <= 6
    assert json.loads((out / "checkpoint" / "meta.json").read_text())["step"] == k
    assert [r["step"] for r in metrics(out)] == list(range(1, k + 1))
    assert not (out / "final").exists()
    if k == 6:  # the signal came during the last step: nothing is left to resume
        pytest.skip("SIGINT arrived during the last step")

    # the resumed run continues the same schedule: the whole run equals one never interrupted
    ok(run("gspo", "--resume", out))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is False and summary["step"] == 6
    assert [r["step"] for r in metrics(out)] == list(range(1, 7))
    annealed = runs("gspo", "annealed")
    # lr = base * (1 - (step - 1) / steps): 3 float64 roundings, the expected 2; multiples of 1e-4 that the
    # metrics' 6-decimal rounding keeps
    assert [r["lr"] for r in metrics(annealed)] == pytest.approx([6e-4 * (6 - s) / 6 for s in range(6)], rel=gamma(6))
    assert metrics(out) == metrics(annealed)
    assert_same_weights(weights(out / "final"), weights(annealed / "final"))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])  # kill or a scheduler; the terminal closed
def test_sigterm_and_sighup_exit_128_plus_the_signal_with_a_checkpoint(tmp_path, signum):
    out = tmp_path / "run"
    status, stderr = start_and_signal(out, signum)
    assert status == 128 + signum, stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True
    assert json.loads((out / "checkpoint" / "meta.json").read_text())["step"] == summary["step"]


def test_sigint_with_stdout_a_closed_pipe_saves_and_resume_completes_the_run(tmp_path):
    """`python gspo.py | tee log` stopped by Ctrl-C: writes go to a closed pipe, yet the checkpoint is saved and
    --resume ends where an unstopped run ends."""
    flags = ["--eval-every", "1", "--steps", "8"]
    whole = tmp_path / "whole"
    train_in_process(__import__("gspo"), *flags, "--out", whole)
    out = tmp_path / "piped"
    proc = start(out, *flags, PYTHONUNBUFFERED="1")
    assert proc.stdout.readline().startswith("step 0:")  # the run is writing to the pipe
    proc.stdout.close()  # tee is gone: the pipe has no reader
    proc.send_signal(signal.SIGINT)
    stderr = proc.stderr.read()
    proc.wait(timeout=240)
    if proc.returncode == 0:
        pytest.skip("the run finished before SIGINT arrived")
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr[-2000:]
    k = json.loads((out / "summary.json").read_text())["step"]
    assert json.loads((out / "checkpoint" / "meta.json").read_text())["step"] == k
    if k == 8:
        pytest.skip("SIGINT arrived during the last step")
    ok(run("gspo", "--resume", out))
    assert metrics(out) == metrics(whole)
    assert_same_weights(weights(out / "final"), weights(whole / "final"))


# --- Non-finite guard (in-process: the algorithm's loss function is wrapped to return NaN) ---

# The script's policy loss: `<script>_loss` (a fork named rloo.py: rloo_loss), except where named here
LOSS_FN = {"ppo": "ppo_policy_loss"}


def loss_fn_name(module) -> str:
    name = LOSS_FN.get(module.__name__, f"{module.__name__}_loss")
    assert callable(getattr(module, name, None)), f"{module.__name__}.py has no {name}(): add its loss to LOSS_FN"
    return name


def poison_loss(monkeypatch, module, from_call):
    """From the `from_call`-th call on (1-based), the script's loss function returns NaN."""
    name = loss_fn_name(module)
    original, calls = getattr(module, name), [0]

    def poisoned(*a, **kw):
        calls[0] += 1
        loss, info = original(*a, **kw)
        return (loss * float("nan") if calls[0] >= from_call else loss), info

    monkeypatch.setattr(module, name, poisoned)


def train_in_process(module, *argv):
    common.main(module.train, module.Args, [*SMALL, *map(str, argv)])


def alternating_rewards(monkeypatch):
    """Rewards 0, 1, 0, 1, ...: every group has spread, so every update moves the weights."""
    score_rollout = common.score_rollout

    def alternating(tok, roll, answers, parser="exact"):
        _, *rest = score_rollout(tok, roll, answers, parser)  # the format flags (and whatever else it returns) stay
        return torch.tensor([float(i % 2) for i in range(len(answers))]), *rest

    monkeypatch.setattr(common, "score_rollout", alternating)


@pytest.mark.parametrize("script", SCRIPTS)
def test_nonfinite_updates_are_skipped_leaving_weights_and_optimizer_untouched(
    tmp_path, monkeypatch, script, tiny_path
):
    module = __import__(script)  # a project module: an ImportError fails (importorskip made it a skip)
    alternating_rewards(monkeypatch)  # both runs: step 1's updates have a nonzero gradient by construction
    one = tmp_path / "one-step"
    # --no-anneal-lr: the optimizer states compared below hold the learning rate, which anneals with --steps
    train_in_process(module, "--steps", "1", "--save-every", "1", "--no-anneal-lr", "--out", one)
    initial = weights(tiny_path)
    # step 1 did train: a guard that skipped healthy updates would pass the comparison below
    assert any(not torch.equal(initial[k], w) for k, w in weights(one / "final").items())
    assert metrics(one)[0]["skipped_updates"] == 0
    # the same run for two steps, where both updates of step 2 (--minibatches 2) have a NaN loss
    two = tmp_path / "two-steps"
    poison_loss(monkeypatch, module, from_call=3)
    train_in_process(module, "--steps", "2", "--save-every", "2", "--no-anneal-lr", "--out", two)

    row = metrics(two)[1]
    assert row["step"] == 2 and row["skipped_updates"] == 2
    assert_same_weights(weights(two / "final"), weights(one / "final"))
    state = {d: torch.load(d / "checkpoint" / "trainer.pt", weights_only=True)["state"] for d in (one, two)}
    for name in ("optimizer", "critic", "critic_optimizer"):
        if name in state[one]:
            assert_nested_equal(state[two][name], state[one][name], name)


def assert_nested_equal(a, b, where):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_nested_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


@pytest.mark.parametrize("script", SCRIPTS)
def test_consecutive_nonfinite_updates_stop_with_status_3(tmp_path, monkeypatch, capsys, script):
    module = __import__(script)  # a project module: an ImportError fails (importorskip made it a skip)
    poison_loss(monkeypatch, module, from_call=1)
    with pytest.raises(SystemExit) as stop:
        train_in_process(module, "--steps", "4", "--out", tmp_path / "run")
    assert stop.value.code == 3
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("error: loss or gradient norm not finite in 3 consecutive updates (step 2)")
    rows = metrics(tmp_path / "run")
    assert [r["skipped_updates"] for r in rows] == [2]  # step 1 logged; step 2 stopped at its first update
