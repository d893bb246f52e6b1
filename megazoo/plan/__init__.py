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
offload: `offload.py`), ZeRO-3's gathered working set, buffers and the verdict (`memory.py`),
activations tensor by tensor (`activations.py`), each pipeline stage (`stages.py`), the
largest shape that fits (`largest.py`). bench/results/plan_memory_* compare it with
measurements.

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
