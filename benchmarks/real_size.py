"""Real size without a GPU: two steps of each script against randomly initialised models with the
published configurations of Qwen2.5-0.5B-Instruct and Qwen3-0.6B (tools/plan_memory.py's QWEN_CONFIGS: vocabulary,
hidden size, layers, heads, KV heads, head_dim, intermediate size, tied embeddings, RoPE), through the
scripts' normal command lines, float32 on the CPU. Not a test: it takes minutes and up to ~20 GB.

    python benchmarks/real_size.py                       # both configs, all three scripts
    python benchmarks/real_size.py --configs qwen2.5-0.5b --scripts grpo gspo --extra=--grad-checkpointing
    python benchmarks/real_size.py --configs qwen3-0.6b --tokenizer qwen3 --steps 1   # Qwen3's real tokenizer

Per run it prints seconds per step, the peak RSS (the process's ru_maxrss), the planner's figure for
the same run (`plan_memory.plan_memory`, device "cpu", plus the measured import baseline) and the losses
and gradient norms, which must be finite and non-zero. A random model never writes a correct answer,
so the exact-match reward would give every advantage 0 (GRPO and GSPO skip every row, PPO's whitened
advantages vanish) and prove nothing about the backward pass: the reward here is the completion's
length in characters / 100 (`completion_length`, through --reward), which varies between samples.

--tokenizer filler (the default) gives the model a tokenizer of the real vocabulary's size built from the
character tokenizer (prompts without a chat template); --tokenizer qwen3 gives it Qwen3's real tokenizer
(vendored, extras/qwen3_tokenizer.py), its chat template and its generation config (EOS 151645 and 151643).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT_TOKENS = 6  # the longest arith prompt ("99+99=") in the char tokenizer, no chat template


def completion_length(prompts, completions, **fields):
    """A reward with variance for random models: the completion's length in characters / 100."""
    return [len(c) / 100 for c in completions]


def build_checkpoint(fields: dict, path: Path, tokenizer: str = "filler"):
    """A random model with the config `fields` (model_type and sizes: a QWEN_CONFIGS entry) and a
    tokenizer whose vocabulary has the real size (the char tokenizer's entries, then filler tokens up
    to vocab_size, so that every id the model samples decodes to text), saved at `path`; tokenizer
    "qwen3": Qwen3's own tokenizer and generation config instead."""
    if tokenizer == "qwen3":
        return build_qwen3_checkpoint(fields, path)
    sys.path[:0] = [str(ROOT), str(ROOT / "tools")]
    import recipes
    import torch
    from build_checkpoints import build_char_tokenizer
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

    fields = dict(fields)  # model_type is taken out below
    chars = build_char_tokenizer().get_vocab()  # {token: id}: PAD 0, EOS 1, then the characters
    vocab = dict(chars)
    vocab.update({f"<f{i}>": i for i in range(len(chars), fields["vocab_size"])})
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=recipes.PAD, eos_token=recipes.EOS,
                                  unk_token="<unk>", padding_side="left")  # fmt: skip
    assert len(tok) == fields["vocab_size"], (len(tok), fields["vocab_size"])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields, pad_token_id=tok.pad_token_id,
                                  eos_token_id=tok.eos_token_id, bos_token_id=None)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(eos_token_id=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    tmp = Path(tempfile.mkdtemp(dir=path.parent))
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.rename(tmp, path)


def build_qwen3_checkpoint(fields: dict, path: Path):
    """A random model with the config `fields` and Qwen3's vendored tokenizer and generation config."""
    sys.path[:0] = [str(ROOT)]
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from extras import qwen3_tokenizer

    fields = dict(fields)
    ids = dict(pad_token_id=qwen3_tokenizer.ENDOFTEXT, eos_token_id=qwen3_tokenizer.IM_END,
               bos_token_id=qwen3_tokenizer.ENDOFTEXT)  # fmt: skip
    config = AutoConfig.for_model(fields.pop("model_type"), **fields, **ids)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(**qwen3_tokenizer.GENERATION_CONFIG)
    tmp = Path(tempfile.mkdtemp(dir=path.parent))
    model.save_pretrained(tmp)
    for name in qwen3_tokenizer.FILES:
        shutil.copyfile(qwen3_tokenizer.tokenizer_dir() / name, tmp / name)
    os.rename(tmp, path)


def prompt_tokens(path: Path, tokenizer: str) -> int:
    """The longest arith prompt in tokens, as the scripts encode it (Qwen3's: through its chat template,
    after the default system prompt, --thinking off)."""
    if tokenizer == "filler":
        return PROMPT_TOKENS
    import common

    train, held = common.arith_split()
    return max(map(len, common.encode_prompts(common.load_tokenizer(str(path)), train + held)))


def command(script: str, model: Path, out: Path, extra: list[str], steps: int = 2) -> list[str]:
    prompts, group = (8, 1) if script == "ppo" else (4, 2)  # 8 completions per step either way
    return [sys.executable, str(ROOT / f"{script}.py"), "--model", str(model), "--steps", str(steps),
            "--prompts-per-step", str(prompts), "--group-size", str(group), "--max-new-tokens", "32",
            "--minibatches", "2", "--eval-every", "0", "--eval-size", "4", "--seed", "0", "--out", str(out),
            "--reward", f"{Path(__file__).resolve()}:completion_length", *extra]  # fmt: skip


def run(cmd: list[str], out: Path) -> dict:
    """Run one script; its metrics, its summary and the process's own peak RSS (wait4's ru_maxrss)."""
    t0 = time.perf_counter()
    log = out.with_suffix(".log")
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)
        cpu_at_line = []  # the process's CPU seconds when each metrics.jsonl line appeared: CPU per step,
        while True:  # which a machine shared with other work does not inflate as it does wall time
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            lines = (out / "metrics.jsonl").read_text().count("\n") if (out / "metrics.jsonl").exists() else 0
            if lines > len(cpu_at_line):
                cpu_at_line += [process_cpu_s(proc.pid)] * (lines - len(cpu_at_line))
            time.sleep(0.2)
    output = log.read_text()
    log.unlink()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{output[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    cpu_steps = [b - a for a, b in zip(cpu_at_line, cpu_at_line[1:])]  # steps 2, 3, ...
    return {"rows": rows, "peak_gb": usage.ru_maxrss / 2**20, "wall_s": time.perf_counter() - t0,
            "cpu_s": cpu_steps[0] if cpu_steps else float("nan"), "cpu_steps": cpu_steps}  # fmt: skip


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a running process, from /proc (Linux)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=["qwen2.5-0.5b", "qwen3-0.6b"])
    parser.add_argument("--scripts", nargs="+", default=["grpo", "gspo", "ppo"])
    parser.add_argument("--extra", default="", help="more flags for every script, e.g. --grad-checkpointing")
    parser.add_argument("--tokenizer", choices=["filler", "qwen3"], default="filler",
                        help="a filler tokenizer of the vocabulary's size, or Qwen3's real one (vendored)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=2, help="steps per script (CPU s needs 2: step 2's)")
    parser.add_argument("--cache", default=os.path.expanduser("~/.cache/rl-reference/real-size"))
    args = parser.parse_args()
    sys.path[:0] = [str(ROOT), str(ROOT / "tools")]
    import plan_memory

    extra = args.extra.split()
    print(f"{args.steps} steps, 8 completions x 32 new tokens per step, 2 minibatches, float32 on CPU "
          f"({os.cpu_count()} cores), {args.tokenizer} tokenizer{', ' + args.extra if extra else ''}")  # fmt: skip
    header = (
        f"{'config':14}{'script':7}{'s/step':>8}{'CPU s':>7}{'peak GB':>9}{'planned':>9}  loss, grad norm (steps 1, 2)"
    )
    print(header)
    results = []
    for name in args.configs:
        path = Path(args.cache) / (name if args.tokenizer == "filler" else f"{name}-{args.tokenizer}")
        if not (path / "config.json").is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            build_checkpoint(plan_memory.QWEN_CONFIGS[name], path, args.tokenizer)
            print(f"(built {path} in {time.perf_counter() - t0:.0f} s)")
        longest = prompt_tokens(path, args.tokenizer)
        for script in args.scripts:
            out = Path(tempfile.mkdtemp(prefix=f"dryrun-{script}-"))
            try:
                r = run(command(script, path, out, extra, args.steps), out)
            finally:
                shutil.rmtree(out, ignore_errors=True)
            rows = r["rows"]
            losses = [row["loss"] for row in rows]
            norms = [row[k] for row in rows for k in ("grad_norm", "critic_grad_norm") if k in row]
            ok = all(v == v and abs(v) not in (0.0, float("inf")) for v in losses + norms)
            lora_rank = int(extra[extra.index("--lora-rank") + 1]) if "--lora-rank" in extra else 0
            plan = plan_memory.plan_memory(plan_memory.QWEN_CONFIGS[name], script, 8, longest, 32, 2,
                                      "--grad-checkpointing" in extra, lora_rank, device="cpu")  # fmt: skip
            planned = (plan["peak"] + BASELINE_BYTES) / 2**30
            step_s = sum(row["step_time_s"] for row in rows) / len(rows)
            shown = "; ".join(f"{row['loss']:.4g}, {row['grad_norm']:.3g}" for row in rows)
            print(f"{name:14}{script:7}{step_s:8.1f}{r['cpu_s']:7.1f}{r['peak_gb']:9.2f}{planned:9.2f}  {shown}"
                  f"{'' if ok else '  <- NOT finite and non-zero'}", flush=True)  # fmt: skip
            results.append({"config": name, "script": script, "tokenizer": args.tokenizer, "prompt_tokens": longest,
                            "step_s": step_s, "cpu_s": r["cpu_s"],
                            "peak_gb": r["peak_gb"], "planned_gb": planned, "losses": losses, "grad_norms": norms,
                            "ok": ok})  # fmt: skip
    print(json.dumps(results))
    if not all(r["ok"] for r in results):
        raise SystemExit("a loss or gradient norm was zero or not finite")


BASELINE_BYTES = 255 * 2**20  # RSS of python + torch + transformers + common imported (measured: 255 MB)

if __name__ == "__main__":
    main()
