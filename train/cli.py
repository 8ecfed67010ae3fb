"""What the command lines of train, tune and serve share: ``--config``, ``--set``, ``--print-config``,
a ``--help`` generated from the config's schema, one line on stderr with exit code 2 for bad input, and
Ctrl-C or SIGTERM as ``interrupted`` with exit code 130."""

import argparse
import functools
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import yaml
from pydantic import BaseModel

from train.config import TrainConfig
from train.schema import ConfigError, Section, fields_help, load_yaml, parse
from train.stops import RunStopped
from train.storage import DiskFullError


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line, like raywright's config errors."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message} (--help lists the options)\n")


def config_parser(prog: str, description: str, schema: type[BaseModel], config_help: str) -> OneLineParser:
    """A parser with --config, --set and --print-config whose --help lists every field of ``schema``."""
    parser = OneLineParser(
        prog=prog,
        description=description,
        epilog="settings, for --set KEY=VALUE or the --config file:\n" + fields_help(schema),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help=config_help)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one setting (repeatable); the value is YAML",
    )
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    return parser


def setting_type(section: type[Section], name: str) -> Callable[[str], Any]:
    """An argparse ``type`` that reads a flag as ``--set`` reads the field ``name`` of ``section`` (YAML, then
    the field's rules), so that a flag and the setting it stands for refuse the same values."""

    def convert(text: str) -> Any:
        try:
            return getattr(parse(section, {name: load_yaml(text, name)}), name)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{name}: ")) from None

    return convert


def print_config(config: BaseModel) -> None:
    print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")


class CommandFailed(RuntimeError):
    """An end of a command's work that it reports in one line (``error: ...``, exit code 1), not a traceback."""


def one_line_errors(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
    """Wrap a CLI's ``main``: a ConfigError becomes ``config error: ...`` on stderr and exit code 2; a run that
    stopped (diverged, out of disk space) or a full disk, ``error: ...`` and exit code 1; Ctrl-C (or SIGTERM,
    see ``take_sigterm_as_ctrl_c``), ``interrupted`` with what the interrupted work says of itself, and 130."""

    @functools.wraps(main)
    def wrapper(argv: list[str] | None = None) -> int:
        try:
            return main(argv)
        except ConfigError as exc:
            print(f"config error: {exc}", file=sys.stderr)
            return 2
        except (CommandFailed, RunStopped, DiskFullError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt as exc:
            print(f"interrupted: {exc}" if str(exc) else "interrupted", file=sys.stderr)
            return 130

    return wrapper


def take_sigterm_as_ctrl_c() -> None:
    """Take SIGTERM (``kill``, ``docker stop``, systemd, and ``ray job stop`` first) as Ctrl-C: Python's
    KeyboardInterrupt, or the graceful stop of Ray Train or Tune where they handle SIGINT. Call it after
    ``ray.init``, whose own handler aborts the process with a stack dump. Where SIGINT is ignored, as in a
    background job of a non-interactive shell, a KeyboardInterrupt still: a SIGTERM relayed as SIGINT went unheard."""

    def as_ctrl_c(signum: int, frame) -> None:
        on_ctrl_c = signal.getsignal(signal.SIGINT)
        if not callable(on_ctrl_c):  # ignored, or left to the OS: no Python handler to call
            raise KeyboardInterrupt
        on_ctrl_c(signal.SIGINT, frame)

    signal.signal(signal.SIGTERM, as_ctrl_c)


def use_cpu_deepspeed_unless_gpu_workers(cfg: TrainConfig) -> None:
    """DeepSpeed's accelerator is the CPU where the run's workers have no GPU. Set before DeepSpeed loads, which
    otherwise looks for a GPU and warns that it found none; a local Ray's processes (a sweep's trials) inherit it."""
    if not cfg.scaling.use_gpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
