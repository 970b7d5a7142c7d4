"""The embedded Redis of `serve` (`LocalRedis.durable`): a password made on first start and kept
0600 in the state dir, the same one after a restart (the AOF-backed state resumes behind it);
a password file others can read is refused; the password never reaches the server's command
line (other users read it in /proc); the server runs in a session of its own."""

from __future__ import annotations

import os
import socket
import stat

import pytest
from support.process_tree import cmdline

from pipeline.errors import UserError
from pipeline.redis_client import connect
from pipeline.redis_server import PASSWORD_FILE, LocalRedis, find_redis_binary


def _unauthenticated_ping(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"PING\r\n")
        return s.recv(64)


def test_the_embedded_redis_wants_its_password_and_keeps_it_across_a_restart(tmp_path):
    server = LocalRedis.durable(tmp_path).start()
    try:
        password_file = tmp_path / "redis" / PASSWORD_FILE
        assert stat.S_IMODE(password_file.stat().st_mode) == 0o600
        password = password_file.read_text().strip()
        assert len(password) >= 32 and f":{password}@" in server.url
        assert _unauthenticated_ping(server.port).startswith(b"-NOAUTH")
        client = connect(server.url)
        client.set("odb:test:kept", "1")
        client.close()
        assert server.proc is not None and os.getsid(server.proc.pid) == server.proc.pid
    finally:
        server.cleanup()

    again = LocalRedis.durable(tmp_path).start()
    try:
        assert again.password == password
        client = connect(again.url)
        assert client.get("odb:test:kept") in (b"1", "1")  # resumed from the AOF
        client.close()
    finally:
        again.cleanup()


def test_a_password_file_others_can_read_is_refused(tmp_path):
    LocalRedis.durable(tmp_path).cleanup()  # makes the password file, starts nothing
    password_file = tmp_path / "redis" / PASSWORD_FILE
    password_file.chmod(0o644)
    with pytest.raises(UserError, match=r"mode 0644.*chmod 600"):
        LocalRedis.durable(tmp_path)
    password_file.chmod(0o600)
    LocalRedis.durable(tmp_path).cleanup()  # the lock was released by the refusal


def test_the_password_never_reaches_the_servers_command_line(tmp_path, monkeypatch):
    """Any user reads another's command line in /proc/<pid>/cmdline (and a wrapper or a process
    accounting tool records it): the password goes to the server in a file only we can read.
    A `redis-server` wrapper first on PATH records the arguments it is started with."""
    real = find_redis_binary()
    seen = tmp_path / "argv"
    wrapper = tmp_path / "bin" / "redis-server"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "{seen}"\nexec "{real}" "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{wrapper.parent}{os.pathsep}{os.environ['PATH']}")
    server = LocalRedis.durable(tmp_path / "state").start()
    try:
        password = server.password
        assert password and find_redis_binary() == str(wrapper)
        assert "--port" in seen.read_text()  # the wrapper started the server
        assert password not in seen.read_text()
        running = cmdline(server.proc.pid)
        assert "redis-server" in running and password not in running
        client = connect(server.url)  # ... and the server wants it all the same
        assert client.ping()
        client.close()
        assert _unauthenticated_ping(server.port).startswith(b"-NOAUTH")
    finally:
        server.cleanup()
