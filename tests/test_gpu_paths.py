"""The code paths that run only on CUDA, reached on a CPU by feeding them what CUDA would (tests/README.md)."""

import types

import pytest
import torch
from helpers import (
    assert_within,
    entropy_tol,
    greedy_generate,
    log_softmax_bounds,
    logit_scale,
    logp_entropy_f64,
    logprob_tol,
    sum_gamma,
    unit_roundoff,
)
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import common
from extras import distributed as distributed_extra
from extras import fsdp as fsdp_extra
from extras import resume as resume_extra

TEXTS = ["1+2=", "12+34=", "99+99=abc", "7", "5+5=10 and 3+", "42+", "8+8=", "x"]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model(rand_model):
    return rand_model  # conftest's


@pytest.fixture(scope="module")
def prompts(char_tok):
    return [char_tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]


def as_cuda_lays_it_out(out: torch.Tensor) -> torch.Tensor:
    """The same values [B, Hkv, M, D], laid out in memory as [B, M, Hkv, D]: what CUDA's fused SDPA
    kernels return (a view of it as [B, H, S, D] is impossible)."""
    strided = out.transpose(1, 2).contiguous().transpose(1, 2)
    assert not strided.is_contiguous() and torch.equal(strided, out)
    return strided


@pytest.fixture
def cuda_decoder(monkeypatch):
    """The decoder's CUDA branches on a CPU: separate q, k, v and gate, up projections (no fused copies),
    the fused SDPA kernel, and its output in CUDA's strided layout."""
    attention = common._attention
    monkeypatch.setattr(common._StaticKVDecoder, "FUSED_ON", ())
    monkeypatch.setattr(common, "_attention", lambda *a: as_cuda_lays_it_out(attention(*a, fused=True)))


# --- the decoder: any attention layout, the fused kernel, the unfused projections ---


def test_decoder_samples_the_same_whatever_layout_the_attention_output_has(model, prompts, char_tok, monkeypatch):
    """SDPA's strided output (the first GPU run crashed on its view) samples as the contiguous one."""
    pad, eos, T = char_tok.pad_token_id, [char_tok.eos_token_id, 40], 20
    runs = {}
    for layout in ("contiguous", "strided"):
        if layout == "strided":
            monkeypatch.setattr(common, "_attention", lambda *a, f=common._attention: as_cuda_lays_it_out(f(*a)))
        greedy = common.sample(model, prompts * 2, T, eos, pad, greedy=True)
        drawn = common.sample(model, prompts * 2, T, eos, pad, temperature=1.3,
                              generator=torch.Generator().manual_seed(4))  # fmt: skip
        runs[layout] = (greedy.completion_lists(), drawn.completion_lists())
    assert runs["strided"] == runs["contiguous"]
    assert any(len(c) < T for c in runs["contiguous"][0]), "fixture: some rows should stop early"


def test_cuda_decoder_branches_sample_greedily_as_hf_generate(model, prompts, char_tok, cuda_decoder):
    """The decoder as it runs on CUDA (unfused projections, SDPA, strided output) gives HF generate's
    greedy completions, rows stopping at different steps, past several cache growths (GROW = 16)."""
    pad, T = char_tok.pad_token_id, 40
    free = common.sample(model, prompts, T, [], pad, greedy=True)
    eos = sorted({int(free.completion_ids[0, 2]), int(free.completion_ids[2, 25])})
    ours = common.sample(model, prompts, T, eos, pad, greedy=True).completion_lists()
    assert ours == greedy_generate(model, prompts, T, eos, pad)
    assert len({len(c) for c in ours}) > 1, "fixture: rows should stop at different steps"


@given(M=st.integers(1, 6), N=st.integers(1, 40), masked=st.floats(0.0, 0.7), seed=st.integers(0, 2**16))
@example(M=1, N=1, masked=0.0, seed=0)
@example(M=6, N=40, masked=0.7, seed=1)
@settings(max_examples=30, deadline=None)
def test_fused_attention_equals_the_matmul_path_and_float64(M, N, masked, seed):
    """Both branches of _attention against float64, to bounds from sum_gamma of the scores and the softmax."""
    g = torch.Generator().manual_seed(seed)
    B, Hkv, D, scale = 2, 2, 8, 8**-0.5
    q, k, v = (torch.randn(B, Hkv, n, D, generator=g) * 2 for n in (M, N, N))
    hide = torch.rand(B, 1, M, N, generator=g) < masked
    hide[..., 0] = False  # every query sees at least one slot, as the decoder's do
    bias = torch.zeros(B, 1, M, N).masked_fill(hide, float("-inf"))
    exact = torch.softmax((q.double() @ k.double().transpose(-1, -2)) * scale + bias.double(), -1) @ v.double()
    u = unit_roundoff(torch.float32)
    score_err = sum_gamma(D) * ((q.abs() @ k.abs().transpose(-1, -2)) * scale).max().item()
    weight_rel = 2 * score_err + sum_gamma(N) + 4 * u
    bound = (weight_rel + sum_gamma(N)) * v.abs().max().item() * 2
    for fused in (True, False):
        out = common._attention(q, k, v, bias, scale, fused=fused)
        assert_within(out.double(), exact, bound, f"fused={fused}")


# --- the decode loop's reads of the device ---

# every scalar read (.item(), int(), bool() of a tensor) ends in _local_scalar_dense; the others' output size
# depends on the values
SYNCING_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::unique_dim", "aten::_unique2",
               "aten::unique_consecutive", "aten::masked_select")  # fmt: skip


def count_host_reads(monkeypatch, fn) -> int:
    """Reads of the device `fn` makes: torch.profiler's syncing ops and the decode loop's own common._host reads."""
    calls = []
    host = common._host
    monkeypatch.setattr(common, "_host", lambda x: calls.append(1) or host(x))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    ops = sum(e.count for e in prof.key_averages() if e.key in SYNCING_OPS)
    return ops + len(calls)


@pytest.fixture
def cuda_reads(monkeypatch):
    """The decode loop reading the device on CUDA's schedule (after 4, 8, then every 16 tokens) on a CPU,
    which reads after every token."""
    monkeypatch.setattr(common, "READS_EACH_TOKEN_ON", ())


@pytest.mark.slow  # two 64-token rollouts under torch.profiler: the quick tier's longest test (~20 s)
def test_a_64_token_rollout_reads_the_device_at_most_6_times(model, prompts, char_tok, monkeypatch, cuda_reads):
    """On CUDA's schedule: reads after 4, 8, 16, 32, 48 tokens and one for the width (126 at ae2de67)."""
    pad, T = char_tok.pad_token_id, 64
    repeated = [p for p in prompts[:4] for _ in range(4)]  # prompts shared by groups: prefilled once
    for kw in (dict(greedy=True), dict(temperature=1.0, top_p=0.9, generator=torch.Generator().manual_seed(0))):
        roll = None

        def run(kw=kw):
            nonlocal roll
            roll = common.sample(model, repeated, T, [], pad, record_logp=True, **kw)

        reads = count_host_reads(monkeypatch, run)
        assert roll.completion_ids.shape == (len(repeated), T)  # no EOS: every row decodes all 64 tokens
        assert 1 <= reads <= 6, f"{reads} reads of the device in a 64-token rollout ({kw})"


def test_on_a_cpu_the_loop_stops_at_the_last_rows_end(model, prompts, char_tok, monkeypatch):
    """A CPU reads every token: no decode step past the last row's end, finished rows dropped once half have ended."""
    pad, T = char_tok.pad_token_id, 40
    free = common.sample(model, prompts, T, [], pad, greedy=True).completion_lists()
    eos = sorted({c[5] for c in free})  # every row ends by its 6th token, some sooner: between the reads at 4 and 8
    ends = [next(i + 1 for i, t in enumerate(c) if t in eos) if set(c) & set(eos) else T for c in free]
    width = max(ends)
    assert 4 < width < 8, f"fixture: the last row should end between the reads at 4 and 8 (ends {ends})"
    steps = {}
    step = common._StaticKVDecoder.step
    for schedule in ("cpu", "cuda"):
        with monkeypatch.context() as m:
            if schedule == "cuda":
                m.setattr(common, "READS_EACH_TOKEN_ON", ())
            seen = steps[schedule] = []  # the rows given to each decode step
            counted = lambda self, token, seen=seen: seen.append(len(token)) or step(self, token)  # noqa: E731
            m.setattr(common._StaticKVDecoder, "step", counted)
            roll = common.sample(model, prompts, T, eos, pad, greedy=True)
        assert roll.completion_ids.shape[1] == width and roll.completion_lists() == [c[:n] for c, n in zip(free, ends)]
    assert len(steps["cpu"]) == width - 1
    alive = [sum(n > t + 1 for n in ends) for t in range(width - 1)]  # rows alive after token t (0-based)
    dropped, rows = [], len(prompts)  # a per-token loop keeps all rows until half have ended, then the alive ones
    for a in alive:
        rows = a if 2 * a <= rows else rows
        dropped.append(rows)
    assert steps["cpu"] == dropped and min(dropped) < len(prompts), "fixture: half the rows end before the last"
    assert len(steps["cuda"]) == 7, "CUDA's schedule decodes on to its read after 8 tokens"


@given(seed=st.integers(0, 2**16), T=st.integers(1, 40), temperature=st.sampled_from([0.7, 1.0, 1.6]),
       top_p=st.sampled_from([1.0, 0.8]))  # fmt: skip
@example(seed=0, T=1, temperature=1.0, top_p=1.0)
@example(seed=1, T=40, temperature=1.6, top_p=0.8)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_reading_every_16_tokens_changes_no_token_draw_or_width(model, prompts, char_tok, monkeypatch, seed, T,
                                                                temperature, top_p):  # fmt: skip
    """CUDA's sparse reads change no token, mask, width or generator state; entropies and log-probs to rounding."""
    pad, eos = char_tok.pad_token_id, [char_tok.eos_token_id, 40, 41, 42]
    batch = [p for p in prompts for _ in range(2)]
    results = []
    with monkeypatch.context() as m:
        for cadence in ("every 16", "every step"):  # CUDA's schedule, then a CPU's
            m.setattr(common, "READS_EACH_TOKEN_ON", () if cadence == "every 16" else ("cpu",))
            g = torch.Generator().manual_seed(seed)
            roll = common.sample(model, batch, T, eos, pad, temperature=temperature, top_p=top_p, generator=g,
                                 record_logp=True)  # fmt: skip
            results.append((roll, torch.rand(4, generator=g)))
    (a, next_a), (b, next_b) = results
    for field in ("completion_ids", "completion_mask"):
        assert getattr(a, field).shape == getattr(b, field).shape and torch.equal(getattr(a, field), getattr(b, field))
    assert torch.equal(next_a, next_b), "the generator is left where a per-token loop leaves it"
    length, max_logit = logit_scale(model, a, temperature)
    for field, tol in (("entropy", entropy_tol), ("sample_logp", logprob_tol), ("sample_logp_full", logprob_tol)):
        x, y = getattr(a, field), getattr(b, field)
        assert torch.isfinite(x).all() and torch.equal(x == 0, y == 0), field  # zeros on padding, nan nowhere
        assert_within(x, y, tol(model.config, length, max_logit), field)


# --- the training forward under bf16 autocast, and its cache rule ---


def test_training_forward_under_bf16_autocast_is_float32_to_bf16_precision(model, prompts, char_tok):
    """The bf16-autocast training forward on a CPU: not float32's, and within logprob_tol at bfloat16 of it."""
    roll = common.sample(model, prompts, 12, [char_tok.eos_token_id], char_tok.pad_token_id, temperature=1.0,
                         generator=torch.Generator().manual_seed(2))  # fmt: skip
    base, head = model.get_decoder(), model.get_output_embeddings().weight
    with torch.no_grad():
        fp32 = common.completion_hidden_states(base, roll)
        bf16 = common.completion_hidden_states(base, roll, bf16=True)
        logp32, _ = common.logprobs_from_hidden(fp32, head, roll.completion_ids)
        logp16, _ = common.logprobs_from_hidden(bf16, head, roll.completion_ids)
    assert fp32.dtype == bf16.dtype == torch.float32  # the log-probs and the loss stay float32
    mask = roll.completion_mask.bool()
    assert not torch.equal(logp16[mask], logp32[mask]), "the forward ran in float32: autocast was not applied"
    length, max_logit = logit_scale(model, roll)
    bound = min(logprob_tol(model.config, length, max_logit, torch.bfloat16), 0.5 * max_logit)
    assert_within(logp16[mask], logp32[mask], bound, "bf16-autocast log-probs against float32")


def test_autocast_caches_its_casts_unless_the_weights_are_sharded(model, prompts, char_tok, monkeypatch):
    """Autocast's cache keeps a bf16 copy of each weight until the forward ends: right for whole weights,
    a whole extra model under --fsdp, where each layer's gathered weights must go with the layer."""
    seen = []
    autocast = torch.autocast

    def recording(device_type, **kw):
        seen.append((device_type, kw["enabled"], kw["cache_enabled"]))
        return autocast(device_type, **kw)

    monkeypatch.setattr(torch, "autocast", recording)
    roll = common.Rollout.from_lists(prompts[:2], [[5, 6], [7]], char_tok.pad_token_id)
    with torch.no_grad():
        common.completion_hidden_states(model.get_decoder(), roll, bf16=True)
        monkeypatch.setattr(common, "sharded", lambda module: True)
        common.completion_hidden_states(model.get_decoder(), roll, bf16=True)
        common.completion_hidden_states(model.get_decoder(), roll)  # on a CPU: no autocast by default
    assert seen == [("cpu", True, True), ("cpu", True, False), ("cpu", False, False)]


# --- torch.cuda's state and settings, through stand-ins ---


def test_cuda_rng_state_round_trips_through_a_checkpoint(monkeypatch, tmp_path):
    """rng_state() records every GPU's generator state when CUDA is there; the checkpoint file keeps it
    (loaded as --resume loads it: weights_only, to the CPU) and set_rng_state hands it back to torch.cuda."""
    states = [torch.arange(16, dtype=torch.uint8), torch.arange(16, 32, dtype=torch.uint8)]
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [s.clone() for s in states])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda s: restored.append(s))
    torch.save({"rng": common.rng_state()}, tmp_path / "trainer.pt")
    saved = torch.load(tmp_path / "trainer.pt", map_location="cpu", weights_only=True)
    resume_extra.set_rng_state(saved["rng"])
    assert len(restored) == 1 and len(restored[0]) == 2
    assert all(torch.equal(a, b) for a, b in zip(restored[0], states))


def test_peak_memory_reads_torch_cuda_on_a_gpu(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: asked.append(d) or 3 * 2**20)
    assert common.peak_memory_mb(torch.device("cuda:1")) == 3.0
    assert asked == [torch.device("cuda:1")]
    assert common.peak_memory_mb(CPU) > 1.0  # the process's resident set, in MB


def gpu_of(monkeypatch, gib: float) -> list:
    """torch.cuda's device properties as a GPU of `gib` GiB reports them; the devices asked, recorded."""
    asked = []
    props = lambda d: asked.append(d) or types.SimpleNamespace(total_memory=int(gib * 2**30))  # noqa: E731
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    return asked


def loop_chunk_elements(memory: int) -> int:
    """The largest power of two p whose chunk peak, 4 float32 [p] logits copies (16 p bytes), is at most 1/32 of
    `memory`, at least 2**24: counted up in a plain loop."""
    p = 1
    while 16 * (2 * p) * 32 <= memory:
        p *= 2
    return max(p, 2**24)


def test_log_prob_chunks_are_sized_to_the_gpus_memory(monkeypatch):
    """CUDA's 'auto' chunk: the power of two whose peak is 1/32 of the GPU, at least 2**24 (hand-worked sizes)."""
    for gib, hand in ((139, 2**28), (80, 2**27), (24, 2**25), (8, 2**24), (4, 2**24), (0.001, 2**24)):
        asked = gpu_of(monkeypatch, gib)
        assert common.logits_chunk_elements(torch.device("cuda:1")) == hand == loop_chunk_elements(int(gib * 2**30))
        assert asked == [torch.device("cuda:1")]
        assert common.logits_chunk_elements("cuda", int(gib * 2**30)) == hand  # as tools/plan_memory.py asks
    asked = gpu_of(monkeypatch, 139)
    assert common.logits_chunk_elements(CPU) == common.logits_chunk_elements(CPU, 2**40) == 2**24 and asked == []
    assert 2**28 // 151_936 == 1766  # tokens of Qwen's vocabulary per chunk on an H200 (common.py's docstring)


@pytest.mark.numeric
def test_log_probs_are_the_same_whatever_chunk_a_gpu_gets(monkeypatch):
    """'auto' chunks as a GPU of each memory sizes them: the sizes, and values and gradients against float64."""
    V, H, n, temperature = 1000, 8, 40, 0.9
    monkeypatch.setattr(common, "LOGITS_CHUNK_ELEMENTS", 2**12)  # 4 tokens a chunk on a CPU
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(n, H, generator=g), 0.5 * torch.randn(V, H, generator=g)
    targets, coef = torch.randint(0, V, (n,), generator=g), torch.randn(n, generator=g)
    bound = log_softmax_bounds(hidden, weight, targets, temperature, coef)
    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    lp64, ent64 = logp_entropy_f64(h64, w64, targets, temperature)
    (coef.double() * lp64).sum().backward()
    h32, w32 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    plain_lp, plain_ent = common.logprobs_from_hidden(h32, w32, targets, temperature, chunk_tokens=None)
    (coef * plain_lp).sum().backward()
    chunk_fn, real = common._logp_entropy_chunk, common.logits_chunk_elements
    # GPU bytes -> the chunks' token counts: 2**24 B / 512 = 2**15 logits, 32 tokens; 2**23 -> 16; the floor, 4;
    # None: the CPU itself (the tensors' device), 4
    for memory, chunks in ((2**24, [32, 8]), (2**23, [16, 16, 8]), (2**20, [4] * 10), (2**26, [40]), (None, [4] * 10)):
        sizes, devices = [], []  # each chunk's tokens as the forward makes them; the devices asked about
        counted = lambda h, *a, sizes=sizes: sizes.append(len(h)) or chunk_fn(h, *a)  # noqa: E731
        sized = lambda d, m=None, memory=memory, devices=devices: (  # noqa: E731
            devices.append(d) or (real(d) if memory is None else real("cuda", memory)))  # fmt: skip
        monkeypatch.setattr(common, "_logp_entropy_chunk", counted)
        monkeypatch.setattr(common, "logits_chunk_elements", sized)
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        lp, ent = common.logprobs_from_hidden(h, w, targets, temperature)  # chunk_tokens="auto"
        assert sizes == chunks and devices == [CPU], (memory, sizes)  # (backward recomputes them: not counted)
        (coef * lp).sum().backward()
        for what, x, exact, plain, b in (("log p", lp, lp64, plain_lp, bound["logp"]),
                                         ("entropy", ent, ent64, plain_ent, bound["entropy"]),
                                         ("d/dhidden", h.grad, h64.grad, h32.grad, bound["grad_hidden"]),
                                         ("d/dweight", w.grad, w64.grad, w32.grad, bound["grad_weight"])):  # fmt: skip
            assert_within(x.detach(), exact.detach(), b, f"{what}, {memory} B vs float64")
            assert_within(x.detach(), plain.detach(), 2 * b, f"{what}, {memory} B vs unchunked")


def test_tf32_is_allowed_on_cuda_only():
    # set and restored through torch's own switch: monkeypatch's undo deletes the attribute under pytest 9.2,
    # which torch's cuBLASModule refuses (AttributeError at teardown)
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        common.use_tf32(CPU)
        assert torch.backends.cuda.matmul.allow_tf32 is False
        common.use_tf32(torch.device("cuda:0"))
        assert torch.backends.cuda.matmul.allow_tf32 is True
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def test_load_model_sets_matmul_precision_for_its_device(monkeypatch):
    asked = []
    monkeypatch.setattr(common, "use_tf32", lambda device: asked.append(device))
    common.load_model("tiny", CPU)
    assert asked == [CPU]


def test_resolve_device_picks_this_ranks_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert common.resolve_device("auto", 3) == torch.device("cuda:3")
    assert common.resolve_device("cuda", 2) == torch.device("cuda:2")
    assert common.resolve_device("cpu", 2) == CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert common.resolve_device("auto", 3) == CPU


def test_the_default_generator_of_a_gpu_is_its_own(monkeypatch):
    gens = [torch.Generator(), torch.Generator()]
    monkeypatch.setattr(torch.cuda, "default_generators", gens, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert common.default_generator(torch.device("cuda:0")) is gens[0]
    assert common.default_generator(torch.device("cuda")) is gens[1]
    assert common.default_generator(CPU) is torch.default_generator


def test_device_flag_counts_visible_gpus(monkeypatch):
    import grpo

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    args = common.parse_args(grpo.Args, ["--device", "cuda:1"])
    common.check_common_args(args, needs_group=True)
    args.device = "cuda:2"
    with pytest.raises(common.UsageError, match="only 2 CUDA device"):
        common.check_common_args(args, needs_group=True)


# --- torchrun on GPUs: NCCL, DDP's device_ids, FSDP's bf16 gathering ---


def test_nccl_collectives_run_on_the_gpu_and_gloo_ones_on_the_cpu(monkeypatch):
    assert [distributed_extra.collective_device(b) for b in ("nccl", "gloo")] == ["cuda", "cpu"]
    dist = torch.distributed
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda: "nccl")
    asked, reduced = [], []
    monkeypatch.setattr(distributed_extra, "collective_device", lambda backend: asked.append(backend) or "cpu")
    monkeypatch.setattr(dist, "all_reduce", lambda x, op: reduced.append(op) or x.mul_(2))
    assert common.all_reduce_sum(torch.tensor([1.0, 2.0])).tolist() == [2.0, 4.0]
    assert asked == ["nccl"] and reduced == [dist.ReduceOp.SUM]


def test_torchrun_joins_nccl_on_its_local_gpu_and_gloo_on_a_cpu(monkeypatch):
    dist = torch.distributed
    for var, value in (("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1")):
        monkeypatch.setenv(var, value)
    for cuda, device, backend in ((True, "auto", "nccl"), (True, "cpu", "gloo"), (False, "auto", "gloo")):
        joined, gpus = [], []
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        monkeypatch.setattr(torch.cuda, "set_device", gpus.append)
        monkeypatch.setattr(dist, "is_initialized", lambda: False)
        monkeypatch.setattr(dist, "init_process_group", joined.append)
        assert distributed_extra.init_distributed(device) == (1, 2, 1)
        assert joined == [backend] and gpus == ([1] if backend == "nccl" else [])


def test_ddp_is_given_this_ranks_gpu(monkeypatch):
    import torch.nn.parallel

    made = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", lambda m, device_ids: made.append(device_ids))
    module = torch.nn.Linear(2, 2)
    common.data_parallel(module, torch.device("cuda:3"))
    common.data_parallel(module, CPU)
    assert made == [[3], None]


def test_fsdp_gathers_bf16_on_cuda_with_a_bf16_rollout_only():
    """The dtype choice; the bf16 gathering itself runs on CPU in test_fsdp.py
    (test_bf16_gathered_weights_sample_as_the_bf16_sampler_and_train_to_bf16_precision)."""
    bf16, fp32 = (types.SimpleNamespace(rollout_dtype=d) for d in ("bfloat16", "float32"))
    assert fsdp_extra.gathered_dtype(torch.device("cuda:0"), bf16) == torch.bfloat16
    assert fsdp_extra.gathered_dtype(torch.device("cuda:0"), fp32) == torch.float32
    assert fsdp_extra.gathered_dtype(CPU, bf16) == torch.float32


@given(prompts=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=4), min_size=1, max_size=12))
@example(prompts=[[1, 2], [1, 2], [2], [0, 2], [2]])  # pad id 0 inside a prompt: its mask tells it from padding
@settings(max_examples=60, deadline=None)
def test_distinct_prompts_found_on_the_host_as_torch_unique_finds_them(prompts):
    """The prefill's distinct prompts, found from the lists (no read of the device), in torch.unique's order
    of the left-padded ids and mask, and each row's place among them its inverse index."""
    first, copies = common._distinct_rows(prompts, pad_id=0)
    ids, mask = common._left_pad(prompts, 0, CPU)
    rows, inverse = torch.unique(torch.cat([ids, mask], 1), dim=0, return_inverse=True)
    assert torch.equal(torch.cat([ids, mask], 1)[first], rows)
    assert copies == inverse.tolist()
