"""`megazoo.pipeline.forward` at pp = 2 (and tp x pp, vpp) against the one-process model."""
import pytest
import torch

from megazoo.models import ModelConfig, build_model
from megazoo.parallel import ParallelConfig, ParallelState
from megazoo.pipeline import forward
from megazoo.testing import run_distributed

CFG = ModelConfig(family="gpt", num_layers=4, hidden_size=32, num_attention_heads=4,
                  vocab_size=300, max_position_embeddings=32)
TOL = dict(rtol=1e-4, atol=1e-5)  # fp32, the same sums in another order (tp splits them)


def _ids():
    return torch.randint(0, 300, (4, 8), generator=torch.Generator().manual_seed(5))


def _reference():
    model = build_model(CFG, None, device="cpu", seed=0)
    with torch.no_grad():
        return model(_ids()), model(_ids(), labels=_ids())


def _ranks(tp: int, pp: int, vpp: int) -> list:
    state = ParallelState.initialize(ParallelConfig(tp=tp, pp=pp, vpp=vpp))
    model = build_model(CFG, state, device="cpu", seed=0)
    logits = forward(model, _ids(), state)
    loss = forward(model, _ids(), state, labels=_ids())
    split = forward(model, _ids(), state, num_microbatches=2)
    everywhere = forward(model, _ids(), state, labels=_ids(), broadcast=True)
    return [state.is_last_stage, logits, loss, split, everywhere]


@pytest.mark.parametrize("tp, pp, vpp", [(1, 2, 1), (2, 2, 1), (1, 2, 2)])
def test_pipeline_forward_matches_one_process(tp, pp, vpp):
    ref_logits, ref_loss = _reference()
    for last, logits, loss, split, everywhere in run_distributed(_ranks, tp * pp, tp, pp, vpp,
                                                                 timeout=180):
        torch.testing.assert_close(everywhere, ref_loss, **TOL)
        if not last:
            assert logits is None and loss is None and split is None
            continue
        torch.testing.assert_close(logits, ref_logits, **TOL)
        torch.testing.assert_close(split, ref_logits, **TOL)
        torch.testing.assert_close(loss, ref_loss, **TOL)


def test_one_stage_is_the_model_and_bad_input_is_a_value_error():
    model = build_model(CFG, None, device="cpu", seed=0)
    ref_logits, _ = _reference()
    torch.testing.assert_close(forward(model, _ids()), ref_logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="divide the batch 4"):
        forward(model, _ids(), num_microbatches=3)
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        forward(model, _ids()[0])
