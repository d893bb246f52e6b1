"""Indexed .bin/.idx files, tokenizers and tools/preprocess_data.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megazoo.data import (ByteLevelTokenizer, HFTokenizer, IndexedDataset, IndexedDatasetBuilder,
                          SentencePieceTokenizer, best_dtype, build_tokenizer, train_sentencepiece)

REPO = Path(__file__).resolve().parents[2]
TEXT = "The quick brown fox jumps over the lazy dog. Ünïcödé and emoji 🦊 too!"


def _write(prefix, docs, dtype=np.uint16):
    with IndexedDatasetBuilder(prefix, dtype) as builder:
        for doc in docs:
            builder.add_document(doc)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64])
def test_round_trip(tmp_path, dtype):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 60000, size=n) for n in (5, 0, 17, 1, 0, 300)]
    prefix = tmp_path / "corpus"
    _write(prefix, docs, dtype)
    ds = IndexedDataset(prefix)
    assert len(ds) == len(docs) and ds.dtype == np.dtype(dtype)
    assert ds.sizes.tolist() == [len(d) for d in docs]
    assert ds.doc_idx.tolist() == list(range(len(docs) + 1))
    assert ds.num_tokens == sum(len(d) for d in docs)
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ds[i], doc)
    np.testing.assert_array_equal(ds.get(5, 10, 7), docs[5][10:17])
    np.testing.assert_array_equal(ds.get(2, 3), docs[2][3:])
    with pytest.raises(IndexError):
        ds.get(0, 3, 5)
    with pytest.raises(IndexError):
        ds[6]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.bin", "corpus.idx"]


def test_empty_dataset_and_dtype_choice(tmp_path):
    _write(tmp_path / "empty", [])
    ds = IndexedDataset(tmp_path / "empty")
    assert len(ds) == 0 and ds.num_tokens == 0 and ds.doc_idx.tolist() == [0]
    assert best_dtype(50257) == np.uint16 and best_dtype(65500) == np.int32
    assert best_dtype(257) == np.uint16


def test_builder_rejects_overflow_and_aborts_cleanly(tmp_path):
    prefix = tmp_path / "bad"
    with pytest.raises(ValueError, match="wider dtype"):
        with IndexedDatasetBuilder(prefix, np.uint16) as builder:
            builder.add_document([1, 2, 3])
            builder.add_document([70000])
    assert list(tmp_path.iterdir()) == []  # temporary files removed, nothing renamed
    with pytest.raises(ValueError, match="not supported"):
        IndexedDatasetBuilder(prefix, np.float32)
    with pytest.raises(FileNotFoundError, match="create it first"):
        IndexedDatasetBuilder(tmp_path / "missing_dir" / "x")


def test_missing_files_say_what_to_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="preprocess_data.py"):
        IndexedDataset(tmp_path / "nothing")
    _write(tmp_path / "half", [[1, 2]])
    (tmp_path / "half.bin").unlink()
    with pytest.raises(FileNotFoundError, match="half.bin not found"):
        IndexedDataset(tmp_path / "half")


@pytest.mark.parametrize("damage", ["truncate_idx", "tiny_idx", "empty_idx", "magic",
                                    "version", "truncate_bin", "extra_bin"])
def test_corrupt_files_give_one_clear_error(tmp_path, damage):
    prefix = tmp_path / "c"
    _write(prefix, [[1, 2, 3], [4, 5], [6]])
    idx, bin_ = tmp_path / "c.idx", tmp_path / "c.bin"
    raw = idx.read_bytes()
    edits = {
        "truncate_idx": lambda: idx.write_bytes(raw[:-5]),
        "tiny_idx": lambda: idx.write_bytes(raw[:10]),
        "empty_idx": lambda: idx.write_bytes(b""),
        "magic": lambda: idx.write_bytes(b"XXXXXXXXX" + raw[9:]),
        "version": lambda: idx.write_bytes(raw[:9] + (7).to_bytes(8, "little") + raw[17:]),
        "truncate_bin": lambda: bin_.write_bytes(bin_.read_bytes()[:-2]),
        "extra_bin": lambda: bin_.write_bytes(bin_.read_bytes() + b"\0\0"),
    }
    edits[damage]()
    with pytest.raises(ValueError, match="run tools/preprocess_data.py again") as info:
        IndexedDataset(prefix)
    assert "\n" not in str(info.value)


def test_byte_level_tokenizer():
    tok = build_tokenizer("ByteLevelTokenizer")
    assert isinstance(tok, ByteLevelTokenizer) and tok.vocab_size == 257 and tok.eod == 256
    ids = tok.encode(TEXT)
    assert max(ids) < 256 and tok.decode(ids + [tok.eod]) == TEXT


def test_sentencepiece_train_and_round_trip(tmp_path):
    corpus = tmp_path / "corpus.txt"
    lines = [f"{TEXT} line {i} with some words, numbers {i * 7} and more." for i in range(200)]
    corpus.write_text("\n".join(lines), encoding="utf-8")
    model = train_sentencepiece([corpus], vocab_size=120, model_prefix=tmp_path / "sp")
    tok = build_tokenizer("SentencePieceTokenizer", model)
    assert isinstance(tok, SentencePieceTokenizer)
    assert 0 < tok.vocab_size <= 120 and 0 <= tok.eod < tok.vocab_size
    for text in (lines[3], "  two  spaces and the lazy fox 🦊"):
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text


def _tiny_hf_tokenizer(path: Path) -> Path:
    """Train a byte-level BPE tokenizer.json on a few sentences (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([TEXT, "hello world " * 5, "megazoo data pipeline"] * 10, trainer)
    out = path / "tokenizer.json"
    tok.save(str(out))
    return out


def test_hf_tokenizer_round_trip(tmp_path):
    file = _tiny_hf_tokenizer(tmp_path)
    for source in (file, tmp_path):  # the file itself or its directory
        tok = build_tokenizer("HFTokenizer", source)
        assert isinstance(tok, HFTokenizer) and tok.eod == 0 and tok.vocab_size <= 300
        for text in (TEXT, "unseen wörds ✓ and\nnew lines"):
            assert tok.decode(tok.encode(text)) == text
    with pytest.raises(ValueError, match="eod_token"):
        HFTokenizer(file, eod_token="</nope>")


def test_build_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="choose one of"):
        build_tokenizer("GPT2BPETokenizer")
    with pytest.raises(ValueError, match="needs --tokenizer-model"):
        build_tokenizer("SentencePieceTokenizer")
    with pytest.raises(FileNotFoundError, match="--tokenizer-model"):
        build_tokenizer("HFTokenizer", tmp_path / "absent.json")
    with pytest.raises(ValueError, match="takes no --tokenizer-model"):
        build_tokenizer("ByteLevelTokenizer", "x")


def _preprocess(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools" / "preprocess_data.py"), *args],
                          capture_output=True, text=True, cwd=REPO, timeout=120)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_preprocess_jsonl_and_text(tmp_path, workers):
    texts = ["first document", "", "second 🦊 document", "third one\nwith two lines"]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("\n".join(json.dumps({"content": t}) for t in texts) + "\n", "utf-8")
    plain = tmp_path / "book.txt"
    plain.write_text("a whole file\nis one document", encoding="utf-8")
    prefix = tmp_path / "out"
    result = _preprocess("--input", str(jsonl), str(tmp_path / "*.txt"), "--output-prefix",
                         str(prefix), "--tokenizer-type", "ByteLevelTokenizer",
                         "--json-key", "content", "--append-eod", "--workers", workers)
    assert result.returncode == 0, result.stderr
    assert "documents 4, tokens" in result.stdout and "skipped empty documents 1" in result.stdout
    ds = IndexedDataset(prefix)
    tok = ByteLevelTokenizer()
    expected = [t for t in texts if t] + [plain.read_text("utf-8")]
    assert len(ds) == len(expected)
    for i, text in enumerate(expected):
        assert ds[i].tolist() == tok.encode(text) + [tok.eod]


def test_preprocess_split_lines_and_errors(tmp_path):
    plain = tmp_path / "lines.txt"
    plain.write_text("one\n\ntwo\nthree\n", encoding="utf-8")
    prefix = tmp_path / "lines"
    result = _preprocess("--input", str(plain), "--split-lines", "--output-prefix", str(prefix),
                         "--tokenizer-type", "ByteLevelTokenizer")
    assert result.returncode == 0, result.stderr
    assert [bytes(d.tolist()).decode() for d in IndexedDataset(prefix)] == ["one", "two", "three"]
    missing = _preprocess("--input", str(tmp_path / "nope*.jsonl"), "--output-prefix",
                          str(prefix), "--tokenizer-type", "ByteLevelTokenizer")
    assert missing.returncode == 2 and "matches no file" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"other": 1}\n', encoding="utf-8")
    result = _preprocess("--input", str(bad), "--output-prefix", str(prefix),
                         "--tokenizer-type", "ByteLevelTokenizer", "--overwrite")
    assert result.returncode == 2 and "bad.jsonl:2" in result.stderr
    assert len(IndexedDataset(prefix)) == 3  # the failed run left the old files alone
    assert sorted(p.name for p in tmp_path.glob("lines.*")) == [
        "lines.bin", "lines.idx", "lines.tokenizer.json", "lines.txt"]


def test_preprocess_with_hf_tokenizer_and_workers(tmp_path):
    tok_file = _tiny_hf_tokenizer(tmp_path)
    jsonl = tmp_path / "d.jsonl"
    texts = [f"hello world number {i} 🦊" for i in range(300)]
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), "utf-8")
    result = _preprocess("--input", str(jsonl), "--output-prefix", str(tmp_path / "hf"),
                         "--tokenizer-type", "HFTokenizer", "--tokenizer-model", str(tok_file),
                         "--append-eod", "--workers", "2")
    assert result.returncode == 0, result.stderr
    tok = HFTokenizer(tok_file)
    ds = IndexedDataset(tmp_path / "hf")
    assert len(ds) == 300 and ds.dtype == np.uint16
    for i in (0, 150, 299):  # order is kept across workers
        assert ds[i].tolist() == tok.encode(texts[i]) + [tok.eod]
