"""`--search`: every layout pretrain_gpt.py accepts for a model, a cluster and a global batch,
filtered by memory and ranked by predicted tokens/s.

For each tensor-parallel size t and Ulysses size u inside a node, context-parallel size c
(the ring may leave the node), pipeline size p, virtual
stages v (interleaved when p > 1), the largest data-parallel size d with t u c p d <= the GPUs
given and the global batch divisible by micro-batch x d, each micro-batch size, recompute
(none, selective, full) and Megatron SP on and off (t > 1), the candidate's flags are the
user's flags with the layout replaced, and go through the run's own parsing and checks
(`args_from_namespace` -> `check_args`): a layout the run refuses is never returned. The
plain engine's distributed optimizer and both overlaps are on where dp x sp x cp > 1, and
CUDA graphs (`--enable-cuda-graph`) with tp or Ulysses where the run accepts them (one
pipeline stage, no recompute, the plain engine: else the candidate runs eagerly). The memory
planner's most loaded rank must fit the cluster's GPU; the rest are
timed (`timing.step_time`) and ranked. Each result carries its pretrain_gpt.py command.
"""
from __future__ import annotations

import dataclasses
import itertools

from .clusters import Cluster
from .command import launch_command
from .layout import PlanOptions, resolve
from .memory import GB, _estimate
from .timing import StepTime, step_time

MICRO_BATCHES = (1, 2, 4, 8)
RECOMPUTE = ("none", "selective", "full")
LAYOUT_FLAGS = {"--tensor-model-parallel-size", "--tp", "--pipeline-model-parallel-size",
                "--pp", "--sequence-parallel-size", "--ds-sequence-parallel-size", "--sp",
                "--dp", "--micro-batch-size", "--recompute", "--recompute-granularity",
                "--sequence-parallel", "--num-layers-per-virtual-pipeline-stage",
                "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
                "--virtual-pipeline-model-parallel-size", "--context-parallel-size",
                "--cp"}
SEARCH_FLAGS = {"--search", "--json", "--top", "--cluster", "--out", "--gpus"}


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One layout that fits, with its prediction."""

    flags: list[str]
    """The layout's flags (added to the user's others)."""
    time: StepTime
    gpu_memory_gb: float
    gpus: int
    inputs: tuple = dataclasses.field(default=(), repr=False, compare=False)
    """(args, layout) it was planned from."""

    def command(self, per_node: int) -> str:
        """The pretrain_gpt.py command line over `gpus` ranks, from the candidate's parsed
        config (`command.launch_command`: the run takes dp from its world size)."""
        return launch_command(self.inputs[0], per_node)


def drop_flags(argv: list[str], names: set[str]) -> list[str]:
    """`argv` without the flags `names` and their values (the next word, unless it is a flag
    or the flag is written --flag=value)."""
    kept, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg.split("=", 1)[0] in names:
            skip = "=" not in arg and i + 1 < len(argv) and not argv[i + 1].startswith("--")
            continue
        kept.append(arg)
    return kept


def layouts(num_layers: int, gpus: int, global_batch: int, per_node: int):
    """(tp, sp, cp, pp, vpp, dp, micro-batch) tuples to try (the run's checks come later)."""
    for t, u, c in itertools.product((1, 2, 4, 8), repeat=3):
        if t * u > per_node:
            continue
        tuc = t * u * c
        for p in (x for x in range(1, num_layers + 1) if num_layers % x == 0 and tuc * x <= gpus):
            for b in MICRO_BATCHES:
                d = gpus // (tuc * p)
                while d > 1 and global_batch % (b * d):
                    d -= 1
                if global_batch % (b * d):
                    continue
                for v in (1, 2, 4) if p > 1 else (1,):
                    if num_layers % (p * v) == 0 and (v == 1 or (global_batch // (b * d)) % p == 0):
                        yield t, u, c, p, v, d, b


def _flags(t, u, c, p, v, d, b, recompute, megatron_sp, num_layers) -> list[str]:
    flags = ["--tensor-model-parallel-size", str(t), "--pipeline-model-parallel-size", str(p),
             "--micro-batch-size", str(b), "--recompute", recompute]
    if u > 1:
        flags += ["--sequence-parallel-size", str(u)]
    if c > 1:
        flags += ["--context-parallel-size", str(c)]
    if v > 1:
        flags += ["--num-layers-per-virtual-pipeline-stage", str(num_layers // (p * v))]
    if megatron_sp:
        flags.append("--sequence-parallel")
    if d * u * c > 1:
        flags += ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    return flags + ["--dp", str(d)]


def _first_accepted(parse, base: list[str], flags: list[str], options: PlanOptions,
                    graphs: bool):
    """(flags, args, layout) with --enable-cuda-graph added where `graphs` and the run
    accepts it, else without; None when the run refuses the layout itself."""
    for extra in (["--enable-cuda-graph"], []) if graphs else ([],):
        try:
            args = parse(base + flags + extra)
            return flags + extra, args, resolve(args, options)
        except (ValueError, SystemExit):
            continue
    return None


def search(parse, base: list[str], num_layers: int, gpus: int, global_batch: int,
           cluster: Cluster, rescore: int = 20
           ) -> tuple[list[Candidate], int, list[tuple[float, list[str]]]]:
    """(fitting candidates, fastest first; layouts the run refused; (GB, flags) of the
    layouts too big, smallest first: the nearest is what a search finding none reports).

    `parse(argv)` is the planner's parsing: flags -> the run's checked PretrainArgs. Every
    candidate is timed with the pipeline's closed form, the best `rescore` again with the
    schedule simulated (they lead the list)."""
    found, refused, too_big = [], 0, []
    options = PlanOptions(gpu_memory=cluster.hbm_gb, gpus_per_node=cluster.gpus_per_node)
    for t, u, c, p, v, d, b in layouts(num_layers, gpus, global_batch, cluster.gpus_per_node):
        for recompute, msp in itertools.product(RECOMPUTE, (False, True) if t > 1 else (False,)):
            flags = _flags(t, u, c, p, v, d, b, recompute, msp, num_layers)
            parsed = _first_accepted(parse, base, flags, options, graphs=t * u > 1)
            if parsed is None:
                refused += 1
                continue
            flags, args, layout = parsed
            memory = _estimate(args.model, layout).gpu_total
            if memory > cluster.hbm_gb * GB:
                too_big.append((memory / GB, flags))
                continue
            found.append(Candidate(flags, step_time(args, layout, cluster, exact=False),
                                   memory / GB, layout.world_size, (args, layout)))
    found.sort(key=lambda c: -c.time.tokens_per_s)
    exact = [dataclasses.replace(c, time=step_time(*c.inputs, cluster)) for c in found[:rescore]]
    found = sorted(exact, key=lambda c: -c.time.tokens_per_s) + found[rescore:]
    return found, refused, sorted(too_big, key=lambda x: x[0])
