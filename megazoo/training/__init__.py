"""Training: typed config and command line, one training step, backends, checkpoints.

- `config`, `arguments`, `zero_config`, `ds_config`: the run's typed configuration and the
  generated Megatron-style command line;
- `run` (setup, entry point) and `loop` (steps, logs, evaluation, checkpoints, the final
  sample), `metrics` (the log line, JSON lines, FLOPs, MFU, memory) and `log_writers`;
- `gradients` (the gradient contract: completion, global norm, clipping), `optim` (the one
  AdamW builder), `lr_schedule` (the learning rate of the n-th applied step), `scaler`
  (fp16 loss scaling), `nonfinite` (skipped-step accounting and the stop);
- `backends/`: plain (Megatron DDP + distributed optimizer), FSDP2 and DeepSpeed, each
  owning only wrap / backward / finish gradients / step / save / load, and the factory.
"""
