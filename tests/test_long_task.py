"""The long `sums` task and the staleness sweep's reductions on hand-made curves."""

import pytest
import staleness_sweep
import sums_task
import torch
from helpers import forward_roundings, gamma, probable_gamma

import common
import grpo
import gspo
import ppo

# --- The generator ---


@pytest.fixture(scope="module")
def split():
    return sums_task.sums_split()


def test_split_is_deterministic_and_the_held_out_set_is_disjoint(split, tmp_path):
    train, held = split
    assert len(train) == 20000 and len(held) == 500
    prompts = [ex["prompt"] for ex in train + held]
    assert len(set(prompts)) == len(prompts)  # distinct, so no held-out prompt is a training prompt
    assert not {ex["prompt"] for ex in held} & {ex["prompt"] for ex in train}
    sums_task.write_split(tmp_path)  # and the scripts read back exactly the split from its files
    argv = sums_task.task_flags(tmp_path)
    flags = dict(zip(argv[::2], argv[1::2]))
    assert common.load_task(flags["--data"], flags["--eval-data"]) == (train, held)


def test_every_reference_completion_works_the_sum_and_parses_to_the_answer(split):
    for ex in split[0] + split[1]:
        terms = [int(x) for x in ex["prompt"][:-1].split("+")]
        assert ex["prompt"].endswith("=") and 2 <= len(terms) <= 6 and all(0 <= x <= 9 for x in terms)
        total = 0
        for x in terms:  # the gold answer, by a plain loop
            total += x
        assert ex["answer"] == str(total)
        ref = sums_task.sums_reference(ex["prompt"])
        working, answer = ref.split(" #### ")
        assert answer == str(total)
        steps = working.split(" ")
        assert len(steps) == len(terms) - 1
        running = terms[0]
        for step, x in zip(steps, terms[1:]):  # each step: the running total + the next term = the new total
            assert step == f"{running}+{x}={running + x}"
            running += x
        assert common.score(ref, ex["answer"]) == (1.0, 1.0)


def test_length_distribution_as_documented(split):
    """docs/staleness.md's figures: 12-46 characters, mean 36.2; per term count 12.9, 20.5, 28.3, 36.3, 44.3."""
    lengths = {}
    for ex in split[0] + split[1]:
        lengths.setdefault(ex["prompt"].count("+") + 1, []).append(len(sums_task.sums_reference(ex["prompt"])))
    every = [n for v in lengths.values() for n in v]
    assert min(every) == 12 and max(every) == 46
    assert abs(sum(every) / len(every) - 36.2) < 0.05
    assert sorted(lengths) == [2, 3, 4, 5, 6]
    assert (len(lengths[2]), len(lengths[3])) == (100, 1000)
    for k, expected in zip(sorted(lengths), (12.9, 20.5, 28.3, 36.3, 44.3)):
        assert abs(sum(lengths[k]) / len(lengths[k]) - expected) < 0.05, k
    # with its EOS the longest completion fits the task's default --max-new-tokens
    assert max(every) + 1 <= sums_task.TASK_DEFAULTS["max_new_tokens"]


def test_the_task_brings_its_flags_and_flags_after_them_win(tmp_path):
    for module in (ppo, grpo, gspo):
        a = common.parse_args(module.Args, sums_task.task_flags(tmp_path))
        assert (a.model, a.max_new_tokens, a.lr) == ("tiny-sums", 64, 1e-4)
        assert (a.data, a.eval_data) == (str(tmp_path / "sums_train.jsonl"), str(tmp_path / "sums_eval.jsonl"))
        later = ["--model", "tiny", "--max-new-tokens", "70", "--lr", "3e-4"]  # a sweep's EXTRA_ARGS come last
        a = common.parse_args(module.Args, [*sums_task.task_flags(tmp_path), *later])
        assert (a.model, a.max_new_tokens, a.lr) == ("tiny", 70, 3e-4)


@pytest.mark.slow  # 500 greedy 64-token completions
def test_the_checkpoint_has_its_own_key_and_starts_in_the_band(split):
    path = common.tiny_checkpoint("tiny-sums")
    assert "tiny-qwen3-sums-" in path and path != common.tiny_checkpoint("tiny")
    model, tok = common.load_model("tiny-sums", torch.device("cpu"))
    assert 0.15 <= common.evaluate(model, tok, split[1], max_new_tokens=64)["accuracy"] <= 0.50


# --- The on-policy cell of the sweep: ratios 1, GSPO's gradient = GRPO seq-mean-token-mean's ---


def test_on_policy_update_on_the_task_gspo_gradient_equals_grpo_and_a_plain_loop(split):
    """The sweep's on-policy cell: GSPO's gradients (both variants) equal GRPO's and a float64 loop's."""
    torch.manual_seed(0)
    model, tok = common.load_model("tiny-sums", torch.device("cpu"))
    examples = split[0][:4]
    prompts, _ = common.prompts_and_records(tok, examples, 4, "")
    gen = torch.Generator().manual_seed(0)
    roll = common.sample(model, prompts, 64, common.eos_token_ids(model, tok), tok.pad_token_id, generator=gen)
    mask = roll.completion_mask
    assert mask.sum(1).max() >= 20 and len(set(mask.sum(1).tolist())) >= 4  # long, of different lengths
    adv = torch.tensor([1.5, -0.5, -0.5, -0.5, 0.3, -1.2, 0.9, 0.0, -1.0, 1.0, 0.5, -0.5, 2.0, 0.1, -0.7, -1.4])
    with torch.no_grad():
        old, _ = common.completion_logprobs(model, roll)

    def grad_of(loss_fn):
        model.zero_grad()
        logp, _ = common.completion_logprobs(model, roll)
        loss_fn(logp).backward()
        return torch.cat([p.grad.flatten().clone() for p in model.parameters()]), logp.detach()

    g_grpo, logp = grad_of(
        lambda lp: grpo.grpo_loss(lp, old, adv, mask, eps_low=0.2, eps_high=0.2, agg="seq-mean-token-mean")[0]
    )
    ratio = torch.exp(logp - old)[mask.bool()]
    assert torch.equal(ratio, torch.ones_like(ratio))  # the same forward twice: exactly 1
    for info in (grpo.grpo_loss(logp, old, adv, mask)[1], gspo.gspo_loss(logp, old, adv, mask)[1]):
        assert (info["log_ratio_std"], info["ratio_outside_grpo_clip"]) == (0.0, 0.0)
    g_gspo, _ = grad_of(
        lambda lp: gspo.gspo_loss(lp, old, adv, mask, eps_low=3e-4, eps_high=4e-4, variant="sequence")[0]
    )
    g_token, _ = grad_of(lambda lp: gspo.gspo_loss(lp, old, adv, mask, eps_low=3e-4, eps_high=4e-4, variant="token")[0])

    def plain_loop(lp):
        rows = []
        for i in range(lp.shape[0]):
            n = int(mask[i].sum())
            s = sum(lp[i, t].double() for t in range(lp.shape[1]) if mask[i, t])
            rows.append(-float(adv[i]) * s / n)
        return sum(rows) / lp.shape[0]

    g_ref, _ = grad_of(plain_loop)
    scale = g_ref.abs().max()
    assert scale > 0
    # the losses' gradients at the log-probs: -A / (|y| B) each, a few float32 roundings (gamma_8) against the
    # loop's float64; backward through one model then adds its sums' rounding (helpers' forward model), relative
    # to the gradients' size
    length = roll.prompt_ids.shape[1] + roll.completion_ids.shape[1]
    tol = 2 * (gamma(8, torch.float32) + probable_gamma(forward_roundings(model.config, length))) * scale
    for g in (g_grpo, g_gspo, g_token):
        assert ((g - g_ref.float()).abs() <= tol).all(), ((g - g_ref.float()).abs().max() / tol).item()


# --- The sweep's reductions on hand-made curves (experiments/staleness_sweep.py) ---


@pytest.mark.parametrize(
    "curve, expected",
    [
        ([(0, 0.3), (10, 0.5), (20, 0.6), (30, 0.62)], None),  # rises
        ([(0, 0.3), (10, 0.6), (20, 0.2), (30, 0.1)], 20),  # falls below 0.3 at step 20 and stays
        ([(0, 0.3), (10, 0.6), (20, 0.2), (30, 0.35)], None),  # dips, then recovers to half its best
        ([(0, 0.3), (10, 0.6), (20, 0.2), (30, 0.4), (40, 0.29)], 40),  # recovers, then falls for good
        ([(0, 0.3), (10, 0.6), (20, 0.3)], None),  # exactly half: not below
        ([(0, 0.4), (10, 0.1), (20, 0.0)], 10),  # the best was before training
        ([(0, 0.0), (10, 0.0)], None),  # never learned: nothing to collapse from
        ([], None),
    ],
)
def test_collapse_on_hand_made_curves(curve, expected):
    assert staleness_sweep.collapse_step(curve) == expected


def test_grad_norm_spikes_hand_worked():
    # sorted 0.9 1 1 1 1 1.1 5 5.1 40: median 1.0; 5.0 is not above 5 x 1.0, 5.1 and 40 are; None, NaN: no step
    norms = [1.0, 0.9, 1.1, 1.0, 1.0, 5.0, 5.1, 40.0, 1.0, None, float("nan")]
    assert staleness_sweep.grad_norm_spikes(norms) == 2
    assert staleness_sweep.grad_norm_spikes([]) == 0
    assert staleness_sweep.eval_curve(
        {"eval_accuracy_before": 0.2}, [{"step": 1}, {"step": 2, "eval_accuracy": 0.3}]
    ) == [
        (0, 0.2),
        (2, 0.3),
    ]


def test_run_values_on_a_hand_made_run():
    summary = {"eval_accuracy_before": 0.25, "eval_accuracy_after": 0.20, "wall_time_s": 9.0}
    rows = [{"step": 1, "grad_norm": 1.0, "entropy": 0.5, "log_ratio_std": 0.0},
            {"step": 2, "grad_norm": 1.0, "entropy": 0.3, "log_ratio_std": 0.1, "eval_accuracy": 0.40},
            {"step": 3, "grad_norm": 9.0, "entropy": 0.1, "log_ratio_std": 0.2, "eval_accuracy": 0.20}]  # fmt: skip
    v = staleness_sweep.run_values(summary, rows)
    # means of 2 or 3 logged values: a sum and a division, in float64
    assert v["best_eval_accuracy"] == 0.40 and v["mean_eval_accuracy"] == pytest.approx(0.30, rel=gamma(4))
    assert v["log_ratio_std"] == pytest.approx(0.1, rel=gamma(4))
    assert v["final_entropy"] == pytest.approx(0.3, rel=gamma(4))
    assert v["grad_norm_spikes"] == 1 and not v["collapsed"]  # 0.20 is half the best: not below it
