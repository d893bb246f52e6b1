"""megazoo checkpoint at any layout -> the same checkpoint at another layout (aux tensors too).
    python checkpoints_tools/reshard.py --load O --out O2 --tp N --pp M [--vpp V]

Errors (unsupported model, config contradicting weights, missing or truncated files, a layout
that does not fit the model) print one line and exit with code 2, writing nothing.
A shim: the command is `megazoo.cli.reshard` (also installed as `megazoo-reshard`).
"""
import sys

from megazoo.cli import reshard

if __name__ == "__main__":
    sys.exit(reshard())
