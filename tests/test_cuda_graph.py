"""--cuda-graph (extras/cuda_graph.py) on CPU: the graphed decode step, fed a stand-in with CUDAGraph's interface,
samples what the eager step samples, over buffers that keep their addresses (its refusal on a CPU: test_reliability)."""

import pytest
import torch
from helpers import entropy_tol, logit_scale, logprob_tol
from test_speed import encode, random_model

import common
from extras import cuda_graph


def buffers(decoder) -> list[torch.Tensor]:
    """What a graphed step reads and writes in place: the KV cache, the attention bias, the slot."""
    return [*decoder.k, *decoder.v, decoder.bias, decoder.slot]


class StandInGraph:
    """torch.cuda.CUDAGraph's interface on CPU: replay() runs the recorded step again on the recorded token, into the
    recorded logits buffer; each replay notes the addresses of the buffers it ran over."""

    made: list["StandInGraph"] = []

    def __init__(self):
        self.addresses = []
        StandInGraph.made.append(self)

    def replay(self):
        self.logits.copy_(self.step(self.token))
        self.addresses.append([t.data_ptr() for t in (*buffers(self.step.__self__), self.token, self.logits)])


def stand_in_capture(graph, step, token):
    """A capture as CUDA does it: the step recorded, not run, so the decoder's buffers are left as they were (here it
    runs once to make the logits buffer, and every buffer is then put back)."""
    saved = [(t, t.clone()) for t in buffers(step.__self__)]
    graph.step, graph.token, graph.logits = step, token, step(token)
    for t, before in saved:
        t.copy_(before)
    return graph.logits


@pytest.fixture
def graphs(monkeypatch):
    StandInGraph.made.clear()
    monkeypatch.setattr(cuda_graph, "CUDAGraph", StandInGraph)
    monkeypatch.setattr(cuda_graph, "capture", stand_in_capture)
    return StandInGraph.made


@pytest.mark.parametrize("greedy, top_p, T", [(True, 1.0, 12), (False, 1.0, 12), (False, 0.8, 12), (False, 1.0, 40)])
@pytest.mark.parametrize("reads", ["each token", "none"])
def test_graphed_step_samples_what_the_eager_step_samples(char_tok, graphs, monkeypatch, greedy, top_p, T, reads):
    """Same seed: the eager sampler's tokens and draws left in the generator, with rows ending at different times and,
    at 40 tokens, across the eager cache's growth (the graphed one is whole from the start). Reading the device after
    each token (CPU's schedule), the eager loop drops ended rows, and its log-probs and entropies, computed on fewer
    rows, round differently: equal within the float32 forward's bounds (helpers.logprob_tol, entropy_tol). Never
    reading (a batch as fixed as the graph's): bit for bit."""
    if reads == "none":
        monkeypatch.setattr(common, "decode_reads", lambda device_type, max_new_tokens: [False] * max_new_tokens)
    model = random_model("qwen3", char_tok, seed=1)
    prompts, pad = encode(char_tok) * 3, char_tok.pad_token_id
    kw = dict(greedy=greedy, temperature=1.3, top_p=top_p, record_logp=True)
    free = common.sample(model, prompts, T, [], pad, generator=torch.Generator().manual_seed(4), **kw)
    eos = sorted({free.completion_ids[i, 2].item() for i in range(0, len(prompts), 2)})  # many rows end early
    runs = {}
    for graphed in (False, True):
        g = torch.Generator().manual_seed(4)
        runs[graphed] = common.sample(model, prompts, T, eos, pad, generator=g, cuda_graph=graphed, **kw), g
    (eager, g_eager), (ours, g_ours) = runs[False], runs[True]
    lengths = eager.completion_mask.sum(1)
    assert lengths.min() < 4 and lengths.max() > 6, f"fixture: rows end at different times, got {lengths.tolist()}"
    assert len(graphs) == 1 and len(graphs[0].addresses) == eager.completion_ids.shape[1] - 2  # one capture
    assert ours.completion_lists() == eager.completion_lists()
    assert torch.equal(ours.completion_mask, eager.completion_mask)
    assert torch.equal(g_ours.get_state(), g_eager.get_state())
    length, scale = logit_scale(model, eager, 1.3)
    bound = logprob_tol(model.config, length, scale)
    for name, tol in (("sample_logp", bound), ("sample_logp_full", bound),
                      ("entropy", entropy_tol(model.config, length, scale))):  # fmt: skip
        a, b = getattr(ours, name), getattr(eager, name)
        if a is None or b is None:
            assert a is None and b is None and greedy and name == "entropy", name
        elif reads == "none":
            assert torch.equal(a, b), name
        else:
            assert (a - b).abs().max() <= tol, f"{name}: {(a - b).abs().max():.3g} > {tol:.3g}"
    assert all(a == graphs[0].addresses[0] for a in graphs[0].addresses), "a buffer moved between replays"
