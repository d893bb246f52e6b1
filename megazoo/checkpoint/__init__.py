"""Checkpoints: safetensors shards + megazoo.json, written at one layout, loaded into any.

    save_checkpoint(model, "ckpt/", state=state, aux={"exp_avg": moments})   # collective
    model = load_pretrained("ckpt/", state=other_state)                     # any layout
    meta, aux = load_model_weights(model, "ckpt/", aux_prefixes=("exp_avg",))
    reader = CheckpointReader("ckpt/"); reader.full_tensor("final_norm.weight")
    write_checkpoint(config, "out/", full_tensor_fn, tp=2, pp=2)           # one process

Layout on disk: `megazoo.json` ({"format": "megazoo-checkpoint-1", "model": config dict,
"layout": {"tp", "pp", "vpp"}, "dtype", "files", "params": {full name: {"full_shape",
"dtype"}}, "aux": [prefixes], "extra", "checksum": "xxh3_64" | "crc32" and the values
{file: {key: hex}} under "checksums_xxh3_64" | "checksums"}) and `model-pp{p:03d}-tp{t:03d}.safetensors`, the
shards of rank (p, t) keyed by full parameter name (`prefix/name` for aux tensors). Nothing is
read with pickle.
"""
from .files import SafetensorsWriter, dtype_name, parse_dtype
from .layout import FORMAT, METADATA_FILE, rank_file, rank_model, virtual_state
from .load import CheckpointReader, check_config, config_from_dict, load_model_weights, load_pretrained
from .save import save_checkpoint, write_checkpoint

__all__ = ["save_checkpoint", "load_pretrained", "load_model_weights", "CheckpointReader",
           "write_checkpoint", "virtual_state", "rank_model", "rank_file", "FORMAT",
           "METADATA_FILE", "SafetensorsWriter", "dtype_name", "parse_dtype", "check_config",
           "config_from_dict"]
