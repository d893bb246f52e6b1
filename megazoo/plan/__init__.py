"""Memory planner: what one training run needs per GPU, on the host and on disk, and whether
it fits; with `--cluster C`, the step time on a cluster, and with `--search` the fastest
layout (docs/planner.md).

    python -m megazoo.plan --model bloom-176b --dp 8 --deepspeed --zero-stage 3 \
        --offload-optimizer cpu --recompute full --micro-batch-size 1 --global-batch-size 8 \
        --bf16 --gpu-memory 80 --host-memory 2000 [--json] [--out PNG]
    python -m megazoo.plan --largest --model-family llama --gpu-memory 80 --host-memory 125 \
        --disk-memory 500 --optimizer-cpu-offload [--nvme-path DIR] [layout flags]

The command line is `pretrain_gpt.py`'s, checked by the run's own `check_args`, plus the
planner's few flags (`cli.py`). `estimate_memory(args)` is a pure function of the run's
`PretrainArgs`: a `MemoryEstimate` in bytes, stated part by part where each is computed:
parameters, gradients and optimizer states per engine (`engines.py`; the plain engine's
offload: `megazoo.offload`, the rules the engine applies too), ZeRO-3's gathered working
set, buffers and the verdict (`memory.py`), activations tensor by tensor (`activations.py`),
each pipeline stage (`stages.py`), the largest shape that fits (`largest.py`). bench/results/plan_memory_* compare it with
measurements.
"""
from .activations import block_coefficients, stage_activations
from .cli import format_table, main
from .clusters import Cluster, load_cluster
from .layout import PlanOptions, Resolved, resolve
from .memory import (GB, RUNTIME_BYTES, MemoryEstimate, activation_bytes, estimate_memory,
                     stage_parameters)
from .stages import stage_estimates
from .timing import StepTime, step_time

__all__ = ["block_coefficients", "stage_activations", "format_table", "main", "Cluster",
           "load_cluster", "PlanOptions", "Resolved", "resolve", "GB", "RUNTIME_BYTES",
           "MemoryEstimate", "activation_bytes", "estimate_memory", "stage_parameters",
           "stage_estimates", "StepTime", "step_time"]
