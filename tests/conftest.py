"""Shared fixtures: the root, tools/ and experiments/ on sys.path; the tiny checkpoint; the char tokenizer."""

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
for folder in (ROOT, ROOT / "tools", ROOT / "experiments"):  # the tests of the tools and experiments import them
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import common  # noqa: E402

# The models under test are tiny: intra-op threads only add synchronisation, and on a shared 2-core
# machine two threads contending with other jobs made a 10-token sample ~100x slower (5 s vs 0.05 s).
torch.set_num_threads(int(os.environ.get("RLREF_TEST_THREADS", "1")))


@pytest.fixture(scope="session")
def tiny_path() -> str:
    """The warm-started tiny checkpoint (built once, about a minute on 2 cores, then cached)."""
    return common.tiny_checkpoint()


@pytest.fixture(scope="session")
def char_tok():
    import build_checkpoints  # here, not at the top: a tool that fails to import fails only the tests using it

    return build_checkpoints.build_char_tokenizer()
