"""The chunked all-gather + GEMM and GEMM + reduce-scatter of Megatron SP
(`megazoo.layers.tp_overlap`) against the unchunked path and one process, on gloo; the chunk
loop's order and the row blocks without processes. Tolerances: tests/helpers/comm_checks.py.
"""
import pytest
import torch

from helpers import comm_checks
from megazoo.layers import symm_tp
from megazoo.layers.tp_overlap import chunk_pipeline, chunk_rows, usable_chunks
from megazoo.testing import run_distributed


def test_chunked_linears_match_unchunked_and_one_process():
    assert run_distributed(comm_checks.check_chunked_linears, 2, timeout=300) == [6, 6]


# On 2 GPUs over NCCL: the CUDA path, torch's fused symmetric-memory ops (`symm_tp`).
@pytest.mark.gpu(count=2)
def test_chunked_linears_match_on_nccl():
    results = run_distributed(comm_checks.check_chunked_linears, 2, "cuda", timeout=300,
                              backend="nccl")
    assert results == [6, 6]


def test_chunk_rows_cover_the_sequence_once():
    assert chunk_rows(8, 2, 1, 0) == [(0, 16)]
    assert chunk_rows(8, 2, 2, 1) == [(4, 8), (12, 16)]
    rows = sorted(r for i in range(4) for lo, hi in chunk_rows(8, 4, 4, i) for r in range(lo, hi))
    assert rows == list(range(32))
    assert [usable_chunks(8, k) for k in (1, 2, 3, 4, 5)] == [1, 2, 2, 4, 4]
    assert usable_chunks(6, 4) == 3


class _Work:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait(self):
        self.log.append(f"wait {self.name}")


def test_pipeline_starts_the_next_transfer_before_computing():
    log = []

    def fetch(i):
        log.append(f"fetch {i}")
        return _Work(log, f"fetch {i}")

    def send(i, result):
        log.append(f"send {i}")
        return _Work(log, f"send {i}")

    sent = chunk_pipeline(2, lambda i: log.append(f"compute {i}"), fetch=fetch, send=send)
    assert log == ["fetch 0", "fetch 1", "wait fetch 0", "compute 0", "send 0",
                   "wait fetch 1", "compute 1", "send 1"]
    sent.wait()
    assert log[-2:] == ["wait send 0", "wait send 1"]


def test_cpu_tensors_keep_the_chunked_path():
    """The fused copy-engine ops (`symm_tp`) stand in for the chunked path on CUDA over NCCL
    only: a CPU tensor takes the chunked path the tests above check, before any group is
    looked at."""
    assert not symm_tp.usable(torch.zeros(2), None)
