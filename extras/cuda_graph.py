"""extras/cuda_graph.py: --cuda-graph, each decode step of common.sample replayed as one CUDA graph (a small batch's
decoding on a GPU is bound by kernel launches). Unmeasured on a GPU yet (benchmarks/gpu.sh). The graph records the
decoder's `step` over buffers whose shapes and addresses stay: the whole KV cache (P + T slots), the slot a [1]
tensor advanced in place, the batch fixed. Tokens are drawn outside it, so they are the eager step's
(tests/test_cuda_graph.py, on CPU through a stand-in with CUDAGraph's interface).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common import UsageError

CUDAGraph = torch.cuda.CUDAGraph  # tests/test_cuda_graph.py swaps in a CPU stand-in for it and for `capture`


def check_args(args):
    """--cuda-graph: a CUDA device (check_common_args: before anything is loaded)."""
    if args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available()):
        raise UsageError("--cuda-graph needs a CUDA device")


def capture(graph, step, token: torch.Tensor) -> torch.Tensor:
    """step(token) recorded into `graph`, not run (the decoder's state is left as it was): the logits buffer that
    every graph.replay() rewrites."""
    with torch.cuda.graph(graph):
        return step(token)


class GraphedStep:
    """`decoder.step` as a graph: the first call runs the step eagerly (on a side stream on CUDA, the warm-up a capture
    needs) and then records it; every later call copies its tokens into the recorded input and replays."""

    def __init__(self, decoder):
        more = (0, 0, 0, decoder.bias.shape[-1] - decoder.k[0].shape[2])  # every slot now: the cache never grows
        decoder.k, decoder.v = [F.pad(k, more) for k in decoder.k], [F.pad(v, more) for v in decoder.v]
        decoder.slot = torch.tensor([decoder.slot], device=decoder.bias.device)
        self.decoder, self.graph = decoder, None

    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        if self.graph is not None:
            self.token.copy_(token)
            self.graph.replay()
            return self.logits
        self.token = token.clone()
        stream = torch.cuda.Stream() if token.is_cuda else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # (None: no stream, on CPU)
            logits = self.decoder.step(self.token)
        if stream is not None:
            torch.cuda.current_stream().wait_stream(stream)
        self.graph = CUDAGraph()
        self.logits = capture(self.graph, self.decoder.step, self.token)
        return logits
