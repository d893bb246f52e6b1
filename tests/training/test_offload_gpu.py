"""The overlapped offload on a GPU: --overlap-cpu-optimizer-d2h-h2d against the offload
without it over 100 steps of a small GPT in bf16 (gradients down and parameters up on side
streams, the host step on the worker thread beside the compute stream), in memory and split
with the disk tier.

Tolerance. Both runs take the same kernels in the same order; only cuBLAS / cuDNN's
non-deterministic reductions (split-K, atomics in the embedding's backward) may differ,
by bf16 rounding that training then carries. Each step's loss within 2 % and the last ten
steps' mean within 0.5 % of the run without the overlap; a parameter read a step early or
late (the fault this guards) moves the loss by a whole AdamW step at lr 1e-2 from the first
steps on, far outside both.
"""
import pytest

from helpers.runs import make_data, tiny_argv
from megazoo.training.run import run_training


def _losses(data, *extra) -> list[float]:
    out = run_training(tiny_argv(data, "--train-iters", "100", "--eval-interval", "100",
                                 "--bf16", "--optimizer-cpu-offload", "--ddp-bucket-size",
                                 "3000", "--cpu-threads", "4", *extra), print_fn=lambda *a: None)
    return out["losses"]


@pytest.mark.gpu(count=1)
@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_overlap_matches_the_step_without_it_over_100_steps(tmp_path, tier):
    data = make_data(tmp_path)
    disk = lambda name: ([] if tier == "memory" else  # noqa: E731
                         ["--nvme-path", str(tmp_path / name),
                          "--optimizer-offload-host-memory", "0.0007"])
    ref = _losses(data, *disk("a"))
    out = _losses(data, "--overlap-cpu-optimizer-d2h-h2d", *disk("b"))
    assert len(ref) == len(out) == 100
    worst = max(abs(a - b) / b for a, b in zip(out, ref))
    print(f"{tier}: largest step difference {worst:.2e}, last ten {sum(out[-10:]):.4f} / "
          f"{sum(ref[-10:]):.4f}")
    assert worst < 0.02
    assert sum(out[-10:]) == pytest.approx(sum(ref[-10:]), rel=5e-3)
