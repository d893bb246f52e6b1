"""Every reader of checkpoints takes a training run's --save folder (its `latest`) or one
iter_* folder: resolve_checkpoint, megazoo.load_pretrained, megazoo_to_hf.py, reshard.py."""
import pytest
import torch

import megazoo
from megazoo.checkpoint import CheckpointReader, save_checkpoint
from megazoo.checkpoint.resolve import resolve_checkpoint
from megazoo.convert.cli import megazoo_to_hf_main, reshard_main
from megazoo.models import build_model
from helpers.fixtures import tiny_config


@pytest.fixture(scope="module")
def save_dir(tmp_path_factory):
    """A --save folder: iter_0000003 (seed 3), iter_0000006 (seed 6), latest = 6."""
    save = tmp_path_factory.mktemp("run") / "checkpoints"
    for step in (3, 6):
        model = build_model(tiny_config("gpt", max_position_embeddings=32), None, device="cpu",
                            seed=step)
        save_checkpoint(model, save / f"iter_{step:07d}")
    (save / "latest").write_text("6\n")
    return save


def test_save_folder_means_its_latest_and_iter_folder_itself(save_dir):
    assert resolve_checkpoint(save_dir) == str(save_dir / "iter_0000006")
    assert resolve_checkpoint(save_dir / "iter_0000003") == str(save_dir / "iter_0000003")
    latest = CheckpointReader(save_dir / "iter_0000006")
    model = megazoo.load_pretrained(str(save_dir))
    for name, p in model.named_parameters():
        assert torch.equal(p.detach()[:latest.full_tensor(name).shape[0]],
                           latest.full_tensor(name)), name


def test_converters_take_the_save_folder(save_dir, tmp_path, capsys):
    assert megazoo_to_hf_main(["--load", str(save_dir), "--out", str(tmp_path / "hf")]) == 0
    assert reshard_main(["--load", str(save_dir), "--out", str(tmp_path / "tp2"),
                         "--tp", "2"]) == 0
    a, b = CheckpointReader(save_dir / "iter_0000006"), CheckpointReader(tmp_path / "tp2")
    assert b.layout["tp"] == 2
    assert all(torch.equal(a.full_tensor(n), b.full_tensor(n)) for n in a.names())


def test_folder_without_checkpoint_says_what_to_pass(save_dir, tmp_path):
    with pytest.raises(ValueError, match=r"is not a megazoo checkpoint \(megazoo.json is missing\) "
                       r"nor a --save folder \(no latest file\); pass a --save folder or one of "
                       r"its iter_\* folders"):
        resolve_checkpoint(tmp_path)
    (tmp_path / "iter_0000009").symlink_to(save_dir / "iter_0000006")
    with pytest.raises(FileNotFoundError, match="it holds .*iter_0000009: pass that"):
        resolve_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="no checkpoint directory at"):
        resolve_checkpoint(tmp_path / "nowhere")
