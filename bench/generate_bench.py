"""Decode throughput with a KV cache: megazoo's generation against transformers' `generate`
(GPT2 with its own cache), on one GPU, in the same run.

    python -m bench.generate_bench --out generate.json     # GPU: gpt-1.3b shape, bf16
    python -m bench.generate_bench --dry-run               # CPU, tiny, exercises the code

Both models: random weights of the gpt-1.3b shape (24 layers, hidden 2048, 16 heads,
vocabulary 50257), bf16, the same random 128-token prompt per row, 128 new tokens, greedy,
no early stop. transformers runs `GPT2LMHeadModel` (attn_implementation="sdpa") through
`generate(do_sample=False)` with its default cache; megazoo runs `generate_ids` with CUDA
graphs (its default on CUDA) and, for reference, eagerly.

Decode tokens/s = b (N - 1) / (t(N) - t(1)), where t(n) is the median time of a whole
generate call producing n tokens: prefill and the first token cancel out; megazoo's CUDA
graph capture happens inside every call that decodes, so it is counted. Targets: 3x
transformers at batch 1, 1.5x at batch 16.
"""
from __future__ import annotations

import argparse
import dataclasses

import torch

from bench.common import environment, print_table, time_ms, write_json
from megazoo.checkpoint.load import materialize
from megazoo.generation.loop import generate_ids
from megazoo.generation.sampling import Sampling
from megazoo.models import PRESETS, build_model

TARGETS = {1: 3.0, 16: 1.5}


def parse_args(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument("--dry-run", action="store_true", help="tiny float32 run on CPU")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    args.device, args.dtype = torch.device("cuda"), torch.bfloat16
    args.config = PRESETS["gpt-1.3b"]
    if args.dry_run:
        args.device, args.dtype = torch.device("cpu"), torch.float32
        args.config = dataclasses.replace(args.config, num_layers=2, hidden_size=64,
                                          num_attention_heads=4, num_key_value_heads=4,
                                          ffn_hidden_size=256, vocab_size=300,
                                          max_position_embeddings=64)
        args.batches, args.prompt_len, args.new_tokens = [1, 2], 8, 4
        args.warmup, args.iters = 0, 1
    return args


def megazoo_model(args):
    """The config's model with random weights (matrices N(0, 0.02), norms 1, biases 0)."""
    model = materialize(build_model(args.config, None, device="meta", dtype=args.dtype),
                        args.device)
    g = torch.Generator(device=args.device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02, generator=g)
            else:
                p.fill_(1.0 if "norm" in name else 0.0)
    return model.eval()


def hf_model(args):
    """transformers' GPT2 of the same shape (random init), SDPA attention, or None."""
    try:
        import transformers
    except ImportError:
        return None
    c = args.config
    config = transformers.GPT2Config(n_embd=c.hidden_size, n_layer=c.num_layers,
                                     n_head=c.num_attention_heads, vocab_size=c.vocab_size,
                                     n_positions=c.max_position_embeddings, bos_token_id=0,
                                     eos_token_id=0,
                                     attn_implementation="sdpa")
    with torch.device(args.device):
        model = transformers.GPT2LMHeadModel(config)
    model = model.to(args.dtype).eval()
    model.generation_config.eos_token_id = None  # always generate every requested token
    model.generation_config.pad_token_id = 0
    if model.config._attn_implementation != "sdpa":
        raise RuntimeError(f"transformers chose {model.config._attn_implementation} attention")
    return model


def decode_rate(run, batch: int, args) -> dict:
    """Decode tokens/s of `run(n)` (a generate call making n tokens), see the docstring."""
    full = time_ms(lambda: run(args.new_tokens), args.device, args.warmup, args.iters)
    first = time_ms(lambda: run(1), args.device, args.warmup, args.iters)
    rate = batch * (args.new_tokens - 1) / max((full - first) / 1e3, 1e-9)
    return {"tokens_per_s": rate, "call_ms": full, "prefill_ms": first}


def measure(batch: int, mz, hf, args) -> list[dict]:
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, args.config.vocab_size, (batch, args.prompt_len), generator=g)
    prompts, greedy = ids.tolist(), Sampling(greedy=True)
    runs = {"megazoo": lambda n: generate_ids(mz, prompts, n, greedy),
            "megazoo-eager": lambda n: generate_ids(mz, prompts, n, greedy, cuda_graphs=False)}
    if hf is not None:
        ids_dev, mask = ids.to(args.device), torch.ones_like(ids, device=args.device)

        def hf_run(n):
            with torch.no_grad():
                return hf.generate(ids_dev, attention_mask=mask, max_new_tokens=n,
                                   do_sample=False).tolist()
        runs["transformers"] = hf_run
    rows = [{"impl": name, "batch": batch, **decode_rate(run, batch, args)}
            for name, run in runs.items()]
    if hf is not None:
        base = rows[-1]["tokens_per_s"]
        for row in rows:
            row["vs_transformers"] = row["tokens_per_s"] / base
    return rows


def main(argv=None) -> dict:
    args = parse_args(argv)
    mz = megazoo_model(args)
    hf = None if args.no_hf else hf_model(args)
    rows = [row for batch in args.batches for row in measure(batch, mz, hf, args)]
    print_table(rows, ["impl", "batch", "tokens_per_s", "vs_transformers", "call_ms",
                       "prefill_ms"])
    ratios = {str(r["batch"]): r["vs_transformers"] for r in rows
              if r["impl"] == "megazoo" and "vs_transformers" in r}
    for batch, ratio in ratios.items():
        target = TARGETS.get(int(batch))
        if target:
            print(f"batch {batch}: megazoo decodes at {ratio:.2f}x transformers "
                  f"(target {target}x: {'met' if ratio >= target else 'NOT met'})")
    payload = {"env": environment(args.device), "model": args.config.to_dict(),
               "dtype": str(args.dtype), "prompt_len": args.prompt_len,
               "new_tokens": args.new_tokens, "rows": rows, "megazoo_vs_transformers": ratios}
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
