"""Command lines of checkpoints_tools/: argument parsing and one-line errors (exit code 2)."""
from __future__ import annotations

import argparse
import time

from ..checkpoint.files import parse_dtype
from ..cli_parser import HintingParser
from ..errors import report_error, user_path

LOAD_FORMS = "a --save folder (its `latest` checkpoint) or one iter_* folder"


def _layout_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", "--tensor-model-parallel-size", type=int, default=1,
                        help="tensor-parallel size of the written checkpoint")
    parser.add_argument("--pp", "--pipeline-model-parallel-size", type=int, default=1,
                        help="pipeline-parallel size of the written checkpoint")
    parser.add_argument("--vpp", type=int, default=1, help="model chunks per pipeline rank")
    _output_args(parser)


def _output_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", default=None, help="float32, float16 or bfloat16 (default: as stored)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --out, only if it is a checkpoint of the kind "
                             "written, holds nothing else, and is not (nor contains) the input")


def _verify_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-verify-checksums", dest="verify_checksums", action="store_false",
                        help="read the --load checkpoint without checking each tensor (each "
                             "DeepSpeed file) against the checksum megazoo.json recorded for it")


def _dtype(args):
    """The torch dtype `--dtype` names, or None (keep the stored one)."""
    return parse_dtype(args.dtype) if args.dtype else None


def _run(action, args, paths: dict[str, str]) -> int:
    """Run `action(args)`; every converter's one error path: a ValueError or RuntimeError
    (DeepSpeed's loader) becomes one line on stderr and exit code 2, and an OSError (a full
    disk, a read-only --out, ...) one line naming the flag of `paths` (flag -> path) it is
    about and what to do."""
    try:
        start = time.perf_counter()
        with user_path(paths):
            message = action(args)
        print(f"{message} in {time.perf_counter() - start:.2f} s")
        return 0
    except (ValueError, OSError, RuntimeError) as exc:
        return report_error(str(exc))


def hf_to_megazoo_main(argv=None) -> int:
    parser = HintingParser(description="Convert a Hugging Face model (gpt2, bloom, "
                                                 "llama; safetensors) to a megazoo checkpoint.")
    parser.add_argument("--hf-dir", required=True, help="directory with config.json + safetensors")
    parser.add_argument("--out", required=True, help="megazoo checkpoint directory to write")
    _layout_args(parser)
    args = parser.parse_args(argv)

    def action(_):
        from .api import hf_to_megazoo
        cfg = hf_to_megazoo(args.hf_dir, args.out, tp=args.tp, pp=args.pp, vpp=args.vpp,
                            dtype=_dtype(args), overwrite=args.overwrite)
        return f"wrote {args.out}: {cfg.family} {cfg.num_layers} layers, tp={args.tp} pp={args.pp}"
    return _run(action, args, {"--out": args.out, "--hf-dir": args.hf_dir})


def megazoo_to_hf_main(argv=None) -> int:
    parser = HintingParser(description="Convert a megazoo checkpoint (any layout) to a "
                                                 "Hugging Face model directory.")
    parser.add_argument("--load", required=True, help=f"megazoo checkpoint: {LOAD_FORMS}")
    parser.add_argument("--out", required=True, help="Hugging Face directory to write")
    _output_args(parser)
    _verify_args(parser)
    args = parser.parse_args(argv)

    def action(_):
        from .api import megazoo_to_hf
        config = megazoo_to_hf(args.load, args.out, dtype=_dtype(args), overwrite=args.overwrite,
                               verify_checksums=args.verify_checksums)
        return f"wrote {args.out}: {config['architectures'][0]}"
    return _run(action, args, {"--out": args.out, "--load": args.load})


def _relayout_main(argv, description: str, load_help: str, convert) -> int:
    """--load + --out + layout flags -> `convert(load, out, tp=, pp=, vpp=, dtype=, overwrite=,
    verify_checksums=)`."""
    parser = HintingParser(description=description)
    parser.add_argument("--load", required=True, help=load_help)
    parser.add_argument("--out", required=True, help="megazoo checkpoint folder to write")
    _layout_args(parser)
    _verify_args(parser)
    args = parser.parse_args(argv)

    def action(_):
        convert(args.load, args.out, tp=args.tp, pp=args.pp, vpp=args.vpp, dtype=_dtype(args),
                overwrite=args.overwrite, verify_checksums=args.verify_checksums)
        return f"wrote {args.out} at tp={args.tp} pp={args.pp} vpp={args.vpp}"
    return _run(action, args, {"--out": args.out, "--load": args.load})


def reshard_main(argv=None) -> int:
    from .api import reshard
    return _relayout_main(argv, "Rewrite a megazoo checkpoint at another tp/pp/vpp layout "
                                "(optimizer aux tensors included).",
                          f"megazoo checkpoint: {LOAD_FORMS}", reshard)


def zero_to_megazoo_main(argv=None) -> int:
    from .deepspeed import zero_to_megazoo
    return _relayout_main(argv, "Consolidate a DeepSpeedEngine (ZeRO-1/2/3) checkpoint into a "
                                "megazoo checkpoint.",
                          f"DeepSpeedEngine checkpoint: {LOAD_FORMS}", zero_to_megazoo)
