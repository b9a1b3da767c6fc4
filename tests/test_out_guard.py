"""--out: a directory holding a run is refused before anything is written (one line), --overwrite replaces it
whole, a directory holding no run is never deleted. Runs in this process, tiny; check_out also directly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_fork_traps import TINY_RUN, one_line_error
from test_fork_traps import run_main as fork_traps_main

import common
import gspo


def run_main(name, argv, capsys):
    """One step of script `name` in this process (test_fork_traps' tiny run): (exit status, stderr)."""
    status, _, err = fork_traps_main(name, [*TINY_RUN, "--steps", 1, *argv], capsys)
    return status, err


def snapshot(directory: Path) -> dict:
    """Every file under `directory` (relative path -> bytes): what 'untouched' compares."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def replacing_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "replacing the earlier" in line]


# --- check_out's decisions, on hand-made directories ---


def args_for(out: Path, **kw) -> gspo.Args:
    return gspo.Args(out=str(out), **kw)


def make_run(
    out: Path, summary_algo=None, checkpoint_algo=None, metrics=True, last=1, summary=(), checkpoint=1
) -> Path:
    """A run's files: metrics.jsonl's rows 1..`last` (the last one torn when `metrics` is "torn"), summary.json naming
    `summary_algo` (or not JSON: "?") with the fields `summary`, checkpoint/meta.json at step `checkpoint`."""
    out.mkdir(parents=True)
    if metrics:
        rows = "".join(json.dumps({"step": s, "lr": 0.1}) + "\n" for s in range(1, last + 1))
        (out / "metrics.jsonl").write_text(rows + f'{{"step": {last + 1}, "lr": 0.' * (metrics == "torn"))
    if summary_algo is not None:
        (out / "summary.json").write_text(
            "not json" if summary_algo == "?" else json.dumps({"algo": summary_algo, **dict(summary)})
        )
    if checkpoint_algo is not None:
        (out / "checkpoint").mkdir()
        (out / "checkpoint" / "meta.json").write_text(json.dumps({"algo": checkpoint_algo, "step": checkpoint}))
    return out


def test_nothing_to_replace_in_a_new_or_empty_directory(tmp_path):
    assert common.check_out(args_for(tmp_path / "new"), None) is None
    (tmp_path / "empty").mkdir()
    assert common.check_out(args_for(tmp_path / "empty"), None) is None


@pytest.mark.parametrize(
    "where, says, replaced",
    [
        (dict(summary_algo="grpo"), "grpo.py run, not gspo.py's", "grpo.py run"),
        (dict(checkpoint_algo="grpo", metrics=False), "grpo.py run, not gspo.py's", "grpo.py run"),
        (dict(checkpoint_algo="grpo"), "grpo.py run, not gspo.py's", "grpo.py run"),
        # a gspo summary beside a grpo checkpoint is still another script's run (the files are mixed)
        (dict(summary_algo="gspo", checkpoint_algo="grpo"), "grpo.py run, not gspo.py's", "grpo.py and gspo.py run"),
        # this script's run, in each state it can be in: what the refusal says of it (docs/running.md, "Outputs")
        (dict(summary_algo="gspo", checkpoint_algo="gspo", last=6, checkpoint=6,
              summary=dict(step=6, steps=6, interrupted=False, eval_accuracy_after=0.75)),
         "a finished gspo.py run (step 6, held-out accuracy 0.75; python gspo.py --resume {out} --steps N",
         "gspo.py run"),
        (dict(summary_algo="gspo", checkpoint_algo="gspo", last=4, checkpoint=4,
              summary=dict(step=4, steps=10, interrupted=True)),
         "a gspo.py run stopped at step 4 of 10 (continue it: python gspo.py --resume {out})", "gspo.py run"),
        # stopped at 4, resumed, killed at step 9 (a torn row 10) after a checkpoint at 8: the summary is stale
        (dict(summary_algo="gspo", checkpoint_algo="gspo", last=9, checkpoint=8, metrics="torn",
              summary=dict(step=4, steps=10, interrupted=True)),
         "a gspo.py run that ended at step 9 without a checkpoint past step 8 (killed or crashed?; python gspo.py "
         "--resume {out} continues from step 8)", "gspo.py run"),
        # an unreadable summary beside metrics.jsonl: a run that crashed before any checkpoint or summary
        (dict(summary_algo="?", last=3), "no summary.json or checkpoint names (a crashed run?), logged to step 3",
         "run (no file names its script)"),
    ],
)  # fmt: skip
def test_a_run_in_out_is_refused_in_one_line_naming_it_unless_overwrite(tmp_path, where, says, replaced):
    out = make_run(tmp_path / "out", **where)
    with pytest.raises(common.UsageError) as e:
        common.check_out(args_for(out), None)
    message = str(e.value)
    assert says.format(out=out) in message and "--overwrite" in message and "another --out" in message, message
    assert "\n" not in message
    assert common.check_out(args_for(out, overwrite=True), None) == replaced


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
    status, err = run_main("gspo", ["--save-every", "1", "--out", out], capsys)
    assert status == 0, err
    assert (out / "checkpoint" / "meta.json").is_file() and replacing_lines(err) == []
    (out / "traces.jsonl").write_text('{"step": 1, "earlier_run": true}\n')  # an earlier run's extra file
    (out / "leftover.txt").write_text("old")
    before = snapshot(out)
    for name, says in (
        ("gspo", "a finished gspo.py run (step 1, held-out accuracy"),
        ("grpo", "gspo.py run, not grpo.py's"),
    ):  # again; another
        status, err = run_main(name, ["--out", out], capsys)
        assert status == 2 and says in one_line_error(err) and "--overwrite" in one_line_error(err)
        assert snapshot(out) == before  # not a byte written
    status, err = run_main("grpo", ["--overwrite", "--out", out], capsys)
    assert status == 0, err
    assert replacing_lines(err) == [f"--out {out}: --overwrite: replacing the earlier gspo.py run there whole"]
    assert not (out / "leftover.txt").exists() and not (out / "checkpoint").exists()  # nothing of gspo's stays
    assert "earlier_run" not in (out / "traces.jsonl").read_text()
    assert [json.loads(r)["step"] for r in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["algo"] == "grpo" and summary["args"]["save_every"] == 0  # the new run's


def test_a_non_run_directory_is_refused_and_kept(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    status, err = run_main("gspo", ["--overwrite", "--out", tmp_path], capsys)
    assert status == 2 and "holds no run" in one_line_error(err)
    assert snapshot(tmp_path) == {"notes.txt": b"mine"}
