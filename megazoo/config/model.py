"""`ModelConfig`: one dataclass describing GPT, BLOOM and LLaMA models.

The three families share one transformer block and differ only by these fields. Fields left
as None take the family's default (`FAMILY_DEFAULTS`), so
`ModelConfig(family="bloom", num_layers=2, hidden_size=64, num_attention_heads=8,
vocab_size=1000, max_position_embeddings=128)` is a complete BLOOM.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from .precision import FP8Recipe
from .sparse_attention import SparseAttentionConfig

_GPT = dict(position_embedding="learned", norm="layernorm", activation="gelu",
            embedding_layernorm=False, tie_word_embeddings=True, qkv_bias=True,
            dense_bias=True, mlp_bias=True, norm_eps=1e-5)
# Per-family defaults of the fields that are None unless given (BLOOM: GPT with ALiBi and an
# embedding LayerNorm).
FAMILY_DEFAULTS = {
    "gpt": _GPT,
    "bloom": {**_GPT, "position_embedding": "alibi", "embedding_layernorm": True},
    "llama": dict(position_embedding="rope", norm="rmsnorm", activation="swiglu",
                  embedding_layernorm=False, tie_word_embeddings=False, qkv_bias=False,
                  dense_bias=False, mlp_bias=False, norm_eps=1e-5),
}
RECOMPUTE = ("none", "full", "selective")
# Fields that take one of a few values.
CHOICES = {"position_embedding": ("learned", "alibi", "rope"), "norm": ("layernorm", "rmsnorm"),
           "activation": ("gelu", "gelu_exact", "swiglu"), "recompute": RECOMPUTE,
           "fp8_layers": ("all", "mlp")}


@dataclass
class ModelConfig:
    """Shape and conventions of a decoder-only transformer (GPT, BLOOM or LLaMA family)."""

    family: str = "gpt"
    """Model family, "gpt", "bloom" or "llama": picks the defaults of the None fields."""
    num_layers: int = 2
    """Number of transformer blocks."""
    hidden_size: int = 64
    """Width of the residual stream, h."""
    num_attention_heads: int = 8
    """Query heads; hidden_size must divide by it."""
    num_key_value_heads: int | None = None
    """Key/value heads (grouped-query attention); None means num_attention_heads (MHA)."""
    ffn_hidden_size: int | None = None
    """MLP inner width; None means 4h (gelu) or LLaMA's round_up(8h/3, 256) (swiglu)."""
    vocab_size: int = 1000
    """Real vocabulary size (the tokenizer's); the embedding is padded past it."""
    max_position_embeddings: int = 2048
    """Longest sequence; the size of the learned position table (GPT)."""
    make_vocab_size_divisible_by: int = 128
    """Megatron padding: the embedding has round_up(vocab, this * tp) rows."""
    padded_vocab_size: int | None = None
    """Explicit padded vocabulary, the same at every tp (must divide by tp); overrides the rule."""
    position_embedding: str | None = None
    """"learned" (GPT), "alibi" (BLOOM) or "rope" (LLaMA)."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    norm: str | None = None
    """"layernorm" or "rmsnorm"."""
    norm_eps: float | None = None
    """Epsilon of every norm."""
    activation: str | None = None
    """"gelu" (tanh approximation), "gelu_exact" or "swiglu"."""
    embedding_layernorm: bool | None = None
    """A LayerNorm right after the word embedding (BLOOM's word_embeddings_layernorm)."""
    tie_word_embeddings: bool | None = None
    """The output head reuses the input embedding matrix."""
    qkv_bias: bool | None = None
    """Bias on the query/key/value projection."""
    dense_bias: bool | None = None
    """Bias on the attention output projection."""
    mlp_bias: bool | None = None
    """Biases on both MLP projections."""
    init_std: float = 0.02
    """Standard deviation of the normal init of every weight matrix."""
    scaled_output_init: bool = True
    """GPT-2 init: output projections (attention dense, MLP fc2) use init_std / sqrt(2 * L)."""
    hidden_dropout: float = 0.0
    """Dropout on the embedding output and on each sublayer output before the residual add."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    recompute: str = "none"
    """Activation recompute: "none", "full" (whole block) or "selective" (attention core)."""
    recompute_num_layers: int | None = None
    """Recompute the first N blocks of each model chunk; None means all of them."""
    attention_backend: str = "auto"
    """Passed to ParallelAttention ("auto" picks the best available)."""
    bias_gelu_fusion: bool = True
    """GELU MLPs on CUDA in bf16 / fp16: fc1's bias and GELU, and GELU's derivative, run
    inside the GEMMs (cuBLASLt epilogues); off: separate kernels."""
    sparse_attention: dict | None = None
    """Block-sparse attention: a ds_config `sparse_attention` section (`sparse_attention.py`),
    kept as a plain dict so the config stays JSON (checkpoints); None: dense attention."""
    fp8_format: str | None = None
    """FP8 GEMMs, compute only (weights stay in the model dtype): "e4m3", or "hybrid" (e5m2
    gradients); None: off."""
    fp8_recipe: str = "tensorwise"
    """FP8 scaling: "tensorwise" (one scale per tensor) or "rowwise" (one per row)."""
    fp8_layers: str = "all"
    """Linears that run FP8: "all" (attention qkv / dense and MLP) or "mlp" (MLP only)."""

    def __post_init__(self) -> None:
        if self.family not in FAMILY_DEFAULTS:
            raise ValueError(f"family must be one of {sorted(FAMILY_DEFAULTS)}, got {self.family!r}")
        for name, value in FAMILY_DEFAULTS[self.family].items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = _default_ffn(self.hidden_size, self.activation)
        self._validate()

    def _validate(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                     "ffn_hidden_size", "vocab_size", "max_position_embeddings",
                     "make_vocab_size_divisible_by"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must divide by num_attention_heads "
                             f"{self.num_attention_heads}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} must be a multiple "
                             f"of num_key_value_heads {self.num_key_value_heads}")
        for name, choices in CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        if self.recompute_num_layers is not None and self.recompute_num_layers < 0:
            raise ValueError(f"recompute_num_layers must be >= 0 or None, got {self.recompute_num_layers}")
        if self.padded_vocab_size is not None and self.padded_vocab_size < self.vocab_size:
            raise ValueError(f"padded_vocab_size {self.padded_vocab_size} is smaller than "
                             f"vocab_size {self.vocab_size}")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.norm_eps <= 0 or self.init_std <= 0 or self.rope_theta <= 0:
            raise ValueError("norm_eps, init_std and rope_theta must be positive")
        self._sparse = None  # the section parsed once (replace() builds a new config)
        if self.sparse_attention is not None:
            self._sparse = SparseAttentionConfig.from_ds_config(dict(self.sparse_attention))
            self.sparse_attention = self._sparse.to_ds_config()  # validated, normalised
            if self.attention_dropout > 0:
                raise ValueError(f"attention_dropout {self.attention_dropout} is not supported "
                                 f"with sparse attention: set it to 0")
        FP8Recipe(self.fp8_format or "e4m3", self.fp8_recipe)  # its one-line errors

    @property
    def sparse(self) -> SparseAttentionConfig | None:
        """The sparse attention pattern (None: dense attention), parsed in __post_init__."""
        return self._sparse

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def padded_vocab(self, tp: int = 1) -> int:
        """Rows of the embedding / output head at tensor-parallel size `tp`."""
        if self.padded_vocab_size is not None:
            if self.padded_vocab_size % tp:
                raise ValueError(f"padded_vocab_size {self.padded_vocab_size} does not divide by "
                                 f"tp={tp}: change padded_vocab_size or tp")
            return self.padded_vocab_size
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    def fp8(self, layer: str = "mlp") -> FP8Recipe | None:
        """The FP8Recipe of the linears of `layer` ("attention" or "mlp"), or None where
        they run in the model dtype (fp8_format None, or attention with fp8_layers "mlp")."""
        if self.fp8_format is None or (layer == "attention" and self.fp8_layers == "mlp"):
            return None
        return FP8Recipe(self.fp8_format, self.fp8_recipe)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _default_ffn(hidden: int, activation: str) -> int:
    if activation == "swiglu":  # LLaMA: 2/3 of 4h, rounded up to a multiple of 256
        return -(-(8 * hidden // 3) // 256) * 256
    return 4 * hidden
