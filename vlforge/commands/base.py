"""What every command module shares: the Command record cli.py builds its parser from, argparse
types, and which process of a torchrun launch is speaking."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Command:
    """One `vlforge NAME` subcommand: its help line, the arguments it adds, the function it runs
    (returning the process's exit code)."""

    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    # it may torch.compile: torch's compile caches go under VLFORGE_CACHE first (train/runtime.use_compile_caches),
    # and its log (stdout) says where, unless stdout is the answer itself (`answers`: infer, chat)
    compiles: bool = False
    answers: bool = False


def at_least(minimum: int):
    """An argparse type: a whole number >= minimum (a bad value is argparse's usage error, exit 2)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value}: must be >= {minimum}")
        return value

    return parse


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text}: must be a finite number >= 0")
    return value


def overrides_argument(p: argparse.ArgumentParser, example: str) -> None:
    p.add_argument("overrides", nargs="*", help=f"key.sub=value overrides, e.g. {example}")


def rank_prefix() -> str:
    """Under torchrun, which process an error comes from (torchrun then stops the others)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    return f"[rank {os.environ.get('RANK', '0')} of {size}] " if size > 1 else ""


def main_process() -> bool:
    return os.environ.get("RANK", "0") == "0"
