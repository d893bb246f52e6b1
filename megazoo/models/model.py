"""`TransformerModel`: GPT, BLOOM and LLaMA as one model, whole or as one pipeline stage.

A model object holds the blocks of one or more layer ranges (a pipeline stage, or its
virtual chunks), plus the embedding when `pre_process` and the final norm and head when
`post_process`. Blocks live in `layers` keyed by their global index, so parameter names are
the names of the one-process model (`layers.17.mlp.fc1.weight`) whatever the layout.

forward, for chunk c of this object:
- input: token ids `[b, s]` (full, the same on every tp/sp rank) when c is the first chunk
  and pre_process; otherwise `hidden_states [s_local, b, h]` from the previous stage.
- output: `hidden_states [s_local, b, h]` unless c is the last chunk and post_process;
  then the mean token loss if `labels` are given (Hugging Face convention: labels are the
  input ids, the model shifts them; -100 is ignored), else the full logits `[b, s, vocab]`.

Dropout masks come from torch's global generator and are not layout-independent (no
Megatron-style RNG tracker yet); layouts agree exactly only with dropout 0 (the default).
"""
from __future__ import annotations

import torch
from torch import nn

from ..config.model import ModelConfig
from ..layers import NormalInit, set_tp_layout
from ..layers.norm import build_norm
from ..parallel.state import ParallelState
from .block import TransformerBlock
from .parts import (WORD_EMBEDDINGS, Embedding, OutputLayer, check_sequence_length, full_logits,
                    lm_logits, mean_token_loss, sequence_shard, ulysses_window)

LayerSpec = range | list[range] | None


def layer_chunks(layers: LayerSpec, num_layers: int) -> list[range]:
    """Normalise `layers` (None: all; a range; a list of ranges) and validate it."""
    chunks = [range(num_layers)] if layers is None else [layers] if isinstance(layers, range) else list(layers)
    seen: set[int] = set()
    for chunk in chunks:
        if not isinstance(chunk, range) or chunk.step != 1 or len(chunk) == 0:
            raise ValueError(f"layer chunks must be non-empty ranges with step 1, got {chunk!r}")
        if chunk.start < 0 or chunk.stop > num_layers:
            raise ValueError(f"layer range {chunk} is outside the model's {num_layers} layers")
        if seen & set(chunk):
            raise ValueError(f"layer ranges {chunks} overlap")
        seen |= set(chunk)
    return chunks


class TransformerModel(nn.Module):
    """A decoder-only transformer (or a pipeline stage of one); see the module docstring."""

    family: str | None = None  # set by GPTModel / BloomModel / LlamaModel below
    check_inputs: bool = True
    """Check token ids and labels against the vocabulary before use (a clear error instead of a
    device-side assert), at the cost of a device sync per forward. Training turns it off: its
    data was checked when the run started, and a sync per micro-batch starves the GPU."""

    def __init__(self, config: ModelConfig, state: ParallelState | None = None, *,
                 layers: LayerSpec = None, pre_process: bool = True, post_process: bool = True,
                 seed: int = 0, device=None, dtype=None):
        super().__init__()
        if self.family is not None and config.family != self.family:
            raise ValueError(f"{type(self).__name__} needs family={self.family!r}, got "
                             f"{config.family!r}: use build_model or the matching class")
        self.config, self.state = config, state or ParallelState.single()
        self.chunks = layer_chunks(layers, config.num_layers)
        self.pre_process, self.post_process = pre_process, post_process
        factory = dict(device=device, dtype=dtype)
        self.embedding = Embedding(config, self.state, seed=seed, **factory) if pre_process else None
        self.layers = nn.ModuleDict({
            str(i): TransformerBlock(config, self.state, i, seed=seed, **factory)
            for chunk in self.chunks for i in chunk})
        self.final_norm = self.output_layer = None
        if post_process:
            self.final_norm = build_norm(config.norm, config.hidden_size, config.norm_eps,
                                         sequence_parallel=self.state.config.megatron_sp,
                                         **factory)
            self.output_layer = self._build_head(seed, factory)
        self.set_recompute(config.recompute, config.recompute_num_layers)

    def _build_head(self, seed: int, factory: dict) -> OutputLayer | None:
        """Untied: a column-parallel [V_pad, h] matrix. Tied: None when this object holds the
        embedding; else (last pipeline stage) a copy of it, tagged `tied_to`."""
        cfg, tied = self.config, self.config.tie_word_embeddings
        if tied and self.pre_process:
            return None
        key = WORD_EMBEDDINGS if tied else "output_layer.weight"
        head = OutputLayer(cfg.hidden_size, cfg.padded_vocab(self.state.tp.size),
                           group=self.state.tp, bias=False,
                           sequence_parallel=self.state.config.megatron_sp,
                           init_method=NormalInit(cfg.init_std, seed, key), **factory)
        set_tp_layout(head.weight, 0, unpadded=cfg.vocab_size)
        head.weight.tied_to = WORD_EMBEDDINGS if tied else None
        return head

    def set_recompute(self, mode: str, num_layers: int | None = None) -> None:
        """Recompute ("none" | "full" | "selective") the first `num_layers` blocks of each
        chunk (None: all), the others "none" (Megatron's "block" method)."""
        for chunk in self.chunks:
            count = len(chunk) if num_layers is None else min(num_layers, len(chunk))
            for i in chunk:
                self.layers[str(i)].set_recompute(mode if i - chunk.start < count else "none")

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [s_local, b, h] after the final norm -> logits_shard [s_sp, b, V_pad/tp]: the
        untied head as a module call (the hooks that wait for its weight run), or the tied
        embedding's weight (`lm_logits`)."""
        if self.output_layer is None:
            return lm_logits(x, self.head_weight(), self.state)
        return self.output_layer(x)

    def head_weight(self) -> torch.Tensor:
        """The vocab-sharded [V_pad/tp, h] matrix of the output head."""
        if self.output_layer is None:
            return self.embedding.word_embeddings.weight
        return self.output_layer.weight

    def activation_shape(self, batch: int, seq: int) -> tuple[int, int, int]:
        """[s_local, b, h] of the hidden states one pipeline stage sends to the next, for
        ids [batch, seq] (the pipeline executor asks the model; it knows how it cuts the
        sequence)."""
        return (seq // sequence_shard(self.state), batch, self.config.hidden_size)

    def _check_positions(self, seq_len: int) -> None:
        """ValueError when a learned position table is shorter than the sequence."""
        if self.config.position_embedding == "learned" \
                and seq_len > self.config.max_position_embeddings:
            raise ValueError(f"sequence of {seq_len} tokens exceeds max_position_embeddings "
                             f"{self.config.max_position_embeddings}")

    def forward(self, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                *, hidden_states: torch.Tensor | None = None, chunk: int = 0):
        """See the module docstring. ids/labels [b, s]; hidden_states [s_local, b, h]."""
        if not 0 <= chunk < len(self.chunks):
            raise ValueError(f"chunk {chunk} out of range: this model has {len(self.chunks)} chunks")
        first, last = chunk == 0 and self.pre_process, chunk == len(self.chunks) - 1 and self.post_process
        if first:
            if input_ids is None:
                raise ValueError("the first chunk of the first stage needs input_ids [b, s]")
            check_sequence_length(input_ids.shape[1], self.state)
            window = ulysses_window(input_ids.shape[1], self.state)
            if isinstance(window, slice):
                first = window.start
            else:  # cp: the rank's tokens are not contiguous, their positions go along
                self._check_positions(input_ids.shape[1])
                first, window = window, window.to(input_ids.device)
            x = self.embedding(input_ids[:, window], first, self.check_inputs)
        elif hidden_states is None:
            raise ValueError("a chunk without the embedding needs hidden_states [s_local, b, h]; "
                             "to run ids through every pipeline stage, call "
                             "megazoo.pipeline.forward(model, ids, state)")
        else:
            x = hidden_states
        for i in self.chunks[chunk]:
            x = self.layers[str(i)](x)
        if not last:
            return x
        logits_shard = self.logits(self.final_norm(x))
        if labels is not None:
            return mean_token_loss(logits_shard, labels, self.config.vocab_size, self.state,
                                   self.check_inputs)
        return full_logits(logits_shard, self.config.vocab_size, self.state)


class GPTModel(TransformerModel):
    """GPT-2/GPT-3: learned positions, LayerNorm, GeLU MLP, biases, tied embeddings."""

    family = "gpt"


class BloomModel(TransformerModel):
    """BLOOM: ALiBi positions, an embedding LayerNorm, GeLU MLP, biases, tied embeddings."""

    family = "bloom"


class LlamaModel(TransformerModel):
    """LLaMA: RoPE, RMSNorm, SwiGLU MLP, no biases, untied head, grouped-query attention."""

    family = "llama"
