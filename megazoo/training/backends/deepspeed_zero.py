"""`DeepSpeedEngine`: ZeRO-1/2/3 (with CPU / NVMe offload) through `deepspeed.initialize`.

    engine = DeepSpeedEngine(model, state, args)       # args: PretrainArgs (.training, .zero)
    result = engine.train_step(micro_batches)          # one optimizer step

Owns: `deepspeed.initialize` and its JSON config, the micro-batch backward and step
(DeepSpeed's own `engine.backward` / `engine.step`, through the pipeline executor's
`backward` hook), the skip decision (DeepSpeed's `skipped_steps` counter, so a skipped step
does not advance the lr clock) and its checkpoint files. Precision, fp32 masters and the
gradient norm (before clipping, each tp shard counted once) are DeepSpeed's.

ZeRO partitions over our `dp_sp` group (`ZeroMPU(state)`); DeepSpeed's "model parallel"
group is our tp. Under Ulysses the gradient contract is "sum over sp, mean over dp"
(`allreduce_gradients`): ZeRO-1/2 divide their dp x sp reduction by dp, right as is; ZeRO-3
leaves gradients at 1/sp of that, so for stage 3 the backward loss is multiplied by sp
(`grad_scale`). DeepSpeed pipelines only through its own PipelineEngine, which refuses
ZeRO-2/3: pp > 1 is a ValueError pointing at `--zero-impl fsdp2`.

Checkpoints: DeepSpeed's own files under `path/zero/` and `path/megazoo.json`
("megazoo-deepspeed-1": model config, layout, engine counters, `extra` and a checksum of
every DeepSpeed file, `megazoo.checkpoint.deepspeed`). `load` verifies the checksums before
DeepSpeed reads a byte and the loaded state for inf / nan after (--no-verify-checksums,
--allow-nonfinite-load as for every checkpoint); `checkpoints_tools/zero_to_megazoo.py`
turns such a folder into an ordinary megazoo checkpoint loadable at any layout.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ...checkpoint.deepspeed import (FILES_KEY, check_files, check_finite_loaded,
                                      record_checksums)
from ...checkpoint.deepspeed import read_ds_metadata, write_ds_metadata
from ...checkpoint.save import refuse_nonfinite
from ...config.compression import check_onebit_backend
from ...config.ds_config import build_ds_config, offload_device, onebit_optimizer, zero_stage
from ...config.validate import check_deepspeed_pipeline
from ...parallel.state import ParallelState
from ..optim import param_groups
from .base import Engine
from ..gradients import hook_sequence_parallel_grads
from .deepspeed_setup import (ZeroMPU, build_optimizer, check_nvme, ensure_process_group,
                         tag_tensor_parallel, use_accelerator_of)
from ..ds_ops import prepare_ops
from ..run_checks import read_options

TAG = "zero"


class DeepSpeedEngine(Engine):
    """ZeRO through DeepSpeed: `DeepSpeedEngine(model, state, args, *, cpu_adam=None)`.

    `args` needs `.training` (TrainingConfig: lr and schedule fields, weight_decay, adam_*,
    clip_grad, micro_batch_size, global_batch_size, bf16, fp16, loss-scale fields) and
    `.zero` (ZeroConfig). `cpu_adam`: None picks DeepSpeedCPUAdam when the optimizer is
    offloaded and its op loads; False forces torch AdamW.
    """

    checkpoint_kind = "deepspeed"

    def __init__(self, model: torch.nn.Module, state: ParallelState, args, *,
                 cpu_adam: bool | None = None):
        check_deepspeed_pipeline(state.pp.size)
        self.state, self.args, self.cfg = state, args, args.training
        self.ds_config = build_ds_config(args, state.dp.size)  # ValueErrors, no collective
        device = next(model.parameters()).device
        if zero_stage(self.ds_config) == 0 and offload_device(self.ds_config) != "none":
            raise ValueError("optimizer offload needs ZeRO stage 1-3: pass --zero-stage")
        if device.type == "cpu" and self.cfg.fp16:
            raise ValueError("DeepSpeed's CPU accelerator has no fp16: on CPU use --bf16 or fp32")
        onebit = onebit_optimizer(self.ds_config)
        if onebit is not None:  # DeepSpeed builds it from the "optimizer" section
            check_onebit_backend(onebit, self.ds_config, device)
        use_accelerator_of(device)
        check_nvme(self.ds_config)
        prepare_ops(self.ds_config, announce=state.global_rank == 0)
        ensure_process_group(state)
        import deepspeed

        tag_tensor_parallel(model, state)
        hook_sequence_parallel_grads(model, state)
        optimizer = None if onebit else build_optimizer(model, self.cfg, self.ds_config, cpu_adam)
        self.cpu_offload = offload_device(self.ds_config) == "cpu"
        self.gathers_parameters = zero_stage(self.ds_config) == 3
        params = param_groups(model, self.cfg.weight_decay) if onebit else None
        self.ds, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, model_parameters=params, config=self.ds_config,
            mpu=ZeroMPU(state))
        self.model = self.ds.module
        self.device = device
        self.steps = 0
        stage3_sp = zero_stage(self.ds_config) == 3 and state.sp.size > 1
        self.grad_scale = float(state.sp.size) if stage3_sp else 1.0  # see the module doc

    # -- the backend interface ---------------------------------------------------------------
    def stage(self, num_microbatches: int, loss_scale: float):
        return _DeepSpeedStage(self.ds)

    def eval_module(self):
        return _DeepSpeedStage(self.ds)

    def start_step(self, num_microbatches: int, lr: float) -> None:
        accumulation = int(self.ds_config["gradient_accumulation_steps"])
        if num_microbatches != accumulation:
            raise ValueError(f"got {num_microbatches} micro-batches; the DeepSpeed config "
                             f"accumulates {accumulation} per step (global batch / "
                             "(micro batch x dp)): pass that many")
        self.ds.train()
        for group in self.ds.optimizer.param_groups:
            group["lr"] = lr
        self._m, self._skipped_before = num_microbatches, self.ds.skipped_steps

    def backward(self, loss: torch.Tensor) -> None:
        """DeepSpeed's own backward and step per micro-batch: it divides by the accumulation
        itself (so the executor's 1/m is undone) and steps at the accumulation boundary."""
        self.ds.backward(loss * (self._m * self.grad_scale))
        self.ds.step()

    def finish_gradients(self) -> float:
        norm = self.ds.get_global_grad_norm()
        return math.nan if norm is None else float(norm)

    def step(self, lr: float, norm: float, loss_is_finite: bool) -> bool:
        """DeepSpeed stepped already; whether it applied the step is its own overflow count."""
        return self.ds.skipped_steps == self._skipped_before

    def reported_loss_scale(self) -> float | None:
        if not self.cfg.fp16:
            return None
        return float(getattr(self.ds.optimizer, "cur_scale", getattr(self.ds.optimizer,
                                                                       "loss_scale", math.nan)))

    def _local_parameters(self):
        """(name, this rank's tensor of it): the ZeRO-3 partition where parameters are
        partitioned (their module tensors are then empty placeholders), else the parameter."""
        for name, p in self.model.named_parameters():
            yield name, getattr(p, "ds_tensor", p)

    def save(self, path: str, extra: dict) -> None:
        """DeepSpeed's files under `path/zero/`, then `path/megazoo.json` (rank 0); first
        the check every engine's save makes (`refuse_nonfinite`): nothing is written when any
        rank's weights hold inf or nan."""
        refuse_nonfinite(self._local_parameters(), path, self.state, self.device)
        self.ds.save_checkpoint(path, tag=TAG)
        if self.state.world_size > 1:
            dist.barrier()  # every rank's files are written before they are hashed
        algorithm, sums = record_checksums(path, TAG, self.state)
        if self.state.global_rank == 0:
            meta = {"tag": TAG, "model": self.model.config.to_dict(),
                    "checksum": algorithm, FILES_KEY: sums,
                    "layout": {"tp": self.state.tp.size, "sp": self.state.sp.size,
                               "dp": self.state.dp.size, "pp": 1, "vpp": 1},
                    "zero_stage": zero_stage(self.ds_config),
                    "engine": {"steps": self.steps}, "extra": extra,
                    "hint": "convert with checkpoints_tools/zero_to_megazoo.py --load DIR --out O"}
            write_ds_metadata(path, meta)
        if self.state.world_size > 1:
            dist.barrier()

    def _state_tensors(self):
        """(name, tensor) of this rank's weights and optimizer state (the fp32 partitions
        and moments DeepSpeed's optimizer steps), for the check after loading."""
        yield from self._local_parameters()
        inner = getattr(self.ds.optimizer, "optimizer", self.ds.optimizer)
        for i, group in enumerate(getattr(inner, "param_groups", [])):
            for j, p in enumerate(group["params"]):
                yield f"optimizer group {i} tensor {j}", p
                for key, value in getattr(inner, "state", {}).get(p, {}).items():
                    if torch.is_tensor(value):
                        yield f"optimizer group {i} tensor {j} {key}", value

    def load(self, path: str) -> dict:
        meta = read_ds_metadata(path)
        options = read_options(self.args)
        check_files(path, meta, options["verify_checksums"], self.state, self.device)
        saved = (meta["layout"]["tp"], meta["layout"]["dp"] * meta["layout"]["sp"])
        here = (self.state.tp.size, self.state.dp_sp.size)
        if saved != here:  # DeepSpeed's partitions are tied to the tp and dp x sp sizes
            raise ValueError(f"{path} was saved at (tp, dp x sp) = {saved}, this run has {here}: "
                             "resume with the same layout, or convert it with "
                             "checkpoints_tools/zero_to_megazoo.py and load the weights")
        loaded, _ = self.ds.load_checkpoint(path, tag=meta["tag"])
        if loaded is None:
            raise ValueError(f"DeepSpeed could not load {path}/{meta['tag']}")
        if not options["allow_nonfinite"]:
            check_finite_loaded(self._state_tensors(), path, self.state, self.device)
        self.steps = int(meta["engine"]["steps"])
        return meta.get("extra") or {}


class _DeepSpeedStage:
    """The DeepSpeed engine as the pipeline executor sees it: calls go through DeepSpeed's
    forward, attributes (chunks, config, state, parameters) come from our model."""

    def __init__(self, ds):
        self._ds = ds

    def __getattr__(self, name):
        return getattr(self._ds.module, name)

    def __call__(self, *args, **kwargs):
        return self._ds(*args, **kwargs)

    def eval(self):
        self._ds.eval()
