"""Tiny training runs: byte-level data and the pretrain_gpt.py flags of a 2-layer model."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from megazoo.data import IndexedDatasetBuilder

ROOT = Path(__file__).resolve().parents[2]
TEXT = (ROOT / "megazoo" / "models" / "model.py").read_text() * 2


def make_data(folder: Path) -> str:
    """60 byte-level documents (pieces of a source file), ids < 257."""
    prefix = str(folder / "tiny")
    with IndexedDatasetBuilder(prefix, np.uint16) as b:
        for i in range(60):
            b.add_document(list(TEXT[i * 150:(i + 1) * 150].encode()) + [256])
    return prefix


def tiny_argv(prefix: str, *extra: str) -> list[str]:
    """Flags of a 6-iteration run on `prefix` (h = 32, 2 layers), plus `extra`."""
    return ["--data-path", prefix, "--tokenizer-type", "ByteLevelTokenizer", "--split", "90,10,0",
            "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "64", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--train-iters", "6", "--lr-warmup-iters", "2",
            "--lr", "1e-2", "--min-lr", "1e-3", "--log-interval", "1", "--eval-interval", "3",
            "--eval-iters", "1", "--generate-tokens", "3", "--no-progress", "--save", "",
            "--cpu-threads", "1", "--no-plot-curves", *extra]


def signalled_rank_run(argv: list[str], signalled: int, step: int) -> tuple[int, str | None]:
    """On each rank of a `run_distributed` job: pretrain with `argv`, rank `signalled` getting
    SIGINT during step `step` (0-based); (exit status, the --save folder's `latest`)."""
    import signal

    import torch.distributed as dist

    from megazoo.training import loop
    from megazoo.training.run import main

    real = loop.seed_step

    def seed_then_signal(seed, iteration, state):
        real(seed, iteration, state)
        if iteration == step and dist.get_rank() == signalled:
            signal.raise_signal(signal.SIGINT)

    loop.seed_step = seed_then_signal
    code = main(argv)
    save = argv[len(argv) - 1 - argv[::-1].index("--save") + 1]  # the last --save given
    latest = Path(save) / "latest"
    return code, latest.read_text().strip() if latest.is_file() else None
