"""--report-to wandb and trackio (extras/trackers.py), without a network: wandb's offline run files and trackio's
local store each hold every number of every metrics.jsonl row, at its step; a tracker whose package is missing is
one line naming its install. (TensorBoard's event files: tests/test_eval_and_logging.py.)"""

import importlib.util
import json
import os
import sqlite3
import subprocess
import sys

import pytest
from helpers import ROOT, in_ci, main_in_process

import gspo

SMALL = ["--prompts-per-step", "4", "--group-size", "2", "--max-new-tokens", "6", "--eval-size", "8",
         "--minibatches", "2", "--steps", "3", "--eval-every", "2"]  # fmt: skip
INSTALL = "pip install -r requirements-trackers.txt"  # the README's line for them


def needs(package):
    """Skip without `package`, except under CI (in_ci()), which installs requirements-trackers.txt: there it fails."""
    if not in_ci():
        pytest.importorskip(package, reason=f"{package} is not installed: {INSTALL}")


def run_gspo(out, tracker, **env_vars):
    env = dict(os.environ, RLREF_THREADS="1", HF_HUB_OFFLINE="1", **env_vars)
    cmd = [sys.executable, "gspo.py", *SMALL, "--report-to", tracker, "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def metric_rows(out) -> dict:
    """{step: the row's numbers but its step} of OUT/metrics.jsonl: what each tracker must hold."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    numeric = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    return {r["step"]: {k: v for k, v in r.items() if k != "step" and numeric(v)} for r in rows}


def wandb_records(path):
    """The records of a .wandb file (wandb's transaction log: LevelDB's log format, 32 KiB blocks of chunks each with
    a 7-byte header: CRC32C, length, type 1 full / 2 first / 3 middle / 4 last), after the file's 7-byte header."""
    from wandb.proto import wandb_internal_pb2

    data, pos, pending = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B", data[:7]
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        pending, pos = pending + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


@pytest.mark.slow
def test_wandb_offline_run_holds_every_metric_of_every_row(tmp_path):
    needs("wandb")
    out = tmp_path / "run"
    run_gspo(out, "wandb", WANDB_MODE="offline", WANDB_SILENT="true")
    (log,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    history, config = {}, {}
    for record in wandb_records(log):
        if record.WhichOneof("record_type") == "history":
            item = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            history[record.history.step.num] = {k: v for k, v in item.items() if not k.startswith("_")}
        elif record.WhichOneof("record_type") == "run":  # the run's start, its config the args
            config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
    expected = metric_rows(out)
    assert sorted(expected) == [1, 2, 3] and history == expected
    assert any(k.startswith("eval_") for k in history[2]) and config["report_to"] == "wandb"


@pytest.mark.slow
def test_trackio_local_store_holds_every_metric_of_every_row(tmp_path):
    needs("trackio")
    out, home = tmp_path / "run", tmp_path / "trackio"
    run_gspo(out, "trackio", TRACKIO_DIR=str(home))
    with sqlite3.connect(home / "rl-reference.db") as db:
        rows = db.execute("SELECT run_name, step, metrics FROM metrics").fetchall()
        (config,) = db.execute("SELECT config FROM configs").fetchone()
    assert {name for name, _, _ in rows} == {"run"}  # the run is named by its --out
    logged = {step: json.loads(metrics) for _, step, metrics in rows}
    expected = metric_rows(out)
    assert len(rows) == 3 and logged == expected
    assert any(k.startswith("eval_") for k in logged[2]) and json.loads(config)["report_to"] == "trackio"


@pytest.mark.parametrize("tracker", ["tensorboard", "wandb", "trackio"])
def test_missing_tracker_package_is_one_line_naming_its_install(tmp_path, capsys, monkeypatch, tracker):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == tracker else find_spec(name, *a))
    status, _, err = main_in_process(gspo, ["--report-to", tracker, "--out", tmp_path / "out"], capsys)
    install = "pip install -r requirements.txt" if tracker == "tensorboard" else INSTALL
    assert (
        status == 2
        and err == f"error: --report-to {tracker} needs the {tracker} package, not installed here: {install}\n"
    )
    assert not (tmp_path / "out").exists()
