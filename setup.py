"""Install megazoo. On a CPU machine nothing is compiled; see csrc/ for the optional kernels.

Install with the CPU build of torch first so pip never pulls a CUDA build:
    pip install torch==2.13.0 && pip install --no-build-isolation -e ".[test]"
(--no-build-isolation because DeepSpeed's own setup imports the torch already installed.)
"""
from setuptools import find_packages, setup

setup(
    name="megazoo",
    version="0.1.0",
    description="A Megatron-style model zoo: tensor, sequence, pipeline and ZeRO parallelism",
    python_requires=">=3.10",
    packages=find_packages(include=["megazoo", "megazoo.*"]),
    install_requires=[
        "torch>=2.4",
        "numpy",
        "safetensors",
        "sentencepiece",
        "transformers",
        "deepspeed",
        "tqdm",
    ],
    extras_require={
        "test": ["pytest", "pytest-timeout", "matplotlib"],
    },
)
