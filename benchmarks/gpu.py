"""GPU benchmark at a realistic size: rollout tokens/s, training tokens/s and peak GPU memory.

    bash benchmarks/gpu.sh               # on a CUDA machine, no network needed (about 2-4 minutes)
    python benchmarks/gpu.py --cpu-smoke # a tiny version of every measurement, on CPU: does it run?

The model is randomly initialised with Qwen2.5-0.5B's dimensions and vocabulary (Qwen2ForCausalLM:
hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864, vocabulary 151,936, tied embeddings), float32
weights as the scripts keep them (the training forward under bf16 autocast), built from its config
(no download); the ids are random, so the tiny char tokenizer stands in for Qwen's (it only names
the pad and EOS ids). Sizes: --batch completions (64) of --new-tokens (256) after left-padded
prompts of --prompt-len/2 .. --prompt-len (128) tokens.

Rollout: common.sample and Hugging Face's model.generate, greedy with EOS disabled (every row
makes --new-tokens tokens),
plus common.sample at temperature 1 (the training setting); the median of --repeats after one
warm-up each; and how many greedy rows are identical to generate's (bf16 kernels can break
near-ties differently, so a few differing rows are not a bug).
Training: one step of each script's loss (gspo, grpo, ppo with its critic and reference model),
as benchmarks/memory.py defines it: old log-probs of the rollout, then --minibatches updates of
(backward, AdamW step); float32 log-probs through the output projection in chunks of ~110 tokens
("chunked") or all at once ("naive"); tokens/s = rollout tokens / step time (median of 2 after one
warm-up); peak = torch.cuda.max_memory_allocated during the step (weights, grads, optimizer state
included). Everything prints as one table at the end.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tools"))
import build_checkpoints  # noqa: E402
from memory import training_step  # noqa: E402

import common  # noqa: E402

QWEN25_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151_936,
    max_position_embeddings=32768,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
SMOKE = dict(
    QWEN25_05B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)


def timed(fn, device, repeats: int):
    """Median seconds of fn() over `repeats` runs after one warm-up, and its last result."""
    out = fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_reset(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gb(device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model and sizes on CPU: checks that it runs")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--minibatches", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--algos", default="gspo,grpo,ppo")
    ap.add_argument("--modes", default="chunked,naive")
    ap.add_argument("--skip-generate", action="store_true", help="leave HF generate out of the rollout table")
    args = ap.parse_args()
    if args.cpu_smoke:
        args.batch, args.new_tokens, args.prompt_len, args.repeats = 8, 8, 8, 1
        device, dtype, dims = torch.device("cpu"), torch.float32, SMOKE
    else:
        if not torch.cuda.is_available():
            sys.exit("error: no CUDA device (use --cpu-smoke to try it on CPU)")
        # float32 master weights and TF32 matmuls, the training forward under bf16 autocast:
        # what common.load_model and common.completion_hidden_states do on CUDA
        device, dtype, dims = torch.device("cuda"), torch.float32, QWEN25_05B
        torch.backends.cuda.matmul.allow_tf32 = True
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    t_start = time.perf_counter()
    tok = build_checkpoints.build_char_tokenizer()
    pad, eos = tok.pad_token_id, tok.eos_token_id
    torch.manual_seed(0)
    config = Qwen2Config(pad_token_id=pad, eos_token_id=eos, bos_token_id=None, **dims)
    with device:
        model = Qwen2ForCausalLM(config).to(dtype).eval()
    model.generation_config = GenerationConfig(eos_token_id=[eos], pad_token_id=pad)
    n_params = sum(p.numel() for p in model.parameters())
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"{gpu}: random Qwen2 {n_params / 1e6:.0f}M parameters, {dtype}; {args.batch} x {args.new_tokens} new tokens, "
        f"prompts {args.prompt_len // 2}-{args.prompt_len} tokens",
        flush=True,
    )

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.prompt_len // 2, args.prompt_len + 1, (args.batch,), generator=g).tolist()
    prompts = [torch.randint(2, config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    T, B = args.new_tokens, args.batch
    rollout_rows, train_rows = [], []

    # ---- rollout --------------------------------------------------------------------------
    gen = torch.Generator(device).manual_seed(0)
    samplers = [
        ("common.sample", lambda: common.sample(model, prompts, T, [], pad, greedy=True)),
        (
            "common.sample, temperature 1",
            lambda: common.sample(model, prompts, T, [], pad, temperature=1.0, generator=gen),
        ),
    ]
    if not args.skip_generate:
        batch = common.Rollout.from_lists(prompts, [[]] * B, pad, device)

        def generate():
            with torch.no_grad():
                out = model.generate(
                    input_ids=batch.prompt_ids,
                    attention_mask=batch.prompt_mask,
                    max_new_tokens=T,
                    do_sample=False,
                    eos_token_id=[],
                    pad_token_id=pad,
                )
            return out[:, batch.prompt_ids.shape[1] :]

        samplers.append(("HF model.generate", generate))
    outputs = {}
    for name, fn in samplers:
        peak_reset(device)
        try:
            seconds, out = timed(fn, device, args.repeats)
        except Exception as e:  # report it and measure the rest
            print(f"  rollout {name}: FAILED {e.__class__.__name__}: {str(e).splitlines()[0][:200]}", flush=True)
            rollout_rows.append([name, float("nan"), float("nan"), float("nan")])
            continue
        outputs[name] = out.completion_ids if isinstance(out, common.Rollout) else out
        rollout_rows.append([name, B * T / seconds, seconds, peak_gb(device)])
        print(f"  rollout {name}: {B * T / seconds:.0f} tok/s", flush=True)
    greedy_name = next(name for name, _ in samplers if name in outputs and "temperature" not in name)
    greedy = outputs[greedy_name]
    agree = {
        name: int((outputs[name] == greedy).all(1).sum())
        for name in outputs
        if name != greedy_name and "temperature" not in name
    }
    gen_rate = next((r[1] for r in rollout_rows if r[0] == "HF model.generate"), None)

    # ---- training ---------------------------------------------------------------------------
    completions = greedy.tolist()  # greedy tokens: full length, all real
    roll = common.Rollout.from_lists(prompts, completions, pad, device)
    rewards = torch.randint(0, 2, (B,), generator=g).float().to(device)
    import ppo

    for algo in args.algos.split(","):
        ref_model = critic = None
        if algo == "ppo":  # the frozen reference and the critic (a second trunk, loaded as ppo.Critic does)
            ref_model = copy.deepcopy(model).requires_grad_(False)
            with tempfile.TemporaryDirectory() as tmp:
                model.save_pretrained(tmp)
                tok.save_pretrained(tmp)
                critic = ppo.Critic(tmp, device)  # trunk in the model's dtype, float32 head (as ppo.py has it)
        for mode in args.modes.split(","):
            params = list(model.parameters()) + (list(critic.parameters()) if critic is not None else [])
            optimizer = torch.optim.AdamW(params, lr=1e-6)
            # partial binds this configuration's objects now (a closure would read the loop variables,
            # and the names deleted below, whenever it ran)
            step = functools.partial(
                training_step,
                algo,
                model,
                roll,
                rewards,
                chunk_tokens="auto" if mode == "chunked" else None,
                minibatches=args.minibatches,
                updates=args.minibatches,
                optimizer=optimizer,
                ref_model=ref_model,
                critic=critic,
            )
            peak_reset(device)
            try:
                seconds, loss = timed(step, device, 1 if args.cpu_smoke else 2)
                train_rows.append([algo, mode, B * T / seconds, seconds, peak_gb(device)])
            except Exception as e:  # out of memory, or anything else: report it and measure the rest
                print(
                    f"  train {algo} {mode}: FAILED {e.__class__.__name__}: {str(e).splitlines()[0][:200]}", flush=True
                )
                train_rows.append([algo, mode, float("nan"), float("nan"), float("nan")])
            print(f"  train {algo} {mode}: {train_rows[-1][2]:.0f} tok/s, peak {train_rows[-1][4]:.2f} GB", flush=True)
            del step, optimizer  # the AdamW state goes before the next configuration's peak is measured
            model.zero_grad(set_to_none=True)
            if critic is not None:
                critic.zero_grad(set_to_none=True)
        del ref_model, critic

    # ---- the table ----------------------------------------------------------------------------
    print(f"\n{gpu}, random Qwen2.5-0.5B-sized model ({n_params / 1e6:.0f}M, {dtype}), {B} x {T} new tokens")
    print(f"{'rollout':34} {'tok/s':>9} {'s':>7} {'peak GB':>8} {'vs generate':>12}")
    for name, rate, seconds, peak in rollout_rows:
        vs = f"{rate / gen_rate:.2f}x" if gen_rate else "-"
        print(f"{name:34} {rate:9.0f} {seconds:7.2f} {peak:8.2f} {vs:>12}")
    for name, n in agree.items():
        print(f"  greedy rows identical to {greedy_name}'s: {name} {n}/{B}")
    print(f"{'training step (old logp + updates)':34} {'tok/s':>9} {'s':>7} {'peak GB':>8}")
    for algo, mode, rate, seconds, peak in train_rows:
        print(f"{algo + ' ' + mode:34} {rate:9.0f} {seconds:7.2f} {peak:8.2f}")
    print(f"total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
