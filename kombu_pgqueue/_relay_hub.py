"""The host relay's hub (``_relay``): the host's one LISTEN session, watching the
union of the queues its clients wait for, on a thread of its own, with the safety poll,
the sweep and the storage's rotation that each consumer ran for itself.

It serves clients on the relay's Unix socket, one JSON object a line. A client says
``{"consume": [queues]}`` and ``{"forget": [...]}`` (its subscriptions: the hub polls
them), ``{"wait": [...]}`` and ``{"rest": [...]}`` (it waits for these, drained, or no
longer: it has a backlog). The hub says ``{"news": [queue]}`` to one client per queue
with news: the one that began waiting for it last. A line that is not one of these
drops its client.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import psycopg

from . import _pool
from ._listener import Listener, Notified
from ._options import Options
from ._rotation import Rotator
from ._store import Store

logger = logging.getLogger(__name__)

#: the longest the hub's loop waits before it looks at its clocks again
HUB_TICK = 1.0
#: seconds between two attempts of the hub to open its LISTEN session
REOPEN_SECONDS = 1.0
#: what the hub keeps unsent for a client that does not read; past it, the client is
#: dropped (it finds a hub again when it reads, and claims once from every queue)
MAX_OUTBOX = 64 << 10
#: the longest line a client may send the hub
MAX_LINE = 1 << 20
_PEERCRED = struct.Struct("3i")


def line(message: dict[str, Any]) -> bytes:
    return json.dumps(message).encode() + b"\n"


@dataclass(eq=False)
class _Peer:
    """A client of the hub: what it consumes and waits for, and what is unsent to it."""

    sock: socket.socket
    buffer: bytes = b""
    outbox: bytes = b""
    consumed: set[str] = field(default_factory=set)
    waiting: set[str] = field(default_factory=set)


class Hub:
    """The host's LISTEN session and safety poll, on a thread of its own (see the module's
    docstring). Started by the client that bound the relay's name; stopped when the last
    client of its process closes.

    Who writes what: the hub's thread everything but ``clients`` (the process's
    clients, under ``_hubs_lock``) and the stop event.
    """

    def __init__(
        self,
        server: socket.socket,
        conninfo: str,
        options: Options,
        on_end: Callable[[Hub], None],
    ) -> None:
        self.server = server
        #: called on the hub's thread as it ends (no client of the process joins it then)
        self._on_end = on_end
        self.options = replace(options, handoff=False)
        self.store = Store(conninfo, self.options)
        self.listener = Listener(conninfo, self.options)
        #: this process's clients (see _hub_for, _let_go)
        self.clients = 0
        self._selector = selectors.DefaultSelector()
        self._peers: dict[int, _Peer] = {}
        #: queue -> the peers waiting for it, the one that began last at the end
        self._waiting: dict[str, list[_Peer]] = {}
        self._listen_fd: int | None = None
        #: no session can LISTEN (a pooler took it): poll every POLL_WITHOUT_LISTEN
        self._unheard = False
        self._reopen_at = 0.0
        self._next_poll = 0.0
        self._next_sweep = 0.0
        self._due: float | None = None
        self._failures: set[str] = set()
        self._stop = threading.Event()
        self._bell, self._bell_rung = socket.socketpair()
        self._rotator = Rotator(lambda: self.store, options.rotate_interval)
        self._thread = threading.Thread(target=self._run, name="pgqueue-relay", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._bell_rung.send(b"!")
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def forget(self) -> None:
        """In a forked child: close the sockets' copies (the parent's hub goes on; a copy
        kept here would keep its clients from seeing it end), touch nothing else."""
        for sock in (
            self.server,
            self._bell,
            self._bell_rung,
            *(p.sock for p in self._peers.values()),
        ):
            with contextlib.suppress(OSError):
                sock.close()

    # -- the loop --------------------------------------------------------------------------

    def _run(self) -> None:
        self._selector.register(self.server, selectors.EVENT_READ, None)
        self._selector.register(self._bell, selectors.EVENT_READ, None)
        self._rotator.start()
        try:
            while not self._stop.is_set():
                self._open_session()
                for key, events in self._selector.select(self._timeout()):
                    self._ready(key.fileobj, events)
                self._on_clocks()
        except Exception:
            logger.exception("pgqueue: the host's relay stopped; its clients find another")
        finally:
            self._on_end(self)
            self._rotator.stop()
            self._close()

    def _ready(self, fileobj: Any, events: int) -> None:
        if fileobj is self.server:
            self._accept()
        elif fileobj is self._bell:
            with contextlib.suppress(OSError):
                self._bell.recv(64)
        elif isinstance(fileobj, int):  # the LISTEN session
            self._heard(lambda: self.listener.drain())
        else:
            peer = self._peers.get(fileobj.fileno())
            if peer is not None and events & selectors.EVENT_WRITE:
                self._flush(peer)
            if peer is not None and events & selectors.EVENT_READ:
                self._read(peer)

    def _timeout(self) -> float:
        now = time.monotonic()
        waits = [HUB_TICK, self._next_poll - now, self._next_sweep - now]
        if self._listen_fd is None and not self._unheard:
            waits.append(self._reopen_at - now)
        if self._due is not None:
            waits.append(self._due - time.time())
        return max(min(waits), 0.0)

    def _on_clocks(self) -> None:
        now = time.monotonic()
        if now >= self._next_poll or (self._due is not None and time.time() >= self._due):
            self._poll(now)
        if now >= self._next_sweep:
            self._next_sweep = now + self.options.sweep_interval
            self._guarded("sweep", self.store.sweep)

    # -- the LISTEN session ----------------------------------------------------------------

    def _open_session(self) -> None:
        if self._listen_fd is not None or self._unheard or time.monotonic() < self._reopen_at:
            return
        self._reopen_at = time.monotonic() + REOPEN_SECONDS
        try:
            opened = self.listener.open()
        except psycopg.Error as exc:
            self._failed("LISTEN", exc)
            return
        if opened is None:
            self._unheard = True
            logger.warning(
                "pgqueue: the host's relay cannot LISTEN (a transaction pooler takes it; "
                "set transport option listen_url to the server itself): polling every %g s",
                _pool.POLL_WITHOUT_LISTEN,
            )
            return
        self._listen_fd = self.listener.fileno()
        self._selector.register(self._listen_fd, selectors.EVENT_READ, None)
        # a new session: what was notified meanwhile was missed; wake a client of each
        self._heard(lambda: self.listener.watch(self._waiting))
        for queue in list(self._waiting):
            self._wake(queue)

    def _heard(self, statement: Any) -> None:
        """Run a statement of the LISTEN session's (returning what was notified) and
        wake a client of each queue it says has news; a lost session is opened again."""
        if self._listen_fd is None:
            return
        try:
            notified: Notified = statement()
        except psycopg.Error as exc:
            self._failed("LISTEN", exc)
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(self._listen_fd)
            self._listen_fd = None
            self.listener.close()
            return
        for queue in notified.queues:
            self._wake(queue)
        if notified.due is not None:
            self._due = notified.due if self._due is None else min(self._due, notified.due)

    def _wake(self, queue: str) -> None:
        """Tell the client that began waiting for ``queue`` last that it has news."""
        waiting = self._waiting.get(queue)
        if waiting:
            self._send(waiting[-1], {"news": [queue]})

    # -- the safety poll -------------------------------------------------------------------

    def _poll(self, now: float) -> None:
        interval = self.options.polling_interval
        if self._unheard:
            interval = min(interval, _pool.POLL_WITHOUT_LISTEN)
        self._next_poll = now + interval
        self._due = None
        consumed = sorted(set().union(*(p.consumed for p in self._peers.values())))
        if not consumed:
            return
        check = [queue for queue in consumed if queue in self._waiting]
        found = self._guarded("poll", lambda: self.store.poll(consumed, check=check))
        if found is not None:
            ready, self._due = found
            for queue in ready:
                self._wake(queue)

    def _guarded(self, what: str, step: Any) -> Any:
        try:
            return step()
        except Exception as exc:  # noqa: BLE001 - the relay must outlive the database
            self._failed(what, exc)
            return None

    def _failed(self, what: str, exc: BaseException) -> None:
        """Said once per kind: the hub goes on, and tries again."""
        kind = f"{what}:{type(exc).__name__}"
        if kind not in self._failures:
            self._failures.add(kind)
            logger.warning(
                "pgqueue: the host's relay could not %s (%s: %s); trying again",
                what,
                type(exc).__name__,
                exc,
                exc_info=not isinstance(exc, psycopg.Error),
            )

    # -- the clients -----------------------------------------------------------------------

    def _accept(self) -> None:
        try:
            sock, _ = self.server.accept()
        except OSError:
            return
        pid, uid, _gid = _PEERCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        )
        if uid != os.geteuid():
            logger.warning("pgqueue: the host's relay refused process %d of user %d", pid, uid)
            sock.close()
            return
        sock.setblocking(False)
        peer = _Peer(sock)
        self._peers[sock.fileno()] = peer
        self._selector.register(sock, selectors.EVENT_READ, None)

    def _read(self, peer: _Peer) -> None:
        try:
            data = peer.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(peer)
            return
        peer.buffer += data
        *lines, peer.buffer = peer.buffer.split(b"\n")
        if len(peer.buffer) > MAX_LINE:
            lines.append(b"")  # not a message of ours
        for line in lines:
            try:
                message = json.loads(line)
                for op, queues in message.items():
                    self._said(peer, op, [str(q) for q in queues])
            except (ValueError, TypeError, AttributeError) as exc:
                logger.warning(
                    "pgqueue: the host's relay dropped a client that sent %.60r (%s)", line, exc
                )
                self._drop(peer)
                return

    def _said(self, peer: _Peer, op: str, queues: list[str]) -> None:
        if op == "consume":
            peer.consumed.update(queues)
            self._next_poll = 0.0  # their delayed messages' due times
        elif op == "forget":
            peer.consumed.difference_update(queues)
            self._stop_waiting(peer, queues)
        elif op == "wait":
            self._start_waiting(peer, queues)
        elif op == "rest":
            self._stop_waiting(peer, queues)
        else:
            raise ValueError(f"unknown operation {op!r}")

    def _start_waiting(self, peer: _Peer, queues: list[str]) -> None:
        new = []
        for queue in queues:
            waiting = self._waiting.setdefault(queue, [])
            if peer in waiting:
                waiting.remove(peer)
            waiting.append(peer)  # the last to begin is woken first
            peer.waiting.add(queue)
            if queue not in self.listener.watched:
                new.append(queue)
        if new:
            # the publishes that looked before have committed: the news of each new
            # queue (the client's claim may have run before them) goes to the client
            self._heard(lambda: self.listener.watch(new))

    def _stop_waiting(self, peer: _Peer, queues: Iterable[str]) -> None:
        gone = []
        for queue in queues:
            peer.waiting.discard(queue)
            waiting = self._waiting.get(queue, [])
            if peer in waiting:
                waiting.remove(peer)
            if not waiting and self._waiting.pop(queue, None) is not None:
                gone.append(queue)
        if gone:
            self._heard(lambda: self.listener.unwatch(gone))

    def _send(self, peer: _Peer, message: dict[str, Any]) -> None:
        peer.outbox += line(message)
        self._flush(peer)

    def _flush(self, peer: _Peer) -> None:
        try:
            sent = peer.sock.send(peer.outbox)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._drop(peer)
            return
        peer.outbox = peer.outbox[sent:]
        if len(peer.outbox) > MAX_OUTBOX:
            self._drop(peer)
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if peer.outbox else 0)
        self._selector.modify(peer.sock, events, None)

    def _drop(self, peer: _Peer) -> None:
        if self._peers.pop(peer.sock.fileno(), None) is None:
            return
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(peer.sock)
        peer.sock.close()
        self._stop_waiting(peer, list(peer.waiting))

    def _close(self) -> None:
        for peer in list(self._peers.values()):
            self._drop(peer)
        for sock in (self.server, self._bell, self._bell_rung):
            sock.close()
        self.listener.close()
        self._selector.close()
