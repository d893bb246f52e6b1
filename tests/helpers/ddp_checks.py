"""Rank-side code of `test_data_parallel.py` (no tests here): the plain engine's bucketed,
overlapped data parallelism and distributed optimizer against the one-process run.

Every run builds the same tiny GPT (seed 7) and trains on the same global batches: step s
has GLOBAL_MB micro-batches, and data-parallel rank r of dp takes the r-th contiguous slice
of them, so any dp size sees the same global batch as one process.
"""
from __future__ import annotations

import time

import torch

import megazoo
from megazoo.config.run import PretrainArgs, TrainingConfig
from megazoo.config.zero import ZeroConfig
from megazoo.models import ModelConfig, build_model
from megazoo.parallel import ParallelConfig, ParallelState

VOCAB, B, S, GLOBAL_MB = 128, 2, 16, 4


def model_config(num_layers: int = 4) -> ModelConfig:
    return ModelConfig(family="gpt", num_layers=num_layers, hidden_size=32,
                       num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=S,
                       qkv_bias=False, dense_bias=False)  # a key bias has a zero gradient up to rounding noise,
    # which AdamW turns into lr-sized steps of either sign: not comparable across layouts


def make_args(par: ParallelConfig, zero: ZeroConfig | None = None, **training) -> PretrainArgs:
    # Warmup then cosine: the lr changes every step, so a clock bug shows.
    base = dict(micro_batch_size=B, global_batch_size=B * GLOBAL_MB, train_iters=8, lr=1e-2,
                min_lr=1e-3, lr_warmup_iters=2, weight_decay=0.1, clip_grad=1.0, seed=7)
    return PretrainArgs(model=model_config(), parallel=par, zero=zero or ZeroConfig(),
                        training=TrainingConfig(**{**base, **training}))


def batches(step: int, dp_rank: int, dp: int) -> list[dict]:
    g = torch.Generator().manual_seed(1000 + step)
    mbs = []
    for _ in range(GLOBAL_MB):
        ids = torch.randint(0, VOCAB, (B, S), generator=g)
        mbs.append({"input_ids": ids, "labels": ids})
    per = GLOBAL_MB // dp
    return mbs[dp_rank * per:(dp_rank + 1) * per]


def engine_for(par: ParallelConfig, **training):
    from megazoo.training.backends.plain import PlainEngine

    state = ParallelState.initialize(par) if torch.distributed.is_initialized() \
        else ParallelState.single()
    args = make_args(par, **training)
    model = build_model(args.model, state, device="cpu", seed=args.training.seed)
    return PlainEngine(model, state, args), state


def train(engine, state, steps) -> list[float]:
    return [engine.train_step(batches(s, state.dp.rank, state.dp.size)).loss for s in steps]


def full_params(path: str) -> dict[str, torch.Tensor]:
    """The one-process model's parameters of a checkpoint (its fp32 masters)."""
    model = megazoo.load_pretrained(path, state=None, device="cpu")
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def one_thread(fn, *args, **kwargs):
    """fn(*args, **kwargs) with torch on one thread, as the spawned ranks run (a float32
    reduction's order then matches theirs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args, **kwargs)
    finally:
        torch.set_num_threads(threads)


def run_and_save(par: ParallelConfig, path: str, steps: int = 3, **training) -> dict:
    """Losses of `steps` steps, then a checkpoint at `path`; the full parameters it holds."""
    engine, state = engine_for(par, **training)
    losses = train(engine, state, range(steps))
    engine.save(path, {"iteration": steps})
    return {"losses": losses, "params": full_params(path)}


def layouts(jobs: list[tuple[ParallelConfig, str, dict]]) -> list[dict]:
    """`run_and_save` for several layouts in one process group (one spawn)."""
    return [run_and_save(par, path, **training) for par, path, training in jobs]


def overlap_timeline(bucket_size: int = 2000) -> dict:
    """dp=2 with --overlap-grad-reduce and small buckets: when each bucket's reduction was
    launched, and when backward reached the first transformer block and the embedding
    (full backward hooks), for one step of one micro-batch."""
    engine, state = engine_for(ParallelConfig(), overlap_grad_reduce=True,
                               ddp_bucket_size=bucket_size, global_batch_size=B * 2)
    marks = {}
    model = engine.model
    first = model.layers[min(model.layers.keys(), key=int)]

    def mark(name):
        def hook(*_):
            marks.setdefault(name, time.perf_counter())
        return hook

    first.register_full_backward_hook(mark("first_block"))
    model.embedding.register_full_backward_hook(mark("embedding"))
    engine.train_step(batches(0, state.dp.rank, GLOBAL_MB)[:1])
    launches = sorted(b.launch_time for b in engine.buffers.buckets)
    return {"launches": launches, "buckets": len(engine.buffers.buckets), **marks}


def save_then_continue(path: str, training: dict) -> dict:
    """dp=2 with the distributed optimizer: steps 0-1, save, steps 2-3."""
    engine, state = engine_for(ParallelConfig(), **training)
    train(engine, state, range(2))
    engine.save(path, {"iteration": 2})
    return {"after": train(engine, state, range(2, 4))}


def resume(path: str, training: dict, steps=range(2, 4)) -> dict:
    """A fresh engine at this run's dp loads `path` and trains `steps`."""
    engine, state = engine_for(ParallelConfig(), **training)
    engine.load(path)
    return {"after": train(engine, state, steps), "steps": engine.steps}
