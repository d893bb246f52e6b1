"""Pre-train a GPT / BLOOM / LLaMA model with Megatron-style flags.

    python pretrain_gpt.py                        # small GPT on Python's stdlib, CPU, minutes
    torchrun --nproc-per-node 2 pretrain_gpt.py --tensor-model-parallel-size 2
    python pretrain_gpt.py --help                 # every flag, generated from the configs

The flags come from the dataclasses in `megazoo/config/` (`megazoo/config/flags.py` builds
them); the run itself is `megazoo.training.run.main`, reached
through `megazoo.cli.pretrain` (also installed as the `megazoo-pretrain` command).
"""
import sys

from megazoo.cli import pretrain

if __name__ == "__main__":
    sys.exit(pretrain())
