"""Rank-side code of the compressed-reduction tests (`tests/parallel/test_compression.py`)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megazoo.compress import build_reduction
from megazoo.parallel.state import GroupInfo


def world_group() -> GroupInfo:
    n = dist.get_world_size()
    return GroupInfo(dist.group.WORLD if n > 1 else None, tuple(range(n)), dist.get_rank())


def _all_gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def conservation(algorithm: str, steps: int, numel: int, shard: bool,
                 dtype: torch.dtype = torch.float64, impl: str | None = None,
                 weighted: bool = False) -> dict:
    """Run `steps` reductions of random `dtype` buckets; return the largest deviation from
    sum(outputs) + sum(errors) = sum(inputs), this rank's outputs, and the byte counts.
    `weighted` (topk): each rank chooses its entries by |x| x its own random weights."""
    group, n, rank = world_group(), dist.get_world_size(), dist.get_rank()
    red = build_reduction(algorithm, group, topk_ratio=0.05, block=16, impl=impl)
    total_in = torch.zeros(numel, dtype=torch.float64)
    total_out = torch.zeros(numel, dtype=torch.float64)
    outputs = []
    k = numel // n
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        data = torch.randn(numel, dtype=torch.float64, generator=gen).to(dtype)
        total_in += sum(_all_gather(data)).double()
        shard_view = data[rank * k:(rank + 1) * k] if shard else None
        extra = {"weight": torch.rand(numel, dtype=dtype, generator=gen)} if weighted else {}
        red.launch("b0", data, shard_view, **extra).wait()
        out = data[rank * k:(rank + 1) * k] if shard else data
        if shard:  # the owned shards, put together
            out = torch.cat(_all_gather(out.clone()))
        total_out += out.double()
        outputs.append(out.clone())
    errors = sum(_all_gather(red.errors["b0.worker"])).double()
    if "b0.server" in red.errors:
        errors = errors + torch.cat(_all_gather(red.errors["b0.server"])).double()
    return {"deviation": float((total_out + errors - total_in).abs().max()),
            "scale": float(total_in.abs().max()), "outputs": outputs,
            "sent": red.sent_bytes, "dense": red.dense_bytes}


def conservation_both(algorithm: str, steps: int, numel: int, dtype: torch.dtype = torch.float64,
                      impl: str | None = None, weighted: bool = False) -> dict:
    """`conservation` for the all-reduce and the reduce-scatter form, in one spawn."""
    return {shard: conservation(algorithm, steps, numel, shard, dtype, impl, weighted)
            for shard in (False, True)}


def lossless_all(numel: int) -> dict:
    """`lossless` for every algorithm, in one spawn."""
    return {alg: lossless(alg, numel) for alg in ("topk", "1bit", "2bit")}


def lossless(algorithm: str, numel: int) -> dict:
    """Inputs a codec represents exactly (ratio 1 for topk; for 1bit / 2bit every block
    +-s_rank, or 0 for 2bit, with one sign pattern on every rank): the reduced bucket must
    equal the exact sum, bit for bit (small integers: every sum is exact)."""
    group, rank = world_group(), dist.get_rank()
    red = build_reduction(algorithm, group, topk_ratio=1.0, block=16)
    gen = torch.Generator().manual_seed(7)
    if algorithm == "topk":
        data = torch.randint(-50, 50, (numel,), generator=gen).float() * (rank + 1)
    else:
        pattern = torch.randint(0, 3 if algorithm == "2bit" else 2, (numel,), generator=gen)
        sign = (pattern == 1).float() - (pattern == 0).float() if algorithm == "2bit" else \
            1.0 - 2.0 * pattern.float()
        data = sign * (rank + 1)
    expected = sum(_all_gather(data))
    red.launch("b0", data).wait()
    return {"equal": bool(torch.equal(data, expected)),
            "max_error": float((data - expected).abs().max())}


def compressed_engine(compression: dict, **training):
    """ddp_checks' engine (tiny GPT, seed 7) at this world's dp, compressing its reduction
    (`compression`: CompressionConfig fields and recipe internals, `INTERNALS`' names)."""
    import dataclasses

    from .ddp_checks import make_args
    from megazoo.models import build_model
    from megazoo.parallel import ParallelConfig, ParallelState
    from megazoo.training.backends.plain import PlainEngine
    from megazoo.config.compression import INTERNALS, RECIPES, CompressionConfig

    state = ParallelState.initialize(ParallelConfig()) if dist.is_initialized() \
        else ParallelState.single()
    internals = {k: v for k, v in compression.items() if k in INTERNALS}
    if internals:  # recipe internals: through a recipe of this rank's process, as bench's
        RECIPES["test"] = internals
        compression = {k: v for k, v in compression.items() if k not in INTERNALS}
        compression["compression_recipe"] = "test"
    args = dataclasses.replace(make_args(ParallelConfig(), **training),
                               compression=CompressionConfig(**compression))
    model = build_model(args.model, state, device="cpu", seed=args.training.seed)
    return PlainEngine(model, state, args), state


def train_steps(compression: dict, training: dict, steps: int) -> dict:
    """Losses of `steps` steps and what the engine logged about its bytes."""
    from .ddp_checks import train

    engine, state = compressed_engine(compression, **training)
    losses = train(engine, state, range(steps))
    return {"losses": losses, "stats": engine.comm_stats(),
            "params": [p.detach().clone() for p in engine.model.parameters()]}


def step_norms(compression: dict, training: dict, steps: int) -> list[float]:
    """The gradient norm each of `steps` steps reported (the reduced gradient's)."""
    from .ddp_checks import batches

    engine, state = compressed_engine(compression, **training)
    return [engine.train_step(batches(s, state.dp.rank, state.dp.size)).grad_norm
            for s in range(steps)]


def with_and_without_momentum(compression: dict, training: dict, steps: int) -> list[dict]:
    """`train_steps` twice: the engine as built (with the variance frozen it carries the
    momentum through the compressed reduction), then with that offset switched off."""
    from .ddp_checks import train

    out = []
    for carry in (True, False):
        engine, state = compressed_engine(compression, **training)
        if not carry:
            engine.reducer.start_step = _without_offset(engine.reducer)
        losses = train(engine, state, range(steps))
        out.append({"losses": losses, "params": [p.detach().clone() for p in engine.model.parameters()]})
    return out


def _without_offset(reducer):
    """`reducer.start_step` that leaves the momentum out of the buckets."""
    start = reducer.start_step

    def start_step(*args, **kwargs):
        start(*args, **kwargs)
        reducer._offset = None

    return start_step


def save_then_continue(path: str, compression: dict, training: dict) -> dict:
    """Steps 0-2, save, steps 3-5: the losses after the save."""
    from .ddp_checks import train

    engine, state = compressed_engine(compression, **training)
    train(engine, state, range(3))
    engine.save(path, {"iteration": 3})
    return {"after": train(engine, state, range(3, 6))}


def resume(path: str, compression: dict, training: dict) -> dict:
    """A fresh engine loads `path` and runs steps 3-5; its resume notes."""
    from .ddp_checks import train

    engine, state = compressed_engine(compression, **training)
    engine.load(path)
    return {"after": train(engine, state, range(3, 6)), "notes": engine.resume_notes}


def dense_wire_dtypes(numel: int) -> dict:
    """communication_data_type: the dense all-reduce and reduce-scatter in fp16 / bf16 of
    small integers (exact in both) give the exact fp32 sum; bytes halve."""
    group, rank, n = world_group(), dist.get_rank(), dist.get_world_size()
    out = {}
    for wire in (torch.float16, torch.bfloat16):
        red = build_reduction(None, group, wire_dtype=wire)
        data = torch.randint(-20, 20, (numel,), generator=torch.Generator().manual_seed(rank)).float()
        expected = sum(_all_gather(data))
        full = data.clone()
        red.launch("b0", full).wait()
        k = numel // n
        shard = data.clone()
        red.launch("b0", shard, shard[rank * k:(rank + 1) * k]).wait()
        out[str(wire)] = (torch.equal(full, expected),
                          torch.equal(shard[rank * k:(rank + 1) * k], expected[rank * k:(rank + 1) * k]),
                          red.dense_bytes / red.sent_bytes, full.dtype)
    return out
