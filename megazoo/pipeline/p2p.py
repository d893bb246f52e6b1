"""Point-to-point transfers between pipeline stages, and Megatron's two memory helpers.

Plain `isend` / `irecv` (gloo's `batch_isend_irecv` is known to hang). Sends are
non-blocking: `Channel.send` returns at once and keeps the tensor alive until the transfer
completes. Receives block. Tensor shapes are known in advance, so no shapes are exchanged.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def free_output_storage(output: torch.Tensor) -> None:
    """Release the memory of an activation already sent to the next stage.

    The next stage owns a copy; here only the autograd graph (`output.grad_fn`) is still
    needed for the backward pass, not the values. Megatron's `deallocate_output_tensor`:
    swap the data for a one-element placeholder, keep the graph.
    """
    if output._base is not None:  # a view: freeing it would not release its base's memory
        return
    output.data = torch.empty((1,), device=output.device, dtype=output.dtype)


def backward_from_freed(output: torch.Tensor, grad: torch.Tensor) -> None:
    """Backward from an output whose storage `free_output_storage` released.

    `torch.autograd.backward` checks that `grad` has the output's shape, which the freed
    placeholder no longer has; calling the autograd engine directly skips that check
    (Megatron's `custom_backward`). The graph itself never looks at the output's values.
    """
    torch.autograd.Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad,), keep_graph=False, create_graph=False,
        inputs=(), allow_unreachable=True, accumulate_grad=True)


class Channel:
    """Sends and receives of one rank with its pipeline neighbours (global ranks)."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self._pending: list[tuple[dist.Work, torch.Tensor, bool]] = []

    def send(self, tensor: torch.Tensor, dst: int, free_after: bool = False) -> None:
        """Start sending; with `free_after`, release `tensor`'s storage once it has left."""
        payload = tensor.detach().contiguous()
        work = dist.isend(payload, dst, group=self.group)
        self._pending.append((work, tensor, free_after))

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, device, src: int) -> torch.Tensor:
        buffer = torch.empty(shape, dtype=dtype, device=device)
        dist.irecv(buffer, src, group=self.group).wait()
        return buffer

    def reap(self, wait: bool = False) -> None:
        """Retire completed sends (with `wait`, every send: the end of a step), freeing the
        storage of those marked `free_after`."""
        still = []
        for work, tensor, free_after in self._pending:
            if wait or work.is_completed():
                work.wait()
                if free_after:
                    free_output_storage(tensor)
            else:
                still.append((work, tensor, free_after))
        self._pending = still

    def drain(self) -> None:
        """Wait for every send still in flight (end of a step)."""
        self.reap(wait=True)
