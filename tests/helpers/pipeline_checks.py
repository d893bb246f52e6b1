"""Rank-side checks: the pipeline executor against the unpipelined model.

Each layout builds this rank's stage (same seed as the one-process model), runs the schedule
on m micro-batches, completes the gradients with `allreduce_gradients`, and compares the
loss and every gradient with the one-process model that accumulates the same m
micro-batches (loss_i / m each). Tolerance as in model_checks (fp32, rtol 1e-4, atol 1e-5):
the same sums in another order, not bitwise.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .model_checks import TOL, compare
from .fixtures import tiny_config
from megazoo.models import ModelConfig, build_model
from megazoo.training.gradients import allreduce_gradients
from megazoo.parallel import ParallelConfig, ParallelState
from megazoo.pipeline.executor import run_pipeline

VOCAB, B, S = 300, 2, 8


def config(family: str = "gpt") -> ModelConfig:
    """8 layers (enough to split over pp = 2 x vpp = 2 with two blocks per chunk), h 32."""
    return tiny_config(family, num_layers=8, hidden_size=32, num_attention_heads=4,
                       max_position_embeddings=32)


def microbatches(m: int):
    g = torch.Generator().manual_seed(99)
    out = []
    for _ in range(m):
        ids = torch.randint(0, VOCAB, (B, S), generator=g)
        out.append((ids, ids.clone()))
    return out


def reference(cfg: ModelConfig, batches) -> dict:
    """One process, gradient accumulation over the micro-batches."""
    model = build_model(cfg, None, device="cpu", seed=0)
    total = 0.0
    for ids, labels in batches:
        loss = model(ids, labels=labels) / len(batches)
        loss.backward()
        total += loss.item()
    return dict(loss=torch.tensor(total),
                weights={n: p.detach() for n, p in model.named_parameters()},
                grads={n: p.grad for n, p in model.named_parameters()})


def check_layouts(layouts, families=("gpt",)) -> list[str]:
    """layouts: (tp, pp, vpp, m) tuples; dp is whatever the world leaves."""
    errors = []
    refs = {}
    for tp, pp, vpp, m in layouts:
        state = ParallelState.initialize(ParallelConfig(tp=tp, pp=pp, vpp=vpp))
        for family in families:
            cfg = config(family)
            batches = microbatches(m)
            key = (family, m)
            if key not in refs:
                refs[key] = reference(cfg, batches)
            model = build_model(cfg, state, device="cpu", seed=0)
            loss = run_pipeline(model, batches, state)
            allreduce_gradients(model, state)
            tag = f"{family} {state.config} vpp{vpp} m{m}"
            if state.is_last_stage:
                if not torch.allclose(loss, refs[key]["loss"], **TOL):
                    errors.append(f"{tag}: loss {loss.item()} vs {refs[key]['loss'].item()}")
            elif loss is not None:
                errors.append(f"{tag}: a non-last stage returned a loss")
            errors += compare(model, refs[key], state, "grads", tag)
    dist.barrier()
    return errors


def check_forward_only() -> list[str]:
    """Forward-only pipeline (pp=2): the last stage's loss equals the reference's."""
    state = ParallelState.initialize(ParallelConfig(pp=2))
    cfg, batches = config(), microbatches(2)
    ref = reference(cfg, batches)
    model = build_model(cfg, state, device="cpu", seed=0)
    with torch.no_grad():
        loss = run_pipeline(model, batches, state, forward_only=True)
    if state.is_last_stage and not torch.allclose(loss, ref["loss"], **TOL):
        return [f"forward-only loss {loss.item()} vs {ref['loss'].item()}"]
    return []
