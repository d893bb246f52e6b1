"""Writing checkpoints: `save_checkpoint` (collective, from a live model at its layout) and
`write_checkpoint` (one process, any layout, fed full tensors one at a time); the files are
described in the package docstring.

Checksums are computed while writing; each rank of `save_checkpoint` leaves its file's next to
it (`SUMS_SUFFIX`) for rank 0 to gather into megazoo.json before the folder is published. A
tensor holding inf or nan stops the save before anything is published (`NonFiniteError`,
naming the tensor and the checkpoint, on every rank); `refuse_nonfinite` is the same check,
message and agreement for a writer of another format (DeepSpeed's engine).
"""
from __future__ import annotations

import json
import os
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from ..layers.sharding import full_shape, tp_slice
from ..models import ModelConfig
from ..parallel.device import comm_device
from ..parallel.state import ParallelState
from .checksums import default_algorithm, values_key
from .files import NonFiniteError, SafetensorsWriter, check_finite, dtype_name, write_json
from .output import (check_output_dir, discard, fault_point, fresh_temp_dir, publish,
                     temp_dir)
from .layout import FORMAT, METADATA_FILE, full_shapes, rank_file, rank_model, stored_parameters

SUMS_SUFFIX = ".checksums.json"


def build_metadata(config: ModelConfig, layout: dict, dtype: torch.dtype, extra: dict | None,
                   aux_dtypes: dict[str, torch.dtype]) -> dict:
    """The contents of megazoo.json, less the checksums (`add_checksums`)."""
    return {"format": FORMAT, "model": config.to_dict(), "layout": dict(layout),
            "dtype": dtype_name(dtype),
            "files": [rank_file(p, t) for p in range(layout["pp"]) for t in range(layout["tp"])],
            "params": {name: {"full_shape": list(shape), "dtype": dtype_name(dtype)}
                       for name, shape in full_shapes(config).items()},
            "aux": list(aux_dtypes), "aux_dtypes": {k: dtype_name(v) for k, v in aux_dtypes.items()},
            "extra": extra or {}}


def add_checksums(meta: dict, algorithm: str, checksums: dict[str, dict]) -> dict:
    """`meta` with the hash's name and its values ({file: {key: hex}})."""
    meta["checksum"], meta[values_key(algorithm)] = algorithm, checksums
    return meta


def _named(path: str, exc: NonFiniteError) -> NonFiniteError:
    """The writer's error with the checkpoint it was refused for."""
    return NonFiniteError(f"not saving {path}: {exc}; a checkpoint is never written with inf "
                          f"or nan")


def _check_aux(model: nn.Module, aux: dict) -> None:
    """Every aux tensor names a local parameter and has its shape, and every stored parameter
    has one (load and reshard expect them all) (ValueError otherwise)."""
    params = dict(model.named_parameters())
    needed = {name for name, _ in stored_parameters(model).values()}
    for prefix, tensors in aux.items():
        if not prefix or "/" in prefix:
            raise ValueError(f"aux prefix {prefix!r} must be a non-empty name without '/'")
        missing = sorted(needed - set(tensors))
        if missing:
            raise ValueError(f"aux[{prefix!r}] lacks parameters {missing[:3]} ({len(missing)} "
                             f"in all): give a tensor for every parameter")
        for name, t in tensors.items():
            if name not in params:
                raise ValueError(f"aux[{prefix!r}] names {name!r}, which is not a parameter of "
                                 f"this model: key aux tensors by model.named_parameters() names")
            if tuple(t.shape) != tuple(params[name].shape):
                raise ValueError(f"aux[{prefix!r}][{name!r}] has shape {tuple(t.shape)}, the "
                                 f"parameter has {tuple(params[name].shape)}")


def _write_rank_file(model: nn.Module, file: str, aux: dict) -> None:
    """This rank's parameters (and their aux tensors) into one safetensors file."""
    tensors = {}
    for fname, (name, p) in stored_parameters(model).items():
        tensors[fname] = p
        for prefix, by_name in aux.items():
            if name in by_name:
                tensors[f"{prefix}/{fname}"] = by_name[name]
    specs = {k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()}
    with SafetensorsWriter(file, specs) as writer:
        for key, t in tensors.items():
            writer.write(key, t)
    write_json(file + SUMS_SUFFIX, {"checksum": writer.algorithm, "checksums": writer.checksums})


def _gather_checksums(tmp: str, files: list[str]) -> tuple[str, dict[str, dict]]:
    """(hash name, {file: {key: hex}}) from the rank files' checksum notes, which are then
    removed; every rank must have used the same hash."""
    sums, algorithms = {}, set()
    for name in files:
        note = os.path.join(tmp, name + SUMS_SUFFIX)
        with open(note) as f:
            data = json.load(f)
        algorithms.add(data["checksum"])
        sums[name] = data["checksums"]
        os.remove(note)
    if len(algorithms) > 1:
        raise RuntimeError(f"the ranks hashed their files with different checksums "
                           f"{sorted(algorithms)}: install xxhash on every node, or on none")
    return (algorithms.pop() if algorithms else default_algorithm()), sums


class SavedElsewhereFailed(RuntimeError, ValueError):
    """A save that failed on another rank (whose own error says why: a full disk, inf / nan);
    a ValueError too, so a command reports it as one line (printed by rank 0) like the
    cause, never as a traceback on every other rank."""


def agree(step: Callable[[], object], state: ParallelState | None, device: torch.device,
          elsewhere: Exception, nonfinite: Exception | None = None) -> object:
    """Run `step()` on this rank, then agree (one all-reduce, which also synchronises): if it
    raised on any rank, raise on every rank: its own error where it failed, `elsewhere` on
    the others (`nonfinite` instead, if given, when a NonFiniteError was among the causes).
    `state` None: one process."""
    result, error = None, None
    try:
        result = step()
    except Exception as exc:  # reported to every rank below, then re-raised here
        error = exc
    code = 0 if error is None else 2 if isinstance(error, NonFiniteError) else 1
    if state is not None and state.world_size > 1:
        flag = torch.tensor([code], device=comm_device(device))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        code = int(flag.item())
    if code and error is None:
        error = nonfinite if code == 2 and nonfinite is not None else elsewhere
    if error is not None:
        raise error
    return result


def _collectively(step: Callable[[], object], state: ParallelState, device: torch.device,
                  path: str, owns_temp: bool = True) -> object:
    """`agree` on one step of saving `path`; on a failure anywhere, rank 0 also removes the
    temp dir (when this write created it)."""
    elsewhere = SavedElsewhereFailed(f"saving {path} failed on another rank; see its error")
    nonfinite = NonFiniteError(f"not saving {path}: another rank found a tensor holding inf "
                               f"or nan (its error names it)")
    try:
        return agree(step, state, device, elsewhere, nonfinite)
    except Exception:
        if state.global_rank == 0 and owns_temp:
            discard(path)
        raise


def refuse_nonfinite(tensors: Iterable[tuple[str, torch.Tensor]], path: str,
                     state: ParallelState, device: torch.device) -> None:
    """NonFiniteError on every rank, worded as `save_checkpoint`'s, if any rank's `tensors`
    ((name, local tensor) pairs) hold inf or nan. Collective (one all-reduce)."""
    def check() -> None:
        for name, tensor in tensors:
            try:
                check_finite(name, tensor.detach())
            except NonFiniteError as exc:
                raise _named(path, exc) from None

    _collectively(check, state, device, path, owns_temp=False)


def save_checkpoint(model: nn.Module, path, *, state: ParallelState | None = None,
                    extra: dict | None = None,
                    aux: dict[str, dict[str, torch.Tensor]] | None = None,
                    overwrite: bool = False,
                    rank_files: Callable[[str], None] | None = None,
                    device: torch.device | None = None) -> None:
    """Save `model` (this rank's part of it) to the checkpoint directory `path`.

    Collective: every rank of `state` calls it (state None: `model.state`, else one process).
    Ranks with dp rank 0 and sp rank 0 write their (pp, tp) file into the temp folder; global
    rank 0 writes megazoo.json and publishes it (`output.py`, which also says what
    `overwrite` may replace). `aux` maps a prefix ("exp_avg") to {local parameter name:
    tensor shaped like it}, for every parameter. Raises on every rank if any rank failed;
    `path` is then left as it was. `rank_files(tmp)`, if given, runs on every rank to add
    that rank's own files (per-rank state such as gradient-compression residuals).
    `device`: where the ranks' agreement all-reduces run (default: the parameters'; an engine
    saving a host copy of its GPU model passes its GPU).
    """
    state = state or getattr(model, "state", None) or ParallelState.single()
    aux = aux or {}
    _check_aux(model, aux)
    path = os.fspath(path)
    params = list(model.parameters())
    device = device or (params[0].device if params else torch.device("cpu"))
    lead, tmp = state.global_rank == 0, temp_dir(path)

    def start() -> None:
        if lead:
            check_output_dir(path, kind="megazoo", overwrite=overwrite)
            fresh_temp_dir(path)

    _collectively(start, state, device, path, owns_temp=False)

    def write() -> dict | None:
        if rank_files is not None:
            rank_files(tmp)
        if state.dp.rank == 0 and state.sp.rank == 0:
            file = os.path.join(tmp, rank_file(state.pp.rank, state.tp.rank))
            try:
                _write_rank_file(model, file, aux)
            except NonFiniteError as exc:
                raise _named(path, exc) from None
        if not lead:
            return None
        layout = {"tp": state.tp.size, "pp": state.pp.size, "vpp": len(model.chunks)}
        aux_dtypes = {k: next(iter(v.values())).dtype for k, v in aux.items() if v}
        dtype = params[0].dtype if params else torch.float32
        return build_metadata(model.config, layout, dtype, extra, aux_dtypes)

    meta = _collectively(write, state, device, path)

    def finish() -> None:
        if not lead:
            return
        missing = [f for f in meta["files"] if not os.path.exists(os.path.join(tmp, f))]
        if missing:
            raise RuntimeError(f"rank files {missing} were not written")
        add_checksums(meta, *_gather_checksums(tmp, meta["files"]))
        fault_point("save-files-written", path)
        write_json(os.path.join(tmp, METADATA_FILE), meta)
        publish(path)

    _collectively(finish, state, device, path)


def write_checkpoint(config: ModelConfig, path, full_tensor: Callable[[str], torch.Tensor], *,
                     tp: int = 1, pp: int = 1, vpp: int = 1, dtype: torch.dtype | None = None,
                     extra: dict | None = None, aux_prefixes=(),
                     aux_dtype: torch.dtype = torch.float32, overwrite: bool = False,
                     inputs=()) -> None:
    """Write a checkpoint of `config` at layout (tp, pp, vpp) in one process, streaming.

    `full_tensor(full_name)` returns a full, unpadded parameter (`full_tensor(f"{prefix}/{name}")`
    an aux tensor); each is fetched when its rank file is written, sliced, written and freed, so
    memory holds about one full tensor. dtype None: the dtype of the first tensor fetched.
    Atomic like `save_checkpoint`, with the same `overwrite` rule;
    `inputs` are the folders `full_tensor` reads, which `path` must not be nor contain.
    """
    layout = {"tp": tp, "pp": pp, "vpp": vpp}
    path = os.fspath(path)
    check_output_dir(path, kind="megazoo", overwrite=overwrite, inputs=inputs)
    first = rank_model(config, layout, 0, 0)  # validates the layout and the model against it
    if dtype is None:
        dtype = full_tensor(next(iter(stored_parameters(first)))).dtype
    tmp = fresh_temp_dir(path)
    checksums, algorithm = {}, default_algorithm()
    try:
        for p in range(pp):
            for t in range(tp):
                model = first if p == t == 0 else rank_model(config, layout, p, t)
                checksums[rank_file(p, t)] = _stream_rank(
                    model, t, tp, os.path.join(tmp, rank_file(p, t)), full_tensor, dtype,
                    tuple(aux_prefixes), aux_dtype, algorithm)
        meta = add_checksums(build_metadata(config, layout, dtype, extra,
                                            {a: aux_dtype for a in aux_prefixes}),
                             algorithm, checksums)
        write_json(os.path.join(tmp, METADATA_FILE), meta)
        publish(path)
    except NonFiniteError as exc:
        discard(path)
        raise _named(path, exc) from None
    except BaseException:
        discard(path)
        raise


def _stream_rank(model: nn.Module, tp_rank: int, tp: int, file: str, full_tensor, dtype,
                 aux_prefixes: tuple, aux_dtype, algorithm: str) -> dict[str, str]:
    """One rank file: plan every key from the meta model, then fetch, slice and write each;
    returns the file's checksums {key: hex} (hash `algorithm`)."""
    stored = stored_parameters(model)
    specs = {}
    for fname, (_, p) in stored.items():
        specs[fname] = (dtype, tuple(p.shape))
        for prefix in aux_prefixes:
            specs[f"{prefix}/{fname}"] = (aux_dtype, tuple(p.shape))
    with SafetensorsWriter(file, specs, algorithm) as writer:
        for key in specs:
            p = stored[key.split("/", 1)[-1]][1]  # an aux tensor is sharded like its parameter
            full = full_tensor(key)
            expected = full_shape(p, tp)
            if tuple(full.shape) != expected:
                raise ValueError(f"{key}: got a tensor of shape {tuple(full.shape)}, the model "
                                 f"config needs {expected}: the config contradicts the weights")
            writer.write(key, tp_slice(full, p, tp_rank, tp))
            del full
    return writer.checksums
