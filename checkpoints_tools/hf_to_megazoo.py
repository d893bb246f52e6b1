"""Hugging Face (gpt2, bloom, llama) -> megazoo checkpoint at any tp/pp/vpp.
    python checkpoints_tools/hf_to_megazoo.py --hf-dir D --out O [--tp N --pp M --vpp V] [--dtype bf16]

Errors (unsupported model, config contradicting weights, missing or truncated files, a layout
that does not fit the model) print one line and exit with code 2, writing nothing.
A shim: the command is `megazoo.cli.convert_hf` (also installed as `megazoo-convert-hf`).
"""
import sys

from megazoo.cli import convert_hf

if __name__ == "__main__":
    sys.exit(convert_hf())
