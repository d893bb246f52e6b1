"""Which host tensors reach a collective: the CPU check for what NCCL refuses.

On a GPU run the default process group (`init_process_group()` with no backend) holds NCCL
alone, so a collective handed a host tensor fails ("No backend type associated with device
type cpu"). On CPU tests every tensor is a host tensor and gloo takes them all: the mistake
cannot show by device. `HostTensors` tracks instead where a tensor was *made*: a host tensor
is one from a factory given no device (torch's default device is the host), `.cpu()`, a
`"cpu"` string device, or a device read from a host tensor (`x.device`), and what a torch
op computes from one as its first tensor argument (results live where that one does: a host
index into a device tensor leaves the result on the device; `.to(device)` with any other
device, or an in-place op on a tensor that is not one, keeps the result clean). Every
collective op (c10d, functional collectives) handed a host tensor is recorded.

    with HostTensors() as seen:
        engine.train_step(...)
    assert not seen.violations, seen.violations

Limits: a device object built from a literal (`torch.device("cpu")`) counts as the compute
device; tensors are tracked by storage (held alive while the tracker lives, so no address
is reused).
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.tensor, torch.as_tensor,
             torch.arange, torch.linspace, torch.rand, torch.randn, torch.randint,
             torch.randperm, torch.eye, torch.scalar_tensor, torch.empty_strided,
             torch.frombuffer, torch.from_numpy}
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")


def _storage(t: torch.Tensor) -> int:
    t = getattr(t, "_local_tensor", t)  # a DTensor: its local shard
    if t.is_meta:
        return 0
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


class HostTensors:
    """Context manager: `violations` lists "op: host tensor of shape S" per collective given
    a host tensor (see the module docstring); `collectives` counts every collective op."""

    def __init__(self):
        self.violations: list[str] = []
        self.collectives = 0  # collective ops seen (a check that saw none checked nothing)
        self._storages: dict[int, torch.Tensor] = {}
        self._devices: list[torch.device] = []  # host devices handed out (kept: ids unique)
        self._modes = (_Sources(self), _Collectives(self))

    def __enter__(self):
        # `x.device` reaches no torch-function mode: the property is shadowed on torch.Tensor
        # (a Python class) while the tracker is on, and answers a host tensor's read with a
        # new device object remembered as a host device.
        seen, base = self, torch._C.TensorBase.device

        def device(t):
            found = base.__get__(t)
            if seen.is_host(t):
                found = torch.device(found.type)
                seen._devices.append(found)
            return found

        torch.Tensor.device = property(device)
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        del torch.Tensor.device

    def is_host(self, t) -> bool:
        return isinstance(t, torch.Tensor) and _storage(t) in self._storages

    def mark(self, out) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and _storage(t):
                self._storages[_storage(t)] = t

    def host_device(self, device) -> bool:
        return device == "cpu" or any(device is d for d in self._devices)


class _Sources(TorchFunctionMode):
    """Marks host-made tensors and what is computed from them."""

    def __init__(self, seen: HostTensors):
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        seen = self.seen
        named = [a for a in (*args[1:], kwargs.get("device")) if isinstance(a, (str, torch.device))]
        if func is torch.Tensor.cpu or (func in FACTORIES and kwargs.get("device") is None):
            seen.mark(out)
        elif any(seen.host_device(d) for d in named):
            seen.mark(out)
        elif named and func is torch.Tensor.to:
            pass  # a copy to the compute device
        elif args and out is args[0]:
            pass  # in place: the tensor stays where it was made
        elif seen.is_host(next((t for t in tree_flatten(args)[0]
                                if isinstance(t, torch.Tensor)), None)):
            seen.mark(out)  # an op's result lives where its first tensor does
        return out


class _Collectives(TorchDispatchMode):
    """Records collectives handed a host tensor."""

    def __init__(self, seen: HostTensors):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in COLLECTIVE_NAMESPACES:
            self.seen.collectives += 1
            for t in tree_flatten((args, kwargs))[0]:
                if self.seen.is_host(t):
                    self.seen.violations.append(f"{func}: host tensor of shape {tuple(t.shape)}")
        return func(*args, **kwargs)
