"""A TCP proxy in front of the test PostgreSQL that breaks connections on cue.

Tests point a broker URL at ``proxy.port`` (with ``sslmode=disable``, so the proxy can
read the server's messages) and arm a fault; everything else is forwarded unchanged.

``cut_after_commit()``: the next time the server answers a statement that inserted rows
(a statement with ``INSERT INTO``, answered by ReadyForQuery outside a transaction
block: it has committed), the proxy closes the client's connection instead of forwarding the answer.
The rows are in the database; the client sees a broken connection, as after a network
fault or a server crash at the worst moment.
"""

from __future__ import annotations

import socket
import struct
import threading
from typing import Any

import psycopg


def _upstream(dsn: str) -> tuple[int, Any]:
    """(address family, address) of the server ``dsn`` connects to."""
    with psycopg.connect(dsn) as conn:
        host, port = conn.info.host, conn.info.port
    if host.startswith("/"):
        return socket.AF_UNIX, f"{host}/.s.PGSQL.{port}"
    return socket.AF_INET, (host, port)


class FaultProxy:
    def __init__(self, dsn: str) -> None:
        self._family, self._address = _upstream(dsn)
        self._lock = threading.Lock()
        self._cut_armed = False
        #: connections closed by an armed fault
        self.cuts = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, name="fault-proxy", daemon=True).start()

    def cut_after_commit(self) -> None:
        with self._lock:
            self._cut_armed = True

    def close(self) -> None:
        for sock in self._sockets:
            try:
                sock.close()
            except OSError:
                pass

    # -- plumbing -------------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.socket(self._family, socket.SOCK_STREAM)
            server.connect(self._address)
            self._sockets += [client, server]
            link = _Link(client, server)
            threading.Thread(target=self._requests, args=(link,), daemon=True).start()
            threading.Thread(target=self._answers, args=(link,), daemon=True).start()

    def _requests(self, link: _Link) -> None:
        """Forward the client's messages, noting statements that insert."""
        buffer = b""
        started = False
        try:
            while data := link.client.recv(65536):
                buffer += data
                while True:
                    if not started:  # the startup packet: a length, no type byte
                        if len(buffer) < 8:
                            break
                        (length,) = struct.unpack("!I", buffer[:4])
                        if len(buffer) < length:
                            break
                        packet, buffer = buffer[:length], buffer[length:]
                        if struct.unpack("!I", packet[4:8])[0] in _ENCRYPTION_REQUESTS:
                            link.client.sendall(b"N")  # no TLS, no GSS: plain text
                            continue
                        started = True
                        link.server.sendall(packet)
                        continue
                    if len(buffer) < 5:
                        break
                    (length,) = struct.unpack("!I", buffer[1:5])
                    if len(buffer) < 1 + length:
                        break
                    message, buffer = buffer[: 1 + length], buffer[1 + length :]
                    link.note(message)
                    link.server.sendall(message)
        except OSError:
            pass
        link.close()

    def _answers(self, link: _Link) -> None:
        """Forward the server's messages whole; cut after a committed insert when armed."""
        buffer = b""
        try:
            while data := link.server.recv(65536):
                buffer += data
                forward = b""
                while len(buffer) >= 5:
                    (length,) = struct.unpack("!I", buffer[1:5])
                    if len(buffer) < 1 + length:
                        break
                    message, buffer = buffer[: 1 + length], buffer[1 + length :]
                    # ReadyForQuery outside a transaction block: what came before committed
                    if message[:1] == b"Z" and message[5:6] == b"I" and link.took_insert():
                        with self._lock:
                            cut, self._cut_armed = self._cut_armed, False
                            self.cuts += cut
                        if cut:
                            raise ConnectionAbortedError
                    forward += message
                if forward:
                    link.client.sendall(forward)
        except OSError:
            pass
        link.close()


_ENCRYPTION_REQUESTS = (80877103, 80877104)  # SSLRequest, GSSENCRequest


class _Link:
    """One client connection and its server connection, and the inserts sent on it."""

    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client = client
        self.server = server
        self._lock = threading.Lock()
        self._inserting: dict[bytes, bool] = {}  # prepared statement name -> inserts
        self._pending = 0

    def note(self, message: bytes) -> None:
        kind, payload = message[:1], message[5:]
        with self._lock:
            if kind == b"Q":
                self._pending += b"INSERT INTO" in payload.upper()
            elif kind == b"P":
                name, _, rest = payload.partition(b"\0")
                self._inserting[name] = b"INSERT INTO" in rest.upper()
            elif kind == b"B":
                _portal, _, rest = payload.partition(b"\0")
                name = rest.partition(b"\0")[0]
                self._pending += self._inserting.get(name, False)

    def took_insert(self) -> bool:
        with self._lock:
            taken, self._pending = self._pending > 0, 0
            return taken

    def close(self) -> None:
        for sock in (self.client, self.server):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
