"""extras/traces.py: --trace-every, every token of a few groups as sampled, scored and updated (docs/traces.md).

Imported by common.Run on a traced step. The Run feeds it: `Run.rollout` starts a Trace with what sampling,
scoring and the no-grad passes computed, `Run.update` adds what each update's loss saw (its `info`: the
ratio and the clip decisions), `Run.log` writes the records to OUT/traces.jsonl. The loss functions know
nothing of it. tools/show_traces.py draws the page.
"""

from __future__ import annotations

import torch

from common import Rollout, completion_ends, completion_logprobs, eos_token_ids, forwarded_rows, sharded


def _values(x: torch.Tensor | None, n: int):
    """The first n values of a 1-d tensor as a list (floats to 8 significant digits), or None."""
    if x is None or x.dtype == torch.bool:
        return None if x is None else x[:n].tolist()
    return [float(f"{v:.8g}") for v in x[:n].tolist()]


def traced_forward(run, roll: Rollout) -> torch.Tensor:
    """[b, T] the policy's log-probs of `roll` for a trace, without gradient. Under --fsdp the forward is
    a collective: on a traced step every rank runs one (Run.trace), rank 0 for its trace."""
    with torch.no_grad():
        return completion_logprobs(run.model, roll, run.args.temperature)[0]


class Trace:
    """One step's values for the rollout's first --trace-groups groups (rows 0 .. n * G - 1 of
    this rank's rollout): what sampling, scoring and the no-grad passes computed, given to the
    constructor, and what each update's loss used (`update`); `records()` makes traces.jsonl's records,
    one per group.
    The only computation is a no-grad forward of traced rows that no update forwards (their pi_old
    was never needed); no random stream moves, and the updates see the same tensors as untraced."""

    def __init__(self, run, step, roll, records, rewards, parts, advantages, old_logp, plan, per_token):
        self.run, self.step, self.roll, self.examples = run, step, roll, records
        self.rewards, self.parts, self.advantages, self.per_token = rewards, parts, advantages, per_token
        self.rows = list(range(min(len(roll), run.args.trace_groups * run.args.group_size)))  # the traced rows
        forwarded = set(forwarded_rows(plan, len(roll), roll.completion_ids.device).nonzero().squeeze(1).tolist())
        self.old_logp = old_logp[: len(self.rows)].detach().clone()  # [n, T]
        skipped = [r for r in self.rows if r not in forwarded]
        if skipped or sharded(run.model):  # their pi_old: old_logp holds 0 there (--fsdp: a forward on every rank)
            self.old_logp[skipped] = traced_forward(run, roll[skipped or self.rows[:1]])[: len(skipped)]
        self.updates = []  # per update: (rows [b], logp [b, T], entropy [b, T] or None, the loss's dict)

    def update(self, rows, logp, entropy, info: dict):
        """An update's forwarded rows [b], its log-probs and entropy [b, T], and its loss's `info`, whose
        "ratio" and "clipped" ([b, T], or [b] for a sequence ratio) the trace keeps."""
        detached = lambda x: None if x is None else x.detach()  # noqa: E731
        self.updates.append((rows, logp.detach(), detached(entropy), {k: info.get(k) for k in ("ratio", "clipped")}))

    def _update_entries(self, lengths: list[int]) -> dict:
        """row -> one entry per update that forwarded it (in update order), or None if none did."""
        per_row = {r: [] for r in self.rows}
        for k, (rows, logp, entropy, filled) in enumerate(self.updates):
            ratio, clipped = filled.get("ratio"), filled.get("clipped")
            if ratio is not None and ratio.dim() == 1:  # GSPO's sequence ratio: every token gets its row's
                ratio, clipped = ratio[:, None].expand_as(logp), clipped[:, None].expand_as(logp)
            values = {"logp": logp, "ratio": ratio, "clipped": clipped, "entropy": entropy}  # [b, T] or None
            for pos, r in enumerate(rows.tolist()):
                if r in per_row:
                    row = {name: _values(None if x is None else x[pos], lengths[r]) for name, x in values.items()}
                    per_row[r].append({"update": k, **row})
        return {r: entries or None for r, entries in per_row.items()}

    def records(self) -> list[dict]:
        args, tok, roll = self.run.args, self.run.tok, self.roll
        ends = completion_ends(roll, eos_token_ids(self.run.model, tok)).tolist()
        lengths = roll.completion_mask.sum(1).long().tolist()
        T = roll.completion_ids.shape[1]
        updates = self._update_entries(lengths)
        components = {k.removeprefix("reward/"): v for k, v in self.parts.items() if k.startswith("reward/")}
        completions = []
        for r in self.rows:
            n, ids = lengths[r], roll.completion_ids[r, : lengths[r]].tolist()
            adv = self.advantages[r]  # [] or, for PPO, [T]
            completions.append(
                {
                    "row": r,
                    "ids": ids,
                    "tokens": [tok.decode([i]) for i in ids],
                    "pad": T - n,  # padding after the completion (its EOS token is in ids)
                    "text": tok.decode(ids, skip_special_tokens=True),
                    "eos": bool(ends[r]),
                    "reward": float(self.rewards[r]),
                    "rewards": {name: float(v[r]) for name, v in components.items()},
                    "advantage": _values(adv, n) if adv.dim() else float(adv),
                    "old_logp": _values(self.old_logp[r], n),
                    "mu": _values(roll.sample_logp[r], n) if roll.sample_logp is not None else None,  # the sampler's
                    "entropy": _values(None if roll.entropy is None else roll.entropy[r], n),
                    **{name: _values(None if v is None else v[r], n) for name, v in self.per_token.items()},
                    "updates": updates[r],
                }
            )
        out = []
        for g in range(0, len(self.rows), args.group_size):
            prompt = roll.prompt_ids[g][roll.prompt_mask[g].bool()].tolist()
            out.append(
                {
                    "step": self.step,
                    "algo": self.run.algo,
                    "group": g // args.group_size,
                    "prompt": {
                        "text": self.examples[g]["prompt"],
                        "ids": prompt,
                        "tokens": [tok.decode([i]) for i in prompt],
                        "pad": roll.prompt_ids.shape[1] - len(prompt),  # left padding before it
                    },
                    "answer": self.examples[g].get("answer"),
                    "updates_planned": args.epochs * args.minibatches,
                    "completions": completions[g : g + args.group_size],
                }
            )
        return out
