"""PPO where the pad id is an EOS id (Qwen3): through train(), a completion ending with it has ended, its score
and value land on that token (a mask `completion_ids != pad_id` would put them one token early)."""

import pytest
import torch
from helpers import main_in_process
from test_pi_old import TINY_BATCH

import common
import ppo

PAD = 0  # the tiny tokenizer's pad id (<|endoftext|>), made an EOS id too below, as Qwen3's generation config has it
PENALTY = 0.5


def test_a_completion_ending_with_the_pad_id_eos_gets_its_score_and_value_on_that_token(tmp_path, monkeypatch,
                                                                                        capsys):  # fmt: skip
    eos_ids = common.eos_token_ids
    monkeypatch.setattr(common, "eos_token_ids", lambda model, tok: sorted({*eos_ids(model, tok), PAD}))
    sample, seen = common.Sampler.sample, {}

    def ending_some_rows_with_the_pad_id(self, prompts, generator):
        """The sampled rollout, with rows 0-3 ended by the pad id after 1, 2, 3 and 1 tokens (as the sampler
        records an EOS: inside the mask, padding after it)."""
        roll = sample(self, prompts, generator)
        seen["eos_ids"] = self.eos_ids
        T = max(roll.completion_ids.shape[1], 4)
        ids = torch.nn.functional.pad(roll.completion_ids, (0, T - roll.completion_ids.shape[1]), value=PAD)
        mask = torch.nn.functional.pad(roll.completion_mask, (0, T - roll.completion_mask.shape[1]))
        for row, n in enumerate((1, 2, 3, 1)):
            ids[row, n - 1], ids[row, n:], mask[row, :n], mask[row, n:] = PAD, PAD, 1, 0
        roll.completion_ids, roll.completion_mask, roll.entropy = ids, mask, torch.zeros_like(mask)
        seen["roll"] = roll
        return roll

    def recording(name, fn):
        def record(*args, **kwargs):
            out = fn(*args, **kwargs)
            seen[name] = (args, out)
            return out

        return record

    monkeypatch.setattr(common.Sampler, "sample", ending_some_rows_with_the_pad_id)
    monkeypatch.setattr(ppo, "token_rewards", recording("token_rewards", ppo.token_rewards))
    monkeypatch.setattr(ppo, "gae", recording("gae", ppo.gae))
    argv = [*TINY_BATCH, "--prompts-per-step", "8", "--group-size", "1", "--missing-eos-penalty", str(PENALTY),
            "--out", tmp_path / "out"]  # fmt: skip
    status, _, err = main_in_process(ppo, argv, capsys)
    assert status == 0, err

    roll = seen["roll"]
    (scores, old_logp, ref_logp, mask, kl_coef), rewards = seen["token_rewards"]
    assert torch.equal(mask, roll.completion_mask)  # the sampler's mask, EOS inside, not one rebuilt from the ids
    assert PAD in seen["eos_ids"] and len(seen["eos_ids"]) > 1
    ends = common.completion_ends(roll, seen["eos_ids"])
    assert ends[:4].all(), "a completion ending with the pad id (an EOS id) counts as ended"
    kl_part = torch.zeros_like(rewards) if ref_logp is None else -kl_coef * (old_logp - ref_logp) * mask
    (_, values, gae_mask, *_), (advantages, returns) = seen["gae"]
    for row, n in enumerate((1, 2, 3, 1)):
        eos_at = n - 1
        assert roll.completion_ids[row, eos_at] == PAD and mask[row, eos_at] == 1 and mask[row, n:].sum() == 0
        score = rewards[row, eos_at] - kl_part[row, eos_at]
        assert score.item() == pytest.approx(scores[row].item(), abs=1e-6), f"row {row}: the score is not on its EOS"
        assert gae_mask[row, eos_at] == 1
        # the last real token: the return is its reward (gamma V after it is 0), the advantage that minus its value
        assert returns[row, eos_at].item() == pytest.approx(rewards[row, eos_at].item(), abs=1e-6)
        assert advantages[row, eos_at].item() == pytest.approx((rewards[row, eos_at] - values[row, eos_at]).item(),
                                                               abs=1e-6)  # fmt: skip
    # no missing-EOS penalty on those rows: each score is its reward (0 or 1 here), never reward - PENALTY
    assert all(float(s) in (0.0, 1.0) for s in scores[:4]), scores[:4]
