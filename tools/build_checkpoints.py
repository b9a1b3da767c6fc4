"""tools/build_checkpoints.py: rebuild the embedded tiny checkpoints from their recipes.

    python tools/build_checkpoints.py tiny-moe              # into $RLREF_CACHE (default ~/.cache/rl-reference)
    python tools/build_checkpoints.py tiny tiny-rm --into checkpoints --force   # replace the shipped ones

All four ship in checkpoints/, so a run never builds one: this is for a changed recipe (tools/recipes.py's
TINY_CONFIG, TINY_WARMSTART, SUMS_WARMSTART, TINY_RM_RECIPE, ...: each checkpoint's directory name is
`recipes.checkpoint_key`, a hash of its recipe, so a changed recipe needs a new build, and a run that
finds none stops with one line naming this command) and for the warm-start study
(experiments/warm_starts.py builds the same recipe with other SFT seeds). A build takes about a
minute on 2 CPU cores (tiny-sums and tiny-rm start from tiny's weights, so build tiny first when it
changed), and its result depends on the CPU it runs on: that is why the checkpoints ship.
"""

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py, when run as a script
sys.path.insert(0, str(Path(__file__).resolve().parent))  # train_reward_model.py beside this file

import recipes  # noqa: E402  (tools/recipes.py; read at build time: a test or a study may change a recipe)
from cli import ArgumentParser  # noqa: E402
from recipes import EOS, PAD, TINY_CHARS, TINY_SPECS, checkpoint_key  # noqa: E402
from train_reward_model import arith_preference_pairs, train_reward_model  # noqa: E402

from common import (  # noqa: E402
    TINY_MODELS,
    TINY_RM,
    Rollout,
    arith_split,
    cache_root,
    completion_logprobs,
    evaluate,
    load_model,
    tiny_checkpoint,
)
from experiments.sums_task import sums_reference, sums_split  # noqa: E402


def _warm_start_recipe(name: str) -> tuple[dict, list, object]:
    """(recipe, training examples, SFT target of an example) of an embedded checkpoint."""
    if name == "tiny-sums":
        return recipes.SUMS_WARMSTART, sums_split()[0], lambda ex: sums_reference(ex["prompt"])
    return recipes.TINY_WARMSTART, arith_split()[0], lambda ex: ex["answer"]


def build_char_tokenizer():
    """A character-level tokenizer saved in Hugging Face format (loads with AutoTokenizer)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([PAD, EOS] + TINY_CHARS + ["<unk>"])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # one piece per character: "[\s\S]", not ".", which skips "\n" and left "\n\n" one unknown piece (issue 48)
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token="<unk>", padding_side="left"
    )


def build_atomically(path: Path, build, threads: int, replace: bool = False):
    """`build(tmp)` into a fresh directory beside `path`, with `threads` torch threads and the caller's
    random state untouched (a run that found the checkpoint equals one that built it), then renamed
    to `path`: atomic, so a concurrent builder or a crash never leaves half a model. With `replace`
    (--force) a checkpoint already at `path` is swapped out only once the new one is complete.
    Returns what `build` returned."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".building-"))
    caller_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        with torch.random.fork_rng(devices=[]):
            result = build(tmp)
        if replace and path.exists():
            old = path.with_name(f".replaced-{path.name}")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
            os.rename(tmp, path)
            shutil.rmtree(old)
        else:
            try:
                os.rename(tmp, path)
            except OSError:  # another builder was first
                if not (path / "config.json").is_file():
                    raise
    finally:
        torch.set_num_threads(caller_threads)
        shutil.rmtree(tmp, ignore_errors=True)
    return result


def build_tiny_checkpoint(name: str, path: Path, recipe: dict | None = None, replace: bool = False):
    """Run the warm-start recipe of `name` (or `recipe` in its place: experiments/warm_starts.py builds
    the same recipe with other SFT seeds) and save the checkpoint at `path`."""

    def build(tmp):
        model, tok = _warm_start_tiny(name, recipe)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)

    # SFT batches: 2 threads ~1.7x faster on a quiet machine
    build_atomically(path, build, threads=min(2, os.cpu_count() or 1), replace=replace)


def _warm_start_tiny(name: str = "tiny", recipe: dict | None = None):
    import transformers
    from transformers import GenerationConfig

    _, cls, tiny_config = TINY_SPECS[name]
    ws, train, target = _warm_start_recipe(name)
    ws = recipe or ws
    tok = build_char_tokenizer()
    torch.manual_seed(ws["seed"])
    config = getattr(transformers, f"{cls}Config")(
        vocab_size=len(tok),
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
        **tiny_config,
    )
    model = getattr(transformers, f"{cls}ForCausalLM")(config)
    if ws.get("init"):  # tiny-sums: from the arith checkpoint's weights, which can already add
        model = getattr(transformers, f"{cls}ForCausalLM").from_pretrained(tiny_checkpoint(ws["init"]))
    model.generation_config = GenerationConfig(
        eos_token_id=[tok.eos_token_id], pad_token_id=tok.pad_token_id, do_sample=False
    )
    rng = np.random.RandomState(ws["seed"])
    probe = [train[i] for i in rng.choice(len(train), ws["probe_size"], replace=False)]
    opt = torch.optim.AdamW(model.parameters(), lr=ws["lr"], weight_decay=0.0)
    eos = [tok.eos_token_id]
    for step in range(1, ws["max_steps"] + 1):
        batch = [train[i] for i in rng.randint(0, len(train), ws["batch"])]
        prompts = [tok(ex["prompt"])["input_ids"] for ex in batch]
        answers = [tok(target(ex))["input_ids"] + eos for ex in batch]
        roll = Rollout.from_lists(prompts, answers, tok.pad_token_id)
        logp, _ = completion_logprobs(model, roll)
        loss = -(logp * roll.completion_mask).sum() / roll.completion_mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % ws["probe_every"] == 0:
            acc = evaluate(model, tok, probe, max_new_tokens=ws.get("probe_tokens", 5))["accuracy"]
            if acc >= ws["target_accuracy"]:
                break
    model.eval()
    return model, tok


def build_tiny_reward_model(path: Path, recipe: dict | None = None, replace: bool = False) -> dict:
    """Pairs from `arith` training prompts (and the warm-started policy's own wrong samples), then
    `train_reward_model` from the tiny checkpoint, saved at `path`. Returns the trainer's report
    (held-out pairwise accuracy, time)."""
    r = recipe or recipes.TINY_RM_RECIPE

    def build(tmp):
        train, _ = arith_split()
        examples = [train[i] for i in np.random.RandomState(r["seed"]).permutation(len(train))[: r["prompts"]]]
        policy, tok = load_model("tiny", torch.device("cpu"))
        # One thread: batches of 64 rows of ~12 tokens are too small to split, and on a shared 2-core
        # machine two threads made a step 3-40x slower (0.3-5 s against 0.1 s).
        torch.set_num_threads(1)
        pairs = arith_preference_pairs(examples, r["seed"], policy.eval(), tok, r["policy_samples"],
                                       r["policy_prompts"], r["max_new_tokens"])  # fmt: skip
        return train_reward_model(pairs, "tiny", tmp, r["steps"], r["batch"], r["lr"], r["eval_frac"], r["seed"],
                                  log=None)  # fmt: skip

    return build_atomically(path, build, threads=1, replace=replace)


def main(argv=None):
    """python tools/build_checkpoints.py NAME [NAME ...] [--into DIR] [--force]: build each embedded
    checkpoint from its recipe into DIR/<its checkpoint_key>."""
    p = ArgumentParser(prog="python tools/build_checkpoints.py", description=main.__doc__.split(":")[0])
    p.add_argument("names", nargs="+", choices=[*TINY_MODELS, TINY_RM], metavar="NAME",
                   help=f"one of {', '.join([*TINY_MODELS, TINY_RM])}")  # fmt: skip
    p.add_argument("--into", help="where to write (default: $RLREF_CACHE, ~/.cache/rl-reference; checkpoints: ship it)")
    p.add_argument("--force", action="store_true", help="rebuild even when DIR already holds this recipe's checkpoint")
    a = p.parse_args(argv)
    for name in a.names:
        path = Path(a.into or cache_root()) / checkpoint_key(name)
        if (path / "config.json").is_file() and not a.force:
            print(f"{name}: {path} already exists (--force rebuilds it)")
            continue
        t0 = time.perf_counter()
        if name == TINY_RM:
            report = build_tiny_reward_model(path, replace=a.force)
            done = f"held-out pairwise accuracy {report['pairwise_accuracy']:.3f}"
        else:
            build_tiny_checkpoint(name, path, replace=a.force)
            done = "warm-started"
        print(f"{name}: built {path} in {time.perf_counter() - t0:.0f} s ({done})")


if __name__ == "__main__":
    main()
