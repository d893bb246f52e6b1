"""Tokenize text or JSON-lines files into a Megatron-style ``PREFIX.bin`` + ``PREFIX.idx``.

    python tools/preprocess_data.py --input 'corpus/*.jsonl' --output-prefix data/web \\
        --tokenizer-type HFTokenizer --tokenizer-model gpt2/tokenizer.json --append-eod

A shim: the command is `megazoo.cli.preprocess_data` (also installed as
`megazoo-preprocess-data`); the logic and every flag are in `megazoo/data/preprocess.py`.
"""
import sys

from megazoo.cli import preprocess_data

if __name__ == "__main__":
    sys.exit(preprocess_data())
