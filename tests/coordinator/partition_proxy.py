"""A TCP forwarder that can cut a link without closing it: what a network partition between a
client and Redis looks like to both ends (neither socket learns anything; only the client's
own timeouts can tell). Cut bytes are not read: they wait in the kernel's buffers and flow on,
in order, when the link heals, so a call sent into the cut arrives late."""

from __future__ import annotations

import contextlib
import socket
import threading


class PartitionProxy:
    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.1)
        self.port = self._server.getsockname()[1]
        self._open = threading.Event()  # set: bytes flow
        self._open.set()
        self._closed = threading.Event()
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def cut(self) -> None:
        self._open.clear()

    def heal(self) -> None:
        self._open.set()

    def close(self) -> None:
        self._closed.set()
        self._open.set()
        self._server.close()
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self._socks += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        src.settimeout(0.05)
        while not self._closed.is_set():
            self._open.wait()
            try:
                data = src.recv(1 << 16)
            except TimeoutError:
                continue
            except OSError:
                data = b""
            if not data:  # one end closed: pass the close on, after what it sent before
                with contextlib.suppress(OSError):
                    dst.shutdown(socket.SHUT_WR)
                return
            if not self._open.is_set():  # cut while reading: hold it until healed
                self._open.wait()
            with contextlib.suppress(OSError):
                dst.sendall(data)
