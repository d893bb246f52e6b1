"""`generate`: text (or token ids) from a model or a checkpoint folder, and the lookups it
needs: the checkpoint behind a `--save` folder, and the tokenizer a checkpoint was made with.

    import megazoo
    text = megazoo.generate("checkpoints", "def main(", max_new_tokens=40, greedy=True)
    texts = megazoo.generate(model, ["a", "bc"], tokenizer=tok, top_k=50, top_p=0.9, seed=1)
    new_ids = megazoo.generate(model, [[5, 17, 3], [8]], max_new_tokens=4, greedy=True)

A checkpoint's tokenizer, in this order: the one its training run recorded in megazoo.json
(`extra.args.data`: the SentencePiece model or HF tokenizer.json of `--tokenizer-model`, or
the byte-level one; a relative path is looked up from here, then from the folder holding the
`--save` folder); a `tokenizer.json` (or SentencePiece `tokenizer.model`) in the
checkpoint folder or the folder above it (where a converted Hugging Face model's tokenizer
is put). `tokenizer=` overrides the lookup.
"""
from __future__ import annotations

import os

from ..data.tokenizer import (ByteLevelTokenizer, HFTokenizer, SentencePieceTokenizer, Tokenizer,
                              build_tokenizer)
from ..errors import read_json
from ..parallel.device import local_device
from .loop import generate_ids
from .sampling import Sampling

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
TOKENIZER_HINT = ("pass --tokenizer PATH (a tokenizer.json or a folder holding one, a "
                  "SentencePiece .model, or 'bytes')")


def resolve_checkpoint(path) -> str:
    """An iter_* folder as given, or the one a --save folder's `latest` names
    (`megazoo.checkpoint.resolve`), as one line for the command."""
    from ..checkpoint.resolve import resolve_checkpoint as resolve

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"--load {path}: no such folder")
    return resolve(path)  # its CheckpointNotFound is a ValueError too


def tokenizer_from(spec: str) -> Tokenizer:
    """A tokenizer named on the command line: 'bytes', a .model file, or a tokenizer.json /
    folder holding one."""
    if spec in ("bytes", "ByteLevelTokenizer"):
        return ByteLevelTokenizer()
    if spec.endswith(".model") and os.path.isfile(spec):
        return SentencePieceTokenizer(spec)
    if os.path.isfile(spec) or os.path.isfile(os.path.join(spec, "tokenizer.json")):
        return HFTokenizer(spec)
    raise ValueError(f"--tokenizer {spec}: not found; {TOKENIZER_HINT}")


def recorded_tokenizer(checkpoint: str) -> Tokenizer | None:
    """The tokenizer the training run recorded in megazoo.json (None if it recorded none)."""
    meta = read_json(os.path.join(checkpoint, "megazoo.json"), advice="the checkpoint is damaged")
    data = (((meta.get("extra") or {}).get("args") or {}).get("data") or {})
    kind, model = data.get("tokenizer_type"), data.get("tokenizer_model")
    if not kind:
        return None
    if model and not os.path.isabs(model) and not os.path.exists(model):
        # recorded relative to the run's folder: the one holding the --save folder
        run_dir = os.path.dirname(os.path.dirname(os.path.abspath(checkpoint)))
        model = os.path.join(run_dir, model) if os.path.exists(os.path.join(run_dir, model)) else model
    if model and not os.path.exists(model):
        raise ValueError(f"the tokenizer this checkpoint was trained with ({model}, recorded in "
                         f"{checkpoint}/megazoo.json) is missing; {TOKENIZER_HINT}")
    return build_tokenizer(kind, model)


def find_tokenizer(checkpoint: str, override: str | None = None) -> Tokenizer:
    """The checkpoint's tokenizer (module docstring for the order); ValueError if none."""
    if override:
        return tokenizer_from(override)
    found = recorded_tokenizer(checkpoint)
    if found is not None:
        return found
    for folder in (checkpoint, os.path.dirname(os.path.abspath(checkpoint))):
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(folder, name)):
                return tokenizer_from(os.path.join(folder, name))
    raise ValueError(f"no tokenizer found for {checkpoint}: megazoo.json records none and no "
                     f"tokenizer.json or tokenizer.model is next to it; {TOKENIZER_HINT}")


def encode_prompt(tokenizer: Tokenizer, text: str) -> list[int]:
    """A prompt's ids: an HF tokenizer adds its template's special tokens (LLaMA's <s>), as
    transformers does for a prompt; the others encode the text alone, as megazoo's data is."""
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.encode(text, add_special_tokens=True)
    return tokenizer.encode(text)


def decode_text(tokenizer: Tokenizer, ids: list[int]) -> str:
    """Text of prompt + continuation ids, without an HF tokenizer's special tokens."""
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.decode(ids, skip_special_tokens=True)
    return tokenizer.decode(ids)


def _is_text(prompts) -> bool:
    return isinstance(prompts, str) or (bool(prompts) and all(isinstance(p, str) for p in prompts))


def generate(model_or_dir, prompts, max_new_tokens: int = 64, *, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, greedy: bool = False, seed: int = 0,
             tokenizer: Tokenizer | str | None = None, state=None, device=None, dtype=None,
             cuda_graphs: bool | None = None, stop_at_eos: bool = True, cache: bool = True,
             max_context: int | None = None):
    """Continue `prompts` with a KV cache (see the module docstring for examples).

    prompts: a string, a list of strings, or a list of token-id lists. Returns, for text,
    the prompt plus its continuation (a string, or a list of them); for ids, the new ids of
    each prompt. A checkpoint folder is loaded at `state`'s layout (None: one process) on
    `device` (default: this rank's accelerator, else the CPU) in `dtype` (default: the
    checkpoint's). Rows stop at the tokenizer's end-of-document id when `stop_at_eos`.
    `cache=False` recomputes the context (at most `max_context` tokens) per token instead:
    any layout, any engine's model (`loop.generate_ids`).
    """
    sampling = Sampling(greedy, temperature, top_k, top_p)
    text = _is_text(prompts)
    if isinstance(tokenizer, str):
        tokenizer = tokenizer_from(tokenizer)
    model = model_or_dir
    if isinstance(model_or_dir, (str, os.PathLike)):
        from ..checkpoint import load_pretrained

        checkpoint = resolve_checkpoint(model_or_dir)
        if tokenizer is None and text:
            tokenizer = find_tokenizer(checkpoint)
        model = load_pretrained(checkpoint, state=state, device=device or local_device(),
                                dtype=dtype)
    if text and tokenizer is None:
        raise ValueError("text prompts need a tokenizer: pass tokenizer= (or a checkpoint "
                         "folder, whose tokenizer is found for you)")
    texts = [prompts] if isinstance(prompts, str) else prompts
    ids = [encode_prompt(tokenizer, t) for t in texts] if text else [list(p) for p in prompts]
    stop = tokenizer.eod if (text and stop_at_eos) else None
    new = generate_ids(model, ids, max_new_tokens, sampling, seed=seed, stop_id=stop,
                       cuda_graphs=cuda_graphs, cache=cache, max_context=max_context)
    if not text:
        return new
    out = [decode_text(tokenizer, p + n) for p, n in zip(ids, new)]
    return out[0] if isinstance(prompts, str) else out
