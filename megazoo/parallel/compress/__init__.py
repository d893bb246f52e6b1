"""Compressed gradient reductions with error feedback: codecs (`codecs`) and the collectives
that move their bytes (`reduce`). PyTorch on the tensors' device, the 1bit / 2bit codec as
Triton kernels on GPUs (`megazoo.kernels.triton_codec`); see each module."""
from .codecs import BlockCodec, TopKCodec
from .reduce import ALGORITHMS, BlockReduction, DenseReduction, TopKReduction, build_reduction

__all__ = ["ALGORITHMS", "BlockCodec", "BlockReduction", "DenseReduction", "TopKCodec",
           "TopKReduction", "build_reduction"]
