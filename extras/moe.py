"""extras/moe.py: Mixture-of-Experts routing, recorded and replayed (GSPO paper section 5.3), and its drift. Imported
for a model with sparse MoE blocks (--model tiny-moe; common.routing): each token's experts recorded in the pi_old
forward (Rollout.experts), routing_drift logged, and replayed in every update under grpo.py's --routing-replay."""

from __future__ import annotations

import contextlib
import functools

import torch

from common import Rollout, completion_logprobs


class RoutingReplay:
    """Record and replay the experts an MoE model routes each position to (Routing Replay), through hooks on every
    sparse MoE block (a module with `.gate` and `.experts`, as Qwen3MoeSparseMoeBlock, whose router returns (logits
    [N, E], top-k weights [N, k], top-k ids [N, k]) for N = B * S positions), only inside `record()` / `replay()`.
    record(): afterwards `self.indices` [layers, B, S, k] holds the ids each router chose in the last forward.
    replay(indices, rows=None): each router returns the recorded ids in place of its own top-k; the weights are the
    current router's softmax gathered at them (renormalised under norm_topk_prob), so gradients reach the recorded
    experts and the router as in a plain forward, which a replay with unchanged weights equals."""

    def __init__(self, model):
        self.blocks = [m for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]
        self.indices, self._shape, self._layers = None, None, None

    @contextlib.contextmanager
    def recording(self, roll: Rollout):
        """common.recording_experts: record the block's forward of `roll` into `roll.experts`."""
        with self.record():
            yield
        roll.experts = self.indices

    def drift(self, model, roll: Rollout, temperature: float = 1.0) -> dict:
        """{"routing_drift": `routing_drift` of `roll.experts` and `model` now}, at the cost of one forward; {}
        without a record (--old-logp rollout runs no pi_old forward)."""
        before = roll.experts
        if not self.blocks or before is None:
            return {}
        with torch.no_grad(), self.record():
            completion_logprobs(model, roll, temperature)
        return {"routing_drift": routing_drift(before, self.indices, roll.completion_mask)}

    @contextlib.contextmanager
    def _hooked(self, router_hook):
        handles = []
        for layer, block in enumerate(self.blocks):
            handles.append(block.register_forward_pre_hook(self._note_shape))
            handles.append(block.gate.register_forward_hook(functools.partial(router_hook, layer)))
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def _note_shape(self, block, inputs):
        self._shape = inputs[0].shape[:-1]  # (B, S): the router sees them flattened

    @contextlib.contextmanager
    def record(self):
        self._layers = [None] * len(self.blocks)
        with self._hooked(self._record_hook):
            yield self
        # None unless a forward ran inside the block (--old-logp rollout runs none before the updates)
        ran = self.blocks and all(x is not None for x in self._layers)
        self.indices = torch.stack(self._layers) if ran else None

    @staticmethod
    def _check(router, output):
        if not (isinstance(output, tuple) and len(output) == 3):
            raise TypeError(f"routing replay: {type(router).__name__} does not return (logits, weights, expert ids) "
                            "as Qwen3-MoE's router does")  # fmt: skip

    def _record_hook(self, layer, router, inputs, output):
        self._check(router, output)
        self._layers[layer] = output[2].detach().view(*self._shape, -1)

    @contextlib.contextmanager
    def replay(self, indices, rows=None):  # indices None: a plain forward (replay off)
        if indices is None:
            yield self
            return
        self._layers = indices if rows is None else indices[:, rows]
        with self._hooked(self._replay_hook):
            yield self

    def _replay_hook(self, layer, router, inputs, output):
        self._check(router, output)
        logits, ids = output[0], self._layers[layer].reshape(-1, self._layers.shape[-1])  # [N, E], [N, k]
        if ids.shape[0] != logits.shape[0]:
            raise ValueError(f"routing replay: {ids.shape[0]} recorded positions, the forward has {logits.shape[0]}")
        weights = logits.float().softmax(-1).gather(-1, ids)  # the router's own arithmetic, recorded ids
        if getattr(router, "norm_topk_prob", False):
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights.to(logits.dtype), ids


def routing_drift(indices_a: torch.Tensor, indices_b: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """Fraction of (position, layer) pairs whose *set* of top-k experts differs between two routings [layers, B, S,
    k] of a batch; with `mask` [B, T] (a completion mask) only real completion tokens count: the last T positions."""
    differ = (indices_a.sort(-1).values != indices_b.sort(-1).values).any(-1).float()  # [layers, B, S]
    if mask is None:
        return differ.mean().item()
    differ = differ[..., -mask.shape[-1] :]
    m = mask.to(differ.dtype)[None].expand_as(differ)
    return ((differ * m).sum() / m.sum().clamp(min=1)).item()
