"""The host's relay (transport option ``relay``): one LISTEN session for all the
consumers of a host, instead of one each.

A LISTEN session is a server session held for as long as its consumer lives, and on
PostgreSQL 15 to 18 every notifying commit signals every listening session of the
database, whatever its channel: 200 idle workers are 200 sessions, past a managed
server's limit, and each publish pays for all of them (issue 43).

The first consumer of a host to start becomes the *hub* (``_relay_hub``): a thread of
its process binds a Unix socket in Linux's abstract namespace, named after the user,
the connection and the schema (:func:`relay_name`), holds the host's one LISTEN session (a
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

import hashlib
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Iterable

import psycopg
from psycopg.conninfo import conninfo_to_dict

from ._listener import Notified
from ._options import Options
from ._relay_hub import Hub, line

logger = logging.getLogger(__name__)

#: a client's safety poll, in safety intervals (``polling_interval``): the hub polls for
#: every client; a client's own poll only covers a hub that is stuck
RELAY_POLL_FACTOR = 12
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


class RelayLost(psycopg.OperationalError):
    """The host's relay closed the socket (the client joins the hub that follows it)."""


class RelayClient:
    """A consumer's wakeups through the host's relay, in the shape of a
    :class:`~._listener.Listener` (what ``_wakeups`` uses of one). Handoffs are not
    relayed (``tokens`` stays empty), and no claim shares a session of its (``conn``)."""

    conn: psycopg.Connection | None = None

    def __init__(self, conninfo: str, options: Options) -> None:
        self.conninfo = conninfo
        self.options = options
        self.tokens: dict[str, str] = {}
        #: the queues consumed, and those waited for (a drained queue: see Listener.turn)
        self.consumed: set[str] = set()
        self.watched: set[str] = set()
        self._sock: socket.socket | None = None
        self._hub: Hub | None = None
        self._buffer = b""
        self._pid = os.getpid()
        #: sockets of hubs that went, until the event loop stopped watching them
        self._stale: list[socket.socket] = []

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
            rejoined = self._rejoin()
            self.release_stale()
            return rejoined

    def drain(self) -> Notified:
        """What has arrived, without blocking. When the hub went, join the one that
        follows it on a new socket (claim from every queue once): the consumer's
        connection goes on (a Celery worker does not reconnect, and restore what its
        pool runs), and an event loop watches the new socket (:meth:`fileno`) before
        :meth:`release_stale` closes the old one, whose number the new one cannot have
        meanwhile."""
        try:
            return self._receive(0)
        except RelayLost:
            return self._rejoin()

    def _rejoin(self) -> Notified:
        old, self._sock = self._sock, None
        hub, self._hub = self._hub, None
        if old is not None and self._pid == os.getpid():
            self._stale.append(old)
        if hub is not None:
            _let_go(hub)
        self.open()
        return Notified(self.tokens, queues=set(self.consumed))

    def release_stale(self) -> None:
        """Close the sockets of hubs that went (see :meth:`drain`)."""
        stale, self._stale = self._stale, []
        for sock in stale:
            sock.close()

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
        for said in lines:
            found.queues.update(json.loads(said).get("news", ()))
        return found

    def _say(self, op: str, queues: Iterable[str]) -> None:
        queues = sorted(queues)
        if not queues or self._sock is None or self._pid != os.getpid():
            return
        try:
            self._sock.settimeout(None)
            self._sock.sendall(line({op: queues}))
        except OSError as exc:
            # the hub went: the socket reads as closed next, and the rejoin says it all
            logger.debug("pgqueue: the host's relay went away (%s)", exc)

    def close(self) -> None:
        self.release_stale()
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
    hub = Hub(server, conninfo, options, _unlist)
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
