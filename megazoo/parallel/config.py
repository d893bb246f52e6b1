"""`ParallelConfig`: the sizes of the parallel grid, validated before any process group exists.

Two kinds of sequence parallelism, named apart everywhere: `sp` (and `state.sp`) is Ulysses,
ranks of their own that split the sequence and trade it for heads inside attention;
`megatron_sp` is Megatron's sequence parallelism, which splits the activations outside
attention and the MLP over the tp ranks (its flag keeps Megatron's name,
`--sequence-parallel`, and `ParallelConfig(sequence_parallel=True)` still means it).
A third split of the sequence, `cp` (context parallelism, `--context-parallel-size`), cuts it
into 2 cp chunks and gives rank i chunks i and 2 cp - 1 - i; attention passes key/value chunks
around a ring of the cp ranks (layers/ring_attention.py). Ulysses and Megatron SP then split
a cp rank's tokens as they would split a whole sequence.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

DIMS = ("tp", "sp", "cp", "dp", "pp")
# The default order; cp, left out, goes right after sp (`grid_order`): tp, sp, cp, dp, pp.
DEFAULT_ORDER = ("tp", "sp", "dp", "pp")


@dataclass(frozen=True, init=False)
class ParallelConfig:
    """How the world of ranks is split. Every size is validated here, before any collective."""

    tp: int = 1
    """Tensor-parallel size: ranks that split each weight matrix (Megatron column/row split)."""
    sp: int = 1
    """Ulysses sequence-parallel size: ranks that split the sequence, all-to-all inside attention."""
    cp: int = 1
    """Context-parallel size: ranks that split the sequence into mirrored chunk pairs and pass
    key/value chunks around a ring in attention (ring attention)."""
    pp: int = 1
    """Pipeline-parallel size: ranks that hold consecutive ranges of layers."""
    vpp: int = 1
    """Virtual pipeline stages (model chunks) per pipeline rank, for the interleaved schedule."""
    dp: int | None = None
    """Data-parallel size; None derives it as world_size // (tp * sp * cp * pp)."""
    megatron_sp: bool = False
    """Megatron sequence parallelism: activations outside attention/MLP are split over tp."""
    order: tuple[str, ...] = field(default=DEFAULT_ORDER)
    """Rank order, innermost (adjacent ranks) first. The default tp, sp, dp, pp (cp, left out,
    goes right after sp) keeps TP in a node, then Ulysses' all-to-alls, then the ring."""

    def __init__(self, tp: int = 1, sp: int = 1, pp: int = 1, vpp: int = 1, dp: int | None = None,
                 megatron_sp: bool = False, order: tuple[str, ...] | str = DEFAULT_ORDER, *,
                 sequence_parallel: bool | None = None, cp: int = 1):
        """The fields, plus `sequence_parallel`: Megatron's name for `megatron_sp`."""
        if sequence_parallel is not None:
            if megatron_sp and not sequence_parallel:
                raise ValueError("megatron_sp=True and sequence_parallel=False disagree: "
                                 "pass one of them (they name the same setting)")
            megatron_sp = sequence_parallel
        for name, value in (("tp", tp), ("sp", sp), ("cp", cp), ("pp", pp), ("vpp", vpp), ("dp", dp),
                            ("megatron_sp", megatron_sp), ("order", order)):
            object.__setattr__(self, name, value)
        self.__post_init__()

    @property
    def sequence_parallel(self) -> bool:
        """Megatron's name for `megatron_sp`."""
        return self.megatron_sp

    def __post_init__(self) -> None:
        for name in ("tp", "sp", "cp", "pp", "vpp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.dp is not None and (not isinstance(self.dp, int) or self.dp < 1):
            raise ValueError(f"dp must be a positive integer or None (derived), got {self.dp!r}")
        if isinstance(self.order, str):
            object.__setattr__(self, "order", tuple(self.order.replace(",", "-").split("-")))
        if sorted(self.grid_order) != sorted(DIMS):
            raise ValueError(f"order must be a permutation of {'-'.join(DIMS)} (cp may be left "
                             f"out), got {'-'.join(self.order)}")
        if self.vpp > 1 and self.pp == 1:
            raise ValueError(f"vpp={self.vpp} needs pipeline parallelism: set pp > 1 or vpp = 1")

    @property
    def grid_order(self) -> tuple[str, ...]:
        """`order` with every dimension: an order without cp places it right after sp."""
        if "cp" in self.order or "sp" not in self.order:
            return self.order
        at = self.order.index("sp") + 1
        return self.order[:at] + ("cp",) + self.order[at:]

    def resolve(self, world_size: int) -> "ParallelConfig":
        """Return a copy with dp derived from `world_size`; raise if the sizes do not fit it."""
        mp = self.tp * self.sp * self.cp * self.pp  # ranks that together hold one replica
        product = "tp*sp*cp*pp" if self.cp > 1 else "tp*sp*pp"
        if world_size % mp != 0:
            cp = f", cp={self.cp}" if self.cp > 1 else ""
            raise ValueError(
                f"world size {world_size} is not divisible by {product} = {mp} "
                f"(tp={self.tp}, sp={self.sp}{cp}, pp={self.pp}): change the sizes or the number "
                f"of ranks")
        dp = world_size // mp
        if self.dp is not None and self.dp != dp:
            raise ValueError(
                f"dp={self.dp} does not fit: world size {world_size} with {product} = {mp} "
                f"leaves dp = {dp}; pass dp={dp} or dp=None")
        return replace(self, dp=dp)

    def sizes(self) -> dict[str, int]:
        """Size of each dimension (dp must be resolved)."""
        if self.dp is None:
            raise ValueError("dp is not resolved yet: call config.resolve(world_size) first")
        return {"tp": self.tp, "sp": self.sp, "cp": self.cp, "dp": self.dp, "pp": self.pp}

    def __str__(self) -> str:
        dp = "?" if self.dp is None else self.dp
        cp = f"-CP{self.cp}" if self.cp > 1 else ""
        return f"TP{self.tp}-SP{self.sp}{cp}-PP{self.pp}-DP{dp}"
