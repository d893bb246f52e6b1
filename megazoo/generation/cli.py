"""`python generate.py` / `megazoo-generate`: text from a megazoo checkpoint, at any tp x pp
layout (under torchrun; extra ranks are data-parallel copies), with the checkpoint's own
tokenizer and a KV cache.

    python generate.py --load checkpoints --prompt "def main(" --max-new-tokens 60 --greedy
    torchrun --nproc-per-node 4 generate.py --load mz --tp 2 --pp 2 --prompt-file prompts.txt

Rank 0 prints each prompt with its continuation (separated by a line of dashes) on stdout,
and the timing on stderr. Bad input is one line on stderr and exit status 2, before any
process group is set up or any weight is read.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch.distributed as dist

from ..checkpoint import config_from_dict, parse_dtype
from ..cli_parser import HintingParser
from ..errors import read_json, read_text, report_error
from ..parallel.device import local_device
from ..parallel.state import runs_nccl
from .api import decode_text, encode_prompt, find_tokenizer, resolve_checkpoint
from .loop import check_request, generate_ids
from .sampling import Sampling

SEPARATOR = "-" * 40
DEFAULT_NEW_TOKENS = 64


def build_parser() -> HintingParser:
    p = HintingParser(prog="generate.py", description="Generate text from a megazoo checkpoint "
                      "(any family, including converted Hugging Face models) with a KV cache.")
    p.add_argument("--load", required=True, help="an iter_* checkpoint folder, or a --save "
                   "folder (its `latest` checkpoint)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt; repeat the flag "
                   "for a batch of prompts")
    p.add_argument("--prompt-file", help="a text file with one prompt per line (added after "
                   "the --prompt ones)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="tokens to generate per "
                   f"prompt (default: {DEFAULT_NEW_TOKENS}, or fewer to fit the model's positions)")
    p.add_argument("--temperature", type=float, default=1.0, help="divide the logits by it "
                   "before sampling (default: 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens "
                   "(default: 0, no limit)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample among the most likely "
                   "tokens holding probability p (default: 1.0, all)")
    p.add_argument("--greedy", action="store_true", help="always take the most likely token")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (default: 0)")
    p.add_argument("--tokenizer", help="a tokenizer.json (or its folder), a SentencePiece "
                   ".model, or 'bytes' (default: the checkpoint's own)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop a prompt at the "
                   "end-of-document token")
    p.add_argument("--tp", "--tensor-model-parallel-size", type=int, default=1,
                   help="tensor-parallel size (default: 1)")
    p.add_argument("--pp", "--pipeline-model-parallel-size", type=int, default=1,
                   help="pipeline-parallel size (default: 1)")
    p.add_argument("--dtype", help="float32, bfloat16 or float16 (default: the checkpoint's)")
    p.add_argument("--bf16", dest="dtype", action="store_const", const="bfloat16",
                   help="same as --dtype bfloat16")
    p.add_argument("--fp16", dest="dtype", action="store_const", const="float16",
                   help="same as --dtype float16")
    p.add_argument("--no-verify-checksums", dest="verify_checksums", action="store_false",
                   help="read the checkpoint without checking each tensor against the "
                   "checksum megazoo.json recorded for it")
    p.add_argument("--allow-nonfinite-load", action="store_true", help="load a checkpoint "
                   "holding inf / nan values (refused by default)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction,
                   default=None, help="capture the decode step as a CUDA graph (default: on "
                   "CUDA at tp = pp = 1, with an eager fallback)")
    return p


def read_prompts(args) -> list[str]:
    """The prompts of --prompt and --prompt-file, each checked to be non-empty UTF-8 text
    (the shell passes bytes that are not UTF-8 as lone surrogates)."""
    prompts = [(f"--prompt {n + 1}", text) for n, text in enumerate(args.prompt)]
    if args.prompt_file:
        lines = _prompt_file_text(args.prompt_file).splitlines()
        prompts += [(f"--prompt-file {args.prompt_file} line {n + 1}", line)
                    for n, line in enumerate(lines) if line.strip()]
    if not prompts:
        raise ValueError("no prompt given: pass --prompt TEXT (repeatable) or --prompt-file FILE")
    for where, text in prompts:
        if not text:
            raise ValueError(f"{where} is empty: give it some text")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{where} is not valid UTF-8 text: pass the prompt as UTF-8 (e.g. "
                             f"convert it with iconv)") from None
    return [text for _, text in prompts]


def _prompt_file_text(path: str) -> str:
    """The text of --prompt-file: `-` is stdin; a pipe or device (/dev/null, a process
    substitution) reads like a file; a UTF-8 byte-order mark is dropped."""
    if path == "-":
        raw = sys.stdin.buffer.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"--prompt-file - (stdin) is not UTF-8 text (byte "
                             f"0x{raw[exc.start]:02x} at offset {exc.start})") from None
    elif not os.path.exists(path):
        raise ValueError(f"--prompt-file {path}: no such file")
    elif os.path.isdir(path):
        raise ValueError(f"--prompt-file {path} is a folder: give a text file, one prompt a line")
    else:
        text = read_text(path, "--prompt-file ")
    return text.removeprefix("\ufeff")


def _weights_dtype(args, meta: dict, checkpoint: str):
    """The --dtype to load in (None: as stored), refusing a checkpoint that is not a
    floating-point model or that is in DeepSpeed's format."""
    if str(meta.get("format", "")).startswith("megazoo-deepspeed"):
        raise ValueError(f"{checkpoint} is a DeepSpeed-format checkpoint: consolidate it first "
                         f"with zero_to_megazoo.py --load {checkpoint} --out DIR (or "
                         f"megazoo-zero-to-megazoo), then --load DIR")
    stored = str(meta.get("dtype", "float32"))
    try:
        parse_dtype(stored)
    except ValueError:
        raise ValueError(f"{checkpoint} holds {stored} weights, not a floating-point model: "
                         f"convert it again from its source with --dtype float32, float16 or "
                         f"bfloat16") from None
    return parse_dtype(args.dtype) if args.dtype else None


def prepare(args):
    """Everything checkable before any collective: (checkpoint, tokenizer, ids, sampling)."""
    sampling = Sampling(args.greedy, args.temperature, args.top_k, args.top_p)
    prompts = read_prompts(args)
    checkpoint = resolve_checkpoint(args.load)
    meta = read_json(os.path.join(checkpoint, "megazoo.json"), advice="the checkpoint is damaged")
    args.dtype = _weights_dtype(args, meta, checkpoint)
    config = config_from_dict(meta.get("model") or {})
    tokenizer = find_tokenizer(checkpoint, args.tokenizer)
    ids = [encode_prompt(tokenizer, text) for text in prompts]
    if args.max_new_tokens is None:  # as many as fit, up to the default
        room = config.max_position_embeddings - max(len(i) for i in ids)
        args.max_new_tokens = min(DEFAULT_NEW_TOKENS, max(room, 1))
    check_request(ids, args.max_new_tokens, config)
    if args.tp < 1 or args.pp < 1:
        raise ValueError(f"--tp and --pp must be >= 1, got {args.tp} and {args.pp}")
    if args.pp > config.num_layers:
        raise ValueError(f"--pp {args.pp} exceeds the model's {config.num_layers} layers")
    return checkpoint, tokenizer, ids, sampling


def run(args) -> None:
    from ..checkpoint import load_pretrained
    from ..parallel import ParallelConfig, ParallelState

    checkpoint, tokenizer, ids, sampling = prepare(args)
    dtype = args.dtype
    state = ParallelState.initialize(ParallelConfig(tp=args.tp, pp=args.pp))
    model = load_pretrained(checkpoint, state=state, device=local_device(), dtype=dtype,
                            verify_checksums=args.verify_checksums,
                            allow_nonfinite=args.allow_nonfinite_load)
    start = time.perf_counter()
    new = generate_ids(model, ids, args.max_new_tokens, sampling, seed=args.seed,
                       stop_id=None if args.ignore_eos else tokenizer.eod,
                       cuda_graphs=args.cuda_graphs)
    seconds = time.perf_counter() - start
    if state.global_rank == 0:
        texts = [decode_text(tokenizer, p + n) for p, n in zip(ids, new)]
        print(f"\n{SEPARATOR}\n".join(texts))
        count = sum(len(n) for n in new)
        print(f"generated {count} tokens for {len(ids)} prompt{'s' if len(ids) > 1 else ''} "
              f"in {seconds:.2f} s ({count / max(seconds, 1e-9):,.0f} tokens/s) from "
              f"{checkpoint}", file=sys.stderr)
    if state.world_size > 1:
        dist.barrier()


def main(argv: list[str] | None = None) -> int:
    """0 when done; 'error: ...' on stderr and 2 for bad input."""
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except (ValueError, FileNotFoundError) as exc:
        return report_error(str(exc))
    finally:  # gloo is left standing: see megazoo.cli._leave_gloo
        if runs_nccl():
            dist.destroy_process_group()
    return 0
