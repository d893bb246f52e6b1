"""Hugging Face <-> megazoo converters and checkpoint resharding.

    from megazoo.convert import hf_to_megazoo, megazoo_to_hf, reshard
    hf_to_megazoo("hf/llama", "ckpt/", tp=2, pp=2)       # model_type gpt2 | bloom | llama
    megazoo_to_hf("ckpt/", "hf_out/")                    # AutoModelForCausalLM loads it
    reshard("ckpt/", "ckpt_tp4/", tp=4, pp=1)            # any layout -> any layout

One adapter per family (`gpt2.py`, `bloom.py`, `llama.py`): config maps both ways and a key
map of `Rule`s through the unsharded (tp = 1) form; the checkpoint writer does the tp/pp split
and vocabulary padding. Everything streams tensor by tensor and is written atomically.
Command lines: checkpoints_tools/{hf_to_megazoo,megazoo_to_hf,reshard}.py (see `cli.py`).
"""
from .api import ADAPTERS, adapter_for, hf_config, hf_to_megazoo, megazoo_to_hf, reshard
from .common import Adapter, Rule, fuse_qkv, split_qkv

__all__ = ["hf_to_megazoo", "megazoo_to_hf", "reshard", "ADAPTERS", "adapter_for", "hf_config",
           "Adapter", "Rule", "fuse_qkv", "split_qkv"]
