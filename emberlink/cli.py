"""The `emberlink` command: one small function per subcommand, registered on one subparsers object."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from emberlink.errors import ConfigError, EmberlinkError
from emberlink.protocol.identity import Identity, default_key_path

Handler = Callable[[argparse.Namespace], int]


def add_keygen(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("keygen", help="write a new identity key (mode 0600) and print its NodeId")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="key file (default: $EMBERLINK_KEY, else ~/.config/emberlink/client.key)",
    )
    p.add_argument("--force", action="store_true", help="overwrite an existing key file")
    p.set_defaults(run=keygen)


def keygen(args: argparse.Namespace) -> int:
    path: Path = args.out if args.out is not None else default_key_path()
    if path.exists() and not args.force:
        raise ConfigError(f"{path} already exists; pass --force to replace it (its NodeId changes)")
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create directory {path.parent}: {e.strerror}") from e
    identity = Identity.generate(os.urandom)
    identity.save(path, overwrite=args.force)
    print(identity.node_id)
    print(f"wrote {path}", file=sys.stderr)
    return 0


# Each subcommand module adds itself here: a function that registers a parser whose defaults
# set `run` to the handler.
COMMANDS: list[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None]] = [add_keygen]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="emberlink", description="Use a GPU on another machine as if it were local."
    )
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for add in COMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    run: Handler | None = getattr(args, "run", None)
    if run is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return run(args)
    except EmberlinkError as e:
        print(f"emberlink: error: {e}", file=sys.stderr)
        return 1
