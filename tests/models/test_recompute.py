"""Activation recompute: gradients with and without it are identical.

On CPU in fp32 with dropout 0 the recomputed forward repeats exactly the same operations on
the same inputs, so gradients must match bit for bit (torch.equal). With dropout > 0,
checkpointing restores the RNG state, so the masks, and hence gradients, also repeat exactly.
"""
import dataclasses

import pytest
import torch

from helpers import model_checks
from megazoo.models import build_model


def _grads(cfg, dropout=0.0):
    cfg = dataclasses.replace(cfg, hidden_dropout=dropout, attention_dropout=dropout)
    model = build_model(cfg, device="cpu", seed=5)
    ids, labels = model_checks.batch()
    torch.manual_seed(0)
    loss = model(ids, labels=labels)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, model


@pytest.mark.parametrize("family", ["gpt", "bloom", "llama"])
@pytest.mark.parametrize("mode, layers", [("full", None), ("selective", None), ("full", 1)])
def test_recompute_gives_identical_gradients(family, mode, layers):
    base = model_checks.tiny_config(family)
    loss_ref, ref, _ = _grads(base)
    loss, grads, model = _grads(dataclasses.replace(base, recompute=mode, recompute_num_layers=layers))
    assert [model.layers[str(i)].recompute for i in range(2)] == (
        [mode, mode] if layers is None else [mode, "none"])
    assert torch.equal(loss, loss_ref)
    for name, g in ref.items():
        assert torch.equal(grads[name], g), name


def test_recompute_with_dropout_repeats_masks():
    base = model_checks.tiny_config("gpt")
    loss_ref, ref, _ = _grads(base, dropout=0.1)
    loss, grads, _ = _grads(dataclasses.replace(base, recompute="full"), dropout=0.1)
    assert torch.equal(loss, loss_ref)
    assert all(torch.equal(grads[n], g) for n, g in ref.items())


def test_recompute_saves_activations():
    """Full recompute keeps fewer tensors for backward (checked via saved-tensor hooks)."""
    def saved_bytes(mode):
        model = build_model(dataclasses.replace(model_checks.tiny_config("gpt"), recompute=mode),
                            device="cpu")
        ids, labels = model_checks.batch()
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(ids, labels=labels)
        return total[0]
    assert saved_bytes("full") < saved_bytes("selective") < saved_bytes("none")
