"""Generate text from a megazoo checkpoint with a KV cache, at any tp / pp layout.

    python generate.py --load checkpoints --prompt "def main(" --max-new-tokens 60 --greedy
    torchrun --nproc-per-node 2 generate.py --load checkpoints --tp 2 --prompt "import "
    python generate.py --help

The command is `megazoo.generation.cli.main`, reached through `megazoo.cli.generate` (also
installed as the `megazoo-generate` command).
"""
import sys

from megazoo.cli import generate

if __name__ == "__main__":
    sys.exit(generate())
