"""tools/recipes.py: the recipes of the embedded checkpoints that ship in checkpoints/ (common.TINY_KEYS).

Each checkpoint's directory name is `checkpoint_key(name)`, a hash of everything its recipe depends on:
change a recipe here and rebuild (python tools/build_checkpoints.py NAME --into checkpoints --force),
then put the new key in common.TINY_KEYS; tests/test_common.py checks that the two agree. The runtime
never reads these: a run loads the shipped weights.
"""

import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py, when imported from tools/

from common import TINY_RM  # noqa: E402
from experiments.sums_task import SUMS_GENERATOR  # noqa: E402

PAD, EOS = "<|endoftext|>", "<|im_end|>"  # Qwen's own names: pad and EOS are different tokens

TINY_CHARS = [chr(c) for c in range(32, 127)] + ["\n"]  # printable ASCII and newline; others: <unk> (check_characters)

TINY_CONFIG = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
)

TINY_WARMSTART = dict(seed=0, max_steps=1500, batch=64, lr=2e-3, target_accuracy=0.2, probe_every=25, probe_size=256)

TINY_RECIPE_VERSION = 1

# tiny-moe: the same attention stack with every MLP a sparse MoE block (GSPO paper section 5.3):
# 8 experts, top-2, each expert half the dense MLP's width, so 2 active experts cost one dense MLP.
TINY_MOE_CONFIG = dict(
    TINY_CONFIG,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=192,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
    router_aux_loss_coef=0.0,
    output_router_logits=False,
)

TINY_SPECS = {  # name -> (cache-directory prefix, transformers class prefix, config)
    "tiny": ("tiny-qwen3", "Qwen3", TINY_CONFIG),
    "tiny-moe": ("tiny-qwen3moe", "Qwen3Moe", TINY_MOE_CONFIG),
    "tiny-sums": ("tiny-qwen3-sums", "Qwen3", TINY_CONFIG),  # the `sums` task's warm start (below)
}

# tiny-sums: the same model and recipe, started from tiny's weights (it can add already) and SFT on
# `sums` reference completions (working and answer) until a probe of training prompts reaches the
# target; the probe generates whole completions. Smaller batches at a higher rate: the build's
# cost is per token, and these completions are ten times arith's.
SUMS_WARMSTART = dict(
    TINY_WARMSTART, init="tiny", batch=32, lr=3e-3, max_steps=1200, target_accuracy=0.3, probe_size=128, probe_tokens=64
)

# tiny-rm: the tiny policy's trunk plus a scalar head, trained by Bradley-Terry on arithmetic preference
# pairs, some of them the policy's own wrong samples (tools/train_reward_model.py; --reward-model tiny-rm).

TINY_RM_RECIPE = dict(seed=0, prompts=3000, policy_prompts=500, policy_samples=4, steps=300, batch=32, lr=2e-3,
                      eval_frac=0.1, max_new_tokens=8)  # fmt: skip


def checkpoint_key(name: str) -> str:
    """The directory name of embedded checkpoint `name`: its prefix and a hash of everything its recipe
    depends on (config, warm-start recipe, vocabulary; tiny-sums: also the task's generator and the tiny
    checkpoint it starts from; tiny-rm: its recipe and that tiny checkpoint). A changed recipe is a new
    key, so a stale checkpoint is never reused."""
    if name == TINY_RM:
        prefix, parts = TINY_RM, [TINY_RM_RECIPE, checkpoint_key("tiny")]
    else:
        prefix, _, config = TINY_SPECS[name]
        parts = [config, TINY_WARMSTART, TINY_CHARS, TINY_RECIPE_VERSION]
        if name == "tiny-sums":
            parts = [config, SUMS_WARMSTART, TINY_CHARS, TINY_RECIPE_VERSION, SUMS_GENERATOR, checkpoint_key("tiny")]
    recipe = json.dumps(parts, sort_keys=True)
    return f"{prefix}-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"
