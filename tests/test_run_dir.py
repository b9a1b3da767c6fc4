"""One writer per run directory (OUT/.lock), a damaged run directory as one line, and a run that says its state:
a second process on a live run's directory refused naming its PID, a SIGKILLed run resumed at once, a torn log line
or a truncated checkpoint file named with what can still be done, --resume saying where it continues from."""

from __future__ import annotations

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
from helpers import ROOT, main_in_process
from test_fork_traps import TINY_RUN, one_line_error
from test_out_guard import snapshot

import common
import gspo
from extras import resume

CHECKPOINTED = [*TINY_RUN, "--save-every", "1"]


def env() -> dict:
    e = dict(os.environ, RLREF_THREADS="1", HF_HUB_OFFLINE="1")  # one core each; never reach the network
    e.pop("PYTHONWARNINGS", None)
    return e


def gspo_cmd(*argv) -> list[str]:
    return [sys.executable, "gspo.py", *map(str, argv)]


def refusal(proc: subprocess.CompletedProcess) -> str:
    """A refused command's one stderr line (exit status 2, nothing on stdout)."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (proc.returncode, proc.stderr)
    return lines[0]


def steps_logged(out: Path) -> list[int]:
    """The steps of OUT/metrics.jsonl's rows; only a last line may be torn (a row written as the run was killed)."""
    steps, torn = resume.log_rows(out / "metrics.jsonl")
    assert torn in ([], [len(steps) + 1]), f"torn lines {torn} in {out / 'metrics.jsonl'}"
    return steps


@pytest.mark.slow
def test_a_live_runs_directory_is_refused_naming_its_pid_and_a_sigkilled_run_resumes_at_once(tmp_path):
    out, elsewhere = tmp_path / "live", tmp_path / "elsewhere"
    argv = [*TINY_RUN, "--save-every", 3, "--steps", 100_000, "--out", out]
    live = subprocess.Popen(gspo_cmd(*argv), cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not ((out / "checkpoint" / "meta.json").is_file() and len(steps_logged(out)) >= 2):
            assert live.poll() is None and time.monotonic() < deadline, "the live run wrote no checkpoint"
            time.sleep(0.05)
        first_row = (out / "metrics.jsonl").read_text().splitlines()[0]
        for argv in (["--out", out], ["--out", out, "--overwrite"], ["--resume", out, "--steps", 200_000],
                     ["--resume", out, "--steps", 200_000, "--out", elsewhere]):  # fmt: skip
            proc = subprocess.run(gspo_cmd(*TINY_RUN, *argv), cwd=ROOT, env=env(), capture_output=True, text=True)
            line = refusal(proc)
            assert f"{out} is in use by the run in process {live.pid} (gspo.py " in line, line
            assert live.poll() is None, "the live run stopped"
            assert not elsewhere.exists()  # nothing written for the second process
            assert (out / "metrics.jsonl").read_text().splitlines()[0] == first_row  # --overwrite deleted nothing
        assert (out / ".lock").read_text().split("\n")[0] == str(live.pid)
        while not len(steps_logged(out)) % 3:  # killed after a step past its checkpoint: rows its resume discards
            assert live.poll() is None, "the live run stopped"
            time.sleep(0.01)
    finally:
        live.send_signal(signal.SIGKILL)  # no checkpoint, no summary: what a crash or an OOM kill leaves
        live.wait()
    logged = steps_logged(out)
    assert logged == list(range(1, len(logged) + 1))  # one writer: whole rows, each step once, in order
    k = json.loads((out / "checkpoint" / "meta.json").read_text())["step"]
    # at once: the kernel let go of the lock with the process
    line = refusal(subprocess.run(gspo_cmd(*TINY_RUN, "--out", out), cwd=ROOT, env=env(), capture_output=True,
                                  text=True))  # fmt: skip
    assert f"holds a gspo.py run that ended at step {logged[-1]} without a checkpoint past step {k}" in line, line
    assert f"python gspo.py --resume {out} continues from step {k}" in line
    proc = subprocess.run(gspo_cmd("--resume", out, "--steps", k + 2), cwd=ROOT, env=env(), capture_output=True,
                          text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout.splitlines()[0]
    assert said.startswith(f"resuming from step {k} of {k + 2}: {out / 'checkpoint'}, written "), said
    if logged[-1] > k:  # the rows logged after the checkpoint are run again
        assert f"logged past it: step{'s' * (logged[-1] > k + 1)} {k + 1}" in said, said
    assert steps_logged(out) == list(range(1, k + 3))


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A 2-step gspo run checkpointed at step 2 (in this process); each test damages a copy."""
    out = tmp_path_factory.mktemp("saved") / "run"
    # its console output is not the asking test's: a test that reads stdout or stderr sees only its own
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        common.main(gspo.train, gspo.Args, [*map(str, CHECKPOINTED), "--steps", "2", "--out", str(out)])
    return out


def damaged_copy(saved_run: Path, to: Path, damage) -> Path:
    shutil.copytree(saved_run, to)
    damage(to / "checkpoint")
    return to


def truncate(path: Path, by: int = 100):
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - by)


def tear_line(path: Path, n: int):
    """Line `n` of a jsonl log as two interleaved writers leave it (the issue's `": 53, "lr": ...`)."""
    lines = path.read_text().splitlines()
    lines[n - 1] = lines[n - 1][: len(lines[n - 1]) // 2] + '": 53, "lr": 0.000496'
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize(
    "damage, says",
    [
        (lambda c: tear_line(c / "metrics.jsonl", 2), "checkpoint/metrics.jsonl line 2 is not a JSON row"),
        (lambda c: tear_line(c / "samples.jsonl", 1), "checkpoint/samples.jsonl line 1 is not a JSON row"),
        (lambda c: tear_line(c / "traces.jsonl", 1), "checkpoint/traces.jsonl line 1 is not a JSON row"),
        (lambda c: truncate(c / "trainer.pt"), "checkpoint/trainer.pt is truncated"),
        (lambda c: truncate(c / "policy" / "model.safetensors"), "checkpoint/policy/model.safetensors is truncated"),
        (lambda c: (c / "policy" / "config.json").unlink(), "checkpoint/policy/config.json is missing"),
        (lambda c: (c / "trainer.pt").unlink(), "incomplete checkpoint"),
    ],
)  # fmt: skip
def test_a_damaged_checkpoint_is_one_line_naming_the_file_and_writes_nothing(saved_run, tmp_path, damage, says, capsys):
    run = damaged_copy(saved_run, tmp_path / "run", damage)
    before = snapshot(run)
    status, _, err = main_in_process(gspo, ["--resume", run, "--steps", 4], capsys)
    line = one_line_error(err)
    assert status == 2 and err.strip() == line and says in line, err
    what_now = "delete or repair the line" if "line" in says else f"python gspo.py --overwrite --out {run}"
    assert what_now in line, line
    assert snapshot(run) == before


def test_what_a_damaged_checkpoints_line_says_can_be_done_works(saved_run, tmp_path, capsys):
    """The torn row deleted, the run resumes; a damaged checkpoint beside a whole checkpoint.old names it, and it
    resumes."""
    run = damaged_copy(saved_run, tmp_path / "torn", lambda c: tear_line(c / "metrics.jsonl", 2))
    lines = (run / "checkpoint" / "metrics.jsonl").read_text().splitlines()
    (run / "checkpoint" / "metrics.jsonl").write_text("\n".join([lines[0], *lines[2:]]) + "\n")
    status, out, err = main_in_process(gspo, ["--resume", run, "--steps", 3], capsys)
    assert status == 0, err
    assert steps_logged(run) == [1, 3]  # step 2's row is lost, the run goes on

    run = tmp_path / "old"
    shutil.copytree(saved_run, run)
    shutil.copytree(run / "checkpoint", run / "checkpoint.old")  # as a crash between save's two renames leaves it
    truncate(run / "checkpoint" / "trainer.pt")
    status, _, err = main_in_process(gspo, ["--resume", run, "--steps", 3], capsys)
    assert status == 2 and f"--resume {run / 'checkpoint.old'} continues from its step 2" in one_line_error(err)
    status, out, err = main_in_process(gspo, ["--resume", run / "checkpoint.old", "--steps", 3], capsys)
    assert status == 0, err
    assert steps_logged(run) == [1, 2, 3]


def test_resume_says_its_step_the_checkpoints_time_and_what_it_discards(saved_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    meta = run / "checkpoint" / "meta.json"
    os.utime(meta, (time.time() - 125, time.time() - 125))  # written 2 min 5 s ago
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(meta.stat().st_mtime))
    with open(run / "metrics.jsonl", "a") as f:  # rows a killed run logged after its checkpoint, the last one torn
        f.write(json.dumps({"step": 3}) + "\n" + json.dumps({"step": 4}) + "\n" + '{"step": 5, "lr')
    status, out, err = main_in_process(gspo, ["--resume", run, "--steps", 4], capsys)
    assert status == 0, err
    said = out.splitlines()[0]
    assert said.startswith(f"resuming from step 2 of 4: {run / 'checkpoint'}, written {when} (2 min 5 s ago)"), said
    assert said.endswith(f"discarding what {run / 'metrics.jsonl'} logged past it: steps 3-4, 1 torn line"), said
    assert steps_logged(run) == [1, 2, 3, 4]


@pytest.mark.slow
def test_refusals_that_need_no_model_come_before_transformers_is_imported(saved_run, tmp_path):
    """Each refusal of a command line, a run directory or a checkpoint in a fresh process: exit 2 without importing
    transformers (the model's library: its import and the tokenizer's load are most of the 3-9 s a refusal took)."""
    torn = damaged_copy(saved_run, tmp_path / "torn", lambda c: tear_line(c / "metrics.jsonl", 1))
    (tmp_path / "a-file").write_text("x")
    cases = [
        ["--steeps", 3],
        ["--out", saved_run],
        ["--out", tmp_path / "a-file" / "out"],
        ["--resume", saved_run, "--steps", 2],
        ["--resume", torn, "--steps", 4],
        *([["--out", "/proc/rlref-test/out"]] if Path("/proc").is_dir() else []),
    ]
    probe = ("import sys, common, gspo\ntry:\n    common.main(gspo.train, gspo.Args, sys.argv[1:])\n"
             "finally:\n    print('transformers' in sys.modules)\n")  # fmt: skip
    for argv in cases:
        proc = subprocess.run([sys.executable, "-c", probe, *map(str, argv)], cwd=ROOT, env=env(),
                              capture_output=True, text=True)  # fmt: skip
        refusal_line = refusal(subprocess.CompletedProcess(proc.args, proc.returncode, "", proc.stderr))
        assert proc.stdout.strip() == "False", (argv, refusal_line)
