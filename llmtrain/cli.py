"""Command-line plumbing shared by the recipes: arguments and one-line errors."""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path

from . import demo
from .config import load_config
from .data import as_list
from .errors import UserError
from .launch import process_group_backend


def parse_args(argv: list[str] | None, default_config: Path | None, description: str = ""):
    """Returns (config, parsed arguments)."""
    parser = argparse.ArgumentParser(
        description=description, epilog="Overrides: dotted key=value pairs, e.g. train.lr=2e-5 data.packing=true"
    )
    parser.add_argument("--config", type=Path, default=default_config, help=f"YAML config (default: {default_config})")
    parser.add_argument(
        "--prepare-only",
        action="store_true",
        help="tokenize the data into the cache and exit (run once before a multi-node job)",
    )
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    own = [cfg.model.name_or_path, *as_list(cfg.data.train)]
    if args.config == default_config and any(name not in demo.DEMO_NAMES for name in own):
        from accelerate import PartialState

        PartialState().print(
            f"note: no --config given, so the demo's settings from {default_config} apply "
            f"(train.lr={cfg.train.lr}, train.epochs={cfg.train.epochs}, ...), which suit its tiny "
            "model; pass --config with your own YAML (see recipes/configs/) for a real run"
        )
    return cfg, args


def warn(message: str) -> None:
    """'warning: <message>' on stderr, from the main process only."""
    from accelerate import PartialState

    if PartialState().is_main_process:
        print(f"warning: {message}", file=sys.stderr, flush=True)


@contextmanager
def user_errors(report: bool = True):
    """Turn a user error (errors.UserError) into one 'error: ...' line per problem on stderr,
    printed only where `report` (the main process), and exit 2. Anything else is a bug
    and keeps its traceback. The recipes and `llmtrain plan` both report through here."""
    try:
        yield
    except UserError as e:
        if report:
            for line in str(e).splitlines():
                print(f"error: {line}", file=sys.stderr, flush=True)
        sys.exit(2)


def run_cli(main, argv: list[str] | None = None) -> None:
    """Run main(argv), reporting user errors once (see `user_errors`)."""
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    # Set up the process group first, so only one process reports. It must honour
    # ACCELERATE_USE_CPU exactly as Accelerator() will, or CPU runs launched with
    # --num_processes 2 would silently become two unrelated single-process runs.
    backend = process_group_backend()
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"), **({"backend": backend} if backend else {}))
    with user_errors(state.is_main_process):
        main(argv)
