"""megatron-core's GPTModel (its local, non-TransformerEngine spec) trained at megazoo's rows'
shapes and flags: the peer of `bench/multi_gpu_sweep.py`.

    torchrun --nproc-per-node 2 -m bench.mcore_peer --shape gpt-1.3b --tp 2 --sp \
        --global-batch 64 --out row.json
    torchrun --nproc-per-node 2 -m bench.mcore_peer --dry-run --tp 2 --sp      # CPU: build

Needs megatron-core 0.19.2 (`bash tools/gpu_stage.sh` stages it; its only import beyond
torch and numpy is `packaging`). Random tokens, bf16 parameters, megatron-core's
DistributedDataParallel (fp32 gradient buffers) and distributed optimizer with overlapped
gradient reduction and parameter gather, as megazoo's rows run; the interleaved schedule
when --vpp > 1. Prints one `RESULT {json}` line (rank 0) with the median tokens/s of the
iterations after --warmup, and writes it to --out.

On CPU (--dry-run) megatron-core builds its model (gloo, tiny shape) but runs nothing: its
attention, DDP and schedules allocate on "cuda"; the dry run checks the build, the layout and
the norms' tags, and prints what it built.

The local spec's norm (`WrappedTorchNorm`) refuses sequence parallelism without apex; here
the norm is torch's LayerNorm / RMSNorm whose weights carry `sequence_parallel = True`, as
megatron-core's apex `FusedLayerNorm` tags them, so their gradients are summed over tp.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from bench.train_bench import SHAPES

SHAPES = {**SHAPES,  # the LLaMA-8B-like rows, and its tiny stand-in for dry runs
          "llama-8b-8l": dict(family="llama", layers=8, hidden=4096, heads=32, kv_heads=8,
                              ffn=14336, seq=4096, micro=1),
          "tiny-llama": dict(family="llama", layers=4, hidden=64, heads=4, kv_heads=2, ffn=128,
                             seq=64, micro=1)}
VOCAB = 2048  # megazoo's rows train on the default corpus's 2,048-token vocabulary


class SequenceParallelNorm:
    """Builds torch's LayerNorm (or RMSNorm) with the signature of megatron-core's norm
    classes, its parameters tagged `sequence_parallel` when the config is."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        norm = (torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm)(
            hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


def transformer_config(shape: dict, cfg):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    llama = shape["family"] == "llama"
    dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    return TransformerConfig(
        num_layers=shape["layers"], hidden_size=shape["hidden"],
        num_attention_heads=shape["heads"], num_query_groups=shape["kv_heads"],
        ffn_hidden_size=shape["ffn"], hidden_dropout=0.0, attention_dropout=0.0,
        normalization="RMSNorm" if llama else "LayerNorm", gated_linear_unit=llama,
        activation_func=F.silu if llama else F.gelu, add_bias_linear=not llama,
        bf16=cfg.bf16, params_dtype=dtype, pipeline_dtype=dtype,
        tensor_model_parallel_size=cfg.tp, pipeline_model_parallel_size=cfg.pp,
        virtual_pipeline_model_parallel_size=cfg.vpp if cfg.vpp > 1 else None,
        sequence_parallel=cfg.sp and cfg.tp > 1, use_cpu_initialization=not cfg.cuda,
        gradient_accumulation_fusion=False, bias_activation_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, cross_entropy_loss_fusion=False,
        deallocate_pipeline_outputs=True, overlap_p2p_comm=cfg.vpp > 1,
        batch_p2p_comm=cfg.vpp == 1)


def layer_stack(config, vp_stage):
    """The local spec's layers, with `SequenceParallelNorm` for every norm."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import (TransformerBlockSubmodules,
                                                             get_num_layers_to_build)

    layer = get_gpt_layer_local_spec(normalization=config.normalization)
    layer.submodules.input_layernorm = SequenceParallelNorm
    layer.submodules.pre_mlp_layernorm = SequenceParallelNorm
    n = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer] * n, layer_norm=SequenceParallelNorm)


def build_chunks(shape: dict, cfg, config) -> list:
    """This rank's model chunks (one per virtual stage), each in megatron-core's DDP."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel

    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True,
                                        use_distributed_optimizer=True,
                                        overlap_param_gather=cfg.cuda, align_param_gather=cfg.vpp > 1)
    chunks = []
    for v in range(cfg.vpp):
        stage = v if cfg.vpp > 1 else None
        model = GPTModel(
            config=config, transformer_layer_spec=layer_stack(config, stage), vocab_size=VOCAB,
            max_sequence_length=shape["seq"],
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            position_embedding_type="rope" if shape["family"] == "llama" else "learned_absolute",
            share_embeddings_and_output_weights=shape["family"] != "llama", vp_stage=stage)
        if cfg.cuda:
            model.cuda(torch.cuda.current_device())
        if cfg.bf16:
            model.bfloat16()
        # megatron-core's DDP and optimizers need CUDA: the dry run steps the bare chunks
        chunks.append(DistributedDataParallel(config=config, ddp_config=ddp, module=model)
                      if cfg.cuda else model)
    return chunks


def wire_overlap(config, chunks, cfg) -> None:
    """What Megatron-LM's training loop sets for overlapped reduction and gather (GPUs)."""
    from megatron.core.distributed import finalize_model_grads

    if not cfg.cuda:
        return

    config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
    if cfg.pp > 1:
        config.grad_sync_func = [c.start_grad_sync for c in chunks]
        if cfg.vpp > 1 and cfg.cuda:
            config.param_sync_func = [c.start_param_sync for c in chunks]
    config.finalize_model_grads_func = finalize_model_grads


def batches(shape: dict, cfg, device):
    """Endless random micro-batches (the same on every tp rank of a replica)."""
    from megatron.core import parallel_state as ps

    g = torch.Generator().manual_seed(1234 + ps.get_data_parallel_rank())
    s, b = shape["seq"], shape["micro"]
    positions = torch.arange(s, device=device).unsqueeze(0).expand(b, s)
    while True:
        ids = torch.randint(0, VOCAB, (b, s + 1), generator=g).to(device)
        yield ids[:, :-1], ids[:, 1:].contiguous(), positions


def forward_step(data, model):
    tokens, labels, positions = next(data)
    losses = model(tokens, positions, None, labels=labels)

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"lm loss": loss.detach()}
    return losses, loss_func


def train(cfg) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    shape = SHAPES[cfg.shape]
    ps.initialize_model_parallel(tensor_model_parallel_size=cfg.tp,
                                 pipeline_model_parallel_size=cfg.pp,
                                 virtual_pipeline_model_parallel_size=cfg.vpp if cfg.vpp > 1 else None)
    if cfg.cuda:
        model_parallel_cuda_manual_seed(1234)
    config = transformer_config(shape, cfg)
    chunks = build_chunks(shape, cfg, config)
    if not cfg.cuda:  # its attention, DDP and schedules allocate on "cuda": the build only
        return built(cfg, config, chunks)
    wire_overlap(config, chunks, cfg)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-4, weight_decay=0.1, bf16=cfg.bf16,
                        params_dtype=config.params_dtype, use_distributed_optimizer=True,
                        overlap_param_gather=True, clip_grad=1.0), chunks)
    dp = ps.get_data_parallel_world_size()
    m = cfg.global_batch // (shape["micro"] * dp)
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.cuda else torch.device("cpu")
    data = [batches(shape, cfg, device) for _ in chunks]
    step = get_forward_backward_func()
    times = []
    for it in range(cfg.warmup + cfg.iters):
        start = time.perf_counter()
        for c in chunks:
            if cfg.cuda:
                c.zero_grad_buffer()
        optimizer.zero_grad()
        step(forward_step_func=forward_step, data_iterator=data if len(chunks) > 1 else data[0],
             model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=m,
             seq_length=shape["seq"], micro_batch_size=shape["micro"], forward_only=False)
        optimizer.step()
        if cfg.cuda:
            torch.cuda.synchronize()
        if it >= cfg.warmup:
            times.append(time.perf_counter() - start)
    tokens = cfg.global_batch * shape["seq"]
    row = {"peer": "megatron-core 0.19.2 local spec", "shape": cfg.shape, "tp": cfg.tp,
           "pp": cfg.pp, "vpp": cfg.vpp, "dp": dp, "sequence_parallel": config.sequence_parallel,
           "global_batch": cfg.global_batch, "micro_batches": m,
           "step_s": statistics.median(times), "tokens_per_s": tokens / statistics.median(times)}
    if cfg.cuda:
        row["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
    return row


def built(cfg, config, chunks) -> dict:
    """The dry run's row: what was built (megatron-core runs nothing on CPU), and that every
    norm parameter carries the sequence-parallel tag (ValueError otherwise)."""
    norms = [p for c in chunks for m in c.modules()
             if isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm)) for p in m.parameters()]
    untagged = [p for p in norms if getattr(p, "sequence_parallel", None) != config.sequence_parallel]
    if not norms or untagged:
        raise ValueError(f"{len(untagged)} of {len(norms)} norm parameters lack the tag")
    return {"peer": "megatron-core local spec (built only: no CUDA)", "shape": cfg.shape,
            "tp": cfg.tp, "sequence_parallel": config.sequence_parallel,
            "parameters": sum(p.numel() for c in chunks for p in c.parameters()),
            "tagged_norm_parameters": len(norms)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="gpt-1.3b", choices=sorted(SHAPES))
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vpp", type=int, default=1, help="virtual stages per pipeline rank")
    p.add_argument("--sp", action="store_true", help="Megatron sequence parallelism (tp > 1)")
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--dry-run", action="store_true", help="CPU, gloo, fp32, tiny shape")
    p.add_argument("--out", default=None)
    cfg = p.parse_args(argv)
    cfg.cuda = torch.cuda.is_available() and not cfg.dry_run
    cfg.bf16 = not cfg.dry_run
    if cfg.dry_run:
        cfg.shape = "tiny-llama" if SHAPES[cfg.shape]["family"] == "llama" else "tiny"
        cfg.warmup, cfg.iters, cfg.global_batch = 1, 2, 8
    return cfg


def main(argv=None) -> int:
    cfg = parse_args(argv)
    if cfg.cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cfg.cuda else "gloo")
    try:
        row = train(cfg)
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps(row), flush=True)
            if cfg.out:
                with open(cfg.out, "w") as f:
                    json.dump(row, f, indent=1)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
