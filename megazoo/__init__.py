"""megazoo: a Megatron-style model zoo.

`save_checkpoint` and `load_pretrained` (megazoo.checkpoint) are re-exported lazily, so
`import megazoo` stays light.
"""

__all__ = ["save_checkpoint", "load_pretrained"]


def __getattr__(name: str):
    if name in __all__:
        from . import checkpoint
        return getattr(checkpoint, name)
    raise AttributeError(f"module 'megazoo' has no attribute {name!r}")
