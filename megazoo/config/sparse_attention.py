"""The `sparse_attention` section of a DeepSpeed config, as a typed, validated dataclass.

The keys and their defaults are DeepSpeed's (`ds_config["sparse_attention"]`); which keys a
mode reads is fixed per mode, and a key the mode does not read is an error (DeepSpeed ignores
it silently, which hides typos). The layout each mode draws is in `sparse_layouts.py`.

A run reads the section from `--deepspeed_config` (every engine, not only DeepSpeed's, which
never gets it: `ds_config.build_ds_config`) and from the flags `--sparse-attention-mode`,
`--sparse-block` and `--sparse-attention-config` (a JSON object with the other keys), merged
key by key by `ds_config.merge_flags` (`sparse_section`) into `ModelConfig.sparse_attention`.

| key | modes | meaning (one unit = one `block` x `block` tile of the s x s score matrix) |
|---|---|---|
| mode | all | dense, fixed, variable, bigbird or bslongformer (default fixed) |
| block | all | tokens per block side (default 16) |
| different_layout_per_head | all | heads may differ (random draws; fixed's global pattern) |
| attention | not dense | "bidirectional" (default) or "unidirectional" (keys <= query only) |
| num_local_blocks | fixed | blocks per local window; windows tile the sequence (default 4) |
| num_global_blocks | fixed, bigbird | fixed: global blocks per window; bigbird: the first n blocks are global (default 1) |
| horizontal_global_attention | fixed, variable | global blocks also attend to every block (bidirectional only) |
| num_different_global_patterns | fixed | how many heads' choices of global block in a window (default 1) |
| num_random_blocks | variable, bigbird | random key blocks per query block row (default 0) |
| local_window_blocks | variable | sizes of the first windows; the last size repeats (default [4]) |
| global_block_indices | variable, bslongformer | global blocks (default [0]); with end indices: range starts |
| global_block_end_indices | variable, bslongformer | exclusive ends of the global ranges (default none) |
| num_sliding_window_blocks | bigbird, bslongformer | window width in blocks, centred on the query block (default 3) |
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from .ds_config import SPARSE_SECTION as SECTION, JsonKey, merge_flags

MODES = ("dense", "fixed", "variable", "bigbird", "bslongformer")
COMMON_KEYS = ("mode", "block", "different_layout_per_head")
MODE_KEYS = {
    "dense": (),
    "fixed": ("num_local_blocks", "num_global_blocks", "attention", "horizontal_global_attention",
              "num_different_global_patterns"),
    "variable": ("num_random_blocks", "local_window_blocks", "global_block_indices",
                 "global_block_end_indices", "attention", "horizontal_global_attention"),
    "bigbird": ("num_random_blocks", "num_sliding_window_blocks", "num_global_blocks", "attention"),
    "bslongformer": ("num_sliding_window_blocks", "global_block_indices",
                     "global_block_end_indices", "attention"),
}
DEFAULTS = {
    "num_local_blocks": 4, "num_global_blocks": 1, "attention": "bidirectional",
    "horizontal_global_attention": False, "num_different_global_patterns": 1,
    "num_random_blocks": 0, "local_window_blocks": (4,), "global_block_indices": (0,),
    "global_block_end_indices": None, "num_sliding_window_blocks": 3,
}
ATTENTION_TYPES = ("bidirectional", "unidirectional")
MIN_BLOCK = 16
FLAGS = {"mode": "--sparse-attention-mode", "block": "--sparse-block"}
CONFIG_FLAG = "--sparse-attention-config"


@dataclass(frozen=True)
class SparseAttentionConfig:
    """A block-sparsity pattern, by DeepSpeed's keys; see the module table for each key.

    Mode-specific fields left as None take DeepSpeed's default for the mode; a field set for a
    mode that does not read it is a ValueError. Lists become tuples (the config is hashable).
    """

    mode: str = "fixed"
    """Which pattern: dense, fixed, variable, bigbird or bslongformer."""
    block: int = 16
    """Tokens per block side; a power of two >= 16, so it tiles FlexAttention's 128-token kernel
    block or is tiled by it."""
    different_layout_per_head: bool = False
    """Draw each head's random blocks (and fixed's global pattern) separately."""
    num_local_blocks: int | None = None
    """fixed: blocks per local window."""
    num_global_blocks: int | None = None
    """fixed: global blocks per local window; bigbird: number of leading global blocks."""
    attention: str | None = None
    """"bidirectional" or "unidirectional" (a block attends to blocks at or before it only)."""
    horizontal_global_attention: bool | None = None
    """fixed, variable: global blocks also attend to all blocks (bidirectional only)."""
    num_different_global_patterns: int | None = None
    """fixed: number of different choices of global block within a window, cycled over heads."""
    num_random_blocks: int | None = None
    """variable, bigbird: random key blocks per query block row."""
    local_window_blocks: tuple[int, ...] | None = None
    """variable: sizes of the first local windows; the last size repeats to the end."""
    global_block_indices: tuple[int, ...] | None = None
    """variable, bslongformer: global blocks, or the starts of global ranges."""
    global_block_end_indices: tuple[int, ...] | None = None
    """variable, bslongformer: exclusive ends of the global ranges (None: single blocks)."""
    num_sliding_window_blocks: int | None = None
    """bigbird, bslongformer: window width in blocks, centred on the query block."""

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown sparse attention mode {self.mode!r}; choose one of "
                             f"{', '.join(MODES)}")
        _check_int("block", self.block, MIN_BLOCK)
        if self.block & (self.block - 1):
            raise ValueError(f"sparse attention block must be a power of two >= {MIN_BLOCK} "
                             f"(16, 32, 64, 128, ...), got {self.block}")
        _check_bool("different_layout_per_head", self.different_layout_per_head)
        used = MODE_KEYS[self.mode]
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in COMMON_KEYS:
                continue
            if f.name not in used:
                if value is not None:
                    raise ValueError(f"sparse attention key {f.name!r} is not read by mode "
                                     f"{self.mode!r} (it reads: {', '.join(COMMON_KEYS + used)})")
                continue
            if value is None:
                value = DEFAULTS[f.name]
            if isinstance(value, list):
                value = tuple(value)
            object.__setattr__(self, f.name, value)
        self._check_values()

    def _check_values(self) -> None:
        m = self.mode
        if m != "dense" and self.attention not in ATTENTION_TYPES:
            raise ValueError(f"sparse attention 'attention' must be one of {ATTENTION_TYPES}, "
                             f"got {self.attention!r}")
        if m in ("fixed", "variable"):
            _check_bool("horizontal_global_attention", self.horizontal_global_attention)
            if self.horizontal_global_attention and self.attention != "bidirectional":
                raise ValueError("sparse attention horizontal_global_attention needs "
                                 "attention='bidirectional'")
        if m == "fixed":
            _check_fixed(self)
        if m in ("variable", "bigbird"):
            _check_int("num_random_blocks", self.num_random_blocks, 0)
        if m in ("bigbird", "bslongformer"):
            _check_int("num_sliding_window_blocks", self.num_sliding_window_blocks, 1)
        if m == "bigbird":
            _check_int("num_global_blocks", self.num_global_blocks, 0)
        if m == "variable":
            _check_int_list("local_window_blocks", self.local_window_blocks, 1)
        if m in ("variable", "bslongformer"):
            _check_global_ranges(self.global_block_indices, self.global_block_end_indices)

    @classmethod
    def from_ds_config(cls, section: dict) -> "SparseAttentionConfig":
        """From a ds_config `sparse_attention` dict; an unknown key is named in a ValueError."""
        if not isinstance(section, dict):
            raise ValueError(f"ds_config 'sparse_attention' must be a JSON object, got "
                             f"{type(section).__name__}")
        mode = section.get("mode", "fixed")
        if mode not in MODES:
            raise ValueError(f"unknown sparse attention mode {mode!r}; choose one of "
                             f"{', '.join(MODES)}")
        known = COMMON_KEYS + MODE_KEYS[mode]
        unknown = [k for k in section if k not in known]
        if unknown:
            raise ValueError(f"ds_config sparse_attention (mode {mode!r}) has unknown key(s) "
                             f"{', '.join(map(repr, unknown))}; mode {mode!r} reads: "
                             f"{', '.join(known)}")
        return cls(**section)

    def to_ds_config(self) -> dict:
        """The keys this mode reads, with their values (JSON-ready; inverse of from_ds_config)."""
        out = {k: getattr(self, k) for k in COMMON_KEYS + MODE_KEYS[self.mode]}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


def _check_fixed(c: SparseAttentionConfig) -> None:
    _check_int("num_local_blocks", c.num_local_blocks, 1)
    _check_int("num_global_blocks", c.num_global_blocks, 1)
    _check_int("num_different_global_patterns", c.num_different_global_patterns, 1)
    if c.num_local_blocks % c.num_global_blocks:
        raise ValueError(f"sparse attention num_local_blocks ({c.num_local_blocks}) must be a "
                         f"multiple of num_global_blocks ({c.num_global_blocks})")
    most = c.num_local_blocks // c.num_global_blocks
    if c.num_different_global_patterns > most:
        raise ValueError(f"sparse attention num_different_global_patterns "
                         f"({c.num_different_global_patterns}) can be at most num_local_blocks / "
                         f"num_global_blocks = {most}")
    if c.num_different_global_patterns > 1 and not c.different_layout_per_head:
        raise ValueError("sparse attention num_different_global_patterns > 1 needs "
                         "different_layout_per_head=true")


def _check_global_ranges(starts, ends) -> None:
    _check_int_list("global_block_indices", starts, 0)
    if ends is None:
        return
    _check_int_list("global_block_end_indices", ends, 1)
    if len(ends) != len(starts):
        raise ValueError(f"sparse attention global_block_end_indices has {len(ends)} entries, "
                         f"global_block_indices {len(starts)}; give one end per start")
    for a, b in zip(starts, ends):
        if a >= b:
            raise ValueError(f"sparse attention global block range [{a}, {b}) is empty: each "
                             f"start must be below its end index")


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"sparse attention {name} must be an integer >= {minimum}, got {value!r}")


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"sparse attention {name} must be true or false, got {value!r}")


def _check_int_list(name: str, values, minimum: int) -> None:
    if not isinstance(values, (list, tuple)) or not values:
        raise ValueError(f"sparse attention {name} must be a non-empty list of integers, "
                         f"got {values!r}")
    for v in values:
        _check_int(f"{name} entry", v, minimum)


def add_sparse_flags(parser) -> None:
    group = parser.add_argument_group("sparse attention", "Block-sparse attention (DeepSpeed's "
                                      "sparse_attention keys; see README).")
    group.add_argument(FLAGS["mode"], dest="sparse__mode", default=None, metavar="MODE",
                       help="dense, fixed, variable, bigbird or bslongformer (default: the "
                       "--deepspeed_config section's, else dense)")
    group.add_argument(FLAGS["block"], dest="sparse__block", type=int, default=None, metavar="N",
                       help="tokens per block side, a power of two >= 16 (default: the "
                       "section's, else 16)")
    group.add_argument(CONFIG_FLAG, dest="sparse__config", default=None, metavar="JSON",
                       help="JSON object with the other sparse_attention keys (default: "
                       "none: the section's, else each mode's defaults)")


def sparse_section(ns, ds: dict, source: str) -> dict | None:
    """The merged `sparse_attention` section of the flags in `ns` and the ds_config `ds`
    (None: no sparse attention asked for)."""
    flags = _flag_section(ns)
    from_json = ds.get(SECTION)  # a JSON object: `read_ds_config` checked its type
    if not flags and from_json is None:
        return None
    keys = [JsonKey(k, (SECTION, k), _flag(ns, k)) for k in {**(from_json or {}), **flags}]
    return merge_flags(ds, flags, keys, source)


def _flag(ns, key: str) -> str:
    """The flag that gave `key`: its own, or the --sparse-attention-config object."""
    if key in FLAGS and getattr(ns, f"sparse__{key}", None) is not None:
        return FLAGS[key]
    return f"{CONFIG_FLAG}'s {key!r}"


def _flag_section(ns) -> dict:
    """--sparse-attention-config's object with --sparse-attention-mode / --sparse-block
    merged in (the same rule: a key both give must agree)."""
    config = {}
    raw = getattr(ns, "sparse__config", None)
    if raw is not None:
        try:
            config = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{CONFIG_FLAG} is not valid JSON: {exc}") from None
        if not isinstance(config, dict):
            raise ValueError(f"{CONFIG_FLAG} must be a JSON object, got {type(config).__name__}")
    given = {k: getattr(ns, f"sparse__{k}") for k in FLAGS
             if getattr(ns, f"sparse__{k}", None) is not None}
    merged = merge_flags({SECTION: config}, given,
                         [JsonKey(k, (SECTION, k), FLAGS[k]) for k in given], CONFIG_FLAG)
    return {**config, **merged}
