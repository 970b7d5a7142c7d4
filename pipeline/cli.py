"""The `odb-pipeline` command: one subcommand per module under `pipeline.commands`.

Each command module exposes `HELP`, `add_arguments(parser)` and `run(args) -> int`; modules are
imported only when their command runs so `--help` does not pay for Ray or torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from pipeline import __version__

# name -> one-line help. Order is the order `--help` lists them in.
COMMANDS: dict[str, str] = {
    "serve": "run the service: Ray preprocessing, planner and gRPC server for the configured jobs",
    "plan": "dry-run batching on a dataset or a lengths file (steps, padding efficiency, balance)",
    "inspect": "show samples after preprocessing (tokens, visual tokens, cost, quarantine)",
    "status": "operator queries: jobs, ranks, throughput, quarantine (from Redis and the service)",
    "scale": "move the rest of a job onto a new world size (reconfiguration)",
    "mix": "change a mixture job's source weights from the next step (every rank at once)",
    "job": "delete a job's state, or reset it to start over (where serve keeps it)",
    "demo": "everything local: embedded Redis, local Ray, the service and N trainer ranks",
}


def build_parser(load_commands: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="odb-pipeline",
        description="Online Dynamic Batching as a service: token-budgeted, rank-aligned batches "
        "streamed over gRPC to trainer ranks.",
    )
    parser.add_argument("--version", action="version", version=f"odb-pipeline {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if load_commands:
            _module(name).add_arguments(p)
    return parser


def _module(name: str):
    return importlib.import_module(f"pipeline.commands.{name}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Every child these commands fork (Redis, Ray's node processes) execs at once: gRPC's fork
    # handlers only pause its threads (a live server's included) around each fork for nothing.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    # Only the chosen command's module is imported (its arguments are needed to parse).
    chosen = next((a for a in argv if a in COMMANDS), None)
    parser = build_parser(load_commands=False)
    if chosen is not None:
        # Re-register the chosen command with its real arguments.
        parser = argparse.ArgumentParser(prog="odb-pipeline")
        sub = parser.add_subparsers(dest="command", metavar="COMMAND")
        p = sub.add_parser(chosen, help=COMMANDS[chosen], description=COMMANDS[chosen])
        _module(chosen).add_arguments(p)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    from pipeline.errors import UserError

    try:
        return int(_module(args.command).run(args) or 0)
    except UserError as exc:
        print(f"odb-pipeline {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"odb-pipeline {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
