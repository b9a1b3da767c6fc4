"""Shared fixtures: the root, tools/ and experiments/ on sys.path; the tiny checkpoint; the char tokenizer."""

import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import settings

ROOT = Path(__file__).resolve().parents[1]
for folder in (ROOT, ROOT / "tools", ROOT / "experiments"):  # the tests of the tools and experiments import them
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from helpers import in_ci  # noqa: E402

import common  # noqa: E402

# The models under test are tiny: intra-op threads only add synchronisation, and on a shared 2-core
# machine two threads contending with other jobs made a 10-token sample ~100x slower (5 s vs 0.05 s).
torch.set_num_threads(int(os.environ.get("RLREF_TEST_THREADS", "1")))

# Hypothesis profiles (issue 48): under CI every property draws the same examples (derandomize), so a red run can be
# replayed (HYPOTHESIS_PROFILE=ci); locally ("dev") each run draws anew.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if in_ci() else "dev"))


@pytest.fixture(scope="session")
def tiny_path() -> str:
    """The warm-started tiny checkpoint (built once, about a minute on 2 cores, then cached)."""
    return common.tiny_checkpoint()


@pytest.fixture(scope="session")
def char_tok():
    import build_checkpoints  # here, not at the top: a tool that fails to import fails only the tests using it

    return build_checkpoints.build_char_tokenizer()


@pytest.fixture(scope="session")
def rand_model(char_tok):
    """A small random Qwen3 on the char tokenizer; initializer_range 0.3 (not 0.02) makes its next-token distributions
    peaked enough that greedy choices are not near-ties decided by rounding."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(char_tok), pad_token_id=char_tok.pad_token_id,
                         eos_token_id=char_tok.eos_token_id, bos_token_id=None, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         max_position_embeddings=256, initializer_range=0.3, tie_word_embeddings=False)  # fmt: skip
    model = Qwen3ForCausalLM(config).eval()
    model.generation_config = GenerationConfig(eos_token_id=[char_tok.eos_token_id], pad_token_id=char_tok.pad_token_id,
                                               do_sample=False)  # fmt: skip
    return model
