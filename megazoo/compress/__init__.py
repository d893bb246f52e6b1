"""Gradient compression as a plug-in of the plain engine's bucket reduction: the codecs
(`codecs`), the compressed collectives with error feedback (`reduce`), 1-bit Adam's
frozen-variance rule (`frozen_adam`), the residuals in checkpoints (`state`), and the one
object the engine holds, `reducer.Reducer`, which its grad buffer calls per bucket. The
1bit / 2bit codec and the topk encoder also run as Triton kernels on GPUs
(`megazoo.kernels.triton_codec`, `triton_topk`)."""
from .reduce import build_reduction
from .reducer import Reducer

__all__ = ["Reducer", "build_reduction"]
