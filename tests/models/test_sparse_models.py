"""Whole models with block-sparse attention (ModelConfig.sparse_attention): one process against
dense attention with the layout as an explicit boolean mask, and parallel layouts (tp, Ulysses
sp, both) against one process (sparse_model_checks.py)."""
import dataclasses
import json

import pytest
import torch

from helpers import sparse_model_checks as checks
from megazoo.checkpoint.load import config_from_dict
from megazoo.layers import attention, ulysses
from megazoo.layers.sparse import token_mask
from megazoo.layers.sparse.layouts import layout
from megazoo.models import build_model
from megazoo.testing import run_distributed

TOL = dict(rtol=1e-5, atol=1e-6)  # the same float32 math; only the mask's construction differs


def _masked_reference(cfg):
    """core_attention replaced by float32 math with the layout (all heads, one process) as an
    explicit [h, s, s] mask plus causality."""
    sparse = cfg.sparse

    def masked(q, k, v, *, causal, padding_mask, alibi_slopes, dropout_p, backend):
        lay = layout(sparse, cfg.num_attention_heads, q.shape[0], causal=True)
        mask = token_mask(lay, sparse.block)[None]
        return attention.math_attention(q, k, v, True, None, alibi_slopes, q.shape[-1] ** -0.5,
                                        0.0, mask=mask)
    return masked


@pytest.mark.parametrize("family", ["gpt", "bloom", "llama"])
def test_one_process_sparse_model_equals_dense_with_mask(family, monkeypatch):
    cfg = checks.config(family)
    ids, _ = checks.batch()
    with torch.no_grad():
        sparse_logits = build_model(cfg, None, device="cpu", seed=0)(ids)
        dense_cfg = dataclasses.replace(cfg, sparse_attention=None)
        dense_logits = build_model(dense_cfg, None, device="cpu", seed=0)(ids)
        monkeypatch.setattr(ulysses, "core_attention", _masked_reference(cfg))
        masked_logits = build_model(dense_cfg, None, device="cpu", seed=0)(ids)
    assert not torch.allclose(sparse_logits, dense_logits, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(sparse_logits, masked_logits, **TOL)


def test_dense_mode_equals_dense_attention():
    cfg = checks.config("llama")
    ids, _ = checks.batch()
    with torch.no_grad():
        a = build_model(dataclasses.replace(cfg, sparse_attention={"mode": "dense", "block": 16}),
                        None, device="cpu", seed=0)(ids)
        b = build_model(dataclasses.replace(cfg, sparse_attention=None), None, device="cpu",
                        seed=0)(ids)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # math vs the default kernel


def test_parallel_layouts_match_one_process_sparse_model():
    """tp=2 (Megatron SP), Ulysses sp=2 and tp=2 x sp=2 for GPT (bigbird), BLOOM (fixed,
    ALiBi) and LLaMA (bslongformer, RoPE, GQA): loss, logits and gradients."""
    results = run_distributed(checks.check_sparse_layouts, 4, timeout=300)
    errors = sorted({e for r in results for e in r})
    assert errors == [], "\n".join(errors[:40])


def test_config_keeps_sparse_section_through_json():
    cfg = checks.config("gpt")
    back = config_from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert back.sparse == cfg.sparse and back.sparse.mode == "bigbird"


@pytest.mark.parametrize("fields, message", [
    (dict(sparse_attention={"mode": "fixed", "attention_dropout": 0.1}), "unknown key"),
    (dict(sparse_attention={"mode": "fixed"}, attention_dropout=0.1), "attention_dropout"),
    (dict(sparse_attention={"mode": "nope"}), "unknown sparse attention mode"),
])
def test_bad_sparse_config_is_one_line(fields, message):
    with pytest.raises(ValueError, match=message):
        checks.config("gpt").__class__(**{**checks.config("gpt").to_dict(), **fields})


def test_sequence_not_multiple_of_block_is_the_padded_runs_prefix():
    """40 tokens at block 16: the layout of 48 tokens, cut to 40 (a short last block), so the
    causal model's logits equal those of the same tokens right-padded to 48."""
    model = build_model(checks.config("gpt"), None, device="cpu", seed=0)
    ids = torch.randint(0, 100, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids[:, :40]), model(ids)[:, :40], **TOL)
