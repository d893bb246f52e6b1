"""GPTDataset samples, splits, caching and weighted blending."""

from __future__ import annotations

import numpy as np
import pytest

from megazoo.data import (BlendedDataset, GPTDataset, GPTDatasetConfig, IndexedDataset,
                          IndexedDatasetBuilder, build_blending_indices,
                          build_train_valid_test_datasets, parse_data_prefix, parse_split,
                          split_ranges)


def _corpus(tmp_path, name="corpus", num_docs=40, seed=0, base=0):
    """Documents of random lengths (some empty) holding distinct, increasing token ids."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 30, size=num_docs)
    lengths[rng.random(num_docs) < 0.15] = 0
    docs, next_id = [], base
    for n in lengths:
        docs.append(np.arange(next_id, next_id + n))
        next_id += n
    with IndexedDatasetBuilder(tmp_path / name, np.int32) as builder:
        for d in docs:
            builder.add_document(d)
    return IndexedDataset(tmp_path / name), docs


def _stream(ds: GPTDataset, docs) -> np.ndarray:
    """All tokens in doc_idx order (the epochs' shuffled documents back to back)."""
    return np.concatenate([docs[d] for d in ds.doc_idx])


@pytest.mark.parametrize("seq_length", [1, 7, 16])
def test_samples_are_contiguous_windows_covering_the_corpus(tmp_path, seq_length):
    indexed, docs = _corpus(tmp_path)
    cfg = GPTDatasetConfig(seq_length=seq_length, seed=3, use_cache=False)
    ds = GPTDataset(indexed, np.arange(len(docs)), None, cfg)
    stream = _stream(ds, docs)
    total = stream.size
    assert ds.num_epochs == 1 and len(ds) == (total - 1) // seq_length
    for k in range(len(ds)):
        np.testing.assert_array_equal(ds.sample_tokens(k),
                                      stream[k * seq_length:(k + 1) * seq_length + 1])
    served = {tuple(ds[i]) for i in range(len(ds))}
    assert served == {tuple(ds.sample_tokens(k)) for k in range(len(ds))}
    covered = np.unique(np.concatenate([ds[i] for i in range(len(ds))]))
    assert covered.size > total - seq_length  # only a tail shorter than one sample unused
    assert all(ds[i].dtype == np.int64 and ds[i].size == seq_length + 1 for i in range(len(ds)))


def test_multiple_epochs_and_last_epoch_shuffled_apart(tmp_path):
    indexed, docs = _corpus(tmp_path)
    cfg = GPTDatasetConfig(seq_length=5, seed=11, use_cache=False)
    one_epoch = GPTDataset(indexed, np.arange(len(docs)), None, cfg).num_samples
    ds = GPTDataset(indexed, np.arange(len(docs)), 2 * one_epoch + 3, cfg)
    assert ds.num_epochs == 3 and len(ds) == 2 * one_epoch + 3
    n = len(docs)
    for e in range(3):
        assert sorted(ds.doc_idx[e * n:(e + 1) * n].tolist()) == list(range(n))
    assert not np.array_equal(ds.doc_idx[:n], ds.doc_idx[n:2 * n])
    stream = _stream(ds, docs)
    for i in range(len(ds)):
        k = int(ds.shuffle_idx[i])
        np.testing.assert_array_equal(ds[i], stream[k * 5:k * 5 + 6])
    first = ((2 * ds.tokens_per_epoch) - 1) // 5
    assert sorted(ds.shuffle_idx[:first].tolist()) == list(range(first))


def test_deterministic_under_seed(tmp_path):
    indexed, docs = _corpus(tmp_path)

    def samples(seed):
        cfg = GPTDatasetConfig(seq_length=8, seed=seed, use_cache=False)
        ds = GPTDataset(indexed, np.arange(len(docs)), 50, cfg)
        return np.stack([ds[i] for i in range(len(ds))])

    np.testing.assert_array_equal(samples(1), samples(1))
    assert not np.array_equal(samples(1), samples(2))


def test_index_cache_is_written_and_reused(tmp_path):
    indexed, docs = _corpus(tmp_path)
    cfg = GPTDatasetConfig(seq_length=6, seed=5, cache_dir=str(tmp_path / "cache"))
    built = GPTDataset(indexed, np.arange(len(docs)), 30, cfg, name="valid")
    files = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len(files) == 3 and all(f.startswith("corpus_valid_") for f in files)
    loaded = GPTDataset(indexed, np.arange(len(docs)), 30, cfg, name="valid")
    assert isinstance(loaded.sample_idx, np.memmap)
    for name in ("doc_idx", "sample_idx", "shuffle_idx"):
        np.testing.assert_array_equal(getattr(built, name), getattr(loaded, name))
    GPTDataset(indexed, np.arange(len(docs)), 30, GPTDatasetConfig(
        seq_length=6, seed=6, cache_dir=str(tmp_path / "cache")), name="valid")
    assert len(list((tmp_path / "cache").iterdir())) == 6  # another seed, another key
    next_to_data = GPTDataset(indexed, np.arange(5), None, GPTDatasetConfig(seq_length=4))
    assert len(list(tmp_path.glob("corpus_train_*.npy"))) == 3 and len(next_to_data) > 0


def test_config_validation():
    with pytest.raises(ValueError, match="seq_length"):
        GPTDatasetConfig(seq_length=0)
    with pytest.raises(ValueError, match="seed"):
        GPTDatasetConfig(seq_length=4, seed=-1)
    with pytest.raises(ValueError, match="969,30,1"):
        GPTDatasetConfig(seq_length=4, split="a,b")


def test_split_parsing():
    assert split_ranges(1000, "969,30,1") == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges(10, "98/2") == [(0, 10), (10, 10), (10, 10)]
    assert split_ranges(7, "1,1,1") == [(0, 2), (2, 5), (5, 7)]
    assert split_ranges(0, "969,30,1") == [(0, 0), (0, 0), (0, 0)]
    assert parse_split("2,1,1") == [0.5, 0.25, 0.25]
    for bad in ("", "1,2,3,4", "-1,2", "0,0,0", "x"):
        with pytest.raises(ValueError, match="--split"):
            parse_split(bad)
    assert parse_data_prefix(["a"]) == [(1.0, "a")]
    assert parse_data_prefix(["0.3", "a", "0.7", "b"]) == [(0.3, "a"), (0.7, "b")]
    for bad in (["0.3", "a", "b"], ["x", "a", "0.5", "b"], []):
        with pytest.raises(ValueError, match="--data-path"):
            parse_data_prefix(bad)


def test_blending_matches_weights():
    weights = [0.2, 0.3, 0.5]
    index, sample = build_blending_indices(weights, 10_000)
    for t in (10, 100, 1000, 10_000):
        counts = np.bincount(index[:t], minlength=3)
        assert np.all(np.abs(counts - np.array(weights) * t) <= 1.0), (t, counts)
    for i in range(3):  # each dataset's samples are taken in order 0, 1, 2, ...
        assert sample[index == i].tolist() == list(range(int((index == i).sum())))
    index, _ = build_blending_indices([2, 0, 6], 100)  # unnormalised, one zero weight
    assert np.bincount(index, minlength=3).tolist() == [25, 0, 75]
    with pytest.raises(ValueError, match="non-negative"):
        build_blending_indices([1, -1], 10)


def test_train_valid_test_blended(tmp_path):
    _corpus(tmp_path, "a", num_docs=60, seed=1, base=0)
    _corpus(tmp_path, "b", num_docs=60, seed=2, base=100_000)
    cfg = GPTDatasetConfig(seq_length=8, seed=7, split="8,1,1", use_cache=False)
    train, valid, test = build_train_valid_test_datasets(
        ["0.25", str(tmp_path / "a"), "0.75", str(tmp_path / "b")], (400, 20, 0), cfg)
    assert isinstance(train, BlendedDataset) and len(train) == 400 and len(valid) == 20
    assert test is None
    from_b = sum(int(train[i][0] >= 100_000) for i in range(len(train)))
    assert from_b == 300
    a_train = train.datasets[0]
    assert a_train.documents.tolist() == list(range(48))  # 8/10 of 60 documents
    single = build_train_valid_test_datasets([str(tmp_path / "a")], (10, 0, 5), cfg)
    assert isinstance(single[0], GPTDataset) and single[1] is None and len(single[2]) == 5
    assert single[2].documents.tolist() == list(range(54, 60))
    with pytest.raises(ValueError, match="more samples"):
        BlendedDataset([single[2], single[2]], [0.5, 0.5], 100)
