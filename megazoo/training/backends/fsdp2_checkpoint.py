"""FSDP2Engine checkpoints: ordinary megazoo checkpoints (safetensors + megazoo.json).

`save_fsdp` all-gathers each parameter and AdamW moment over the dp x sp mesh
(`DTensor.full_tensor`, collective), puts them into a meta-built twin of the stage (same
names and tp shard tags), and calls `megazoo.checkpoint.save_checkpoint` with the moments as
aux tensors `exp_avg` / `exp_avg_sq` -- the same contents as `PlainEngine.save`, so either
engine resumes the other's checkpoints, and any layout loads the weights. `load_fsdp` loads
into a CPU twin with `load_model_weights` and copies each rank's dim-0 shard into the FSDP2
parameters and fresh AdamW state (no communication: every rank slices the full tensor).
Memory: one full stage (plus moments) per rank while saving or loading.
"""
from __future__ import annotations

import torch

from ...models import build_model
from ..gradients import local
from .fsdp2_sharding import copy_tags

AUX = ("exp_avg", "exp_avg_sq")


def _full(t, device: torch.device) -> torch.Tensor:
    """The whole tensor on the host. An offloaded shard goes to `device` for the gather
    first: the mesh's group has no backend for host tensors on GPUs (NCCL)."""
    if not hasattr(t, "full_tensor"):
        return t.detach().cpu()
    return t.to(device).full_tensor().cpu()


def save_fsdp(engine, path: str, extra: dict) -> None:
    from ...checkpoint import save_checkpoint

    model, state, opt = engine.model, engine.state, engine.optimizer
    weights, aux = {}, {prefix: {} for prefix in AUX}
    for name, p in model.named_parameters():  # same order on every rank: matched gathers
        weights[name] = _full(p, engine.device)
        st = opt.state.get(p, {})
        for prefix in AUX:
            aux[prefix][name] = (_full(st[prefix], engine.device) if prefix in st
                                 else torch.zeros_like(weights[name]))
    twin = build_model(model.config, state, device="meta")
    tags = {n: dict(vars(p)) for n, p in twin.named_parameters()}
    twin.load_state_dict(weights, assign=True)
    copy_tags(twin, tags)
    first = next(iter(opt.state.values()), {"step": 0})  # (every parameter's step is the same)
    meta = {"steps": engine.steps, "adam_step": int(first["step"]), "scaler": None}
    # the twin holds host copies: the save's collectives run on the engine's device
    save_checkpoint(twin, path, state=state, extra={**extra, "engine": meta}, aux=aux,
                    device=engine.device)


def _shard_like(full: torch.Tensor, p):
    """This rank's FSDP2 shard of `full`, as a DTensor placed like `p` (no communication),
    its local tensor where p's is (the host under CPU offload: distribute_tensor puts it on
    the mesh's device type)."""
    from torch.distributed.tensor import distribute_tensor

    shard = distribute_tensor(full.to(dtype=local(p).dtype), p.device_mesh, p.placements,
                              src_data_rank=None)
    return shard.to(local(p).device)


def load_fsdp(engine, path: str) -> dict:
    from ...checkpoint import load_model_weights
    from ..run_checks import read_options

    model, state, opt = engine.model, engine.state, engine.optimizer
    twin = build_model(model.config, state, device="cpu")
    meta, aux = load_model_weights(twin, path, state=state, aux_prefixes=AUX,
                                   **read_options(engine.args))
    extra = meta.get("extra") or {}
    info = extra.get("engine", {})
    step = int(info.get("adam_step", 0))
    full = dict(twin.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            local(p).copy_(local(_shard_like(full[name], p)))
            if step > 0:
                # on the parameter's device, as AdamW makes it (fused kernels read it there)
                opt.state[p] = {"step": torch.tensor(float(step), device=local(p).device),
                                **{prefix: _shard_like(aux[prefix][name], p) for prefix in AUX}}
    engine.steps = int(info.get("steps", 0))
    return extra
