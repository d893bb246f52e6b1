"""One GPU: a training step of megazoo's GPT / BLOOM / LLaMA against Hugging Face's, same run.

    python -m bench.model_bench --families gpt bloom llama --out model_bench.json

Shape: GPT-3 XL, h=2048, l=24, 16 heads, s=2048, B=4, V=50304;
LLaMA with SwiGLU 5504 (same parameter count). Pure bf16 weights, fused AdamW, one step =
forward + backward + optimizer. Each (family, implementation) runs in its own subprocess so
peak memory is its own; the matmul ceiling is measured once, in the parent.

`--impls megazoo-kernels` is megazoo with its GeLU routed through the fused bias+GeLU kernel
of `bench/experimental/kernels` instead of F.gelu, the end-to-end check of whether wiring it in wins.
(The norms made the same check on 2026-11-23 against F.layer_norm and the compiled RMSNorm,
won, and now run the Triton kernels on CUDA by default, `layers/norm.py`.)

    python -m bench.model_bench --families gpt llama --impls megazoo megazoo-kernels
"""
from __future__ import annotations

import argparse
import json
import subprocess

import torch

from bench.common import (REPO, RESULT, child_env, module_command, print_table, results, time_cuda,
                          write_json)
from megazoo.models.flops import flops_per_iteration
from megazoo.training.metrics import measure_peak_tflops

SHAPE = dict(hidden=2048, layers=24, heads=16, seq=2048, batch=4, vocab=50304, llama_ffn=5504)


def hf_model(family: str):
    from transformers import AutoModelForCausalLM, BloomConfig, GPT2Config, LlamaConfig

    s = SHAPE
    if family == "gpt":
        cfg, attn = GPT2Config(n_embd=s["hidden"], n_layer=s["layers"], n_head=s["heads"],
                               n_positions=s["seq"], vocab_size=s["vocab"]), "sdpa"
    elif family == "bloom":
        cfg, attn = BloomConfig(hidden_size=s["hidden"], n_layer=s["layers"], n_head=s["heads"],
                                vocab_size=s["vocab"]), "eager"  # SDPA unsupported for BLOOM
    else:
        cfg, attn = LlamaConfig(hidden_size=s["hidden"], intermediate_size=s["llama_ffn"],
                                num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                                num_key_value_heads=s["heads"], vocab_size=s["vocab"],
                                max_position_embeddings=s["seq"]), "sdpa"
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    model = model.to(torch.bfloat16)
    return lambda ids: model(input_ids=ids, labels=ids).loss, model


def megazoo_model(family: str):
    from megazoo.models import ModelConfig, build_model

    s = SHAPE
    extra = {"ffn_hidden_size": s["llama_ffn"]} if family == "llama" else {}
    cfg = ModelConfig(family=family, num_layers=s["layers"], hidden_size=s["hidden"],
                      num_attention_heads=s["heads"], vocab_size=s["vocab"],
                      max_position_embeddings=s["seq"], **extra)
    model = build_model(cfg, state=None, device="cuda", dtype=torch.bfloat16, seed=0)
    model.check_inputs = False  # random ids in range: no host sync per step, as in training
    return lambda ids: model(ids, labels=ids), model


def use_fused_kernels() -> None:
    """Route megazoo's GeLU through the experimental bias_gelu kernel (this process only)."""
    from experimental import kernels
    from megazoo.layers import mlp

    zero_bias = {}

    def gelu(x, approximate="none"):
        key = (x.shape[-1], x.dtype, x.device)
        bias = zero_bias.setdefault(key, torch.zeros(x.shape[-1], dtype=x.dtype, device=x.device))
        return kernels.bias_gelu(x, bias, approximate=approximate)
    mlp.F = type("F", (), {"gelu": staticmethod(gelu)})


def run_one(family: str, impl: str) -> dict:
    torch.manual_seed(0)
    if impl == "megazoo-kernels":
        use_fused_kernels()
    loss_fn, model = (hf_model if impl == "hf" else megazoo_model)(family)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, SHAPE["vocab"], (SHAPE["batch"], SHAPE["seq"]), device="cuda")

    def step():
        loss = loss_fn(ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    torch.cuda.reset_peak_memory_stats()
    seconds = time_cuda(step, warmup=3, iters=10)
    tokens = SHAPE["batch"] * SHAPE["seq"]
    flops = flops_per_iteration(SHAPE["batch"], SHAPE["seq"], SHAPE["layers"], SHAPE["hidden"], SHAPE["vocab"])
    return dict(family=family, impl=impl, step_s=seconds, tokens_per_s=tokens / seconds,
                model_tflops=flops / seconds / 1e12,
                peak_gb=torch.cuda.max_memory_allocated() / 1e9,
                params=sum(p.numel() for p in model.parameters()))


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="+", default=["gpt", "bloom", "llama"])
    p.add_argument("--impls", nargs="+", default=["hf", "megazoo"])
    p.add_argument("--out", default=None)
    p.add_argument("--run", nargs=2, metavar=("FAMILY", "IMPL"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.run:
        print(RESULT + json.dumps(run_one(*args.run)))
        return
    ceiling = measure_peak_tflops(torch.device("cuda"))
    rows = []
    for family in args.families:
        for impl in args.impls:
            proc = subprocess.run(module_command("model_bench") + ["--run", family, impl],
                                  capture_output=True, text=True, cwd=REPO, env=child_env())
            found = results(proc.stdout)
            if proc.returncode != 0 or not found:
                print(f"{family}/{impl} failed:\n{proc.stderr[-3000:]}")
                continue
            row = found[-1]
            row["mfu"] = row["model_tflops"] / ceiling
            rows.append(row)
        peer = [r for r in rows if r["family"] == family and r["impl"] == "hf"]
        for ours in [r for r in rows if r["family"] == family and r["impl"] != "hf"]:
            if peer:
                ours["speedup_vs_hf"] = ours["tokens_per_s"] / peer[0]["tokens_per_s"]
    print(f"bf16 matmul ceiling: {ceiling:.0f} TFLOP/s")
    print_table(rows, ["family", "impl", "step_s", "tokens_per_s", "model_tflops", "mfu",
                       "peak_gb", "speedup_vs_hf"])
    write_json(args.out, dict(ceiling_tflops=ceiling, rows=rows))


if __name__ == "__main__":
    main()
