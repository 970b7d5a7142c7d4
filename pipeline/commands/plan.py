"""`odb-pipeline plan` (not built yet)."""

from __future__ import annotations

import argparse

from pipeline.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    raise UserError("'plan' is not implemented yet")
