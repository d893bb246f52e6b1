"""Training a model: `run` (setup and the entry point of `pretrain_gpt.py`), `loop` (steps,
logs, evaluation, checkpoints), `gradients` (the gradient contract: completion, global norm,
clipping), `optim` (the one AdamW builder), `lr_schedule`, `scaler` (fp16 loss scaling),
`nonfinite` (skipped steps and the stop), and `backends/` (plain, FSDP2 and DeepSpeed, each
owning only wrap / backward / finish gradients / step / save / load). The run's configuration
and flags are `megazoo.config`'s.
"""
