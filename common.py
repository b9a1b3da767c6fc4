"""common.py: everything ppo.py, grpo.py and gspo.py share that is not the algorithm.

Sections, in reading order:
  1. CLI           Args dataclass -> argparse, one-line errors with exit status 2
  2. Data          the built-in `arith` task and a JSONL loader (prompt/answer or GSM8K)
  3. Rewards       strict final-answer extraction, exact-match reward, a separate format signal
  4. Tiny model    `tiny_checkpoint()`: a Qwen3ForCausalLM + char tokenizer, warm-started, cached
  5. Loading       model/tokenizer loading, EOS ids, prompt formatting (chat template if any)
  6. Sampling      batched generation: left padding, KV cache, temperature, top-p, many EOS ids
  7. Log-probs     per-token log-probs and true entropy in float32, chunked over the vocabulary
  8. Evaluation    greedy held-out accuracy and format rate
  9. Logging       metrics.jsonl, summary.json, final/ checkpoint, seeding, peak memory

The tiny checkpoint is cached under $RLREF_CACHE (default ~/.cache/rl-reference), keyed by a hash
of its recipe, so changing the recipe builds a new one and never reuses a stale one.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import random
import re
import resource
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# ---------------------------------------------------------------------------------------------
# 1. CLI
# ---------------------------------------------------------------------------------------------


def arg(default, help: str):
    """A dataclass field that carries its --help text."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: default, metadata={"help": help})
    return field(default=default, metadata={"help": help})


class UsageError(Exception):
    """Bad input from the user: reported as one line on stderr, exit status 2."""


def die(message: str):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def parse_args(args_cls, argv=None):
    """Turn a dataclass whose fields carry `help` metadata into a CLI (underscores -> dashes)."""

    class Parser(argparse.ArgumentParser):
        def error(self, message):  # argparse's own errors: one line, exit 2, no usage dump
            die(message)

    parser = Parser(description=(sys.modules[args_cls.__module__].__doc__ or "").split("\n")[0])
    for f in dataclasses.fields(args_cls):
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "") + f" (default: {f.default})"
        if f.type in (bool, "bool"):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        else:
            kind = {"int": int, "float": float, "str": str}.get(f.type if isinstance(f.type, str) else f.type.__name__, str)
            if "None" in str(f.type):  # Optional[...] fields: "none" on the command line means None
                inner = int if "int" in str(f.type) else float if "float" in str(f.type) else str
                kind = lambda s, inner=inner: None if s.lower() == "none" else inner(s)  # noqa: E731
            parser.add_argument(flag, type=kind, default=f.default, help=help_text)
    return args_cls(**vars(parser.parse_args(argv)))


def check_common_args(args, needs_group: bool):
    """Range checks shared by the three scripts; raises UsageError naming the flag."""
    for name in ("steps", "prompts_per_step", "max_new_tokens", "minibatches", "epochs", "eval_size"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.group_size < (2 if needs_group else 1):
        need = "2 (group advantages need at least two samples per prompt)" if needs_group else "1"
        raise UsageError(f"--group-size must be >= {need}, got {args.group_size}")
    if not args.temperature > 0:
        raise UsageError(f"--temperature must be > 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.lr < 0:
        raise UsageError(f"--lr must be >= 0, got {args.lr}")
    if args.eval_every < 0:
        raise UsageError(f"--eval-every must be >= 0 (0 turns periodic evaluation off), got {args.eval_every}")
    batch = args.prompts_per_step * args.group_size
    if batch % args.minibatches:
        raise UsageError(
            f"--minibatches {args.minibatches} does not divide the batch of {batch} completions "
            f"(--prompts-per-step x --group-size)"
        )
    if args.device not in ("auto", "cpu", "cuda") and not args.device.startswith("cuda:"):
        raise UsageError(f"--device must be auto, cpu or cuda[:N], got {args.device!r}")
    if args.model not in TINY_MODELS and not Path(args.model).is_dir() and not re.fullmatch(r"[\w.-]+/[\w.-]+", args.model):
        raise UsageError(f"--model {args.model!r}: not 'tiny', an existing directory, or a hub id like Qwen/Qwen2.5-0.5B")
    if args.model not in TINY_MODELS and Path(args.model).is_dir() and not (Path(args.model) / "config.json").is_file():
        raise UsageError(f"--model {args.model!r}: directory has no config.json (not a Hugging Face checkpoint)")


# ---------------------------------------------------------------------------------------------
# 2. Data
# ---------------------------------------------------------------------------------------------

ARITH_EVAL_SEED = 1234  # fixed, so the held-out set is the same for every run seed
ARITH_EVAL_SIZE = 500


def arith_split(max_operand: int = 99):
    """All `a+b=` pairs with 0 <= a, b <= max_operand, split once into (train, held-out eval)."""
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    order = np.random.RandomState(ARITH_EVAL_SEED).permutation(len(pairs))
    examples = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in (pairs[i] for i in order)]
    return examples[ARITH_EVAL_SIZE:], examples[:ARITH_EVAL_SIZE]


def load_jsonl(path: str):
    """Records {"prompt", "answer"} or GSM8K's {"question", "answer": "... #### N"}."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--data {path}: file not found")
    records = []
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--data {path}: cannot read ({e.__class__.__name__})")
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"--data {path}:{lineno}: invalid JSON ({e.msg})")
        if not isinstance(rec, dict):
            raise UsageError(f"--data {path}:{lineno}: expected a JSON object")
        prompt = rec.get("prompt", rec.get("question"))
        if not isinstance(prompt, str) or not prompt:
            raise UsageError(f"--data {path}:{lineno}: missing field 'prompt' (or 'question')")
        answer = rec.get("answer")
        if isinstance(answer, (int, float)):
            answer = str(answer)
        if not isinstance(answer, str) or not answer.strip():
            raise UsageError(f"--data {path}:{lineno}: missing field 'answer'")
        if "question" in rec and "prompt" not in rec:  # GSM8K: the gold is what follows '####'
            if "####" not in answer:
                raise UsageError(f"--data {path}:{lineno}: field 'answer' has no '#### N' final answer")
            answer = answer.split("####")[-1].strip()
        records.append({"prompt": prompt, "answer": answer.strip()})
    if not records:
        raise UsageError(f"--data {path}: no records")
    return records


TASKS = ("arith", "gsm8k", "jsonl")


def load_task(task: str | None, data: str | None, eval_fraction: float = 0.1):
    """Returns (train_examples, eval_examples); the eval set never overlaps training."""
    if task is None:
        task = "jsonl" if data else "arith"
    if task not in TASKS:
        raise UsageError(f"--task {task!r} is unknown; expected one of {', '.join(TASKS)}")
    if task == "arith":
        if data:
            raise UsageError("--data is not used by --task arith; drop it or choose --task jsonl/gsm8k")
        return arith_split()
    if not data:
        raise UsageError(f"--task {task} needs --data FILE.jsonl")
    records = load_jsonl(data)
    if len(records) < 2:
        raise UsageError(f"--data {data}: needs at least 2 records (a training and a held-out part)")
    order = np.random.RandomState(ARITH_EVAL_SEED).permutation(len(records))
    n_eval = max(1, int(len(records) * eval_fraction))
    return [records[i] for i in order[n_eval:]], [records[i] for i in order[:n_eval]]


class PromptStream:
    """Deterministic, resumable stream of training examples: a fresh permutation each epoch."""

    def __init__(self, examples, seed: int):
        self.examples, self.seed, self.epoch, self.pos = examples, seed, 0, 0
        self._order = self._permutation()

    def _permutation(self):
        return np.random.RandomState(self.seed * 1000 + self.epoch).permutation(len(self.examples))

    def next(self, n: int):
        batch = []
        while len(batch) < n:
            if self.pos == len(self.examples):
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._permutation()
            batch.append(self.examples[self._order[self.pos]])
            self.pos += 1
        return batch

    def state_dict(self):
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state):
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._order = self._permutation()


# ---------------------------------------------------------------------------------------------
# 3. Rewards
# ---------------------------------------------------------------------------------------------

_NUMBER = re.compile(r"[-+]?\d[\d,]*(\.\d+)?|[-+]?\.\d+")


def normalize_number(s: str) -> str | None:
    """'1,234' -> '1234', '12.0' -> '12', '+5' -> '5'; None if `s` is not exactly one number."""
    s = s.strip().replace("$", "")
    if not _NUMBER.fullmatch(s):
        return None
    s = s.replace(",", "").lstrip("+")
    if "." in s:
        s = s.rstrip("0").rstrip(".")
    if s in ("-0", ""):
        s = "0"
    return s


def extract_answer(completion: str) -> str | None:
    """The final answer, strictly: the text after the last '####' if present, else the whole
    completion, and it must be exactly one number. A completion that merely contains the right
    number somewhere ("46 or 47", "I think 46") has no answer. Empty text has no answer."""
    text = completion.split("####")[-1] if "####" in completion else completion
    return normalize_number(text)


def score(completion: str, answer: str) -> tuple[float, float]:
    """(reward, format_ok): reward 1.0 iff the extracted answer equals the gold answer."""
    pred = extract_answer(completion)
    gold = normalize_number(answer)
    if gold is None:  # non-numeric gold answers: exact string match after stripping
        gold = answer.strip()
        pred = completion.split("####")[-1].strip() or None
    return float(pred is not None and pred == gold), float(pred is not None)


# ---------------------------------------------------------------------------------------------
# 4. The embedded tiny Qwen3 checkpoint
# ---------------------------------------------------------------------------------------------

TINY_MODELS = ("tiny",)
PAD, EOS = "<|endoftext|>", "<|im_end|>"  # Qwen's own names: pad and EOS are different tokens
TINY_CHARS = [chr(c) for c in range(32, 127)] + ["\n"]  # printable ASCII: any JSONL text tokenizes
TINY_CONFIG = dict(
    hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rope_theta=10000.0,
    tie_word_embeddings=True, rms_norm_eps=1e-6,
)
TINY_WARMSTART = dict(seed=0, max_steps=1500, batch=64, lr=2e-3, target_accuracy=0.2, probe_every=25, probe_size=256)
TINY_RECIPE_VERSION = 1


def cache_root() -> Path:
    return Path(os.environ.get("RLREF_CACHE", Path.home() / ".cache" / "rl-reference"))


def build_char_tokenizer():
    """A character-level tokenizer saved in Hugging Face format (loads with AutoTokenizer)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([PAD, EOS] + TINY_CHARS + ["<unk>"])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token="<unk>", padding_side="left"
    )


def tiny_checkpoint() -> str:
    """Path of the embedded checkpoint: built (about a minute on 2 CPU cores) and cached on first
    call, reused afterwards. A real Qwen3ForCausalLM with a small config, warm-started by SFT on
    `arith` training pairs until a probe of *training* prompts reaches the target accuracy, so
    the held-out accuracy starts in a band that leaves room for RL."""
    recipe = json.dumps([TINY_CONFIG, TINY_WARMSTART, TINY_CHARS, TINY_RECIPE_VERSION], sort_keys=True)
    path = cache_root() / f"tiny-qwen3-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"
    if (path / "config.json").is_file():
        return str(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".building-"))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # tiny matmuls: one thread is fastest, and immune to contention
        model, tok = _warm_start_tiny()
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        try:
            os.rename(tmp, path)  # atomic: a concurrent builder or a crash never leaves half a model
        except OSError:
            if not (path / "config.json").is_file():
                raise
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(tmp, ignore_errors=True)
    return str(path)


def _warm_start_tiny():
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    ws = TINY_WARMSTART
    tok = build_char_tokenizer()
    torch.manual_seed(ws["seed"])
    config = Qwen3Config(
        vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        bos_token_id=None, **TINY_CONFIG,
    )
    model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=[tok.eos_token_id], pad_token_id=tok.pad_token_id, do_sample=False
    )
    train, _ = arith_split()
    rng = np.random.RandomState(ws["seed"])
    probe = [train[i] for i in rng.choice(len(train), ws["probe_size"], replace=False)]
    opt = torch.optim.AdamW(model.parameters(), lr=ws["lr"], weight_decay=0.0)
    eos = [tok.eos_token_id]
    for step in range(1, ws["max_steps"] + 1):
        batch = [train[i] for i in rng.randint(0, len(train), ws["batch"])]
        prompts = [tok(ex["prompt"])["input_ids"] for ex in batch]
        answers = [tok(ex["answer"])["input_ids"] + eos for ex in batch]
        roll = Rollout.from_lists(prompts, answers, tok.pad_token_id)
        logp, _ = completion_logprobs(model, roll)
        loss = -(logp * roll.completion_mask).sum() / roll.completion_mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % ws["probe_every"] == 0:
            acc = evaluate(model, tok, probe, max_new_tokens=5)["accuracy"]
            if acc >= ws["target_accuracy"]:
                break
    model.eval()
    return model, tok


# ---------------------------------------------------------------------------------------------
# 5. Model loading and prompts
# ---------------------------------------------------------------------------------------------


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_model(name: str, device: torch.device, dtype=None):
    """(model, tokenizer) for 'tiny' or any local directory / hub id; bf16 weights on GPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_checkpoint() if name in TINY_MODELS else name
    if device.type == "cpu" and name in TINY_MODELS and "RLREF_THREADS" not in os.environ:
        # A 0.8M-parameter model's matmuls are too small to split across cores: extra threads
        # only add synchronisation (and collapse when another process shares the cores).
        torch.set_num_threads(1)
    if "RLREF_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["RLREF_THREADS"]))
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    return model, tok


def eos_token_ids(model, tok) -> list[int]:
    """Every id that ends a completion: the generation config may list several (Qwen3 does)."""
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tok.eos_token_id is not None and tok.eos_token_id not in ids:
        ids.append(tok.eos_token_id)
    return ids


SYSTEM_PROMPT = "Solve the problem step by step, then write the final answer as a number after '####'."


def encode_prompts(tok, examples) -> list[list[int]]:
    """Token ids per prompt: through the chat template (with the answer-format instruction) when
    the tokenizer has one, as plain text otherwise (the tiny model and base checkpoints)."""
    if getattr(tok, "chat_template", None):
        return [
            tok.apply_chat_template(
                [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": ex["prompt"]}],
                add_generation_prompt=True, tokenize=True, return_dict=False,
            )
            for ex in examples
        ]
    return [tok(ex["prompt"], add_special_tokens=False)["input_ids"] for ex in examples]


# ---------------------------------------------------------------------------------------------
# 6. Sampling
# ---------------------------------------------------------------------------------------------


@dataclass
class Rollout:
    """A batch of prompts and completions. Prompts are left-padded, completions right-padded, so
    prompt ++ completion is one contiguous sequence per row."""

    prompt_ids: torch.Tensor  # [B, P]
    prompt_mask: torch.Tensor  # [B, P] 1 on real prompt tokens
    completion_ids: torch.Tensor  # [B, T]
    completion_mask: torch.Tensor  # [B, T] 1 on generated tokens, the EOS token included

    def __getitem__(self, idx):
        return Rollout(self.prompt_ids[idx], self.prompt_mask[idx], self.completion_ids[idx], self.completion_mask[idx])

    def __len__(self):
        return self.prompt_ids.shape[0]

    @staticmethod
    def from_lists(prompts, completions, pad_id: int, device="cpu"):
        P, T = max(map(len, prompts)), max(1, max(map(len, completions)))
        pids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
        pmask = torch.zeros(len(prompts), P, dtype=torch.long)
        cids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
        cmask = torch.zeros(len(prompts), T)
        assert len(prompts) == len(completions)
        for i, (p, c) in enumerate(zip(prompts, completions)):
            pids[i, P - len(p):], pmask[i, P - len(p):] = torch.tensor(p), 1
            cids[i, : len(c)], cmask[i, : len(c)] = torch.tensor(c, dtype=torch.long), 1
        return Rollout(pids.to(device), pmask.to(device), cids.to(device), cmask.to(device))

    def completion_lists(self) -> list[list[int]]:
        lengths = self.completion_mask.sum(1).long().tolist()
        return [row[:n] for row, n in zip(self.completion_ids.tolist(), lengths)]


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability reaches top_p (nucleus sampling)."""
    sorted_logits, order = logits.sort(-1, descending=True)
    cum = sorted_logits.softmax(-1).cumsum(-1)
    drop = cum - sorted_logits.softmax(-1) >= top_p  # tokens entirely beyond the nucleus
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


@torch.no_grad()
def sample(model, prompts: list[list[int]], max_new_tokens: int, eos_ids: list[int], pad_id: int,
           temperature: float = 1.0, top_p: float = 1.0, greedy: bool = False, generator=None) -> Rollout:
    """Batched sampling with a KV cache. `prompts` are token-id lists (repeat a prompt n times for n
    samples). A row stops at the first of any EOS id; the EOS token is inside the completion mask
    and every position after it is padding."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    roll = Rollout.from_lists(prompts, [[]] * len(prompts), pad_id, device)
    B, P = roll.prompt_ids.shape
    attn = torch.cat([roll.prompt_mask, torch.ones(B, max_new_tokens, dtype=torch.long, device=device)], 1)
    positions = (attn.cumsum(1) - 1).clamp(min=0)  # [B, P+T] RoPE positions that skip left padding
    eos = torch.tensor(eos_ids, device=device)
    out = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros(B, max_new_tokens, device=device)
    alive = torch.ones(B, dtype=torch.bool, device=device)
    cache = DynamicCache(config=model.config)
    next_input = roll.prompt_ids
    for t in range(max_new_tokens):
        start = 0 if t == 0 else P + t - 1
        logits = model(
            input_ids=next_input, attention_mask=attn[:, : P + t], position_ids=positions[:, start: P + t],
            past_key_values=cache, use_cache=True, logits_to_keep=1,
        ).logits[:, -1].float()
        if greedy:
            token = logits.argmax(-1)
        else:
            logits = logits / temperature
            if top_p < 1.0:
                logits = _top_p_filter(logits, top_p)
            token = torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(1)
        token = torch.where(alive, token, torch.full_like(token, pad_id))
        out[:, t], mask[:, t] = token, alive.float()
        alive &= ~torch.isin(token, eos)
        if not alive.any():
            out, mask = out[:, : t + 1], mask[:, : t + 1]
            break
        next_input = token[:, None]
    return Rollout(roll.prompt_ids, roll.prompt_mask, out, mask)


# ---------------------------------------------------------------------------------------------
# 7. Log-probs and entropy
# ---------------------------------------------------------------------------------------------


def completion_hidden_states(backbone, roll: Rollout) -> torch.Tensor:
    """[B, T, H] final hidden states at the positions that predict each completion token."""
    ids = torch.cat([roll.prompt_ids, roll.completion_ids], 1)
    attn = torch.cat([roll.prompt_mask, roll.completion_mask.long()], 1)
    positions = (attn.cumsum(1) - 1).clamp(min=0)
    hidden = backbone(input_ids=ids, attention_mask=attn, position_ids=positions).last_hidden_state
    P, T = roll.prompt_ids.shape[1], roll.completion_ids.shape[1]
    return hidden[:, P - 1: P + T - 1]


def _logp_entropy_chunk(hidden, weight, targets, temperature: float):
    logits = (hidden @ weight.T).float() / temperature  # [n, V] float32, one chunk only
    logz = logits.logsumexp(-1)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - logz
    with torch.no_grad():  # entropy is a diagnostic here: no graph kept for it
        entropy = logz - (logits.softmax(-1) * logits).sum(-1)
    return logp, entropy


def logprobs_from_hidden(hidden, weight, targets, temperature: float = 1.0, chunk_tokens: int | None = 1024):
    """Per-token log p(target) and the distribution's entropy from hidden states [..., H] and the
    output projection `weight` [V, H], in float32 from logits / temperature. The vocabulary-sized
    logits are made `chunk_tokens` tokens at a time and recomputed in backward, so no
    [B, T, V] tensor ever exists; chunk_tokens=None is the plain (memory-hungry) computation."""
    shape = targets.shape
    h, y = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    if chunk_tokens is None or h.shape[0] <= chunk_tokens:
        logp, ent = _logp_entropy_chunk(h, weight, y, temperature)
        return logp.view(shape), ent.view(shape)
    logps, ents = [], []
    for s in range(0, h.shape[0], chunk_tokens):
        args = (h[s: s + chunk_tokens], weight, y[s: s + chunk_tokens], temperature)
        if torch.is_grad_enabled():
            lp, en = checkpoint(_logp_entropy_chunk, *args, use_reentrant=False)
        else:
            lp, en = _logp_entropy_chunk(*args)
        logps.append(lp)
        ents.append(en)
    return torch.cat(logps).view(shape), torch.cat(ents).view(shape)


def completion_logprobs(model, roll: Rollout, temperature: float = 1.0, chunk_tokens: int | None = 1024):
    """(logp [B, T], entropy [B, T]) of the completion tokens under `model` (a *ForCausalLM).
    Padding positions hold finite values; multiply by `roll.completion_mask` before use."""
    hidden = completion_hidden_states(model.get_decoder(), roll)
    weight = model.get_output_embeddings().weight
    return logprobs_from_hidden(hidden, weight, roll.completion_ids, temperature, chunk_tokens)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean of x over mask == 1 (same mask in numerator and denominator); 0 where mask is empty."""
    mask = mask.to(x.dtype)
    total = (x * mask).sum(dim) if dim is not None else (x * mask).sum()
    count = mask.sum(dim) if dim is not None else mask.sum()
    return total / count.clamp(min=1)


# ---------------------------------------------------------------------------------------------
# 8. Evaluation
# ---------------------------------------------------------------------------------------------


def score_rollout(tok, roll: Rollout, answers: list[str]):
    """(rewards [B], format_ok [B], texts) for a rollout whose row i answers answers[i]."""
    texts = tok.batch_decode(roll.completion_lists(), skip_special_tokens=True)
    scored = [score(text, ans) for text, ans in zip(texts, answers)]
    return torch.tensor([s[0] for s in scored]), torch.tensor([s[1] for s in scored]), texts


@torch.no_grad()
def evaluate(model, tok, examples, max_new_tokens: int, batch_size: int = 256) -> dict:
    """Greedy held-out accuracy and format rate."""
    was_training = model.training
    model.eval()
    rewards, formats = [], []
    eos = eos_token_ids(model, tok)
    for s in range(0, len(examples), batch_size):
        batch = examples[s: s + batch_size]
        roll = sample(model, encode_prompts(tok, batch), max_new_tokens, eos, tok.pad_token_id, greedy=True)
        r, f, _ = score_rollout(tok, roll, [ex["answer"] for ex in batch])
        rewards.append(r)
        formats.append(f)
    model.train(was_training)
    return {"accuracy": torch.cat(rewards).mean().item(), "format_rate": torch.cat(formats).mean().item()}


# ---------------------------------------------------------------------------------------------
# 9. Seeding, logging, outputs
# ---------------------------------------------------------------------------------------------


def seed_everything(seed: int):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def peak_memory_mb(device: torch.device) -> float:
    """Peak GPU memory allocated on CUDA; peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024 if sys.platform != "darwin" else kb / 2**20


class RunLogger:
    """Writes metrics.jsonl (one object per step), summary.json and final/ into `out`."""

    def __init__(self, out: str):
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.metrics_file = open(self.out / "metrics.jsonl", "w")

    def log(self, metrics: dict):
        clean = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in metrics.items()}
        self.metrics_file.write(json.dumps(clean) + "\n")
        self.metrics_file.flush()

    def summary(self, summary: dict):
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    def save_model(self, model, tok, name: str = "final"):
        model.save_pretrained(self.out / name)
        tok.save_pretrained(self.out / name)

    def close(self):
        self.metrics_file.close()


def tensor_stats(x: torch.Tensor) -> dict:
    return {"mean": x.float().mean().item(), "std": x.float().std().item() if x.numel() > 1 else 0.0}


def finite_or(x: float, default: float = float("nan")) -> float:
    return x if math.isfinite(x) else default


def elapsed(t0: float) -> float:
    return time.perf_counter() - t0
