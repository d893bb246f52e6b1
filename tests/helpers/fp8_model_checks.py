"""Rank-side checks of whole FP8 models (tp = 2, Megatron SP, pp = 2) on gloo ranks.

The reference is the one-process model (same seed) whose FP8 linears compute as tp ranks do
(`shard_like`): a column-parallel linear casts each rank's rows of the weight (and, in the
backward, of the output gradient) with that shard's scales and concatenates; a row-parallel
one casts each rank's columns (and input slice) with their own scales and sums the partials.
That is the per-shard-scale rule of megazoo/layers/linear.py, so the tp model must equal it
to float32 rounding of the sums (model_checks.TOL, rtol 1e-4 / atol 1e-5): same FP8 values,
the partial sums added in another order. Pipeline stages change no GEMM, so pp = 2 must
equal the plain one-process FP8 model to the same tolerance.
"""
import torch
import torch.distributed as dist

from . import model_checks
from .model_checks import batch  # noqa: F401 (the batch of the tests)
from megazoo.layers import ColumnParallelLinear, RowParallelLinear
from megazoo.layers.fp8 import fp8_linear
from megazoo.layers.sharding import tp_slice
from megazoo.models import build_model, full_name
from megazoo.parallel import ParallelConfig, ParallelState
from megazoo.pipeline.executor import run_pipeline
from megazoo.training.gradients import allreduce_gradients


def _column_forward(layer, index):
    order = torch.argsort(torch.cat(index))

    def forward(x):
        bias = layer.bias
        ys = [fp8_linear(x, layer.weight[i], None if bias is None else bias[i], layer.fp8)
              for i in index]
        return torch.cat(ys, -1)[..., order]
    return forward


def _row_forward(layer, index):
    def forward(x):
        y = sum(fp8_linear(x[..., i], layer.weight[:, i], None, layer.fp8) for i in index)
        return y if layer.bias is None else y + layer.bias
    return forward


def shard_like(reference, parallel, tp: int) -> None:
    """Make `reference`'s FP8 linears (one process) compute with the shards of `parallel`."""
    params = {full_name(n, p): p for n, p in parallel.named_parameters()}
    for name, m in reference.named_modules():
        if not isinstance(m, (ColumnParallelLinear, RowParallelLinear)) or m.fp8 is None:
            continue
        shard = params[full_name(name + ".weight", m.weight)]
        dim = 0 if isinstance(m, ColumnParallelLinear) else 1
        positions = torch.arange(m.weight.shape[dim]).float().unsqueeze(1 - dim)
        index = [tp_slice(positions, shard, r, tp).long().flatten() for r in range(tp)]
        m.forward = (_column_forward if dim == 0 else _row_forward)(m, index)


def check_fp8_tp(configs, sequence_parallel: bool) -> list[str]:
    """tp = 2 (with or without Megatron SP) against the per-shard one-process reference."""
    state = ParallelState.initialize(ParallelConfig(tp=2, sequence_parallel=sequence_parallel))
    errors = []
    for tag, cfg in configs.items():
        model = build_model(cfg, state, device="cpu", seed=0)
        one = build_model(cfg, None, device="cpu", seed=0)
        shard_like(one, model, state.tp.size)
        ids, labels = batch()
        loss = one(ids, labels=labels)
        loss.backward()
        with torch.no_grad():
            logits = one(ids)
        ref = dict(loss=loss.detach(), logits=logits,
                   weights={n: p.detach() for n, p in one.named_parameters()},
                   grads={n: p.grad for n, p in one.named_parameters()})
        errors += model_checks._run_layout(cfg, ref, state, f"{tag} SP={sequence_parallel}")
    dist.barrier()
    return errors


def check_fp8_pp(cfg) -> list[str]:
    """pp = 2, two micro-batches of 16 tokens: loss (last stage) and every stage's gradients
    against the one-process FP8 model."""
    state = ParallelState.initialize(ParallelConfig(pp=2))
    model = build_model(cfg, state, device="cpu", seed=0)
    one = build_model(cfg, None, device="cpu", seed=0)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, model_checks.VOCAB, (2, 1, 16), generator=gen)
    micro = [(i, i.clone()) for i in ids]
    ref = sum(one(i, labels=labels) / len(micro) for i, labels in micro)
    ref.backward()
    loss = run_pipeline(model, micro, state)
    allreduce_gradients(model, state)
    errors = []
    if state.is_last_stage and not torch.allclose(loss, ref.detach(), **model_checks.TOL):
        errors.append(f"pp2 loss {loss.item()} vs {ref.item()}")
    grads = {n: p.grad for n, p in one.named_parameters()}
    for n, p in model.named_parameters():
        expected = grads[full_name(n, p)]
        if not torch.allclose(p.grad, expected, **model_checks.TOL):
            errors.append(f"pp2 grads {n}: max diff {(p.grad - expected).abs().max():.3g}")
    dist.barrier()
    return errors
