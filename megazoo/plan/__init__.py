"""Memory planner: what one training run needs per GPU, on the host and on disk, and whether
it fits; with `--cluster C`, the step time on a cluster, and with `--search` the fastest
layout (docs/planner.md; `timing.py`, `search.py`).

    python -m megazoo.plan --model bloom-176b --dp 8 --deepspeed --zero-stage 3 \
        --offload-optimizer cpu --recompute full --micro-batch-size 1 --global-batch-size 8 \
        --bf16 --gpu-memory 80 --host-memory 2000 [--json]
    python -m megazoo.plan --largest --model-family llama --gpu-memory 80 --host-memory 125 \
        --disk-memory 500 --optimizer-cpu-offload [--nvme-path DIR] [layout flags]

The planner reads a run's own configuration: its command line is `pretrain_gpt.py`'s (the
same flags, names and defaults, generated from the same dataclasses; a `--model` preset
without `--seq-length` plans the preset's sequence length) plus `--dp` (the data-parallel
size, which a launched run takes from its world size), `--gpu-memory`, `--host-memory`,
`--disk-memory` (GB per GPU / node; 0: not checked), `--gpus-per-node`,
`--fp32-grad-accumulation`, `--json`, `--out PNG` (the plan of each pipeline stage as a
stacked bar, `stages.py`) and `--largest --model-family F` (`largest.py`: the largest shape of
the family that fits, and its pretrain_gpt.py command). It checks them with the run's own
`megazoo.config.validate.check_args`, so a layout it plans is one the run accepts.
`estimate_memory(args)` takes the run's `PretrainArgs` and is a pure function returning a
`MemoryEstimate` (bytes). The model (all of it stated, so a measurement can be compared part
by part; bench/README.md and bench/results/plan_memory_* hold the comparisons):

- precision: bf16 / fp16 runs keep parameters, gathered units and activations in 2 B, fp32
  runs (--fp32 or no flag) in 4 B; masters and moments are fp32 either way.
- parameters, per GPU: the most loaded pipeline stage's share per tp rank (`stage_parameters`).
  ZeRO-3 divides them over Z = dp * sp and adds the gathered working set plus one unit's full
  gradient awaiting its reduce-scatter; a unit is a block or the embedding / head. FSDP2
  gathers two units (computing, prefetched; every unit with --no-fsdp-reshard-after-forward);
  DeepSpeed keeps gathered what is reused within stage3_max_reuse_distance (1e9 elements:
  under recompute the last 5e8 of the forward, `LIVE_ELEMENTS`).
- engines (`engines.py`): the plain engine (2 + 4 + 12 B, main gradients bf16 with
  --accumulate-grads-in-bf16, masters and moments / (dp x sp) with the distributed optimizer,
  a fraction of them on the host or the disk with --optimizer-cpu-offload: `offload.py`, per
  gradient bucket as the engine lays them out, its host buffers pinned);
  DeepSpeed (compute-dtype parameters, gradient partitions in the accumulation dtype, fp32
  masters + moments / Z, the fp32 gradient buffer of its largest sub-group, and torch
  AdamW's temporaries at the step, 8 B x its largest flat group; with ZeRO-3 optimizer
  offload the host's bytes follow stage3.py's allocations, `deepspeed_host.py`: pageable
  masters and moments, each sub-group's fp32 gradient and the flat gradient partitions
  pinned, transients while initialising and stepping, whole sub-groups kept on the GPU
  under a partial offload); FSDP2 (fp32 shards of parameters, gradients, m and v, 16 B / Z;
  with CPU offload all on the host, parameters and gradients pinned). Pinned buffers come
  from torch's caching host allocator, which rounds each up to a power of two.
- gradient accumulation: FSDP2 reduce-scatters only in a step's last micro-batch (always at
  pp = 1; under pipelines with --no-fsdp-reduce-every-microbatch) and keeps every parameter's
  unsharded gradient in the reduction dtype (fp32 for bf16 runs) on the GPU until then: 4 B
  per parameter of the stage, not divided by Z, in place of (not beside) the sharded ones. DeepSpeed accumulates into its partitions
  (no change with the micro-batch count, as measured); the plain engine into its main
  gradients.
- the model's build: `run.py` builds every model in fp32 on the GPU before the engine casts,
  shards or offloads it: 4 B per parameter (plain engine: plus its main gradients, the moments
  it keeps on the GPU and the bf16 copy the cast makes), except the offloaded plain engine in
  bf16 / fp16 (`lean_build`): one sub-module in fp32 at a time, then the bf16 buffer, the main
  gradients and the GPU share's fp32 masters; its fp32 model waits on the host (4 B per
  parameter, counted in the host verdict). `peak_allocated` is the larger of that
  and training, what `pretrain_gpt.py` logs; the verdict takes the larger too.
- activations: what megazoo's block saves for the backward, tensor by tensor
  (`megazoo/plan/activations.py`; GPT at tp = 1: 32 s b h bytes per block, no s x s term:
  attention is a fused kernel and dropout is 0). Megatron sequence parallelism divides the
  norm inputs by t; Ulysses divides everything by sp. Selective recompute drops RoPE's
  rotated q, k and the attention output's extra copy; full recompute keeps only the block
  input (2 s b h, / t under SP) plus one block's full activations while it is recomputed.
  The first pipeline stage holds min(p, m) micro-batches under 1F1B, times
  (1 + (p - 1) / (p v)) when interleaved; the last stage adds the final norm and head inputs
  and the loss's peak (10 B per element of s b V / (t sp) in bf16, 8 in fp32).
- communication buffers: DeepSpeed's reduce bucket (5e8 elements, allocated whole at ZeRO-3;
  ZeRO-1/2 also an all-gather bucket, capped at the parameters held), the plain engine's
  bf16 copies of offloaded gradient buckets, pipeline send/receive buffers; plus 1 GiB of
  CUDA context and library workspaces.
- fragmentation allowance: 10 % of everything above (allocator caching and splitting).
- host: the offloaded bytes above plus the process's runtime (2.05 GB with DeepSpeed, 1.39 GB
  without, fitted to measured peaks), per GPU and per node (`--gpus-per-node` ranks).

The claim "BLOOM-176B trains on 8x A100-80GB with ZeRO-3 + CPU optimizer offload in under
24 GB per GPU" does not hold. Optimizer offload leaves the bf16 parameters on the GPUs:
176.2e9 x 2 B / 8 = 44 GB per GPU before anything else. With full recompute, micro-batch 1
and 2048 tokens the planner puts the layout at about 83.5 GB per GPU (44 GB of parameter
shards, 12 GB of gathered parameters, 7 GB of a gathered gradient unit, 10.4 GB of
activations, buffers and a 10% allowance), so it does not fit even the 80 GB, and the
offloaded fp32 master weights, Adam moments and gradients (16 B per parameter) need 2.8 TB
of host memory on the node, 3.4 TB with DeepSpeed's pinned buffers and runtime. Offloading the
parameters too (ZeRO-Infinity, `--offload-param cpu`) brings the GPU to about 35 GB,
bounded below by the gathered
250,880 x 14,336 embedding (3.6e9 parameters: 7.2 GB in bf16, as much again for its
gradient) and the 2.5e9-parameter blocks, and raises host memory to 4.0 TB.

The package imports its parts on first use, so `megazoo.plan.offload` (which the training
engine imports) loads without the planner's command line.
"""
import importlib

_EXPORTS = {
    "block_coefficients": "activations", "stage_activations": "activations",
    "format_table": "cli", "main": "cli", "PlanOptions": "layout", "Resolved": "layout",
    "resolve": "layout", "GB": "memory", "RUNTIME_BYTES": "memory", "MemoryEstimate": "memory",
    "activation_bytes": "memory", "estimate_memory": "memory", "stage_parameters": "memory",
    "stage_estimates": "stages", "Cluster": "clusters", "load_cluster": "clusters",
    "StepTime": "timing", "step_time": "timing",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
