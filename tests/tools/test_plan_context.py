"""The planner with context parallelism: activations per rank divide by cp, the step time's
attention by cp plus the ring's exposed transfers, and --search considers cp."""
import dataclasses

import pytest

from megazoo.config.flags import args_from_namespace
from megazoo.config.validate import check_args
from megazoo.plan.calibration import kernel_rates
from megazoo.plan.cli import plan_parser
from megazoo.plan.clusters import load_cluster
from megazoo.plan.context import ring_exposed
from megazoo.plan.layout import resolve
from megazoo.plan.memory import activation_bytes
from megazoo.plan.published import plan_args
from megazoo.plan.search import search
from megazoo.plan.timing import step_time

LLAMA_64K = ("--family llama --num-layers 8 --hidden-size 4096 --num-attention-heads 32 "
             "--num-key-value-heads 8 --ffn-hidden-size 14336 --seq-length 65536 "
             "--max-position-embeddings 65536 --micro-batch-size 1 --bf16 "
             "--global-batch-size 1 --recompute full")


def _args(flags: str):
    args, config, _ = plan_args(plan_parser().parse_args(flags.split()))
    return args, config


def test_activations_per_rank_divide_by_cp():
    one = activation_bytes(_args(LLAMA_64K)[0])
    two = activation_bytes(_args(LLAMA_64K + " --context-parallel-size 2")[0])
    for key, value in one.items():
        assert two[key] == pytest.approx(value / 2), key


def test_step_time_with_cp_is_near_ulysses_and_the_ring_hides_on_nvlink():
    cluster = load_cluster("h100-sxm")
    times = {}
    for name, extra in (("cp2", " --context-parallel-size 2"),
                        ("sp2", " --sequence-parallel-size 2")):
        args, config = _args(LLAMA_64K + extra)
        times[name] = step_time(args, resolve(args), cluster, config)
    # the same FLOPs per GPU; Ulysses' all-to-alls against the ring's exposed tail
    assert times["cp2"].step_s == pytest.approx(times["sp2"].step_s, rel=0.1)
    args, config = _args(LLAMA_64K + " --context-parallel-size 2")
    layout = resolve(args)
    rates = kernel_rates("h100-sxm")
    a_fwd, a_bwd = rates.attention(1, 32, 65536, 128)
    fwd, bwd = ring_exposed(config, layout, cluster, a_fwd / 2, a_bwd / 2)
    assert fwd == 0.0  # 64k tokens: each step's attention outlasts its kv block on NVLink
    assert 0 < bwd < 0.01 * a_bwd  # only the last accumulator's trip home shows


def test_search_considers_context_parallel_and_returns_runnable_layouts():
    parser = plan_parser()
    base = LLAMA_64K.replace("--recompute full", "").split()
    found, refused, _ = search(lambda argv: args_from_namespace(parser.parse_args(argv)), base,
                               8, 2, 1, load_cluster("h100-sxm"), rescore=3)
    assert found and any("--context-parallel-size" in c.flags for c in found)
    for c in found:
        dp = int(c.flags[c.flags.index("--dp") + 1])
        run = args_from_namespace(parser.parse_args(base + c.flags[:c.flags.index("--dp")]))
        check_args(dataclasses.replace(run, parallel=dataclasses.replace(run.parallel, dp=dp)))
