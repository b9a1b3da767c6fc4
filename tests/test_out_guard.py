"""--out: a directory holding a run is refused before anything is written (one line), --overwrite replaces it
whole, a directory holding no run is never deleted. Runs in this process, tiny; check_out also directly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import main_in_process

import common
import grpo
import gspo

TINY_RUN = ["--prompts-per-step", "4", "--group-size", "2", "--minibatches", "1", "--max-new-tokens", "4",
            "--eval-size", "8", "--eval-every", "0", "--steps", "1"]  # fmt: skip
MODULES = {"gspo": gspo, "grpo": grpo}


def run_main(name, argv, capsys):
    """common.main of script `name` in this process: (exit status, stderr)."""
    status, _, err = main_in_process(MODULES[name], argv, capsys)
    return status, err


def snapshot(directory: Path) -> dict:
    """Every file under `directory` (relative path -> bytes): what 'untouched' compares."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


def replacing_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "replacing the earlier" in line]


# --- check_out's decisions, on hand-made directories ---


def args_for(out: Path, **kw) -> gspo.Args:
    return gspo.Args(out=str(out), **kw)


def make_run(out: Path, summary_algo=None, checkpoint_algo=None, metrics=True) -> Path:
    out.mkdir(parents=True)
    if metrics:
        (out / "metrics.jsonl").write_text('{"step": 1}\n')
    if summary_algo is not None:
        (out / "summary.json").write_text(json.dumps({"algo": summary_algo}))
    if checkpoint_algo is not None:
        (out / "checkpoint").mkdir()
        (out / "checkpoint" / "meta.json").write_text(json.dumps({"algo": checkpoint_algo}))
    return out


def test_nothing_to_replace_in_a_new_or_empty_directory(tmp_path):
    assert common.check_out(args_for(tmp_path / "new"), None) is None
    (tmp_path / "empty").mkdir()
    assert common.check_out(args_for(tmp_path / "empty"), None) is None


@pytest.mark.parametrize(
    "where", [dict(summary_algo="grpo"), dict(checkpoint_algo="grpo", metrics=False), dict(checkpoint_algo="grpo")]
)
def test_another_scripts_run_is_refused_naming_both_unless_overwrite(tmp_path, where):
    out = make_run(tmp_path / "out", **where)
    with pytest.raises(common.UsageError) as e:
        common.check_out(args_for(out), None)
    message = str(e.value)
    assert "grpo.py run, not gspo.py's" in message and "--overwrite" in message and "another --out" in message
    assert "\n" not in message
    assert common.check_out(args_for(out, overwrite=True), None) == "grpo.py run"


def test_summary_and_checkpoint_are_both_read(tmp_path):
    """A gspo summary beside a grpo checkpoint is still another script's run (the files are mixed)."""
    out = make_run(tmp_path / "out", summary_algo="gspo", checkpoint_algo="grpo")
    with pytest.raises(common.UsageError, match="grpo.py run, not gspo.py's"):
        common.check_out(args_for(out), None)
    assert common.check_out(args_for(out, overwrite=True), None) == "grpo.py and gspo.py run"


def test_the_same_scripts_run_is_refused_unless_overwrite(tmp_path):
    out = make_run(tmp_path / "out", summary_algo="gspo", checkpoint_algo="gspo")
    with pytest.raises(common.UsageError) as e:
        common.check_out(args_for(out), None)
    assert f"earlier gspo.py run (--resume {out} continues it" in str(e.value) and "--overwrite" in str(e.value)
    assert "\n" not in str(e.value)
    assert common.check_out(args_for(out, overwrite=True), None) == "gspo.py run"


def test_a_run_no_file_names_needs_overwrite(tmp_path):
    out = make_run(tmp_path / "out")  # metrics.jsonl alone: a run that crashed before any checkpoint or summary
    (out / "summary.json").write_text("not json")
    with pytest.raises(common.UsageError, match="no summary.json or checkpoint names"):
        common.check_out(args_for(out), None)
    assert common.check_out(args_for(out, overwrite=True), None).startswith("run")


def test_resume_in_place_replaces_nothing(tmp_path):
    out = make_run(tmp_path / "out", summary_algo="gspo", checkpoint_algo="gspo")
    assert common.check_out(args_for(out, overwrite=True), out / "checkpoint") is None
    with pytest.raises(common.UsageError, match="holds the checkpoint --resume reads"):
        common.check_out(args_for(tmp_path), out / "checkpoint")  # replacing tmp_path would delete it


def test_overwrite_is_this_commands_not_the_checkpoints(tmp_path):
    """A run started with --overwrite and resumed into another --out does not inherit it."""
    from extras import resume  # a project module: an ImportError is a failure, not a skip

    out = make_run(tmp_path / "out", summary_algo="gspo")
    meta = {"algo": "gspo", "step": 1, "model": "tiny", "config": {}, "args": {"overwrite": True, "lr": 0.1}}
    (out / "checkpoint").mkdir()
    (out / "checkpoint" / "meta.json").write_text(json.dumps(meta))
    for name in ("policy", "trainer.pt", "metrics.jsonl"):
        (out / "checkpoint" / name).touch()
    args = resume.resumed_args(gspo.Args, str(out), lambda defaults: defaults)  # no flag given but --resume
    assert (args.overwrite, args.lr, args.out) == (False, 0.1, str(out))


# --- whole runs ---


def test_a_finished_run_is_refused_untouched_and_overwrite_replaces_it_whole(tmp_path, capsys):
    out = tmp_path / "out"
    status, err = run_main("gspo", [*TINY_RUN, "--save-every", "1", "--out", out], capsys)
    assert status == 0, err
    assert (out / "checkpoint" / "meta.json").is_file() and replacing_lines(err) == []
    (out / "traces.jsonl").write_text('{"step": 1, "earlier_run": true}\n')  # an earlier run's extra file
    (out / "leftover.txt").write_text("old")
    before = snapshot(out)
    for name, says in (("gspo", "earlier gspo.py run"), ("grpo", "gspo.py run, not grpo.py's")):  # again; another
        status, err = run_main(name, [*TINY_RUN, "--out", out], capsys)
        assert status == 2 and says in error_line(err) and "--overwrite" in error_line(err)
        assert snapshot(out) == before  # not a byte written
    status, err = run_main("grpo", [*TINY_RUN, "--overwrite", "--out", out], capsys)
    assert status == 0, err
    assert replacing_lines(err) == [f"--out {out}: --overwrite: replacing the earlier gspo.py run there whole"]
    assert not (out / "leftover.txt").exists() and not (out / "checkpoint").exists()  # nothing of gspo's stays
    assert "earlier_run" not in (out / "traces.jsonl").read_text()
    assert [json.loads(r)["step"] for r in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["algo"] == "grpo" and summary["args"]["save_every"] == 0  # the new run's


def test_a_non_run_directory_is_refused_and_kept(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    status, err = run_main("gspo", [*TINY_RUN, "--overwrite", "--out", tmp_path], capsys)
    assert status == 2 and "holds no run" in error_line(err)
    assert snapshot(tmp_path) == {"notes.txt": b"mine"}
