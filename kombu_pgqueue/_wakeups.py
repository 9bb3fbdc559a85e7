"""Wakeups: what tells a consumer which queues to claim from, and when: what its LISTEN
session's notifications (``_listener``), the safety poll and the consumer's claims say
(:class:`Wakeups`): the queues with news (``pending``), the messages handed off to this
consumer, the next due time of a delayed message, and when to poll.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable

import psycopg

from . import _pool
from ._handoffs import Replays
from ._listener import Listener, Notified
from ._options import Options
from ._relay import RELAY_POLL_FACTOR, RelayClient, supported
from .records import Handoff

logger = logging.getLogger(__name__)


class Wakeups:
    """The queues a consumer should claim from, the messages handed off to it, and the
    next due time of a delayed message: what its LISTEN session, its safety poll and
    its own claims said.

    Who writes what (all from the consumer's thread):
    - ``pending``: :meth:`news` (notifications, the poll, a new subscription or
      session, a handed-back message), :meth:`after_claim` (drained, or more to
      claim), :meth:`forget` (unsubscribed), :meth:`clear` (closed);
    - ``next_due``: :meth:`note_due` (notifications, the poll) and :meth:`due_passed`
      (the loop's due timer fired); ``new_due`` likewise, and :meth:`take_new_due`;
    - the handoffs: :meth:`read`, :meth:`wait` and the watches add, :meth:`take_handoffs`
      empties;
    - ``listener``: :meth:`open` and :meth:`close`.
    """

    def __init__(
        self,
        conninfo: str,
        options: Options,
        no_ack: Callable[[str], bool] = lambda queue: False,
    ) -> None:
        self.conninfo = conninfo
        self.options = options
        #: whether a queue is consumed without acks (the consumer's subscriptions say)
        self._no_ack = no_ack
        #: the LISTEN session, or the host's relay (transport option relay)
        self.listener: Listener | RelayClient | None = None
        #: no session can LISTEN (a pooler took it): the consumer polls (see open)
        self.unheard = False
        #: queues with news, not yet claimed from (a claim in flight leaves it here)
        self.pending: set[str] = set()
        #: the next due time of a delayed message (epoch seconds), and one noted since
        #: the loop last scheduled its timer (see :meth:`take_new_due`)
        self.next_due: float | None = None
        self.new_due: float | None = None
        self._handed: list[Handoff] = []
        self._replays = Replays()
        #: news counted, for claims in flight: queue -> the count at its latest news,
        #: and at its last claim sent (news since then: claimed again, see after_claim)
        self._count = 0
        self._news_at: dict[str, int] = {}
        self._sent_at: dict[str, int] = {}

    # -- the session ---------------------------------------------------------------------

    def open(self, consumed: Iterable[str]) -> bool:
        """Listen (LISTEN off, or no session can LISTEN: never); True if the session is
        open. A new session may have missed notifications: every queue in ``consumed``
        counts as news."""
        if not self.options.listen or self.unheard:
            return False
        if self.listener is None:
            self.listener = (
                RelayClient(self.conninfo, self.options)
                if self.relayed
                else Listener(self.conninfo, self.options, self._no_ack)
            )
        opened = self.listener.open()
        if opened is None:
            self.listener, self.unheard = None, True
            if not _pool.pooled(self.conninfo) or self.options.listen_url:
                logger.warning(
                    "pgqueue: a NOTIFY to this consumer's LISTEN session (%s) never came "
                    "back within %g s: a transaction pooler takes the LISTEN and drops "
                    "what is sent to it; polling every %g s instead (set transport option "
                    "listen_url to the server itself)",
                    "listen_url" if self.options.listen_url else "the broker URL",
                    _pool.LISTEN_PROBE_SECONDS,
                    self.poll_interval,
                )
            return False
        if opened:
            self.news(consumed)
        return True

    @property
    def relayed(self) -> bool:
        """Whether wakeups come through the host's relay (``_relay``; Linux only: elsewhere
        each consumer listens, said once)."""
        if self.options.relay and not supported() and not Wakeups._said_unsupported:
            Wakeups._said_unsupported = True
            logger.warning("pgqueue: transport option relay needs Linux; each consumer listens")
        return self.options.listen and self.options.relay and supported()

    _said_unsupported = False

    @property
    def poll_interval(self) -> float:
        """Seconds between two safety polls: ``polling_interval``; RELAY_POLL_FACTOR times
        that through the host's relay (its hub polls for all); at most POLL_WITHOUT_LISTEN
        when LISTEN was wanted but no session can (behind a transaction pooler with no
        ``listen_url``)."""
        interval = self.options.polling_interval
        if self.relayed:
            return interval * RELAY_POLL_FACTOR
        if self.unheard or (
            self.options.listen and _pool.pooled(self.conninfo) and not self.options.listen_url
        ):
            return min(interval, _pool.POLL_WITHOUT_LISTEN)
        return interval

    def use_store(self, conninfo: str) -> None:
        """Another host after a failover: the next session goes there."""
        self.conninfo = conninfo
        if self.listener is not None:
            self.listener.conninfo = conninfo

    def fileno(self) -> int | None:
        return None if self.listener is None else self.listener.fileno()

    def release_stale(self) -> None:
        """Close what the relay's client kept of a hub that went (``_relay``), once the
        event loop watches :meth:`fileno` instead."""
        if isinstance(self.listener, RelayClient):
            self.listener.release_stale()

    def watch(self, queue: str) -> None:
        """A new subscription: notified from now on (if listening), claimed from once."""
        if self.listener is not None:
            self._heard(self.listener.watch([queue]))
        self.news([queue])

    def forget(self, queue: str) -> None:
        """Unsubscribed: not watched, nothing pending."""
        if self.listener is not None:
            with contextlib.suppress(psycopg.Error):  # a lost session holds nothing
                self._heard(self.listener.unwatch([queue]))
        self.pending.discard(queue)
        self._news_at.pop(queue, None)
        self._sent_at.pop(queue, None)

    def read(self) -> float | None:
        """Take what has arrived on the session's socket; a new due time, if any."""
        if self.listener is None:
            return None
        return self._heard(self.listener.drain())

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for notifications (without a session: sleep);
        whether any came."""
        if self.listener is None:
            time.sleep(timeout)
            return False
        notified = self.listener.wait(timeout)
        self._heard(notified)
        return bool(notified)

    def close(self) -> list[Handoff]:
        """End the session; return the handoffs not delivered (to hand back)."""
        with contextlib.suppress(Exception):  # what arrived last
            self.read()
        handed, self._handed = self._handed, []
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        self.clear()
        return handed

    # -- news ----------------------------------------------------------------------------

    def news(self, queues: Iterable[str]) -> None:
        """Messages may be ready in ``queues``: claim from them (again, if a claim is in
        flight: it may have started before they were)."""
        self._count += 1
        for queue in queues:
            self.pending.add(queue)
            self._news_at[queue] = self._count

    def claim_sent(self, queue: str) -> None:
        """A claim from ``queue`` goes out now."""
        self._sent_at[queue] = self._count

    def after_claim(self, queue: str, *, more: bool, backlog: bool) -> None:
        """A claim from ``queue`` (or a handoff) was delivered. Unless it may have left
        ``more`` (a full batch, a full window, a claim of part of the queue) or news
        came while it was in flight, the queue is drained: no longer pending. Watched
        only while drained (see Listener.turn): ``backlog`` says it holds more, or
        fills the window, and keeps it pending, so that it is claimed again as the
        window opens (a handoff that filled the window made it no news: without this
        it was neither watched nor pending, and heard of nothing until the poll)."""
        if backlog:
            self.pending.add(queue)
        elif not more and self._news_at.get(queue, 0) <= self._sent_at.get(queue, 0):
            self.pending.discard(queue)
        if self.listener is not None:
            pending = queue in self.pending
            self._heard(self.listener.turn(queue, backlog=backlog, pending=pending))

    def note_due(self, due: float | None) -> float | None:
        """A delayed message falls due at ``due``; return it if it is new (sooner)."""
        if due is None or (self.next_due is not None and self.next_due <= due):
            return None
        self.next_due = self.new_due = due  # new_due: for the loop's timer
        return due

    def due_passed(self) -> None:
        """The next due time came (the poll promotes what fell due)."""
        self.next_due = None

    def take_new_due(self) -> float | None:
        """A due time noted since the loop last asked (outside a reader or a poll)."""
        due, self.new_due = self.new_due, None
        return due

    def take_handoffs(self) -> list[tuple[str, Handoff]]:
        """The messages handed off to this consumer since the last call, each with its
        queue's name ("" for a token this session never watched), replays left out."""
        now = time.time()
        handed, self._handed = self._handed, []
        tokens = self.listener.tokens if self.listener is not None else {}
        return [
            (tokens.get(handoff.token, ""), handoff)
            for handoff in handed
            if self._replays.first(handoff, now)
        ]

    @property
    def handed(self) -> bool:
        return bool(self._handed)

    def clear(self) -> None:
        self.pending.clear()
        self.next_due = self.new_due = None
        self._news_at.clear()
        self._sent_at.clear()

    def _heard(self, notified: Notified | None) -> float | None:
        if notified is None:
            return None
        self._handed.extend(notified.handoffs)
        self.news(notified.queues)
        return self.note_due(notified.due)
