"""A 2-step run of each script of helpers.SCRIPTS in this process, for the quick tier: the outputs every run writes."""

from __future__ import annotations

import importlib
import json
import math

import pytest
import torch
from helpers import SCRIPTS, SMOKE_ARGS, traits
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import common


@pytest.mark.parametrize("name", SCRIPTS)
def test_two_steps_train_log_and_save(name, tmp_path, capsys):
    module = importlib.import_module(name)
    out = tmp_path / "out"
    common.main(module.train, module.Args, argv=[*SMOKE_ARGS, "--out", str(out)])
    err = capsys.readouterr().err
    assert "error" not in err.lower(), err

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for key in ("reward", "accuracy", "loss", "entropy", "response_len", "grad_norm", "eval_accuracy"):
            assert isinstance(r[key], (int, float)) and math.isfinite(r[key]), (key, r[key])
        assert 0 <= r["reward"] <= 1 and 0 <= r["accuracy"] <= 1 and 0 <= r["eval_accuracy"] <= 1
        assert r["skipped_updates"] == 0 and r["entropy"] >= 0 and r["response_len"] >= 1
        assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), r
        # the share its clip acted on, in the loss's own unit, under the name TRAITS declares (a fork's own)
        clip = traits(name).clip_metric
        assert clip is None or 0 <= r[clip] <= 1, (clip, sorted(r))

    summary = json.loads((out / "summary.json").read_text())
    assert summary["algo"] == name and summary["step"] == summary["steps"] == 2 and not summary["interrupted"]
    assert summary["eval_accuracy_after"] == rows[-1]["eval_accuracy"]
    assert {"accuracy_drop", "flat_groups", "no_signal", "eval_accuracy_before", "args"} <= summary.keys()
    assert summary["wall_time_s"] > 0 and summary["peak_mem_mb"] > 0 and summary["model"] == "tiny"

    # the updates moved the weights away from the shipped checkpoint's, and final/ holds them
    start = load_file(f"{common.tiny_checkpoint('tiny')}/model.safetensors")
    final = load_file(out / "final" / "model.safetensors")
    assert start.keys() == final.keys()
    assert all(torch.isfinite(w).all() for w in final.values())
    assert any(not torch.equal(start[k], final[k]) for k in start)
    model = AutoModelForCausalLM.from_pretrained(out / "final")  # final/ loads as any Hugging Face checkpoint
    tok = AutoTokenizer.from_pretrained(out / "final")
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.tensor([tok("1+2=")["input_ids"]])).logits).all()
