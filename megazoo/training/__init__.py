"""Training: typed config and command line, optimizer and schedules, engines, checkpoints.

An *engine* (``megazoo.training.engine.Engine``) owns the model, the optimizer and the
gradient reduction, and runs one optimizer step over a global batch's micro-batches; the
training loop in ``pretrain_gpt.py`` only feeds it batches, logs and saves. Engines: plain
data parallel (+ tp / sp / pp), DeepSpeed ZeRO (``zero.py``), FSDP2 with pipelines
(``fsdp.py``).
"""
