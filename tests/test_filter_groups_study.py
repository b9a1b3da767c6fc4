"""experiments/filter_groups.py: its table on hand-made runs, every figure worked out by hand."""

import json

import filter_groups as fg  # experiments/, on sys.path through conftest.py


def fake_run(out, name, steps, step_time, rounds, sampled, kept=64, before=0.25, after=0.5):
    run = out / name
    run.mkdir(parents=True)
    last = {"eval_accuracy": after}
    rows = [{"step": s, "step_time_s": step_time, "sample_rounds": rounds, "groups_sampled": sampled,
             "groups_kept": kept, "zero_std_frac": 0.5, **(last if s == steps else {})}
            for s in range(1, steps + 1)]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps({"eval_accuracy_before": before, "eval_accuracy_after": after}))


def test_the_table_reads_each_configs_seeds(tmp_path):
    fake_run(tmp_path, "grpo-filter-s0", 4, 0.5, 3, 192, after=0.5)
    fake_run(tmp_path, "grpo-filter-s1", 4, 0.25, 2, 128, kept=60, after=0.75)
    fake_run(tmp_path, "grpo-s0", 4, 0.125, 1, 64, kept=30, after=0.25)
    fg.report(tmp_path, [0, 1])
    lines = (tmp_path / "filter_groups.md").read_text().splitlines()
    filtered = next(line for line in lines if line.startswith("| grpo.py --filter-groups |"))
    cells = [c.strip() for c in filtered.split("|")[1:-1]]
    # after: mean 0.625, sample std of (0.5, 0.75) = 0.1768; training s 2 and 1; step s 0.5 and 0.25
    assert cells == ["grpo.py --filter-groups", "0,1", "4/4", "0.625 ± 0.177", "0.250 ± 0.000", "2 ± 1",
                     "0.375 ± 0.177", "2.50 ± 0.71", "160.0 ± 45.3", "62.0 ± 2.8", "0.500 ± 0.000"]  # fmt: skip
    plain = next(line for line in lines if line.startswith("| grpo.py |"))
    assert [c.strip() for c in plain.split("|")[1:-1]][1:5] == ["0", "4", "0.250", "0.250"]  # one seed: no spread
    assert (tmp_path / "filter_groups.png").is_file()
