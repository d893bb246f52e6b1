"""Tokenize text or JSON-lines files into a megazoo/Megatron ``PREFIX.bin`` + ``PREFIX.idx``.

Examples::

    python tools/preprocess_data.py --input 'corpus/*.jsonl' --output-prefix data/web \\
        --tokenizer-type HFTokenizer --tokenizer-model gpt2/tokenizer.json --append-eod
    python tools/preprocess_data.py --input book.txt --split-lines --output-prefix data/book \\
        --tokenizer-type ByteLevelTokenizer

Inputs ending in ``.jsonl`` / ``.json`` are read one JSON object per line, taking the
``--json-key`` field; anything else is plain text: one document per file, or one per
line with ``--split-lines``. Empty documents are skipped (and counted). Text is decoded with
``--encoding`` (default UTF-8); bytes that are not valid in it stop the run with the file and
line (``--errors strict``), become U+FFFD (``--errors replace``), or drop that document
(``--errors skip``, counted like empty ones).
"""

from __future__ import annotations

import argparse
import functools
import glob
import itertools
import json
import multiprocessing
import os
from pathlib import Path
from typing import Iterator

from ..cli_parser import HintingParser
from ..errors import report_error, user_path
from .indexed import IndexedDatasetBuilder, best_dtype, clean_temp_files, data_file_paths
from .provenance import record_path
from .tokenizer import TOKENIZER_TYPES, build_tokenizer

JSON_SUFFIXES = (".jsonl", ".json")
BATCH_DOCUMENTS = 64


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line, with Megatron's flag names."""
    p = HintingParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", nargs="+", required=True,
                   help="input files or glob patterns (.jsonl/.json: JSON lines; else text)")
    p.add_argument("--output-prefix", required=True,
                   help="writes PREFIX.bin, PREFIX.idx and PREFIX.tokenizer.json")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing dataset of --output-prefix (never an input)")
    p.add_argument("--tokenizer-type", required=True, choices=sorted(TOKENIZER_TYPES))
    p.add_argument("--tokenizer-model", default=None,
                   help="SentencePiece .model or HF tokenizer.json (or its directory)")
    p.add_argument("--json-key", default="text", help="field of each JSON line to tokenize")
    p.add_argument("--split-lines", action="store_true",
                   help="plain text: every non-empty line is a document (default: each file)")
    p.add_argument("--append-eod", action="store_true",
                   help="append the end-of-document id to every document")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    p.add_argument("--encoding", default="utf-8", help="text encoding of the inputs")
    p.add_argument("--errors", default="strict", choices=("strict", "replace", "skip"),
                   help="bytes invalid in --encoding: stop (strict), decode them as U+FFFD "
                        "(replace), or skip the document and count it (skip)")
    return p.parse_args(argv)


def expand_inputs(patterns: list[str]) -> list[Path]:
    """Files named by ``patterns`` (globs expanded, order kept); error if one matches none."""
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        matches = [m for m in matches if Path(m).is_file()]
        if not matches:
            raise FileNotFoundError(f"--input {pattern!r} matches no file; check the path")
        files.extend(Path(m) for m in matches)
    return files


def _decode(raw: bytes, path: Path, line: int | None, encoding: str, errors: str) -> str | None:
    """`raw` as text with newlines made "\\n" (as text mode reads it); None when undecodable
    under --errors skip; ValueError under strict."""
    try:
        text = raw.decode(encoding, "replace" if errors == "replace" else "strict")
        return text.replace("\r\n", "\n").replace("\r", "\n")
    except UnicodeDecodeError as exc:
        if errors == "skip":
            return None
        where = f"{path}:{line}" if line else str(path)
        raise ValueError(f"{where} is not {encoding} text (byte 0x{raw[exc.start]:02x} at "
                         f"offset {exc.start}): pass --encoding (e.g. latin-1) if it is another "
                         f"encoding, or --errors replace / --errors skip") from None
    except LookupError:
        raise ValueError(f"--encoding {encoding!r} is not an encoding Python knows") from None


def iter_documents(files: list[Path], json_key: str, split_lines: bool,
                   encoding: str = "utf-8", errors: str = "strict") -> Iterator[str | None]:
    """Yield the text of every document, file by file (None: one skipped as undecodable)."""
    for path in files:
        if path.suffix not in JSON_SUFFIXES and not split_lines:
            with user_path("--input", path):
                raw = path.read_bytes()
            yield _decode(raw, path, None, encoding, errors)
            continue
        with user_path("--input", path), open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                line = _decode(raw, path, lineno, encoding, errors)
                if line is None or path.suffix not in JSON_SUFFIXES:
                    yield None if line is None else line.rstrip("\n")
                    continue
                if not line.strip():
                    continue
                yield _json_text(line, json_key, path, lineno)


def check_output_prefix(prefix: str, inputs: list[Path], overwrite: bool) -> None:
    """ValueError unless writing `prefix`'s files loses nothing: never one of the inputs (even
    with --overwrite), and an existing dataset only with --overwrite."""
    outputs = [*data_file_paths(prefix), record_path(prefix)]
    for path in inputs:
        hit = next((out for out in outputs if out.resolve() == path.resolve()), None)
        if hit is not None:
            raise ValueError(f"--input {path} is also an output of --output-prefix {prefix} "
                             f"({hit.name}): choose another --output-prefix")
    existing = [out.name for out in outputs if os.path.lexists(out)]
    if existing and not overwrite:
        raise ValueError(f"--output-prefix {prefix} exists ({', '.join(existing)}): choose "
                         f"another --output-prefix or pass --overwrite to replace it")


def _json_text(line: str, json_key: str, path: Path, lineno: int) -> str:
    try:
        return str(json.loads(line)[json_key])
    except (json.JSONDecodeError, KeyError, TypeError):
        raise ValueError(f"{path}:{lineno} is not a JSON object with key "
                         f"{json_key!r}; fix the line or pass --json-key") from None


@functools.lru_cache(maxsize=4)
def _cached_tokenizer(tokenizer_type: str, tokenizer_model: str | None):
    """One tokenizer per (process, settings), reused across batches."""
    return build_tokenizer(tokenizer_type, tokenizer_model)


def encode_batch(texts: list[str | None], tokenizer_type: str, tokenizer_model: str | None,
                 append_eod: bool) -> list[list[int] | None]:
    """A batch of texts -> their token id lists (None, an undecodable document, stays None);
    a module-level function, so that worker processes can be sent it."""
    tok = _cached_tokenizer(tokenizer_type, tokenizer_model)
    out = []
    for text in texts:
        if text is None:  # undecodable, skipped
            out.append(None)
            continue
        ids = tok.encode(text) if text.strip() else []
        if ids and append_eod:
            ids.append(tok.eod)
        out.append(ids)
    return out


def _batches(docs: Iterator[str | None], size: int) -> Iterator[list[str | None]]:
    """Group documents into lists of ``size``."""
    while batch := list(itertools.islice(docs, size)):
        yield batch


def preprocess(args: argparse.Namespace) -> tuple[int, int, int, int]:
    """Tokenize all inputs into the output files; return (documents, tokens, skipped empty,
    skipped undecodable)."""
    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    files = expand_inputs(args.input)
    check_output_prefix(args.output_prefix, files, args.overwrite)
    removed, in_the_way = clean_temp_files(args.output_prefix)
    for path in removed:
        print(f"removed {path}, left by an interrupted run")
    if in_the_way:
        print(f"warning: {', '.join(in_the_way)} left by another run of this --output-prefix "
              f"(still running, or an older megazoo): remove them if that run is over")
    tokenizer = _cached_tokenizer(args.tokenizer_type, args.tokenizer_model)
    encoder = functools.partial(encode_batch, tokenizer_type=args.tokenizer_type,
                                tokenizer_model=args.tokenizer_model, append_eod=args.append_eod)
    batches = _batches(iter_documents(files, args.json_key, args.split_lines, args.encoding,
                                      args.errors), BATCH_DOCUMENTS)
    with user_path("--output-prefix", args.output_prefix):  # a full disk: one line, no temp
        return _write(args, encoder, tokenizer, batches)


def _write(args, encoder, tokenizer, batches) -> tuple[int, int, int, int]:
    """Tokenize `batches` into the output files (temp files renamed at the end)."""
    docs = tokens = skipped = undecodable = 0
    with IndexedDatasetBuilder(args.output_prefix, best_dtype(tokenizer.vocab_size),
                               tokenizer.record()) as builder:
        pool = multiprocessing.get_context("spawn").Pool(args.workers) if args.workers > 1 else None
        results = map(encoder, batches) if pool is None else pool.imap(encoder, batches)
        try:
            for encoded in results:
                for ids in encoded:
                    if ids is None:
                        undecodable += 1
                    elif not ids:
                        skipped += 1
                    else:
                        builder.add_document(ids)
                        docs += 1
                        tokens += len(ids)
        finally:
            if pool is not None:
                pool.close()
                pool.join()
    return docs, tokens, skipped, undecodable


def main(argv: list[str] | None = None) -> int:
    """Entry point: prints the counts, or one error line and exit status 2."""
    args = parse_args(argv)
    try:
        docs, tokens, skipped, undecodable = preprocess(args)
    except (FileNotFoundError, ValueError) as exc:
        return report_error(str(exc))
    not_text = f", skipped undecodable documents {undecodable}" if args.errors == "skip" else ""
    print(f"wrote {args.output_prefix}.bin/.idx: documents {docs}, tokens {tokens}, "
          f"skipped empty documents {skipped}{not_text}")
    return 0
