"""Generate the Python gRPC stubs for every .proto under proto/ into trainer_client/wire/.

    python proto/generate.py           # (re)generate in place
    python proto/generate.py --check   # exit 1 if the committed stubs differ from the .proto

The proto tree is mapped to the import path `trainer_client/wire/...` so the generated modules
import each other as `trainer_client.wire.odb.v1...` (no sys.path tricks). The stubs live with
the client so `pip install ./trainer_client` carries the wire contract; the server imports them
from there too.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_PACKAGE = "trainer_client/wire"


def generate(out_root: Path) -> list[Path]:
    """Write stubs under out_root/trainer_client/wire; return the generated files (relative)."""
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(p.relative_to(PROTO_DIR) for p in PROTO_DIR.rglob("*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{OUT_PACKAGE}={PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(f"{OUT_PACKAGE}/{p}" for p in protos),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    # Every directory on the way needs an __init__.py to be importable.
    for d in [out_root / OUT_PACKAGE, *(out_root / OUT_PACKAGE).rglob("*")]:
        if d.is_dir() and d.name != "__pycache__":
            (d / "__init__.py").touch()
    return sorted(
        p.relative_to(out_root) for p in (out_root / OUT_PACKAGE).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )


def check() -> list[str]:
    """Differences between the committed stubs and freshly generated ones."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        committed = sorted(
            p.relative_to(ROOT) for p in (ROOT / OUT_PACKAGE).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts
        )
        problems = [f"missing: {p}" for p in fresh if p not in committed]
        problems += [f"stale (no .proto): {p}" for p in committed if p not in fresh]
        problems += [
            f"out of date: {p}" for p in fresh
            if p in committed and not filecmp.cmp(Path(tmp) / p, ROOT / p, shallow=False)
        ]
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    if args.check:
        problems = check()
        for p in problems:
            print(p, file=sys.stderr)
        if problems:
            print("stubs are out of date: run `python proto/generate.py`", file=sys.stderr)
        return 1 if problems else 0
    for p in generate(ROOT):
        print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
