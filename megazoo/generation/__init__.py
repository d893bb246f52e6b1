"""Text generation with a KV cache, from a model or a checkpoint, at any tp x pp layout
(without the cache at any layout).

- `api.py`: `generate(model_or_dir, prompts, ...)` (also `megazoo.generate`), the checkpoint
  and tokenizer lookups;
- `loop.py`: `generate_ids` (left padding, prefill, decode; pipeline stages pass hidden
  states, the last stage's tokens go back to the first); `recompute.py`: its `cache=False`
  path, the whole context per token at any layout (the end-of-training sample);
- `cache.py`: the static per-layer cache of a rank's kv heads and each step's mask and
  positions; `step.py`: the model's modules run with the cache; `graphs.py`: the decode step
  as a CUDA graph; `sampling.py`: greedy / temperature / top-k / top-p (every path's draw);
- `cli.py`: `python generate.py` / `megazoo-generate`.
"""
from .api import find_tokenizer, generate, resolve_checkpoint
from .loop import generate_ids
from .sampling import Sampling, sample

__all__ = ["generate", "generate_ids", "find_tokenizer", "resolve_checkpoint", "Sampling", "sample"]
