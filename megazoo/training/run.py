"""The training run behind `pretrain_gpt.py`: setup (checked on every rank), then the loop
(`megazoo.training.loop`), and the command-line entry point.

    main(argv) -> exit status    # 0 done, 2 bad input ("error: ..." and no traceback)

Setup validates everything before the first step: the layout against the world size, the
batch sizes, the data files, the tokenizer against the data, a checkpoint against the
model. Any of these raises a ValueError / FileNotFoundError on every rank, which `main`
turns into one "error: ..." line and exit status 2.
"""
from __future__ import annotations

import dataclasses
import os
import random
import shlex
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ..checkpoint.attention import resume_sparse_layout
from ..config.flags import parse_args
from ..data.indexed import check_data_path
from ..config.offload import fraction_note
from ..config.validate import check_args, cuda_graph_accepted
from ..config.run import PretrainArgs
from ..layers.fp8 import check_fp8_run
from ..errors import report_error
from ..parallel.device import local_device
from ..parallel.state import ParallelState, runs_nccl
from ..plot import draw_run_curves
from .checkpoint import load_training_checkpoint
from .data import TrainData, build_data, resolve_data_source, unigram_entropy
from .backends import Engine, TrainingStopped, build_engine
from ..pipeline.schedules import build_schedule
from .block_graphs import BlockGraphs, graph_blocks
from .backends.lean_build import build_run_model
from ..layers.linear import set_tp_comm_overlap
from ..layers.parallel_attention import set_ulysses_overlap
from ..layers.tp_overlap import TP_COMM_CHUNKS
from .metrics import MetricsLogger
from .run_checks import check_save_targets, prepare_save_dir, resume_warnings
from .loop import evaluate, train
from .signals import TrainingInterrupted

USER_ERRORS = (ValueError, FileNotFoundError)


@dataclass
class Run:
    """What setup produces: everything the loop needs."""

    args: PretrainArgs
    state: ParallelState
    data: TrainData
    engine: Engine
    logger: MetricsLogger
    start_iteration: int
    entropy: float
    owns_process_group: bool
    graphs: BlockGraphs | None = None  # --enable-cuda-graph


def _one_rank_group_for_zero(args: PretrainArgs) -> None:
    """DeepSpeed and FSDP2 need torch.distributed even in a plain one-process run (no
    launcher): give them a one-rank group (an in-memory store, no port) and the LOCAL_RANK
    DeepSpeed insists on."""
    if args.zero.zero_impl == "none" or dist.is_initialized() or \
            int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return
    from .backends.deepspeed_setup import init_one_rank_group

    init_one_rank_group()


def setup(args: PretrainArgs, print_fn=print) -> Run:
    """Initialise ranks, data, model, engine (and resume); raise USER_ERRORS on bad input."""
    if args.training.cpu_threads:
        torch.set_num_threads(args.training.cpu_threads)
    seed_everything(args.training.seed)
    check_fp8_run(args.model.fp8(), local_device())  # every rank, before any collective
    if args.training.enable_cuda_graph and local_device().type != "cuda":
        raise ValueError("--enable-cuda-graph needs CUDA GPUs: drop it on this machine")
    owns = not dist.is_initialized()
    _one_rank_group_for_zero(args)
    state = ParallelState.initialize(args.parallel)
    check_args(dataclasses.replace(args, parallel=state.config))  # the batch against dp now
    rank0 = state.global_rank == 0
    log = print_fn if rank0 else (lambda *a, **k: None)
    resolve_data_source(args, state, log)
    data = build_data(args, state)
    prepare_save_dir(args, rank0, log)
    entropy = unigram_entropy(data.prefixes, data.tokenizer.vocab_size)
    device = data.device = local_device()
    if args.checkpoint.load:  # the checkpoint's attention layout is part of its model
        sparse, note = resume_sparse_layout(args.model.sparse_attention, args.checkpoint.load)
        args.model = dataclasses.replace(args.model, sparse_attention=sparse)
        if note:
            log(note)
    model = build_run_model(args, state, device)  # lean: fp32 on the host, one unit at a time
    model.check_inputs = False  # build_data's check_vocabulary checked every id already
    if args.training.tp_comm_overlap:
        set_tp_comm_overlap(model, TP_COMM_CHUNKS)
        set_ulysses_overlap(model, TP_COMM_CHUNKS)
    engine = build_engine(args, model, state)
    graphs = None
    if args.training.enable_cuda_graph:
        program = build_schedule(state.pp.size, len(model.chunks),
                                 data.micro_batches(state))[state.pp.rank]
        graphs = graph_blocks(model, engine.buffers, program)
    advice = host_thread_advice(engine.cpu_offload, torch.get_num_threads(), os.cpu_count() or 1,
                                int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if advice and not args.training.cpu_threads:
        log(f"warning: {advice}")
    hint = cuda_graph_hint(args, device)
    if hint:
        log(f"note: {hint}")
    placement = getattr(getattr(engine, "optimizer", None), "placement", None)
    if placement and isinstance(placement, str):
        log(placement)
        slots = engine.optimizer.slots  # the plain engine's offload: one slot a bucket
        note = fraction_note(args.training.optimizer_offload_fraction,
                             [s.numel for s in slots if s.host], [s.numel for s in slots])
        if note:
            log(f"warning: {note}")
    start = 0
    if args.checkpoint.load:
        extra = load_training_checkpoint(engine, args.checkpoint.load)
        for warning in resume_warnings(args, extra) + getattr(engine, "resume_notes", []):
            log(f"warning: {warning}")
        start = int(extra.get("iteration", 0))
        consumed = int(extra.get("consumed_samples", start * args.training.global_batch_size))
        if consumed != start * args.training.global_batch_size:
            raise ValueError(f"the checkpoint consumed {consumed} samples in {start} iterations; "
                             f"resume with --global-batch-size {consumed // max(start, 1)}")
        log(f"resumed from {args.checkpoint.load} at iteration {start}")
    elif args.logging.eval_only:
        raise ValueError("--eval-only needs --load DIR (the checkpoint to evaluate)")
    if not args.logging.eval_only:
        check_save_targets(args, start, engine.checkpoint_kind)
    metrics = None if args.logging.eval_only else args.checkpoint.save
    logger = MetricsLogger(args.logging, device, rank0, print_fn=log,
                           save_dir=args.checkpoint.save, run_config=args.to_dict(),
                           metrics_dir=metrics or None, start_iteration=start)
    return Run(args, state, data, engine, logger, start, entropy, owns, graphs)


def seed_everything(seed: int) -> None:
    """Python's, numpy's and torch's global generators from --seed, so two fresh runs with
    the same flags hold (and save) the same random states."""
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)


def cuda_graph_hint(args: PretrainArgs, device: torch.device) -> str | None:
    """A line for a GPU run with tensor or Ulysses parallelism that could replay its blocks as
    CUDA graphs and does not: the host often sets such a run's pace
    (`megazoo.training.block_graphs`). None otherwise."""
    p = args.parallel
    if device.type != "cuda" or args.training.enable_cuda_graph or p.tp * p.sp == 1 \
            or not cuda_graph_accepted(args):
        return None
    return ("tensor / Ulysses parallelism issues hundreds of launches per block; add "
            "--enable-cuda-graph to replay each block as a CUDA graph when the host, not the "
            "GPU, sets the pace")


def host_thread_advice(cpu_offload: bool, threads: int, cores: int, local_ranks: int) -> str | None:
    """What to change when an offloaded optimizer would step on one host thread per rank
    (torchrun's default OMP_NUM_THREADS=1) while the host has cores to spare; else None."""
    per_rank = cores // max(local_ranks, 1)
    if not cpu_offload or threads > 1 or per_rank < 2:
        return None
    return (f"the offloaded optimizer steps on 1 host thread per rank (OMP_NUM_THREADS=1 is "
            f"torchrun's default); pass --cpu-threads {per_rank} ({cores} cores / {local_ranks} "
            f"ranks on this host) or set OMP_NUM_THREADS")


def generate_hint(args: PretrainArgs) -> str:
    """--eval-only measures the loss only: the command that generates from the checkpoint."""
    return (f"to generate text from this checkpoint: python generate.py --load "
            f"{shlex.quote(args.checkpoint.load)} --prompt {shlex.quote(args.logging.prompt)} "
            f"--max-new-tokens {args.logging.generate_tokens or 64}")


def parse_run_args(argv: list[str] | None = None) -> PretrainArgs:
    """pretrain_gpt.py's arguments: `config.flags.parse_args` with the --data-path files
    checked (FileNotFoundError naming the missing file, before the tokenizer's checks)."""
    return parse_args(argv, check_data=check_data_path)


def run_training(argv: list[str] | None = None, print_fn=print) -> dict:
    """Parse, set up and train (or evaluate); return the summary (losses, valid loss, ...).

    Bad input raises USER_ERRORS before any step, on every rank.
    """
    run = setup(parse_run_args(argv), print_fn)
    try:
        if run.args.logging.eval_only:
            loss = evaluate(run)
            run.logger.write({"iteration": run.start_iteration, "valid_loss": loss})
            run.logger.print(generate_hint(run.args))
            out = {"valid_loss": loss, "losses": []}
        else:
            out = train(run)
            draw_run_curves(run)
        if run.owns_process_group and run.state.world_size > 1:
            dist.barrier()  # no rank tears gloo down while a peer still talks to it
        return out
    finally:
        run.logger.close()
        if run.graphs is not None:  # before the process group goes (`BlockGraphs.release`)
            run.graphs.release()
        # gloo needs no teardown, and destroying it can abort the process at exit with torch
        # 2.13 (`cli._leave_gloo`)
        if run.owns_process_group and runs_nccl():
            dist.destroy_process_group()


def main(argv: list[str] | None = None, print_fn=print) -> int:
    """Command-line entry point: 0 when done; "error: ..." and 2 for bad input, 1 when the
    run had to stop (too many skipped steps, non-finite weights)."""
    try:
        run_training(argv, print_fn)
    except USER_ERRORS as exc:
        return report_error(str(exc))
    except TrainingStopped as exc:
        return report_error(str(exc), code=1)
    except TrainingInterrupted as exc:  # after a save: one line, not a traceback
        return report_error(str(exc), code=exc.code, prefix="")
    return 0
