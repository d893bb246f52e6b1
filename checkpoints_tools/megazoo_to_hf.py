"""megazoo checkpoint (any layout) -> Hugging Face directory (config.json + safetensors).
    python checkpoints_tools/megazoo_to_hf.py --load O --out D [--dtype fp16]

Errors (unsupported model, config contradicting weights, missing or truncated files, a layout
that does not fit the model) print one line and exit with code 2, writing nothing.
A shim: the command is `megazoo.cli.export_hf` (also installed as `megazoo-export-hf`).
"""
import sys

from megazoo.cli import export_hf

if __name__ == "__main__":
    sys.exit(export_hf())
