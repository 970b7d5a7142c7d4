"""`pip install ./trainer_client` is the light odb-trainer-client: grpcio, protobuf and numpy,
never torch, Ray, transformers or redis; it decodes batches to numpy where torch is absent.

The wheel is built from a copy of the folder and installed into a fresh venv (its three
dependencies come from the package index); a rank in that venv then reads a real served job.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import venv
import zipfile
from pathlib import Path

import numpy as np
import pytest
from service_helpers import job_dict, service_config, serving

from pipeline.preprocess.array_source import synthetic_samples
from pipeline.preprocess.sample import ProcessedSample
from pipeline.preprocess.vision import PIXEL_NORM
from trainer_client.pixels import normalize_numpy

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / "trainer_client"
FORBIDDEN = ("torch", "ray", "transformers", "redis", "matplotlib", "pyarrow", "pipeline")

READER = """
import importlib.util, json, sys
missing = [m for m in {forbidden!r} if importlib.util.find_spec(m) is None]
from trainer_client import BatchStream
import trainer_client
out = {{"absent": missing, "batches": [], "from": trainer_client.__file__}}
with BatchStream(sys.argv[1], "j", 0, 1) as stream:
    for b in stream:
        inputs = b.to_model_inputs()
        out["batches"].append({{
            "ids": list(b.info.sample_ids),
            "wire": {{k: [type(v).__module__, str(v.dtype)] for k, v in b.items()}},
            "inputs": {{k: str(v.dtype) for k, v in inputs.items() if hasattr(v, "dtype")}},
            "pixel_sum": float(inputs["pixel_values"].sum()) if "pixel_values" in inputs else None,
        }})
print(json.dumps(out))
"""


def _gencode_versions() -> tuple[str, str]:
    pb2 = (CLIENT / "wire/odb/v1/data_service_pb2.py").read_text()
    m = re.search(r"Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),", pb2)
    grpc_pb = (CLIENT / "wire/odb/v1/data_service_pb2_grpc.py").read_text()
    g = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", grpc_pb)
    assert m and g
    return ".".join(m.groups()), g.group(1)


def _floor(deps: list[str], name: str) -> str:
    (dep,) = [d for d in deps if re.match(rf"{name}\s*[><=]", d)]
    return re.search(r">=\s*([\d.]+)", dep).group(1)


def test_dependency_floors_are_what_the_generated_stubs_check():
    protobuf, grpc = _gencode_versions()
    for pyproject in (ROOT / "pyproject.toml", CLIENT / "pyproject.toml"):
        deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
        assert _floor(deps, "protobuf") == protobuf, pyproject
        assert _floor(deps, "grpcio") == grpc, pyproject


def _vision_sample() -> ProcessedSample:
    rng = np.random.default_rng(3)
    ids = rng.integers(1, 1000, size=40, dtype=np.int32)
    pixels = rng.integers(0, 256, size=(4, 1176), dtype=np.uint8)
    return ProcessedSample("img:0", "img", 0, ids, ids.copy(), pixel_values=pixels,
                           image_grid_thw=np.array([[1, 2, 2]], np.int64))


def test_light_wheel_installs_without_torch_and_decodes_to_numpy(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(CLIENT, src, ignore=shutil.ignore_patterns("__pycache__", "build",
                                                               "*.egg-info"))
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(wheels), str(src)], check=True)
    (wheel,) = wheels.glob("odb_trainer_client-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    requires = sorted(line.split(":", 1)[1].strip() for line in meta.splitlines()
                      if line.startswith("Requires-Dist:"))
    assert requires == ["grpcio>=1.85.1", "numpy>=1.26", "protobuf>=7.35.1"]
    assert "trainer_client/wire/odb/v1/data_service_pb2_grpc.py" in names
    assert not any(n.startswith(("pipeline/", "tests/")) for n in names)

    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # not this checkout
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    str(wheel)], check=True, timeout=600, env=clean)
    listed = subprocess.run([str(py), "-m", "pip", "list", "--format=json"], check=True,
                            capture_output=True, text=True, env=clean).stdout
    installed = {p["name"].lower() for p in json.loads(listed)}
    assert not installed & {"torch", "ray", "transformers", "redis", "matplotlib"}, installed

    text = synthetic_samples(12, max_len=200, seed=5)
    vision = _vision_sample()
    cfg = service_config(job_dict(world_size=1, batching={"token_budget": 1024}))
    with serving(cfg, {"j": [*text, vision]}) as svc:
        out = subprocess.run([str(py), "-c", READER.format(forbidden=FORBIDDEN), svc.address],
                             check=True, capture_output=True, text=True, timeout=120,
                             cwd=tmp_path, env=clean)
    got = json.loads(out.stdout)
    assert got["absent"] == list(FORBIDDEN)
    assert Path(got["from"]).is_relative_to(env_dir)  # the installed wheel, not this checkout
    ids = sorted(i for b in got["batches"] for i in b["ids"])
    assert ids == sorted([s.sample_id for s in text] + [vision.sample_id])
    for b in got["batches"]:
        assert {mod for mod, _ in b["wire"].values()} == {"numpy"}
        assert b["wire"]["input_ids"][1] == "int32" and b["inputs"]["input_ids"] == "int64"
        if b["pixel_sum"] is not None:
            assert b["wire"]["pixel_values"][1] == "uint8"
            assert b["inputs"]["pixel_values"] == "float32"
            expected = normalize_numpy(vision.pixel_values, PIXEL_NORM).sum()
            assert b["pixel_sum"] == pytest.approx(float(expected), rel=1e-5)
    assert any(b["pixel_sum"] is not None for b in got["batches"])
