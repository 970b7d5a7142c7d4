"""Generated gRPC stubs under trainer_client/wire/ match proto/ (regenerate: proto/generate.py)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_stubs_are_up_to_date():
    result = subprocess.run(
        [sys.executable, str(ROOT / "proto" / "generate.py"), "--check"],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr


def test_stale_stub_is_detected(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "proto"))
    try:
        import generate
    finally:
        sys.path.pop(0)
    stub = ROOT / "trainer_client/wire/odb/v1/data_service_pb2.py"
    original = stub.read_bytes()
    try:
        stub.write_bytes(original + b"\n# edited by hand\n")
        assert any("out of date" in p for p in generate.check())
    finally:
        stub.write_bytes(original)
