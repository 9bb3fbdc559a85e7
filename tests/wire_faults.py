"""TCP proxies in front of the test PostgreSQL that break connections on cue.

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


def split_messages(buffer: bytes) -> tuple[list[bytes], bytes]:
    """The whole protocol messages (type byte, length, body) at the head of ``buffer``,
    and what is left of it."""
    messages = []
    while len(buffer) >= 5:
        (length,) = struct.unpack("!I", buffer[1:5])
        if len(buffer) < 1 + length:
            break
        messages.append(buffer[: 1 + length])
        buffer = buffer[1 + length :]
    return messages, buffer


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
                messages, buffer = split_messages(buffer + data)
                forward = b""
                for message in messages:
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


class AnswerSplitter:
    """A TCP proxy to the test server that holds back one session's ReadyForQuery.

    PostgreSQL sends (and flushes) an ErrorResponse as soon as a statement fails, and
    the ReadyForQuery that ends the answer after it: a claimer's socket can be readable
    while only the error has arrived. Here that moment lasts until :meth:`release`.
    Clients must connect with ``sslmode=disable`` and ``gssencmode=disable``.
    """

    def __init__(self, dsn: str) -> None:
        self._upstream = _upstream(dsn)
        self._lock = threading.Lock()
        self._hold_pid: int | None = None
        self._held: list[bytes] = []
        self._release = threading.Event()
        #: set once the held session's ReadyForQuery is held back
        self.holding = threading.Event()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, name="answer-splitter", daemon=True).start()

    def hold_ready_for(self, backend_pid: int) -> None:
        with self._lock:
            self._hold_pid = backend_pid

    def release(self) -> None:
        self._release.set()

    def close(self) -> None:
        self._release.set()
        for sock in [self._listener, *self._sockets]:
            try:
                sock.close()
            except OSError:
                pass

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.socket(self._upstream[0], socket.SOCK_STREAM)
            server.connect(self._upstream[1])
            self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server), daemon=True).start()
            threading.Thread(target=self._answers, args=(server, client), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, target: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                target.sendall(data)
        except OSError:
            pass

    def _answers(self, server: socket.socket, client: socket.socket) -> None:
        buffer, pid, holding = b"", 0, False
        try:
            while data := server.recv(65536):
                messages, buffer = split_messages(buffer + data)
                forward = b""
                for message in messages:
                    kind = message[:1]
                    if kind == b"K":  # BackendKeyData: this session's server process
                        pid = struct.unpack("!I", message[5:9])[0]
                    with self._lock:
                        hold = pid == self._hold_pid and not self._release.is_set()
                    if hold and (holding or kind == b"Z"):
                        holding = True
                        self._held.append(message)
                        self.holding.set()
                        continue
                    forward += message
                if forward:
                    client.sendall(forward)
                if holding and self._release.wait(30):
                    client.sendall(b"".join(self._held))
                    self._held, holding = [], False
        except OSError:
            pass
