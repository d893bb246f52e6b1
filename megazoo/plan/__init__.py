"""Memory planner: what one training run needs per GPU and on the host, and whether it fits;
with `--cluster C`, the step time on a cluster, and with `--search` the fastest layout
(docs/planner.md; `timing.py`, `search.py`).

    python -m megazoo.plan --model bloom-176b --dp 8 --deepspeed --zero-stage 3 \
        --offload-optimizer cpu --recompute full --micro-batch-size 1 --global-batch-size 8 \
        --seq-length 2048 --gpu-memory 80 [--json]

The planner reads a run's own configuration: its command line is `pretrain_gpt.py`'s (the
same flags, names and defaults, generated from the same dataclasses) plus `--dp` (the
data-parallel size, which a launched run takes from its world size), `--gpu-memory`,
`--gpus-per-node`, `--fp32-grad-accumulation`, `--json` and `--out PNG` (the plan of each
pipeline stage as a stacked bar, `stages.py`); it checks them with the run's
own `megazoo.training.validate.check_args`, so a layout it plans is one the run accepts.
`estimate_memory(args)` takes the run's `PretrainArgs` and is a pure function returning a
`MemoryEstimate` (bytes). It plans bf16 mixed precision whatever `--bf16` says.
The model (all of it stated, so a measurement can be compared part by part):

- parameters, per GPU: the most loaded pipeline stage's share per tp rank (`stage_parameters`),
  bf16 (2 B). ZeRO-3 divides them over Z = dp * sp (the ranks holding the same shard) and
  adds the gathered working set: two units of full bf16 parameters (the one computing and
  one prefetched) plus one unit's full gradient awaiting its reduce-scatter; a unit is a
  transformer block or the embedding/head (FSDP2 `fully_shard` per block).
- gradients: 2 B (bf16) or 4 B (fp32 accumulation) per parameter, / Z from ZeRO-2; with CPU
  optimizer offload they are reduced through the buckets straight to host memory.
- optimizer states: Adam in mixed precision, fp32 master + m + v = 12 B, / Z from ZeRO-1;
  moved to the host with `--offload-optimizer cpu`, together with 4 B of fp32 gradients.
- activations: what megazoo's block saves for the backward, tensor by tensor
  (`megazoo/plan/activations.py`; GPT at tp = 1: 32 s b h bytes per block, no s x s term:
  attention is a fused kernel and dropout is 0). Megatron sequence parallelism divides the
  norm inputs by t; Ulysses divides everything by sp. Selective recompute drops RoPE's
  rotated q, k and the attention output's extra copy; full recompute keeps only the block
  input (2 s b h, / t under SP) plus one block's full activations while it is recomputed.
  The first pipeline stage holds min(p, m) micro-batches under 1F1B, times
  (1 + (p - 1) / (p v)) when interleaved; the last stage adds the final norm and head inputs
  and the loss's peak: bf16 logits, their fp32 copy and fp32 exp together (10 B per element
  of s b V / (t sp)). (Korthikanti et al.'s s b h (34 + 5 a s / h) describes a block that
  stores the softmax; it overestimated ours several times over for "none".)
- communication buffers: ZeRO reduce (and, for ZeRO-1/2, all-gather) buckets of 5e8
  elements (DeepSpeed's defaults, capped at the parameters held), DDP buckets 2 x 25 MB,
  pipeline send/receive buffers; plus 1 GiB of CUDA context and library workspaces.
- fragmentation allowance: 10 % of everything above (allocator caching and splitting).
- host memory with optimizer offload: the 16 B above (times the offloaded fraction with
  ZeRO-3 partial offload); under ZeRO-3 also what DeepSpeed 0.19.8's stage3.py keeps there:
  the flat buffer of partitioned gradients in the accumulation dtype (2 B for every
  parameter, `grad_partitions_flat_buffer`), the fp32 gradient buffer of the largest
  sub-group (<= 1e9 elements) allocated while the optimizer states initialise (a peak), and
  3.2 GB of process runtime (fitted to measured peaks; bench/README.md compares predicted
  and measured host memory). ZeRO-1/2 count the 16 B only.
- `--zero-impl fsdp2` (ZeRO-3 through FSDP2): no DeepSpeed buckets; its CPU offload keeps
  fp32 parameters, gradients and Adam m, v on the host (16 B per parameter) and only the
  gathered working set on the GPU, plus 2.5 GB of host runtime (fitted to a measured run,
  bench/README.md). Without resharding after forward (`--no-fsdp-reshard-after-forward`)
  the working set is every unit of the stage, gathered: 2 B per parameter.

The claim "BLOOM-176B trains on 8x A100-80GB with ZeRO-3 + CPU optimizer offload in under
24 GB per GPU" does not hold. Optimizer offload leaves the bf16 parameters on the GPUs:
176.2e9 x 2 B / 8 = 44 GB per GPU before anything else. With full recompute, micro-batch 1
and 2048 tokens the planner puts the layout at about 83.5 GB per GPU (44 GB of parameter
shards, 12 GB of gathered parameters, 7 GB of a gathered gradient unit, 10.4 GB of
activations, buffers and a 10% allowance), so it does not fit even the 80 GB, and the
offloaded fp32 master weights, Adam moments and gradients (16 B per parameter) need 2.8 TB
of host memory on the node, 3.2 TB with DeepSpeed's buffers and runtime. Offloading the
parameters too (ZeRO-Infinity, `--offload-param cpu`) brings the GPU to about 35 GB,
bounded below by the gathered
250,880 x 14,336 embedding (3.6e9 parameters: 7.2 GB in bf16, as much again for its
gradient) and the 2.5e9-parameter blocks, and raises host memory to 3.6 TB.
"""
from .activations import block_coefficients, stage_activations
from .cli import format_table, main
from .layout import PlanOptions, Resolved, resolve
from .memory import (GB, RUNTIME_BYTES, MemoryEstimate, activation_bytes, estimate_memory,
                     stage_parameters)
from .stages import stage_estimates
from .clusters import Cluster, load_cluster
from .timing import StepTime, step_time

__all__ = ["GB", "RUNTIME_BYTES", "MemoryEstimate", "PlanOptions", "Resolved", "activation_bytes",
           "block_coefficients", "estimate_memory", "format_table", "main", "resolve",
           "stage_activations", "stage_estimates", "stage_parameters",
           "Cluster", "StepTime", "load_cluster", "step_time"]
