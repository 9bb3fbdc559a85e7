"""The host's relay (transport option ``relay``): one LISTEN session for all the
consumers of a host, instead of one each.

A LISTEN session is a server session held for as long as its consumer lives, and on
PostgreSQL 15 to 18 every notifying commit signals every listening session of the
database, whatever its channel: 200 idle workers are 200 sessions, past a managed
server's limit, and each publish pays for all of them (issue 43).

The first consumer of a host to start becomes the *hub*: a thread of its process binds a
Unix socket in Linux's abstract namespace, named after the user, the connection and
the schema (:func:`relay_name`), holds the host's one LISTEN session (a
:class:`~._listener.Listener` taking no handoffs) and watches the union of the queues
its clients wait for. Every consumer, the hub's own process's included, is a client
(:class:`RelayClient`): it tells the hub which queues it consumes and which it waits for
(a queue is waited for while it is drained, as a Listener watches it), and for each
notified queue the hub wakes one client: the one that most recently began waiting for
it. The work goes to the few consumers that took the last of it, whose pooled sessions
stay open, and the rest of the fleet holds no session at all once its pools closed
theirs (``pool_max_idle``). The hub also runs, for all, what each consumer ran for
itself: the safety poll of every consumed queue (which promotes delayed messages at
their due time), the sweep, and the storage's rotation. A client polls only every
RELAY_POLL_FACTOR safety intervals, in case its hub is stuck.

When the hub's process ends or stops consuming, its clients see their socket close.
Each then binds the name itself (one wins, and becomes the hub) or connects to the one
that won, and claims once from every queue it consumes, as after a lost LISTEN session.

Only processes of the hub's own user may connect (``SO_PEERCRED``): what travels, queue
names, is what a process of that user could read from its peers' memory anyway.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import selectors
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from . import _pool
from ._listener import Listener, Notified
from ._options import Options
from ._rotator import Rotator
from ._store import Store

logger = logging.getLogger(__name__)

#: a client's safety poll, in safety intervals (``polling_interval``): the hub polls for
#: every client; a client's own poll only covers a hub that is stuck
RELAY_POLL_FACTOR = 12
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
#: connection parameters that do not change which server, database and role
_NOT_THE_SERVER = frozenset({"password", "passfile", "application_name", "connect_timeout"})


def supported() -> bool:
    """The abstract namespace of Unix sockets is Linux's."""
    return sys.platform.startswith("linux")


def relay_name(conninfo: str, options: Options) -> bytes:
    """The relay's address: this user's, for this server, database, role and schema."""
    params = {k: v for k, v in conninfo_to_dict(conninfo).items() if k not in _NOT_THE_SERVER}
    key = json.dumps([sorted(params.items()), options.listen_url or "", options.schema])
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    return f"\0pgqueue-relay-{os.geteuid()}-{digest}".encode()


def _line(message: dict[str, Any]) -> bytes:
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

    def __init__(self, server: socket.socket, conninfo: str, options: Options) -> None:
        self.server = server
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
            _unlist(self)
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
        peer.outbox += _line(message)
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


class RelayLost(psycopg.OperationalError):
    """The host's relay closed the socket: a connection error, as a lost LISTEN session's
    (the transport reconnects, and the next session finds a hub)."""


class RelayClient:
    """A consumer's wakeups through the host's relay, in the shape of a
    :class:`~._listener.Listener` (what ``_wakeups`` uses of one). Handoffs are not
    relayed (``tokens`` stays empty), and no claim shares a session of its (``conn``)."""

    conn: psycopg.Connection | None = None

    def __init__(self, conninfo: str, options: Options) -> None:
        self.conninfo = conninfo
        self.options = options
        self.tokens: dict[str, str] = {}
        self.no_ack: set[str] = set()
        #: the queues consumed, and those waited for (a drained queue: see Listener.turn)
        self.consumed: set[str] = set()
        self.watched: set[str] = set()
        self._sock: socket.socket | None = None
        self._hub: Hub | None = None
        self._buffer = b""
        self._pid = os.getpid()

    def open(self) -> bool | None:
        """Join the host's relay (as its hub, if there is none) if not joined; True if
        this joined anew (notifications may have been missed meanwhile)."""
        if self._sock is not None and self._pid == os.getpid():
            return False
        self._sock, self._hub = _join(self.conninfo, self.options)
        self._pid, self._buffer = os.getpid(), b""
        self._say("consume", self.consumed)
        self._say("wait", self.watched)
        return True

    def watch(self, queues: Iterable[str]) -> Notified:
        """A subscription: consumed, and waited for; claim from it once."""
        new = set(queues) - self.consumed
        self.consumed.update(new)
        self._say("consume", new)
        return self._wait_for(new)

    def unwatch(self, queues: Iterable[str]) -> Notified:
        """Unsubscribed: neither consumed nor waited for."""
        gone = self.consumed.intersection(queues)
        self.consumed -= gone
        self.watched -= gone
        self._say("forget", gone)
        return Notified(self.tokens)

    def turn(self, queue: str, *, backlog: bool, pending: bool) -> Notified | None:
        """As :meth:`~._listener.Listener.turn`: waited for only while drained."""
        if backlog:
            if queue in self.watched:
                self.watched.discard(queue)
                self._say("rest", [queue])
            return None
        if pending or queue in self.watched:
            return None
        return self._wait_for([queue])

    def _wait_for(self, queues: Iterable[str]) -> Notified:
        new = set(queues) - self.watched
        self.watched.update(new)
        self._say("wait", new)
        return Notified(self.tokens, queues=new)

    def fileno(self) -> int:
        assert self._sock is not None
        return self._sock.fileno()

    def wait(self, timeout: float | None) -> Notified:
        """Block up to ``timeout`` seconds for news; when the hub went, find another
        (and claim from every queue once)."""
        try:
            return self._receive(timeout)
        except RelayLost:
            self.close()
            self.open()
            return Notified(self.tokens, queues=set(self.consumed))

    def drain(self) -> Notified:
        """What has arrived, without blocking; RelayLost when the hub went (an event
        loop's reader: the transport reconnects)."""
        return self._receive(0)

    def _receive(self, timeout: float | None) -> Notified:
        found = Notified(self.tokens)
        sock = self._sock
        if sock is None:
            raise RelayLost("pgqueue: not joined to the host's relay")
        sock.settimeout(timeout)
        while True:
            try:
                data = sock.recv(65536)
            except (BlockingIOError, TimeoutError):
                break
            except OSError as exc:
                raise RelayLost(f"pgqueue: the host's relay went away ({exc})") from exc
            if not data:
                raise RelayLost("pgqueue: the host's relay went away")
            self._buffer += data
            sock.settimeout(0)  # then what else has arrived
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            found.queues.update(json.loads(line).get("news", ()))
        return found

    def _say(self, op: str, queues: Iterable[str]) -> None:
        queues = sorted(queues)
        if not queues or self._sock is None or self._pid != os.getpid():
            return
        try:
            self._sock.settimeout(None)
            self._sock.sendall(_line({op: queues}))
        except OSError as exc:
            raise RelayLost(f"pgqueue: the host's relay went away ({exc})") from exc

    def close(self) -> None:
        sock, self._sock = self._sock, None
        hub, self._hub = self._hub, None
        if sock is not None and self._pid == os.getpid():
            sock.close()
            if hub is not None:
                _let_go(hub)


# -- the process's hubs ---------------------------------------------------------------------

_hubs_lock = threading.Lock()
#: relay name -> the hub this process runs
_hubs: dict[bytes, Hub] = {}


def _join(conninfo: str, options: Options) -> tuple[socket.socket, Hub | None]:
    """A socket connected to the host's relay, and the hub if this process runs it
    (starting it if no process of the host did)."""
    name = relay_name(conninfo, options)
    while True:
        with _hubs_lock:
            hub = _hubs.get(name)
            if hub is not None:
                hub.clients += 1
        if hub is None:
            hub = _become_hub(name, conninfo, options)
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(name)
            return sock, hub
        except (ConnectionRefusedError, FileNotFoundError):
            sock.close()
            if hub is not None:
                _let_go(hub)
            time.sleep(0.01)  # the hub ended, or another is binding: another round


def _become_hub(name: bytes, conninfo: str, options: Options) -> Hub | None:
    """Bind the relay's name and run its hub; None when another process holds it."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(name)
    except OSError:
        server.close()
        return None
    server.listen(socket.SOMAXCONN)
    hub = Hub(server, conninfo, options)
    hub.clients = 1
    with _hubs_lock:
        _hubs[name] = hub
    hub.start()
    return hub


def _let_go(hub: Hub) -> None:
    """A client of this process's hub closed; the last one stops it."""
    with _hubs_lock:
        hub.clients -= 1
        if hub.clients > 0:
            return
    _unlist(hub)
    hub.stop()


def _unlist(hub: Hub) -> None:
    """No client of this process joins ``hub`` from now on (stopping, or stopped)."""
    with _hubs_lock:
        for name, running in list(_hubs.items()):
            if running is hub:
                del _hubs[name]


def _forget_after_fork() -> None:
    global _hubs_lock
    _hubs_lock = threading.Lock()
    for hub in _hubs.values():
        hub.forget()
    _hubs.clear()


os.register_at_fork(after_in_child=_forget_after_fork)
