"""The Settler: the deliveries a consumer holds, and how each is settled (ack, reject,
release, dead letter), renewed and told apart when an atomic task's transaction acks it.

Typed deliveries in (a tag, or (id, lease)), SQL out, through three parts:
- the ledger, one object with a lock, shared by the thread that delivers (and acks),
  the lease keeper's thread (:mod:`._leases`), which renews everything held, and
  close, which releases it. Kombu's own QoS keeps its unacked messages in a dict that
  only the consuming thread may touch; nothing here reads it;
- the ack batchers (:mod:`._acks`): one for ordinary acks, one for atomic tasks';
- the atomic tags (:class:`AtomicTags`): the deliveries of atomic tasks
  (:mod:`kombu_pgqueue.atomic`) are acked by the task's own transaction when it
  commits; the worker's ack that follows finds the row gone. Those acks go to a
  batcher of their own that does not call that late, and one that the task's process
  says it committed (threads and solo pools) sends nothing at all.

Who writes what: :class:`Settler`'s fields are written by the consumer's thread
(``closed`` by :meth:`Settler.close` and :meth:`Settler.reopen` as the transport
closes and reopens, ``store`` on a failover); the ledger's dict only under its lock;
:data:`ATOMIC_TAGS` by the consumer's thread (expect, take, forget) and by a task's
thread in the same process (committed).
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Iterable
from typing import Literal, Protocol

from . import _counters, codec
from ._acks import AckBatcher
from ._leases import LeaseKeeper
from ._options import Options
from ._store import Store
from .records import Delivery

logger = logging.getLogger(__name__)


class Forgets(Protocol):
    """A channel, told that the settler settled one of its deliveries itself."""

    def forget(self, tag: str) -> None: ...


class AtomicTags:
    """The delivery tags of atomic tasks this process consumes, and those its tasks
    committed (:mod:`kombu_pgqueue.atomic` tells it; the settler asks it at each ack)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._expected: set[str] = set()
        self._committed: set[str] = set()

    def expect(self, tag: str) -> None:
        """The delivery ``tag`` goes to an atomic task: its ack may find the row gone."""
        with self._lock:
            self._expected.add(tag)

    def committed(self, tag: str) -> None:
        """A task of this process committed the ack of ``tag``; a pool child of another
        process (prefork) says nothing: its parent never expected the tag here."""
        if tag not in self._expected:  # a pool child's: without the lock
            return
        with self._lock:
            if tag in self._expected:
                self._committed.add(tag)

    def take(self, tag: str) -> Literal["committed", "atomic"] | None:
        """What the consumer's ack of ``tag`` has to do: nothing ("committed"), delete
        the row if it is still there ("atomic"), or ack as usual (None)."""
        if tag not in self._expected:  # the common case, without the lock
            return None
        with self._lock:
            self._expected.discard(tag)
            if tag in self._committed:
                self._committed.discard(tag)
                return "committed"
        return "atomic"

    def forget(self, tag: str) -> None:
        """``tag`` was settled otherwise (rejected, released, restored)."""
        if tag in self._expected:
            with self._lock:
                self._expected.discard(tag)
                self._committed.discard(tag)


#: the one registry of the process: a task's thread tells it by tag alone
ATOMIC_TAGS = AtomicTags()


class Ledger:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, tuple[int, int]] = {}

    def hold(self, tag: str) -> None:
        message_id, lease = codec.parse_tag(tag)
        if lease:  # taken without ack: nothing to renew or settle
            with self._lock:
                self._held[tag] = (message_id, lease)

    def settle(self, tag: str) -> tuple[int, int]:
        """Stop holding ``tag``; return its (id, lease)."""
        held = self.settle_held(tag)
        return held if held is not None else codec.parse_tag(tag)

    def settle_held(self, tag: str) -> tuple[int, int] | None:
        """Stop holding ``tag``; its (id, lease) if it was held, else None."""
        with self._lock:
            held = self._held.pop(tag, None)
        ATOMIC_TAGS.forget(tag)
        return held

    def settle_all(self, tags: Iterable[str]) -> list[tuple[int, int]]:
        """Stop holding ``tags``; return the (id, lease) of those with a lease."""
        settled = [self.settle(tag) for tag in tags]
        return [(message_id, lease) for message_id, lease in settled if lease]

    def holds(self, tag: str) -> bool:
        with self._lock:
            return tag in self._held

    def __len__(self) -> int:
        return len(self._held)

    def held(self) -> list[tuple[int, int]]:
        """(id, lease) of everything held now (any thread)."""
        with self._lock:
            return list(self._held.values())


class AtomicAcks(AckBatcher):
    """Acks of atomic tasks' deliveries, batched apart from the others: most find their
    row deleted by the task's own commit, which is no late ack. One that finds a row
    still there (the task failed and rolled back, and Celery acks a failure) deletes it."""

    def report(self, done: int, sent: int) -> None:
        logger.debug("pgqueue: %d of %d acks of atomic tasks deleted a row", done, sent)


def _handled() -> str | None:
    """The exception this thread is handling now, if any, as "Type: message"."""
    exc = sys.exc_info()[1]
    return None if exc is None else f"{type(exc).__name__}: {exc}"


class Settler:
    """What one consumer holds unacked, with its lease keeper and ack batchers."""

    def __init__(self, store: Store, options: Options) -> None:
        self.store = store
        self._ledger = Ledger()
        self.settle = self._ledger.settle
        self.settle_all = self._ledger.settle_all
        self._keeper = LeaseKeeper(store, self._ledger.held, options.renewal_interval)
        self.acks: AckBatcher | None = AckBatcher(store) if options.batch_acks else None
        #: the acks of atomic tasks' deliveries
        self.atomic_acks: AckBatcher | None = AtomicAcks(store) if options.batch_acks else None
        #: after close: acks go straight to the store
        self.closed = False
        #: tag -> why its body could not be decoded: its ack dead-letters it instead
        self._undecodable: dict[str, str] = {}

    def reopen(self) -> None:
        """The transport connected again (after a close): ack in batches again."""
        self.closed = False

    def use_store(self, store: Store) -> None:
        self.store = store
        self._keeper.use_store(store)
        for batcher in (self.acks, self.atomic_acks):
            if batcher is not None:
                batcher.use_store(store)

    def keep_leases(self) -> None:
        self._keeper.start()

    def hold(self, tag: str) -> None:
        """A delivery reached its channel unacked (Kombu's QoS.append); the lease keeper
        runs from the first subscription or basic_get on (keep_leases)."""
        self._ledger.hold(tag)

    def undecodable(self, tag: str, error: BaseException) -> None:
        """The body of ``tag`` could not be decoded: when its consumer acks it to be rid
        of it (Celery does), it goes to the dead letters, where a person can see it."""
        if self._ledger.holds(tag):
            self._undecodable[tag] = f"{type(error).__name__}: {error}"

    def ack(self, tag: str) -> None:
        error = self._undecodable.pop(tag, None)
        if error is not None:
            self.bury(tag, "undecodable", error)
            return
        kind = ATOMIC_TAGS.take(tag)
        message_id, lease = self.settle(tag)
        _counters.add("acked")
        if kind == "committed":
            return  # the task's transaction deleted the row
        acks = self.acks if kind is None else self.atomic_acks
        if acks is not None and not self.closed:
            acks.add(message_id, lease)
            return
        # closed by a reconnect (the database restarted), but a task that finishes
        # afterwards still acks: send it directly, and if the database cannot take it,
        # the lease runs out and the message runs again (at-least-once), no crash
        try:
            done = self.store.ack(message_id, lease)
        except Exception as exc:
            logger.warning(
                "pgqueue: ack of message %s failed (%r); it runs again when its lease ends",
                message_id,
                exc,
            )
            return
        if not done and kind is None:
            logger.warning(
                "pgqueue: ack of message %s came after its lease ended; it may run again",
                message_id,
            )

    def bury(self, tag: str, reason: str, error: str) -> bool:
        """Move ``tag`` to the dead letters with ``reason`` and ``error``; False when it
        was not held (settled already, or taken without ack: then it is gone)."""
        self._undecodable.pop(tag, None)
        held = self._ledger.settle_held(tag)
        if held is None:
            return False
        _counters.add("rejected")
        return self.store.bury(*held, reason, error)

    def poisoned(self, delivery: Delivery, exc: Exception, sink: Forgets | None) -> None:
        """The consumer's callback raised ``exc`` on this delivery: dead-letter it
        (reason consumer_error, with the exception's text), log an error naming it, and
        tell ``sink`` (the channel) to stop counting it."""
        tag = codec.delivery_tag(delivery.row.id, delivery.lease)
        try:
            self._poisoned(delivery.queue, tag, exc)
        finally:
            if sink is not None:
                sink.forget(tag)

    def _poisoned(self, queue: str, tag: str, exc: Exception) -> None:
        message_id, _ = codec.parse_tag(tag)
        error = f"{type(exc).__name__}: {exc}"
        try:
            buried = self.bury(tag, "consumer_error", error)
        except Exception as lost:
            logger.error(
                "pgqueue: the consumer's callback raised on message %s of queue %r (%s); "
                "moving it to the dead letters failed (%r): it is delivered again when "
                "its lease ends",
                message_id,
                queue,
                error,
                lost,
                exc_info=exc,
            )
            return
        logger.error(
            "pgqueue: the consumer's callback raised on message %s of queue %r; %s: %s",
            message_id,
            queue,
            f"moved to the dead letters (celery pgqueue dead show {message_id})"
            if buried
            else "it was acked already or taken without ack, so it is gone",
            error,
            exc_info=exc,
        )

    def reject(self, tag: str, requeue: bool) -> None:
        """Requeue ``tag``, or move it to the dead letters (reason rejected). A reject
        made while an exception is handled, in an ``except`` block (Celery rejects a task
        it does not know inside its ``except KeyError``), keeps that exception as the
        letter's error: otherwise nothing would say why."""
        self._undecodable.pop(tag, None)
        message_id, lease = self.settle(tag)
        if requeue:
            self.store.requeue(message_id, lease)
            _counters.add("requeued")
        else:
            self.store.bury(message_id, lease, "rejected", _handled())
            _counters.add("rejected")

    def restore(self, tags: Iterable[str]) -> None:
        """Hand back held deliveries at once: they are delivered again immediately. They
        reached the callback, so this delivery still counts against max_attempts."""
        self.flush_acks()
        tags = list(tags)
        for tag in tags:
            self._undecodable.pop(tag, None)
        self.release(self.settle_all(tags), uncount=False)

    def release_deliveries(self, deliveries: Iterable[Delivery]) -> None:
        """Hand back claimed messages that no callback saw (no-ack ones are gone)."""
        tags = [codec.delivery_tag(d.row.id, d.lease) for d in deliveries]
        self.release(self.settle_all(tags))

    def holding(self) -> int:
        """How many deliveries are held unacked (any thread)."""
        return len(self._ledger)

    def release(self, held: list[tuple[int, int]], *, uncount: bool = True) -> None:
        """Hand back ``held`` (id, lease) pairs; ``uncount``: they never reached a
        callback, so this delivery does not count against max_attempts."""
        if not held:
            return
        try:
            ids, leases = [i for i, _ in held], [lease for _, lease in held]
            self.store.release(ids, leases, uncount=uncount)
        except Exception as exc:  # best effort: the leases lapse by themselves
            logger.warning(
                "pgqueue: could not release %d messages (%r); they return when their leases end",
                len(held),
                exc,
            )

    def flush_acks(self) -> None:
        """Send pending acks now, so what is read next reflects them."""
        for batcher in (self.acks, self.atomic_acks):
            if batcher is not None:
                batcher.flush()

    def close(self) -> None:
        self.closed = True
        for batcher in (self.acks, self.atomic_acks):
            if batcher is not None:
                batcher.stop()
        self._keeper.stop()
