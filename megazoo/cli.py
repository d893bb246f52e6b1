"""megazoo's command lines: the console commands `pip install` creates (`COMMANDS`), each a
function that the script at Megatron's path (`pretrain_gpt.py`, `generate.py`,
`checkpoints_tools/*.py`, ...) or the `python -m` module also runs; README.md has the table.

Each function returns the exit code: 0, or 2 after one `error: ...` line for bad input
(`megazoo.errors.report_error`: rank 0 only under torchrun, and torchrun's failure summary
shows it as the root cause). The module doing the work is imported only when its command runs.
`megazoo-sparse-layout` (a picture of a layer's data) is written out here so that `layers/`
holds no command line.
"""
from __future__ import annotations

#: console command -> "module:function" (setup.py's console_scripts are built from this text).
COMMANDS = {
    "megazoo-pretrain": "megazoo.cli:pretrain",
    "megazoo-convert-hf": "megazoo.cli:convert_hf",
    "megazoo-export-hf": "megazoo.cli:export_hf",
    "megazoo-reshard": "megazoo.cli:reshard",
    "megazoo-convert-zero": "megazoo.cli:convert_zero",
    "megazoo-preprocess-data": "megazoo.cli:preprocess_data",
    "megazoo-generate": "megazoo.cli:generate",
    "megazoo-plan": "megazoo.cli:plan",
    "megazoo-kernels": "megazoo.cli:kernels",
    "megazoo-pipeline-show": "megazoo.cli:pipeline_show",
    "megazoo-plot": "megazoo.cli:plot",
    "megazoo-sparse-layout": "megazoo.cli:sparse_layout",
}


def pretrain(argv: list[str] | None = None) -> int:
    """`pretrain_gpt.py`: pre-train with Megatron's flags (megazoo.training.run)."""
    from .training.run import main

    return _leave_gloo(main(argv))


def _leave_gloo(code: int) -> int:
    """The exit code, or, in a torchrun worker of a multi-rank gloo run (its group left
    standing by the run), leave the process now with it (output flushed): the run is over
    (logs closed, checkpoints written), and torch 2.13's gloo can abort the interpreter's
    teardown of a finished run ("terminate called without an active exception", SIGABRT in
    about one run in ten on CPU; destroying the group first aborts too), which torchrun then
    reports as a failed rank. A process that runs the command inside a larger program (not
    started by torchrun) keeps its normal exit."""
    import os
    import sys

    import torch.distributed as dist

    from .parallel.state import runs_nccl

    if "TORCHELASTIC_RUN_ID" in os.environ and dist.is_initialized() \
            and dist.get_world_size() > 1 and not runs_nccl():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def convert_hf(argv: list[str] | None = None) -> int:
    """`checkpoints_tools/hf_to_megazoo.py`: a Hugging Face model -> a megazoo checkpoint."""
    from .convert.cli import hf_to_megazoo_main

    return hf_to_megazoo_main(argv)


def export_hf(argv: list[str] | None = None) -> int:
    """`checkpoints_tools/megazoo_to_hf.py`: a megazoo checkpoint -> a Hugging Face model."""
    from .convert.cli import megazoo_to_hf_main

    return megazoo_to_hf_main(argv)


def reshard(argv: list[str] | None = None) -> int:
    """`checkpoints_tools/reshard.py`: a megazoo checkpoint at another tp / pp layout."""
    from .convert.cli import reshard_main

    return reshard_main(argv)


def convert_zero(argv: list[str] | None = None) -> int:
    """`checkpoints_tools/zero_to_megazoo.py`: a DeepSpeed ZeRO checkpoint -> megazoo."""
    from .convert.cli import zero_to_megazoo_main

    return zero_to_megazoo_main(argv)


def generate(argv: list[str] | None = None) -> int:
    """`generate.py`: text from a checkpoint with a KV cache (megazoo.generation)."""
    from .generation.cli import main

    return _leave_gloo(main(argv))


def plan(argv: list[str] | None = None) -> int:
    """`python -m megazoo.plan`: GPU and host memory of a training layout."""
    from .plan import main

    return main(argv)


def kernels(argv: list[str] | None = None) -> int:
    """`python -m megazoo.kernels`: which implementation each fused kernel uses here."""
    from .kernels.__main__ import main

    main(argv)
    return 0


def pipeline_show(argv: list[str] | None = None) -> int:
    """`python -m megazoo.pipeline.show`: simulate a pipeline schedule and draw it (PNG)."""
    from .pipeline.show import main

    main(argv)
    return 0


def preprocess_data(argv: list[str] | None = None) -> int:
    """`tools/preprocess_data.py`: text or JSON lines -> tokenized PREFIX.bin / PREFIX.idx."""
    from .data.preprocess import main

    return main(argv)


def plot(argv: list[str] | None = None) -> int:
    """`python -m megazoo.plot`: training curves of --log-json files (PNG)."""
    from .plot import main

    return main(argv)


def sparse_layout(argv: list[str] | None = None) -> int:
    """`megazoo-sparse-layout`: a block-sparse attention layout's density per head, and its
    picture (`--out`). The section comes from pretrain_gpt.py's own sparse flags and
    --deepspeed_config, merged as a run merges them."""
    from .cli_parser import HintingParser
    from .config.sparse_attention import add_sparse_flags
    from .errors import report_error

    p = HintingParser(prog="megazoo-sparse-layout",
                      description="Draw a block-sparse attention layout.")
    p.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config",
                   help="a DeepSpeed JSON; its sparse_attention section is used")
    add_sparse_flags(p)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--causal", action="store_true", help="intersect with causality (decoders)")
    p.add_argument("--out", help="image file to write (png, pdf, svg)")
    args = p.parse_args(argv)
    from .config.ds_config import read_ds_config
    from .config.sparse_attention import SparseAttentionConfig, sparse_section
    from .layers.sparse.layouts import density, layout

    try:
        config = SparseAttentionConfig.from_ds_config(
            sparse_section(args, *read_ds_config(args.deepspeed_config)) or {})
        lay = layout(config, args.heads, args.seq, args.seed, causal=args.causal)
        causal = "; intersected with the causal mask (--causal): no key after its query" \
            if args.causal else ""  # the section's own "attention" key is another matter
        print(f"{config.to_ds_config()}  s={args.seq}  {lay.shape[-1]} blocks per side{causal}")
        for h in range(lay.shape[0]):
            print(f"head {h}: density {100 * density(lay[h:h + 1], config.block, args.causal):.2f}%")
        if args.out:
            _draw_sparse_layout(lay, config.block, args.causal, args.out,
                                f"{config.mode}, block {config.block}, s = {args.seq}")
            print(f"wrote {args.out}")
    except (ValueError, OSError) as e:
        return report_error(str(e))
    return 0


def _draw_sparse_layout(block_layout, block: int, causal: bool, out: str, title: str,
                        max_heads: int = 4) -> None:
    """The block pattern of the first few heads, one panel each, to an image file."""
    from .layers.sparse.layouts import density
    from .matplotlib_figure import new_figure

    n = min(max_heads, block_layout.shape[0])
    fig = new_figure("the sparse layout picture", figsize=(3.2 * n, 3.4), layout="constrained")
    for h in range(n):
        ax = fig.add_subplot(1, n, h + 1)
        ax.imshow(block_layout[h].numpy(), cmap="Greys", interpolation="nearest")
        ax.set_title(f"head {h}: {100 * density(block_layout[h:h + 1], block, causal):.1f}%",
                     fontsize=9)
        ax.set_xlabel("key block")
        ax.set_ylabel("query block")
    fig.suptitle(title, fontsize=10)
    fig.savefig(out, dpi=120)
