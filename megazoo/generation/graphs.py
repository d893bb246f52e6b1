"""The decode step as one replayable unit: eager everywhere, a CUDA graph on GPUs.

A step reads two static device tensors, the tokens of the previous step [b, 1] and the slot
they go to [1], and returns logits [b, vocab]; nothing in it reads a value back to the host
(cache.py and step.py keep the mask, positions and cache writes on the device), so on CUDA
the step is captured once (`torch.cuda.CUDAGraph`) and each token costs one replay instead
of hundreds of kernel launches from Python. Capture runs the step twice on a side stream
first (as PyTorch's graph recipe does): those runs write keys and values of dummy tokens
into the first decode slot, which the first real step overwrites before any query reads it.
Under pipeline parallelism the step sends and receives between stages and is not captured.
"""
from __future__ import annotations

import sys

import torch

from .cache import KVCache


class DecodeStep:
    """`step(tokens [b]) -> logits [b, vocab]` of the next slot, starting at `first_slot`.

    `run(tokens [b, 1], inputs)` is the model step (step.model_step); `use_graph` captures it
    on CUDA, falling back to eager (one warning line) if the capture fails.
    """

    def __init__(self, run, cache: KVCache, batch: int, first_slot: int, *, use_graph: bool):
        self.run, self.cache = run, cache
        self.tokens = torch.zeros(batch, 1, dtype=torch.int64, device=cache.device)
        self.slot = torch.full((1,), first_slot, dtype=torch.int64, device=cache.device)
        self.graph = self.logits = None
        if use_graph:
            try:
                self.graph, self.logits = self._capture()
            except Exception as exc:  # any capture failure: run eagerly instead
                print(f"warning: CUDA graph capture of the decode step failed ({exc}); "
                      f"decoding eagerly", file=sys.stderr)
                self.graph = None

    def _eager(self) -> torch.Tensor:
        return self.run(self.tokens, self.cache.inputs(self.slot))

    def _capture(self):
        side = torch.cuda.Stream(self.cache.device)
        side.wait_stream(torch.cuda.current_stream(self.cache.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._eager()
        torch.cuda.current_stream(self.cache.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self._eager()
        return graph, logits

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        self.tokens.copy_(tokens.view(-1, 1))
        if self.graph is not None:
            self.graph.replay()
            logits = self.logits
        else:
            logits = self._eager()
        self.slot += 1
        return logits
