"""Every field of every script's Args, set to another value, changes one step's gradients or weights (bit for bit),
unless common.NOT_IN_UPDATE (or the script's own) declares it does not: then it must leave them bit-identical."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import shutil
import typing

import pytest
import torch
from helpers import SCRIPTS, traits
from test_real_checkpoints import graded_reward

import common

# one one-step run per flag and script (its time under load: tests/README.md)
pytestmark = pytest.mark.slow

# One step of a tiny batch, two minibatches (the second off-policy, so clip ranges can act), no evaluation;
# a reward that varies within every group (GRADED in the argv, replaced by the file's path), so every row trains
BASE = ["--steps", "1", "--minibatches", "2", "--epochs", "1", "--max-new-tokens", "4", "--eval-size", "1",
        "--eval-every", "0", "--reward", "GRADED"]  # fmt: skip
BATCH = {"ppo": ["--prompts-per-step", "8", "--group-size", "1"]}
DEFAULT_BATCH = ["--prompts-per-step", "4", "--group-size", "2"]
BF16_ROLLOUT = ("--rollout-dtype", "bfloat16")  # mu differs from pi_old: what the IS correction corrects
# a reward of the row alone: 1 for the first row of a round's rollout, else 0, so that one group of every round has
# signal and the others are constant, whatever the model samples (--filter-groups samples more rounds)
ONE_GROUP = ("--reward", "ROWS")
ROW_REWARD = """
def rows(prompts, completions, **kwargs):
    return [float(i == 0) for i in range(len(completions))]
"""

# field -> (values, companions): each value (a tuple of argv words) must change the update of a run given the
# companions, against the run given the companions alone. A callable value or companion takes the test's tmp_path.
CASES = {
    # SharedArgs
    "model": ((lambda tmp: ("--model", str(tiny_copy(tmp, noise=0.01))),), ()),  # other weights, tiny's shapes
    "data": ((lambda tmp: ("--data", str(data_file(tmp))),), ()),
    # --eval-data takes the evaluation split out of --data's: training sees all of --data
    "eval_data": (
        (lambda tmp: ("--eval-data", str(data_file(tmp, "eval.jsonl", 8))),),
        lambda tmp: ("--data", str(data_file(tmp))),
    ),  # fmt: skip
    # the tiny tokenizer has no chat template: a copy given one that reads both, as Qwen3's does (test_qwen3_tokenizer:
    # the real one), at the tiny vocabulary's speed (tiny-qwen3's 151,669 tokens took about 5 s a run)
    "system_prompt": ((("--system-prompt", ""),), lambda tmp: ("--model", str(tiny_copy(tmp, chat=True)))),
    "thinking": ((("--thinking", "on"),), lambda tmp: ("--model", str(tiny_copy(tmp, chat=True)))),
    "reward": ((("--reward", "exact"),), ()),  # (added to GRADED: the same weight each)
    "reward_weights": ((("--reward-weights", "1", "0.5"),), ("--reward", "exact")),
    "reward_model": ((("--reward-model", "tiny-rm"),), ()),
    "reward_model_weight": ((("--reward-model-weight", "0.5"),), ("--reward-model", "tiny-rm")),
    # sampling draws argmax(p / noise), so a nucleus that drops only the tail changes a sample only where the tail
    # token would have won: at 0.3 the tiny model's samples change (the training log-probs are the untruncated ones)
    "top_p": ((("--top-p", "0.3"),), ()),
    "entropy_coef": ((("--entropy-coef", "0.01"),), ()),
    "seed": ((("--seed", "1"),), ()),
    "lora_rank": ((("--lora-rank", "2"),), ()),
    # B = 0 at the first step, so only B's gradient, scaled by alpha / r, shows alpha
    "lora_alpha": ((("--lora-alpha", "1"),), ("--lora-rank", "2")),
    "lora_targets": ((("--lora-targets", "q_proj"),), ("--lora-rank", "2")),
    # a bf16 copy samples what float32 does on the tiny model (argmax(p / noise) is robust to its rounding) and a
    # recomputed pi_old is float32 either way: with --old-logp rollout, pi_old is the bf16 sampler's
    "rollout_dtype": ((BF16_ROLLOUT,), ("--old-logp", "rollout")),
    "old_logp": ((("--old-logp", "rollout"),), BF16_ROLLOUT),
    # a sequence's pi_old / mu under bf16 stays below the default cap 2 (mask would drop nothing): cap 1.001
    "is_correction": ((("--is-correction", "tis"), ("--is-correction", "mask")), (*BF16_ROLLOUT, "--is-cap", "1.001")),
    "is_cap": ((("--is-cap", "1.001"),), (*BF16_ROLLOUT, "--is-correction", "tis")),
    # the recipe (every script's)
    "steps": ((("--steps", "2"),), ()),
    "max_new_tokens": ((("--max-new-tokens", "3"),), ()),
    "temperature": ((("--temperature", "0.7"),), ()),
    "lr": ((("--lr", "1e-3"),), ()),
    "weight_decay": ((("--weight-decay", "0.1"),), ()),
    "max_grad_norm": ((("--max-grad-norm", "1e-4"),), ()),  # below any gradient norm of these runs: clipping acts
    "anneal_lr": ((("--no-anneal-lr",),), ("--steps", "2")),  # step 1's rate is --lr either way; step 2's is not
    "minibatches": ((("--minibatches", "1"),), ()),
    "epochs": ((("--epochs", "2"),), ()),
    # grouped scripts' own
    "filter_groups": ((("--filter-groups",),), ONE_GROUP),
    "max_sample_rounds": ((("--max-sample-rounds", "1"),), (*ONE_GROUP, "--filter-groups")),
    "mask_truncated": ((("--mask-truncated",),), ("--max-new-tokens", "2")),  # some rows cut at 2 tokens
    "routing_replay": ((("--routing-replay",),), ("--model", "tiny-moe")),
    # PPO's own
    # (none against the default 3 changes nothing here: no ratio of one step reaches 3); four minibatches, so that
    # a later one holds a token with A < 0 whose ratio has passed 1.001, whatever the minibatches' order
    "dual_clip": ((("--dual-clip", "1.001"),), ("--minibatches", "4")),
    "missing_eos_penalty": ((("--missing-eos-penalty", "1"),), ("--max-new-tokens", "2")),
    "cliprange_value": ((("--cliprange-value", "1e-4"),), ()),
}
# a clip range that changes which of the second minibatch's ratios are clipped: PPO's and GRPO's token ratios
# (default 0.2) leave 1e-4; GSPO's sequence ratios all leave its default (3e-4, 4e-4) already (after one update of
# the tiny model they are off 1 by 0.04 to 0.9), and a wide range takes some back
EPS = {("gspo", "eps_low"): "0.9", ("gspo", "eps_high"): "0.1"}

# The declared flags that one process can run: their value leaves the update bit-identical
NEUTRAL = {
    "out": ("--out", "OTHER"),  # also: the same run twice is bit-identical
    "eval_every": ("--eval-every", "1"),
    "eval_size": ("--eval-size", "3"),
    "eval_samples": ("--eval-samples", "2"),
    "trace_every": ("--trace-every", "1"),
    "trace_groups": ("--trace-groups", "1"),
    "overwrite": ("--overwrite",),
    "save_every": ("--save-every", "1"),
    "device": ("--device", "cpu"),
    "grad_checkpointing": ("--grad-checkpointing",),
}


# a chat template that, as Qwen3's, puts a system message first and reads enable_thinking (tiny's characters)
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if enable_thinking is defined and enable_thinking %}think: {% endif %}a: ")  # fmt: skip


def tiny_copy(folder, chat=False, noise=0.0):
    """The tiny checkpoint copied to `folder`: its tokenizer given CHAT_TEMPLATE, or its weights moved by `noise`."""
    from safetensors.torch import load_file, save_file

    path = folder / f"tiny-chat{chat}-noise{noise}"
    if not path.exists():
        shutil.copytree(common.tiny_checkpoint(), path)
    if chat:
        tok = common.load_tokenizer(str(path))
        tok.chat_template = CHAT_TEMPLATE
        tok.save_pretrained(path)
    if noise:
        weights = load_file(path / "model.safetensors")
        g = torch.Generator().manual_seed(0)
        save_file({k: w + noise * torch.randn(w.shape, generator=g) for k, w in weights.items()},
                  path / "model.safetensors", metadata={"format": "pt"})  # fmt: skip
    return path


def data_file(folder, name="train.jsonl", n=40):
    path = folder / name
    path.write_text("".join(json.dumps({"prompt": f"{i}+{i % 7}=", "answer": str(i + i % 7)}) + "\n" for i in range(n)))
    return path


def declared(module) -> dict:
    return {**common.NOT_IN_UPDATE, **getattr(module, "NOT_IN_UPDATE", {})}


def other_values(field, default, args_cls) -> list[tuple]:
    """Generic values other than `default` for a field CASES does not list (a fork's new flag)."""
    flag = "--" + field.name.replace("_", "-")
    choices = common._choices(typing.get_type_hints(args_cls)[field.name])  # a Literal[...] field's values
    if choices:
        return [(flag, str(c)) for c in choices if c != default]
    if isinstance(default, bool):
        return [(("--no-" + flag[2:]) if default else flag,)]
    if isinstance(default, (int, float)):
        return [(flag, str(type(default)(default * 2 if default else 1) if isinstance(default, int) else
                         (default / 2 if default else 0.1)))]  # fmt: skip
    raise AssertionError(f"{flag}: no generic other value for {default!r}; give one in test_flags_reach_update.CASES")


def cases(name):
    module = importlib.import_module(name)
    defaults = module.Args()
    for field in dataclasses.fields(module.Args):
        if field.name in declared(module):
            continue
        default = getattr(defaults, field.name)
        values, companions = CASES.get(field.name, (None, ()))
        if field.name in ("eps_low", "eps_high"):
            values = [("--" + field.name.replace("_", "-"), EPS.get((name, field.name), "1e-4"))]
            # a ratio below 1 where A < 0 (the lower clip's side): one step raises most sampled tokens' probability,
            # so it takes a second epoch over rows the first pushed down
            companions = ("--epochs", "2") if field.name == "eps_low" else ()
        elif field.name == "kl_coef":  # PPO's 0.1 off; GRPO's 0 on
            values = [("--kl-coef", "0" if default else "0.05")]
            # PPO's KL is in the reward, -beta (log pi_old - log ref): exactly 0 at step 1, where the policy is ref
            companions = ("--steps", "2") if name == "ppo" else ()
        elif field.name in ("prompts_per_step", "group_size"):
            batch = dict(zip(*[iter(BATCH.get(name, DEFAULT_BATCH))] * 2))
            values = [("--" + field.name.replace("_", "-"), str(2 * int(batch["--" + field.name.replace("_", "-")])))]
        elif values is None:
            values = other_values(field, default, module.Args)
        for value in values:
            yield pytest.param(name, field.name, value, companions, id=f"{name}-{field.name}-{value_id(value)}")


def value_id(value):
    return "callable" if callable(value) else "=".join(str(v).lstrip("-") for v in value)


ADAMW = torch.optim.AdamW  # (each run's recording subclass derives from it, not from the last run's)


class Fingerprint:
    """A digest of every AdamW step of a run: the gradients it is stepped with and the parameters after."""

    digests: list = []

    @classmethod
    def recording_adamw(cls):
        class RecordingAdamW(ADAMW):
            def step(self, closure=None):
                out = super().step(closure)  # (the gradient is still there after the step)
                h = hashlib.sha256()
                for group in self.param_groups:
                    for p in group["params"]:
                        for t in (p.grad, p):
                            if t is not None:
                                h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
                cls.digests.append(h.hexdigest())
                return out

        return RecordingAdamW


_BASELINES = {}  # (script, companions) -> the digests of a run at the default
_runs = []  # (each run its own --out)


def run_once(name, argv, tmp_path, monkeypatch) -> tuple:
    """The digests of every AdamW step of one run of script `name` with `argv` (after BASE)."""
    module = importlib.import_module(name)
    (tmp_path / "rows.py").write_text(ROW_REWARD)
    files = {"GRADED": graded_reward(tmp_path), "ROWS": f"{tmp_path / 'rows.py'}:rows"}
    base = BASE[:-2] if "ROWS" in argv else BASE  # (ONE_GROUP's reward alone)
    full = [files.get(a, a) for a in [*base, *BATCH.get(name, DEFAULT_BATCH), *argv]]
    if "--out" not in full:
        _runs.append(name)
        full += ["--out", str(tmp_path / f"out{len(_runs)}")]
    monkeypatch.setattr(torch.optim, "AdamW", Fingerprint.recording_adamw())
    Fingerprint.digests = []
    common.main(module.train, module.Args, argv=[str(a) for a in full])
    digests = tuple(Fingerprint.digests)
    assert digests, f"{name} {' '.join(map(str, argv))}: no optimizer step"
    return digests


def baseline(name, companions, tmp_path, monkeypatch):
    key = (name, companions)
    if key not in _BASELINES:
        _BASELINES[key] = run_once(name, list(companions), tmp_path, monkeypatch)
    return _BASELINES[key]


@pytest.mark.parametrize(("name", "field", "value", "companions"), [c for s in SCRIPTS for c in cases(s)])
def test_a_flag_set_changes_the_update(name, field, value, companions, tmp_path, monkeypatch):
    value = value(tmp_path) if callable(value) else value
    companions = tuple(companions(tmp_path) if callable(companions) else companions)
    if callable(CASES.get(field, (None, ()))[1]):  # a file the companion writes: the baseline is this test's own
        default = run_once(name, list(companions), tmp_path, monkeypatch)
    else:
        default = baseline(name, companions, tmp_path, monkeypatch)
    changed = run_once(name, [*companions, *value], tmp_path, monkeypatch)
    assert changed != default, (
        f"{name}.py {' '.join(value)} (beside {' '.join(companions) or 'the defaults'}): every gradient and weight "
        f"of the update is bit-identical to the default's, so train() never reads --{field.replace('_', '-')}. If it "
        f"cannot change one step, give it a companion in tests/test_flags_reach_update.py's CASES, or declare it in "
        f"{name}.py's NOT_IN_UPDATE with the reason"
    )


# --out for every script: the same run twice is bit-identical (what makes a changed digest mean a changed update);
# the other declared flags are read by shared code, each checked on one script, in turn
@pytest.mark.parametrize(
    ("name", "field"),
    [(name, "out") for name in SCRIPTS]
    + [(SCRIPTS[i % len(SCRIPTS)], field) for i, field in enumerate(sorted(set(NEUTRAL) - {"out"}))],
)
def test_a_flag_declared_outside_the_update_leaves_it_bit_identical(name, field, tmp_path, monkeypatch):
    module = importlib.import_module(name)
    assert field in declared(module), f"--{field} is checked as not touching the update but not declared so"
    value = [str(tmp_path / "other") if v == "OTHER" else v for v in NEUTRAL[field]]
    default = baseline(name, (), tmp_path, monkeypatch)
    assert run_once(name, value, tmp_path, monkeypatch) == default, f"{name}.py {' '.join(value)} changed the update"


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_declared_flag_is_a_field(name):
    module = importlib.import_module(name)
    fields = {f.name for f in dataclasses.fields(module.Args)}
    assert set(declared(module)) <= fields, set(declared(module)) - fields
    traits(name)  # (a script in SCRIPTS has its TRAITS line)
