"""The three conversions: Hugging Face -> megazoo, megazoo -> Hugging Face, megazoo -> megazoo.

Each validates everything it can from headers and configs before writing (key sets, every
HF tensor shape against the shape the config implies, the target layout), streams tensor by
tensor, and writes into a temp dir renamed into place, so a failure leaves no partial output.
"""
from __future__ import annotations

import os

import torch

from ..checkpoint import CheckpointReader, dtype_name, write_checkpoint
from ..checkpoint.files import write_json
from ..checkpoint.output import check_output_dir, discard, fresh_temp_dir, publish
from ..checkpoint.layout import full_shapes
from ..models import ModelConfig
from .common import Adapter, Rule
from .bloom import ADAPTER as BLOOM
from .gpt2 import ADAPTER as GPT2
from .hf_io import HFReader, read_hf_config, write_hf_weights
from .llama import ADAPTER as LLAMA

ADAPTERS = {a.model_type: a for a in (GPT2, BLOOM, LLAMA)}
BY_FAMILY = {a.family: a for a in ADAPTERS.values()}
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")  # carried through `extra`


def adapter_for(model_type: str) -> Adapter:
    """The adapter of an HF model_type ("gpt2", "bloom", "llama")."""
    if model_type not in ADAPTERS:
        raise ValueError(f"unsupported model_type {model_type!r}: supported are "
                         f"{', '.join(sorted(ADAPTERS))}")
    return ADAPTERS[model_type]


def hf_shapes(cfg: ModelConfig, rules: list[Rule]) -> dict[str, tuple[int, ...]]:
    """The HF key -> shape the config implies (each rule's to_hf run on meta tensors)."""
    full = full_shapes(cfg)
    out = {}
    for rule in rules:
        tensors = rule.to_hf(torch.empty(full[rule.name], device="meta"))
        assert len(tensors) == len(rule.hf_keys), rule.name
        out.update({k: tuple(t.shape) for k, t in zip(rule.hf_keys, tensors)})
    return out


def check_hf_weights(reader: HFReader, adapter: Adapter, cfg: ModelConfig,
                     expected: dict[str, tuple[int, ...]]) -> None:
    """Key sets equal (up to ignorable keys) and every shape as the config implies."""
    missing = sorted(set(expected) - reader.keys)
    unexpected = sorted(k for k in reader.keys - set(expected) if not adapter.ignored(k))
    if missing or unexpected:
        raise ValueError(f"HF weights do not match the {adapter.model_type} key map "
                         f"({len(expected)} keys expected, {len(reader.keys)} found): missing "
                         f"{missing[:3]}, unexpected {unexpected[:3]}")
    for key, shape in expected.items():
        if reader.shape(key) != shape:
            raise ValueError(f"config.json contradicts the weights: {key} has shape "
                             f"{reader.shape(key)}, the config (hidden_size {cfg.hidden_size}, "
                             f"{cfg.num_attention_heads} heads, vocab {cfg.vocab_size}) implies {shape}")


def hf_to_megazoo(hf_dir, out, *, tp: int = 1, pp: int = 1, vpp: int = 1,
                  dtype: torch.dtype | None = None, overwrite: bool = False) -> ModelConfig:
    """Convert the HF model in `hf_dir` to a megazoo checkpoint at layout (tp, pp, vpp).

    An existing, non-empty `out` is refused unless `overwrite` (and then replaced only if it
    is a megazoo checkpoint and holds nothing else); `out` may never be or contain `hf_dir`.
    """
    hf_dir, out = os.fspath(hf_dir), os.fspath(out)
    check_output_dir(out, kind="megazoo", overwrite=overwrite, inputs=[hf_dir])
    hf = read_hf_config(hf_dir)
    adapter = adapter_for(hf.get("model_type"))
    cfg = adapter.config_from_hf(hf)
    rules = adapter.rules(cfg)
    expected = hf_shapes(cfg, rules)
    reader = HFReader(hf_dir, adapter.prefix)
    check_hf_weights(reader, adapter, cfg, expected)
    by_name = {r.name: r for r in rules}

    def full_tensor(name: str) -> torch.Tensor:
        rule = by_name[name]
        return rule.from_hf([reader.get(k) for k in rule.hf_keys])

    tokens = {k: hf[k] for k in TOKEN_IDS if hf.get(k) is not None}
    write_checkpoint(cfg, out, full_tensor, tp=tp, pp=pp, vpp=vpp, dtype=dtype,
                     extra={"converted_from": adapter.model_type, "hf_token_ids": tokens},
                     overwrite=overwrite, inputs=[hf_dir])
    return cfg


def hf_config(cfg: ModelConfig, dtype: torch.dtype, tokens: dict | None = None) -> dict:
    """config.json for `cfg` (ValueError when HF has no such architecture); `tokens`: the
    bos/eos/pad ids an HF conversion recorded (None: HF's defaults, valid only for small ids)."""
    if cfg.family not in BY_FAMILY:
        raise ValueError(f"family {cfg.family!r} has no Hugging Face adapter")
    if cfg.sparse is not None and cfg.sparse.mode != "dense":
        raise ValueError(f"the model uses {cfg.sparse.mode} block-sparse attention, which Hugging "
                         f"Face's {cfg.family} architecture cannot express: export refused "
                         f"(keep it as a megazoo checkpoint)")
    adapter = BY_FAMILY[cfg.family]
    return {"architectures": [adapter.architecture], "model_type": adapter.model_type,
            **adapter.config_to_hf(cfg), "dtype": dtype_name(dtype), "use_cache": True,
            **{k: None for k in TOKEN_IDS}, **(tokens or {})}


def megazoo_to_hf(load, out, *, dtype: torch.dtype | None = None,
                  max_shard_bytes: int = 5 * 2**30, overwrite: bool = False,
                  verify_checksums: bool = True) -> dict:
    """Write the megazoo checkpoint `load` (any layout) as an HF model directory `out`.

    `overwrite` as in `hf_to_megazoo`: only an HF model folder holding nothing but the files
    this writes is replaced (a tokenizer or README beside them makes it a refusal). Each
    tensor read is checked against its recorded checksum unless `verify_checksums=False`.
    """
    load, out = os.fspath(load), os.fspath(out)
    check_output_dir(out, kind="hf", overwrite=overwrite, inputs=[load])
    reader = CheckpointReader(load, verify_checksums=verify_checksums)
    reader.nonfinite_override = ""  # the writer refuses inf / nan: no flag can help
    cfg, dtype = reader.config, dtype or reader.dtype
    config = hf_config(cfg, dtype, (reader.metadata.get("extra") or {}).get("hf_token_ids"))
    rules = BY_FAMILY[cfg.family].rules(cfg)
    expected = hf_shapes(cfg, rules)

    def hf_tensors():
        for rule in rules:
            for key, t in zip(rule.hf_keys, rule.to_hf(reader.full_tensor(rule.name))):
                assert tuple(t.shape) == expected[key], (key, t.shape, expected[key])
                yield key, t

    tmp = fresh_temp_dir(out)
    try:
        write_hf_weights(tmp, {k: (dtype, s) for k, s in expected.items()}, hf_tensors(),
                         max_shard_bytes)
        write_json(os.path.join(tmp, "config.json"), config)
        publish(out)
    except BaseException:
        discard(out)
        raise
    return config


def reshard(load, out, *, tp: int = 1, pp: int = 1, vpp: int = 1,
            dtype: torch.dtype | None = None, overwrite: bool = False,
            verify_checksums: bool = True) -> None:
    """Rewrite checkpoint `load` at layout (tp, pp, vpp) into `out`, aux tensors included
    (`overwrite` as in `hf_to_megazoo`; `out` is never `load` nor a folder containing it;
    `verify_checksums` as in `megazoo_to_hf`)."""
    check_output_dir(out, kind="megazoo", overwrite=overwrite, inputs=[load])
    reader = CheckpointReader(load, verify_checksums=verify_checksums)
    reader.nonfinite_override = ""  # the writer refuses inf / nan: no flag can help
    meta = reader.metadata
    aux_dtypes = {meta.get("aux_dtypes", {}).get(a, "float32") for a in reader.aux_prefixes}
    aux_dtype = getattr(torch, aux_dtypes.pop()) if len(aux_dtypes) == 1 else torch.float32

    def full_tensor(key: str) -> torch.Tensor:
        prefix, _, name = key.rpartition("/")
        return reader.full_tensor(name, prefix or None)

    write_checkpoint(reader.config, out, full_tensor, tp=tp, pp=pp, vpp=vpp,
                     dtype=dtype or reader.dtype, extra=meta.get("extra"),
                     aux_prefixes=reader.aux_prefixes, aux_dtype=aux_dtype,
                     overwrite=overwrite, inputs=[load])

