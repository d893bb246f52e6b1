"""Tokenizers behind one small interface, chosen by Megatron-style ``--tokenizer-type``.

* ``SentencePieceTokenizer`` -- a SentencePiece ``.model`` (train one with
  :func:`train_sentencepiece`);
* ``HFTokenizer`` -- a Hugging Face ``tokenizer.json`` read from a local path with the
  ``tokenizers`` library (never downloads);
* ``ByteLevelTokenizer`` -- UTF-8 bytes, ids 0..255, plus an end-of-document id 256.

Third-party libraries are imported when a tokenizer is built, not at module import.
"""

from __future__ import annotations

import hashlib
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Iterable, Sequence


class Tokenizer(ABC):
    """Text <-> token ids, with an end-of-document id appended between documents."""

    vocab_size: int
    """Number of ids (every id is ``< vocab_size``)."""
    eod: int
    """End-of-document id."""
    model_file: str | None = None
    """The file the tokenizer was read from (None: it needs none)."""

    def record(self) -> dict:
        """What identifies this tokenizer in the data it made: its type name, vocabulary size
        and the sha256 of its model file (of the type name when it has none)."""
        if self.model_file is None:
            digest = hashlib.sha256(type(self).__name__.encode()).hexdigest()
        else:
            with open(self.model_file, "rb") as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()
        return {"type": type(self).__name__, "vocab_size": int(self.vocab_size),
                "sha256": digest}

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no end-of-document id added)."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``."""


class ByteLevelTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255 and ``eod = 256``; needs no model file."""

    vocab_size = 257
    eod = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes back to text; end-of-document ids are dropped, bad UTF-8 becomes U+FFFD."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def _require_file(path: str | os.PathLike, what: str) -> Path:
    """Return ``path`` as a Path, or raise FileNotFoundError naming it (every command that
    takes a tokenizer names its own flag for it, so the message names none)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{what} {p} not found; check the path")
    return p


def _unreadable(path, what: str, exc: Exception) -> ValueError:
    """One line for a tokenizer file its library cannot parse (the library's own reason,
    first line, shortened)."""
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:120]
    return ValueError(f"{path} is not a readable {what} ({reason}): pass the tokenizer file "
                      f"the data and the model were made with")


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model; ``eod`` is its ``</s>`` (eos) piece."""

    def __init__(self, model_path: str | os.PathLike):
        import sentencepiece

        path = _require_file(model_path, "SentencePiece model")
        self.model_path = self.model_file = str(path)
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=self.model_path)
        except Exception as exc:  # sentencepiece raises RuntimeError / OSError, by version
            raise _unreadable(path, "SentencePiece model", exc) from None
        self.vocab_size, self.eod = int(self._sp.get_piece_size()), int(self._sp.eos_id())
        if self.eod < 0:
            raise ValueError(f"SentencePiece model {path} has no eos piece; retrain it with "
                             "eos_id >= 0 (train_sentencepiece does)")

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text, out_type=int))

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


def train_sentencepiece(files: Iterable[str | os.PathLike], vocab_size: int,
                        model_prefix: str | os.PathLike) -> str:
    """Train a SentencePiece BPE on text files (one sentence per line, a million sampled at
    most); return its path.

    Normalisation is the identity and whitespace is kept, so ``decode(encode(s)) == s``
    for text made of characters seen in training. ``vocab_size`` is a soft limit: a small
    corpus gives a smaller vocabulary instead of an error.
    """
    import sentencepiece

    paths = [str(_require_file(f, "training file")) for f in files]
    if not paths:
        raise ValueError("train_sentencepiece needs at least one training file")
    if vocab_size < 8:
        raise ValueError(f"vocab_size must be >= 8, got {vocab_size}")
    with open(os.devnull, "w") as devnull:
        sentencepiece.SentencePieceTrainer.train(
            input=paths, model_prefix=str(model_prefix), vocab_size=vocab_size,
            model_type="bpe", character_coverage=1.0, normalization_rule_name="identity",
            remove_extra_whitespaces=False, hard_vocab_limit=False,
            input_sentence_size=1_000_000, shuffle_input_sentence=True, unk_id=0, bos_id=1,
            eos_id=2, pad_id=-1, num_threads=min(4, os.cpu_count() or 1), logstream=devnull)
    return str(model_prefix) + ".model"


#: Special tokens tried, in order, as the end-of-document token of an HF tokenizer.
HF_EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]", "<eod>")


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json`` (a file, or a directory holding one)."""

    def __init__(self, path: str | os.PathLike, eod_token: str | None = None):
        import tokenizers

        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        p = _require_file(p, "tokenizer.json")
        self.path = self.model_file = str(p)
        try:
            self._tok = tokenizers.Tokenizer.from_file(self.path)
        except Exception as exc:  # the Rust library's parse errors are plain Exceptions
            raise _unreadable(p, "Hugging Face tokenizer.json", exc) from None
        candidates = (eod_token,) if eod_token else HF_EOD_CANDIDATES
        found = [i for i in map(self._tok.token_to_id, candidates) if i is not None]
        if not found:
            raise ValueError(f"{p} has none of the end-of-document tokens {list(candidates)}; "
                             "add one to the tokenizer or pass eod_token=")
        self.eod = int(found[0])
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens=True`` adds what the tokenizer's own
        template adds (LLaMA's leading ``<s>``), as transformers does for a prompt."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


#: ``--tokenizer-type`` names.
TOKENIZER_TYPES: dict[str, type[Tokenizer]] = {
    "SentencePieceTokenizer": SentencePieceTokenizer,
    "HFTokenizer": HFTokenizer,
    "ByteLevelTokenizer": ByteLevelTokenizer,
}


def build_tokenizer(tokenizer_type: str, tokenizer_model: str | os.PathLike | None = None
                    ) -> Tokenizer:
    """Build a tokenizer from Megatron-style ``--tokenizer-type`` / ``--tokenizer-model``."""
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(f"unknown --tokenizer-type {tokenizer_type!r}; choose one of "
                         f"{', '.join(TOKENIZER_TYPES)}")
    if tokenizer_type == "ByteLevelTokenizer":
        if tokenizer_model is not None:
            raise ValueError("ByteLevelTokenizer takes no --tokenizer-model; drop the flag")
        return ByteLevelTokenizer()
    if tokenizer_model is None:
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model "
                         "(a .model file for SentencePiece, a tokenizer.json for HF)")
    if not Path(tokenizer_model).is_dir():
        _require_file(tokenizer_model, "--tokenizer-model")
    return TOKENIZER_TYPES[tokenizer_type](tokenizer_model)
