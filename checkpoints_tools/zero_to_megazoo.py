"""A DeepSpeedEngine checkpoint (ZeRO-1/2/3 shards) -> an ordinary megazoo checkpoint.

    python checkpoints_tools/zero_to_megazoo.py --load DS_DIR --out O [--tp N --pp M --vpp V]
        [--dtype float32|bfloat16|float16] [--overwrite]

Errors (not a DeepSpeedEngine folder, missing rank files, a layout that does not fit the
model, an --out that exists) print one line and exit with code 2, writing nothing.
The logic lives in megazoo.convert.deepspeed; this script only parses the command line.
"""
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script from a source checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megazoo.convert.cli import zero_to_megazoo_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(zero_to_megazoo_main())
