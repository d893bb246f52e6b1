"""Rank-side checks: whole GPT / BLOOM / LLaMA models in parallel layouts vs one process.

Every rank builds the one-process reference model (same seed) and, for each layout (tp, sp,
Megatron SP) of a 4-rank world (dp = 4 / (tp * sp), every replica given the same batch),
the parallel model; then checks, for every parameter, through the shard metadata
(`tp_slice`, `full_name`):
- init: the shard equals its slice of the reference weight, bit for bit (real rows only;
  padded vocabulary rows differ with the padding);
- loss and full logits equal the reference's;
- after `allreduce_gradients`, the gradient equals its slice of the reference gradient
  (padded rows zero).

Tolerance (fp32): rtol 1e-4, atol 1e-5. The layouts sum the same products in other orders
(partial matmuls plus all-reduces, sequence pieces), so agreement is to rounding of O(1)
values accumulated over a few hundred terms, not bitwise.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megazoo.layers import tp_slice
from megazoo.models import ModelConfig, build_model, full_name
from megazoo.training.gradients import allreduce_gradients
from megazoo.parallel import ParallelConfig, ParallelState
from .fixtures import tiny_config  # noqa: F401 (model_checks.tiny_config in tests)

TOL = dict(rtol=1e-4, atol=1e-5)
VOCAB, B, S = 300, 2, 8  # vocab pads to 384 at tp=1 and 512 at tp=2
LAYOUTS = [(1, 1, False), (2, 1, False), (2, 1, True), (1, 2, False), (2, 2, False), (2, 2, True)]


def batch():
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    labels = ids.clone()
    labels[0, 3] = -100
    return ids, labels


def reference(cfg: ModelConfig, data=None) -> dict:
    """One-process weights, grads, loss and logits (of `data` (ids, labels), default batch())."""
    model = build_model(cfg, None, device="cpu", seed=0)
    ids, labels = batch() if data is None else data
    loss = model(ids, labels=labels)
    loss.backward()
    with torch.no_grad():
        logits = model(ids)
    return dict(loss=loss.detach(), logits=logits,
                weights={n: p.detach() for n, p in model.named_parameters()},
                grads={n: p.grad for n, p in model.named_parameters()})


def _real_rows(p: torch.Tensor, state: ParallelState) -> int | None:
    """Rows of a vocab-padded shard that are real vocabulary (None if not padded)."""
    unpadded = getattr(p, "tp_unpadded", None)
    if unpadded is None:
        return None
    return max(0, min(p.shape[0], unpadded - state.tp.rank * p.shape[0]))


def compare(model, ref: dict, state: ParallelState, what: str, tag: str) -> list[str]:
    """Each local parameter (what="weights", exact) or gradient ("grads") vs its slice."""
    errors = []
    for name, p in model.named_parameters():
        mine = p.detach() if what == "weights" else p.grad
        expected = tp_slice(ref[what][full_name(name, p)], p, state.tp.rank, state.tp.size)
        real = _real_rows(p, state)
        if real is not None:
            if what == "grads" and torch.count_nonzero(mine[real:]):
                errors.append(f"{tag} {name}: padded rows have gradient")
            mine, expected = mine[:real], expected[:real]
        ok = (torch.equal(mine, expected) if what == "weights"
              else torch.allclose(mine, expected, **TOL))
        if not ok:
            diff = (mine - expected).abs().max().item()
            errors.append(f"{tag} {what} {name}: max diff {diff:.3g}")
    return errors


def _run_layout(cfg, ref, state, tag, via_logits=False, prepare=None) -> list[str]:
    """One layout against `ref` (loss, logits, weights, gradients); `prepare(model)` runs on
    the built model first (switching a path on, say)."""
    model = build_model(cfg, state, device="cpu", seed=0)
    if prepare is not None:
        prepare(model)
    errors = compare(model, ref, state, "weights", tag)
    ids, labels = batch()
    if via_logits:  # the convenience path: full logits on every rank, loss outside
        logits = model(ids)
        targets = torch.cat([labels[:, 1:], labels.new_full((B, 1), -100)], 1)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
    else:
        loss = model(ids, labels=labels)
        with torch.no_grad():
            if not torch.allclose(model(ids), ref["logits"], **TOL):
                errors.append(f"{tag}: logits differ")
    if not torch.allclose(loss.detach(), ref["loss"], **TOL):
        errors.append(f"{tag}: loss {loss.item()} vs {ref['loss'].item()}")
    loss.backward()
    allreduce_gradients(model, state)
    return errors + compare(model, ref, state, "grads", tag)


def check_families(families=("gpt", "bloom", "llama", "llama-mqa")) -> list[str]:
    """Every family in every layout of LAYOUTS; returns the mismatches (empty when all agree)."""
    configs = {f: tiny_config(f) for f in families}
    refs = {f: reference(c) for f, c in configs.items()}
    errors = []
    for tp, sp, seq_par in LAYOUTS:
        state = ParallelState.initialize(ParallelConfig(tp=tp, sp=sp, sequence_parallel=seq_par))
        for family, cfg in configs.items():
            tag = f"{family} tp{tp} sp{sp}{' SP' if seq_par else ''}"
            errors += _run_layout(cfg, refs[family], state, tag)
            if sp > 1:
                errors += _run_layout(cfg, refs[family], state, tag + " via logits", True)
            if tp == 2 and sp == 2 and seq_par and family != "llama-mqa":
                for mode in ("full", "selective"):
                    recomputed = dataclasses.replace(cfg, recompute=mode)
                    errors += _run_layout(recomputed, refs[family], state, f"{tag} recompute {mode}")
    dist.barrier()
    return errors
