"""Checkpoints: save at one layout (4 gloo ranks), load into others; atomicity; clear errors.

Reference: the one-process model with the same seed. Weights and aux tensors move through a
checkpoint as copies of slices, so they must come back bit for bit (torch.equal). Logits of a
model loaded at tp=1, pp=1 equal the one-process logits bit for bit (same weights, same
arithmetic); logits of a model loaded at another parallel layout are compared with
model_checks.TOL (rtol 1e-4, atol 1e-5: the same sums in another order, see model_checks).
"""
import json
import os

import pytest
import torch

from megazoo import load_pretrained, save_checkpoint
from megazoo.checkpoint import CheckpointReader, load_model_weights, write_checkpoint
from megazoo.checkpoint import files as ckpt_files
from megazoo.layers import tp_slice
from megazoo.models import ModelConfig, build_model, full_name
from megazoo.parallel import ParallelConfig, ParallelState
from megazoo.pipeline.executor import run_pipeline
from megazoo.testing import run_distributed
from helpers.model_checks import TOL
from helpers.fixtures import tiny_config

VOCAB, B, S = 300, 2, 8
# (family, save tp, save pp, load tp, load pp, load vpp): every save layout, each family once
# at least, tied embeddings across stages (gpt/bloom at pp=2), GQA llama resharded to vpp=2.
CASES = [("gpt", 1, 1, 2, 2, 1), ("llama", 2, 1, 1, 2, 2), ("bloom", 1, 2, 2, 1, 1),
         ("gpt", 2, 2, 1, 2, 2), ("llama", 2, 2, 2, 1, 1)]


def tiny(family: str, **extra) -> ModelConfig:
    """4 layers (pp = 2 x vpp = 2), h 32, 4 heads; "llama" 2 kv heads, "llama-mqa" one."""
    return tiny_config(family, num_layers=4, hidden_size=32, num_attention_heads=4,
                       max_position_embeddings=16, **extra)


def ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(7))


def full_aux(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A layout-independent fake optimizer moment per full parameter."""
    g = torch.Generator().manual_seed(3)
    model = build_model(cfg, None, device="meta")
    from megazoo.layers.sharding import full_shape
    return {n: torch.randn(full_shape(p, 1), generator=g) for n, p in model.named_parameters()}


def real(t: torch.Tensor, p: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """The rows of a vocab-padded shard that are real vocabulary (all rows otherwise)."""
    unpadded = getattr(p, "tp_unpadded", None)
    if unpadded is None:
        return t
    return t[:max(0, min(p.shape[0], unpadded - tp_rank * p.shape[0]))]


def forward(model, state: ParallelState, x: torch.Tensor):
    """Full logits on the last stage (None elsewhere), pipelined when pp > 1."""
    with torch.no_grad():
        if state.pp.size == 1:
            return model(x)
        out = run_pipeline(model, [(x, None)] * state.pp.size, state, forward_only=True)
        return None if out is None else out[0]


def _check_case(case, root: str) -> list[str]:
    family, tp, pp, ltp, lpp, lvpp = case
    cfg, tag, errors = tiny(family), "-".join(map(str, case)), []
    ref = build_model(cfg, None, device="cpu", seed=0)
    ref_w = {n: p.detach() for n, p in ref.named_parameters()}
    ref_logits = forward(ref, ParallelState.single(), ids())
    aux_full = full_aux(cfg)
    state = ParallelState.initialize(ParallelConfig(tp=tp, pp=pp))
    model = build_model(cfg, state, device="cpu", seed=0)
    aux = {"exp_avg": {n: tp_slice(aux_full[full_name(n, p)], p, state.tp.rank, tp)
                       for n, p in model.named_parameters()}}
    path = os.path.join(root, tag)
    save_checkpoint(model, path, state=state, extra={"step": 5}, aux=aux)
    one = load_pretrained(path)  # one process, in every rank
    if not torch.equal(one(ids()), ref_logits):
        errors.append(f"{tag}: tp1 pp1 logits differ from the one-process model")
    other = ParallelState.initialize(ParallelConfig(tp=ltp, pp=lpp, vpp=lvpp))
    loaded = build_model(cfg, other, device="cpu", seed=1)  # other seed: weights must come from disk
    meta, got = load_model_weights(loaded, path, state=other, aux_prefixes=("exp_avg",))
    if meta["extra"] != {"step": 5} or meta["layout"] != {"tp": tp, "pp": pp, "vpp": 1}:
        errors.append(f"{tag}: metadata {meta['extra']} {meta['layout']}")
    r = other.tp.rank
    for n, p in loaded.named_parameters():
        fname = full_name(n, p)
        if not torch.equal(real(p.detach(), p, r), real(tp_slice(ref_w[fname], p, r, ltp), p, r)):
            errors.append(f"{tag}: weight {n} differs after resharding")
        if not torch.equal(got["exp_avg"][n], tp_slice(aux_full[fname], p, r, ltp)):
            errors.append(f"{tag}: aux exp_avg {n} differs after resharding")
    logits = forward(loaded, other, ids())
    if logits is not None and not torch.allclose(logits, ref_logits, **TOL):
        errors.append(f"{tag}: logits at tp{ltp} pp{lpp} vpp{lvpp} differ")
    return errors


def _check_crash(root: str) -> list[str]:
    """Rank 3 fails mid-write while saving over a checkpoint: every rank raises, the old
    checkpoint stays, no temp dir is left."""
    cfg, path = tiny("gpt"), os.path.join(root, "crash")
    state = ParallelState.initialize(ParallelConfig(tp=2, pp=2))
    save_checkpoint(build_model(cfg, state, device="cpu", seed=0), path, state=state)
    newer = build_model(cfg, state, device="cpu", seed=1)
    real_write, errors = ckpt_files.SafetensorsWriter.write, []

    def failing_write(self, key, tensor):
        raise OSError("disk full (simulated)")

    if state.global_rank == 3:
        ckpt_files.SafetensorsWriter.write = failing_write
    try:
        save_checkpoint(newer, path, state=state, overwrite=True)
        errors.append(f"rank {state.global_rank}: a failed save did not raise")
    except (OSError, RuntimeError):
        pass
    finally:
        ckpt_files.SafetensorsWriter.write = real_write
    ref = build_model(cfg, None, device="cpu", seed=0)
    if not torch.equal(load_pretrained(path)(ids()), ref(ids())) or os.path.exists(path + ".megazoo-tmp"):
        errors.append(f"rank {state.global_rank}: the previous checkpoint was damaged")
    return errors


def check_save_and_reshard(root: str) -> list[str]:
    """Rank side: every case of CASES on a 4-rank world (dp fills the rest), then a crash."""
    return [e for case in CASES for e in _check_case(case, root)] + _check_crash(root)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpts"))
    results = run_distributed(check_save_and_reshard, 4, root, timeout=240)
    return root, sorted({e for r in results for e in r})


def test_save_at_layout_load_at_other_layout(saved):
    """(tp, pp) saves (1,1) (2,1) (1,2) (2,2) -> loads at other tp/pp/vpp: weights and aux
    exact, logits exact at one process and within TOL in parallel; a rank failing mid-save
    makes every rank raise and keeps the previous checkpoint."""
    root, errors = saved
    assert errors == [], "\n".join(errors[:30])
    for case in CASES:
        path = os.path.join(root, "-".join(map(str, case)))
        assert sorted(os.listdir(path)) == sorted(
            ["megazoo.json"] + [f"model-pp{p:03d}-tp{t:03d}.safetensors"
                                for p in range(case[2]) for t in range(case[1])])
        assert not os.path.exists(path + ".megazoo-tmp")


def test_reader_full_tensor_equals_one_process_parameter(saved):
    root, _ = saved
    for case in CASES:
        reader = CheckpointReader(os.path.join(root, "-".join(map(str, case))))
        ref = build_model(tiny(case[0]), None, device="cpu", seed=0)
        aux_full = full_aux(tiny(case[0]))
        assert sorted(reader.names()) == sorted(n for n, _ in ref.named_parameters())
        for n, p in ref.named_parameters():
            assert torch.equal(reader.full_tensor(n), real(p.detach(), p, 0)), n
            assert torch.equal(reader.full_tensor(n, "exp_avg"), aux_full[n]), n


@pytest.mark.parametrize("family", ["gpt", "llama", "llama-mqa"])
def test_write_checkpoint_tp2_pp2_loads_as_one_process_model(tmp_path, family):
    cfg = tiny(family)
    ref = build_model(cfg, None, device="cpu", seed=0)
    weights = {n: real(p.detach(), p, 0) for n, p in ref.named_parameters()}
    write_checkpoint(cfg, tmp_path / "c", weights.__getitem__, tp=2, pp=2)
    meta = json.loads((tmp_path / "c" / "megazoo.json").read_text())
    assert meta["format"] == "megazoo-checkpoint-1" and len(meta["files"]) == 4
    loaded = load_pretrained(tmp_path / "c")
    assert torch.equal(loaded(ids()), ref(ids()))
    reader = CheckpointReader(tmp_path / "c")
    for name, t in weights.items():
        assert torch.equal(reader.full_tensor(name), t), name


def _one_process_checkpoint(path, seed=0, **cfg_extra):
    model = build_model(tiny("gpt", **cfg_extra), None, device="cpu", seed=seed)
    save_checkpoint(model, path)
    return model


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "c"
    old = _one_process_checkpoint(path, seed=0)
    calls = []

    def failing_write(self, key, tensor):
        calls.append(key)
        if len(calls) == 3:
            raise OSError("disk full (simulated)")
        return real_write(self, key, tensor)

    real_write = ckpt_files.SafetensorsWriter.write
    monkeypatch.setattr(ckpt_files.SafetensorsWriter, "write", failing_write)
    new = build_model(tiny("gpt"), None, device="cpu", seed=1)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(new, path, overwrite=True)
    calls.clear()
    weights = {n: real(p.detach(), p, 0) for n, p in new.named_parameters()}
    with pytest.raises(OSError, match="disk full"):
        write_checkpoint(tiny("gpt"), path, weights.__getitem__, tp=2, overwrite=True)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["c"]  # no temp dir, no partial checkpoint
    assert torch.equal(load_pretrained(path)(ids()), old(ids()))


def test_checkpoint_of_another_model_is_a_clear_error(tmp_path):
    _one_process_checkpoint(tmp_path / "c")
    wider = build_model(ModelConfig(family="gpt", num_layers=4, hidden_size=64, num_attention_heads=4,
                                    vocab_size=VOCAB, max_position_embeddings=16), None, device="meta")
    with pytest.raises(ValueError, match="checkpoint is a gpt with hidden 32.*model has 64"):
        load_model_weights(wider, tmp_path / "c")
    llama = build_model(tiny("llama"), None, device="meta")
    with pytest.raises(ValueError, match="checkpoint is a gpt with family gpt"):
        load_model_weights(llama, tmp_path / "c")


def test_missing_or_truncated_shard_is_a_clear_error(tmp_path):
    cfg = tiny("gpt")
    ref = build_model(cfg, None, device="cpu", seed=0)
    weights = {n: real(p.detach(), p, 0) for n, p in ref.named_parameters()}
    write_checkpoint(cfg, tmp_path / "c", weights.__getitem__, tp=2)
    shard = tmp_path / "c" / "model-pp000-tp001.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model-pp000-tp001.safetensors is damaged or truncated"):
        load_pretrained(tmp_path / "c")
    shard.unlink()
    with pytest.raises(ValueError, match="model-pp000-tp001.safetensors is missing"):
        CheckpointReader(tmp_path / "c")
    os.rename(tmp_path / "c", tmp_path / "c.megazoo-old")  # as a crash between the two renames leaves it
    with pytest.raises(ValueError, match="previous checkpoint at .*c.megazoo-old"):
        CheckpointReader(tmp_path / "c")
    with pytest.raises(ValueError, match="not a megazoo checkpoint"):
        CheckpointReader(tmp_path)


def test_bad_layout_or_aux_fails_before_writing(tmp_path):
    model = build_model(tiny("gpt"), None, device="cpu")
    moments = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="not a parameter of this model"):
        save_checkpoint(model, tmp_path / "c", aux={"m": {**moments, "nope": torch.zeros(1)}})
    with pytest.raises(ValueError, match="lacks parameters"):
        save_checkpoint(model, tmp_path / "c", aux={"m": {"final_norm.weight": torch.zeros(32)}})
    with pytest.raises(ValueError, match="num_heads \\(4\\) is not divisible by tp"):
        write_checkpoint(tiny("gpt"), tmp_path / "c", lambda n: None, tp=3)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("family", ["gpt", "bloom", "llama"])
def test_load_pretrained_skips_init_and_gives_identical_logits(tmp_path, family, monkeypatch):
    """load_pretrained builds on the meta device and allocates without the random init (no
    NormalInit fills a real tensor), keeps every parameter's sharding attributes, and its
    logits equal the saved model's bit for bit. No model has buffers to recompute (RoPE and
    ALiBi factors are made in each forward); one with a buffer is not materialised."""
    from megazoo.checkpoint.load import can_materialize
    from megazoo.layers.init import NormalInit

    saved = build_model(tiny(family), None, device="cpu", seed=5)
    save_checkpoint(saved, tmp_path / "c")
    filled = []
    fill = NormalInit.fill_
    monkeypatch.setattr(NormalInit, "fill_", lambda self, shard, *a: (
        filled.append(shard.device.type), fill(self, shard, *a))[1])
    loaded = load_pretrained(tmp_path / "c")
    assert filled and set(filled) == {"meta"}
    assert torch.equal(loaded(ids()), saved(ids()))
    for (name, p), (_, q) in zip(loaded.named_parameters(), saved.named_parameters(), strict=True):
        assert p.device.type == "cpu" and vars(p).keys() == vars(q).keys(), name
        assert torch.equal(real(p.detach(), p, 0), real(q.detach(), q, 0)), name
    assert next(loaded.buffers(), None) is None and can_materialize(build_model(tiny(family)))
    with_buffer = torch.nn.Linear(2, 2, device="meta")
    with_buffer.register_buffer("cache", torch.zeros(2, device="meta"))
    assert not can_materialize(with_buffer)
