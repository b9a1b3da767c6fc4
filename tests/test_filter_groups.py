"""--filter-groups (DAPO's dynamic sampling) in grpo.py and gspo.py, and filter_groups.concat, which joins rounds."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import (
    LOGGED_TOL,
    ROOT,
    assert_within,
    entropy_tol,
    free_port,
    group_advantage_tol,
    logit_scale,
    logprob_tol,
    loop_group_advantages,
    main_in_process,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from transformers import Qwen3Config, Qwen3ForCausalLM

import common
import grpo
import gspo
from extras import filter_groups

FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
PAD = 0


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                         initializer_range=0.3, tie_word_embeddings=False, pad_token_id=PAD)  # fmt: skip
    return Qwen3ForCausalLM(config).eval()


# --- filter_groups.concat ---

tokens = st.lists(st.integers(1, 39), min_size=1, max_size=6)
part = st.lists(st.tuples(tokens, tokens), min_size=0, max_size=3)  # (prompt, completion) rows; a part may be empty


def make_part(rows, seconds, n_tokens, draws):
    if not rows:  # no rows: what a selection of no group leaves, of some width
        roll = common.Rollout.from_lists([[1, 2]], [[3]], PAD)[torch.arange(0)]
    else:
        roll = common.Rollout.from_lists([p for p, _ in rows], [c for _, c in rows], PAD)
    g = torch.Generator().manual_seed(len(rows))
    roll.entropy = torch.rand(roll.completion_ids.shape, generator=g) * roll.completion_mask  # as sample() keeps it
    roll.seconds, roll.sampled_tokens, roll.draws = seconds, n_tokens, draws
    return roll


def row_lists(roll):
    """[(prompt tokens, completion tokens)] of each row, read through the masks by plain loops, and checks that
    the prompt's padding is on its left and the completion's on its right."""
    out = []
    for i in range(len(roll)):
        pm, cm = roll.prompt_mask[i].tolist(), roll.completion_mask[i].tolist()
        n, m = int(sum(pm)), int(sum(cm))
        assert pm == [0] * (len(pm) - n) + [1] * n and cm == [1] * m + [0] * (len(cm) - m), (pm, cm)
        assert all(t == PAD for t in roll.prompt_ids[i].tolist()[: len(pm) - n])
        assert all(t == PAD for t in roll.completion_ids[i].tolist()[m:])
        out.append((roll.prompt_ids[i].tolist()[len(pm) - n :], roll.completion_ids[i].tolist()[:m]))
    return out


@FAST
@given(
    parts=st.lists(
        st.tuples(part, st.floats(0.001, 10.0), st.integers(0, 500), st.integers(1, 3)), min_size=1, max_size=4
    ),
)
def test_concat_keeps_each_rows_tokens_and_adds_up_what_sampling_cost(parts):
    rolls = [make_part(*p) for p in parts]
    joined = filter_groups.concat(rolls, PAD)
    expected = [row for p in parts for row in p[0]]
    assert row_lists(joined) == expected
    assert joined.seconds == sum(p[1] for p in parts)  # the same additions in the same order
    assert joined.sampled_tokens == sum(p[2] for p in parts) and joined.draws == sum(p[3] for p in parts)
    i = 0
    for roll in rolls:  # the per-token entropy of sampling: the part's values, 0 on the new padding
        for r in range(len(roll)):
            m = roll.completion_ids.shape[1]
            assert torch.equal(joined.entropy[i, :m], roll.entropy[r])
            assert not joined.entropy[i, m:].any()
            i += 1


def test_concat_of_a_part_without_seconds_or_entropy_has_none():
    a = make_part([([1, 2], [3])], 1.0, 1, 1)
    b = common.Rollout.from_lists([[4]], [[5, 6]], PAD)  # not from Sampler.sample
    joined = filter_groups.concat([a, b], PAD)
    assert joined.seconds is None and joined.sampled_tokens is None and joined.draws is None
    assert joined.entropy is None  # one part has no entropy: none rather than a made-up one


@FAST
@given(parts=st.lists(st.lists(st.tuples(tokens, tokens), min_size=1, max_size=3), min_size=2, max_size=3))
def test_concat_completion_logprobs_and_entropies_equal_the_parts_row_for_row(model, parts):
    rolls = [common.Rollout.from_lists([p for p, _ in rows], [c for _, c in rows], PAD) for rows in parts]
    joined = filter_groups.concat(rolls, PAD)
    with torch.no_grad():
        logp, ent = common.completion_logprobs(model, joined, 0.9)
    length, max_z = logit_scale(model, joined, 0.9)  # the re-padded batch against each part: two float32 forwards
    i = 0
    for roll in rolls:
        with torch.no_grad():
            lp, en = common.completion_logprobs(model, roll, 0.9)
        length_p, max_zp = logit_scale(model, roll, 0.9)
        scale = (max(length, length_p), max(max_z, max_zp))
        for r in range(len(roll)):
            m = int(roll.completion_mask[r].sum())
            assert_within(logp[i, :m], lp[r, :m], logprob_tol(model.config, *scale), f"log p, row {i}")
            assert_within(ent[i, :m], en[r, :m], entropy_tol(model.config, *scale), f"entropy, row {i}")
            i += 1


# --- The selection: keep_groups, groups_to_train ---

VALUES = [0.0, 1.0, 0.5, 0.1 + 0.2, 0.3, -1.0]  # 0.1 + 0.2 != 0.3: a group of the two differs


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 5), st.lists(st.lists(st.sampled_from(VALUES), min_size=5, max_size=5), max_size=6),
       st.integers(0, 7))  # fmt: skip
def test_keep_groups_is_the_first_n_groups_whose_rewards_differ_whole_and_in_order(G, groups, n):
    rewards = [x for g in groups for x in g[:G]]
    expected, kept = [], 0
    for g in range(len(groups)):
        values = rewards[g * G : (g + 1) * G]
        if max(values) != min(values) and kept < n:  # exact, as in float64
            expected += list(range(g * G, (g + 1) * G))
            kept += 1
    rows = filter_groups.keep_groups(torch.tensor(rewards, dtype=torch.float64), G, n)
    assert rows.tolist() == expected


def test_keep_groups_hand_worked():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.0, 1e-9])  # groups of 2: constant, signal, constant, signal
    assert filter_groups.keep_groups(r, 2, 5).tolist() == [2, 3, 6, 7]
    assert filter_groups.keep_groups(r, 2, 1).tolist() == [2, 3]
    assert filter_groups.keep_groups(r, 2, 0).tolist() == []
    assert filter_groups.keep_groups(r.float(), 4, 9).tolist() == [0, 1, 2, 3, 4, 5, 6, 7]  # groups of 4: both differ


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 40), st.integers(1, 20), st.integers(2, 8), st.integers(1, 8))
def test_groups_to_train_is_the_most_that_fit_the_share_and_split_into_minibatches(agreed, share, G, minibatches):
    expected = max(n for n in range(0, min(agreed, share) + 1) if n * G % minibatches == 0)
    assert filter_groups.groups_to_train(agreed, share, G, minibatches) == expected


# --- filter_groups.fill on hand-worked rounds (one process) ---


def fake_round(rewards, width, seconds, tag):
    """A round of len(rewards) rows: completion `width` tokens wide, each row's record naming it."""
    n = len(rewards)
    roll = common.Rollout.from_lists([[1 + i % 3] * (1 + i % 2) for i in range(n)], [[5] * width] * n, PAD)
    roll.seconds, roll.sampled_tokens, roll.draws = seconds, n * width, 1
    records = [f"{tag}{i}" for i in range(n)]
    return roll, records, torch.tensor(rewards), {"accuracy": torch.tensor(rewards)}


def args_for(**kw):
    base = dict(filter_groups=True, max_sample_rounds=3, prompts_per_step=2, group_size=2, minibatches=1)
    return SimpleNamespace(**{**base, **kw})


def drive(args, given):
    """The scripts' call: the step's first round given, `fill` sampling the next ones from `given`; returns
    (kept, sampled, how many rounds it sampled)."""
    used = [1]

    def sample_round():
        used[0] += 1
        return given[used[0] - 1]

    kept, sampled = filter_groups.fill(args, 1, PAD, sample_round, given[0])
    return kept, sampled, used[0]


def test_rounds_go_on_until_the_step_is_full_and_keep_the_first_groups_with_signal():
    given_rounds = [
        fake_round([1.0, 1.0, 0.0, 1.0], 2, 0.5, "a"),  # group a1 has signal
        fake_round([0.0, 0.0, 0.0, 0.0], 4, 0.25, "b"),  # none
        fake_round([0.5, 0.0, 1.0, 0.0], 3, 0.125, "c"),  # both: the step is full after c0
        fake_round([0.5, 0.0, 1.0, 0.0], 3, 1.0, "d"),
    ]
    (roll, records, rewards, parts), sampled, used = drive(args_for(), given_rounds)
    assert used == 3
    assert records == ["a2", "a3", "c0", "c1"] and rewards.tolist() == [0.0, 1.0, 0.5, 0.0]
    assert parts["accuracy"].tolist() == rewards.tolist()
    assert [c for _, c in row_lists(roll)] == [[5, 5], [5, 5], [5, 5, 5], [5, 5, 5]]
    everything, all_rewards, all_parts = sampled
    assert len(everything) == 12 and all_rewards.tolist() == [1, 1, 0, 1, 0, 0, 0, 0, 0.5, 0, 1, 0]
    assert everything.seconds == 0.875 and everything.sampled_tokens == 8 + 16 + 12 and everything.draws == 3
    assert roll.seconds == 0.875 and roll.draws == 3  # rows picked keep what their draws cost


def test_at_the_cap_it_trains_what_it_has_and_with_nothing_the_first_round():
    signal, flat = fake_round([1.0, 0.0, 1.0, 1.0], 2, 1.0, "a"), fake_round([0.0] * 4, 2, 1.0, "b")
    kept, _, used = drive(args_for(prompts_per_step=4, max_sample_rounds=2), [signal, flat, signal])
    assert used == 2 and kept[1] == ["a0", "a1"]  # the cap: 1 group of 4
    kept, _, used = drive(args_for(prompts_per_step=4, max_sample_rounds=2, minibatches=4), [signal, flat])
    assert used == 2  # 1 group, 2 rows, cannot split into 4 minibatches: none fits
    assert all(x is y for x, y in zip(kept, signal))  # the first round as sampled
    kept, sampled, used = drive(args_for(max_sample_rounds=1), [flat, signal])
    assert used == 1 and all(x is y for x, y in zip(kept, flat))  # no signal: it learns nothing, as unfiltered
    assert sampled[0] is flat[0] and sampled[1] is flat[2]


# --- Advantages on the kept groups ---


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([grpo, gspo]), st.sampled_from(["std", "none"]), st.integers(2, 5),
       st.lists(st.lists(st.sampled_from([0.0, 1.0, 0.25, 2.0, -0.5]), min_size=5, max_size=5), min_size=1,
                max_size=6), st.integers(0, 6))  # fmt: skip
def test_the_kept_groups_advantages_equal_those_the_whole_batch_gives_their_rows(module, scale, G, groups, n):
    rewards = torch.tensor([x for g in groups for x in g[:G]])
    rows = filter_groups.keep_groups(rewards, G, n)
    if not len(rows):  # nothing kept (n = 0, or no group with signal): nothing to compare
        assert n == 0 or all(max(g[:G]) == min(g[:G]) for g in groups)
        return
    kept = module.group_advantages(rewards[rows], G, scale)
    assert torch.equal(kept, module.group_advantages(rewards, G, scale)[rows])  # each group on its own
    loop = loop_group_advantages(rewards[rows].tolist(), G, scale)  # and the float64 loop
    for g in range(len(rows) // G):
        group = rewards[rows][g * G : (g + 1) * G].tolist()
        assert_within(kept[g * G : (g + 1) * G], loop[g * G : (g + 1) * G], group_advantage_tol(group, scale))
        assert kept[g * G : (g + 1) * G].any()  # a kept group has signal


# --- Bad input ---


@pytest.mark.parametrize("module", [grpo, gspo])
@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--max-sample-rounds", "0"], "error: --max-sample-rounds must be >= 1, got 0"),
        (["--filter-groups", "--max-sample-rounds", "-2"], "error: --max-sample-rounds must be >= 1, got -2"),
        (
            ["--filter-groups", "--group-size", "1"],
            "error: --filter-groups keeps groups whose rewards differ: --group-size must be >= 2, got 1",
        ),  # fmt: skip
    ],
)
def test_bad_filter_flags_are_one_line_exit_2_nothing_written(tmp_path, capsys, module, argv, expected):
    status, _, err = main_in_process(module, [*argv, "--out", tmp_path / "out"], capsys)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert status == 2 and errors == [expected], err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


# --- A small run: every trained group has signal; the metrics read everything sampled ---

SMALL = ["--prompts-per-step", "4", "--group-size", "4", "--minibatches", "2", "--max-new-tokens", "4",
         "--eval-size", "8", "--eval-every", "0", "--steps", "3", "--filter-groups"]  # fmt: skip


@pytest.mark.parametrize("module", [grpo, gspo])
def test_a_filtered_run_trains_only_groups_with_signal_and_measures_all_it_sampled(
    tmp_path, capsys, monkeypatch, module
):
    sampled, trained = [], []  # each round's rewards; each step's trained rewards
    score = common.Rewards.__call__  # each sampled round's rewards (the check before the run samples greedily)

    def scored(self, tok, roll, records):
        rewards, parts = score(self, tok, roll, records)
        if roll.seconds is not None:  # from Sampler.sample: a training round
            sampled.append((roll, rewards))
        return rewards, parts

    monkeypatch.setattr(common.Rewards, "__call__", scored)
    advantages = module.group_advantages
    monkeypatch.setattr(module, "group_advantages", lambda r, *a: (trained.append(r.clone()), advantages(r, *a))[1])
    status, _, err = main_in_process(module, [*SMALL, "--out", tmp_path / "out"], capsys)
    assert status == 0, err
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == len(trained) == 3
    G, share = 4, 4
    for row, rewards in zip(rows, trained):
        rounds, sampled = sampled[: row["sample_rounds"]], sampled[row["sample_rounds"] :]
        everything = [x for _, r in rounds for x in r.tolist()]
        groups = [everything[g : g + G] for g in range(0, len(everything), G)]
        signal = [g for g in groups if max(g) != min(g)]
        trained_groups = [rewards.tolist()[g : g + G] for g in range(0, len(rewards), G)]
        assert all(max(g) != min(g) for g in trained_groups)  # every trained group has signal
        assert trained_groups == signal[:share]  # the first ones, in the order sampled
        assert row["groups_kept"] == len(trained_groups) and row["groups_sampled"] == len(groups)
        assert 1 <= row["sample_rounds"] <= 3 and (len(signal) >= share or row["sample_rounds"] == 3)
        assert len(signal[:share]) == share or row["sample_rounds"] == 3  # short only at the cap
        assert abs(row["reward"] - sum(everything) / len(everything)) <= LOGGED_TOL  # all sampled, not the kept
        assert abs(row["zero_std_frac"] - (len(groups) - len(signal)) / len(groups)) <= LOGGED_TOL
        tokens = sum(int(r.completion_mask.sum()) for r, _ in rounds)
        assert row["response_len"] == pytest.approx(tokens / len(everything), abs=LOGGED_TOL)
    assert not sampled  # every round accounted for
    traces = [json.loads(line) for line in (tmp_path / "out" / "traces.jsonl").read_text().splitlines()]
    last = rows[-1]  # the trace (at the last step) draws from the kept groups: all with signal
    assert traces and all(t["signal"] and t["step"] == 3 for t in traces)
    assert {t["groups_in_step"] for t in traces} == {t["groups_with_signal"] for t in traces} == {last["groups_kept"]}


# --- Full tier: torchrun, --resume ---

# rewards 0, 1, 0, 1, ... along the rows (every group has signal), except on rank 1 every other training batch,
# which gets all 0 (that rank keeps nothing in the round)
RANK_REWARD = """
import torch.distributed as dist
calls = []
def alternating(prompts, completions, **kw):
    rank = dist.get_rank() if dist.is_initialized() else 0
    if len(prompts) == 8:  # a training batch of this rank (2 prompts x 4); evaluation's are 3 rows
        calls.append(1)
        if rank == 1 and len(calls) % 2 == 0:
            return [0.0] * len(prompts)
    return [float(i % 2) for i in range(len(prompts))]
"""

# a fork that records what each rank trains: its rewards, step by step
RECORDING = """
import json, os, sys
sys.path.insert(0, {root!r})
import common, {algo} as script
advantages = script.group_advantages
def recording(rewards, *a, **k):
    with open(os.environ["RECORD"] + "." + os.environ["RANK"], "a") as f:
        f.write(json.dumps(rewards.tolist()) + "\\n")
    return advantages(rewards, *a, **k)
script.group_advantages = recording
common.main(script.train, script.Args)
"""


@pytest.mark.slow
@pytest.mark.parametrize("algo, cap", [("grpo", 3), ("gspo", 1)])
def test_two_ranks_agree_and_train_equal_rows_when_one_keeps_nothing(tmp_path, algo, cap):
    (tmp_path / "rank_reward.py").write_text(RANK_REWARD)
    (tmp_path / "fork.py").write_text(RECORDING.format(root=str(ROOT), algo=algo))
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--nproc_per_node", "2", "--master_port", str(free_port()), str(tmp_path / "fork.py"),
           "--reward", f"{tmp_path}/rank_reward.py:alternating", "--steps", "3", "--prompts-per-step", "4",
           "--group-size", "4", "--minibatches", "2", "--max-new-tokens", "4", "--eval-size", "6", "--eval-every",
           "0", "--device", "cpu", "--filter-groups", "--max-sample-rounds", str(cap),
           "--out", str(tmp_path / "run")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RLREF_THREADS": "1", "RECORD": str(tmp_path / "trained")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [[json.loads(line) for line in (tmp_path / f"trained.{r}").read_text().splitlines()] for r in (0, 1)]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(ranks[0]) == len(ranks[1]) == len(rows) == 3
    for step, (zero, one, row) in enumerate(zip(*ranks, rows), 1):
        assert len(zero) == len(one) == 8, step  # every rank the same rows, so the same minibatches
        if cap == 3:  # rank 1's first round has nothing; the second fills the step on both ranks
            assert row["sample_rounds"] == 2 and row["groups_sampled"] == 8 and row["groups_kept"] == 4
            for rewards in (zero, one):
                assert rewards == [0.0, 1.0] * 4  # all with signal: rank 0 its first round's, rank 1 its second's
        else:  # one round: on odd steps rank 1 keeps nothing, so no rank fills its share: each its round as sampled
            assert row["sample_rounds"] == 1 and row["groups_sampled"] == 4 and zero == [0.0, 1.0] * 4
            assert (one, row["groups_kept"]) == (([0.0] * 8, 2) if step % 2 else ([0.0, 1.0] * 4, 4))
    if cap == 1:  # steps 1 and 3 reach the cap: said once
        assert proc.stderr.count("reached --max-sample-rounds 1 with 2 of --prompts-per-step 4 groups") == 1


def untimed(out):
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    timing = lambda k: k == "tokens_per_s" or k.endswith("_s") or "time" in k  # noqa: E731
    return [{k: v for k, v in r.items() if not timing(k)} for r in rows]


@pytest.mark.slow
def test_a_filtered_run_resumed_ends_bit_identical_to_a_straight_one(tmp_path, capsys, module=gspo):  # (shared rounds)
    flags = ["--prompts-per-step", "4", "--group-size", "2", "--minibatches", "2", "--max-new-tokens", "6",
             "--eval-size", "8", "--eval-every", "3", "--no-anneal-lr", "--filter-groups"]  # fmt: skip
    for argv in ([*flags, "--steps", "5", "--out", tmp_path / "full"],
                 [*flags, "--steps", "3", "--save-every", "3", "--out", tmp_path / "part"],
                 ["--resume", tmp_path / "part", "--steps", "5"]):  # fmt: skip
        status, _, err = main_in_process(module, argv, capsys)  # in this process: the scripts seed every stream
        assert status == 0, err[-3000:]
    full, part = untimed(tmp_path / "full"), untimed(tmp_path / "part")
    assert part == full and [r["step"] for r in full] == [1, 2, 3, 4, 5]
    assert max(r["sample_rounds"] for r in full) > 1  # the rounds moved the stream and the generator further
    a, b = (load_file(str(d / "final" / "model.safetensors")) for d in (tmp_path / "full", tmp_path / "part"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert math.isfinite(json.loads((tmp_path / "part" / "summary.json").read_text())["eval_accuracy_after"])
