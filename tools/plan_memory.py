"""tools/plan_memory.py: will it fit? The expected peak memory of one training step, by component,
before anything is loaded or downloaded.

    python tools/plan_memory.py --model qwen2.5-0.5b qwen2.5-7b --algo grpo --grad-checkpointing
    python tools/plan_memory.py --model qwen2.5-7b --algo grpo --grad-checkpointing --fsdp 4   # per GPU
    python tools/plan_memory.py --model qwen2.5-7b --grad-checkpointing --compare-gpus 1 2 4 8   # DDP vs FSDP2

`plan_memory` counts float32 master weights, gradients, AdamW's two moments, the reference and the
critic where the script keeps them, activations per token of a Qwen2 / Qwen3 decoder layer, the
largest chunk of the log-probs, and the sampler's KV cache; the peak is the fixed part plus the
larger of the sampling and the update phase. Under torchrun (--ddp N, --fsdp N) the figures are one
rank's (one GPU's): DistributedDataParallel replicas or FSDP2 shards, each with 1/N of the batch.
docs/memory.md compares it with measured peaks (benchmarks/real_size.py, benchmarks/gpu.py);
tests/test_memory_plan.py checks it against autograd's saved tensors.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py, when run as a script

from cli import ArgumentParser, number  # noqa: E402

from common import UsageError, _describe, die, logits_chunk_elements  # noqa: E402

# Published configurations (the fields that set memory and the dry run's shapes), so that the planner
# and benchmarks/real_size.py need no download. Qwen2 has q/k/v biases; Qwen3 has per-head q/k norms.
QWEN_CONFIGS = {
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         tie_word_embeddings=True, max_position_embeddings=32768),
    "qwen2.5-1.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         tie_word_embeddings=True, max_position_embeddings=32768),
    "qwen2.5-3b": dict(model_type="qwen2", vocab_size=151936, hidden_size=2048, intermediate_size=11008,
                       num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                       tie_word_embeddings=True, max_position_embeddings=32768),
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       tie_word_embeddings=False, max_position_embeddings=32768),
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       tie_word_embeddings=True, max_position_embeddings=40960),
}  # fmt: skip


for _c in QWEN_CONFIGS.values():  # shared by all five
    _c.update(rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu")

# --gpu-memory's default: an 80 GB A100 / H100. The GPU's size sets the log-prob chunk on CUDA
# (common.logits_chunk_elements); benchmarks/gpu.py passes the real GPU's
GPU_MEMORY_GB = 80


def model_shape(config) -> dict:
    """The sizes the planner needs from a config (a dict of config.json fields, or a PretrainedConfig)."""
    c = config if isinstance(config, dict) else config.to_dict()
    H, heads = c["hidden_size"], c["num_attention_heads"]
    D = c.get("head_dim") or H // heads
    return dict(V=c["vocab_size"], H=H, I=c["intermediate_size"], L=c["num_hidden_layers"], heads=heads,
                kv_heads=c["num_key_value_heads"], D=D, q=heads * D, kv=c["num_key_value_heads"] * D,
                tied=c.get("tie_word_embeddings", False), qk_norm=c.get("model_type") == "qwen3",
                qkv_bias=c.get("model_type") == "qwen2" or c.get("attention_bias", False))  # fmt: skip


def linear_shapes(s: dict) -> dict:
    """(in, out) features of each projection of one decoder layer."""
    H, I, q, kv = s["H"], s["I"], s["q"], s["kv"]
    return {"q_proj": (H, q), "k_proj": (H, kv), "v_proj": (H, kv), "o_proj": (q, H),
            "gate_proj": (H, I), "up_proj": (H, I), "down_proj": (I, H)}  # fmt: skip


def count_parameters(s: dict) -> dict:
    """{"trunk": embedding + layers + final norm, "lm_head": 0 when tied to the embedding}."""
    per_layer = sum(i * o for i, o in linear_shapes(s).values()) + 2 * s["H"]  # projections, two RMSNorms
    per_layer += (s["q"] + 2 * s["kv"]) * s["qkv_bias"] + 2 * s["D"] * s["qk_norm"]
    trunk = s["V"] * s["H"] + s["L"] * per_layer + s["H"]
    return {"trunk": trunk, "lm_head": 0 if s["tied"] else s["V"] * s["H"]}


def activation_elements_per_token(s: dict, grad_checkpointing: bool) -> int:
    """Elements autograd saves for backward per token of a training forward (the decoder, float32),
    counted from the saved tensors of a Qwen2 / Qwen3 layer (tests/test_memory_plan.py measures them):
    per layer 6H (two RMSNorms' input and output, the projections' inputs) + 4I (gate, up, act(gate),
    the down projection's input) + 2q + 2kv + heads (attention: rotated q, k, v, output, logsumexp)
    + 2 (norm statistics); Qwen3's q/k norms add 2q + 2kv + heads + kv_heads. Once per forward: the
    final norm (2H + 1), cos and sin (2D), the ids. With gradient checkpointing a layer keeps only its
    input (H), and backward recomputes one layer at a time."""
    layer = 6 * s["H"] + 4 * s["I"] + 2 * s["q"] + 2 * s["kv"] + s["heads"] + 2
    if s["qk_norm"]:
        layer += 2 * s["q"] + 2 * s["kv"] + s["heads"] + s["kv_heads"]
    once = 2 * s["H"] + 1 + 2 * s["D"] + 2
    return once + (s["L"] * s["H"] + layer if grad_checkpointing else s["L"] * layer)


def plan_memory(
    config,
    algo: str,
    rows: int,
    prompt_tokens: int,
    new_tokens: int,
    minibatches: int = 1,
    grad_checkpointing: bool = False,
    lora_rank: int = 0,
    reference: bool | None = None,
    reward_model=None,
    device: str = "cuda",
    rollout_dtype: str = "float32",
    parallel: str | None = None,
    world: int = 1,
    gpu_memory: int | None = None,
) -> dict:
    """Expected peak memory in bytes, by component, of one script's training step: `rows` completions
    per step (prompts x group size) of `prompt_tokens` + `new_tokens` tokens, in `minibatches` updates.
    Float32 master weights, AdamW; on "cuda" the training forward runs under bf16 autocast (activations
    half size, plus a bf16 copy of the weights that autocast keeps for backward); on "cpu" everything is
    float32 and the sampler adds its fused q/k/v and gate/up weight copies (see _StaticKVDecoder).

    reference: a frozen copy of the initial policy (PPO always; GRPO with --kl-coef > 0; any script
    with --reward-model, for kl_to_init); None = the script's default. With LoRA (lora_rank > 0) only
    the adapters train and the reference is the base model with adapters off (no copy). The critic
    (PPO) is a second trunk with its own gradients and AdamW state (with LoRA: frozen, and only its own
    adapters and value head train); its loss goes backward before the policy's forward, so one trunk's
    activations are alive at a time.
    reward_model: its config (scored without gradients; its activations are not counted).
    rollout_dtype "bfloat16" (--rollout-dtype): the sampler's bf16 copy of the weights (made for each
    rollout and freed after it), a bf16 KV cache and bf16 fused weights.
    gpu_memory: on "cuda", one GPU's memory in bytes (its properties' total_memory; None: GPU_MEMORY_GB),
    which sizes the log-prob chunk as the scripts size it (common.logits_chunk_elements).
    parallel: None = one process (world 1); "ddp" or "fsdp" = torchrun with `world` ranks, each with
    1/world of the `rows` (its activations, KV cache, log-prob chunks), and the figures are one rank's.
    "ddp": every rank holds the whole weights, gradients and AdamW state, plus DistributedDataParallel's
    gradient buckets (a second float32 copy of the trained parameters' gradients: gradient_as_bucket_view
    is off). "fsdp": FSDP2 (fully_shard on each decoder layer, then the root) on the policy, the critic
    and the reference: 1/world of their float32 weights, gradients and AdamW state per rank (each
    parameter's padding to a multiple of `world` rows is ignored). The training forward and backward
    gather two layers at a time (one prefetched) with their unsharded gradients, and the root's own
    parameters (embedding, final norm, lm_head) for the whole pass, in bf16 on CUDA with bf16 rollouts
    (MixedPrecisionPolicy; no autocast copy) and float32 otherwise; each rollout gathers the whole policy.
    The critic's gathered trunk is the policy's (plus its value head) and goes before the policy's
    forward; the no-grad forwards of pi_old and the reference gather as much, without activations.
    peak = the fixed part + the larger of the sampling phase and the update phase."""
    if parallel not in (None, "ddp", "fsdp") or world < 1 or (parallel is None and world != 1) or rows % world:
        raise ValueError(f"plan_memory: parallel {parallel!r} with world {world} for {rows} rows")
    fsdp = parallel == "fsdp"
    if fsdp and lora_rank:
        raise ValueError("plan_memory: FSDP2 with LoRA is not planned")
    s = model_shape(config)
    n = count_parameters(s)
    params = n["trunk"] + n["lm_head"]
    lora = lora_rank * sum((i + o) for i, o in linear_shapes(s).values()) * s["L"]
    trainable = lora if lora_rank else params
    if reference is None:
        reference = algo == "ppo" or reward_model is not None
    cuda, f32 = device == "cuda", 4
    act_bytes = 2 if cuda else f32  # bf16 under autocast (its norm statistics stay float32: a small share)
    shards = world if fsdp else 1

    def sharded(nbytes: int) -> int:  # one rank's share of what FSDP2 shards
        return -(-nbytes // shards)

    gathered_bytes = 2 if cuda and rollout_dtype == "bfloat16" else f32  # FSDP2's unsharded weights and gradients
    rows_rank = rows // world  # this rank's completions
    rows_mb = -(-rows_rank // minibatches)
    seq = prompt_tokens + new_tokens
    acts = rows_mb * seq * activation_elements_per_token(s, grad_checkpointing) * act_bytes
    if cuda and gpu_memory is None:
        gpu_memory = GPU_MEMORY_GB * 2**30
    chunk_tokens = min(rows_mb * new_tokens, max(1, logits_chunk_elements(device, gpu_memory) // s["V"]))
    plan = {
        "weights": sharded((params + lora) * f32),  # the base, and the adapters (LoRA)
        "gradients": sharded(trainable * f32),
        "adamw_state": sharded(2 * trainable * f32),
        "reference": sharded(params * f32) if reference and not lora_rank else 0,
        "critic": 0,
        "reward_model": 0,
        # bf16 casts of the weights, kept until backward: in autocast's cache (weights that train) or as saved
        # tensors; frozen LoRA bases under gradient checkpointing are cast again layer by layer. Under FSDP2
        # with float32 gathered weights autocast runs uncached (common.completion_hidden_states): with gradient
        # checkpointing each layer's cast is freed with it; without, backward keeps every layer's: the whole trunk
        "autocast_weight_copy": n["trunk"] * 2
        if cuda
        and not (lora_rank and grad_checkpointing)
        and not (fsdp and (gathered_bytes == 2 or grad_checkpointing))
        else 0,
        "ddp_gradient_buckets": trainable * f32 if parallel == "ddp" else 0,
    }
    if algo == "ppo":  # trunk + scalar head: weights, gradients, AdamW; with LoRA a frozen trunk + its own adapters
        critic = n["trunk"] + s["H"] + 1
        plan["critic"] = (n["trunk"] + 4 * (lora + s["H"] + 1)) * f32 if lora_rank else sharded(4 * critic * f32)
        # its forward on the same minibatch goes backward before the policy's forward: one trunk's activations at a time
        if parallel == "ddp":  # the critic is a DDP replica too
            plan["ddp_gradient_buckets"] += (lora + s["H"] + 1 if lora_rank else critic) * f32
    if reward_model is not None:
        rm = model_shape(reward_model)
        plan["reward_model"] = (count_parameters(rm)["trunk"] + rm["H"]) * f32
    rollout_bytes = 2 if rollout_dtype == "bfloat16" else f32  # the sampler's dtype
    kv_cache = rows_rank * seq * s["L"] * 2 * s["kv"] * rollout_bytes  # the sampler's K and V, in its dtype
    sampler_logits = 4 * rows_rank * s["V"] * f32  # logits, probabilities, top-p's sorted copy, entropy's
    fused = s["L"] * (s["H"] * (s["q"] + 2 * s["kv"]) + 2 * s["H"] * s["I"]) * rollout_bytes if not cuda else 0
    root = s["V"] * s["H"] + s["H"] + n["lm_head"]  # FSDP2's root module: embedding, final norm, lm_head (0 if tied)
    layer = (n["trunk"] - s["V"] * s["H"] - s["H"]) // s["L"]  # one decoder layer's parameters
    update = {
        "activations": acts,
        "logprob_chunk": 4 * chunk_tokens * s["V"] * f32,  # logits, softmax, product or gradient
        # a tied embedding gets two [V, H] gradients (output projection, input lookup) before autograd sums them
        "tied_embedding_grad": s["V"] * s["H"] * (gathered_bytes if fsdp else f32)
        if s["tied"] and not lora_rank
        else 0,
        # FSDP2: the root gathered for the whole forward and backward, and its gradients unsharded until its
        # reduce-scatter (the last); two layers (one prefetched) and their gradients; the float32 input of a
        # reduce-scatter (foreach_reduce), largest for the root's at the end of backward
        "fsdp_gathered_root": root * gathered_bytes if fsdp else 0,
        "fsdp_root_gradients": root * gathered_bytes if fsdp else 0,
        "fsdp_gathered_layers": 2 * 2 * layer * gathered_bytes if fsdp else 0,
        "fsdp_reduce_scatter_input": max(root, layer) * f32 if fsdp else 0,
    }
    sampling = {"kv_cache": kv_cache, "sampler_logits": sampler_logits, "sampler_fused_weights": fused}
    sampling["fsdp_gathered_policy"] = params * gathered_bytes if fsdp else 0  # FSDP2: unshard() before each rollout
    # common.Sampler's bf16 copy, per rollout; under FSDP2 on CUDA it samples from the gathered weights themselves
    sampling["rollout_copy"] = (params + lora) * 2 if rollout_dtype == "bfloat16" and not (fsdp and cuda) else 0
    fixed = sum(plan.values())
    plan.update(update)
    plan.update(sampling)
    plan["peak"] = fixed + max(sum(update.values()), sum(sampling.values()))
    plan["parameters"], plan["trainable_parameters"] = params, trainable
    return plan


PLAN_ROWS = [  # (key, label, phase) in the printed table
    ("weights", "policy weights (float32)", "fixed"),
    ("gradients", "gradients", "fixed"),
    ("adamw_state", "AdamW state (2 moments)", "fixed"),
    ("reference", "reference (frozen copy)", "fixed"),
    ("critic", "critic (PPO: trunk, grads, AdamW)", "fixed"),
    ("reward_model", "reward model", "fixed"),
    ("autocast_weight_copy", "bf16 weight copy (autocast)", "fixed"),
    ("ddp_gradient_buckets", "DDP gradient buckets", "fixed"),
    ("activations", "activations (one minibatch)", "update"),
    ("logprob_chunk", "largest log-prob chunk", "update"),
    ("tied_embedding_grad", "tied embedding's 2nd gradient", "update"),
    ("fsdp_gathered_root", "FSDP2 root: embed, norm, head", "update"),
    ("fsdp_root_gradients", "FSDP2 root's gradients", "update"),
    ("fsdp_gathered_layers", "FSDP2 2 layers + gradients", "update"),
    ("fsdp_reduce_scatter_input", "FSDP2 reduce-scatter input", "update"),
    ("kv_cache", "sampler KV cache", "sampling"),
    ("sampler_logits", "sampler logits", "sampling"),
    ("sampler_fused_weights", "sampler fused weights (CPU)", "sampling"),
    ("rollout_copy", "bf16 rollout weights", "sampling"),
    ("fsdp_gathered_policy", "FSDP2 gathered policy", "sampling"),
]


def load_config(spec: str) -> dict:
    """A named config (QWEN_CONFIGS) or a checkpoint directory's config.json."""
    if spec in QWEN_CONFIGS:
        return QWEN_CONFIGS[spec]
    path = Path(spec) / "config.json" if Path(spec).is_dir() else Path(spec)
    if not path.is_file():
        raise UsageError(f"--model {spec}: neither a named config ({', '.join(QWEN_CONFIGS)}) nor a config.json")
    try:
        config = json.loads(path.read_text())
        model_shape(config)
    except (ValueError, KeyError) as e:
        raise UsageError(f"--model {spec}: not a decoder config ({_describe(e)})") from e
    return config


def plan_memory_cli(argv=None):
    """python tools/plan_memory.py --model qwen2.5-0.5b --algo grpo ...: the expected peak memory
    of a training step by component (`plan_memory`), one column per --model; per GPU under torchrun
    with --ddp N or --fsdp N; --compare-gpus 1 2 4 8: only the peaks, DDP against FSDP2, as a table."""

    p = ArgumentParser(prog="python tools/plan_memory.py", description=plan_memory_cli.__doc__.split(":")[0])
    p.add_argument("--model", nargs="+", default=["qwen2.5-0.5b"], help=f"{', '.join(QWEN_CONFIGS)} or a dir")
    p.add_argument("--algo", choices=["ppo", "grpo", "gspo"], default="grpo")
    p.add_argument("--prompts-per-step", type=number(int), default=32)
    p.add_argument("--group-size", type=number(int), default=8)
    p.add_argument("--prompt-tokens", type=number(int), default=128, help="longest prompt, in tokens")
    p.add_argument("--max-new-tokens", type=number(int), default=512)
    p.add_argument("--minibatches", type=number(int), default=4)
    p.add_argument("--grad-checkpointing", action="store_true")
    p.add_argument("--lora-rank", type=number(int), default=0)
    p.add_argument("--kl-coef", type=number(float), default=0.0, help="GRPO: > 0 keeps a reference")
    p.add_argument("--reward-model", help="its config: a named config or a dir")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--rollout-dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--gpu-memory", type=number(float), default=GPU_MEMORY_GB, metavar="GB",
                   help="--device cuda: one GPU's memory, GB (2^30 bytes), which sizes the log-prob chunk")  # fmt: skip
    ranks = p.add_mutually_exclusive_group()
    ranks.add_argument("--ddp", type=number(int), metavar="N", help="per GPU: torchrun, N ranks, DDP")
    ranks.add_argument("--fsdp", type=number(int), metavar="N", help="per GPU: torchrun, N ranks, FSDP2")
    ranks.add_argument("--compare-gpus", type=number(int), nargs="+", metavar="N",
                       help="the peaks of one process, DDP and FSDP2 on each N GPUs: a markdown table")  # fmt: skip
    a = p.parse_args(argv)
    gpus = a.compare_gpus or [n for n in (a.ddp, a.fsdp) if n is not None]  # [] for one process
    try:
        if min(a.prompts_per_step, a.group_size, a.max_new_tokens, a.minibatches) < 1 or a.lora_rank < 0:
            raise UsageError("sizes must be >= 1 and --lora-rank >= 0")
        if a.gpu_memory <= 0:
            raise UsageError(f"--gpu-memory must be > 0 GB, got {a.gpu_memory}")
        if min(gpus, default=1) < 1:
            raise UsageError("--ddp, --fsdp and --compare-gpus take numbers of GPUs >= 1")
        for n in gpus:  # as the scripts ask under torchrun
            if a.prompts_per_step % n:
                raise UsageError(f"--prompts-per-step {a.prompts_per_step} must split into {n} equal shares, one a GPU")
        if a.lora_rank and (a.fsdp is not None or a.compare_gpus):
            raise UsageError("--lora-rank with FSDP2 (--fsdp, --compare-gpus) is not planned")
        configs = [load_config(m) for m in a.model]
        rm = load_config(a.reward_model) if a.reward_model else None
    except UsageError as e:
        die(str(e))
    reference = a.algo == "ppo" or rm is not None or (a.algo == "grpo" and a.kl_coef > 0)
    rows = a.prompts_per_step * a.group_size

    def plan(config, parallel=None, world=1):
        return plan_memory(config, a.algo, rows, a.prompt_tokens, a.max_new_tokens, a.minibatches,
                           a.grad_checkpointing, a.lora_rank, reference, rm, a.device, a.rollout_dtype,
                           parallel, world, int(a.gpu_memory * 2**30))  # fmt: skip

    print(f"{a.algo}: {rows} completions x ({a.prompt_tokens} + {a.max_new_tokens}) tokens, {a.minibatches} "
          f"minibatches, {a.device}{f' ({a.gpu_memory:g} GB)' if a.device == 'cuda' else ''}"
          f"{', grad checkpointing' if a.grad_checkpointing else ''}"
          f"{f', LoRA rank {a.lora_rank}' if a.lora_rank else ''}, {a.rollout_dtype} rollouts; "
          "GB (2^30 bytes)" + (" per GPU" if gpus else ""))  # fmt: skip
    if a.compare_gpus:  # one row per model: one process, then DDP and FSDP2 on each number of GPUs
        columns = [(None, 1)] + [(parallel, n) for n in gpus for parallel in ("ddp", "fsdp")]
        names = {"ddp": "DDP", "fsdp": "FSDP2"}
        print("| model | one process | " + " | ".join(f"{names[parallel]} x{n}" for parallel, n in columns[1:]) + " |")
        print("|---" * (len(columns) + 1) + "|")
        for name, config in zip(a.model, configs):
            peaks = [plan(config, parallel, n)["peak"] / 2**30 for parallel, n in columns]
            print(f"| {name} | " + " | ".join(f"{peak:.1f}" for peak in peaks) + " |")
        return
    parallel = "ddp" if a.ddp is not None else "fsdp" if a.fsdp is not None else None
    plans = [plan(c, parallel, max(gpus, default=1)) for c in configs]
    width = max(12, *(len(m) + 2 for m in a.model))
    print(f"{'':42}" + "".join(f"{m:>{width}}" for m in a.model))
    for key, label, phase in PLAN_ROWS:
        if any(plan[key] for plan in plans):
            print(f"{label + ' [' + phase + ']':42}" + "".join(f"{plan[key] / 2**30:>{width}.2f}" for plan in plans))
    print(f"{'peak: fixed + max(update, sampling)':42}" + "".join(f"{p['peak'] / 2**30:>{width}.2f}" for p in plans))


if __name__ == "__main__":
    plan_memory_cli()
