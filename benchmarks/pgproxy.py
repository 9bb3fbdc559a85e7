"""A counting TCP proxy for the PostgreSQL wire protocol (benchmark use only).

Clients connect to the proxy instead of the server; it forwards bytes both ways
and counts the frontend messages each client sends, so the statements one
process sends can be counted exactly even when other sessions use the same
database (``pg_stat_statements`` is not loaded on the benchmark server, and
``pg_stat_database`` counts everybody).

Counted per proxy: connections opened, connections open now, and the frontend
messages by type: ``Q`` (simple query), ``E`` (execute), ``S`` (sync: the end of
one extended-protocol round trip), ``P`` (parse), ``B`` (bind). A statement is a
``Q`` or an ``E``; a round trip is a ``Q`` or an ``S``.

SSLRequest/GSSENCRequest are answered ``N`` by the proxy itself, so libpq's
default ``sslmode=prefer`` falls back to plain text and the traffic can be read.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections import Counter

_SSL_REQUEST = 80877103
_GSSENC_REQUEST = 80877104


class CountingProxy:
    def __init__(self, upstream: tuple[str, int] = ("127.0.0.1", 5432)) -> None:
        self.upstream = upstream
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.connections = 0
        self.open_connections = 0
        self._server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(64)
        self.port = self._server.getsockname()[1]
        self._closed = False
        self._sockets: set[socket.socket] = set()
        #: set to a list to record (time, type, payload) of every Parse/Bind/Query message
        self.trace: list[tuple[float, str, bytes]] | None = None
        threading.Thread(target=self._accept, name="pgproxy-accept", daemon=True).start()

    # -- counters --------------------------------------------------------------------

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            snap = dict(self.counts)
            snap["connections"] = self.connections
            snap["open_connections"] = self.open_connections
        snap["statements"] = snap.get("Q", 0) + snap.get("E", 0)
        snap["round_trips"] = snap.get("Q", 0) + snap.get("S", 0)
        return snap

    # -- plumbing ----------------------------------------------------------------------

    def close(self) -> None:
        self._closed = True
        try:
            self._server.close()
        except OSError:
            pass
        for sock in list(self._sockets):
            try:
                sock.close()
            except OSError:
                pass

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    @staticmethod
    def _read_exact(sock: socket.socket, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("closed")
            data += chunk
        return data

    def _serve(self, client: socket.socket) -> None:
        try:
            # startup phase: untyped messages; refuse encryption ourselves
            while True:
                head = self._read_exact(client, 8)
                length, code = struct.unpack("!ii", head)
                rest = self._read_exact(client, length - 8)
                if code in (_SSL_REQUEST, _GSSENC_REQUEST):
                    client.sendall(b"N")
                    continue
                break
            server = socket.create_connection(self.upstream)
        except (OSError, ConnectionError, struct.error):
            client.close()
            return
        with self._lock:
            self.connections += 1
            self.open_connections += 1
        self._sockets.update((client, server))
        server.sendall(head + rest)
        threading.Thread(target=self._pipe, args=(server, client), daemon=True).start()
        buffer = b""
        try:
            while True:
                chunk = client.recv(65536)
                if not chunk:
                    break
                server.sendall(chunk)
                buffer += chunk
                found: list[str] = []
                pos = 0
                while len(buffer) - pos >= 5:
                    (length,) = struct.unpack_from("!i", buffer, pos + 1)
                    if len(buffer) - pos < 1 + length:
                        break
                    found.append(chr(buffer[pos]))
                    if self.trace is not None and buffer[pos] in b"PBQ":
                        self.trace.append(
                            (
                                time.time(),
                                chr(buffer[pos]),
                                bytes(buffer[pos + 5 : pos + 1 + length]),
                            )
                        )
                    pos += 1 + length
                buffer = buffer[pos:]
                if found:
                    with self._lock:
                        self.counts.update(found)
        except OSError:
            pass
        finally:
            with self._lock:
                self.open_connections -= 1
            for sock in (client, server):
                self._sockets.discard(sock)
                try:
                    sock.close()
                except OSError:
                    pass

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                chunk = src.recv(65536)
                if not chunk:
                    break
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass
