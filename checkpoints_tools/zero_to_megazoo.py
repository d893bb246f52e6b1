"""A DeepSpeedEngine checkpoint (ZeRO-1/2/3 shards) -> an ordinary megazoo checkpoint.

    python checkpoints_tools/zero_to_megazoo.py --load DS_DIR --out O [--tp N --pp M --vpp V]
        [--dtype float32|bfloat16|float16] [--overwrite]

Errors (not a DeepSpeedEngine folder, missing rank files, a layout that does not fit the
model, an --out that exists) print one line and exit with code 2, writing nothing.
A shim: the command is `megazoo.cli.convert_zero` (also installed as `megazoo-convert-zero`).
"""
import sys

from megazoo.cli import convert_zero

if __name__ == "__main__":
    sys.exit(convert_zero())
