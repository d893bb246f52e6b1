"""Time of one training step for a layout on a cluster, per pipeline stage.

Each virtual stage's forward and backward per micro-batch is its blocks' work plus the
embedding on the first and the head and loss on the last (`work.py`: GEMMs on the fitted
curve, attention, elementwise passes, recompute, the exposed tp / sp collectives). The
pipeline runs them through the schedule the run executes (`megazoo.pipeline`: 1F1B or
interleaved, simulated with per-stage times and the p2p time of one activation over NVLink
or the network), which gives each stage's end and its bubble. After its last backward each
stage reduces its gradients over dp x sp and steps its optimizer:

- plain engine: fp32 gradients, all-reduced (ring 2 (z - 1) / z x 4 B per parameter) or,
  with the distributed optimizer, reduce-scattered (4 B) and the bf16 parameters
  all-gathered (2 B); `--overlap-grad-reduce` hides the reduction behind the last
  micro-batch's backward except the last bucket; `--overlap-param-gather` hides the gather.
- DeepSpeed ZeRO-1/2: bf16 gradients reduce-scattered, parameters all-gathered (2 B each),
  overlapped like the plain engine's. ZeRO-3 (DeepSpeed, FSDP2): per micro-batch, the
  parameters gathered for forward and for backward and the gradients reduce-scattered, each
  hidden behind that pass's compute as far as it lasts.
- optimizer: fused AdamW at its measured rate over the stage's parameters (/ z where
  sharded) plus a read of the fp32 gradients for the norm; with optimizer offload, the host's
  Adam (`Cluster.host_adam_params_per_s`) and the PCIe traffic (4 B gradients down, 2 B
  parameters up per parameter) of the offloaded share.

The host: where the cluster gives its host time per block (`Cluster.host_block_ms`, and
per tp / sp collective call), a virtual stage's micro-batch takes at least that long, as the
GPU cannot run what the host has not issued yet (`work.host_paced`): a layout that divides
a block's GPU work (tp, Ulysses) but not its host work becomes host-bound.

step = max over stages of (end of its last backward + its dp reduction + its optimizer).
Per stage the breakdown adds up to the step: compute, tp/sp communication, the host's
pace, dp communication, optimizer and the rest, the bubble (waiting on the pipeline and on
the slowest stage). FLOPs are counted as the run logs them (`flops_per_iteration`: no
recompute) and as Megatron-LM's papers do (96 B s l h^2 (1 + s / 6h + V / 16 l h): the
forward rerun by full recompute included).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..config.model import ModelConfig
from ..config.run import PretrainArgs
from ..config.validate import cuda_graph_accepted
from ..models.flops import flops_per_iteration
from ..pipeline.schedules import build_schedule
from ..pipeline.simulate import simulate
from .calibration import kernel_rates
from .clusters import Cluster
from .layout import Resolved
from .memory import rank_parameters
from .work import (Work, block_host, block_work, embedding_work, head_work, host_paced,
                   zero3_copies)


@dataclass(frozen=True)
class StageTime:
    """Seconds of one step on one pipeline rank, by part (they add up to the step)."""

    layers: int
    compute: float
    tp_comm: float
    host: float
    """The GPU idle between launches where the host issues a pass slower than the GPU runs it."""
    bubble: float
    dp_comm: float
    optimizer: float


@dataclass(frozen=True)
class StepTime:
    """The prediction for one step."""

    step_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    """Model FLOPs (no recompute) per second per GPU: what pretrain_gpt.py logs."""
    tflops_per_gpu_megatron: float
    """Megatron-LM's count (full recompute's forward included)."""
    gpus: int
    stages: list[StageTime]
    kernels: str
    """Where the kernel rates come from."""
    notes: list[str] = field(default_factory=list)


def stage_layers(num_layers: int, pp: int, vpp: int) -> list[int]:
    """Blocks per virtual stage (pp x vpp of them): even where they divide, else (vpp = 1)
    Megatron-DeepSpeed's split counting the embedding and the head as one layer each (BLOOM:
    70 blocks on 12 stages = 5, 6, ..., 6, 5); ValueError otherwise."""
    n = pp * vpp
    if num_layers % n == 0:
        return [num_layers // n] * n
    if vpp == 1 and pp > 1 and (num_layers + 2) % pp == 0 and (num_layers + 2) // pp > 1:
        per = (num_layers + 2) // pp
        return [per - 1] + [per] * (pp - 2) + [per - 1]
    raise ValueError(f"num_layers {num_layers} must divide by pp*vpp = {n} (or, with vpp 1, "
                     f"num_layers + 2 by pp): change the layout or the model")


def step_time(args: PretrainArgs, layout: Resolved, cluster: Cluster,
              config: ModelConfig | None = None, exact: bool = True) -> StepTime:
    """Predict one step of the run `args` (resolved as `layout`) on `cluster`; `config`
    overrides args.model (a layer count pretrain_gpt.py cannot split, see `stage_layers`).
    exact=False replaces the pipeline simulation by its closed form (`_pipeline`), for
    screening many layouts. The run's --tp-comm-overlap chunks the tp / SP collectives
    beside the GEMMs (`work.block_work`, `work.block_host`)."""
    config = config or args.model
    tp_overlap = args.training.tp_comm_overlap
    rates = kernel_rates(cluster.calibration).scaled(cluster.peak_bf16_tflops,
                                                     cluster.hbm_gb_s, cluster.gpu)
    p, v, m = layout.pp, layout.vpp, layout.num_micro_batches
    layers = stage_layers(config.num_layers, p, v)
    block = block_work(config, layout, rates, cluster, overlap=tp_overlap)
    works = [block * n for n in layers]
    works[0] = works[0] + embedding_work(config, layout, rates, cluster)
    works[-1] = works[-1] + head_work(config, layout, rates, cluster)
    params = rank_parameters(config, layout.tp, [sum(layers[r::p]) for r in range(p)])
    zero3 = [_zero3_exposed(w, params[i % p] / v, layout, cluster) for i, w in enumerate(works)]
    works = [w + zero3_copies(params[i % p] / v, layout, rates) for i, w in enumerate(works)]
    # ZeRO-3's per-micro-batch exposure runs inside the pipeline (`ends`); what is reduced
    # once per step (FSDP2 syncing on the last micro-batch) and the dp reduction follow it
    graphs = args.training.enable_cuda_graph  # the blocks replay: no per-block host time
    host = 0.0 if graphs else block_host(config, layout, cluster, overlap=tp_overlap)
    loaded = [w + z for w, z in zip(works, zero3)]
    paced = [host_paced(w, n * host, synced=layout.deepspeed_zero3)
             for w, n in zip(loaded, layers)]
    waits = [q.total - w.total for q, w in zip(paced, loaded)]
    ends = _pipeline(paced, layout, config, cluster, exact)
    inside = [m * sum(z.fwd_comm + z.bwd_comm for z in zero3[r::p]) for r in range(p)]
    tail = [_dp_exposed(args, layout, cluster, params[r], works[r::p])
            + _zero3_step_reduce(layout, cluster, params[r], works[r::p], sum(layers[r::p]) + 1)
            for r in range(p)]
    optim = [_optimizer(layout, cluster, rates, params[r], sum(w.fwd for w in works[r::p]))
             for r in range(p)]
    step = max(e + d + o for e, d, o in zip(ends, tail, optim))
    stages = []
    for r in range(p):
        compute = m * sum(w.fwd + w.bwd for w in works[r::p])
        comm = m * sum(w.fwd_comm + w.bwd_comm for w in works[r::p])
        dp_comm, wait = tail[r] + inside[r], m * sum(waits[r::p])
        stages.append(StageTime(sum(layers[r::p]), compute, comm, wait,
                                step - compute - comm - wait - dp_comm - optim[r], dp_comm,
                                optim[r]))
    gpus, batch, s = layout.world_size, layout.micro_batch_size * m * layout.dp, layout.seq_length
    model = flops_per_iteration(batch, s, config.num_layers, config.hidden_size,
                                config.padded_vocab(1))
    # Megatron-LM's 96 B s l h^2 (1 + s / 6h + V / 16 l h) adds full recompute's forward
    paper = model + 24.0 * batch * s * config.num_layers * config.hidden_size ** 2 * (
        1 + s / (6.0 * config.hidden_size))
    notes, waited = [], max(st.host for st in stages) / step
    if waited > 0.05 and cuda_graph_accepted(args):
        notes.append(f"the host sets the pace: the GPUs wait {waited:.0%} of the step for "
                     f"launches; --enable-cuda-graph replays the blocks instead")
    return StepTime(step, batch * s / step, model / step / gpus / 1e12, paper / step / gpus / 1e12,
                    gpus, stages, rates.gpu, notes)


def _pipeline(works: list[Work], layout: Resolved, config: ModelConfig, cluster: Cluster,
              exact: bool = True) -> list[float]:
    """When each pipeline rank's last compute ends. exact: the schedule simulated; else the
    closed form m max_r T_r + (p - 1) mean_r T_r / v + 2 (p - 1) p2p (T_r: rank r's
    forward + backward of one micro-batch over its chunks; exact for equal stages), the same
    end for every rank."""
    p, v, m = layout.pp, layout.vpp, layout.num_micro_batches
    tf = [w.fwd + w.fwd_comm for w in works]
    tb = [w.bwd + w.bwd_comm for w in works]
    if p == 1:
        return [m * (tf[0] + tb[0])]
    shard = layout.tp if layout.megatron_sp_on else 1
    tokens = layout.seq_length * layout.micro_batch_size
    sent = 2.0 * tokens * config.hidden_size / (layout.seq_ranks * shard)
    p2p = sent / cluster.link_bytes_s(layout.tp * layout.seq_ranks * layout.dp + 1)
    if not exact:
        per_rank = [sum(tf[r::p]) + sum(tb[r::p]) for r in range(p)]
        span = m * max(per_rank) + (p - 1) * (sum(per_rank) / p / v + 2 * p2p)
        return [span] * p
    sim = simulate(build_schedule(p, v, m), tf, tb, p2p)
    return [t[-1].end for t in sim.timelines]


def _zero3_seconds_per_byte(params: float, layout: Resolved, cluster: Cluster) -> float:
    """Seconds to all-gather (or reduce-scatter) one byte per parameter of `params` over
    dp x sp (0 when ZeRO-3 is off or that group has one rank)."""
    z = layout.dp * layout.seq_ranks
    if layout.zero_stage != 3 or z == 1:
        return 0.0
    return (z - 1) / z * params / cluster.link_bytes_s(layout.tp * z)


def _zero3_reduces_per_microbatch(layout: Resolved) -> bool:
    """DeepSpeed reduce-scatters in every micro-batch's backward; FSDP2 only under a pipeline
    with --fsdp-reduce-every-microbatch (else once, in each chunk's last backward)."""
    return layout.zero_impl != "fsdp2" or (layout.pp > 1 and layout.fsdp_reduce_every_microbatch)


def _zero3_exposed(work: Work, params: float, layout: Resolved, cluster: Cluster) -> Work:
    """ZeRO-3's per-micro-batch traffic beyond the compute hiding it: the bf16 parameters
    gathered for forward and again for backward (unless FSDP2 keeps them,
    --no-fsdp-reshard-after-forward), the gradients reduce-scattered (FSDP2: in its reduce
    dtype, fp32 under bf16) where that happens every micro-batch."""
    per_byte = _zero3_seconds_per_byte(params, layout, cluster)
    if per_byte == 0.0:
        return Work()
    gather = 2.0 * per_byte
    if layout.offload_param == "cpu":
        gather += 2.0 * params / (layout.dp * layout.seq_ranks) / (cluster.pcie_gb_s * 1e9)
    fsdp2 = layout.zero_impl == "fsdp2"
    again = gather if not fsdp2 or layout.fsdp_reshard_after_forward else 0.0
    reduce = (layout.reduce_bytes if fsdp2 else 2.0) * per_byte
    reduce = reduce if _zero3_reduces_per_microbatch(layout) else 0.0
    return Work(0.0, 0.0, gather - _hidden(cluster, gather, work.fwd),
                again + reduce - _hidden(cluster, again + reduce, work.bwd))


def _hidden(cluster: Cluster, comm: float, beside: float) -> float:
    """Seconds of `comm`, overlapped with `beside` seconds of compute, that do not show:
    the cluster's `overlap_hidden` share of what the compute could cover."""
    return cluster.overlap_hidden * min(comm, beside)


def _zero3_step_reduce(layout: Resolved, cluster: Cluster, params: float, works: list[Work],
                       units: int) -> float:
    """FSDP2's once-per-step reduce-scatter, unit by unit (`units`: the rank's blocks and
    its root) as the last backward finishes each: hidden behind the rest of that backward,
    except the last unit's share."""
    per_byte = _zero3_seconds_per_byte(params, layout, cluster)
    if per_byte == 0.0 or _zero3_reduces_per_microbatch(layout):
        return 0.0
    reduce = layout.reduce_bytes * per_byte
    return reduce - _hidden(cluster, reduce * (1 - 1 / max(units, 1)), sum(w.bwd for w in works))


def _dp_exposed(args: PretrainArgs, layout: Resolved, cluster: Cluster, params: float,
                works: list[Work]) -> float:
    """Seconds of gradient reduction and parameter gather left after the last backward."""
    z = layout.dp * layout.seq_ranks
    if z == 1 or layout.zero_stage == 3:
        return 0.0
    link, share = cluster.link_bytes_s(layout.tp * z), (z - 1) / z
    t = args.training
    if layout.plain_engine:
        sharded = layout.distributed_optimizer
        reduce = share * 4.0 * params / link * (1 if sharded else 2)
        gather = share * 2.0 * params / link if sharded else 0.0
        overlap, overlap_gather = t.overlap_grad_reduce, t.overlap_param_gather
    else:  # DeepSpeed: bf16 gradients; stage 0 all-reduces, 1 / 2 reduce-scatter + gather
        reduce = share * 2.0 * params / link * (1 if layout.zero_stage else 2)
        gather = share * 2.0 * params / link if layout.zero_stage else 0.0
        overlap, overlap_gather = True, False
    bucket = min(1.0, layout.bucket_elements / max(params, 1.0))
    if overlap:  # all but the last bucket behind one micro-batch's backward
        reduce -= _hidden(cluster, reduce * (1 - bucket), sum(w.bwd + w.bwd_comm for w in works))
    if overlap_gather:  # all but the first bucket behind the next step's forward
        gather -= _hidden(cluster, gather * (1 - bucket), gather)
    return reduce + gather


def _optimizer(layout: Resolved, cluster: Cluster, rates, params: float,
               forward: float) -> float:
    """AdamW over this rank's share and the gradient-norm read; offload: the host share's
    AdamW at the host's rate (`Cluster.host_adam_params_per_s`) and its PCIe traffic, its
    gradients down and its parameters up. The plain engine's overlap sends the gradients down
    during the backward and steps the host share beside the GPU share's step and the next
    forward, which needs the host buckets last (`forward`: one micro-batch's forward of the
    stage); what the host step and its uploads take beyond that shows. The delayed update
    hides the host step behind a whole step."""
    z = layout.dp * layout.seq_ranks
    sharded = (layout.distributed_optimizer if layout.plain_engine else layout.zero_stage >= 1)
    share = params / (z if sharded else 1)
    offload = layout.optimizer_offload
    off = offload.ratio if offload.on else 0.0
    gpu = (1 - off) * share * rates.adamw_s_per_param + 4.0 * share / rates.copy_bytes_s
    if not off:
        return gpu
    pcie, host = cluster.pcie_gb_s * 1e9, off * share
    step = host / cluster.host_adam_params_per_s
    if not (layout.plain_engine and offload.overlap):  # fp32 gradients down, bf16 params up
        return gpu + step + host * 6.0 / pcie
    if offload.delayed:
        return gpu
    up = host * layout.param_bytes / pcie
    return gpu + max(0.0, step + up - forward - gpu)
