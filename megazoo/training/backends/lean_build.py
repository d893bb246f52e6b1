"""Building a model for the offloaded plain engine without a full fp32 copy on the GPU.

    model = build_run_model(args, state, device)      # run.py: the model the engine takes
    values = initial_values(model, args)              # engine: {id(p): fp32 values} or None
    fill_flat_(dst, lo, hi, bucket, buffers, values)  # one range of the flat layout, from them

Where the engine keeps its fp32 masters in its own optimizer (`OffloadAdamW`:
--optimizer-cpu-offload, or bf16 main gradients) and computes in bf16 / fp16, the fp32 model
is needed only as the masters' initial values, yet a build on the GPU holds all of it there
(4 bytes per parameter). So `build_run_model` builds on the GPU but moves each sub-module's
parameters to the host the moment it is attached to its parent (a module-registration hook):
the GPU holds one sub-module's fp32 parameters at a time, and the values are the same (each
weight's init is a counter-based function of (seed, name, element), `megazoo.layers.init`,
computed on the device; the move is a copy). The engine builds its flat bf16 buffer from
those host tensors and the optimizer fills its masters from them (host and disk buckets
straight from host memory, GPU buckets by one copy up), dropping each parameter's host
tensor once its bucket is filled.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn.modules import module as nn_module

HOST = torch.device("cpu")


def lean_build_applies(args) -> bool:
    """Whether the run's engine is the plain one with its own masters in `OffloadAdamW` and
    low-precision parameters (the only case the host build serves)."""
    from ...config.offload import plain_offload

    t = args.training
    if args.zero.zero_impl != "none" or not (t.bf16 or t.fp16):
        return False
    return t.accumulate_grads_in_bf16 or plain_offload(args) is not None


def _to_host(module: nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            if p.device != HOST:
                p.data = p.data.to(HOST)


@contextlib.contextmanager
def units_to_host(sink=_to_host):
    """While open, every module attached to a parent passes through `sink` (default: its
    parameters move to the host) as it is attached."""
    def hook(parent, name, child):
        if child is not None:
            sink(child)
        return None

    handle = nn_module.register_module_module_registration_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def build_run_model(args, state, device, sink=_to_host) -> nn.Module:
    """This rank's model for the run `args`: built on `device`; with the lean build, its
    parameters end on the host in fp32 (one sub-module at a time on `device`)."""
    from ...models import build_model

    if not lean_build_applies(args) or torch.device(device) == HOST:
        return build_model(args.model, state, device=device, seed=args.training.seed)
    with units_to_host(sink):
        model = build_model(args.model, state, device=device, seed=args.training.seed)
    sink(model)  # the root's own parameters (none today) and anything attached late
    return model


def initial_values(model: nn.Module, args) -> dict | None:
    """{id(p): p's fp32 values} when the engine builds its masters from them (the run of
    `lean_build_applies`), else None (the masters are cast from the flat buffer)."""
    if not lean_build_applies(args):
        return None
    values = {id(p): p.detach() for p in model.parameters() if p.requires_grad}
    if any(v.dtype != torch.float32 for v in values.values()):
        return None
    return values


def fill_flat_(dst: torch.Tensor, lo: int, hi: int, bucket, buffers, values: dict) -> None:
    """dst (numel hi - lo) <- the flat range [lo, hi) of `bucket` in `buffers`' layout, from
    `values` (padding: zeros)."""
    dst.zero_()
    for p, a, b in buffers.pieces(bucket, lo, hi):
        start = buffers.offsets[id(p)]
        dst[a - lo:b - lo].copy_(values[id(p)].reshape(-1)[a - start:b - start])


def held_bytes(values: dict | None) -> int:
    """Host bytes of `values` (the masters' fill frees them bucket by bucket, so the host
    needs the larger of them and the state, not the sum)."""
    return sum(v.numel() * v.element_size() for v in (values or {}).values()
               if v.device == HOST)
