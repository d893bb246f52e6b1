"""The default run's data: Python's standard-library sources, tokenized once and cached.

Every machine with Python has them, so `python pretrain_gpt.py` needs no download:

1. pick `.py` files of `sysconfig.get_paths()["stdlib"]` (not site-packages) in an order
   fixed by a hash of their relative path, until `megabytes` of text;
2. train a SentencePiece BPE of `vocab_size` pieces on them: identity normalisation, byte
   fallback (any text round-trips) and whitespace-only pieces, so an indentation of 8
   spaces is one or two tokens rather than eight;
3. tokenize each file as one document (end-of-document id appended) into
   `CACHE/stdlib-<key>/corpus.bin/.idx` with `megazoo.data.IndexedDatasetBuilder`.

Everything is written under temporary names and renamed, so an interrupted preparation is
redone, never half-used. Returns the data prefix and the tokenizer model path.
"""
from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path

from ..checkpoint.output import remove_leftovers
from ..data import IndexedDatasetBuilder, SentencePieceTokenizer, best_dtype
from ..data.indexed import clean_temp_files

# Temp files of a preparation, named after its process (removed at the next start once that
# process is gone): the tokenizer's training text and its model under a temporary prefix.
LEFTOVERS = r"(?:train_text|tok)\.(?P<pid>\d+)\.(?:txt|model|vocab)"


def train_code_tokenizer(text_file: Path, vocab_size: int, prefix: Path) -> str:
    """A SentencePiece BPE for source code (see the module docstring); returns its path."""
    import sentencepiece

    try:
        sentencepiece.SentencePieceTrainer.train(
            input=str(text_file), model_prefix=str(prefix), vocab_size=vocab_size,
            model_type="bpe", character_coverage=1.0, byte_fallback=True,
            normalization_rule_name="identity", remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True, hard_vocab_limit=False,
            input_sentence_size=300_000, shuffle_input_sentence=True,
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=2, minloglevel=2)
    except RuntimeError as exc:  # e.g. fewer pieces than the corpus has characters
        reason = str(exc).strip().splitlines()[-1].split("] ")[-1]
        raise ValueError(f"--default-vocab-size {vocab_size}: SentencePiece cannot train the "
                         f"default corpus' tokenizer ({reason}): pass a larger "
                         f"--default-vocab-size") from None
    return str(prefix) + ".model"


def stdlib_files(megabytes: float) -> list[Path]:
    """Standard-library .py files (site-packages excluded), hash-ordered, up to `megabytes`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py")
             if "site-packages" not in p.parts and "dist-packages" not in p.parts and p.is_file()]
    files.sort(key=lambda p: hashlib.sha1(str(p.relative_to(root)).encode()).hexdigest())
    chosen, total, budget = [], 0, int(megabytes * 1e6)
    for path in files:
        size = path.stat().st_size
        if 0 < size <= 200_000 and total < budget:
            chosen.append(path)
            total += size
    if not chosen:
        raise FileNotFoundError(f"no .py files under {root}: pass --data-path with your own data")
    return chosen


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def prepare_default_corpus(cache_dir: str, megabytes: float, vocab_size: int,
                           log=print) -> tuple[str, str]:
    """Build (or reuse) the cached corpus; return (data prefix, SentencePiece model path)."""
    key = hashlib.sha1(f"{sysconfig.get_paths()['stdlib']}|{megabytes}|{vocab_size}|v2"
                       .encode()).hexdigest()[:10]
    folder = Path(cache_dir) / f"stdlib-{key}"
    prefix, model = folder / "corpus", folder / "tokenizer.model"
    for path in remove_leftovers(str(folder), LEFTOVERS) + clean_temp_files(prefix)[0]:
        log(f"removed {path}, left by a killed run")
    if model.is_file() and Path(str(prefix) + ".idx").is_file():
        return str(prefix), str(model)
    folder.mkdir(parents=True, exist_ok=True)
    texts = [t for t in (_read(p) for p in stdlib_files(megabytes)) if t and t.strip()]
    log(f"preparing the default corpus: {len(texts)} standard-library files, "
        f"{sum(map(len, texts)) / 1e6:.1f} M characters -> {folder}")
    text_file = folder / f"train_text.{os.getpid()}.txt"
    tmp_prefix = folder / f"tok.{os.getpid()}"
    try:  # a full disk while writing the text file leaves nothing behind either
        text_file.write_text("\n".join(texts), encoding="utf-8")
        path = train_code_tokenizer(text_file, vocab_size, tmp_prefix)
        tokenizer = SentencePieceTokenizer(path)
        os.replace(path, model)
        tokenizer.model_file = str(model)
        with IndexedDatasetBuilder(prefix, best_dtype(tokenizer.vocab_size),
                                   tokenizer.record()) as builder:
            for text in texts:
                builder.add_document(tokenizer.encode(text) + [tokenizer.eod])
    finally:
        text_file.unlink(missing_ok=True)
        for leftover in folder.glob(f"tok.{os.getpid()}.*"):
            leftover.unlink()
    return str(prefix), str(model)
