"""Checkpoints keep a model's sparse attention section; HF export refuses a sparse model."""
import os

import pytest
import torch

from megazoo.checkpoint import CheckpointReader, save_checkpoint
from megazoo.convert import megazoo_to_hf
from megazoo.convert.cli import megazoo_to_hf_main
from megazoo.models import build_model
from helpers.fixtures import tiny_config

FIXED = {"mode": "fixed", "block": 16, "different_layout_per_head": True}


def test_checkpoint_keeps_sparse_section_and_the_loaded_model_computes_the_same(tmp_path):
    cfg = tiny_config("bloom", sparse_attention=FIXED)
    model = build_model(cfg, None, device="cpu", seed=2)
    save_checkpoint(model, tmp_path / "mz")
    back = CheckpointReader(tmp_path / "mz").config
    assert back.sparse == cfg.sparse
    ids = torch.randint(0, 300, (1, 32), generator=torch.Generator().manual_seed(0))
    rebuilt = build_model(back, None, device="cpu", seed=2)
    with torch.no_grad():
        assert torch.equal(model(ids), rebuilt(ids))


def test_hf_export_refuses_sparse_attention_in_one_line(tmp_path, capsys):
    save_checkpoint(build_model(tiny_config("llama", sparse_attention=FIXED), None,
                                device="cpu"), tmp_path / "mz")
    with pytest.raises(ValueError, match="fixed block-sparse attention, which Hugging Face's "
                                         "llama architecture cannot express"):
        megazoo_to_hf(tmp_path / "mz", tmp_path / "hf")
    assert megazoo_to_hf_main(["--load", str(tmp_path / "mz"), "--out",
                               str(tmp_path / "hf2")]) == 2
    err = capsys.readouterr().err
    assert "export refused" in err and len(err.strip().splitlines()) == 1
    assert sorted(os.listdir(tmp_path)) == ["mz"]


def test_hf_export_of_dense_mode_is_allowed(tmp_path):
    save_checkpoint(build_model(tiny_config("gpt", sparse_attention={"mode": "dense"}), None,
                                device="cpu"), tmp_path / "mz")
    config = megazoo_to_hf(tmp_path / "mz", tmp_path / "hf")
    assert config["model_type"] == "gpt2"
