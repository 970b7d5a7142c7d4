"""The Refill RPC over loopback gRPC with the real server, real Redis and the real tokenizer:
budgets under random capacities, a consumer SIGKILLed and restarted, a server restarted, bad
calls with precise status codes, status counters."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from refill_helpers import chats_slice, refill_config, refill_job

from pipeline.coordinator.refill_state import RefillState
from pipeline.preprocess.array_source import ArraySource, synthetic_samples
from pipeline.service.server import start_service
from trainer_client import BatchStream, RefillStream
from trainer_client.batch_stream import StreamError
from trainer_client.wire.odb.v1 import data_service_pb2 as pb
from trainer_client.wire.odb.v1 import data_service_pb2_grpc as pb_grpc

HERE = Path(__file__).resolve().parent
ROWS = 60  # the first 60 shipped chats: text and image records, one bad row


def good_ids(state: RefillState) -> set[str]:
    return {k.decode() for k in state.client.hkeys(state.keys.refill_info)}


def wait_exhausted(state: RefillState, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not state.counts().exhausted:
        assert time.monotonic() < deadline, "the producer did not read the whole source"
        time.sleep(0.1)


@pytest.fixture
def served(tmp_path, redis_url, redis_client):
    """A refill job `gen` of the first chats, two epochs, and a training job `train`, on one
    server."""
    train = {"job_id": "train", "world_size": 1, "source": {"paths": ["arrays"]},
             "batching": {"token_budget": 2048, "max_window_samples": 64}}
    cfg = refill_config({**refill_job(chats_slice(tmp_path, ROWS), max_request_tokens=3000,
                                      over_budget="quarantine", queue_depth=128), "epochs": 2},
                        train, redis_url=redis_url)
    svc = start_service(cfg, sample_sources={
        "train": ArraySource(synthetic_samples(20, lengths=[100] * 20))})
    yield svc, RefillState.connect(redis_url, "gen")
    svc.stop(grace=0.5)


def test_random_capacities_never_receive_more_than_offered(served):
    svc, state = served
    seen: list[str] = []
    lock = threading.Lock()
    problems: list[str] = []

    def consumer(i: int) -> None:
        # One draw sequence per consumer (a shared one would follow the threads' interleaving),
        # and one consumer at least as large as max_request_tokens, so every request fits one.
        rng = random.Random(i)
        cap = (1000, 3000, 5000)[i]
        held: dict[str, int] = {}
        with RefillStream(svc.address, "gen", consumer_id=f"c{i}") as s:
            finished: list[str] = []
            while not s.exhausted:
                for rid in finished:
                    held.pop(rid)
                free = rng.randint(0, cap - sum(held.values()))
                got = s.refill(free, finished)
                if sum(r.cost for r in got) > free:
                    problems.append(f"{sum(r.cost for r in got)} > {free}")
                problems.extend(f"{r.id}: cost {r.cost}, {r.prompt_tokens} prompt tokens "
                                f"({len(r.input_ids)} ids) + {r.generation_tokens}" for r in got
                                if not r.cost == r.prompt_tokens + r.generation_tokens
                                == len(r.input_ids) + r.generation_tokens)
                with lock:
                    seen.extend(s.completed)
                held.update({r.id: r.cost for r in got})
                finished = [rid for rid in held if rng.random() < 0.5]
                time.sleep(0.005)

    threads = [threading.Thread(target=consumer, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads)
    assert problems == []  # (checked here: an assert in a consumer's thread would only warn)
    assert len(seen) == len(set(seen)) == len(good_ids(state)) > 0
    assert {rid for rid in seen if rid.endswith("@1")} == {f"{rid}@1" for rid in seen
                                                            if "@" not in rid}  # each epoch
    c = state.counts()
    assert c.enqueued + c.quarantined in (2 * (ROWS - 1), 2 * ROWS)
    assert [(e.epoch, e.completed) for e in c.by_epoch] == [(0, c.enqueued // 2),
                                                            (1, c.enqueued // 2)]
    # Status over GetJob: what `odb-pipeline status` shows.
    st = RefillStream(svc.address, "gen").job_status()
    assert st.mode == pb.REFILL and st.done
    assert (st.refill.completed, st.refill.in_flight) == (c.enqueued, 0)
    assert st.refill.quarantined == c.quarantined > 0  # images not shipped next to the slice
    # ... and the operator's command.
    from pipeline.status import text
    from pipeline.status.query import Sources, collect

    report = collect(Sources(endpoint=svc.address, jobs=["gen"]))
    job = report.jobs[0]
    assert job.mode == "refill" and job.state == "done"
    assert job.refill.completed == c.enqueued and job.refill.in_flight == 0
    assert f"refill: in_flight=0  completed={c.enqueued}  readmitted=0" in text.render(report)


def test_requests_are_the_real_prompts(served):
    """input_ids are the chat template's prompt through the assistant header (real tokenizer)."""
    from pipeline.preprocess.tokenizer import load_tokenizer

    svc, _ = served
    with RefillStream(svc.address, "gen") as s:
        got: list = []
        while not got:
            got = s.refill(3000)
        text = load_tokenizer(svc_cfg_preprocess()).decode(got[0].input_ids.tolist())
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")


def svc_cfg_preprocess():
    from pipeline.config import PreprocessConfig

    return PreprocessConfig()


def test_a_killed_consumer_restarts_and_every_request_completes_once(served, tmp_path):
    svc, state = served
    wait_exhausted(state)
    log = tmp_path / "done.log"
    cmd = [sys.executable, str(HERE / "refill_consumer.py"), svc.address, "gen", "worker-1",
           str(log)]
    env = {**os.environ, "PYTHONPATH": str(HERE.parents[1])}
    p = subprocess.Popen([*cmd, "1", "3000"], env=env)
    deadline = time.monotonic() + 60
    while state.counts().completed < 10:  # mid-way: some done, some in flight
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.02)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    mid = state.counts()
    assert mid.in_flight > 0 and not mid.done
    # Restarted under the same consumer id: its lost leases go back at once, not after a lease.
    p2 = subprocess.run([*cmd, "2", "3000"], env=env, timeout=90)
    assert p2.returncode == 0
    lines = log.read_text().split()
    assert len(lines) == len(set(lines))  # never confirmed twice
    assert set(lines) <= set(state.completions())
    assert set(state.completions()) == good_ids(state)
    c = state.counts()
    assert c.done and c.completed == c.enqueued and c.readmitted >= mid.in_flight


def test_a_consumer_killed_for_good_loses_its_requests_to_another_after_the_lease(served,
                                                                                tmp_path):
    svc, state = served
    wait_exhausted(state)
    with RefillStream(svc.address, "gen", consumer_id="doomed") as s:
        taken = s.refill(5000)
    assert taken
    with RefillStream(svc.address, "gen", consumer_id="heir") as s:
        finished: list[str] = []
        got_ids: list[str] = []
        t0 = time.monotonic()
        while not s.exhausted:
            got = s.refill(5000, finished)
            got_ids += [r.id for r in got]
            finished = [r.id for r in got]
            time.sleep(0.05)
        assert {r.id for r in taken} <= set(got_ids)
        assert time.monotonic() - t0 >= 2.5  # the job's lease_seconds (3) had to pass
    assert state.counts().readmitted >= len(taken)


def test_a_server_restart_mid_way_loses_and_duplicates_nothing(tmp_path, redis_url,
                                                               redis_client):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = refill_config({**refill_job(chats_slice(tmp_path, ROWS), queue_depth=8,
                                      max_request_tokens=3000), "epochs": 2},
                        redis_url=redis_url).model_copy(deep=True)
    cfg = cfg.model_validate({**cfg.model_dump(), "grpc": {"port": port}})
    svc = start_service(cfg)
    state = RefillState.connect(redis_url, "gen")
    confirmed: list[str] = []
    errors: list[BaseException] = []

    def consume() -> None:
        try:
            with RefillStream(f"127.0.0.1:{port}", "gen", consumer_id="steady",
                              reconnect_timeout=30) as s:
                held: list[str] = []
                while not s.exhausted:
                    got = s.refill(3000, held[:2])
                    confirmed.extend(s.completed)
                    held = held[2:] + [r.id for r in got]
                    time.sleep(0.01)
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    t = threading.Thread(target=consume)
    t.start()
    deadline = time.monotonic() + 60
    while state.counts().completed < 5:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    svc.stop(grace=0.2)  # the replica and its producer go away mid-source
    time.sleep(0.5)
    svc = start_service(cfg)
    try:
        t.join(90)
        assert not errors and not t.is_alive()
        assert len(confirmed) == len(set(confirmed)) == len(good_ids(state))
        assert set(state.completions()) == good_ids(state)
        c = state.counts()  # every request once in each of the two epochs
        assert c.exhausted and c.enqueued + c.quarantined in (2 * (ROWS - 1), 2 * ROWS)
        assert sum(rid.endswith("@1") for rid in confirmed) == c.enqueued // 2
    finally:
        svc.stop(grace=0.2)


# --- bad calls ---
def ask(stub, *msgs: pb.RefillMessage, metadata=()) -> list[pb.RefillReply]:
    return list(stub.Refill(iter(msgs), metadata=metadata, timeout=10))


def open_msg(job: str = "gen", consumer: str = "bad") -> pb.RefillMessage:
    return pb.RefillMessage(open=pb.RefillOpen(job_id=job, consumer_id=consumer))


def ask_msg(free: int, finished=(), seq: int = 1) -> pb.RefillMessage:
    return pb.RefillMessage(ask=pb.RefillAsk(free_tokens=free, finished=list(finished),
                                             call_seq=seq))


def code_of(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as exc:
        fn()
    return exc.value.code(), exc.value.details()


def test_bad_calls_get_precise_status_codes(served):
    svc, state = served
    stub = pb_grpc.DataServiceStub(grpc.insecure_channel(svc.address))
    code, msg = code_of(lambda: ask(stub, open_msg(), ask_msg(-5)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "free_tokens must be >= 0, got -5" in msg
    code, msg = code_of(lambda: ask(stub, open_msg("nope"), ask_msg(10)))
    assert code == grpc.StatusCode.NOT_FOUND and "unknown job 'nope'" in msg
    assert "gen" not in msg and "train" not in msg  # nothing about the jobs served
    code, msg = code_of(lambda: ask(stub, open_msg("train"), ask_msg(10)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "mode 'join'" in msg
    code, msg = code_of(lambda: ask(stub, ask_msg(10)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "must be RefillOpen" in msg
    # Unknown ids in `finished`: refused whole, the valid one named beside stays leased.
    reply = []
    while not reply or not reply[-1].requests:
        reply = ask(stub, open_msg(consumer="strict"), ask_msg(3000))
    rid = reply[-1].requests[0].id
    code, msg = code_of(lambda: ask(stub, open_msg(consumer="strict2"),
                                    ask_msg(0, [rid, "chats.jsonl:999999"])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown request ids ['chats.jsonl:999999']" in msg and "nothing was applied" in msg
    assert rid not in state.completions()
    # A training job's Stream is not the way to a refill job, nor Refill to a training job.
    with BatchStream(svc.address, "gen", 0, 1, reconnect_timeout=2) as bs, \
            pytest.raises(StreamError) as exc:
        next(iter(bs))
    assert exc.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "mode 'refill'" in exc.value.details
    with RefillStream(svc.address, "train") as rs, pytest.raises(StreamError) as exc:
        rs.refill(10)
    assert exc.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_a_job_token_guards_refill(tmp_path, redis_url, redis_client):
    train = {"job_id": "train", "world_size": 1, "source": {"paths": ["arrays"]}}
    cfg = refill_config(refill_job(chats_slice(tmp_path, 10)), train, redis_url=redis_url)
    svc = start_service(cfg, tokens={"gen": "s3cret", "train": "t0ken"}, sample_sources={
        "train": ArraySource(synthetic_samples(4, lengths=[10] * 4))})
    try:
        with RefillStream(svc.address, "gen", token="wrong") as s, \
                pytest.raises(StreamError) as exc:
            s.refill(10)
        assert exc.value.code == grpc.StatusCode.UNAUTHENTICATED
        # A training job's mode is told only to a caller with its token.
        for token, code in ((None, grpc.StatusCode.UNAUTHENTICATED),
                            ("t0ken", grpc.StatusCode.FAILED_PRECONDITION)):
            with RefillStream(svc.address, "train", token=token) as s, \
                    pytest.raises(StreamError) as exc:
                s.refill(10)
            assert exc.value.code == code and ("mode 'join'" in exc.value.details) == bool(
                token)
        with RefillStream(svc.address, "gen", token="s3cret") as s:
            assert isinstance(s.refill(10), list)
            assert s.job_status().refill.consumers == 1
        # Stream and Scale naming the refill job: its mode is told only to a caller with its
        # token too; without it, UNAUTHENTICATED and nothing about the job (#40 item 10).
        for token, code in ((None, grpc.StatusCode.UNAUTHENTICATED),
                            ("wrong", grpc.StatusCode.UNAUTHENTICATED),
                            ("s3cret", grpc.StatusCode.FAILED_PRECONDITION)):
            with BatchStream(svc.address, "gen", 0, 1, token=token, reconnect_timeout=1) as bs, \
                    pytest.raises(StreamError) as exc:
                next(iter(bs))
            assert exc.value.code == code
            assert ("refill" in exc.value.details) == (token == "s3cret"), exc.value.details
            meta = (("authorization", f"Bearer {token}"),) if token else ()
            with grpc.insecure_channel(svc.address) as channel, \
                    pytest.raises(grpc.RpcError) as err:
                pb_grpc.DataServiceStub(channel).Scale(
                    pb.ScaleRequest(job_id="gen", world_size=2), metadata=meta, timeout=10)
            assert err.value.code() == code
            assert ("refill" in err.value.details()) == (token == "s3cret"), err.value.details()
    finally:
        svc.stop(grace=0.2)


def test_over_budget_requests_are_quarantined_with_a_reason_or_sent_alone(tmp_path, redis_url,
                                                                         redis_client):
    src = chats_slice(tmp_path, 30)
    jobs = [refill_job(src, "q", generation_tokens=64, max_request_tokens=400),
            refill_job(src, "a", generation_tokens=64, max_request_tokens=400,
                       over_budget="alone")]
    svc = start_service(refill_config(*jobs, redis_url=redis_url))
    try:
        q = RefillState.connect(redis_url, "q")
        a = RefillState.connect(redis_url, "a")
        wait_exhausted(q)
        wait_exhausted(a)
        reasons = {x["reason"] for x in q.quarantine()}
        assert "over_budget" in reasons
        over = [x for x in q.quarantine() if x["reason"] == "over_budget"]
        assert all("> max_request_tokens 400" in x["detail"] for x in over)
        with RefillStream(svc.address, "a") as s:
            flagged = 0
            held: list[str] = []
            while not s.exhausted:
                got = s.refill(400, held)
                if any(r.over_budget for r in got):
                    # Alone, to a consumer idle once this ask's report is applied (it reports
                    # everything it held each time).
                    assert len(got) == 1
                    flagged += 1
                else:
                    assert sum(r.cost for r in got) <= 400
                held = [r.id for r in got]
            assert flagged == len(over) > 0
    finally:
        svc.stop(grace=0.2)


def test_input_ids_travel_as_raw_int32(served):
    svc, _ = served
    with RefillStream(svc.address, "gen") as s:
        got: list = []
        while not got:
            got = s.refill(3000)
    assert got[0].input_ids.dtype == np.int32 and got[0].input_ids.ndim == 1


def test_stopping_with_a_consumer_and_a_rank_still_connected_leaves_no_thread_behind(served):
    """Refill runs in the server's handler threads and reads its requests through the event
    loop the rank streams run on: a stop must end both kinds of call before the loop goes, or
    a handler thread would wait on it forever (and hold the interpreter's exit)."""
    svc, _ = served
    channel = grpc.insecure_channel(svc.address)
    refill = channel.stream_stream("/odb.v1.DataService/Refill")(iter(lambda: None, 0))
    rank = BatchStream(svc.address, "train", 0, 1, prefetch=1)
    next(iter(rank))
    time.sleep(0.5)  # the Refill handler now waits for its first request
    assert svc.server.stop(grace=0.2).wait(20)
    assert not [t.name for t in threading.enumerate()
                if t.name.startswith(("odb_", "odb-io", "odb-grpc"))]
    rank.close()
    refill.cancel()
    channel.close()
