"""What tools/preprocess_data.py refuses to overwrite, and the tokenizer it records with the
data (refused at load when the run's tokenizer is another one)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megazoo.data import ByteLevelTokenizer, IndexedDataset, IndexedDatasetBuilder
from megazoo.data import preprocess as preprocess_data
from megazoo.data.provenance import read_tokenizer_record, record_path
from megazoo.training.data import check_vocabulary
from tests.data.test_data import _tiny_hf_tokenizer

BYTES = ["--tokenizer-type", "ByteLevelTokenizer"]


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
@pytest.mark.parametrize("suffix", [".bin", ".idx"])
def test_preprocess_refuses_to_write_over_its_input(tmp_path, capsys, suffix, overwrite):
    text = tmp_path / f"t{suffix}"
    text.write_text("my only copy of this text\n", encoding="utf-8")
    argv = ["--input", str(text), "--output-prefix", str(tmp_path / "t"), *BYTES, *overwrite]
    assert preprocess_data.main(argv) == 2
    line = _one_error_line(capsys)
    assert f"--input {text}" in line and "choose another --output-prefix" in line
    assert text.read_text(encoding="utf-8") == "my only copy of this text\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [text.name]


def test_preprocess_replaces_a_dataset_only_with_overwrite(tmp_path, capsys):
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text("first", encoding="utf-8")
    second.write_text("second text", encoding="utf-8")
    prefix = tmp_path / "data"
    assert preprocess_data.main(["--input", str(first), "--output-prefix", str(prefix), *BYTES]) == 0
    capsys.readouterr()
    again = ["--input", str(second), "--output-prefix", str(prefix), *BYTES]
    assert preprocess_data.main(again) == 2
    assert "pass --overwrite" in _one_error_line(capsys)
    assert bytes(IndexedDataset(prefix)[0].tolist()) == b"first"  # kept
    assert preprocess_data.main(again + ["--overwrite"]) == 0
    assert bytes(IndexedDataset(prefix)[0].tolist()) == b"second text"


def test_tokenizer_recorded_and_a_mismatch_refused_at_load(tmp_path):
    from megazoo.data import HFTokenizer

    text = tmp_path / "t.txt"
    text.write_text("hello world, bytes only", encoding="utf-8")
    prefix = tmp_path / "bytes"
    assert preprocess_data.main(["--input", str(text), "--output-prefix", str(prefix), *BYTES]) == 0
    record = read_tokenizer_record(prefix)
    assert record == ByteLevelTokenizer().record() and record["vocab_size"] == 257
    check_vocabulary([str(prefix)], ByteLevelTokenizer(), 1024)  # the same tokenizer loads
    (tmp_path / "hf").mkdir()
    hf = HFTokenizer(_tiny_hf_tokenizer(tmp_path / "hf"))  # > 257 ids: every byte id fits
    assert hf.vocab_size > 257
    with pytest.raises(ValueError, match="made with ByteLevelTokenizer .257 ids.*HFTokenizer"):
        check_vocabulary([str(prefix)], hf, 1024)
    record_path(prefix).unlink()  # data made before the record existed still loads
    check_vocabulary([str(prefix)], hf, 1024)


def test_tokenizer_model_file_bytes_are_part_of_the_record(tmp_path):
    from megazoo.data import HFTokenizer

    (tmp_path / "a").mkdir()
    tok = HFTokenizer(_tiny_hf_tokenizer(tmp_path / "a"))
    prefix = tmp_path / "d"
    with IndexedDatasetBuilder(prefix, np.uint16, tok.record()) as builder:
        builder.add_document([1, 2, 3])
    spec = json.loads(open(tok.model_file, encoding="utf-8").read())
    vocab = spec["model"]["vocab"]
    a, b = "a", "b"
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same type and size, two ids mean other text
    other = tmp_path / "b.json"
    other.write_text(json.dumps(spec), encoding="utf-8")
    with pytest.raises(ValueError, match="differ in model file"):
        check_vocabulary([str(prefix)], HFTokenizer(other), 1024)
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:  # rebuilt without a record:
        builder.add_document([1, 2, 3])                         # the stale one goes
    assert not record_path(prefix).exists()
