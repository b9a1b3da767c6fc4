"""How the sampler should see LoRA adapters: read through them, or merge them before each rollout.

    python benchmarks/lora.py            (a few minutes on 2 CPU cores; not a test)

read-through  what common.sample does: the fused q/k/v and gate/up copies it makes per call are
              built from W + (alpha / r) B A, and o_proj / down_proj run as peft's modules
              (W x + scale B A x: two extra small matmuls each)
merge         peft's merge_adapter() before the rollout and unmerge_adapter() after it, so every
              projection is one plain matmul; it writes every frozen weight twice per rollout, and
              W + D - D need not round back to W in float32 (printed: the largest change of a
              base weight after 100 merge / unmerge cycles)

Both are timed on the embedded tiny Qwen3 and a wider random Qwen3, at gspo.py's rollout shape
(64 prompts x 4 samples x 8 new tokens), with adapters made non-zero, median of REPEATS calls.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # recipes.py

import recipes  # noqa: E402  (tools/recipes.py: the tiny model's shape)

import common  # noqa: E402

REPEATS = 7


def lora_policy(model, rank=8):
    args = SimpleNamespace(lora_rank=rank, lora_alpha=None, lora_targets=common.LORA_TARGETS)
    model = common.add_lora(model, args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)  # peft starts B at 0: a zero adapter would hide a sampler that ignores it
    return model.eval()


def timed(fn) -> float:
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench(name, model, tok):
    prompts = [tok(f"{a}+{b}=")["input_ids"] for a, b in zip(range(10, 74), range(30, 94)) for _ in range(4)]
    eos = common.eos_token_ids(model, tok)

    def sample(m):
        return common.sample(m, prompts, 8, eos, tok.pad_token_id, generator=torch.Generator().manual_seed(0))

    def merged():
        model.merge_adapter()
        try:
            return sample(model.get_base_model())
        finally:
            model.unmerge_adapter()

    base = model.get_base_model()
    with model.disable_adapter():
        t_base = timed(lambda: sample(base))
    t_read, t_merge = timed(lambda: sample(model)), timed(merged)
    q = base.model.layers[0].self_attn.q_proj.base_layer.weight
    before = q.detach().clone()
    for _ in range(100):
        model.merge_adapter()
        model.unmerge_adapter()
    drift = (q.detach() - before).abs().max().item()
    with torch.no_grad():
        q.copy_(before)
    print(f"{name:28s} base (no adapters) {t_base * 1e3:7.1f} ms   read-through {t_read * 1e3:7.1f} ms   "
          f"merge + unmerge {t_merge * 1e3:7.1f} ms   base drift after 100 merges {drift:.1e}")  # fmt: skip


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, tok = common.load_model("tiny", torch.device("cpu"))
    bench("tiny Qwen3 (hidden 128)", lora_policy(model), tok)
    import transformers

    config = transformers.Qwen3Config(
        **{**recipes.TINY_CONFIG, "hidden_size": 512, "intermediate_size": 1536, "num_attention_heads": 8,
           "num_key_value_heads": 4, "head_dim": 64, "num_hidden_layers": 8},
        vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    wide = transformers.Qwen3ForCausalLM(config).eval()
    bench("random Qwen3 (hidden 512)", lora_policy(wide), tok)


if __name__ == "__main__":
    main()
