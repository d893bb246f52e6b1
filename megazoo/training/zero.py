"""`DeepSpeedEngine`: ZeRO-1/2/3 (with CPU / NVMe offload) through `deepspeed.initialize`.

    engine = DeepSpeedEngine(model, state, args)       # args: PretrainArgs (.training, .zero)
    result = engine.train_step(micro_batches)          # one optimizer step

ZeRO partitions over our `dp_sp` group (DeepSpeed's "sequence data parallel" group, from
`ZeroMPU(state)`); tensor-parallel shards stay shards (DeepSpeed's "model parallel" group is
our tp). Gradient scaling under Ulysses: each sp rank holds a partial sum of the true gradient
of the one mean loss, which needs "sum over sp, mean over dp" (`allreduce_gradients`).
DeepSpeed 0.19.8's ZeRO-1/2 divide their dp x sp reduction by dp x sp / sp = dp: right as
is. Its ZeRO-3 path (measured here on gloo at sp=2 with dp=1 and dp=2) leaves gradients at
1/sp of that, the case `allreduce_gradients`' docstring warns about: for stage 3 the backward
loss is multiplied by sp (`grad_scale`). The sp tests against the plain engine guard both.
Megatron-SP parameters get their tp sum from a gradient hook
(`zero_setup.sum_sequence_parallel_grads`).

DeepSpeed has no place in our pipeline schedules (it only pipelines through its own
PipelineEngine, and refuses ZeRO-2/3 there): pp > 1 is a ValueError pointing at
`--zero-impl fsdp2`.

Precision is DeepSpeed's: with bf16 / fp16 enabled it casts the model to that dtype and keeps
fp32 master weights in the (possibly offloaded) optimizer. The learning rate of each step is
`megazoo.training.schedule.learning_rate`, written into the optimizer's groups before the
step; the gradient norm is DeepSpeed's (before clipping, each tp shard counted once).

Checkpoints: `save(path, extra)` writes DeepSpeed's own files under `path/zero/` (its format,
including the partitioned optimizer state) and `path/megazoo.json` with format
"megazoo-deepspeed-1" (model config, layout, engine counters and `extra`, JSON).
`checkpoints_tools/zero_to_megazoo.py` turns such a folder into an ordinary megazoo
checkpoint loadable at any layout.
"""
from __future__ import annotations

import json
import math
import os

import torch
import torch.distributed as dist

from ..parallel.state import ParallelState
from .ds_config import build_ds_config, offload_device, zero_stage
from .ds_ops import prepare_ops
from .engine import Engine, StepResult, dp_mean, mean_eval_loss
from .schedule import learning_rate
from .zero_setup import (ZeroMPU, build_optimizer, check_nvme, ensure_process_group,
                         sum_sequence_parallel_grads, tag_tensor_parallel, use_accelerator_of)

DS_FORMAT = "megazoo-deepspeed-1"
TAG = "zero"


def check_layout(state: ParallelState) -> None:
    if state.pp.size > 1:
        raise ValueError(f"DeepSpeed cannot run megazoo's pipeline schedules (pp={state.pp.size}): "
                         "use --zero-impl fsdp2 for ZeRO-3 with pipelines, or set "
                         "--pipeline-model-parallel-size 1")


class DeepSpeedEngine(Engine):
    """ZeRO through DeepSpeed: `DeepSpeedEngine(model, state, args, *, cpu_adam=None)`.

    `args` needs `.training` (TrainingConfig: lr and schedule fields, weight_decay, adam_*,
    clip_grad, micro_batch_size, global_batch_size, bf16, fp16, loss-scale fields) and
    `.zero` (ZeroConfig). `cpu_adam`: None picks DeepSpeedCPUAdam when the optimizer is
    offloaded and its op loads; False forces torch AdamW.
    """

    def __init__(self, model: torch.nn.Module, state: ParallelState, args, *,
                 cpu_adam: bool | None = None):
        check_layout(state)
        self.state, self.args, self.cfg = state, args, args.training
        self.ds_config = build_ds_config(args, state.dp.size)  # ValueErrors, no collective
        device = next(model.parameters()).device
        if zero_stage(self.ds_config) == 0 and offload_device(self.ds_config) != "none":
            raise ValueError("optimizer offload needs ZeRO stage 1-3: pass --zero-stage")
        if device.type == "cpu" and self.cfg.fp16:
            raise ValueError("DeepSpeed's CPU accelerator has no fp16: on CPU use --bf16 or fp32")
        use_accelerator_of(device)
        check_nvme(self.ds_config)
        prepare_ops(self.ds_config, announce=state.global_rank == 0)
        ensure_process_group(state)
        import deepspeed

        tag_tensor_parallel(model, state)
        self._hooks = sum_sequence_parallel_grads(model, state)
        optimizer = build_optimizer(model, self.cfg, self.ds_config, cpu_adam)
        self.uses_cpu_adam = type(optimizer).__name__ == "DeepSpeedCPUAdam"
        self.cpu_offload = offload_device(self.ds_config) == "cpu"
        self.ds, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=self.ds_config, mpu=ZeroMPU(state))
        self.model = self.ds.module
        self.device = device
        self.steps = 0  # optimizer steps taken (skipped included): drives the schedule
        stage3_sp = zero_stage(self.ds_config) == 3 and state.sp.size > 1
        self.grad_scale = float(state.sp.size) if stage3_sp else 1.0  # see the module doc

    # -- helpers ------------------------------------------------------------------------
    @property
    def accumulation(self) -> int:
        return int(self.ds_config["gradient_accumulation_steps"])

    def _check_batches(self, micro_batches) -> None:
        if len(micro_batches) != self.accumulation:
            raise ValueError(f"got {len(micro_batches)} micro-batches; the DeepSpeed config "
                             f"accumulates {self.accumulation} per step (global batch / "
                             "(micro batch x dp)): pass that many")

    def _loss_scale(self) -> float | None:
        if not self.cfg.fp16:
            return None
        return float(getattr(self.ds.optimizer, "cur_scale", getattr(self.ds.optimizer,
                                                                       "loss_scale", math.nan)))

    # -- Engine interface ---------------------------------------------------------------
    def train_step(self, micro_batches) -> StepResult:
        self._check_batches(micro_batches)
        self.ds.train()
        lr = learning_rate(self.steps, self.cfg)
        for group in self.ds.optimizer.param_groups:
            group["lr"] = lr
        self.steps += 1
        skipped_before = self.ds.skipped_steps
        total = torch.zeros((), device=self.device)
        for b in micro_batches:
            loss = self.ds(b["input_ids"], labels=b["labels"])
            self.ds.backward(loss * self.grad_scale)  # DeepSpeed scales by 1 / accumulation
            self.ds.step()          # steps the optimizer at the accumulation boundary
            total += loss.detach().float() / len(micro_batches)
        skipped = self.ds.skipped_steps != skipped_before
        norm = self.ds.get_global_grad_norm()
        norm = math.nan if skipped or norm is None else float(norm)
        return StepResult(dp_mean(total, self.state), norm, lr, self._loss_scale(), skipped=skipped)

    @torch.no_grad()
    def eval_loss(self, micro_batches) -> float:
        self.ds.eval()
        return mean_eval_loss(self.ds, micro_batches, self.state, self.device)  # pp is 1 here

    def save(self, path: str, extra: dict) -> None:
        """DeepSpeed's files under `path/zero/`, then `path/megazoo.json` (rank 0)."""
        self.ds.save_checkpoint(path, tag=TAG)
        if self.state.global_rank == 0:
            meta = {"format": DS_FORMAT, "tag": TAG, "model": self.model.config.to_dict(),
                    "layout": {"tp": self.state.tp.size, "sp": self.state.sp.size,
                               "dp": self.state.dp.size, "pp": 1, "vpp": 1},
                    "zero_stage": zero_stage(self.ds_config),
                    "engine": {"steps": self.steps}, "extra": extra,
                    "hint": "convert with checkpoints_tools/zero_to_megazoo.py --load DIR --out O"}
            tmp = os.path.join(path, f".megazoo.json.tmp{os.getpid()}")
            with open(tmp, "w") as f:
                json.dump(meta, f, indent=1)
            os.replace(tmp, os.path.join(path, "megazoo.json"))
        if self.state.world_size > 1:
            dist.barrier()

    def load(self, path: str) -> dict:
        meta = read_ds_metadata(path)
        saved = (meta["layout"]["tp"], meta["layout"]["dp"] * meta["layout"]["sp"])
        here = (self.state.tp.size, self.state.dp_sp.size)
        if saved != here:  # DeepSpeed's partitions are tied to the tp and dp x sp sizes
            raise ValueError(f"{path} was saved at (tp, dp x sp) = {saved}, this run has {here}: "
                             "resume with the same layout, or convert it with "
                             "checkpoints_tools/zero_to_megazoo.py and load the weights")
        loaded, _ = self.ds.load_checkpoint(path, tag=meta["tag"])
        if loaded is None:
            raise ValueError(f"DeepSpeed could not load {path}/{meta['tag']}")
        self.steps = int(meta["engine"]["steps"])
        return meta.get("extra") or {}


def read_ds_metadata(path: str) -> dict:
    """`path/megazoo.json` of a DeepSpeedEngine checkpoint (clear errors otherwise)."""
    file = os.path.join(path, "megazoo.json")
    if not os.path.isfile(file):
        raise ValueError(f"{path} is not a megazoo DeepSpeed checkpoint: megazoo.json is missing")
    with open(file) as f:
        meta = json.load(f)
    if meta.get("format") != DS_FORMAT:
        raise ValueError(f"{file}: format {meta.get('format')!r} is not {DS_FORMAT!r} "
                         "(an ordinary megazoo checkpoint loads with load_model_weights)")
    return meta
