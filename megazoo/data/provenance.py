"""Which tokenizer made a dataset: ``PREFIX.tokenizer.json`` beside ``PREFIX.bin`` / ``.idx``.

The Megatron index format has no room for it, so the builder writes this small file with the
pair: the tokenizer's type name, vocabulary size and the sha256 of its model file
(`Tokenizer.record`). Loading data with another tokenizer is then refused by name instead of
training silently on ids that mean other text. Data written before the record existed (or by
another tool) has no such file and loads as before; only the vocabulary bound checks it.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import read_json

RECORD_SUFFIX = ".tokenizer.json"


def record_path(path_prefix: str | os.PathLike) -> Path:
    """``PREFIX.tokenizer.json``."""
    return Path(str(path_prefix) + RECORD_SUFFIX)


def read_tokenizer_record(path_prefix: str | os.PathLike) -> dict | None:
    """The recorded tokenizer of a dataset, or None when it has no record."""
    path = record_path(path_prefix)
    if not path.is_file():
        return None
    record = read_json(path, advice="rebuild the data with tools/preprocess_data.py")
    tok = record.get("tokenizer")
    if not isinstance(tok, dict) or not {"type", "vocab_size", "sha256"} <= set(tok):
        raise ValueError(f"{path} records no tokenizer (type, vocab_size, sha256): rebuild the "
                         "data with tools/preprocess_data.py")
    return tok


def check_tokenizer_record(path_prefix: str | os.PathLike, tokenizer) -> None:
    """ValueError naming both tokenizers when `tokenizer` is not the one recorded with the
    dataset (type, vocabulary size or model file bytes differ); nothing without a record."""
    recorded = read_tokenizer_record(path_prefix)
    if recorded is None:
        return
    ours = tokenizer.record()
    differ = [k for k in ("type", "vocab_size", "sha256") if recorded[k] != ours[k]]
    if differ:
        what = ", ".join(differ).replace("sha256", "model file")
        raise ValueError(f"dataset {path_prefix} was made with {recorded['type']} "
                         f"({recorded['vocab_size']} ids, sha256 {recorded['sha256'][:12]}), "
                         f"this run's tokenizer is {ours['type']} ({ours['vocab_size']} ids, "
                         f"sha256 {ours['sha256'][:12]}): they differ in {what}; pass the "
                         "--tokenizer-type/--tokenizer-model the data was made with")
