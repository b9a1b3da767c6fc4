"""Each grouped script's group_advantages against a float64 loop; a constant group exactly 0; a group of one refused."""

import importlib
import math

import pytest
import torch
from helpers import (
    F64,
    LIGHT,
    SCRIPTS,
    float32_round,
    group_advantage_tol,
    group_mean_std,
    loop_group_advantages,
    traits,
)
from hypothesis import given
from hypothesis import strategies as st

GROUPED = [name for name in SCRIPTS if traits(name).grouped]
SCALES = ("std", "none")
REWARD = st.one_of(st.sampled_from([0.0, 1.0]), st.floats(-10, 10, allow_nan=False).map(lambda x: round(x, 2)))


def advantages(name):
    return importlib.import_module(name).group_advantages


@pytest.mark.numeric
@pytest.mark.parametrize("name", GROUPED)
@LIGHT
@given(st.integers(2, 6), st.integers(1, 4), st.sampled_from(SCALES), st.data())
def test_group_advantages_match_loop(name, G, n_groups, scale, data):
    rewards = data.draw(st.lists(REWARD, min_size=G * n_groups, max_size=G * n_groups))
    adv = advantages(name)(torch.tensor(rewards), G, scale=scale)
    assert adv.shape == (G * n_groups,)
    r32 = float32_round(rewards)
    expected = loop_group_advantages(r32, G, scale=scale)
    for g, (mean, std) in enumerate(group_mean_std(adv.double().tolist(), G)):
        grp = r32[g * G : (g + 1) * G]
        got = adv[g * G : (g + 1) * G]
        if all(x == grp[0] for x in grp):
            assert torch.equal(got, torch.zeros(G))  # exact zero, not residue / eps
            continue
        rstd = torch.tensor(grp, dtype=F64).std().item()
        tol = group_advantage_tol(grp, scale)  # float32 against float64 (helpers)
        for x, e in zip(got.tolist(), expected[g * G : (g + 1) * G]):
            assert x == pytest.approx(e, abs=tol)
        assert mean == pytest.approx(0.0, abs=tol)  # the exact advantages' mean is 0
        # a std moves by <= sqrt(2) max|d adv|; the exact one is rstd / (rstd + eps) under "std", 1 up to eps
        if scale == "std":
            assert std == pytest.approx(rstd / (rstd + 1e-6), abs=math.sqrt(2) * tol)
            assert std == pytest.approx(1.0, abs=math.sqrt(2) * tol + 1e-6 / rstd)
        else:
            assert std == pytest.approx(rstd, abs=math.sqrt(2) * tol)


@pytest.mark.parametrize("name", GROUPED)
@pytest.mark.parametrize(
    "rewards, scale, expected",
    [
        ([1.0, 0.0, 0.0, 0.0], "std", [1.5, -0.5, -0.5, -0.5]),
        ([1.0, 0.0, 0.0, 0.0], "none", [0.75, -0.25, -0.25, -0.25]),
        ([0.0, 1.0, 1.0, 0.0], "std", [-math.sqrt(3) / 2, math.sqrt(3) / 2, math.sqrt(3) / 2, -math.sqrt(3) / 2]),
    ],
)
def test_group_advantages_hand_cases(name, rewards, scale, expected):
    got = advantages(name)(torch.tensor(rewards), 4, scale=scale).tolist()
    std = torch.tensor(rewards, dtype=F64).std().item()
    shrink = std / (std + 1e-6) if scale == "std" else 1.0  # eps = 1e-6 beside the std
    for g, e in zip(got, expected):  # float32 (helpers.group_advantage_tol)
        assert g == pytest.approx(e * shrink, abs=group_advantage_tol(float32_round(rewards), scale))


CONSTANT_VALUES = [0.1, 0.3, 0.7, 1 / 3, 2.2, 1e-3, 0.0, 1.0, -0.6]


@pytest.mark.parametrize("name", GROUPED)
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("G", [3, 5, 7, 8])
def test_group_advantages_exactly_zero_for_constant_groups(name, G, scale):
    rewards = []
    for v in CONSTANT_VALUES:
        rewards += [v] * G + [1.0] + [0.0] * (G - 1)
    adv = advantages(name)(torch.tensor(rewards), G, scale=scale).view(-1, G)
    for k in range(len(CONSTANT_VALUES)):
        assert torch.equal(adv[2 * k], torch.zeros(G)), (CONSTANT_VALUES[k], adv[2 * k].tolist())
        assert adv[2 * k + 1, 0].item() > 0  # the non-constant neighbour is untouched


def test_constant_groups_are_a_real_trap():
    """The exact-zero test above can fail: without the exact-zero rule, float32 leaves residue in R - mean (and so
    in the z-score) for some of those constant groups (NeMo-RL #4158)."""
    residue = False
    for G in (3, 5, 7, 8):
        for v in CONSTANT_VALUES:
            r = torch.full((G,), v, dtype=torch.float32)
            residue |= bool((r - r.mean()).ne(0).any())
    assert residue


@pytest.mark.parametrize("name", GROUPED)
def test_group_advantages_refuse_a_group_of_one_and_an_unknown_scale(name):
    """A completion alone is its own baseline: every advantage 0, silently, and nothing trains. The command line
    refuses --group-size 1; the function, which a fork may call with a group size of its own, refuses it too."""
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        advantages(name)(torch.tensor([1.0, 0.0, 0.5]), 1)
    assert advantages(name)(torch.tensor([1.0, 0.0]), 2).abs().min() > 0  # G = 2 still works
    with pytest.raises(ValueError):
        advantages(name)(torch.tensor([1.0, 0.0]), 2, scale="mad")
