"""Compressed gradient reductions with error feedback: codecs (`codecs`) and the collectives
that move their bytes (`reduce`). Pure PyTorch on the tensors' device; see each module."""
from .codecs import BlockCodec, TopKCodec
from .reduce import ALGORITHMS, BlockReduction, DenseReduction, TopKReduction, build_reduction

__all__ = ["ALGORITHMS", "BlockCodec", "BlockReduction", "DenseReduction", "TopKCodec",
           "TopKReduction", "build_reduction"]
