"""The memory planner (tools/plan_memory.py) against independent counts: HF's parameter counts, the bytes
autograd saves, the sampler's buffers, hand-worked plans. Against measured peaks: benchmarks/real_size.py."""

import plan_memory  # tools/, on sys.path through conftest.py
import pytest
import torch
import transformers
from helpers import in_process

import common


@pytest.mark.parametrize("name", list(plan_memory.QWEN_CONFIGS))
def test_parameter_count_matches_the_hugging_face_model(name):
    fields = dict(plan_memory.QWEN_CONFIGS[name])
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    n = plan_memory.count_parameters(plan_memory.model_shape(plan_memory.QWEN_CONFIGS[name]))
    assert n["trunk"] + n["lm_head"] == sum(p.numel() for p in model.parameters())
    assert n["trunk"] == sum(p.numel() for p in model.get_decoder().parameters())


def test_published_sizes():
    """The named configs are the published models: 0.49B, 0.6B (0.44B without embeddings), 7.6B."""
    count = lambda name: sum(
        plan_memory.count_parameters(plan_memory.model_shape(plan_memory.QWEN_CONFIGS[name])).values()
    )  # noqa: E731
    assert round(count("qwen2.5-0.5b") / 1e9, 2) == 0.49
    assert round(count("qwen2.5-1.5b") / 1e9, 2) == 1.54
    assert round(count("qwen2.5-3b") / 1e9, 2) == 3.09
    assert round(count("qwen2.5-7b") / 1e9, 2) == 7.62
    q3 = plan_memory.QWEN_CONFIGS["qwen3-0.6b"]
    assert round((count("qwen3-0.6b") - q3["vocab_size"] * q3["hidden_size"]) / 1e9, 2) == 0.44


def saved_bytes(model, roll) -> int:
    """Bytes of the distinct non-parameter tensors autograd saves during a training forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        common.completion_hidden_states(model.get_decoder(), roll)
    return sum(seen.values())


SHAPES = {  # every size different, so that a coefficient on the wrong one shows
    "qwen3": dict(hidden_size=80, intermediate_size=176, num_hidden_layers=3, num_attention_heads=6,
                  num_key_value_heads=2, head_dim=24),
    "qwen2": dict(hidden_size=96, intermediate_size=208, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2),
}  # fmt: skip


@pytest.mark.parametrize("model_type", list(SHAPES))
@pytest.mark.parametrize("rows,prompt,new", [(3, 7, 5), (2, 4, 11)])
def test_activation_count_matches_what_autograd_saves(model_type, rows, prompt, new):
    fields = dict(SHAPES[model_type], vocab_size=50, pad_token_id=0, eos_token_id=1, tie_word_embeddings=True)
    config = transformers.AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    g = torch.Generator().manual_seed(1)
    roll = common.Rollout.from_lists(
        torch.randint(2, 50, (rows, prompt), generator=g).tolist(),
        torch.randint(2, 50, (rows, new), generator=g).tolist(),
        0,
    )
    planned = (
        rows
        * (prompt + new)
        * plan_memory.activation_elements_per_token(plan_memory.model_shape(fields | {"model_type": model_type}), False)
        * 4
    )
    assert saved_bytes(model, roll) == planned


def test_hand_worked_plan():
    """Qwen2.5-0.5B, GRPO, 8 completions of 6 + 32 tokens, 2 minibatches, CPU, worked by hand."""
    c = plan_memory.QWEN_CONFIGS["qwen2.5-0.5b"]
    plan = plan_memory.plan_memory(c, "grpo", 8, 6, 32, 2, device="cpu")
    n = 494_032_768
    assert (plan["weights"], plan["gradients"], plan["adamw_state"]) == (4 * n, 4 * n, 8 * n)
    assert plan["reference"] == plan["critic"] == plan["autocast_weight_copy"] == 0
    per_layer = 6 * 896 + 4 * 4864 + 2 * 896 + 2 * 128 + 14 + 2  # q = 14 x 64 = 896, kv = 2 x 64 = 128
    per_token = 24 * per_layer + 2 * 896 + 1 + 2 * 64 + 2
    assert plan["activations"] == 4 * 38 * per_token * 4
    assert plan["logprob_chunk"] == 4 * (2**24 // 151_936) * 151_936 * 4  # 128 tokens: more than a chunk's 110
    assert plan["kv_cache"] == 8 * 38 * 24 * 2 * 128 * 4
    fixed = 16 * n
    assert plan["tied_embedding_grad"] == 151_936 * 896 * 4
    update = plan["activations"] + plan["logprob_chunk"] + plan["tied_embedding_grad"]
    sampling = plan["kv_cache"] + plan["sampler_logits"] + plan["sampler_fused_weights"]
    assert plan["peak"] == fixed + max(update, sampling)
    ppo = plan_memory.plan_memory(c, "ppo", 8, 6, 32, 2, device="cpu")
    assert ppo["reference"] == 4 * n and ppo["critic"] == 16 * (n + 896 + 1)  # tied: the trunk is every weight
    assert ppo["activations"] == plan["activations"]  # the critic's backward runs before the policy's forward
    gpu = plan_memory.plan_memory(c, "grpo", 8, 6, 32, 2, device="cuda")
    assert gpu["activations"] * 2 == plan["activations"] and gpu["autocast_weight_copy"] == 2 * n


def test_the_log_prob_chunk_is_planned_as_the_gpu_sizes_it():
    """On CUDA the planner's log-prob chunk is common.logits_chunk_elements' for the GPU's memory (the function
    the scripts call): Qwen2.5-0.5B, 64 completions of 64 tokens in one minibatch (4,096 tokens, more than any
    chunk here). Hand-worked: 139 GiB / 512 -> 2**28 logits, 1,766 tokens of 151,936; 80 GiB (the default)
    -> 2**27, 883; 24 GiB -> 2**25, 220; 8 GiB -> 2**24, 110, a CPU's chunk whatever --gpu-memory says."""
    c, V = plan_memory.QWEN_CONFIGS["qwen2.5-0.5b"], 151_936
    plan = lambda **kw: plan_memory.plan_memory(c, "grpo", 64, 6, 64, 1, **kw)  # noqa: E731
    cpu = plan(device="cpu")
    assert cpu["logprob_chunk"] == plan(device="cpu", gpu_memory=139 * 2**30)["logprob_chunk"] == 4 * 110 * V * 4
    by_gib = {gib: plan(device="cuda", gpu_memory=gib * 2**30) for gib in (139, 80, 24, 8)}
    for gib, tokens in ((139, 1766), (80, 883), (24, 220), (8, 110)):
        assert by_gib[gib]["logprob_chunk"] == 4 * tokens * V * 4
        assert tokens == common.logits_chunk_elements("cuda", gib * 2**30) // V
        assert by_gib[gib]["peak"] - by_gib[8]["peak"] <= 4 * (tokens - 110) * V * 4  # the chunk moves the peak
    assert plan(device="cuda")["logprob_chunk"] == by_gib[plan_memory.GPU_MEMORY_GB]["logprob_chunk"]
    update = sum(by_gib[139][k] for k in ("activations", "logprob_chunk", "tied_embedding_grad"))
    sampling = sum(by_gib[139][k] for k in ("kv_cache", "sampler_logits", "sampler_fused_weights", "rollout_copy"))
    assert update > sampling and by_gib[139]["peak"] - by_gib[8]["peak"] == 4 * (1766 - 110) * V * 4  # all of it


def test_lora_trains_only_the_adapters():
    c = plan_memory.QWEN_CONFIGS["qwen2.5-0.5b"]
    plan = plan_memory.plan_memory(c, "ppo", 8, 6, 32, lora_rank=16, device="cuda")
    per_rank_layer = (896 + 896) + 2 * (896 + 128) + (896 + 896) + 2 * (896 + 4864) + (4864 + 896)
    assert plan["trainable_parameters"] == 16 * 24 * per_rank_layer
    lora = plan["trainable_parameters"]
    assert plan["gradients"] == 4 * lora and plan["adamw_state"] == 8 * lora and plan["reference"] == 0
    assert plan["weights"] == 4 * (494_032_768 + lora)  # the frozen base and the adapters
    assert plan["critic"] == 4 * 494_032_768 + 16 * (lora + 896 + 1)  # frozen trunk; adapters + head trained


def test_kv_cache_matches_the_sampler_buffers_and_bf16_rollouts_add_a_copy_while_sampling():
    """The sampler's cache, every slot written, float32 and a bf16 copy's (--rollout-dtype bfloat16), is what the
    plan says; the copy (2 bytes a parameter) counts in the sampling phase only."""
    fields = dict(SHAPES["qwen3"], vocab_size=50, pad_token_id=0, eos_token_id=1)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("qwen3", **fields))
    rows, prompt, new = 4, 5, 20
    roll = common.Rollout.from_lists([[3] * prompt] * rows, [[4]] * rows, 0)
    config = fields | {"model_type": "qwen3"}
    bf16 = plan_memory.plan_memory(config, "grpo", rows, prompt, new, device="cpu", rollout_dtype="bfloat16")
    f32 = plan_memory.plan_memory(config, "grpo", rows, prompt, new, device="cpu")
    for plan, dtype in ((f32, torch.float32), (bf16, torch.bfloat16)):
        decoder = common._StaticKVDecoder(model.to(dtype), roll, new)
        decoder.prefill()
        for _ in range(new):  # every slot written: the cache at its largest
            decoder.step(torch.full((rows,), 5))
        assert sum(t.nbytes for t in decoder.k + decoder.v) == plan["kv_cache"]
    assert bf16["kv_cache"] == f32["kv_cache"] // 2
    assert bf16["rollout_copy"] == 2 * sum(p.numel() for p in model.parameters()) and f32["rollout_copy"] == 0
    sampling = ("kv_cache", "sampler_logits", "sampler_fused_weights", "rollout_copy")
    update = ("activations", "logprob_chunk", "tied_embedding_grad")
    fixed = bf16["weights"] + bf16["gradients"] + bf16["adamw_state"]
    assert bf16["peak"] == fixed + max(sum(bf16[k] for k in update), sum(bf16[k] for k in sampling))


def qwen2_counts(name: str) -> dict:
    """Parameter counts of a named Qwen2 config, worked out here from its fields: one decoder layer (q, k, v,
    o, gate, up, down, their q/k/v biases, two RMSNorms), the root (embedding, final norm, untied lm_head)."""
    c = plan_memory.QWEN_CONFIGS[name]
    V, H, I, L = c["vocab_size"], c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    q = H  # heads x head_dim
    kv = c["num_key_value_heads"] * H // c["num_attention_heads"]
    layer = H * q + 2 * H * kv + q * H + 3 * H * I + (q + 2 * kv) + 2 * H
    root = V * H + H + (0 if c["tie_word_embeddings"] else V * H)
    return dict(V=V, H=H, layer=layer, root=root, total=root + L * layer, trunk=V * H + H + L * layer)


GSM8K_SHAPE = dict(rows=32 * 8, prompt_tokens=128, new_tokens=512, minibatches=4, grad_checkpointing=True)
UPDATE = ("activations", "logprob_chunk", "tied_embedding_grad", "fsdp_gathered_root", "fsdp_root_gradients",
          "fsdp_gathered_layers", "fsdp_reduce_scatter_input")  # fmt: skip
SAMPLING = ("kv_cache", "sampler_logits", "sampler_fused_weights", "rollout_copy", "fsdp_gathered_policy")


def fixed_part(plan: dict) -> int:
    return plan["peak"] - max(sum(plan[k] for k in UPDATE), sum(plan[k] for k in SAMPLING))


def test_ddp_keeps_the_whole_state_and_splits_the_batch():
    """DDP on 4 GPUs: every rank holds Qwen2.5-7B's float32 weights, gradients, AdamW moments and DDP's
    gradient buckets (a second float32 copy of the gradients), and a quarter of the batch's memory."""
    k = qwen2_counts("qwen2.5-7b")
    n = k["total"]
    c = plan_memory.QWEN_CONFIGS["qwen2.5-7b"]
    one = plan_memory.plan_memory(c, "grpo", **GSM8K_SHAPE)
    ddp = plan_memory.plan_memory(c, "grpo", **GSM8K_SHAPE, parallel="ddp", world=4)
    assert n == ddp["parameters"] == 7_615_616_512
    assert (ddp["weights"], ddp["gradients"], ddp["adamw_state"]) == (4 * n, 4 * n, 8 * n)
    assert ddp["ddp_gradient_buckets"] == 4 * n
    assert ddp["autocast_weight_copy"] == one["autocast_weight_copy"] and one["ddp_gradient_buckets"] == 0
    for key in ("activations", "kv_cache", "sampler_logits"):  # 64 completions a rank, 16 a minibatch
        assert ddp[key] * 4 == one[key]
    assert fixed_part(ddp) == fixed_part(one) + 4 * n
    ppo = plan_memory.plan_memory(c, "ppo", **GSM8K_SHAPE, parallel="ddp", world=4)
    critic = k["trunk"] + k["H"] + 1  # the trunk and a scalar head
    assert ppo["ddp_gradient_buckets"] == 4 * n + 4 * critic and ppo["critic"] == 16 * critic


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "qwen2.5-7b"])  # tied and untied embeddings
@pytest.mark.parametrize("world", [2, 8])
@pytest.mark.parametrize("device,rollout_dtype", [("cuda", "float32"), ("cuda", "bfloat16"), ("cpu", "bfloat16")])
def test_fsdp_shards_the_state_and_gathers_the_root_two_layers_and_the_policy(name, world, device, rollout_dtype):
    k = qwen2_counts(name)
    n, root, layer = k["total"], k["root"], k["layer"]
    c = plan_memory.QWEN_CONFIGS[name]
    shape = GSM8K_SHAPE | dict(device=device, rollout_dtype=rollout_dtype)
    one = plan_memory.plan_memory(c, "ppo", **shape)
    fsdp = plan_memory.plan_memory(c, "ppo", **shape, parallel="fsdp", world=world)
    gathered = 2 if (device, rollout_dtype) == ("cuda", "bfloat16") else 4  # MixedPrecisionPolicy's bf16, else float32
    critic = k["trunk"] + k["H"] + 1
    assert (fsdp["weights"], fsdp["gradients"], fsdp["adamw_state"]) == (4 * n // world, 4 * n // world, 8 * n // world)
    assert fsdp["reference"] == 4 * n // world and fsdp["critic"] == 16 * critic // world
    assert fsdp["ddp_gradient_buckets"] == 0
    # bf16 gathered weights need no autocast cast; with float32 ones on CUDA autocast runs uncached, and under
    # gradient checkpointing each layer's bf16 cast is freed with it; without, backward keeps every layer's
    assert fsdp["autocast_weight_copy"] == 0
    kept = plan_memory.plan_memory(c, "ppo", **(shape | dict(grad_checkpointing=False)), parallel="fsdp", world=world)
    assert kept["autocast_weight_copy"] == (2 * k["trunk"] if (device, gathered) == ("cuda", 4) else 0)
    assert fsdp["fsdp_gathered_root"] == fsdp["fsdp_root_gradients"] == root * gathered
    assert fsdp["fsdp_gathered_layers"] == 2 * 2 * layer * gathered and fsdp["fsdp_reduce_scatter_input"] == 4 * root
    tied = c["tie_word_embeddings"]
    assert fsdp["tied_embedding_grad"] == (k["V"] * k["H"] * gathered if tied else 0)
    assert fsdp["fsdp_gathered_policy"] == n * gathered
    assert fsdp["rollout_copy"] == (2 * n if device == "cpu" else 0)  # CPU: the bf16 copy of the gathered weights
    for key in ("activations", "kv_cache", "sampler_logits"):  # 256 / world completions a rank
        assert fsdp[key] * world == one[key]
    sharded = (4 + 4 + 8 + 4) * n // world + 16 * critic // world
    assert fixed_part(fsdp) == sharded + fsdp["autocast_weight_copy"]


def test_fsdp_on_one_gpu_shards_nothing_and_still_gathers():
    """One rank: FSDP2's shard is the whole state, yet the root, two layers and the policy are still gathered."""
    k = qwen2_counts("qwen2.5-0.5b")
    n = k["total"]
    c = plan_memory.QWEN_CONFIGS["qwen2.5-0.5b"]
    one = plan_memory.plan_memory(c, "ppo", **GSM8K_SHAPE)
    fsdp = plan_memory.plan_memory(c, "ppo", **GSM8K_SHAPE, parallel="fsdp", world=1)
    ddp = plan_memory.plan_memory(c, "ppo", **GSM8K_SHAPE, parallel="ddp", world=1)
    buckets = 4 * n + 4 * (k["trunk"] + k["H"] + 1)  # the policy's and the critic's gradients again
    copy = one["autocast_weight_copy"]  # one process keeps autocast's bf16 copy; FSDP2 frees it layer by layer
    assert fixed_part(fsdp) == fixed_part(one) - copy and fixed_part(ddp) == fixed_part(one) + buckets
    gathered_update = 2 * k["root"] * 4 + 4 * k["layer"] * 4 + 4 * k["root"]
    assert sum(fsdp[key] for key in UPDATE) == sum(one[key] for key in UPDATE) + gathered_update
    assert sum(fsdp[key] for key in SAMPLING) == sum(one[key] for key in SAMPLING) + 4 * n  # float32 on CUDA
    assert ddp["peak"] - one["peak"] == buckets and fsdp["peak"] > one["peak"]


def test_parallel_plans_reject_what_torchrun_would_not_run():
    c = plan_memory.QWEN_CONFIGS["qwen2.5-0.5b"]
    for bad in (dict(parallel="fsdp", world=3), dict(world=2), dict(parallel="zero", world=2),
                dict(parallel="fsdp", world=2, lora_rank=8)):  # fmt: skip
        with pytest.raises(ValueError):
            plan_memory.plan_memory(c, "grpo", 8, 6, 32, **bad)


def test_cli_prints_the_plans_and_the_comparison_table_and_rejects_bad_input(tmp_path, capsys):
    def cli(*argv):  # in this process: (exit status, stdout, stderr)
        return in_process(plan_memory.plan_memory_cli, argv, capsys)

    status, out, err = cli("--model", "qwen2.5-0.5b", "qwen3-0.6b", "--algo", "ppo")
    assert status == 0 and "peak" in out and "qwen3-0.6b" in out and "critic" in out, err
    status, out, _ = cli("--gpu-memory", 139)
    chunk = [line.split()[-1] for line in out.splitlines() if line.startswith("largest log-prob chunk")]
    assert status == 0 and "cuda (139 GB)" in out and chunk == ["4.00"], out  # 2**28 x 16 B
    two = ["--model", "qwen2.5-0.5b", "qwen2.5-7b", "--grad-checkpointing"]
    status, out, err = cli(*two, "--fsdp", 4)
    assert status == 0 and "per GPU" in out and "FSDP2 gathered policy" in out, err
    status, out, err = cli(*two, "--algo", "ppo", "--compare-gpus", 1, 8)
    lines = out.splitlines()
    assert status == 0 and lines[1] == "| model | one process | DDP x1 | FSDP2 x1 | DDP x8 | FSDP2 x8 |", err
    one_7b = plan_memory.plan_memory(plan_memory.QWEN_CONFIGS["qwen2.5-7b"], "ppo", **GSM8K_SHAPE)
    assert len(lines) == 5 and lines[4].startswith(f"| qwen2.5-7b | {one_7b['peak'] / 2**30:.1f} |")
    (tmp_path / "config.json").write_text("{}")
    for bad in (["--model", "qwen9-1b"], ["--model", tmp_path], ["--lora-rank", -1], ["--gpu-memory", 0],
                ["--fsdp", 0], ["--fsdp", 3], ["--ddp", 2, "--fsdp", 2], ["--fsdp", 2, "--lora-rank", 8]):  # fmt: skip
        status, _, err = cli(*bad)
        assert status == 2 and err.count("\n") == 1 and err.startswith("error:"), (bad, err)
