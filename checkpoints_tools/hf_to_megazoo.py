"""Hugging Face (gpt2, bloom, llama) -> megazoo checkpoint at any tp/pp/vpp.
    python checkpoints_tools/hf_to_megazoo.py --hf-dir D --out O [--tp N --pp M --vpp V] [--dtype bf16]

Errors (unsupported model, config contradicting weights, missing or truncated files, a layout
that does not fit the model) print one line and exit with code 2, writing nothing.
The logic lives in megazoo.convert; this script only parses the command line.
"""
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script from a source checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megazoo.convert.cli import hf_to_megazoo_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(hf_to_megazoo_main())
