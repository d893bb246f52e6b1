"""A model against a parallel layout: pure arithmetic, no process, no layer.

`check_layout` is the one check of a `ModelConfig` against a `ParallelConfig`: `build_model`,
the run's flags (`validate.check_args`) and the memory planner all apply it, so a layout one
of them accepts is one the others accept. Its pieces (heads over tp and sp, the sequence's
shards, each pipeline rank's layers) are the rules the layers and models split the work by.
"""
from __future__ import annotations

import math

from ..parallel.config import ParallelConfig
from .model import ModelConfig


def split_groups(groups: int, per_group: int, n: int, what: str) -> tuple[int, int]:
    """Split `groups` groups of `per_group` query heads over n ranks -> (groups, q per group):
    whole groups when n divides them, else each group replicated over n / groups ranks."""
    if groups % n == 0:
        return groups // n, per_group
    if n % groups == 0 and per_group % (n // groups) == 0:
        return 1, per_group // (n // groups)
    raise ValueError(f"{what}: {groups} kv heads cannot be split over {n} ranks nor replicated "
                     f"evenly; choose a number of kv heads that divides {n} or is a multiple of it")


def check_heads(heads: int, kv_heads: int, head_dim: int, tp: int = 1, sp: int = 1) -> None:
    """ValueError unless `heads` query heads in groups over `kv_heads` split over tp x sp."""
    if min(heads, kv_heads, head_dim, tp, sp) < 1 or heads % kv_heads != 0:
        raise ValueError(f"num_heads ({heads}) must be a positive multiple of num_kv_heads "
                         f"({kv_heads}), head_dim, tp and sp positive")
    if heads % (tp * sp) != 0:
        raise ValueError(f"num_heads ({heads}) is not divisible by tp*sp = {tp}*{sp}: "
                         f"choose tp and sp whose product divides the number of heads")
    kl, gl = split_groups(kv_heads, heads // kv_heads, tp, "tensor parallelism")
    split_groups(kl, gl, sp, f"Ulysses over the kv heads of one tp rank ({kl})")


def sequence_pieces(tp: int, sp: int, megatron_sp: bool, cp: int = 1) -> int:
    """How many shards the sequence is cut into: cp times sp, times tp under Megatron SP."""
    return cp * sp * (tp if megatron_sp else 1)


def sequence_multiple(tp: int, sp: int, megatron_sp: bool, cp: int = 1) -> int:
    """What a sequence length must divide by: `sequence_pieces`, and with context parallelism
    2 cp chunks whose pairs split into the other pieces."""
    pieces = sequence_pieces(tp, sp, megatron_sp)
    return pieces if cp == 1 else cp * math.lcm(2, pieces)


def context_parallel_chunks(seq_len: int, cp: int, cp_rank: int) -> tuple[range, range]:
    """The two global position ranges context-parallel rank `cp_rank` holds: chunks cp_rank
    and 2 cp - 1 - cp_rank of 2 cp equal chunks, so that under a causal mask every rank has
    the same work (an early chunk sees few keys, its mirror many). cp = 1: the whole sequence
    (as two halves)."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} must divide by 2*cp = {2 * cp} (context "
                         f"parallelism cuts it into 2 cp chunks): pad the batch to a multiple "
                         f"of it or change --context-parallel-size")
    c = seq_len // (2 * cp)
    mirror = 2 * cp - 1 - cp_rank
    return range(cp_rank * c, (cp_rank + 1) * c), range(mirror * c, (mirror + 1) * c)


def check_sequence_split(seq_len: int, tp: int, sp: int, megatron_sp: bool, cp: int = 1) -> None:
    """ValueError unless `seq_len` splits into `sequence_pieces` equal shards (and, with
    context parallelism, 2 cp chunks whose pairs split over the rest)."""
    if cp > 1:
        context_parallel_chunks(seq_len, cp, 0)
        need = sequence_multiple(tp, sp, megatron_sp, cp)
        if seq_len % need:
            raise ValueError(f"sequence length {seq_len} must divide by {need} (cp={cp} x Ulysses "
                             f"sp={sp}" + (f" x Megatron SP tp={tp}" if megatron_sp else "")
                             + "): pad the batch to a multiple of it or change the layout")
        return
    pieces = sequence_pieces(tp, sp, megatron_sp)
    if seq_len % pieces:
        raise ValueError(f"sequence length {seq_len} must divide by {pieces} (Ulysses sp={sp}"
                         + (f" x Megatron SP tp={tp}" if megatron_sp else "")
                         + "): pad the batch to a multiple of it or change the layout")


def layer_ranges(num_layers: int, pp: int, vpp: int, pp_rank: int) -> list[range]:
    """The layers of pipeline rank `pp_rank`: chunk c holds block c*pp + pp_rank of the
    model cut into pp*vpp equal blocks (Megatron's interleaved assignment)."""
    blocks = pp * vpp
    if num_layers % blocks:
        raise ValueError(f"num_layers {num_layers} must divide by pp*vpp = {blocks} "
                         f"(pp={pp}, vpp={vpp}): change the layout or the model")
    per = num_layers // blocks
    return [range((c * pp + pp_rank) * per, (c * pp + pp_rank + 1) * per) for c in range(vpp)]


def check_layout(config: ModelConfig, parallel: ParallelConfig,
                 seq_length: int | None = None) -> None:
    """Raise a ValueError unless `config` can be laid out as `parallel`: attention heads and
    kv heads over tp x sp, the MLP width over tp, layers over pp x vpp, the padded vocabulary
    over tp, and, given a `seq_length`, the sequence over the shards of Ulysses / Megatron SP
    and the learned position table."""
    tp = parallel.tp
    check_heads(config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                tp, parallel.sp)
    if config.ffn_hidden_size % tp:
        raise ValueError(f"ffn_hidden_size over tp={tp} ({config.ffn_hidden_size}) is not "
                         f"divisible by {tp}; choose sizes so that it divides")
    layer_ranges(config.num_layers, parallel.pp, parallel.vpp, 0)
    config.padded_vocab(tp)
    check_context_parallel(config, parallel.cp)
    if seq_length is None:
        return
    check_sequence_split(seq_length, tp, parallel.sp, parallel.megatron_sp, parallel.cp)
    if config.position_embedding == "learned" and seq_length > config.max_position_embeddings:
        raise ValueError(f"--seq-length {seq_length} exceeds --max-position-embeddings "
                         f"{config.max_position_embeddings}")


def check_context_parallel(config: ModelConfig, cp: int) -> None:
    """ValueError for what ring attention does not compute: block-sparse layouts and attention
    dropout (one mask per key block would not match the one-process mask)."""
    if cp == 1:
        return
    if getattr(config, "sparse", None) is not None:
        raise ValueError(f"--context-parallel-size {cp} does not combine with sparse attention: "
                         f"use dense attention or --context-parallel-size 1")
    if config.attention_dropout > 0:
        raise ValueError(f"--context-parallel-size {cp} needs --attention-dropout 0 (got "
                         f"{config.attention_dropout})")
