"""Remote sources for real: s3:// JSONL and Parquet on an S3-protocol server the test starts on
loopback (moto), read through pyarrow's S3 filesystem by the Ray preprocessing, shuffled and
mixed. The epoch is the order's placements, each sample what the same rows give read locally,
and the requests are counted: one ranged read per unit a block touches, never one per row."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.waiting import wait_for

from pipeline.config import TrainingJobConfig
from pipeline.order.cursor import OrderCursor
from pipeline.order.job_order import JobOrder
from pipeline.preprocess.block_reader import _reads
from pipeline.preprocess.pipeline import iter_samples
from pipeline.preprocess.process import split_sample_id
from pipeline.preprocess.sample import ProcessedSample
from pipeline.preprocess.task_size import rows_per_task

ROWS = 300
BUCKET = "odb-data"


def _chat(tag: str, i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"{tag} question {i}"},
                         {"role": "assistant", "content": f"{tag} answer {i} " + "x " * (i % 9)}]}


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """An S3-protocol server (moto) in a process of its own on a free loopback port (in this
    process it would share the interpreter with the Ray driver's threads), a bucket with two
    JSONL files and a Parquet file of row groups of 50 rows."""
    boto3 = pytest.importorskip("boto3")
    requests = pytest.importorskip("requests")
    from pipeline.redis_server import free_port

    port = free_port()
    # (its request log in the test's tmp dir: moto writes it into the working directory)
    log = tmp_path_factory.mktemp("moto") / "recording"
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                               "-p", str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL,
                              env={**os.environ, "MOTO_RECORDER_FILEPATH": str(log)})
    endpoint = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _answers(requests, endpoint), 30, "the S3 server to answer")
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        client.create_bucket(Bucket=BUCKET)
        for tag in ("a", "b"):
            body = b"\n".join(json.dumps(_chat(tag, i)).encode() for i in range(ROWS)) + b"\n"
            client.put_object(Bucket=BUCKET, Key=f"{tag}.jsonl", Body=body)
        table = pa.Table.from_pylist([_chat("c", i) for i in range(ROWS)])
        buf = io.BytesIO()
        pq.write_table(table, buf, row_group_size=50)
        client.put_object(Bucket=BUCKET, Key="c.parquet", Body=buf.getvalue())

        def uri(key: str) -> str:
            return (f"s3://{BUCKET}/{key}?endpoint_override=127.0.0.1:{port}&scheme=http"
                    "&region=us-east-1")

        def recorded(action: str):
            return requests.request("GET" if action == "download" else "POST",
                                    f"{endpoint}/moto-api/recorder/{action}-recording",
                                    timeout=10)

        yield uri, recorded, client
    finally:
        server.kill()
        server.wait()


def _answers(requests, endpoint: str) -> bool:
    try:
        return requests.get(f"{endpoint}/moto-api/", timeout=1).ok
    except requests.RequestException:
        return False


def _job(uris, **source) -> TrainingJobConfig:
    a, b, c = uris
    return TrainingJobConfig.model_validate({
        "job_id": "remote", "world_size": 2, "seed": 9,
        "source": {"mixture": [{"name": "a", "paths": [a]},
                               {"name": "b", "paths": [b], "repeat": 2},
                               {"name": "c", "paths": [c]}],
                   "shuffle_block_rows": 400, **source}})


def _ranged_gets(recording: str) -> list[dict]:
    out = []
    for line in recording.splitlines():
        if not line.strip():
            continue
        req = json.loads(line)
        headers = {k.lower(): v for k, v in (req.get("headers") or {}).items()}
        if req.get("method") == "GET" and "range" in headers:
            out.append(req)
    return out


def test_a_shuffled_mixed_epoch_reads_s3_by_units(ray_session, s3, tmp_path: Path):
    uri, recorded, client = s3
    job = _job([uri("a.jsonl"), uri("b.jsonl"), uri("c.parquet")])
    order = JobOrder(job.source, job.seed)  # indexes the files (driver side, read once)
    epoch = order.epoch(0, OrderCursor())
    want = [(order.layouts[p.source].files[p.file].source, p.row, p.copy)
            for p in epoch.placements()]
    assert len(want) == 4 * ROWS

    for lay in order.layouts:  # each source's task size, from its first rows (read once)
        rows_per_task(job, lay.files[0])
    recorded("reset")
    recorded("start")
    items = list(iter_samples(job, 0, order=order))
    recorded("stop")
    gets = _ranged_gets(recorded("download").text)

    got = [split_sample_id(i.sample_id) for i in items]
    assert got == want and all(isinstance(i, ProcessedSample) for i in items)
    firsts = [i for i, (_, _, c) in enumerate(want) if c == 0]
    assert sorted(want[i][:2] for i in firsts[:50]) != [w[:2] for w in want[:50]]  # shuffled

    # Every sample is what the same row gives read from a local file.
    local = {}
    for tag in ("a", "b", "c"):
        body = client.get_object(Bucket=BUCKET, Key=f"{tag}.{'parquet' if tag == 'c' else 'jsonl'}")
        path = tmp_path / f"{tag}.{'parquet' if tag == 'c' else 'jsonl'}"
        path.write_bytes(body["Body"].read())
        local[tag] = str(path)
    plain = _job([local["a"], local["b"], local["c"]], shuffle=False)
    by_row = {}
    for it in iter_samples(plain, 0):
        src, row, copy = split_sample_id(it.sample_id)
        by_row[(Path(src).name, row, copy)] = it
    for it in items:
        src, row, copy = split_sample_id(it.sample_id)
        twin = by_row[(src.split("?")[0].rsplit("/", 1)[1], row, copy)]
        assert it.input_ids.tobytes() == twin.input_ids.tobytes()
        assert it.labels.tobytes() == twin.labels.tobytes()

    # The requests: one ranged read per unit-run a block touches (JSONL), a few per row group
    # (Parquet: the footer and its column chunks); never one per row.
    expected = Counter()
    files = [lay.files for lay in order.layouts]
    for block in epoch.blocks():
        for r in _reads(block, files):
            expected[files[r[0]][r[1]].kind] += 1
    by_kind = Counter("parquet" if "c.parquet" in g["url"] else "jsonl" for g in gets)
    assert by_kind["jsonl"] == expected["jsonl"], (by_kind, expected)
    assert by_kind["parquet"] <= 4 * expected["parquet"], (by_kind, expected)
    assert len(gets) * 10 <= len(items), (len(gets), len(items))
