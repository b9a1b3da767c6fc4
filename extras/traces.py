"""extras/traces.py: --trace-every, every token of a few groups as sampled, scored and updated (docs/traces.md):
one Trace a traced step, written to OUT/traces.jsonl by common.log_step (drawn by tools/show_traces.py)."""

from __future__ import annotations

import torch

from common import completion_ends


def _values(x: torch.Tensor | None, n: int):
    """The first n values of a 1-d tensor as a list (floats to 8 significant digits), or None."""
    if x is None or x.dtype == torch.bool:
        return None if x is None else x[:n].tolist()
    return [float(f"{v:.8g}") for v in x[:n].tolist()]


def groups_with_signal(advantages: torch.Tensor, mask: torch.Tensor, group_size: int) -> list[bool]:
    """Per group of `group_size` consecutive rows: whether some row has a nonzero advantage on some token (the
    group's gradient can be nonzero): rewards not all equal (GRPO, GSPO), or some nonzero GAE ([B, T], PPO)."""
    nonzero = advantages != 0 if advantages.dim() == 1 else ((advantages != 0) & mask.bool()).any(1)  # [B]
    return nonzero.view(-1, group_size).any(1).tolist()


def traced_groups(signal: list[bool], n: int, seed: int, step: int) -> list[int]:
    """The n groups a step's trace keeps (in rollout order): a random order of all groups, those with signal first,
    from a generator of its own seeded by --seed and the step, so that training's random streams never move."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + 17)  # CPU, not the global one
    order = torch.randperm(len(signal), generator=generator).tolist()
    ranked = sorted(order, key=lambda g: not signal[g])  # stable: those with signal first, in draw order
    return sorted(ranked[:n])


class Trace:
    """One step's values for --trace-groups groups of this rank's rollout: what sampling, scoring and the no-grad
    passes computed, and what each update's loss used (`update`); `records()`: traces.jsonl's, one per group. It
    computes nothing: old_logp is the script's pi_old of every row."""

    def __init__(self, args, tok, eos_ids, step, roll, records, rewards, parts, advantages, old_logp, per_token):
        self.args, self.tok, self.eos_ids, self.step, self.roll, self.examples = args, tok, eos_ids, step, roll, records
        self.rewards, self.parts, self.advantages, self.per_token = rewards, parts, advantages, per_token
        G = args.group_size
        self.signal = groups_with_signal(advantages, roll.completion_mask, G)  # [groups of this rank]
        self.groups = traced_groups(self.signal, args.trace_groups, args.seed, step)
        self.rows = [g * G + i for g in self.groups for i in range(G)]  # the traced rows, in rollout order
        self.old_logp = old_logp[self.rows].detach().clone()  # [n, T], n = len(self.rows)
        self.updates = []  # per update: (rows [b], logp [b, T], entropy [b, T] or None, the loss's dict)

    def update(self, rows, logp, entropy, info: dict, on_policy: bool = False):
        """An update's forwarded rows [b], log-probs and entropy [b, T], its loss's `info` ("ratio" and "clipped",
        [b, T] or [b] for a sequence ratio, are kept) and `on_policy`, as the script marked it."""
        detached = lambda x: None if x is None else x.detach()  # noqa: E731
        kept = {k: info.get(k) for k in ("ratio", "clipped")}
        self.updates.append((rows, logp.detach(), detached(entropy), kept, bool(on_policy)))

    def _update_entries(self, lengths: list[int]) -> dict:
        """row -> one entry per update that forwarded it (in update order), or None if none did."""
        per_row = {r: [] for r in self.rows}
        for k, (rows, logp, entropy, filled, on_policy) in enumerate(self.updates):
            ratio, clipped = filled.get("ratio"), filled.get("clipped")
            if ratio is not None and ratio.dim() == 1:  # GSPO's sequence ratio: every token gets its row's
                ratio, clipped = ratio[:, None].expand_as(logp), clipped[:, None].expand_as(logp)
            values = {"logp": logp, "ratio": ratio, "clipped": clipped, "entropy": entropy}  # [b, T] or None
            for pos, r in enumerate(rows.tolist()):
                if r in per_row:
                    row = {name: _values(None if x is None else x[pos], lengths[r]) for name, x in values.items()}
                    per_row[r].append({"update": k, "on_policy": on_policy, **row})
        return {r: entries or None for r, entries in per_row.items()}

    def records(self) -> list[dict]:
        args, tok, roll = self.args, self.tok, self.roll
        ends = completion_ends(roll, self.eos_ids).tolist()
        lengths = roll.completion_mask.sum(1).long().tolist()
        T = roll.completion_ids.shape[1]
        updates = self._update_entries(lengths)
        components = {k.removeprefix("reward/"): v for k, v in self.parts.items() if k.startswith("reward/")}
        completions = {}
        for k, r in enumerate(self.rows):
            n, ids = lengths[r], roll.completion_ids[r, : lengths[r]].tolist()
            adv = self.advantages[r]  # [] or, for PPO, [T]
            completions[r] = {
                "row": r,
                "ids": ids,
                "tokens": [tok.decode([i]) for i in ids],
                "pad": T - n,  # padding after the completion (its EOS token is in ids)
                "text": tok.decode(ids, skip_special_tokens=True),
                "eos": bool(ends[r]),
                "reward": float(self.rewards[r]),
                "rewards": {name: float(v[r]) for name, v in components.items()},
                "advantage": _values(adv, n) if adv.dim() else float(adv),
                "old_logp": _values(self.old_logp[k], n),
                "mu": _values(roll.sample_logp[r], n) if roll.sample_logp is not None else None,  # the sampler's
                "entropy": _values(None if roll.entropy is None else roll.entropy[r], n),
                **{name: _values(None if v is None else v[r], n) for name, v in self.per_token.items()},
                "updates": updates[r],
            }
        eps = [getattr(args, "eps_low", None), getattr(args, "eps_high", None)]
        clip_range = None if None in eps else [1 - eps[0], 1 + eps[1]]
        out = []
        for g in self.groups:
            first = g * args.group_size
            prompt = roll.prompt_ids[first][roll.prompt_mask[first].bool()].tolist()
            out.append(
                {
                    "step": self.step,
                    "algo": args.algo,
                    "group": g,
                    "signal": self.signal[g],
                    "groups_in_step": len(self.signal),  # this rank's groups, and how many had signal
                    "groups_with_signal": sum(self.signal),
                    "clip_range": clip_range,  # the ratio's band [1 - eps_low, 1 + eps_high]
                    "prompt": {
                        "text": self.examples[first]["prompt"],
                        "ids": prompt,
                        "tokens": [tok.decode([i]) for i in prompt],
                        "pad": roll.prompt_ids.shape[1] - len(prompt),  # left padding before it
                    },
                    "answer": self.examples[first].get("answer"),
                    "updates_planned": args.epochs * args.minibatches,
                    "completions": [completions[first + i] for i in range(args.group_size)],
                }
            )
        return out
