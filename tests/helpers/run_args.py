"""The run's PretrainArgs built directly (no flags): a planner layout, or a DeepSpeed run."""
from __future__ import annotations

import dataclasses
import json

from megazoo.config.flags import parse_args
from megazoo.config.run import DataConfig, PretrainArgs, TrainingConfig
from megazoo.config.zero import ZeroConfig
from megazoo.models import ModelConfig
from megazoo.parallel import ParallelConfig

from .fixtures import tiny_config

# A toy GPT: h=64, 2 layers, 8 heads, vocab 300 (padded 384 at tp=1, 512 at tp=2), 128 positions.
TOY = tiny_config("gpt", max_position_embeddings=128)


def plan_args(model=TOY, *, seq_length=2048, micro_batch_size=1, dp=1, micro_batches=None,
              recompute="none", tp=1, sp=1, pp=1, vpp=1, sequence_parallel=False, bf16=True,
              **zero):
    """The run's bf16 PretrainArgs for a layout: `micro_batches` per step (default pp, the
    pipeline full), `zero`: ZeroConfig fields (zero_impl defaults to deepspeed when a stage is
    given)."""
    if zero.get("zero_stage") and "zero_impl" not in zero:
        zero["zero_impl"] = "deepspeed"
    m = micro_batches or pp
    return PretrainArgs(
        model=dataclasses.replace(model, recompute=recompute),
        parallel=ParallelConfig(tp=tp, sp=sp, pp=pp, vpp=vpp, dp=dp,
                                sequence_parallel=sequence_parallel),
        training=TrainingConfig(micro_batch_size=micro_batch_size, bf16=bf16,
                                global_batch_size=micro_batch_size * dp * m),
        data=DataConfig(seq_length=seq_length), zero=ZeroConfig(**zero))


def ds_args(tmp_path=None, ds: dict | None = None, training=None, **zero):
    """A --deepspeed run's PretrainArgs: `ds` written to tmp_path/ds.json as its ds_config,
    `zero`: ZeroConfig fields."""
    if ds is not None:
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(ds))
        zero["deepspeed_config"] = str(path)
    zero.setdefault("deepspeed", True)
    training = training or TrainingConfig(micro_batch_size=4, global_batch_size=32)
    return PretrainArgs(model=ModelConfig(), parallel=ParallelConfig(), training=training,
                        zero=ZeroConfig(**zero))


def tiny_args(save, *extra):
    args = parse_args(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                       "--max-position-embeddings", "16", "--seq-length", "16", "--save", str(save),
                       *extra])
    args.model = dataclasses.replace(args.model, vocab_size=96)  # as build_data sets it
    return args
