"""Train/valid/test splits and weighted blending of several GPT datasets.

``--data-path`` follows Megatron: either one prefix (``data/corpus_text_document``) or
weights and prefixes alternating (``0.3 data/web 0.7 data/books``). Each prefix is split
into train/valid/test document ranges by ``--split``; when there are several prefixes,
each split is a :class:`BlendedDataset` drawing from them in proportion to the weights.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from megazoo.data.gpt_dataset import GPTDataset, GPTDatasetConfig
from megazoo.data.helpers import build_blending_indices
from megazoo.data.indexed import IndexedDataset
from megazoo.data.splits import parse_data_prefix, split_ranges

#: Extra samples requested from each blended component so rounding never runs it dry.
BLEND_MARGIN = 1.005


class BlendedDataset:
    """``size`` samples drawn from ``datasets`` in proportion to ``weights``.

    Sample ``i`` is sample ``dataset_sample_index[i]`` of ``datasets[dataset_index[i]]``
    (see :func:`megazoo.data.helpers.build_blending_indices`).
    """

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int,
                 use_cpp: bool | None = None):
        if len(datasets) != len(weights):
            raise ValueError(f"got {len(datasets)} datasets but {len(weights)} weights; "
                             "give one weight per dataset")
        self.datasets = list(datasets)
        self.size = int(size)
        self.dataset_index, self.dataset_sample_index = build_blending_indices(
            weights, self.size, use_cpp=use_cpp)
        for i, ds in enumerate(self.datasets):
            used = self.dataset_sample_index[self.dataset_index == i]
            if used.size and int(used.max()) >= len(ds):
                raise ValueError(f"blended dataset {i} has {len(ds)} samples but the blend "
                                 f"needs {int(used.max()) + 1}; build it with more samples "
                                 f"(e.g. ceil(size * weight * {BLEND_MARGIN}) + 1)")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.size:
            raise IndexError(f"sample {i} out of range for {self.size} samples")
        ds = self.datasets[int(self.dataset_index[i])]
        return ds[int(self.dataset_sample_index[i])]


def build_train_valid_test_datasets(data_path: Sequence[str], num_samples: Sequence[int],
                                    config: GPTDatasetConfig) -> tuple:
    """Build ``(train, valid, test)`` datasets; a split with no documents or 0 samples is None.

    ``num_samples`` gives the wanted sample count of each split.
    """
    if len(num_samples) != 3 or any(int(n) < 0 for n in num_samples):
        raise ValueError(f"num_samples must be three non-negative counts, got {num_samples}")
    pairs = parse_data_prefix(data_path)
    total_weight = sum(w for w, _ in pairs)
    names = ("train", "valid", "test")
    per_prefix = []
    for weight, prefix in pairs:
        indexed = IndexedDataset(prefix)
        share = weight / total_weight
        splits = []
        for name, (start, end), wanted in zip(names, split_ranges(len(indexed), config.split),
                                              num_samples):
            if end <= start or wanted == 0 or weight == 0:
                splits.append(None)
                continue
            count = int(wanted)
            if len(pairs) > 1:  # a blended component's share, with the margin
                count = math.ceil(count * share * BLEND_MARGIN) + 1
            splits.append(GPTDataset(indexed, np.arange(start, end), count, config, name))
        per_prefix.append((share, splits))
    if len(pairs) == 1:
        return tuple(per_prefix[0][1])
    result = []
    for s, wanted in enumerate(num_samples):
        members = [(share, splits[s]) for share, splits in per_prefix if splits[s] is not None]
        if not members:
            result.append(None)
            continue
        result.append(BlendedDataset([d for _, d in members], [w for w, _ in members],
                                     int(wanted), use_cpp=config.use_cpp))
    return tuple(result)
