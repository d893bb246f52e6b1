"""Compressed gradient communication of a run: `CompressionConfig`, from the ds_config keys

    "gradient_compression": {"algorithm": "topk", "topk_ratio": 0.01, "compression_start_step": 100},
    "communication_data_type": "bf16"

of `--deepspeed_config` (read by the plain engine too) or the flags of the same names
(`--gradient-compression topk --topk-ratio 0.01 --compression-start-step 100
--communication-data-type bf16`), merged by `ds_config.merge_flags`. The plain engine
compresses its data-parallel bucket reduction (`megazoo.parallel.compress`); DeepSpeed gets
`communication_data_type` as its own key and FSDP2 as its reduce dtype; `gradient_compression`
on those engines is refused (`check_engine_compression`).

`huffman_coding` is refused: measured on the default model's gradients (bench/README.md,
"Huffman coding"), a byte-wise Huffman code saves 3% of the 1bit bytes (the signs carry
~1 bit of entropy each), 6% of topk's and 29% of 2bit's (which then still sends 1.4x what
1bit sends), while decoding is a sequential bit walk that a GPU cannot vectorise.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..parallel.compress import ALGORITHMS as COMPRESSORS
from .ds_config import COMM_KEY, COMPRESSION_SECTION as SECTION, JsonKey, json_section, merge_flags

ALGORITHMS = ("none", *COMPRESSORS)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
DEFAULTS = {"topk_ratio": 0.01, "compression_start_step": 0, "compression_block_size": 1024,
            "compressed_momentum_share": 1.0}
# ds_config key (inside the section) -> field; the section's "algorithm" is the field below.
SECTION_KEYS = {"algorithm": "gradient_compression", "topk_ratio": "topk_ratio",
                "compression_start_step": "compression_start_step",
                "compression_block_size": "compression_block_size",
                "freeze_variance": "freeze_variance",
                "compressed_momentum_share": "compressed_momentum_share",
                "topk_selection": "topk_selection",
                "local_gradient_clipping": "local_gradient_clipping",
                "huffman_coding": "huffman_coding"}
KEYS = (*(JsonKey(f, (SECTION, k), "--" + f.replace("_", "-")) for k, f in SECTION_KEYS.items()),
        COMM_KEY)
TOPK_SELECTIONS = ("magnitude", "update")
HUFFMAN_REFUSAL = ("huffman_coding is not implemented: measured on megazoo's gradients it saves "
                   "3% of the 1bit bytes, 6% of topk's and 29% of 2bit's (still 1.4x 1bit's), "
                   "and decoding is a sequential bit walk (bench/README.md); set it to false "
                   "or drop it")


@dataclass
class CompressionConfig:
    """Compressed gradient communication (DeepSpeed-style ds_config keys, see README)."""

    gradient_compression: str | None = None
    """Plain engine: compress the data-parallel gradient reduction with "topk", "1bit" or
    "2bit" (error feedback keeps what was not sent for the next step); None / "none": off."""
    topk_ratio: float | None = None
    """topk: fraction of each bucket's entries sent per step (default 0.01)."""
    compression_start_step: int | None = None
    """Optimizer steps reduced uncompressed before compression starts (default 0)."""
    compression_block_size: int | None = None
    """1bit / 2bit: elements per scale, a multiple of 8 (default 1024)."""
    freeze_variance: bool | None = None
    """1-bit Adam: freeze AdamW's second moment once compression starts (the update stays
    linear in the gradient, so error feedback works for Adam) and compress each rank's local
    momentum instead of its gradient (not with the distributed optimizer, which holds one
    momentum shard per rank); needs --compression-start-step >= 1, the uncompressed warmup
    that estimates the second moment."""
    compressed_momentum_share: float | None = None
    """With --freeze-variance: the share of AdamW's momentum that each compressed step
    carries through the compression (default 1.0, 1-bit Adam's rule: each rank compresses
    its whole local momentum). Below 1 the rest stays in the optimizer's momentum, where it
    keeps decaying on every entry (by beta1 x (1 - share) per step) whether or not the entry
    was sent; 0 compresses plain gradients. The sum is exact for any share (the momentum
    added to the buckets is taken off again); the share decides what waits in the residual.
    Measured on the default run (bench/README.md): topk 0.01 converged best at 0.3."""
    topk_selection: str | None = None
    """topk: which entries each rank sends: "magnitude" (the largest |x|, default) or "update"
    (the largest |x| / (sqrt(v) + eps) with v AdamW's frozen second moment: the entries whose
    AdamW step is largest, rather than those with the largest gradient, which under Adam's
    per-coordinate scaling are not the ones that move the parameters most). Only the choice
    changes; the values sent and the error feedback stay the same. Needs --freeze-variance
    and the full momentum on every rank (no distributed optimizer)."""
    local_gradient_clipping: bool | None = None
    """Deep Gradient Compression's local clipping (Lin et al. 2018): on compressed steps each
    rank clips its own gradient, bucket by bucket, before compression (to clip_grad x
    sqrt(dp) x sqrt(bucket share of the buffer): the mean over dp of independent gradients
    has 1/sqrt(dp) of their norm), and the reduced gradient is not clipped again. The
    reduced gradient's norm is not the gradient's: topk delivers held-back mass in bursts
    (and with --freeze-variance the momentum offset), which inflates it, so clipping by it
    shrinks the steps. Not with tp or pp > 1: ranks holding replicated or tied copies of
    a parameter would clip them by different factors."""
    huffman_coding: bool | None = None
    """Entropy-code the compressed bytes: refused (measured to save too little, see README)."""
    communication_data_type: str | None = None
    """dtype of the gradient reduction on the wire: fp16, bf16 or fp32 (default: the fp32
    main gradients'); DeepSpeed gets it as its own key, FSDP2 as its reduce dtype."""

    def __post_init__(self) -> None:
        alg = self.gradient_compression
        if alg is not None and alg not in ALGORITHMS:
            raise ValueError(f"--gradient-compression must be one of {ALGORITHMS}, got {alg!r}")
        if self.communication_data_type is not None and self.communication_data_type not in DTYPES:
            raise ValueError(f"--communication-data-type must be one of {tuple(DTYPES)}, got "
                             f"{self.communication_data_type!r}")
        if self.huffman_coding:
            raise ValueError(HUFFMAN_REFUSAL)
        on = self.algorithm is not None
        for name, need in (("topk_ratio", "topk"), ("compression_block_size", "1bit or 2bit"),
                           ("compression_start_step", "any algorithm"),
                           ("freeze_variance", "any algorithm"), ("topk_selection", "topk"),
                           ("local_gradient_clipping", "any algorithm")):
            value = getattr(self, name)
            reads = on and (need == "any algorithm" or self.algorithm in need.split(" or "))
            if value is not None and not reads:
                raise ValueError(f"--{name.replace('_', '-')} is read only with "
                                 f"--gradient-compression {need}: drop it or set the algorithm")
        if self.topk_ratio is not None and not 0.0 < self.topk_ratio <= 1.0:
            raise ValueError(f"--topk-ratio must be in (0, 1], got {self.topk_ratio}")
        if self.compression_start_step is not None and self.compression_start_step < 0:
            raise ValueError(f"--compression-start-step must be >= 0, got "
                             f"{self.compression_start_step}")
        if self.freeze_variance and not self.compression_start_step:
            raise ValueError("--freeze-variance freezes AdamW's variance as estimated by "
                             "uncompressed steps: set --compression-start-step (e.g. 100)")
        share = self.compressed_momentum_share
        if share is not None and not (self.freeze_variance and 0.0 <= share <= 1.0):
            raise ValueError(f"--compressed-momentum-share {share}: needs --freeze-variance "
                             f"(momentum is compressed only with it) and a value in [0, 1]")
        if self.topk_selection is not None and self.topk_selection not in TOPK_SELECTIONS:
            raise ValueError(f"--topk-selection must be one of {TOPK_SELECTIONS}, got "
                             f"{self.topk_selection!r}")
        if self.topk_selection == "update" and not self.freeze_variance:
            raise ValueError("--topk-selection update weighs entries by AdamW's frozen "
                             "variance: add --freeze-variance (and --compression-start-step)")
        block = self.compression_block_size
        if block is not None and (block < 8 or block % 8):
            raise ValueError(f"--compression-block-size must be a positive multiple of 8, got {block}")

    @property
    def algorithm(self) -> str | None:
        """The algorithm, None when compression is off."""
        return None if self.gradient_compression in (None, "none") else self.gradient_compression

    def value(self, name: str):
        """A field, or its default when not given."""
        value = getattr(self, name)
        return DEFAULTS.get(name) if value is None else value

    @property
    def wire_dtype(self) -> torch.dtype | None:
        return DTYPES.get(self.communication_data_type)


def resolve_compression(given: dict, ds: dict, source: str) -> CompressionConfig:
    """The run's CompressionConfig from the flags `given` ({field: value}) and the ds_config
    `ds` (`merge_flags` over KEYS; the section's keys are checked: a typo is an error)."""
    section = json_section(ds, SECTION, source) or {}
    unknown = sorted(set(section) - set(SECTION_KEYS))
    if unknown:
        raise ValueError(f"{source}: {SECTION} has unknown keys {unknown}; known: "
                         f"{sorted(SECTION_KEYS)}")
    return CompressionConfig(**merge_flags(ds, given, KEYS, source))


def check_compression_layout(cfg: CompressionConfig, parallel, sharded: bool) -> None:
    """The compression options that need a layout: one line for those that cannot run."""
    if cfg.local_gradient_clipping and (parallel.tp > 1 or parallel.pp > 1):
        raise ValueError(f"--local-gradient-clipping clips each rank's gradient by its own "
                         f"norm, so the copies of a parameter that model-parallel ranks share "
                         f"(replicated over tp, tied embeddings over pp) would diverge: drop "
                         f"it or run with tp = pp = 1 (here tp = {parallel.tp}, pp = "
                         f"{parallel.pp})")
    if cfg.topk_selection == "update" and sharded:
        raise ValueError("--topk-selection update needs the whole variance on every rank: "
                         "drop --use-distributed-optimizer or the selection")


def check_engine_compression(cfg: CompressionConfig, zero_impl: str) -> None:
    """gradient_compression needs the plain engine's buckets: one line for other engines."""
    if cfg.algorithm is None or zero_impl == "none":
        return
    engine = "DeepSpeed" if zero_impl == "deepspeed" else "FSDP2 (--zero-impl fsdp2)"
    hint = (" (DeepSpeed's own compressed optimizers are the \"optimizer\" types OneBitAdam, "
            "ZeroOneAdam, OneBitLamb, in the releases that ship them)"
            if zero_impl == "deepspeed" else "")
    raise ValueError(f"gradient_compression {cfg.algorithm} compresses the plain engine's "
                     f"gradient buckets; {engine} reduces gradients itself{hint}: drop "
                     f"gradient_compression / --gradient-compression, or the ZeRO engine")


ONEBIT_ALTERNATIVE = ("the plain engine's \"gradient_compression\": {\"algorithm\": \"1bit\"} "
                      "(--gradient-compression 1bit, without --deepspeed) is the alternative")


def check_onebit_backend(kind: str, ds: dict, device: torch.device) -> None:
    """ValueError (one line) unless DeepSpeed's 1-bit optimizer `kind` can run here: this
    DeepSpeed release must have it, the model must be on CUDA GPUs, and its communication
    backend's packages must import (nccl: cupy; mpi: cupy and mpi4py)."""
    import importlib.util

    try:
        present = importlib.util.find_spec("deepspeed.runtime.fp16.onebit") is not None
    except ModuleNotFoundError:
        present = False
    if not present:
        from importlib.metadata import PackageNotFoundError, version

        try:
            release = f"DeepSpeed {version('deepspeed')}"
        except PackageNotFoundError:
            release = "DeepSpeed (not installed)"
        raise ValueError(f"\"optimizer\": {kind} needs DeepSpeed's 1-bit optimizers, which "
                         f"{release} does not ship: {ONEBIT_ALTERNATIVE}")
    if device.type != "cuda":
        raise ValueError(f"DeepSpeed's {kind} runs its compressed all-reduce on CUDA GPUs only, "
                         f"not on {device.type}: {ONEBIT_ALTERNATIVE}")
    backend = ((ds.get("optimizer") or {}).get("params") or {}).get("comm_backend_name", "nccl")
    needs = {"nccl": ("cupy",), "mpi": ("cupy", "mpi4py")}.get(backend, ())
    missing = [m for m in needs if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"DeepSpeed's {kind} with comm_backend_name {backend} needs "
                         f"{' and '.join(missing)} installed: install them, or note that "
                         f"{ONEBIT_ALTERNATIVE}")
