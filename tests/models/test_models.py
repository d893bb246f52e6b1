"""Whole models: parallel layouts vs one process (4 gloo ranks), pipeline stages, metadata."""
import dataclasses

import pytest
import torch

from helpers import model_checks
from megazoo.layers import FusedColumnParallelLinear, set_tp_layout, tp_slice, tp_unslice
from megazoo.layers.sharding import full_shape, tp_dim_of
from megazoo.models import (BloomModel, ModelConfig, TransformerModel, build_model, full_name,
                            layer_ranges)
from megazoo.parallel import GroupInfo, ParallelConfig, ParallelState
from megazoo.testing import run_distributed


def test_parallel_layouts_match_single_process():
    """gpt, bloom, llama (GQA), llama (MQA) x (tp, sp) in (1,1) (2,1) (1,2) (2,2), with and
    without Megatron SP; plus full/selective recompute at tp2 sp2 SP."""
    results = run_distributed(model_checks.check_families, 4, timeout=240)
    errors = sorted({e for r in results for e in r})
    assert errors == [], "\n".join(errors[:40])


def test_config_defaults_per_family():
    bloom = ModelConfig(family="bloom", num_layers=2, hidden_size=64, num_attention_heads=8,
                        vocab_size=1000, max_position_embeddings=128)
    assert (bloom.position_embedding, bloom.embedding_layernorm, bloom.tie_word_embeddings) == ("alibi", True, True)
    llama = ModelConfig(family="llama", hidden_size=4096, num_attention_heads=32)
    assert (llama.norm, llama.activation, llama.ffn_hidden_size, llama.qkv_bias) == ("rmsnorm", "swiglu", 11008, False)
    assert ModelConfig(family="gpt").ffn_hidden_size == 4 * 64


@pytest.mark.parametrize("bad, message", [
    (dict(family="t5"), "family must be one of"),
    (dict(hidden_size=65), "must divide by num_attention_heads"),
    (dict(num_key_value_heads=3), "multiple of num_key_value_heads"),
    (dict(recompute="some"), "recompute must be one of"),
    (dict(padded_vocab_size=10), "smaller than vocab_size"),
])
def test_config_validation(bad, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**bad)


def test_family_class_checks_config():
    with pytest.raises(ValueError, match="BloomModel needs family='bloom'"):
        BloomModel(model_checks.tiny_config("gpt"))


def test_sequence_longer_than_position_table_raises():
    model = build_model(model_checks.tiny_config("gpt"), device="cpu")
    with pytest.raises(ValueError, match="exceeds max_position_embeddings"):
        model(torch.zeros(1, 65, dtype=torch.long))


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_pipeline_stages_and_virtual_chunks_match_whole_model(family):
    """Two stages of two virtual chunks each (4 layers): same weights by name, same loss and,
    for the tied embedding, head-copy + embedding gradients summing to the whole model's."""
    cfg = dataclasses.replace(model_checks.tiny_config(family), num_layers=4)
    whole = build_model(cfg, device="cpu", seed=3)
    ids, labels = model_checks.batch()
    loss_ref = whole(ids, labels=labels)
    loss_ref.backward()
    stages = [TransformerModel(cfg, layers=layer_ranges(4, 2, 2, r), pre_process=r == 0,
                               post_process=r == 1, seed=3, device="cpu") for r in range(2)]
    assert [s.chunks for s in stages] == [[range(0, 1), range(2, 3)], [range(1, 2), range(3, 4)]]
    ref_params = dict(whole.named_parameters())
    grads = {}
    for stage in stages:
        for name, p in stage.named_parameters():
            assert torch.equal(p, ref_params[full_name(name, p)]), name
    h = stages[0](ids, chunk=0)
    h = stages[1](hidden_states=h, chunk=0)
    h = stages[0](hidden_states=h, chunk=1)
    loss = stages[1](hidden_states=h, labels=labels, chunk=1)
    loss.backward()
    torch.testing.assert_close(loss, loss_ref, rtol=0, atol=0)
    for stage in stages:
        for name, p in stage.named_parameters():
            key = full_name(name, p)
            grads[key] = grads.get(key, 0) + p.grad
    for name, p in whole.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-6, atol=1e-7)


def test_tp_slice_roundtrip_fused_and_padded():
    full = torch.arange(24.0).view(6, 4)  # two fused blocks of 2 and 4 rows
    p = torch.nn.Parameter(torch.empty(3, 4))
    set_tp_layout(p, 0, parts=(2, 4))
    shards = [tp_slice(full, p, r, 2) for r in range(2)]
    assert torch.equal(shards[0], full[[0, 2, 3]]) and torch.equal(shards[1], full[[1, 4, 5]])
    assert torch.equal(tp_unslice(shards, p), full)
    emb = torch.nn.Parameter(torch.empty(4, 3))
    set_tp_layout(emb, 0, unpadded=5)
    table = torch.arange(15.0).view(5, 3)
    shards = [tp_slice(table, emb, r, 2) for r in range(2)]
    assert shards[1].shape == (4, 3) and torch.equal(shards[1][1:], torch.zeros(3, 3))
    assert torch.equal(tp_unslice(shards, emb), table)


def test_fused_column_layout_matches_unfused_slices():
    torch.manual_seed(0)
    full = FusedColumnParallelLinear(8, (6, 6), group=None)
    assert full.weight.tp_parts == (6, 6)
    params = dict(build_model(model_checks.tiny_config("llama"), device="meta").named_parameters())
    fc1 = params["layers.0.mlp.fc1.weight"]
    assert tp_dim_of(fc1) == 0 and fc1.tp_parts == (256, 256) and full_shape(fc1, 1) == (512, 64)
    head = params["output_layer.weight"]
    assert head.tp_unpadded == 300 and full_shape(head, 1) == (300, 64)
    assert tp_dim_of(params["layers.1.mlp.fc2.weight"]) == 1


def _fake_tp_state(tp: int, rank: int, sequence_parallel: bool = False) -> ParallelState:
    """A state that builds rank `rank` of a tp group without processes (construction only)."""
    config = ParallelConfig(tp=tp, sequence_parallel=sequence_parallel).resolve(tp)
    one = GroupInfo.single(rank)
    tp_info = GroupInfo(group=None, ranks=tuple(range(tp)), rank=rank)
    return ParallelState(config, rank, tp, tp_info, one, one, one, one, one)


@pytest.mark.parametrize("family, tp", [("gpt", 2), ("bloom", 4), ("llama", 2), ("llama-mqa", 4)])
def test_tp_unslice_of_every_rank_rebuilds_the_one_process_model(family, tp):
    """Layout-independent init + metadata: the tp ranks' shards, put together by
    `tp_unslice`, are the one-process weights (the core of checkpoint resharding)."""
    cfg = model_checks.tiny_config(family)
    ref = dict(build_model(cfg, device="cpu", seed=9).named_parameters())
    ranks = [dict(build_model(cfg, _fake_tp_state(tp, r), device="cpu", seed=9).named_parameters())
             for r in range(tp)]
    for name, p in ranks[0].items():
        full = tp_unslice([m[name].detach() for m in ranks], p)
        expected = ref[full_name(name, p)].detach()
        assert torch.equal(full, expected[:full.shape[0]]), name


def test_check_inputs_off_gives_the_same_loss_and_on_names_bad_ids():
    """check_inputs=False (the training engines: data checked at start) skips the device sync
    of the id checks and computes the same loss; the default still names a bad id or label."""
    cfg = ModelConfig(family="llama", num_layers=2, hidden_size=32, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=50)
    model = build_model(cfg, None, device="cpu", seed=0)
    ids = torch.randint(0, 50, (2, 12))
    checked = model(ids, labels=ids)
    model.check_inputs = False
    assert torch.equal(model(ids, labels=ids), checked)
    model.check_inputs = True
    with pytest.raises(ValueError, match="token id 50 is outside the vocabulary"):
        model(torch.full((2, 12), 50), labels=ids)
    bad_labels = ids.clone()
    bad_labels[0, 5] = 77
    with pytest.raises(ValueError, match="target 77 is outside the vocabulary"):
        model(ids, labels=bad_labels)


def test_rope_factors_from_the_cache_equal_fresh_ones():
    from megazoo.layers.positions import rope_cos_sin, rope_cos_sin_first

    cached = rope_cos_sin_first(24, 16, 10000.0, torch.float32, torch.device("cpu"))
    again = rope_cos_sin_first(24, 16, 10000.0, torch.float32, torch.device("cpu"))
    fresh = rope_cos_sin(torch.arange(24), 16, 10000.0)
    assert cached[0] is again[0]  # computed once
    for a, b in zip(cached, fresh):
        assert torch.equal(a, b)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_embedding_starts_a_contiguous_s_b_h_stream(family):
    """The embedding's output [s, b, h] is contiguous (not a transposed [b, s, h] view: that
    layout would follow the residual stream through every block, each residual add strided
    and each norm copying its input) and holds each sequence's embedded ids."""
    model = build_model(model_checks.tiny_config(family), device="cpu", seed=0)
    ids = torch.randint(0, model.config.vocab_size, (3, 10))
    for check in (True, False):
        x = model.embedding(ids, 0, check=check)
        assert x.shape == (10, 3, model.config.hidden_size) and x.is_contiguous()
        words = model.embedding.word_embeddings.weight[ids[1]]  # sequence 1, [s, h]
        if model.embedding.position_embeddings is not None:
            words = words + model.embedding.position_embeddings[:10]
        torch.testing.assert_close(x[:, 1], words, rtol=0, atol=0)
