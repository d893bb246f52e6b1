"""An argparse parser whose errors are one line with a "did you mean" instead of the usage.

    parser = HintingParser(prog="pretrain_gpt.py")
    parser.parse_args(["--num-layer", "4"])
    # pretrain_gpt.py: error: unrecognized argument --num-layer: did you mean --num-layers?
    #     (pretrain_gpt.py --help lists every flag)            -> exit status 2

A long usage block printed before the error buries the one line that matters; the nearest
flags (or choices, for a value like `--model gpt-125`) by difflib's similarity ratio are what
the user most likely meant. Abbreviations are off (as in Megatron): `--train-iter 10` is an
unknown flag with a "did you mean --train-iters?", never silently taken for it. Under
torchrun the line is printed once (rank 0; `megazoo.errors.report_error`).
"""
from __future__ import annotations

import argparse
import difflib
import re
import sys

from .errors import report_error


def closest(word: str, candidates, n: int = 1) -> list[str]:
    """The `n` candidates most like `word`, ignoring case (similarity >= 0.6), best first."""
    by_lower = {c.lower(): c for c in candidates}
    return [by_lower[m] for m in difflib.get_close_matches(word.lower(), by_lower, n=n, cutoff=0.6)]


class HintingParser(argparse.ArgumentParser):
    """ArgumentParser printing `prog: error: ...` on one line, with a suggestion where one
    is near, and exiting with status 2 (argparse's convention); no abbreviated flags."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        sys.exit(report_error(f"{self._with_hint(message)} ({self.prog} --help lists every "
                              f"flag)", prefix=f"{self.prog}: error: "))

    def _flags(self) -> list[str]:
        return [s for action in self._actions for s in action.option_strings if s.startswith("--")]

    def _with_hint(self, message: str) -> str:
        unknown = re.match(r"unrecognized arguments: (.*)", message)
        if unknown:
            parts = []
            for word in unknown.group(1).split():
                if not word.startswith("-"):
                    continue
                flag = word.split("=", 1)[0]
                near = closest(flag, self._flags())
                parts.append(f"{flag}: did you mean {near[0]}?" if near else flag)
            if parts:
                s = "s" if len(parts) > 1 else ""
                return f"unrecognized argument{s} " + "; ".join(parts)
        choice = re.match(r"argument (\S+?)(?:/\S+)?: invalid choice: '([^']*)' \(choose from (.*)\)",
                          message)
        if choice:
            flag, value, options = choice.groups()
            names = re.findall(r"'([^']*)'", options) or [o.strip() for o in options.split(",")]
            near = closest(value, names)
            hint = f"did you mean {flag} {near[0]}?" if near else f"choose from {', '.join(names)}"
            return f"{flag} {value!r} is not one of its choices: {hint}"
        return message

