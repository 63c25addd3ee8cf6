"""The `vlforge` command: the parser built from the commands' table (vlforge/commands/), one
command run, and its errors as one line and an exit code, never a traceback."""

from __future__ import annotations

import argparse
import signal
import sys

from vlforge.commands import data, inference, inspection, train
from vlforge.commands.base import Command, main_process, rank_prefix
from vlforge.config import ConfigError
from vlforge.data.inline import DataError
from vlforge.rl.rewards import RewardError
from vlforge.train.errors import CheckpointWriteError
from vlforge.train.health import TrainingDiverged
from vlforge.train.stop import signal_name, sigterm_interrupts

COMMANDS: list[Command] = [*train.COMMANDS, *inference.COMMANDS, *inspection.COMMANDS]
GROUPS = {"data": ("dataset tools", data.COMMANDS)}  # `vlforge data synth|check|convert`


def _add(sub, command: Command) -> None:
    p = sub.add_parser(command.name, help=command.help)
    command.arguments(p)
    p.set_defaults(func=command.run, compiles=command.compiles, answers=command.answers)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vlforge", description="Fine-tune, RL-train and serve Qwen3-VL models.")
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        _add(sub, command)
    for name, (help_text, commands) in GROUPS.items():
        group = sub.add_parser(name, help=help_text).add_subparsers(dest=f"{name}_command", required=True)
        for command in commands:
            _add(group, command)
    return p


def _quiet_libraries() -> None:
    import logging

    # torch warns at import of optional libraries built for another torch (torchao's enum
    # registrations): noise for a CLI user, nothing to act on
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    from vlforge.model.quiet import offline_and_quiet

    offline_and_quiet()  # before any command imports bitsandbytes (doctor does, to report it)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _interrupted(command: str, e: KeyboardInterrupt) -> int:
    """Ctrl-C (KeyboardInterrupt) or SIGTERM (train/stop.Interrupted): one line, no traceback, and the
    shell's code for the signal, 128 + its number (130, 143). A training run's stop says what it
    saved (its rank 0 said it already when every rank stopped after one step)."""
    signum = getattr(e, "signum", signal.SIGINT)
    message = getattr(e, "message", None)
    if message is None:
        print(f"{rank_prefix()}vlforge {command}: interrupted ({signal_name(signum)})", file=sys.stderr)
    elif not getattr(e, "said", False):
        print(f"{rank_prefix()}{message}", file=sys.stderr)
    return 128 + signum


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # key=value overrides may come before or after options (argparse leaves the late ones over)
    args, extra = parser.parse_known_args(argv)
    unknown = [e for e in extra if e.startswith("-") or "=" not in e or not hasattr(args, "overrides")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    _quiet_libraries()  # before train/ is imported: its imports (torchao's) would speak otherwise
    from vlforge.train.runtime import cache_note, use_compile_caches

    dirs = use_compile_caches() if getattr(args, "compiles", False) else None  # before anything compiles
    done_early = any(getattr(args, flag, False) for flag in ("plan", "print_config"))  # no run, nothing compiles
    if dirs and main_process() and not (args.answers or done_early):
        print(cache_note(dirs), flush=True)  # the run's log; stderr is for what asks the user to act
    try:
        with sigterm_interrupts():  # SIGTERM raises, as SIGINT does: both end below, in one line
            return args.func(args)
    except KeyboardInterrupt as e:
        return _interrupted(args.command, e)
    except (ConfigError, DataError, RewardError, FileNotFoundError) as e:
        print(f"{rank_prefix()}error: {e}", file=sys.stderr)
        return 2
    except TrainingDiverged as e:  # the health monitor gave up; finished checkpoints are on disk
        print(f"{rank_prefix()}error: training diverged: {e}", file=sys.stderr)
        return 3
    except CheckpointWriteError as e:  # disk full, quota, permissions: finished checkpoints are on disk
        print(f"{rank_prefix()}error: {e}", file=sys.stderr)
        return 4


if __name__ == "__main__":
    sys.exit(main())
