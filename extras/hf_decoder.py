"""extras/hf_decoder.py: sampling a causal LM that common._StaticKVDecoder does not take (e.g. tiny-moe): the model's
own forward with a DynamicCache, no row dropping."""

from __future__ import annotations

import torch.nn.functional as F

from common import Rollout


class HFDecoder:
    def __init__(self, model, roll: Rollout, max_new_tokens: int):
        from transformers import DynamicCache

        self.model, self.prompt_ids = model, roll.prompt_ids
        self.attn = F.pad(roll.prompt_mask, (0, max_new_tokens), value=1)
        self.positions = (self.attn.cumsum(1) - 1).clamp(min=0)  # RoPE positions that skip left padding
        self.cache = DynamicCache(config=model.config)
        self.n = roll.prompt_ids.shape[1]  # tokens in the cache after prefill

    def _forward(self, ids, start):
        out = self.model(input_ids=ids, attention_mask=self.attn[:, : self.n], past_key_values=self.cache,
                         position_ids=self.positions[:, start : self.n], use_cache=True, logits_to_keep=1)  # fmt: skip
        return out.logits[:, -1].float()

    def prefill(self):
        return self._forward(self.prompt_ids, 0)

    def step(self, token):
        self.n += 1
        return self._forward(token[:, None], self.n - 1)
