"""Install megazoo. Compiled code is optional: `import megazoo` and every CPU test work without it.

Install with the CPU build of torch first so pip never pulls a CUDA build:
    pip install torch==2.13.0 && pip install --no-build-isolation -e ".[test]"
(--no-build-isolation: DeepSpeed's setup and ours use the torch already installed.)

The C++ dataset helpers (csrc/data_helpers.cpp, pybind11 headers as shipped inside torch) are
built wherever a C++ compiler works; if the build fails the install still succeeds and
megazoo.data falls back to NumPy (or compiles on first use).
"""
import ast
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext


def _pybind11_includes() -> list[str]:
    try:
        import pybind11
        return [pybind11.get_include()]
    except ImportError:
        pass
    try:
        from torch.utils.cpp_extension import include_paths
        return include_paths()[:1]  # torch/include holds pybind11/
    except ImportError:
        return []


def _console_scripts() -> list[str]:
    """`name = module:function` for each command in megazoo/cli.py's COMMANDS (read, not imported)."""
    tree = ast.parse((Path(__file__).resolve().parent / "megazoo" / "cli.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(getattr(t, "id", None) == "COMMANDS" for t in targets):
                return [f"{name} = {target}" for name, target in ast.literal_eval(node.value).items()]
    raise RuntimeError("megazoo/cli.py defines no COMMANDS")


class OptionalBuildExt(build_ext):
    """Build extensions where a toolchain works; warn and go on where it does not."""

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # a missing compiler or header must not fail the install
            print(f"megazoo: not building {ext.name} ({exc}); the pure-Python fallback is used")


DATA_HELPERS = Extension(
    "megazoo._data_helpers",
    sources=["csrc/data_helpers.cpp"],
    include_dirs=_pybind11_includes(),
    extra_compile_args=["-O3", "-ffp-contract=off", "-std=c++17"],  # as megazoo.data.helpers.CXX_FLAGS
    language="c++",
)

setup(
    name="megazoo",
    version="0.1.0",
    description="A Megatron-style model zoo: tensor, sequence, pipeline and ZeRO parallelism",
    python_requires=">=3.10",
    packages=find_packages(include=["megazoo", "megazoo.*"]),
    ext_modules=[DATA_HELPERS],
    cmdclass={"build_ext": OptionalBuildExt},
    entry_points={"console_scripts": _console_scripts()},
    install_requires=[
        "torch>=2.4",
        "numpy",
        "safetensors",
        "sentencepiece",
        "tokenizers",
        "transformers",
        "deepspeed",
        "tqdm",
        # checkpoint checksums: xxh3_64 hides beside the file I/O where zlib's CRC-32 does
        # not; without it megazoo writes and checks CRC-32 (megazoo.checkpoint.checksums)
        "xxhash",
    ],
    extras_require={
        # triton: the Triton kernels' tests run on CPU tensors under its interpreter
        # (tests/conftest.py); wheels exist for Linux only, elsewhere those tests skip.
        # tensorboard, wandb: the --tensorboard-dir / --wandb-project writers' tests (wandb
        # runs offline there: no account, no network).
        "test": ["pytest", "pytest-timeout", "matplotlib", "tensorboard", "wandb",
                 "triton; platform_system == 'Linux'"],
        # matplotlib: python -m megazoo.plot, megazoo.plan --out, megazoo.pipeline.show and
        # the curves picture a run draws next to its checkpoints.
        "plot": ["matplotlib"],
    },
)
