"""One GPU: the training path users run (`pretrain_gpt.py`) against megazoo's own model step
and against the peer a user would pick (DeepSpeed ZeRO-1, bf16, Hugging Face model), same run.

    python -m bench.train_bench --shapes gpt-1.3b llama-8b-4l --global-batch 8 32 --out train.json
    python -m bench.train_bench --dry-run            # tiny shapes on CPU: checks the plumbing

Rows, each in its own subprocess (its own peak memory):

- `model`: megazoo's model step as `bench/model_bench.py` times it: pure bf16 weights, one
  micro-batch forward + backward, torch's fused AdamW; tokens/s of one micro-batch per step.
- `pretrain`: `pretrain_gpt.py` with its defaults for the engine (the default stdlib corpus),
  `--bf16`, the shape's flags and the global batch; tokens/s as the run logs it, the median of
  the log intervals after the first (compilation, allocator warm-up).
- `deepspeed`: DeepSpeed ZeRO-1 with bf16 around the Hugging Face model of the same shape
  (GPT2LMHeadModel / LlamaForCausalLM, SDPA), micro-batches accumulated to the global batch,
  torch's fused AdamW, gradient clipping 1.0 (the engine's default clip in pretrain_gpt.py).
  Its child also runs data parallel under torchrun (`torchrun --nproc-per-node 2 -m
  bench.train_bench --child deepspeed gpt-1.3b 16`): the world size comes from the launcher,
  each rank accumulates global batch / (micro-batch x ranks), tokens/s counts all ranks.
  The HF GPT2 config keeps its default dropout (0.1 on embeddings, residuals and attention
  probabilities), as a user picking this peer gets it; megazoo's models have none.
- `pretrain-nofusion` (ask for it with `--rows`): `pretrain` with
  `--no-gradient-accumulation-fusion` (each micro-batch's weight gradient added into the
  fp32 main gradient by a separate pass).
- `deepspeed-nodrop` (ask for it with `--rows`): the same with GPT2's dropouts at 0, the
  computation megazoo's rows do.

All three use the vocabulary of the default corpus' tokenizer (2048 ids), so the logits cost
the same everywhere. Model TFLOP/s count F = 72 B s l h^2 (1 + s / 6h) + 6 B s h V
(`megazoo.models.flops.flops_per_iteration`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch

from bench.common import (REPO, RESULT, child_env, environment, module_command, results, time_ms,
                          write_json)

VOCAB = 2048  # the default corpus' tokenizer (pretrain_gpt.py --default-vocab-size)

SHAPES = {
    "gpt-1.3b": dict(family="gpt", layers=24, hidden=2048, heads=16, kv_heads=16, ffn=8192,
                     seq=2048, micro=4),
    "llama-8b-4l": dict(family="llama", layers=4, hidden=4096, heads=32, kv_heads=8, ffn=14336,
                        seq=4096, micro=1),
    "tiny": dict(family="gpt", layers=2, hidden=64, heads=4, kv_heads=4, ffn=256, seq=64, micro=2),
}

# pretrain_gpt.py rows: the default engine, and without gradient-accumulation fusion
PRETRAIN_ROWS = {"pretrain": [], "pretrain-nofusion": ["--no-gradient-accumulation-fusion"]}


def model_flags(shape: dict) -> list[str]:
    """pretrain_gpt.py flags of a shape."""
    flags = ["--family", shape["family"], "--num-layers", str(shape["layers"]),
             "--hidden-size", str(shape["hidden"]), "--num-attention-heads", str(shape["heads"]),
             "--ffn-hidden-size", str(shape["ffn"]), "--seq-length", str(shape["seq"]),
             "--max-position-embeddings", str(shape["seq"])]
    if shape["family"] == "llama":
        flags += ["--num-key-value-heads", str(shape["kv_heads"])]
    return flags


def flops(shape: dict, batch: int) -> float:
    from megazoo.models.flops import flops_per_iteration
    return flops_per_iteration(batch, shape["seq"], shape["layers"], shape["hidden"], VOCAB)


def timed(step, device: torch.device, warmup: int, iters: int) -> float:
    """Median seconds of `step()` after `warmup` calls (bench.common.time_ms)."""
    return time_ms(step, device, warmup, iters) / 1e3


def model_row(shape: dict, device: torch.device, warmup: int, iters: int) -> dict:
    from megazoo.models import ModelConfig, build_model

    cfg = ModelConfig(family=shape["family"], num_layers=shape["layers"],
                      hidden_size=shape["hidden"], num_attention_heads=shape["heads"],
                      num_key_value_heads=shape["kv_heads"] if shape["family"] == "llama" else None,
                      ffn_hidden_size=shape["ffn"], vocab_size=VOCAB,
                      max_position_embeddings=shape["seq"])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(cfg, state=None, device=device, dtype=dtype, seed=0)
    model.check_inputs = False  # as pretrain_gpt.py runs it: ids in range, no host sync
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    ids = torch.randint(0, VOCAB, (shape["micro"], shape["seq"]), device=device)

    def step():
        model(ids, labels=ids).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    seconds = timed(step, device, warmup, iters)
    return {"step_s": seconds, "tokens_per_s": shape["micro"] * shape["seq"] / seconds,
            "model_tflops": flops(shape, shape["micro"]) / seconds / 1e12}


def hf_model(shape: dict, device: torch.device, dropout: bool = True):
    """The HF model of a shape; dropout=False zeroes GPT2Config's three dropouts (its default
    0.1), which megazoo's models do not have (LLaMA's default has none either)."""
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    if shape["family"] == "gpt":
        off = {} if dropout else dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        cfg = GPT2Config(n_embd=shape["hidden"], n_layer=shape["layers"], n_head=shape["heads"],
                         n_inner=shape["ffn"], n_positions=shape["seq"], vocab_size=VOCAB, **off)
    else:
        cfg = LlamaConfig(hidden_size=shape["hidden"], intermediate_size=shape["ffn"],
                          num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                          num_key_value_heads=shape["kv_heads"], vocab_size=VOCAB,
                          max_position_embeddings=shape["seq"])
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    return model.to(torch.bfloat16) if device.type == "cuda" else model


def deepspeed_row(shape: dict, device: torch.device, global_batch: int, warmup: int,
                  iters: int, dropout: bool = True) -> dict:
    import deepspeed

    if "RANK" not in os.environ:  # no launcher: one rank of our own
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT="29517")
    world = int(os.environ["WORLD_SIZE"])
    if global_batch % (shape["micro"] * world):
        raise ValueError(f"global batch {global_batch} must divide by micro-batch "
                         f"{shape['micro']} x {world} ranks")
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    model = hf_model(shape, device, dropout)
    accumulation = global_batch // (shape["micro"] * world)
    config = {"train_micro_batch_size_per_gpu": shape["micro"],
              "gradient_accumulation_steps": accumulation, "gradient_clipping": 1.0,
              "bf16": {"enabled": device.type == "cuda"}, "zero_optimization": {"stage": 1}}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    ids = torch.randint(0, VOCAB, (shape["micro"], shape["seq"]), device=device)

    def step():
        for _ in range(accumulation):
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()

    seconds = timed(step, device, warmup, iters)
    return {"step_s": seconds, "tokens_per_s": global_batch * shape["seq"] / seconds,
            "model_tflops": flops(shape, global_batch) / seconds / 1e12}


def pretrain_row(shape: dict, global_batch: int, iters: int, extra: list[str], dry: bool) -> dict:
    """Run pretrain_gpt.py and read its logged tokens/s (median of the intervals after the first)."""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.jsonl")
        interval = max(1, iters // 6)
        cmd = [sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *model_flags(shape),
               "--micro-batch-size", str(shape["micro"]), "--global-batch-size", str(global_batch),
               "--train-iters", str(iters), "--log-interval", str(interval), "--save", "",
               "--eval-iters", "0", "--generate-tokens", "0", "--no-progress",
               "--data-cache-path", os.path.join(REPO, "data_cache"), "--log-json", log,
               *([] if dry else ["--bf16"]), *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, env=child_env())
        if proc.returncode != 0:
            raise RuntimeError(f"pretrain_gpt.py failed: {proc.stderr[-2000:]}")
        with open(log) as f:
            records = [json.loads(line) for line in f if '"tokens_per_s"' in line]
    rates = [r["tokens_per_s"] for r in records[1:]] or [records[-1]["tokens_per_s"]]
    tokens_per_s = statistics.median(rates)
    seconds = global_batch * shape["seq"] / tokens_per_s
    out = {"step_s": seconds, "tokens_per_s": tokens_per_s,
           "model_tflops": flops(shape, global_batch) / seconds / 1e12}
    if "gpu_max_allocated_gb" in records[-1]:
        out["peak_gb"] = records[-1]["gpu_max_allocated_gb"]
    return out


def child(kind: str, shape_name: str, global_batch: int, dry: bool) -> dict:
    device = torch.device("cpu") if dry else torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    shape = SHAPES[shape_name]
    warmup, iters = (1, 2) if dry else (3, 8)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats()
    if kind == "model":
        row = model_row(shape, device, warmup, iters)
    else:
        row = deepspeed_row(shape, device, global_batch, warmup, iters,
                            dropout=kind != "deepspeed-nodrop")
    if device.type == "cuda":
        row["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
    return row


def run_child(kind: str, shape: str, global_batch: int, dry: bool) -> dict:
    cmd = module_command("train_bench") + ["--child", kind, shape, str(global_batch)]
    proc = subprocess.run(cmd + (["--dry-run"] if dry else []), capture_output=True, text=True,
                          cwd=REPO, env=child_env())
    found = results(proc.stdout)
    if proc.returncode != 0 or not found:
        raise RuntimeError(proc.stderr[-2000:])
    return found[-1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["gpt-1.3b"], choices=sorted(SHAPES))
    p.add_argument("--global-batch", nargs="+", type=int, default=[8, 32])
    p.add_argument("--rows", nargs="+", default=["model", "pretrain", "deepspeed"])
    p.add_argument("--pretrain-iters", type=int, default=30)
    p.add_argument("--pretrain-flags", default="", help="extra pretrain_gpt.py flags (one string)")
    p.add_argument("--dry-run", action="store_true", help="tiny shape on CPU")
    p.add_argument("--out", default=None)
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        kind, shape, gb = args.child
        row = child(kind, shape, int(gb), args.dry_run)
        if os.environ.get("RANK", "0") == "0":  # under torchrun: rank 0 reports for all
            print(RESULT + json.dumps({**row, "world": int(os.environ.get("WORLD_SIZE", "1"))}))
        return 0
    shapes = ["tiny"] if args.dry_run else args.shapes
    rows = []
    for shape in shapes:
        model_step = {}
        for gb in args.global_batch:
            found = {}
            for kind in args.rows:
                try:
                    if kind in PRETRAIN_ROWS:
                        row = pretrain_row(SHAPES[shape], gb, 4 if args.dry_run else args.pretrain_iters,
                                           args.pretrain_flags.split() + PRETRAIN_ROWS[kind],
                                           args.dry_run)
                    elif kind == "model" and model_step:
                        row = dict(model_step)  # one micro-batch per step: the same at any gb
                    else:
                        row = run_child(kind, shape, gb, args.dry_run)
                    if kind == "model" and "error" not in row:
                        model_step = row
                except Exception as exc:  # keep the sweep going; the table shows the failure
                    row = {"error": " ".join(str(exc).split())[-300:]}
                found[kind] = row
                rows.append({"shape": shape, "global_batch": gb, "row": kind, **row})
            for r in rows[-len(args.rows):]:
                for ref in ("model", "deepspeed", "deepspeed-nodrop"):
                    if "tokens_per_s" in r and "tokens_per_s" in found.get(ref, {}):
                        r[f"vs_{ref}"] = r["tokens_per_s"] / found[ref]["tokens_per_s"]
    cols = ["shape", "global_batch", "row", "tokens_per_s", "model_tflops", "peak_gb",
            "vs_model", "vs_deepspeed", "vs_deepspeed-nodrop", "error"]
    print("| " + " | ".join(cols) + " |")
    for r in rows:
        print("| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    write_json(args.out, {"env": environment(device), "rows": rows})
    return 0


def _fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:,.0f}" if value >= 100 else f"{value:.3f}"
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
