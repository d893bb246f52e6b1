"""Reading checkpoints into any layout: `CheckpointReader` (streaming, no process group),
`load_model_weights` (into an existing model) and `load_pretrained` (build on the meta device,
allocate without init, load).

A full tensor is rebuilt from the source layout's shards with `tp_unslice` (driven by the meta
model of the source rank) and cut for the target rank with `tp_slice`, so any tp/pp/vpp loads
into any other. Each tensor is checked as it is read, piece by piece while the pieces are in
the CPU cache: against the checksum megazoo.json records for it, with the hash it names
(`checksums.py`; a checksum not recorded is an error, not a reason to skip), and for inf / nan
(a matching checksum says the bytes are the ones recorded, not that the values are usable).
Every failure is a ValueError naming the file and the tensor; `verify_checksums=False`
(--no-verify-checksums) and `allow_nonfinite=True` (--allow-nonfinite-load) turn the checks off.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os

import torch
from safetensors import safe_open
from torch import nn

from ..errors import read_json
from ..layers.sharding import full_shape, tp_slice, tp_unslice
from ..models import ModelConfig, build_model, full_name
from ..parallel.config import ParallelConfig
from ..parallel.state import ParallelState
from .checksums import CRC32, Hasher, check_algorithm, values_key
from .files import BackgroundChecks, nonfinite_count, parse_dtype, read_header, read_tensor
from .resolve import resolve_checkpoint
from .layout import FORMAT, METADATA_FILE, rank_file, rank_model, stored_parameters

# What a missing checksum's error offers (the command lines' flag, the API's argument).
UNCHECKED = "restore it, or load unchecked with --no-verify-checksums (verify_checksums=False)"
# Fields that must agree between a checkpoint and the model it is loaded into.
SHAPE_FIELDS = ("family", "num_layers", "hidden_size", "num_attention_heads",
                "num_key_value_heads", "ffn_hidden_size", "vocab_size", "position_embedding",
                "norm", "activation", "embedding_layernorm", "tie_word_embeddings", "qkv_bias",
                "dense_bias", "mlp_bias")


def read_metadata(path: str, format: str = FORMAT, hint: str = "") -> dict:
    """`path`/megazoo.json, a ValueError (ending with `hint`) unless it is of `format`."""
    file = os.path.join(path, METADATA_FILE)
    meta = read_json(file, advice="the checkpoint is damaged")
    if meta.get("format") != format:
        raise ValueError(f"{file}: format {meta.get('format')!r} is not {format!r}{hint}")
    return meta


def config_from_dict(data: dict) -> ModelConfig:
    """A ModelConfig from `ModelConfig.to_dict()` output (unknown fields are a ValueError)."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"checkpoint config has fields {unknown} this megazoo does not know: "
                         f"update megazoo")
    return ModelConfig(**data)


class CheckpointReader:
    """Lazy access to a checkpoint's full tensors, whatever layout wrote it.

        reader = CheckpointReader("ckpt/")        # or a --save folder: its `latest`
        reader.config, reader.layout, reader.names(), reader.aux_prefixes
        w = reader.full_tensor("layers.0.attention.qkv.weight")        # full, unpadded
        m = reader.full_tensor("layers.0.attention.qkv.weight", "exp_avg")
    Each call reads only that key, from the files of the stage holding it (of the tp ranks
    that hold a distinct shard), checked as the module docstring says.
    """

    #: How a non-finite tensor's error says to load it anyway; a tool that cannot (a converter:
    #: its writer refuses inf / nan) sets "" so its advice stays followable.
    nonfinite_override = " (--allow-nonfinite-load, allow_nonfinite=True, loads it anyway)"

    def __init__(self, path, *, verify_checksums: bool = True, allow_nonfinite: bool = False):
        self.path = resolve_checkpoint(path)  # a --save folder means its `latest`
        self.verify_checksums, self.allow_nonfinite = verify_checksums, allow_nonfinite
        self._background: BackgroundChecks | None = None
        self.metadata = read_metadata(self.path)
        self.algorithm = self.metadata.get("checksum") or CRC32
        self.checksums = self.metadata.get(values_key(self.algorithm))
        if verify_checksums:
            self._check_recorded()
        self.config = config_from_dict(self.metadata["model"])
        lay = self.metadata["layout"]
        self.layout = {"tp": lay["tp"], "pp": lay["pp"], "vpp": lay.get("vpp", 1)}
        ParallelConfig(**self.layout)  # a ValueError unless the sizes are valid
        self.aux_prefixes = tuple(self.metadata.get("aux", ()))
        self.dtype = parse_dtype(self.metadata.get("dtype", "float32"))
        self._headers = {name: self._header(name) for name in self._rank_files()}
        self._stages: dict[int, list[dict]] = {}
        self._stage_of = {name: p for p in range(self.layout["pp"]) for name in
                          stored_parameters(rank_model(self.config, self.layout, p, 0))}

    def _rank_files(self) -> list[str]:
        """The rank files megazoo.json lists: exactly one per (pp, tp) rank of its layout."""
        files = self.metadata.get("files")
        want = [rank_file(p, t) for p in range(self.layout["pp"]) for t in range(self.layout["tp"])]
        if not isinstance(files, list) or sorted(map(str, files)) != sorted(want):
            raise ValueError(f"{os.path.join(self.path, METADATA_FILE)} lists the files "
                             f"{files!r}, its layout (tp {self.layout['tp']}, pp "
                             f"{self.layout['pp']}) writes {want}: the file was edited or "
                             f"damaged; restore it")
        return want

    def _check_recorded(self) -> None:
        """ValueError unless megazoo.json names a hash this install computes and holds its
        values."""
        where = os.path.join(self.path, METADATA_FILE)
        check_algorithm(self.algorithm, f"checkpoint {self.path}")
        if not isinstance(self.checksums, dict):
            named = f"{self.algorithm} checksums" if "checksum" in self.metadata else \
                "checksums (no \"checksum\" key)"
            raise ValueError(f"{where} records no {named} under "
                             f"\"{values_key(self.algorithm)}\": the file was edited or the "
                             f"checkpoint predates checksums; {UNCHECKED}")

    def _header(self, name: str) -> tuple[int, dict[str, tuple]]:
        """`read_header` of the rank file `name`, once safetensors has opened it."""
        file = os.path.join(self.path, name)
        if not os.path.isfile(file):
            raise ValueError(f"checkpoint file {file} is missing: the checkpoint is incomplete")
        try:
            with safe_open(file, framework="pt") as f:
                f.keys()
        except Exception as exc:  # safetensors raises its own error types
            raise ValueError(f"checkpoint file {file} is damaged or truncated ({exc})") from None
        return read_header(file)

    def names(self) -> list[str]:
        """Full names of every stored parameter."""
        return list(self._stage_of)

    def _source_params(self, stage: int) -> list[dict]:
        """Per source tp rank of `stage`: {full name: meta parameter}."""
        if stage not in self._stages:
            self._stages[stage] = [
                {n: p for n, (_, p) in stored_parameters(
                    rank_model(self.config, self.layout, stage, t)).items()}
                for t in range(self.layout["tp"])]
        return self._stages[stage]

    def _read(self, name: str, key: str) -> torch.Tensor:
        """`key` from the rank file `name`, its checksum verified as it is read, then tested
        for inf / nan."""
        file = os.path.join(self.path, name)
        start, entries = self._headers[name]
        if key not in entries:
            raise ValueError(f"checkpoint file {file} has no tensor {key!r}")
        hasher = None
        if self.verify_checksums:
            recorded = (self.checksums.get(name) or {}).get(key)
            if not isinstance(recorded, str):
                raise ValueError(f"{os.path.join(self.path, METADATA_FILE)} records no checksum "
                                 f"for tensor {key!r} of {name}: the file was edited or "
                                 f"damaged; {UNCHECKED}")
            hasher = Hasher(self.algorithm)
        try:
            with open(file, "rb", buffering=0) as f:
                tensor = read_tensor(f, start, entries[key], hasher)
        except (OSError, ValueError) as exc:
            raise ValueError(f"checkpoint file {file}: cannot read {key!r} ({exc})") from None
        if hasher is not None and hasher.hexdigest() != recorded:
            raise ValueError(f"checkpoint file {file} is corrupted: tensor {key!r} has checksum "
                             f"{hasher.hexdigest()}, megazoo.json recorded {recorded}; restore "
                             f"the file or load another checkpoint (--no-verify-checksums, "
                             f"verify_checksums=False, skips this check)")
        if not self.allow_nonfinite:  # a matching checksum does not make the values usable
            if self._background is not None:
                self._background.submit(self._check_finite, file, key, tensor)
            else:
                self._check_finite(file, key, tensor)
        return tensor

    @contextlib.contextmanager
    def checking_in_background(self):
        """Within the block, each tensor's inf / nan test runs on a worker thread while the
        caller reads the next; leaving the block waits for the tests and raises a failure."""
        self._background = checks = BackgroundChecks()
        try:
            yield
        except BaseException:
            checks.close(wait=False)
            raise
        finally:
            self._background = None
        checks.close()

    def _check_finite(self, file: str, key: str, tensor: torch.Tensor) -> None:
        """ValueError naming file and tensor if it holds inf / nan."""
        bad = nonfinite_count(tensor)
        if bad:
            raise ValueError(f"checkpoint file {file}: tensor {key!r} holds {bad} non-finite "
                             f"value{'s' if bad > 1 else ''} (inf or nan); load an earlier "
                             f"checkpoint{self.nonfinite_override}")

    def full_tensor(self, name: str, prefix: str | None = None) -> torch.Tensor:
        """The full (one-process, unpadded) parameter `name`, or its aux tensor `prefix`."""
        if name not in self._stage_of:
            raise ValueError(f"{self.path} has no parameter {name!r}")
        if prefix is not None and prefix not in self.aux_prefixes:
            raise ValueError(f"{self.path} has no aux tensors {prefix!r}; it has {self.aux_prefixes}")
        stage = self._stage_of[name]
        params = [ranks[name] for ranks in self._source_params(stage)]
        key = name if prefix is None else f"{prefix}/{name}"
        tp = self.layout["tp"]
        ranks = range(tp) if getattr(params[0], "tp_dim", None) is not None else range(1)
        shards = []
        for t in ranks:
            shard = self._read(rank_file(stage, t), key)
            if tuple(shard.shape) != tuple(params[t].shape):
                raise ValueError(f"checkpoint file {os.path.join(self.path, rank_file(stage, t))}: "
                                 f"{key!r} has shape {tuple(shard.shape)}, the layout needs "
                                 f"{tuple(params[t].shape)}")
            shards.append(shard)
        return tp_unslice(shards, params[0])


def check_config(ckpt: ModelConfig, model: ModelConfig) -> None:
    """ValueError listing every shape-defining field where the checkpoint and model differ."""
    learned = ckpt.position_embedding == "learned"  # only a learned table has a length
    fields = SHAPE_FIELDS + (("max_position_embeddings",) if learned else ())
    diffs = [(f, getattr(ckpt, f), getattr(model, f)) for f in fields
             if getattr(ckpt, f) != getattr(model, f)]
    if diffs:
        what = ", ".join(f"{f.replace('_', ' ').replace(' size', '')} {a}" for f, a, _ in diffs)
        has = ", ".join(f"{b}" for _, _, b in diffs)
        raise ValueError(f"checkpoint is a {ckpt.family} with {what}, model has {has}: "
                         f"load it into a model built from the checkpoint's config")


def load_model_weights(model: nn.Module, path, *, state: ParallelState | None = None,
                       aux_prefixes=(), verify_checksums: bool = True,
                       allow_nonfinite: bool = False) -> tuple[dict, dict[str, dict[str, torch.Tensor]]]:
    """Load the checkpoint at `path` into `model`, built at any layout; return (metadata,
    {prefix: {local parameter name: tensor shaped like it}}) for each of `aux_prefixes`.
    No collective: each rank reads what it needs."""
    state = state or getattr(model, "state", None) or ParallelState.single()
    reader = CheckpointReader(path, verify_checksums=verify_checksums,
                              allow_nonfinite=allow_nonfinite)
    check_config(reader.config, model.config)
    missing = [a for a in aux_prefixes if a not in reader.aux_prefixes]
    if missing:
        raise ValueError(f"{reader.path} holds no aux tensors {missing}; it has {list(reader.aux_prefixes)}")
    tp, rank = state.tp.size, state.tp.rank
    aux: dict[str, dict[str, torch.Tensor]] = {a: {} for a in aux_prefixes}
    with reader.checking_in_background():
        _copy_weights(model, reader, tp, rank, aux)
    return reader.metadata, aux


def _copy_weights(model: nn.Module, reader: CheckpointReader, tp: int, rank: int,
                  aux: dict[str, dict[str, torch.Tensor]]) -> None:
    """Each parameter of `model` (and its aux tensors) from `reader`, cut for tp rank `rank`."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            fname = full_name(name, p)
            full = reader.full_tensor(fname)
            if tuple(full.shape) != full_shape(p, tp):
                raise ValueError(f"{fname}: checkpoint shape {tuple(full.shape)}, model needs "
                                 f"{full_shape(p, tp)}")
            p.copy_(tp_slice(full, p, rank, tp))
            for a in aux:
                aux[a][name] = tp_slice(reader.full_tensor(fname, a), p, rank, tp).clone()


def can_materialize(model: nn.Module) -> bool:
    """Whether `materialize` keeps `model` intact: no buffers (not in checkpoints; none of our
    models has one: RoPE and ALiBi factors are computed in each forward) and no parameter
    shared by two modules (to_empty would give each module its own copy)."""
    named = list(model.named_parameters(remove_duplicate=False))
    return len({id(p) for _, p in named}) == len(named) and next(model.buffers(), None) is None


def materialize(model: nn.Module, device) -> nn.Module:
    """`model` (built on the meta device) allocated on `device`, uninitialised, by
    `to_empty`, keeping each parameter's sharding attributes (tp_dim, tp_unpadded, tp_index,
    tied_to, ...), which the fresh Parameters of to_empty would drop. Every element is
    garbage until loaded."""
    if not can_materialize(model):
        raise ValueError("materialize: the model has buffers or shared parameters, which "
                         "to_empty would leave uninitialised or untie: build it on its device")
    attributes = {name: dict(vars(p)) for name, p in model.named_parameters()}
    model.to_empty(device=device)
    for name, p in model.named_parameters():
        p.__dict__.update(attributes[name])
    return model


def load_pretrained(path, state: ParallelState | None = None, device="cpu",
                    dtype: torch.dtype | None = None, *, verify_checksums: bool = True,
                    allow_nonfinite: bool = False) -> nn.Module:
    """Build the checkpoint's model at `state`'s layout (None: one process) and load it.
    `path`: a checkpoint folder, or a training run's --save folder (its `latest` one).

    The model is built on the meta device and allocated on `device` without running the
    weight initialisation (`materialize`), since loading overwrites every parameter
    (vocabulary padding rows with zeros); a model `materialize` cannot take is built on
    `device` with its initialisation."""
    reader = CheckpointReader(path, verify_checksums=verify_checksums)
    dtype = dtype or reader.dtype
    model = build_model(reader.config, state, device="meta", dtype=dtype)
    if can_materialize(model):
        materialize(model, device)
    else:
        model = build_model(reader.config, state, device=device, dtype=dtype)
    load_model_weights(model, path, state=state, verify_checksums=verify_checksums,
                       allow_nonfinite=allow_nonfinite)
    return model
