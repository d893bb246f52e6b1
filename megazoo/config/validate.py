"""`check_args`: every check of a run's configuration that needs no process.

`pretrain_gpt.py` and `python -m megazoo.plan` both apply it, so a layout the planner accepts
is one the run accepts: the model against the layout (`layout.check_layout`), the ZeRO engine
against the flags it understands, and the global batch against the data-parallel size where
that is known (the planner's `--dp`). Every failure is a ValueError naming the flag to change.
"""
from __future__ import annotations

from ..parallel.config import ParallelConfig
from .compression import check_compression_layout, check_engine_compression
from .layout import check_layout
from .run import PretrainArgs
from .zero import ZeroConfig
from .offload import check_plain_only, plain_offload


def check_args(args: PretrainArgs) -> None:
    """Raise a ValueError unless `args` describes a run that can start (see the module doc)."""
    check_layout(args.model, args.parallel, args.data.seq_length)
    check_engine(args.zero, args.parallel)
    check_plain_only(args)
    offload = plain_offload(args) if args.zero.zero_impl == "none" else None
    if args.compression.algorithm is not None and (offload or args.training.accumulate_grads_in_bf16):
        flag = "--optimizer-cpu-offload" if offload else "--accumulate-grads-in-bf16"
        raise ValueError(f"{flag} takes dense gradients: drop --gradient-compression (or {flag})")
    check_engine_compression(args.compression, args.zero.zero_impl)
    check_compression_layout(args.compression, args.parallel,
                             args.training.use_distributed_optimizer)
    dp, t = args.parallel.dp, args.training
    tp_sp = args.parallel.tp > 1 and args.parallel.megatron_sp
    if t.tp_comm_overlap and not (tp_sp or args.parallel.sp > 1):
        raise ValueError("--tp-comm-overlap chunks Megatron-SP's all-gathers / reduce-scatters "
                         "and Ulysses' all-to-alls: it needs --tensor-model-parallel-size > 1 "
                         "with --sequence-parallel, or --sequence-parallel-size > 1")
    if t.enable_cuda_graph:
        check_cuda_graph(args)
    if dp is not None and t.global_batch_size % (t.micro_batch_size * dp):
        raise ValueError(f"--global-batch-size {t.global_batch_size} must divide by "
                         f"--micro-batch-size {t.micro_batch_size} x dp {dp}")


def check_cuda_graph(args: PretrainArgs) -> None:
    """What --enable-cuda-graph (`megazoo.training.block_graphs`) captures: the plain engine's
    blocks, of one pipeline stage or several, without context parallelism, recompute, FP8,
    sparse attention, key/value heads repeated over tp or the offloaded optimizer (the device
    is checked when the run starts)."""
    p, m = args.parallel, args.model
    conflicts = [
        (args.zero.zero_impl != "none", "it runs with the plain engine: drop --deepspeed / --zero-impl"),
        (p.cp > 1, "context parallelism is not captured: set --context-parallel-size 1"),
        (m.recompute != "none", "activation recompute is not captured: drop --recompute-granularity"),
        (m.fp8_format is not None, "FP8's scaling state is not captured: drop --fp8-format"),
        (m.sparse_attention is not None, "sparse attention is not captured: use dense attention"),
        (m.num_key_value_heads < p.tp, f"{m.num_key_value_heads} key/value heads over tp {p.tp} "
                                       f"repeat on several ranks, whose gradient hook is not "
                                       f"captured: use tp <= {m.num_key_value_heads}"),
        (args.zero.zero_impl == "none" and plain_offload(args) is not None,
         "the offloaded optimizer is not supported: drop --optimizer-cpu-offload / "
         "--offload-optimizer"),
    ]
    for conflict, why in conflicts:
        if conflict:
            raise ValueError(f"--enable-cuda-graph: {why} (or drop --enable-cuda-graph)")


def cuda_graph_accepted(args: PretrainArgs) -> bool:
    """Whether the run `args` would take --enable-cuda-graph (`check_cuda_graph` passes)."""
    try:
        check_cuda_graph(args)
    except ValueError:
        return False
    return True


def check_engine(zero: ZeroConfig, parallel: ParallelConfig) -> None:
    """The ZeRO flags against the engine that reads them (values left to a DeepSpeed JSON,
    None here, are checked when the JSON is merged)."""
    if zero.zero_impl == "none" and zero.zero_stage not in (None, 0):
        raise ValueError("--zero-stage needs a ZeRO engine: add --deepspeed (or --zero-impl "
                         "fsdp2); the plain engine offloads with --offload-optimizer alone")
    if zero.zero_impl == "deepspeed":
        check_deepspeed_pipeline(parallel.pp)
    if zero.zero_impl == "fsdp2":
        if zero.zero_stage not in (None, 3):
            raise ValueError(f"--zero-impl fsdp2 shards parameters (ZeRO-3); got --zero-stage "
                             f"{zero.zero_stage}: pass --zero-stage 3 or use --deepspeed")
        if "nvme" in (zero.offload_optimizer, zero.offload_param):
            raise ValueError("--zero-impl fsdp2 offloads to cpu only: use --offload-optimizer "
                             "cpu or --deepspeed for nvme")
        if zero.offload_optimizer_ratio not in (None, 1.0):
            raise ValueError("--zero-impl fsdp2 offloads all or nothing: drop "
                             "--offload-optimizer-ratio or use --deepspeed")
    elif not zero.fsdp_reshard_after_forward:
        raise ValueError("--no-fsdp-reshard-after-forward is an FSDP2 setting: add "
                         "--zero-impl fsdp2 or drop it")
    elif zero.fsdp_blocks_per_unit != ZeroConfig.fsdp_blocks_per_unit:
        raise ValueError(f"--fsdp-blocks-per-unit {zero.fsdp_blocks_per_unit} is an FSDP2 "
                         "setting: add --zero-impl fsdp2 or drop it")
    if zero.zero_stage is None:
        return
    if zero.offload_param not in (None, "none") and zero.zero_stage != 3:
        raise ValueError(f"--offload-param needs --zero-stage 3, got {zero.zero_stage}")
    if zero.offload_optimizer not in (None, "none") and zero.zero_stage == 0:
        raise ValueError("--offload-optimizer needs --zero-stage 1, 2 or 3")


def check_deepspeed_pipeline(pp: int) -> None:
    """DeepSpeed's engine does not run megazoo's pipeline schedules (FSDP2 does)."""
    if pp > 1:
        raise ValueError(f"DeepSpeed cannot run megazoo's pipeline schedules (pp={pp}): "
                         "use --zero-impl fsdp2 for ZeRO-3 with pipelines, or set "
                         "--pipeline-model-parallel-size 1")
