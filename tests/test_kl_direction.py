"""Which divergence grpo.py's k3 term optimises, by exact enumeration in float64: its value averaged over y ~ pi is
KL(pi || ref), and its gradient as a loss, sum_y (pi - ref)(y) grad log pi(y), is grad KL(ref || pi)."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_within, gamma

import grpo

pytestmark = pytest.mark.numeric

K = 6


def policy_and_reference(seed):
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(K, generator=g, dtype=torch.float64).requires_grad_(True)
    ref_logp = torch.randn(K, generator=g, dtype=torch.float64).log_softmax(-1)
    return theta, ref_logp


@pytest.mark.parametrize("seed", range(5))
def test_k3_value_estimates_kl_pi_ref_and_its_gradient_is_that_of_kl_ref_pi(seed):
    theta, ref_logp = policy_and_reference(seed)
    logp = theta.log_softmax(-1)  # [K]
    pi = logp.exp()
    k3 = grpo.kl_k3(logp[None], ref_logp[None])[0]  # [K], one "token" per outcome

    # the value: E_pi[k3] = KL(pi || ref), exactly
    kl_pi_ref = (pi * (logp - ref_logp)).sum()
    kl_ref_pi = (ref_logp.exp() * (ref_logp - logp)).sum()
    # float64, a few dozen operations on K terms each of size <= `size` (gamma of them, relative to that size)
    size = ((ref_logp - logp).exp().max() + (ref_logp - logp).abs().max() + 1).item()
    assert_within((pi * k3).sum().detach(), kl_pi_ref.detach(), gamma(8 * K) * size, "E_pi[k3] against KL(pi || ref)")

    # the gradient as a loss term: the outcomes' weights are the sampling distribution, not differentiated
    (k3_grad,) = torch.autograd.grad((pi.detach() * k3).sum(), theta, retain_graph=True)
    (grad_ref_pi,) = torch.autograd.grad(kl_ref_pi, theta, retain_graph=True)
    (grad_pi_ref,) = torch.autograd.grad(kl_pi_ref, theta)
    assert_within(k3_grad, grad_ref_pi, gamma(8 * K) * size, "the k3 term's gradient against grad KL(ref || pi)")
    assert (k3_grad - grad_pi_ref).abs().max() > 1e3 * gamma(8 * K) * size  # not the other direction's, by far
