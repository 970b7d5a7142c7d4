"""A DNS server on loopback that answers A queries for names the test gives, as Kubernetes DNS
answers a headless Service's name with every ready replica's address.

    dns = DnsServer({"odb-replicas": ["127.0.0.1", "127.0.0.2"]}).start()
    target = dns.target("odb-replicas", port)   # "dns://127.0.0.1:<dns port>/odb-replicas:<port>"
    dns.names["odb-replicas"] = ["127.0.0.2"]   # later answers change (a replica left)
    dns.close()

gRPC's default resolver (c-ares) asks the DNS server named in a `dns://SERVER/` target, so a
client dials a name resolving to several replicas with no hosts file and no privileges: the
client's `dns:` path (resolution, re-resolution, its load-balancing policy) runs as it does
against `dns:///odb-pipeline-headless:50051`. A name it does not know gets NXDOMAIN, an AAAA
query an empty answer.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading

_A, _IN = 1, 1


class DnsServer:
    def __init__(self, names: dict[str, list[str]]) -> None:
        self.names = {k.lower(): list(v) for k, v in names.items()}
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.settimeout(0.2)
        self.port: int = self._sock.getsockname()[1]
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="dns-server", daemon=True)

    def start(self) -> DnsServer:
        self._thread.start()
        return self

    def target(self, name: str, port: int) -> str:
        return f"dns://127.0.0.1:{self.port}/{name}:{port}"

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                query, peer = self._sock.recvfrom(512)
            except TimeoutError:
                continue
            except OSError:
                return
            with contextlib.suppress(Exception):  # a malformed query gets no answer
                self._sock.sendto(self._answer(query), peer)

    def _answer(self, query: bytes) -> bytes:
        txid, _flags, _qdcount = struct.unpack(">HHH", query[:6])
        labels, i = [], 12
        while query[i]:
            n = query[i]
            labels.append(query[i + 1:i + 1 + n].decode("ascii"))
            i += n + 1
        qtype, _qclass = struct.unpack(">HH", query[i + 1:i + 5])
        question = query[12:i + 5]
        name = ".".join(labels).lower()
        known = name in self.names
        addresses = self.names.get(name, []) if qtype == _A else []
        # A response, recursion desired and available; NXDOMAIN (3) for an unknown name.
        header = struct.pack(">HHHHHH", txid, 0x8180 | (0 if known else 3), 1, len(addresses),
                             0, 0)
        # Each answer points back at the question's name (compression pointer 0xc00c), TTL 1 s.
        answers = b"".join(b"\xc0\x0c" + struct.pack(">HHIH", _A, _IN, 1, 4)
                           + socket.inet_aton(a) for a in addresses)
        return header + question + answers

    def close(self) -> None:
        self._closed.set()
        self._sock.close()
        self._thread.join(2.0)
