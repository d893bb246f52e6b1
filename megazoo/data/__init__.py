"""Data pipeline: tokenizers, memory-mapped token files, GPT samples and blending.

Typical use::

    from megazoo.data import GPTDatasetConfig, build_train_valid_test_datasets
    cfg = GPTDatasetConfig(seq_length=2048, seed=1234, split="969,30,1")
    train, valid, test = build_train_valid_test_datasets(
        ["0.3", "data/web_text_document", "0.7", "data/books_text_document"],
        num_samples=(1_000_000, 10_000, 1_000), config=cfg)
    tokens = train[0]            # int64 [seq_length + 1]; inputs tokens[:-1], labels tokens[1:]

Files are written by ``tools/preprocess_data.py``. Nothing here imports torch; the
optional C++ index helpers are built lazily (see :mod:`megazoo.data.helpers`).
"""

from megazoo.data.blended import BlendedDataset, build_train_valid_test_datasets
from megazoo.data.gpt_dataset import GPTDataset, GPTDatasetConfig
from megazoo.data.helpers import backend, build_blending_indices, build_sample_idx
from megazoo.data.indexed import IndexedDataset, IndexedDatasetBuilder, best_dtype
from megazoo.data.splits import parse_data_prefix, parse_split, split_ranges
from megazoo.data.tokenizer import (ByteLevelTokenizer, HFTokenizer, SentencePieceTokenizer,
                                    Tokenizer, build_tokenizer, train_sentencepiece)

__all__ = [
    "BlendedDataset", "ByteLevelTokenizer", "GPTDataset", "GPTDatasetConfig",
    "HFTokenizer", "IndexedDataset", "IndexedDatasetBuilder", "SentencePieceTokenizer",
    "Tokenizer", "backend", "best_dtype", "build_blending_indices", "build_sample_idx",
    "build_tokenizer", "build_train_valid_test_datasets", "parse_data_prefix", "parse_split",
    "split_ranges", "train_sentencepiece",
]
