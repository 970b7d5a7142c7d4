"""The fault-injection tools themselves (tests/support): the TCP proxy black-holes without
closing and heals without losing a byte, refuses and resets on command; `frozen` stops a whole
process tree and always continues it."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from support.freeze import frozen
from support.process_tree import descendants, process_state
from support.tcp_proxy import TcpProxy
from support.waiting import wait_for

QUIET_S = 0.3  # long enough for a forwarded byte to arrive on loopback


class EchoServer:
    """Echoes every byte back; `heard` is everything it received."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.heard = bytearray()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    def _echo(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(ConnectionResetError):  # (reset_all resets it)
            while data := conn.recv(4096):
                self.heard += data
                conn.sendall(data)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def proxy():
    echo = EchoServer()
    with TcpProxy(("127.0.0.1", echo.port)) as p:
        p.echo = echo
        yield p
    echo.close()


def dial(p: TcpProxy) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", p.port), timeout=5)
    s.settimeout(QUIET_S)
    return s


def silent(s: socket.socket) -> bool:
    """Nothing arrives, and the connection is neither closed nor reset."""
    s.settimeout(QUIET_S)
    try:
        s.recv(16)  # data, or b"" for a close
    except TimeoutError:
        return True
    return False


def test_proxy_forwards_then_black_holes_both_ways_and_heals_without_loss(proxy):
    s = dial(proxy)
    s.sendall(b"a")
    assert s.recv(16) == b"a"
    proxy.black_hole()
    s.sendall(b"b")
    assert silent(s)
    assert bytes(proxy.echo.heard) == b"a"  # it never reached the target either
    late = dial(proxy)  # a connection made during the black hole is accepted, and silent
    late.sendall(b"x")
    assert silent(late)
    proxy.heal()
    s.settimeout(5)
    late.settimeout(5)
    assert s.recv(16) == b"b" and late.recv(16) == b"x"


def test_proxy_black_holes_one_way_only(proxy):
    s = dial(proxy)
    proxy.black_hole(to_target=False)  # the target hears the client; its answers are held
    s.sendall(b"c")
    wait_for(lambda: bytes(proxy.echo.heard) == b"c", 5, "the target to hear the client")
    assert silent(s)
    proxy.heal()
    s.settimeout(5)
    assert s.recv(16) == b"c"
    proxy.black_hole(to_client=False)  # now the other way: the target hears nothing
    s.sendall(b"d")
    assert silent(s)
    assert bytes(proxy.echo.heard) == b"c"
    proxy.heal()
    assert s.recv(16) == b"d"


def _closed_by_peer(s: socket.socket) -> bool:
    s.settimeout(5)
    try:
        return s.recv(16) == b""
    except ConnectionResetError:
        return True


def test_proxy_refuses_new_connections_and_resets_live_ones(proxy):
    live = dial(proxy)
    wait_for(lambda: proxy.connections() == 1, 5, "the proxy to accept it")
    proxy.refuse_new()
    try:  # reset at once: while connecting (on a loaded machine) or at the first read
        refused = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        assert _closed_by_peer(refused)
    except ConnectionResetError:
        pass
    live.sendall(b"e")  # a live connection is kept
    live.settimeout(5)
    assert live.recv(16) == b"e"
    proxy.heal()
    again = dial(proxy)
    wait_for(lambda: proxy.connections() == 2, 5, "the proxy to accept it")
    proxy.reset_all()  # a clean kill: both ends learn it at once
    assert _closed_by_peer(live) and _closed_by_peer(again)
    wait_for(lambda: proxy.connections() == 0, 5, "the proxy to drop its connections")


SLEEPER = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
           "'import time; time.sleep(60)']); time.sleep(60)")


def test_frozen_stops_a_process_tree_and_always_continues_it():
    parent = subprocess.Popen([sys.executable, "-c", SLEEPER])
    try:
        wait_for(lambda: descendants(parent.pid), 10, "the child process")
        tree = [parent.pid, *descendants(parent.pid)]
        with pytest.raises(RuntimeError, match="boom"), frozen(parent.pid) as ice:
            assert sorted(ice.pids) == sorted(tree)
            assert all(process_state(p) == "T" for p in tree)
            raise RuntimeError("boom")  # a failing test still thaws what it froze
        assert all(process_state(p) not in ("T", "") for p in tree)
        before = time.time()
        with frozen(parent.pid, tree=False) as ice:
            assert process_state(parent.pid) == "T"
            assert process_state(tree[1]) != "T"
            time.sleep(0.2)  # (what `seconds` is to measure: frozen this long at least)
            ice.thaw()  # early
            after = time.time()
            assert process_state(parent.pid) != "T"
        assert 0.2 <= ice.seconds <= after - before  # how long it was frozen...
        measured = ice.seconds
        time.sleep(0.05)
        assert ice.seconds == measured  # ... fixed once thawed
    finally:
        for pid in [*descendants(parent.pid), parent.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        parent.wait(10)
