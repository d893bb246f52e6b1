"""Rank-side checks: whole models with block-sparse attention in parallel layouts vs one process.

Sequence 64, block 16 (4 x 4 blocks). Every rank builds the one-process sparse model (same
seed) and, per layout (tp, sp) of a 4-rank world, the parallel model; loss, logits and every
gradient must equal the one-process model's (`model_checks.compare`, rtol 1e-4, atol 1e-5:
the layouts sum the same products in other orders). Each rank's heads take their rows of the
one global layout, so a wrong head range changes the result.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .fixtures import tiny_config
from megazoo.models import build_model
from megazoo.parallel import ParallelConfig, ParallelState
from megazoo.training.gradients import allreduce_gradients
from .model_checks import TOL, VOCAB, compare, reference

S = 64
SECTIONS = {
    "gpt": {"mode": "bigbird", "block": 16, "different_layout_per_head": True,
            "num_random_blocks": 1, "num_sliding_window_blocks": 1},
    "bloom": {"mode": "fixed", "block": 16, "different_layout_per_head": True,
              "num_local_blocks": 2, "num_different_global_patterns": 2},
    "llama": {"mode": "bslongformer", "block": 16, "num_sliding_window_blocks": 1,
              "global_block_indices": [1]},
}
LAYOUTS = [(2, 1, True), (1, 2, False), (2, 2, False)]


def config(family: str):
    return tiny_config(family, sparse_attention=SECTIONS[family])


def batch():
    g = torch.Generator().manual_seed(99)
    ids = torch.randint(0, VOCAB, (2, S), generator=g)
    return ids, ids.clone()


def check_sparse_layouts(families=("gpt", "bloom", "llama")) -> list[str]:
    refs = {f: reference(config(f), batch()) for f in families}
    errors = []
    for tp, sp, seq_par in LAYOUTS:
        state = ParallelState.initialize(ParallelConfig(tp=tp, sp=sp, sequence_parallel=seq_par))
        for family in families:
            tag = f"sparse {family} tp{tp} sp{sp}"
            model = build_model(config(family), state, device="cpu", seed=0)
            ids, labels = batch()
            loss = model(ids, labels=labels)
            with torch.no_grad():
                if not torch.allclose(model(ids), refs[family]["logits"], **TOL):
                    errors.append(f"{tag}: logits differ")
            if not torch.allclose(loss.detach(), refs[family]["loss"], **TOL):
                errors.append(f"{tag}: loss {loss.item()} vs {refs[family]['loss'].item()}")
            loss.backward()
            allreduce_gradients(model, state)
            errors += compare(model, refs[family], state, "grads", tag)
    dist.barrier()
    return errors
