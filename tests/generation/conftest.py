"""Generation tests run tiny models token by token: thousands of small ops, which one
intra-op thread runs faster than several contending for a loaded CPU (10-20x here)."""
import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
