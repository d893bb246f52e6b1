"""Plan a published layout that pretrain_gpt.py itself cannot launch: an uneven pipeline.

BLOOM-176B ran 70 blocks on 12 pipeline stages with Megatron-DeepSpeed's partition that
counts the embedding and the head as one layer each: 5 blocks on the first and last stage, 6
on every other. pretrain_gpt.py splits layers evenly (num_layers / pp), so its checks refuse
--pp 12 for 70 layers. To predict such a run anyway, `plan_args` checks every other flag
as the run does (with the layer count rounded up to the split's 72, which changes no other
check), then plans the real model with the uneven split (`timing.stage_layers`) and says so
in a note. `--search` never proposes such a layout: it only returns what the run accepts.

Such a run's memory is also its engine's: `megatron_deepspeed_gb` adds what DeepSpeed's
BF16_Optimizer (the engine of Megatron-DeepSpeed, BLOOM's) keeps beyond megazoo's: the bf16
gradient of every parameter (2 B), which it leaves in `param.grad` after adding it into its
full fp32 gradient buffer (`update_hp_grads`; cleared only when the next backward starts),
where megazoo's weight-gradient GEMMs add straight into the fp32 buffer.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses

from ..config.flags import args_from_namespace, given_fields, set_fields
from ..config.model import ModelConfig
from ..config.presets import PRESETS
from ..config.run import PretrainArgs
from .memory import FRAGMENTATION, GB, MemoryEstimate
from .timing import stage_layers


def plan_args(ns: argparse.Namespace) -> tuple[PretrainArgs, ModelConfig, list[str]]:
    """(args checked as the run checks them, the model to plan, notes) from parsed flags.

    The args' model differs from the returned one only for an uneven pipeline split."""
    try:
        args = args_from_namespace(ns)
        return args, args.model, []
    except ValueError:
        layers = given_fields(ns, "model").get("num_layers") or (
            PRESETS[ns.model_name].num_layers if ns.model_name in PRESETS else None)
        pp = given_fields(ns, "parallel").get("pp", 1) or 1
        if layers is None or pp < 2 or layers % pp == 0 or (layers + 2) % pp \
                or given_fields(ns, "training").get("num_layers_per_virtual_pipeline_stage"):
            raise
    stand_in = copy.copy(ns)
    set_fields(stand_in, "model", {"num_layers": layers + 2}, keep_given=False)
    args = args_from_namespace(stand_in)  # every other check, as the run does them
    config = dataclasses.replace(args.model, num_layers=layers)
    split = stage_layers(layers, pp, 1)
    note = (f"pretrain_gpt.py cannot run this layout (num_layers {layers} does not divide by "
            f"pp {pp}); planned with Megatron-DeepSpeed's split that counts the embedding and "
            f"the head as a layer each: {split[0]}, {split[1]}, ..., {split[-1]} blocks per stage")
    return args, config, [note]


def megatron_deepspeed_gb(estimate: MemoryEstimate) -> float:
    """GB per GPU of the same stage under Megatron-DeepSpeed's BF16_Optimizer: megazoo's
    estimate plus a bf16 gradient per parameter (and its share of the allocator allowance)."""
    return (estimate.gpu_total + 2.0 * estimate.parameters_per_gpu * (1 + FRAGMENTATION)) / GB
