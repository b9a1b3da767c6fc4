"""OUT/console.log keeps every line a run prints (issue 67): a Ctrl-C whose `| tee` died with it, a closed stdout
pipe; and a run whose output is not a terminal writes progress-bar lines, not every redraw."""

import io
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest
from helpers import ROOT

import common

SMALL = ["--prompts-per-step", "4", "--group-size", "2", "--max-new-tokens", "6", "--eval-size", "8",
         "--minibatches", "2"]  # fmt: skip


def env(**also):
    e = dict(os.environ, RLREF_THREADS="1", HF_HUB_OFFLINE="1", **also)
    for name in ("PYTHONWARNINGS", "PYTHONUNBUFFERED"):  # stdout block-buffered, as a user's pipe is
        e.pop(name, None)
    return e


def test_bar_lines_one_line_per_interval_and_the_last_at_close(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(common.time, "monotonic", lambda: now[0])
    sink = io.StringIO()
    lines = common.BarLines(sink)
    for t in range(26):  # a redraw each second, each followed by tqdm's clear (spaces) as tqdm.write makes it
        now[0] = float(t)
        lines.write(f"\rgspo:  {t}/26 [00:{t:02d}]")
        lines.write("\r" + " " * 40 + "\r")
    assert sink.getvalue() == "gspo:  0/26 [00:00]\ngspo:  10/26 [00:10]\ngspo:  20/26 [00:20]\n"
    lines.write("\n")  # the bar's close: its last state, not yet written
    lines.write("\n")
    assert sink.getvalue().splitlines()[3:] == ["gspo:  25/26 [00:25]"]


def test_console_holds_lines_until_kept_then_appends_and_skips_redraws(tmp_path):
    console = common.Console()
    console.write("step 0: before --out is opened\n")
    console.write("\rgspo:  1/9 a terminal's redraw")
    (tmp_path / "console.log").write_text("an earlier run's line\n")  # --resume appends
    console.keep(tmp_path / "console.log")
    console.write("step 1\n")
    console.close()
    console.write("after the run: dropped\n")
    assert (tmp_path / "console.log").read_text() == "an earlier run's line\nstep 0: before --out is opened\nstep 1\n"
    rank1 = common.Console()  # a torchrun rank that keeps no files holds nothing either
    rank1.write("x\n")
    rank1.keep(None)
    rank1.write("y\n")
    assert rank1.held is None and rank1.file is None


@pytest.mark.slow
def test_sigint_with_stdout_a_closed_buffered_pipe_exits_130_and_console_log_keeps_the_message(tmp_path):
    """`python gspo.py | tee log` and a Ctrl-C that stops tee too: the pipe closes with the run's lines still in
    stdout's buffer; the run saves its checkpoint, exits 130 (not Python's 120 for a failed flush at exit), and
    OUT/console.log ends with the line that says how to continue."""
    out = tmp_path / "run"
    cmd = [sys.executable, "gspo.py", *SMALL, "--steps", "60", "--eval-every", "2", "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    proc.stdout.close()  # the reader is gone before the run prints anything
    deadline = time.monotonic() + 240
    while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().strip()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    stderr = proc.stderr.read().decode()
    proc.wait(timeout=240)
    if proc.returncode == 0:
        pytest.skip("the run finished before SIGINT arrived")
    assert proc.returncode == 130 and "Traceback" not in stderr and "Exception ignored" not in stderr, stderr[-2000:]
    log = (out / "console.log").read_text()
    assert log.startswith("step 0: eval accuracy")  # printed before --out was opened
    assert "SIGINT: finishing this step" in log
    assert log.endswith(f"continue with --resume {out}\n"), log[-500:]
    first = log
    resumed = subprocess.run([sys.executable, "gspo.py", "--resume", str(out), "--steps", "4"], cwd=ROOT, env=env(),
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    log = (out / "console.log").read_text()
    assert log.startswith(first) and resumed.stdout.splitlines()[-1] == log.splitlines()[-1]  # appended


@pytest.mark.slow
def test_redirected_run_prints_lines_not_redraws_and_console_log_holds_them(tmp_path):
    out = tmp_path / "run"
    with open(tmp_path / "stdout", "w") as so, open(tmp_path / "stderr", "w") as se:
        started = time.monotonic()
        cmd = [sys.executable, "gspo.py", *SMALL, "--steps", "30", "--eval-every", "10", "--out", str(out)]
        status = subprocess.run(cmd, cwd=ROOT, env=env(), stdout=so, stderr=se, timeout=300).returncode
        seconds = time.monotonic() - started
    stdout, stderr = (tmp_path / "stdout").read_text(), (tmp_path / "stderr").read_text()
    assert status == 0, stderr[-2000:]
    assert "\r" not in stdout + stderr  # no redraws in a file
    bar = [line for line in stderr.splitlines() if line.startswith("gspo: ")]
    assert len(bar) <= 2 + seconds / common.BAR_EVERY_S and "| 30/30 [" in bar[-1], bar  # at most one per interval
    # every line printed, and only those, in console.log
    printed = Counter(stdout.splitlines() + stderr.splitlines())
    assert Counter((out / "console.log").read_text().splitlines()) == printed
    assert stdout.splitlines()[-1].startswith("gspo: held-out accuracy") and "console.log" in stdout.splitlines()[-1]
