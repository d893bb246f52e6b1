"""Ring attention (context parallelism) on gloo rings of 2 and 4 ranks against one process
(ring_checks.py: outputs and q / k / v gradients, MHA, GQA 8 per kv head, MQA, ALiBi, 512
tokens), and its refusals."""
import re

import pytest

from helpers import ring_checks
from megazoo.config.layout import check_sequence_split, context_parallel_chunks
from megazoo.testing import run_distributed


@pytest.mark.parametrize("ranks", [2, 4])
def test_ring_matches_single_process(ranks):
    worst = run_distributed(ring_checks.check_ring, ranks, timeout=240)
    assert max(worst) < 1e-5  # asserted per tensor on the ranks; here for the record


# On 2 GPUs, NCCL: the CUDA block kernels (bf16, head_dim 64) against the float32 reference.
@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("kernel", ["flash", "cudnn"])
def test_ring_cuda_kernels_match_single_process(kernel):
    import torch

    if kernel == "cudnn" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("cuDNN attention is picked from Hopper on")
    worst = run_distributed(ring_checks.check_ring, 2, "cuda", kernel, torch.bfloat16, 64,
                            timeout=600, backend="nccl")
    assert max(worst) < 2e-2


def test_chunks_mirror_and_cover_the_sequence():
    cp, s = 4, 64
    chunks = [context_parallel_chunks(s, cp, r) for r in range(cp)]
    assert chunks[0] == (range(0, 8), range(56, 64))
    assert chunks[3] == (range(24, 32), range(32, 40))
    assert sorted(i for pair in chunks for c in pair for i in c) == list(range(s))
    # causal work (keys before each query) is the same on every rank
    work = [sum(i + 1 for c in pair for i in c) for pair in chunks]
    assert len(set(work)) == 1


@pytest.mark.parametrize("seq, kwargs, message", [
    (30, dict(cp=4), "sequence length 30 must divide by 2*cp = 8"),
    (15, dict(cp=2), "sequence length 15 must divide by 2*cp = 4"),
    (20, dict(cp=2, sp=4), "must divide by 8 (cp=2 x Ulysses sp=4)"),
    (24, dict(cp=2, sp=2, tp=4, megatron_sp=True),
     "must divide by 16 (cp=2 x Ulysses sp=2 x Megatron SP tp=4)"),
])
def test_sequence_split_refusals(seq, kwargs, message):
    args = dict(tp=1, sp=1, megatron_sp=False) | kwargs
    with pytest.raises(ValueError, match=re.escape(message)):
        check_sequence_split(seq, args["tp"], args["sp"], args["megatron_sp"], args["cp"])


def _fake_cp_group(size: int = 2):
    from megazoo.parallel import GroupInfo

    return GroupInfo(group=None, ranks=tuple(range(size)), rank=0)  # no process: checks only


@pytest.mark.parametrize("kwargs, message", [
    (dict(attention_dropout=0.1), "set attention_dropout=0 and causal=True, or cp=1"),
    (dict(causal=False), "set attention_dropout=0 and causal=True, or cp=1"),
])
def test_context_parallel_attention_refuses_what_the_ring_does_not_compute(kwargs, message):
    from megazoo.layers.context_parallel import ContextParallelAttention

    with pytest.raises(ValueError, match=re.escape(message)):
        ContextParallelAttention(4, 8, cp_group=_fake_cp_group(), **kwargs)


def test_padding_mask_is_refused_before_any_communication():
    import torch

    from megazoo.layers.context_parallel import ContextParallelAttention

    layer = ContextParallelAttention(4, 8, cp_group=_fake_cp_group())
    qkv = torch.zeros(8, 2, 4 * 3 * 8)
    with pytest.raises(ValueError, match="context parallelism takes no padding_mask"):
        layer(qkv, torch.ones(2, 16, dtype=torch.bool))
    with pytest.raises(ValueError, match=re.escape("position_ids must be [s] or [b, s]")):
        layer(qkv, None, torch.arange(8))  # the local length, not the full sequence's 16


@pytest.mark.parametrize("flags, message", [
    (["--context-parallel-size", "2", "--attention-dropout", "0.1"],
     "--context-parallel-size 2 needs --attention-dropout 0"),
    (["--context-parallel-size", "2", "--seq-length", "30"],
     "sequence length 30 must divide by 2*cp = 4"),
])
def test_run_flags_refused_with_context_parallelism(flags, message):
    from megazoo.config.flags import parse_args

    with pytest.raises(ValueError, match=re.escape(message)):
        parse_args(flags)
