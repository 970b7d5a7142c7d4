"""A TCP proxy for fault injection: what a network partition looks like to both ends.

    proxy = TcpProxy(("127.0.0.1", redis_port)).start()   # clients dial proxy.port
    proxy.black_hole()                 # both directions: nothing passes, nothing is closed
    proxy.black_hole(to_client=False)  # one way only: the target hears the client, not back
    proxy.heal()                       # everything held back flows on, in order
    proxy.refuse_new()                 # new connections are reset at once (a closed port)
    proxy.reset_all()                  # every connection reset: a clean kill, for comparison
    proxy.close()

A black-holed direction is no longer read: its bytes wait in the kernel's socket buffers and
the sender's TCP flow control, as packets wait for retransmission across a real partition, and
flow on when it heals. Neither connection is closed, so neither end learns anything from its
sockets: only a timeout of its own (gRPC keepalive, a Redis socket timeout) can tell it. A
connection accepted while black-holed is black-holed from its first byte, as is a TCP
connection to a frozen host (its kernel still completes the handshake).
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading
from dataclasses import dataclass, field

_CHUNK = 1 << 16


def _reset(sock: socket.socket) -> None:
    """Close with an RST (SO_LINGER 0), not a FIN: the peer's next read or write fails."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


@dataclass
class _Pair:
    client: socket.socket
    target: socket.socket
    closed: bool = False
    pumps_left: int = 2  # a connection both of whose ends closed is closed here too
    threads: list[threading.Thread] = field(default_factory=list)


class TcpProxy:
    def __init__(self, target: tuple[str, int], listen_host: str = "127.0.0.1",
                 listen_port: int = 0) -> None:
        self.target = target
        self._listener = socket.create_server((listen_host, listen_port), reuse_port=False)
        self._listener.settimeout(0.1)
        self.host, self.port = self._listener.getsockname()[:2]
        self._lock = threading.Lock()
        self._pairs: list[_Pair] = []
        # Set = that direction flows (to_target: client -> target; to_client: target -> client).
        self._to_target = threading.Event()
        self._to_client = threading.Event()
        self._to_target.set()
        self._to_client.set()
        self._refusing = False
        self._closing = threading.Event()
        self._acceptor = threading.Thread(target=self._accept, name=f"proxy-{self.port}",
                                          daemon=True)
        self.accepted = 0  # connections accepted so far (refused ones included)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> TcpProxy:
        self._acceptor.start()
        return self

    # --- faults ---
    def black_hole(self, to_target: bool = True, to_client: bool = True) -> None:
        """Stop forwarding in the given directions, closing nothing."""
        if to_target:
            self._to_target.clear()
        if to_client:
            self._to_client.clear()

    def heal(self) -> None:
        """Forward both ways again (held bytes first) and accept new connections."""
        self._refusing = False
        self._to_target.set()
        self._to_client.set()

    def refuse_new(self) -> None:
        """Reset every new connection as soon as it is accepted (live ones are kept)."""
        self._refusing = True

    def reset_all(self) -> None:
        """Reset every live connection, both sides (new ones are accepted as before)."""
        with self._lock:
            pairs = list(self._pairs)
        for pair in pairs:
            self._drop(pair)

    def connections(self) -> int:
        """Connections open through the proxy now."""
        with self._lock:
            return len(self._pairs)

    def close(self) -> None:
        self._closing.set()
        self.heal()  # pumps waiting on a black hole see the close
        if self._acceptor.is_alive():
            self._acceptor.join(5)
        self._listener.close()
        self.reset_all()

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- forwarding ---
    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            if self._refusing:
                _reset(client)
                continue
            try:
                target = socket.create_connection(self.target, timeout=5)
            except OSError:
                _reset(client)  # the target itself refuses: so does the proxy
                continue
            for s in (client, target):
                s.settimeout(None)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pair = _Pair(client, target)
            pair.threads = [
                threading.Thread(target=self._pump, args=(pair, client, target, self._to_target),
                                 daemon=True, name=f"proxy-{self.port}-up"),
                threading.Thread(target=self._pump, args=(pair, target, client, self._to_client),
                                 daemon=True, name=f"proxy-{self.port}-down")]
            with self._lock:
                self._pairs.append(pair)
            for t in pair.threads:
                t.start()

    def _pump(self, pair: _Pair, src: socket.socket, dst: socket.socket,
              flowing: threading.Event) -> None:
        """Copy src -> dst while `flowing`; a black hole stops reading src (closing nothing)."""
        with selectors.DefaultSelector() as sel:
            try:
                sel.register(src, selectors.EVENT_READ)
            except (ValueError, OSError):
                return
            while not pair.closed and not self._closing.is_set():
                if not flowing.wait(0.1):
                    continue
                if not sel.select(timeout=0.1) or not flowing.is_set():
                    continue  # (a black hole that began while waiting: leave the bytes queued)
                try:
                    data = src.recv(_CHUNK)
                    if not data:  # an orderly close by one end: pass it on
                        with contextlib.suppress(OSError):
                            dst.shutdown(socket.SHUT_WR)
                        break
                    dst.sendall(data)
                except OSError:
                    self._drop(pair)
                    return
        with self._lock:
            pair.pumps_left -= 1
            both_closed = pair.pumps_left == 0
        if both_closed:
            self._drop(pair)

    def _drop(self, pair: _Pair) -> None:
        with self._lock:
            if pair.closed:
                return
            pair.closed = True
            if pair in self._pairs:
                self._pairs.remove(pair)
        _reset(pair.client)
        _reset(pair.target)
