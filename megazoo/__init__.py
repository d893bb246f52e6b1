"""megazoo: a Megatron-style model zoo.

`save_checkpoint` and `load_pretrained` (megazoo.checkpoint) and `generate`
(megazoo.generation) are re-exported lazily, so `import megazoo` stays light.
"""

__all__ = ["save_checkpoint", "load_pretrained", "generate"]


def __getattr__(name: str):
    if name == "generate":
        from .generation import generate
        return generate
    if name in __all__:
        from . import checkpoint
        return getattr(checkpoint, name)
    raise AttributeError(f"module 'megazoo' has no attribute {name!r}")
