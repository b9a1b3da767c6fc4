"""The command line of the tools, experiments and benchmarks: argparse with one-line errors (exit status 2)."""

import argparse
import difflib
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py
from common import die  # noqa: E402


def number(kind):
    """An argparse type for int or float that refuses NaN (every range check would let it through)."""

    def parse(s: str):
        value = kind(s)
        if isinstance(value, float) and math.isnan(value):
            raise ValueError(s)
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its message: "invalid float value: 'x'"
    return parse


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line, exit status 2; a flag spelled out (no --step for --steps), an unknown
    one answered with the nearest real flag."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def parse_args(self, args=None, namespace=None):
        namespace, unknown = self.parse_known_args(args, namespace)
        if unknown:
            first = next((u for u in unknown if u.startswith("-")), unknown[0])
            if not first.startswith("-"):
                self.error(f"unrecognized arguments: {' '.join(unknown)}")
            flags = [s for a in self._actions for s in a.option_strings]
            near = difflib.get_close_matches(first.split("=")[0], flags, n=1)
            self.error(f"unrecognized argument {first}" + (f" (did you mean {near[0]}?)" if near else ""))
        return namespace

    def error(self, message):
        die(message)
