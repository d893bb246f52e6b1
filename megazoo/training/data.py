"""Data for a training run: tokenizer, train/valid datasets, checks, and batches per rank.

    data = build_data(args, state)                     # every rank, before training
    micro_batches = data.train_batch(iteration, state) # this dp rank's part of a global batch

Global batch `i` is training samples `[i * G, (i + 1) * G)` (G = --global-batch-size);
data-parallel rank r takes the r-th contiguous block of G / dp, cut into micro-batches. So
the position in the data is just the number of consumed samples, and resuming from a
checkpoint continues the same sample stream.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ..data import (GPTDatasetConfig, IndexedDataset, Tokenizer, build_tokenizer,
                    build_train_valid_test_datasets, parse_data_prefix)
from ..config.run import PretrainArgs
from ..data.indexed import data_file_paths
from ..data.provenance import check_tokenizer_record
from ..errors import user_path
from ..parallel.state import ParallelState
from .default_corpus import prepare_default_corpus

ENTROPY_MAX_TOKENS = 50_000_000


def check_vocabulary(prefixes: list[str], tokenizer: Tokenizer, model_vocab: int) -> None:
    """ValueError when a data file was made with another tokenizer (its record says so) or
    holds ids the tokenizer (or the model) cannot have."""
    for prefix in prefixes:
        check_tokenizer_record(prefix, tokenizer)
        ds = IndexedDataset(prefix)
        if ds.num_tokens == 0:
            raise ValueError(f"dataset {prefix} holds no tokens; rebuild it with "
                             "tools/preprocess_data.py")
        top = int(_tokens(prefix, ds.dtype).max())
        limit = min(tokenizer.vocab_size, model_vocab)
        if top >= limit:
            raise ValueError(f"dataset {prefix} holds token id {top} but the tokenizer has "
                             f"{tokenizer.vocab_size} ids and the model {model_vocab}: pass the "
                             "--tokenizer-type/--tokenizer-model the data was made with")


def _tokens(prefix: str, dtype) -> np.ndarray:
    _, bin_path = data_file_paths(prefix)
    return np.memmap(bin_path, dtype=dtype, mode="r")


def unigram_entropy(prefixes: list[str], vocab_size: int) -> float:
    """Entropy (nats/token) of the token frequencies of the datasets (first 50 M tokens each)."""
    counts = np.zeros(vocab_size, dtype=np.float64)
    for prefix in prefixes:
        tokens = _tokens(prefix, IndexedDataset(prefix).dtype)[:ENTROPY_MAX_TOKENS]
        counts += np.bincount(tokens.astype(np.int64), minlength=vocab_size)[:vocab_size]
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


@dataclass
class TrainData:
    """Tokenizer and datasets of a run, and how a global batch is cut for one rank."""

    tokenizer: Tokenizer
    train: object
    valid: object | None
    prefixes: list[str]
    micro_batch_size: int
    global_batch_size: int
    device: torch.device = torch.device("cpu")
    """Where the micro-batches go (the model's device)."""

    def micro_batches(self, state: ParallelState) -> int:
        """How many micro-batches a global batch gives this rank (`_batch`'s cut)."""
        return self.global_batch_size // state.dp.size // self.micro_batch_size

    def _batch(self, dataset, start: int, state: ParallelState) -> list[dict]:
        per_rank = self.global_batch_size // state.dp.size
        first = start + state.dp.rank * per_rank
        rows = np.stack([dataset[first + i] for i in range(per_rank)])
        tokens = torch.from_numpy(rows[:, :-1].astype(np.int64)).to(self.device)  # [per_rank, s]
        return [{"input_ids": mb, "labels": mb} for mb in tokens.split(self.micro_batch_size)]

    def train_batch(self, iteration: int, state: ParallelState) -> list[dict]:
        """Micro-batches of global batch `iteration` (0-based) for this dp rank.

        Labels are the inputs (the model shifts them): a sample of s + 1 tokens is cut to
        its first s, and the model learns token t+1 from tokens <= t inside them.
        """
        return self._batch(self.train, iteration * self.global_batch_size, state)

    def valid_batch(self, index: int, state: ParallelState) -> list[dict]:
        return self._batch(self.valid, index * self.global_batch_size, state)


def resolve_data_source(args: PretrainArgs, state: ParallelState, log) -> None:
    """Fill data_path / tokenizer flags for the default run (rank 0 prepares, others wait)."""
    d = args.data
    if d.data_path is not None:
        return

    def prepare():
        with user_path("--data-cache-path", d.data_cache_path):  # where the corpus is written
            return prepare_default_corpus(d.data_cache_path, d.default_corpus_mb,
                                          d.default_vocab_size, log)

    if state.global_rank == 0:
        prepare()
    if state.world_size > 1:
        dist.barrier()
    prefix, model = prepare()
    d.data_path, d.tokenizer_type, d.tokenizer_model = [prefix], "SentencePieceTokenizer", model


def build_data(args: PretrainArgs, state: ParallelState) -> TrainData:
    """Tokenizer, checked data files and the train / valid datasets of this run."""
    d, t = args.data, args.training
    tokenizer = build_tokenizer(d.tokenizer_type, d.tokenizer_model)
    args.model = dataclasses.replace(args.model, vocab_size=tokenizer.vocab_size)
    prefixes = [p for _, p in parse_data_prefix(d.data_path)]
    check_vocabulary(prefixes, tokenizer, args.model.padded_vocab(state.tp.size))
    config = GPTDatasetConfig(seq_length=d.seq_length, seed=t.seed, split=d.split)
    batch = t.global_batch_size
    samples = (t.train_iters * batch, args.logging.eval_iters * batch, 0)
    train, valid, _ = build_train_valid_test_datasets(d.data_path, samples, config)
    if train is None:
        raise ValueError(f"--split {d.split} leaves no training documents: give train a share")
    return TrainData(tokenizer, train, valid, prefixes, t.micro_batch_size, t.global_batch_size)


def tokens_per_step(args: PretrainArgs) -> int:
    """Tokens in one global batch (one iteration)."""
    return args.training.global_batch_size * args.data.seq_length
