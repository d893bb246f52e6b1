"""megazoo checkpoint (any layout) -> Hugging Face directory (config.json + safetensors).
    python checkpoints_tools/megazoo_to_hf.py --load O --out D [--dtype fp16]

Errors (unsupported model, config contradicting weights, missing or truncated files, a layout
that does not fit the model) print one line and exit with code 2, writing nothing.
The logic lives in megazoo.convert; this script only parses the command line.
"""
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script from a source checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megazoo.convert.cli import megazoo_to_hf_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(megazoo_to_hf_main())
