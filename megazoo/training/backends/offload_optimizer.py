"""`OffloadAdamW`: the plain engine's fp32 masters and AdamW moments split by gradient
bucket between the GPU and the host (pinned memory, and with --nvme-path the disk for what
does not fit there: `split_store`), Megatron-core's hybrid device optimizer in this
engine's terms; `MasterAdamW`'s interface.

    opt = OffloadAdamW(model, buffers, cfg, plan)   # plan: config.offload.OffloadPlan
    opt.start_step()                  # before backward: the last gradient copies are done
    opt.step(lr, grad_divisor)        # GPU buckets now; host buckets now or on a thread
    opt.wait_params([i, ...])         # (forward pre-hooks) bucket i's new parameters

Each bucket's shard (this rank's, with the distributed optimizer) is one `cpu_offload.Slot`.
The last buckets of the forward (`plan.fraction` of the elements) keep their state on the
host; the others on the GPU. Both places step with a one-pass AdamW (the gradient as
accumulated in, the bf16 parameters out: `cpu_offload.SlotAdamW`). Of the host buckets,
with --nvme-path, those the forward uses first keep their state in memory while it fits
and the last ones stream from disk (`split_store.host_store`, the planner's rule). The model's bf16
parameters and the main gradients stay on the GPU: per step each host bucket's reduced
gradient goes down once (as soon as it is final: during backward with one rank, after the
reduce-scatter with more) and its parameters come up once.

With `plan.overlap` a worker thread steps the host buckets in forward order once the global
norm is known, and the next forward waits for each bucket when it reaches it (the forward
pre-hooks of --overlap-param-gather); without it `step` returns with every bucket updated.
With the distributed optimizer the updated shard is all-gathered over dp x sp, for host
buckets from that wait (in forward order on every rank, so the collectives match).

Checkpoints: `full_state` / `load_full_state` hold full flat fp32 tensors in host memory,
the same format `MasterAdamW` writes, so runs resume across the two.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from ...parallel.collectives import all_gather_flat
from ...offload.bytes import STORE_SLOTS, UP_BUFFERS
from .cpu_offload import NAMES, ResidentStore, Sides, SlotAdamW, Transfers, bucket_slots
from .grad_buffer import GradBuffer
from .lean_build import fill_flat_
from .master_optimizer import hook_bucket_waits
from .split_store import describe, host_store


class OffloadAdamW:
    """See the module docstring. `cfg`: TrainingConfig; `plan`: OffloadPlan."""

    state_device = torch.device("cpu")  # where full_state's tensors live

    def __init__(self, model: nn.Module, buffers: GradBuffer, cfg, plan, *,
                 initial: dict | None = None):
        self.buffers, self.cfg, self.plan = buffers, cfg, plan
        data = buffers.param_data
        self.device = data.device
        self.copies = Transfers(self.device, plan.pin_memory)
        self.slots = bucket_slots(buffers, plan.fraction)
        self.order = sorted(self.slots, key=lambda s: -s.bucket.index)  # forward order
        self.host_order = [s for s in self.order if s.host]
        host = [s for s in self.slots if s.host]
        self.host_numel = sum(s.numel for s in host)
        gpu = [s for s in self.slots if not s.host]
        self._adamw = Sides(  # (the GPU share's kernel: CUDA only)
            host=SlotAdamW(torch.device("cpu"), max((x.numel for x in host), default=0),
                           kernel=True),
            gpu=SlotAdamW(self.device, max((x.numel for x in gpu), default=0),
                          kernel=self.copies.cuda))
        store, self.split = host_store(plan, host, pin=self.copies.pin,
                                       rank=buffers.state.global_rank,
                                       grad_bytes=buffers.main_grad.element_size(),
                                       param_bytes=data.element_size(), initial=initial,
                                       numel=buffers.numel,
                                       scratch=self._adamw.host.scratch_bytes(
                                           buffers.main_grad.dtype))
        self.stores = Sides(host=store, gpu=ResidentStore([s.numel for s in gpu], self.device,
                                                          pin=False))
        self._initial = {}  # GPU slots: fp32 initial masters until their state exists
        # split: host gradients go down in their host step, through one buffer (host_split)
        self._late = bool(self.split.late and host)
        shared = self.copies.host_empty(max(s.numel for s in host),
                                        buffers.main_grad.dtype) if self._late else None
        with torch.no_grad():  # GPU slots first: their host values go before host state comes
            for slot in sorted(self.slots, key=lambda s: s.host):
                self._init_master(slot, data, initial)
                if slot.host:
                    slot.grad = shared[:slot.numel] if self._late else \
                        self.copies.host_empty(slot.numel, buffers.main_grad.dtype)
        self.stores.host.flush()
        # parameters go up through a small ring of staging buffers (an upload takes ~ms)
        largest = max((s.numel for s in host), default=0)
        self._up = [self.copies.host_empty(largest, data.dtype) for _ in range(UP_BUFFERS)]
        self._up_events, self._up_next = [None] * UP_BUFFERS, 0
        self._divisor = Sides(host=torch.ones((), dtype=torch.float32),
                              gpu=torch.ones((), dtype=torch.float32, device=self.device))
        self.overlap_param_gather = cfg.overlap_param_gather and buffers.shard
        self.step_count = 0
        threads = torch.get_num_threads()
        self._worker = ThreadPoolExecutor(1, initializer=torch.set_num_threads,
                                          initargs=(threads,)) if plan.overlap else None
        buffers.on_final = self._send
        if plan.overlap or self.overlap_param_gather:
            hook_bucket_waits(model, buffers, self.wait_params)

    def _init_master(self, slot, data: torch.Tensor, initial: dict | None) -> None:
        """The slot's fp32 initial master, straight into its place (the GPU, or the host
        state): from the flat buffer (still fp32 then), or from `initial` (host tensors,
        dropped once taken: no staging copy, no value held longer than it is needed)."""
        if not slot.host:
            self._initial[slot.index] = torch.empty(slot.numel, dtype=torch.float32,
                                                    device=self.device)
            self._fill(self._initial[slot.index], slot, data, initial)
            return
        self._fill(self._acquire(slot)["master"], slot, data, initial)  # (moments start at 0)
        self.stores.host.release(slot.index)

    def _fill(self, dst: torch.Tensor, slot, data: torch.Tensor, initial: dict | None) -> None:
        if initial is None:
            dst.copy_(data[slot.lo:slot.hi])
            return
        fill_flat_(dst, slot.lo, slot.hi, slot.bucket, self.buffers, initial)
        for p in slot.bucket.params:  # they live in the masters now (and in no other bucket)
            initial.pop(id(p), None)

    # -- state access -----------------------------------------------------------------------
    def _acquire(self, slot) -> dict:
        state = self.stores[slot.side].acquire(slot.index)
        if not slot.host and slot.index in self._initial:
            state["master"].copy_(self._initial.pop(slot.index))
        return state

    # -- gradients down ---------------------------------------------------------------------
    def start_step(self) -> None:
        """Before the step's backward: the compute stream waits for last step's gradient
        copies (a skipped step never consumed them) before it overwrites the buffer."""
        for slot in self.host_order:
            self.copies.device_waits(slot.d2h)
            slot.sent = False

    def _send(self, bucket) -> None:
        """GradBuffer.on_final: bucket's reduced gradient shard leaves for the host."""
        slot = self.slots[bucket.index]
        if not slot.host or slot.sent or self._late:
            return
        self._wait_slot(slot)  # its host step (and staging buffers) are done
        slot.d2h = self.copies.to_host(slot.grad, self.buffers.main_grad[slot.lo:slot.hi])
        slot.sent = True

    def _send_unsent(self) -> None:
        """Send down the host slots' gradients that have not left yet (a bucket finished
        without the overlap, or late), in forward order."""
        for slot in self.host_order:
            if not slot.sent:
                self._send(slot.bucket)

    # -- the step ---------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, lr: float, grad_divisor: float = 1.0) -> None:
        self.wait_params()
        after = self._begin_step(grad_divisor)
        self._send_unsent()
        for slot in self.host_order:
            slot.sent, slot.pending = False, True
        jobs = self._host_jobs()
        if self._worker is not None:  # the host starts first, the GPU share meanwhile
            for slot, nxt in jobs:
                slot.future = self._worker.submit(self._host_step, slot, nxt, lr, after)
        self._device_steps(lr)
        if self._worker is None:
            for slot, nxt in jobs:
                self._host_step(slot, nxt, lr, after)
            self.wait_params()

    def _begin_step(self, grad_divisor: float):
        """Count the step, set its divisor; an event where backward is done with the parameters."""
        self.step_count += 1
        for divisor in self._divisor.both():
            divisor.fill_(grad_divisor)
        return self.copies.mark()

    def _host_jobs(self) -> list:
        """(host slot, the disk slots to start reading as it steps) in forward order. The
        disk slots come last and stream through STORE_SLOTS staging slots: the memory slots
        start reading the first of them as the host step starts, each disk slot the next."""
        on_disk = self.stores.host.on_disk
        disk = [s for s in self.host_order if on_disk(s.index)]
        ahead = {id(s): disk[k + 1:k + 2] for k, s in enumerate(disk)}
        return [(s, ahead.get(id(s), disk[:STORE_SLOTS])) for s in self.host_order]

    def _device_steps(self, lr: float) -> None:
        for slot in self.order:
            if not slot.host:
                self._device_step(slot, lr)

    def _device_step(self, slot, lr: float) -> None:
        self._adamw.gpu(self._acquire(slot), self.buffers.main_grad[slot.lo:slot.hi], slot,
                        lr, self.cfg, self._divisor.gpu,
                        self.buffers.param_data[slot.lo:slot.hi], step=self.step_count)
        self._gather(slot, async_op=self.overlap_param_gather)

    def _host_step(self, slot, nxt: list, lr: float, after, send_up: bool = True) -> None:
        """On the host (the worker thread with overlap): start reading the disk slots `nxt`,
        wait for the gradient, step, stage the new parameters and, with `send_up`, send them
        up once the compute stream has passed `after` (an event; None: at once). The delayed
        update sends them later (`send_up` False)."""
        store = self.stores.host
        state = store.acquire(slot.index)
        for later in nxt:  # the disk store reads them while this bucket steps
            store.prefetch(later.index)
        if self._late:  # (the next forward waits for the host step, so the
            # next backward cannot overwrite the gradient before it has gone down)
            slot.d2h = self.copies.to_host(slot.grad, self.buffers.main_grad[slot.lo:slot.hi],
                                           after)
        self.copies.host_waits(slot.d2h)
        ring = self._ring(slot) if send_up else None
        self._adamw.host(state, slot.grad, slot, lr, self.cfg, self._divisor.host,
                         None if ring is None else ring[1])
        if ring is not None:
            self._send_ring(slot, ring, after)
        store.release(slot.index)

    def _ring(self, slot) -> tuple[int, torch.Tensor]:
        """(r, the next ring buffer for the slot's parameters), once its last upload left."""
        r = self._up_next
        self._up_next = (r + 1) % len(self._up)
        self.copies.host_waits(self._up_events[r])
        return r, self._up[r][:slot.numel]

    def _send_ring(self, slot, ring, after) -> None:
        """Send ring buffer `ring` up into the slot's parameters once the compute stream has
        passed `after`."""
        r, up = ring
        slot.h2d = self._up_events[r] = self.copies.to_device(
            self.buffers.param_data[slot.lo:slot.hi], up, after)

    # -- parameters up ----------------------------------------------------------------------
    def _gather(self, slot, async_op: bool) -> None:
        group = self.buffers.group
        if not self.buffers.shard or group.size == 1:
            return
        b = slot.bucket
        handle = all_gather_flat(self.buffers.param_data[b.start:b.end],
                                 self.buffers.param_data[slot.lo:slot.hi], group=group.group,
                                 async_op=async_op)
        slot.gather = handle if async_op else None

    def _wait_slot(self, slot, host_step: bool = True) -> None:
        """Wait for the slot's host step unless not `host_step`, then its parameters' copy up
        and all-gather."""
        if host_step and slot.future is not None:
            slot.future.result()
            slot.future = None
        if slot.pending:
            slot.pending = False
            self.copies.device_waits(slot.h2d)
            self._gather(slot, async_op=False)
        if slot.gather is not None:
            slot.gather.wait()
            slot.gather = None

    def wait_params(self, indices=None) -> None:
        """Wait for the new parameters of buckets `indices` (None: all, in forward order)."""
        slots = self.order if indices is None else [self.slots[i] for i in indices]
        for slot in slots:
            self._wait_slot(slot)

    # -- checkpoints ------------------------------------------------------------------------
    def full_state(self) -> dict[str, torch.Tensor]:
        """{"master", "exp_avg", "exp_avg_sq"}: full flat fp32 host tensors (collective over
        dp x sp with the distributed optimizer)."""
        self.wait_params()
        out = {k: torch.zeros(self.buffers.numel, dtype=torch.float32) for k in NAMES}
        gather = self.buffers.shard and self.buffers.group.size > 1
        for slot in self.slots:
            state, b = self._acquire(slot), slot.bucket
            for k in NAMES:
                if not gather:
                    out[k][slot.lo:slot.hi].copy_(state[k])
                    continue
                whole = torch.empty(b.numel, dtype=torch.float32, device=self.device)
                mine = whole[slot.lo - b.start:slot.hi - b.start]
                mine.copy_(state[k])
                all_gather_flat(whole, mine, group=self.buffers.group.group)
                out[k][b.start:b.end].copy_(whole)
            self.stores[slot.side].release(slot.index, write=False)
        return out

    @torch.no_grad()
    def load_full_state(self, full: dict[str, torch.Tensor], step: int) -> None:
        """Set masters (and moments, when given) from full flat fp32 tensors; publish."""
        self.wait_params()
        for slot in self.slots:
            state = self._acquire(slot)
            for k in NAMES:
                if k in full:
                    state[k].copy_(full[k][slot.lo:slot.hi])
                else:
                    state[k].zero_()  # weights only: a fresh optimizer
            self.buffers.param_data[slot.lo:slot.hi].copy_(state["master"])
            self.stores[slot.side].release(slot.index)
            for t in slot.steps[True] + slot.steps[False]:
                t.fill_(float(step))
            self._gather(slot, async_op=False)
        self.stores.host.flush()
        self.step_count = step

    @property
    def adam_step(self) -> int:
        return self.step_count

    @property
    def placement(self) -> str:
        """One line: where the offloaded optimizer state lives ("" if none; run.py logs it)."""
        return describe(self.split, len(self.slots), self.host_order, self.plan.nvme_path)
