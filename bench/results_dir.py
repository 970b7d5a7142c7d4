"""Where a benchmark writes its results: `--out DIR`, else the cache dir, never into the
checkout unless asked. The figures committed under `bench/results/` (docs/benchmarks.md) are
written with `--out bench/results/<name>`."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.config import default_cache_dir


def add_out_argument(ap: argparse.ArgumentParser, name: str) -> None:
    ap.add_argument("--out", type=Path, default=None, metavar="DIR",
                    help=f"write the results here (the committed ones: --out bench/results/"
                         f"{name}); default {Path(default_cache_dir(), 'bench', name)}")


def out_dir(args: argparse.Namespace, name: str) -> Path:
    """The folder to write into (made if missing)."""
    path = Path(args.out) if args.out is not None else Path(default_cache_dir(), "bench", name)
    path.mkdir(parents=True, exist_ok=True)
    return path
