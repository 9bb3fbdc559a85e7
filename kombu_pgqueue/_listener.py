"""The LISTEN session: one dedicated autocommit session per consuming transport
(:class:`Listener`), and what a batch of its notifications says (:class:`Notified`).

Publishers send ``pg_notify(<schema>.notify, payload)`` in the statement that makes
rows visible. Payloads are ``r:<token>`` (messages are ready in the queue of that
token: a random one per queue, column ``queue.token``, which the watch statement
returns), ``d:<epoch>`` (a delayed message falls due then), or
``h:<consumer>:<signature>:...`` (a message the publish leased to that consumer: a
handoff, see :func:`~._handoffs.parse_handoff`). Any role that may connect can LISTEN
on the channel, or NOTIFY on it, so no payload names a queue or holds a message: a
handoff's message is sealed with the schema's key (table ``handoff_key``), and signed
for its consumer with a secret of that consumer's (table ``listener``); only roles
granted the broker's tables may read either. A wakeup that was not a publisher's only
costs a claim that finds nothing.

Each session registers as a *waiter* (table ``listener``, migration 0010) of the queues
it watches and may take handed-off messages from, under a new consumer id per session,
and holds a lock that marks it alive while it lasts.

Publishers notify only queues that somebody waits for: the listening session *watches*
the queues its consumer consumes (advisory locks, see the top of ``sql/queries.sql``), so
a publish to a queue nobody consumes sends no NOTIFY, whose commit signals every
listening session of the database. A queue is watched only while it is drained
(:meth:`Listener.turn`).

An event loop's claims share the session (:meth:`Listener.share`, ``_claimer``); behind
a transaction pooler it connects to transport option ``listen_url``, or there is none
(``_pool.listening``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import select
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import psycopg
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from psycopg import sql

from . import _pool, _sql
from ._handoffs import parse_handoff
from ._options import Options
from .records import Handoff

logger = logging.getLogger(__name__)

#: how long watching a queue waits for publishes in flight (each holds its lock until
#: its commit); past that, one that did not see the consumer is found by the safety poll
BARRIER_TIMEOUT_MS = 2000


def legacy_token(queue: str) -> str:
    """How publishers before migration 0010 name ``queue`` in their wakeups,
    ``left(md5(convert_to(queue, 'UTF8')), 16)``: recognised during a rolling upgrade
    (never sent), until the migration that drops table waiter."""
    return hashlib.md5(queue.encode("utf-8"), usedforsecurity=False).hexdigest()[:16]


@dataclass(slots=True)
class Notified:
    """What a batch of notifications said: watched queues with news, a due time, and
    messages handed off to this consumer."""

    #: token -> name of the queues watched
    tokens: dict[str, str]
    queues: set[str] = field(default_factory=set)
    due: float | None = None
    #: this session's consumer id (handoffs addressed to it are ours, if signed with
    #: its secret and sealed with the schema's key)
    consumer: str = ""
    secret: str = ""
    box: AESGCM | None = None
    handoffs: list[Handoff] = field(default_factory=list)

    def add(self, payload: str) -> None:
        kind, _, rest = payload.partition(":")
        if kind == "h":
            consumer, _, rest = rest.partition(":")
            if consumer and consumer == self.consumer:
                handoff = parse_handoff(rest, self.secret, self.box)
                if handoff is not None:
                    self.handoffs.append(handoff)
                else:
                    logger.warning(
                        "pgqueue: ignoring a handoff that is malformed, not signed with "
                        "this consumer's secret or not sealed with the schema's key: %.40r",
                        payload,
                    )
        elif kind == "r":
            if rest in self.tokens:
                self.queues.add(self.tokens[rest])
        elif kind == "d":
            try:
                when = float(rest)
            except ValueError:
                return
            self.due = when if self.due is None else min(self.due, when)

    def __bool__(self) -> bool:
        return bool(self.queues) or self.due is not None or bool(self.handoffs)

    def merge(self, other: Notified) -> None:
        self.queues.update(other.queues)
        self.handoffs.extend(other.handoffs)
        if other.due is not None:
            self.due = other.due if self.due is None else min(self.due, other.due)


class Listener:
    """The LISTEN session (one per consuming transport; a new one after a fork or a
    lost connection)."""

    def __init__(
        self,
        conninfo: str,
        options: Options,
        no_ack: Callable[[str], bool] = lambda queue: False,
    ) -> None:
        self.conninfo = conninfo
        self.options = options
        #: whether a queue is consumed without acks: no handoffs (a take deletes what it
        #: hands out); the consumer's subscriptions say
        self.no_ack = no_ack
        self.conn: psycopg.Connection | None = None
        self._pid = os.getpid()
        self._q = _sql.queries(options.schema)
        #: the queues this session watches (holds the waiting lock of) -> their tokens
        self.watched: dict[str, str] = {}
        #: token (and legacy token) -> queue, of every queue this session watched (a
        #: handoff may arrive after its queue was unwatched)
        self.tokens: dict[str, str] = {}
        #: this session's id as a waiter, and the secret that signs its handoffs (new
        #: ones per session); the schema's key, which opens them (None: not readable)
        self.consumer = ""
        self.secret = ""
        self.box: AESGCM | None = None
        #: what must happen before a statement of this session's: the claimer's claim
        #: in flight answered, when the claimer shares the session (see :meth:`share`)
        self.before_statement: Callable[[], None] | None = None
        #: payloads psycopg received during this session's statements, while shared
        self._received: list[str] = []

    def _free(self) -> None:
        if self.before_statement is not None:
            self.before_statement()

    def share(self, before_statement: Callable[[], None]) -> None:
        """The claimer sends its claims on this session from now on (an event loop's
        consumer, ``_claimer``). Its reads, on the loop's readable event, are the only
        reads of the socket: :meth:`wait` takes what they and this session's own
        statements took in, and never reads the socket itself, which would take in a
        claim's answer that the loop then never hears of."""
        assert self.conn is not None
        self.before_statement = before_statement
        self.conn.add_notify_handler(self._note)

    def unshare(self) -> None:
        self.before_statement = None
        if self.conn is not None:
            self.conn.remove_notify_handler(self._note)

    def _note(self, notify: psycopg.Notify) -> None:
        self._received.append(notify.payload)

    def open(self) -> bool | None:
        """Connect if not connected; True if this opened a new session (which watches
        what the last one did: notifications may have been missed in between), None if
        no session can LISTEN here (``_pool.listening``)."""
        if self.conn is not None and not self.conn.closed and self._pid == os.getpid():
            return False
        # (after a fork the parent's session is not ours to use, nor to close)
        self.conn = _pool.listening(self.conninfo, self.options, probe=self.conninfo)
        if self.conn is None:
            return None
        self._pid = os.getpid()
        queues, self.watched, self.tokens = self.watched, {}, {}
        try:
            self.conn.execute(
                sql.SQL("SET lock_timeout = {}").format(sql.Literal(BARRIER_TIMEOUT_MS))
            )
            consumer = secrets.token_hex(8)
            self.conn.execute(self._q["listener_alive"], {"consumer": consumer})
            self.consumer, self.secret = consumer, secrets.token_hex(16)
            self.box = self._open_box() if self.options.handoff else None
            self.watch(queues)
        except BaseException:  # the next open() tries again, and watches them all
            self.watched.update(queues)
            self.close()
            raise
        return True

    def _open_box(self) -> AESGCM | None:
        """The schema's handoff key, on this session; None (no handoffs, said in the
        log) for a role that may not read it."""
        assert self.conn is not None
        try:
            row = self.conn.execute(self._q["handoff_key"]).fetchone()
        except psycopg.errors.InsufficientPrivilege as exc:
            logger.warning(
                "pgqueue: this consumer takes no handoffs: its role may not read table "
                "%s.handoff_key (%s); grant it as docs/operations.md says",
                self.options.schema,
                exc.diag.message_primary,
            )
            return None
        return None if row is None else AESGCM(bytes(row[0]))

    def watch(self, queues: Iterable[str]) -> Notified:
        """From now on, publishes to ``queues`` notify; those that looked before have
        committed when this returns (or, if they take longer than BARRIER_TIMEOUT_MS,
        the safety poll finds them). Returns what was notified meanwhile, and the
        queues newly watched as if notified: claim from them once more."""
        new = sorted(set(queues) - set(self.watched))
        if not new or self.conn is None:
            return Notified(self.tokens)
        self._free()
        params = {"channel": self.options.channel, "queues": new}
        takes = [q for q in new if not self.no_ack(q)] if self.box is not None else []
        waiter = {"takes": takes, "consumer": self.consumer, "secret": self.secret}
        lease = {"lease_seconds": self.options.visibility_timeout}
        rows = self.conn.execute(self._q["watch"], {**params, **waiter, **lease}).fetchall()
        for queue, token, _ in rows:
            self.watched[queue] = token
            self.tokens[legacy_token(queue)] = queue
            if token:
                self.tokens[token] = queue
        try:
            self.conn.execute(self._q["watch_barrier"], params)
        except (psycopg.errors.LockNotAvailable, psycopg.errors.DeadlockDetected) as exc:
            logger.debug("pgqueue: watching %s without waiting for publishes: %s", new, exc)
        woken = self.drain()
        woken.queues.update(new)
        return woken

    def turn(self, queue: str, *, backlog: bool, pending: bool) -> Notified | None:
        """A claim from ``queue`` came back: watch it only while it is not known to
        hold more. A full batch (``backlog``) leaves it pending, claimed again without
        a NOTIFY, so publishes to it need not send one (each notifying commit signals
        every listening session of the database and keeps publishers' commits from
        sharing a WAL flush). Once drained (not ``pending``), it is watched again.
        Returns what the statements' results brought along (see :meth:`watch`), or
        None when nothing changed."""
        watched = queue in self.watched
        if backlog:
            return self.unwatch([queue]) if watched else None
        return None if pending or watched else self.watch([queue])

    def unwatch(self, queues: Iterable[str]) -> Notified:
        """Publishes to ``queues`` need not notify for this consumer any more. Returns
        what was notified meanwhile (the socket's readiness went to the statement)."""
        gone = sorted(set(self.watched).intersection(queues))
        for queue in gone:
            del self.watched[queue]
        if not gone or self.conn is None or self.conn.closed:
            return Notified(self.tokens)
        params = {"channel": self.options.channel, "queues": gone, "consumer": self.consumer}
        self._free()
        self.conn.execute(self._q["unwatch"], params)
        return self.drain()

    def fileno(self) -> int:
        assert self.conn is not None
        return self.conn.fileno()

    def wait(self, timeout: float | None) -> Notified:
        """Block up to ``timeout`` seconds for notifications; return all that came."""
        assert self.conn is not None
        found = Notified(self.tokens, consumer=self.consumer, secret=self.secret, box=self.box)
        if self.before_statement is not None:  # shared with the claimer (see share)
            if timeout and not self._taken_in(found):
                select.select([self.conn.fileno()], [], [], timeout)
                self.conn.pgconn.consume_input()
            self._taken_in(found)
            return found
        for notify in self.conn.notifies(timeout=timeout, stop_after=1):
            found.add(notify.payload)
        if found:
            for notify in self.conn.notifies(timeout=0):
                found.add(notify.payload)
        return found

    def drain(self) -> Notified:
        """Read what has arrived without blocking."""
        return self.wait(0)

    def _taken_in(self, found: Notified) -> bool:
        """Add to ``found`` the notifications already read from the socket: those the
        claimer's reads left in libpq's queue, and those psycopg received during this
        session's statements. Whether there were any."""
        assert self.conn is not None
        pgconn, encoding = self.conn.pgconn, self.conn.info.encoding
        any_ = bool(self._received)
        for payload in self._received:
            found.add(payload)
        self._received.clear()
        while (queued := pgconn.notifies()) is not None:
            found.add(queued.extra.decode(encoding))
            any_ = True
        return any_

    def close(self) -> None:
        if self.conn is not None and not self.conn.closed and self._pid == os.getpid():
            # stop being picked (a gone session's rows are removed by the next watch)
            with contextlib.suppress(psycopg.Error):
                self._free()
                queues = list(self.watched)
                params = {"channel": self.options.channel, "consumer": self.consumer}
                self.conn.execute(self._q["unwatch"], {**params, "queues": queues})
        conn, self.conn = self.conn, None
        if conn is not None and not conn.closed:
            try:
                conn.close()
            except psycopg.Error:
                pass
