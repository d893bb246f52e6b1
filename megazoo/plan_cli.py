"""The command line of the memory planner: `python -m megazoo.plan --model NAME [layout] [--json]`."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from .models.build import resolve_config
from .plan import GB, MemoryEstimate, TrainingLayout, estimate_memory


def format_table(name: str, layout: TrainingLayout, est: MemoryEstimate) -> str:
    """A human-readable report."""
    rows = [("parameters", est.parameters), ("gradients", est.gradients),
            ("optimizer states", est.optimizer_states), ("activations", est.activations),
            ("communication buffers + runtime", est.communication_buffers),
            ("fragmentation allowance (10%)", est.fragmentation), ("GPU total", est.gpu_total)]
    lines = [f"{name}: {est.num_parameters:,} parameters; layout TP{layout.tp}-SP{layout.sp}-"
             f"PP{layout.pp}-VPP{layout.vpp}-DP{layout.dp} ({layout.world_size} GPUs), ZeRO-"
             f"{layout.zero_stage}, offload optimizer={layout.offload_optimizer} params="
             f"{layout.offload_params}, recompute={layout.recompute}, micro-batch "
             f"{layout.micro_batch_size} x {layout.seq_length} tokens",
             f"  parameters per GPU before ZeRO: {est.parameters_per_gpu:,}"]
    lines += [f"  {label:<34}{value / GB:10.2f} GB" for label, value in rows]
    lines.append(f"  {'host memory per GPU / per node':<34}{est.host_per_gpu / GB:10.2f} GB"
                 f" / {est.host_per_node / GB:.1f} GB")
    verdict = "fits" if est.fits else "does NOT fit"
    lines.append(f"  => {verdict} in {layout.gpu_memory_gb:g} GB per GPU")
    lines += [f"  note: {n}" for n in est.notes]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megazoo.plan", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a preset name, e.g. bloom-176b")
    for flag in ("tp", "sp", "pp", "vpp", "dp"):
        p.add_argument(f"--{flag}", type=int, default=1)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--seq-length", type=int, default=None, help="default: the model's positions")
    p.add_argument("--num-micro-batches", type=int, default=None)
    p.add_argument("--no-sequence-parallel", action="store_true", help="Megatron SP off")
    p.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2, 3))
    p.add_argument("--offload-optimizer", default="none", choices=("none", "cpu"))
    p.add_argument("--offload-params", default="none", choices=("none", "cpu"))
    p.add_argument("--offload-ratio", type=float, default=1.0,
                   help="ZeRO-3 partial optimizer offload: fraction on the host")
    p.add_argument("--zero-impl", default="deepspeed", choices=("deepspeed", "fsdp2"))
    p.add_argument("--no-fsdp-reshard-after-forward", action="store_true",
                   help="FSDP2: keep the gathered parameters from forward to backward")
    p.add_argument("--recompute", default="none", choices=("none", "selective", "full"))
    p.add_argument("--fp32-grad-accumulation", action="store_true")
    p.add_argument("--gpu-memory", type=float, default=80.0, help="GB per GPU")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    config = resolve_config(args.model)
    try:
        layout = TrainingLayout(
            tp=args.tp, sp=args.sp, pp=args.pp, vpp=args.vpp, dp=args.dp,
            micro_batch_size=args.micro_batch_size,
            seq_length=args.seq_length or min(config.max_position_embeddings, 2048),
            num_micro_batches=args.num_micro_batches, sequence_parallel=not args.no_sequence_parallel,
            zero_stage=args.zero_stage, offload_optimizer=args.offload_optimizer,
            offload_params=args.offload_params, offload_ratio=args.offload_ratio,
            zero_impl=args.zero_impl,
            fsdp_reshard_after_forward=not args.no_fsdp_reshard_after_forward,
            recompute=args.recompute,
            fp32_grad_accumulation=args.fp32_grad_accumulation, gpu_memory_gb=args.gpu_memory,
            gpus_per_node=args.gpus_per_node)
        est = estimate_memory(config, layout)
    except ValueError as exc:  # a layout that cannot be: say what, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"model": args.model, "layout": asdict(layout), **est.to_dict()}, indent=2))
    else:
        print(format_table(args.model, layout, est))
    return 0
