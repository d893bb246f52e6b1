"""Rank-side code of the ZeRO / FSDP2 tests (no tests here; `test_zero.py`, `test_fsdp.py`
spawn these functions on gloo ranks, and compare their results with `assert_close_runs`).

Every run builds the same tiny GPT with the same seed, feeds each data-parallel rank its own
deterministic micro-batches, and records per step (loss, grad norm). The reference is
`PlainEngine` (allreduce_gradients, global-norm clip, torch AdamW) on the same layout.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megazoo.config.run import PretrainArgs, TrainingConfig
from megazoo.config.zero import ZeroConfig
from megazoo.models import ModelConfig, build_model
from megazoo.parallel import ParallelConfig, ParallelState

VOCAB, B, S, M = 128, 2, 16, 2  # vocab, micro-batch, sequence, micro-batches per step
LOSS_RTOL, NORM_RTOL = 1e-4, 1e-3  # fp32, the same math in another order: see test_zero.py


def assert_close_runs(results: dict, names, what=""):
    """Each run in `names` has the per-step (loss, grad norm) of results["plain"]."""
    ref = results["plain"]
    for name in names:
        got = results[name]
        for step, ((l0, n0), (l1, n1)) in enumerate(zip(ref, got)):
            where = f"{what} {name} step {step}"
            assert l1 == pytest.approx(l0, rel=LOSS_RTOL), f"{where}: loss {l1} vs plain {l0}"
            assert n1 == pytest.approx(n0, rel=NORM_RTOL), f"{where}: grad norm {n1} vs plain {n0}"


def model_config(num_layers: int = 2) -> ModelConfig:
    return ModelConfig(family="gpt", num_layers=num_layers, hidden_size=32,
                       num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=S)


def make_args(par: ParallelConfig, dp: int, num_layers: int = 2, **zero) -> PretrainArgs:
    # Warmup of 2 steps then cosine: the lr changes every step, so a schedule bug shows.
    training = TrainingConfig(micro_batch_size=B, global_batch_size=B * M * dp, train_iters=6,
                              lr=1e-2, min_lr=1e-3, lr_warmup_iters=2, weight_decay=0.1,
                              clip_grad=1.0, seed=7)
    return PretrainArgs(model=model_config(num_layers), parallel=par, training=training,
                        zero=ZeroConfig(**zero))


def batches(step: int, state: ParallelState, micro_batches: int = M) -> list[dict]:
    """The micro-batches of data-parallel rank `state.dp.rank` for optimizer step `step`
    (two alternating batches per rank, so the loss falls visibly within a few steps)."""
    g = torch.Generator().manual_seed(1000 * (step % 2) + state.dp.rank)
    out = []
    for _ in range(micro_batches):
        ids = torch.randint(0, VOCAB, (B, S), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def state_for(par: ParallelConfig) -> ParallelState:
    return ParallelState.initialize(par)


def train(engine, state, steps: range, micro_batches: int = M) -> list[tuple[float, float]]:
    out = []
    for step in steps:
        r = engine.train_step(batches(step, state, micro_batches))
        out.append((r.loss, r.grad_norm))
    return out


def plain_run(par: ParallelConfig, steps: int = 3, num_layers: int = 2):
    from megazoo.training.backends.plain import PlainEngine

    state = state_for(par)
    args = make_args(par, state.dp.size, num_layers)
    model = build_model(args.model, state, device="cpu", seed=args.training.seed)
    return train(PlainEngine(model, state, args), state, range(steps))


def deepspeed_engine(par: ParallelConfig, cpu_adam=None, **zero):
    from megazoo.training.backends.deepspeed_zero import DeepSpeedEngine

    state = state_for(par)
    args = make_args(par, state.dp.size, deepspeed=True, **zero)
    model = build_model(args.model, state, device="cpu", seed=args.training.seed)
    return DeepSpeedEngine(model, state, args, cpu_adam=cpu_adam), state


def deepspeed_runs(par: ParallelConfig, runs: list[dict], steps: int = 3) -> dict:
    """{name: [(loss, norm)] } for the plain reference and each ZeRO config of `runs`."""
    out = {"plain": plain_run(par, steps)}
    for run in runs:
        run = dict(run)
        name = run.pop("name")
        engine, state = deepspeed_engine(par, **run)
        out[name] = train(engine, state, range(steps))
        out[name + ":cpu_adam"] = type(engine.ds.basic_optimizer).__name__ == "DeepSpeedCPUAdam"
    return out


def deepspeed_save(par: ParallelConfig, path: str, run: dict) -> dict:
    """Train steps 0-1, save, train steps 2-3; also the eval loss on a fixed batch at save."""
    engine, state = deepspeed_engine(par, **run)
    first = train(engine, state, range(2))
    engine.save(path, {"iteration": 2, "note": "test"})
    probe = engine.eval_loss(batches(99, state))
    return {"first": first, "probe": probe, "after": train(engine, state, range(2, 4))}


def deepspeed_resume(par: ParallelConfig, path: str, run: dict) -> dict:
    engine, state = deepspeed_engine(par, **run)
    extra = engine.load(path)
    return {"extra": extra, "after": train(engine, state, range(2, 4)),
            "steps": engine.steps}


def fsdp_runs(par: ParallelConfig, runs: list[dict], steps: int = 3, num_layers: int = 4) -> dict:
    """Plain pipeline reference and FSDP2Engine runs of `runs` on the same layout."""
    from megazoo.training.backends.fsdp2 import FSDP2Engine

    out = {"plain": plain_run(par, steps, num_layers)}
    for run in runs:
        run = dict(run)
        name = run.pop("name")
        if run.pop("cpu_offload", False):
            run["offload_optimizer"] = "cpu"
        if "reduce_every_microbatch" in run:
            run["fsdp_reduce_every_microbatch"] = run.pop("reduce_every_microbatch")
        state = state_for(par)
        args = make_args(par, state.dp.size, num_layers, zero_impl="fsdp2", zero_stage=3, **run)
        model = build_model(args.model, state, device="cpu", seed=args.training.seed)
        engine = FSDP2Engine(model, state, args)
        out.setdefault("units", {})[name] = fsdp_units(model)
        out[name] = train(engine, state, range(steps))
    return out


def fsdp_units(model) -> int:
    """How many FSDP2 units `fully_shard` made of `model` (the root included): one state
    each, shared by the modules of a grouped unit."""
    from torch.distributed.fsdp import FSDPModule

    return len({id(m._get_fsdp_state()) for m in model.modules() if isinstance(m, FSDPModule)})


def with_sp(par: ParallelConfig, **changes) -> ParallelConfig:
    return dataclasses.replace(par, **changes)


def deepspeed_layouts(layouts: list[tuple[ParallelConfig, list[dict]]], steps: int = 3) -> list:
    """`deepspeed_runs` for several layouts in one process group (one spawn)."""
    return [deepspeed_runs(par, runs, steps) for par, runs in layouts]


def deepspeed_save_many(jobs: list[tuple[ParallelConfig, str, dict]]) -> list[dict]:
    return [deepspeed_save(par, path, run) for par, path, run in jobs]


def one_process_probe(path: str, dp: int) -> float:
    """Loss of a megazoo checkpoint (one process) on `batches(99)` of each dp rank, averaged
    like DeepSpeedEngine.eval_loss."""
    from types import SimpleNamespace

    import megazoo

    model = megazoo.load_pretrained(path, state=None, device="cpu")
    losses = []
    with torch.no_grad():
        for r in range(dp):
            mbs = batches(99, SimpleNamespace(dp=SimpleNamespace(rank=r)))
            losses += [float(model(b["input_ids"], labels=b["labels"])) / len(mbs) for b in mbs]
    return sum(losses) / dp


def fsdp_engine(par: ParallelConfig, num_layers: int = 4, **zero):
    from megazoo.training.backends.fsdp2 import FSDP2Engine

    state = state_for(par)
    args = make_args(par, state.dp.size, num_layers, zero_impl="fsdp2", zero_stage=3, **zero)
    model = build_model(args.model, state, device="cpu", seed=args.training.seed)
    return FSDP2Engine(model, state, args), state, args


def fsdp_save_resume(par: ParallelConfig, path: str) -> dict:
    """FSDP2: steps 0-1, save, steps 2-3; a new engine (fresh model) loads and repeats 2-3;
    PlainEngine loads the same checkpoint and repeats 2-3 too."""
    from megazoo.training.backends.plain import PlainEngine

    engine, state, _ = fsdp_engine(par, offload_optimizer="cpu")
    train(engine, state, range(2))
    engine.save(path, {"iteration": 2})
    after = train(engine, state, range(2, 4))
    fresh, state, args = fsdp_engine(par)
    extra = fresh.load(path)
    plain = PlainEngine(build_model(args.model, state, device="cpu", seed=123), state, args)
    plain.load(path)
    return {"after": after, "resumed": train(fresh, state, range(2, 4)),
            "plain": train(plain, state, range(2, 4)), "extra": extra}


def fsdp_collective_inputs(path: str) -> dict:
    """FSDP2 on 2 ranks at dp 2 (steps, eval, save, a fresh engine loading it, a step), tp 2
    with Megatron SP, pp 2 (the tied embedding's sum): {layout: (collectives seen, those
    handed a host tensor)} (`helpers.host_tensors`: what NCCL refuses on GPUs)."""
    from helpers.host_tensors import HostTensors

    layouts = {"dp2": ParallelConfig(), "tp2-sp": ParallelConfig(tp=2, sequence_parallel=True),
               "pp2": ParallelConfig(pp=2)}
    out = {}
    for name, par in layouts.items():
        engine, state, _ = fsdp_engine(par)
        fresh = fsdp_engine(par)[0] if name == "dp2" else None
        # Models and batches are made before tracking starts: the batches stand for what the
        # training loop puts on the compute device.
        data = [batches(i, state) for i in (0, 1, 9, 2)]
        with HostTensors() as seen:
            for mbs in data[:2]:
                engine.train_step(mbs)
            engine.eval_loss(data[2])
            if fresh is not None:
                engine.save(path, {"iteration": 2})
                fresh.load(path)
                fresh.train_step(data[3])
        out[name] = (seen.collectives, seen.violations)
    return out


def bf16_zero3_accumulation(steps: int = 3) -> dict:
    """bf16 at dp 2, 4 micro-batches per step: the plain engine (fp32 main gradients) and
    DeepSpeed ZeRO-3, and the dtype ZeRO-3 sums micro-batch gradients in."""
    from megazoo.training.backends.deepspeed_zero import DeepSpeedEngine
    from megazoo.training.backends.plain import PlainEngine

    par, state = ParallelConfig(), state_for(ParallelConfig())
    out = {}
    for name in ("plain", "zero3"):
        args = make_args(par, state.dp.size, **({"deepspeed": True, "zero_stage": 3}
                                                if name == "zero3" else {}))
        args.training = dataclasses.replace(args.training, bf16=True,
                                            global_batch_size=B * 4 * state.dp.size)
        model = build_model(args.model, state, device="cpu", seed=args.training.seed)
        engine = (DeepSpeedEngine if name == "zero3" else PlainEngine)(model, state, args)
        out[name] = train(engine, state, range(steps), micro_batches=4)
        if name == "zero3":
            out["accumulation_dtype"] = str(engine.ds.optimizer.gradient_accumulation_dtype)
    return out
