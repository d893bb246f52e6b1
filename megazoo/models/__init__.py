"""GPT, BLOOM and LLaMA: one transformer block, three configurations, any parallel layout.

    from megazoo.models import ModelConfig, build_model, PRESETS
    model = build_model("bloom-176b")                 # meta device: no memory
    model = build_model(ModelConfig(family="llama", num_layers=2, hidden_size=64,
                                    num_attention_heads=8, num_key_value_heads=4,
                                    vocab_size=300), state, device="cpu", seed=0)
    logits = model(input_ids)                          # [b, s] -> [b, s, vocab]
    loss = model(input_ids, labels=input_ids)          # mean token loss (shifted inside)
    loss.backward()   # then megazoo.training.gradients completes the gradients
"""
from ..config.layout import check_layout, layer_ranges
from ..config.model import ModelConfig
from ..config.presets import PRESETS
from .block import TransformerBlock
from .build import MODEL_CLASSES, build_model, resolve_config
from .model import BloomModel, GPTModel, LlamaModel, TransformerModel
from .params import count_parameters, full_name

__all__ = ["ModelConfig", "build_model", "PRESETS", "TransformerModel", "GPTModel",
           "BloomModel", "LlamaModel", "count_parameters", "full_name", "layer_ranges",
           "resolve_config", "MODEL_CLASSES", "check_layout", "TransformerBlock"]
