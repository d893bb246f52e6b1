"""``python -m megazoo.kernels [--device DEV]``: which implementation each fused kernel uses,
and whether the C++ dataset helpers and the offload's C AdamW are built (or which fallback
runs, and why)."""
from __future__ import annotations

from ..cli_parser import HintingParser
from .report import format_report, kernel_report


def main(argv: list[str] | None = None) -> None:
    """Print the kernel table for a device (default: the first CUDA GPU, else CPU)."""
    parser = HintingParser(prog="python -m megazoo.kernels", description=__doc__)
    parser.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda if any)")
    args = parser.parse_args(argv)
    print(format_report(kernel_report(args.device)))
    from .dataset_helpers import backend  # csrc/data_helpers.cpp: built, or why NumPy runs

    info = backend()
    state = "C++ (built)" if info.impl == "cpp" else "NumPy fallback"
    print(f"\ndataset index helpers (csrc/data_helpers.cpp): {state}: {info.reason}")
    from .host_adamw import backend as host_backend  # the offloaded optimizer's host step

    info = host_backend()
    state = "C (one pass)" if info.impl == "c" else "torch's fused AdamW"
    print(f"offload host AdamW (csrc/host_adamw.c): {state}: {info.reason}")


if __name__ == "__main__":
    main()
