"""Fixtures of the training tests: tiny data, and the uninterrupted run others compare with."""
import pytest

from helpers.runs import make_data, tiny_argv
from megazoo.training.run import run_training


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """6 uninterrupted iterations, checkpoints at 3 and 6."""
    save = tmp_path_factory.mktemp("ref") / "ck"
    out = run_training(tiny_argv(data, "--save", str(save), "--save-interval", "3"))
    return out, save
