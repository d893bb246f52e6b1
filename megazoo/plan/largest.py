"""`python -m megazoo.plan --largest --model-family llama|gpt [layout flags]`: the largest model of
a family whose plan fits --gpu-memory, --host-memory and --disk-memory, and its command.

The family is a grid of shapes, sorted by parameter count:

- llama: LLaMA-3-like blocks (RMSNorm, RoPE, SwiGLU with ffn = 3.5 h rounded to 256, head
  dimension 128, 8 key/value heads), widths 2048-8192, even depths 8-96, vocabulary 32,000;
- gpt: GPT-3 widths and head counts (Brown et al. 2020, 768-12288), even depths 12-96,
  vocabulary 50,257.

A run sizes its embedding and head by its tokenizer, so without --data-path every shape
takes the default corpus's vocabulary (--default-vocab-size, `layout.corpus_vocab`): the
model the printed command trains is the one planned, head bucket and disk share included.
With --data-path the family's vocabulary stands for the tokenizer's (not read here; a
smaller one only lowers the plan).

Every candidate is planned with the layout flags given (engine, offload, tp/pp/dp, ...). The
answer is the largest candidate that fits every budget, so every larger one, the next larger
included, does not. With `--optimizer-cpu-offload` and no `--optimizer-offload-fraction`, each
candidate takes the smallest fraction (steps of 0.01) whose GPU share fits: as much optimizer
state on the GPU as fits, the rest on the host (or the disk with --nvme-path). Flags not given
default to what a largest run wants: --seq-length 2048, --micro-batch-size 1, one micro-batch
per step, --recompute full, --bf16.
"""
from __future__ import annotations

import dataclasses

from ..config.model import ModelConfig
from ..models.params import count_parameters
from .layout import corpus_vocab, resolve
from .engines import split_host_budget
from .memory import GB, RUNTIME_BYTES, MemoryEstimate, _estimate

LLAMA_WIDTHS = (2048, 3072, 4096, 5120, 6144, 7168, 8192)
GPT_WIDTHS = ((768, 12), (1024, 16), (1536, 16), (2048, 16), (2560, 32), (4096, 32),
              (5120, 40), (6144, 48), (8192, 64), (12288, 96))
FRACTIONS = tuple(i / 20 for i in range(21))
# What --largest sets when the flag is not given: {config group: {field: value}}.
LARGEST_DEFAULTS = {"data": {"seq_length": 2048}, "training": {"micro_batch_size": 1, "bf16": True},
                    "model": {"recompute": "full"}}


def family_shapes(family: str, seq_length: int, vocab_size: int | None = None) -> list[ModelConfig]:
    """The family's candidate shapes, smallest first; `vocab_size`: the run's vocabulary
    instead of the family's."""
    shapes = []
    if family == "llama":
        for h in LLAMA_WIDTHS:
            ffn = -(-(7 * h // 2) // 256) * 256
            shapes += [ModelConfig(family="llama", num_layers=n, hidden_size=h,
                                   num_attention_heads=h // 128, num_key_value_heads=8,
                                   ffn_hidden_size=ffn, vocab_size=32000,
                                   max_position_embeddings=max(seq_length, 4096))
                       for n in range(8, 97, 2)]
    elif family == "gpt":
        for h, heads in GPT_WIDTHS:
            shapes += [ModelConfig(family="gpt", num_layers=n, hidden_size=h,
                                   num_attention_heads=heads, vocab_size=50257,
                                   max_position_embeddings=max(seq_length, 2048))
                       for n in range(12, 97, 2)]
    else:
        raise ValueError(f"--model-family must be llama or gpt, got {family!r}")
    if vocab_size is not None:
        shapes = [dataclasses.replace(c, vocab_size=vocab_size) for c in shapes]
    return sorted(shapes, key=lambda c: (count_parameters(c), c.hidden_size))


def plan_shape(args, config: ModelConfig, options, pick_fraction: bool):
    """(estimate, args) of `args` with the model `config` (recompute kept); with
    `pick_fraction`, the smallest offload fraction whose GPU share fits."""
    model = dataclasses.replace(config, recompute=args.model.recompute)
    args = dataclasses.replace(args, model=model, model_name=None)
    def planned(fraction: float):
        run = dataclasses.replace(args, training=dataclasses.replace(
            args.training, optimizer_offload_fraction=round(fraction, 2)))
        return _estimate(model, resolve(run, options)), run

    for fraction in FRACTIONS if pick_fraction else (args.training.optimizer_offload_fraction,):
        est, run = planned(fraction)
        if est.verdicts["gpu"]:
            break
    if pick_fraction and est.verdicts["gpu"] and fraction > 0:  # refine to steps of 0.01
        for finer in (fraction - k / 100 for k in range(4, 0, -1)):
            trial = planned(finer)
            if trial[0].verdicts["gpu"]:
                est, run = trial
                break
    return _pin_split(run, options, est)


def _pin_split(args, options, est):
    """(estimate, args): with the disk tier and a --host-memory, `args` take the host budget
    the plan splits by as --optimizer-offload-host-memory (rounded down to 0.1 GB) and are
    planned again, so the printed command splits as planned whatever the host has free
    when it starts; else as they are."""
    t = args.training
    if not (t.optimizer_cpu_offload and args.zero.nvme_path and options.host_memory) \
            or t.optimizer_offload_host_memory is not None:
        return est, args
    budget = split_host_budget(resolve(args, options), est.parameters_per_gpu)
    args = dataclasses.replace(args, training=dataclasses.replace(
        t, optimizer_offload_host_memory=max(0.0, int(budget / 1e8) / 10)))
    return _estimate(args.model, resolve(args, options)), args


def search(args, options, family: str, pick_fraction: bool, with_build: bool = True):
    """(best, next larger): each (config, estimate, args); best None if nothing fits every
    budget, the model's build included (with_build=False: training alone, `training_fits`)."""
    shapes = family_shapes(family, args.data.seq_length, corpus_vocab(args))
    planned = [(c, *plan_shape(args, c, options, pick_fraction)) for c in shapes]
    fitting = [i for i, (_, est, _) in enumerate(planned)
               if (est.fits if with_build else training_fits(est, options))]
    if not fitting:
        return None, planned[0]
    best = fitting[-1]
    return planned[best], planned[best + 1] if best + 1 < len(planned) else None


def describe(config: ModelConfig, est: MemoryEstimate, options) -> str:
    """One line: the shape, its parameters and its bytes against each budget."""
    shape = (f"{config.family} {est.num_parameters / 1e9:.2f}B (L{config.num_layers} "
             f"h{config.hidden_size} heads {config.num_attention_heads}"
             + (f"/{config.num_key_value_heads} ffn {config.ffn_hidden_size}"
                if config.family == "llama" else "") + ")")
    gpu = max(est.gpu_total, est.build_peak + RUNTIME_BYTES)
    parts = [f"GPU {gpu / GB:.1f}/{options.gpu_memory:g} GB"]
    if options.host_memory:
        parts.append(f"host {est.host_per_node / GB:.1f}/{options.host_memory:g} GB")
    if options.disk_memory:
        parts.append(f"disk {est.disk_per_node / GB:.1f}/{options.disk_memory:g} GB")
    failed = [k for k, ok in est.verdicts.items() if not ok]
    verdict = "fits" if not failed else "does not fit: " + ", ".join(failed)
    return f"{shape}: {', '.join(parts)} -> {verdict}"


def training_fits(est: MemoryEstimate, options) -> bool:
    """The verdict without the model's fp32 build on the GPU: what training alone allows."""
    others = all(ok for key, ok in est.verdicts.items() if key != "gpu")
    return others and est.gpu_total <= options.gpu_memory * GB
