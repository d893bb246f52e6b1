"""Compressed gradient communication of a run: `CompressionConfig`, from the ds_config keys

    "gradient_compression": {"algorithm": "topk", "topk_ratio": 0.01, "compression_start_step": 100},
    "communication_data_type": "bf16"

of `--deepspeed_config` (read by the plain engine too) or the flags of the same names, merged
by `ds_config.merge_flags`. A named recipe (`RECIPES`) fills in the keys not given and sets
the internals that only recipes set (see `megazoo.compress.reducer`). The plain engine
compresses its data-parallel bucket reduction (`megazoo.compress`); DeepSpeed and FSDP2 take
`communication_data_type` and refuse `gradient_compression` (`check_engine_compression`).
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

import torch

from .ds_config import COMM_KEY, COMPRESSION_SECTION as SECTION, JsonKey, merge_flags

ALGORITHMS = ("none", "topk", "1bit", "2bit")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
DEFAULTS = {"topk_ratio": 0.01, "compression_start_step": 0, "compression_block_size": 1024}
# ds_config key (inside the section) -> field; the section's "algorithm" is the field below.
SECTION_KEYS = {"algorithm": "gradient_compression", "topk_ratio": "topk_ratio",
                "compression_start_step": "compression_start_step",
                "compression_block_size": "compression_block_size",
                "freeze_variance": "freeze_variance", "recipe": "compression_recipe",
                "huffman_coding": "huffman_coding"}
KEYS = (*(JsonKey(f, (SECTION, k), "--" + f.replace("_", "-")) for k, f in SECTION_KEYS.items()),
        COMM_KEY)
TOPK_SELECTIONS = ("magnitude", "update")
# The internals a recipe may set, and their values without one: the share of AdamW's momentum
# carried through the compression with freeze_variance (1-bit Adam's rule: all of it), how
# topk picks its entries ("update": by the size of their frozen-variance AdamW step), and Deep
# Gradient Compression's local clipping.
INTERNALS = {"momentum_share": 1.0, "topk_selection": "magnitude", "local_clipping": False}
# Named recipes: the keys they fill in (a key given explicitly wins; the algorithm must agree)
# plus internals (docs/compression.md: how close each ends to the uncompressed loss).
RECIPES = {
    "topk-tuned": {"gradient_compression": "topk", "topk_ratio": 0.01,
                   "compression_start_step": 300, "freeze_variance": True,
                   "momentum_share": 0.3, "topk_selection": "update", "local_clipping": True},
    "1bit-adam": {"gradient_compression": "1bit", "compression_start_step": 200,
                  "freeze_variance": True},
}
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
    compression_recipe: str | None = None
    """A named recipe ("topk-tuned", "1bit-adam"): fills in the compression keys not given
    and sets the internals that only recipes set (see the module doc)."""
    huffman_coding: bool | None = None
    """Entropy-code the compressed bytes: refused (measured to save too little, see README)."""
    communication_data_type: str | None = None
    """dtype of the gradient reduction on the wire: fp16, bf16 or fp32 (default: the fp32
    main gradients'); DeepSpeed gets it as its own key, FSDP2 as its reduce dtype."""

    def __post_init__(self) -> None:
        self._apply_recipe()
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
                           ("freeze_variance", "any algorithm")):
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
        self._check_internals()
        block = self.compression_block_size
        if block is not None and (block < 8 or block % 8):
            raise ValueError(f"--compression-block-size must be a positive multiple of 8, got {block}")

    def _apply_recipe(self) -> None:
        """Fill in the recipe's keys that were not given (its algorithm must agree)."""
        name = self.compression_recipe
        if name is None:
            return
        if name not in RECIPES:
            raise ValueError(f"--compression-recipe must be one of {sorted(RECIPES)}, got {name!r}")
        recipe = RECIPES[name]
        given, algorithm = self.gradient_compression, recipe.get("gradient_compression")
        if None not in (given, algorithm) and given != algorithm:
            raise ValueError(f"--compression-recipe {name} is {algorithm} "
                             f"but --gradient-compression gives {given!r}: drop one")
        for key, value in recipe.items():
            if key not in INTERNALS and getattr(self, key) is None:
                setattr(self, key, value)

    def _check_internals(self) -> None:
        """A recipe's internals against its keys (research recipes may set any of them)."""
        share, selection = self.internals["momentum_share"], self.internals["topk_selection"]
        name = self.compression_recipe
        if not 0.0 <= share <= 1.0 or (share != 1.0 and not self.freeze_variance):
            raise ValueError(f"recipe {name}: momentum_share {share} needs freeze_variance "
                             f"(momentum is compressed only with it) and a value in [0, 1]")
        if selection not in TOPK_SELECTIONS:
            raise ValueError(f"recipe {name}: topk_selection must be one of {TOPK_SELECTIONS}, "
                             f"got {selection!r}")
        if selection == "update" and not (self.freeze_variance and self.algorithm == "topk"):
            raise ValueError(f"recipe {name}: topk_selection update weighs topk's entries by "
                             f"AdamW's frozen variance: it needs topk and freeze_variance")

    @property
    def internals(self) -> dict:
        """The recipe internals of this run (`INTERNALS` without a recipe)."""
        recipe = RECIPES.get(self.compression_recipe, {})
        return {k: recipe.get(k, v) for k, v in INTERNALS.items()}

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
    section = ds.get(SECTION) or {}  # a JSON object: `read_ds_config` checked its type
    unknown = sorted(set(section) - set(SECTION_KEYS))
    if unknown:
        raise ValueError(f"{source}: {SECTION} has unknown keys {unknown}; known: "
                         f"{sorted(SECTION_KEYS)}")
    return CompressionConfig(**merge_flags(ds, given, KEYS, source))


def check_compression_layout(cfg: CompressionConfig, parallel, sharded: bool) -> None:
    """The compression options that need a layout: one line for those that cannot run."""
    name = cfg.compression_recipe
    if cfg.internals["local_clipping"] and (parallel.tp > 1 or parallel.pp > 1):
        raise ValueError(f"--compression-recipe {name} clips each rank's gradient by its own "
                         f"norm, so the copies of a parameter that model-parallel ranks share "
                         f"(replicated over tp, tied embeddings over pp) would diverge: drop "
                         f"the recipe or run with tp = pp = 1 (here tp = {parallel.tp}, pp = "
                         f"{parallel.pp})")
    if cfg.internals["topk_selection"] == "update" and sharded:
        raise ValueError(f"--compression-recipe {name} picks topk's entries by AdamW's "
                         f"variance, which needs the whole variance on every rank: drop "
                         f"--use-distributed-optimizer or the recipe")


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
    try:
        present = importlib.util.find_spec("deepspeed.runtime.fp16.onebit") is not None
    except ModuleNotFoundError:
        present = False
    if not present:
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
