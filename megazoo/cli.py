"""megazoo's command lines, in one table: the console commands `pip install` creates.

Every command exists in up to three spellings that run the same function of the package:

| console command | script at Megatron's path | module |
|---|---|---|
| `megazoo-pretrain` | `pretrain_gpt.py` | |
| `megazoo-convert-hf` | `checkpoints_tools/hf_to_megazoo.py` | |
| `megazoo-export-hf` | `checkpoints_tools/megazoo_to_hf.py` | |
| `megazoo-reshard` | `checkpoints_tools/reshard.py` | |
| `megazoo-convert-zero` | `checkpoints_tools/zero_to_megazoo.py` | |
| `megazoo-preprocess-data` | `tools/preprocess_data.py` | |
| `megazoo-generate` | `generate.py` | |
| `megazoo-plan` | | `python -m megazoo.plan` |
| `megazoo-kernels` | | `python -m megazoo.kernels` |
| `megazoo-pipeline-show` | | `python -m megazoo.pipeline.show` |
| `megazoo-plot` | | `python -m megazoo.plot` |

The scripts are three-line shims (import, call, exit) with no path set-up: they need megazoo
importable, which `pip install -e .` gives. Each function below returns the exit code (0, or
2 after a one-line error for bad input: `megazoo.errors.report_error`, which under torchrun
prints the line on rank 0 only and hands it to torchrun's failure summary as its root cause;
argparse's errors included, with abbreviated flags refused); the work happens in the module
it imports, loaded only when the command runs.
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
}


def pretrain(argv: list[str] | None = None) -> int:
    """`pretrain_gpt.py`: pre-train with Megatron's flags (megazoo.training.run)."""
    from .training.run import main

    return main(argv)


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

    return main(argv)


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
