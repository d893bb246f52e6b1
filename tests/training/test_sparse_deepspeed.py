"""The ds_config's `sparse_attention` section under `--deepspeed`: it configures the model's
block-sparse attention, and `deepspeed.initialize` gets the rest of the JSON without it
(DeepSpeed releases without their own sparse attention refuse a config holding the block)."""
import json

import pytest

from megazoo.testing import run_distributed

SECTION = {"mode": "fixed", "block": 16, "different_layout_per_head": True,
           "num_local_blocks": 2, "attention": "unidirectional"}
OTHER = {"zero_optimization": {"stage": 1, "contiguous_gradients": False},
         "communication_data_type": "fp32"}


def _args(json_path: str):
    from megazoo.config.flags import parse_args

    return parse_args(["--deepspeed", "--deepspeed_config", json_path, "--num-layers", "2",
                       "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
                       "--max-position-embeddings", "64", "--micro-batch-size", "2",
                       "--global-batch-size", "2"])


@pytest.fixture
def ds_json(tmp_path) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"sparse_attention": SECTION, **OTHER}))
    return str(path)


class _Captured(Exception):
    """Raised by the stub of deepspeed.initialize once it has the config."""


def test_initialize_gets_the_json_without_the_sparse_section(ds_json, monkeypatch):
    """A stub of deepspeed.initialize records what the engine hands it; nothing else of
    DeepSpeed runs (no process group, no engine)."""
    deepspeed = pytest.importorskip("deepspeed")
    from megazoo.models import build_model
    from megazoo.parallel import ParallelState
    from megazoo.training.backends import deepspeed_zero

    seen = {}

    def initialize(*, model, optimizer, config, mpu, **rest):
        seen.update(config=json.loads(json.dumps(config)), model=model)
        raise _Captured

    monkeypatch.setattr(deepspeed, "initialize", initialize)
    monkeypatch.setattr(deepspeed_zero, "ensure_process_group", lambda state: None)
    args = _args(ds_json)
    model = build_model(args.model, None, device="cpu", seed=0)
    with pytest.raises(_Captured):
        deepspeed_zero.DeepSpeedEngine(model, ParallelState.single(), args)
    assert "sparse_attention" not in seen["config"]
    assert seen["config"]["zero_optimization"] == OTHER["zero_optimization"]
    assert seen["config"]["communication_data_type"] == "fp32"
    sparse = seen["model"].config.sparse
    assert (sparse.mode, sparse.block, sparse.num_local_blocks, sparse.attention) == \
        ("fixed", 16, 2, "unidirectional") and sparse.different_layout_per_head
    assert json.loads(open(ds_json).read())["sparse_attention"] == SECTION  # file untouched


def _one_deepspeed_step(json_path: str) -> tuple[float, dict]:
    import torch

    from megazoo.models import build_model
    from megazoo.parallel import ParallelState
    from megazoo.training.backends.deepspeed_zero import DeepSpeedEngine

    args, state = _args(json_path), ParallelState.single()
    model = build_model(args.model, state, device="cpu", seed=0)
    engine = DeepSpeedEngine(model, state, args)
    ids = torch.randint(0, args.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    result = engine.train_step([{"input_ids": ids, "labels": ids}])
    return result.loss, engine.model.config.sparse_attention


def test_deepspeed_engine_trains_a_step_with_the_seeds_section(ds_json):
    """With the real DeepSpeed: the engine builds from a ds_config holding the section and
    its model runs the sparse layout."""
    pytest.importorskip("deepspeed")
    loss, section = run_distributed(_one_deepspeed_step, 1, ds_json, timeout=300)[0]
    assert loss == loss and loss > 0  # finite
    assert section["mode"] == "fixed" and section["block"] == 16
