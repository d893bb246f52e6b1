"""The offload's bucket rule is one function (`megazoo.offload.buckets`): the planner's bucket
sizes equal the engine's `grad_buffer._layout` on the same parameters, a deferred parameter
(a tied embedding's copy on a pipeline end) included, and the host share the planner counts
is the engine's."""
import torch

from megazoo.offload import bucket_elements_of, host_slots
from megazoo.training.backends.cpu_offload import host_share
from megazoo.training.backends.grad_buffer import _layout


def test_planner_buckets_equal_the_engines_with_a_deferred_parameter():
    sizes = [700, 30, 30, 400, 50, 50, 400, 90, 5, 700]  # forward order: embedding first
    params = [torch.empty(n, device="meta") for n in sizes]
    for bucket, pad, deferred in ((500, 1, set()), (500, 4, {0}), (100, 2, {0}), (10_000, 8, {0})):
        _, engine, total = _layout(params[::-1], bucket, pad, {id(params[i]) for i in deferred})
        planned = bucket_elements_of(sizes, bucket, pad, deferred)
        assert planned == [b.numel for b in engine] and sum(planned) == total
        assert [b.deferred for b in engine].count(True) == len(deferred)
        for fraction in (0.0, 0.3, 0.7, 1.0):
            shared = sorted(host_share(engine, fraction))
            assert host_slots(planned, fraction, 1) == [planned[i] for i in shared]
