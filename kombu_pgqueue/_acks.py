"""Acks in batches: one fenced DELETE for every ack that arrived meanwhile.

An AMQP ack is asynchronous too: ``basic.ack`` is sent and not confirmed. Here a
background thread deletes whatever was acked since its last statement, so while one
commit waits on the disk the next batch gathers (a group commit that sizes itself).
A process that dies right after ``ack()`` leaves the message leased: it is delivered
again when the lease ends, which at-least-once allows. The same transport flushes
pending acks before it sizes or purges, so those read its own acks; a claim need not
wait, since an acked message keeps its lease until it is deleted.
"""

from __future__ import annotations

import logging
import os
import threading

import psycopg

from ._store import Store

logger = logging.getLogger(__name__)

#: how long the ack thread lets acks gather after the first one arrives
GATHER_SECONDS = 0.005


class AckBatcher:
    """Acks gathered by any thread and deleted in batches by the batcher's own.

    Who writes what: ``_store`` by :meth:`use_store` (the consuming thread, on a
    failover); the pending ids and leases under ``_lock``; the thread by :meth:`add`,
    :meth:`stop` and after a fork.
    """

    def __init__(self, store: Store) -> None:
        self._store = store
        self._lock = threading.Lock()
        #: held while a batch is on its way: one flush at a time
        self._flushing = threading.Lock()
        self._ids: list[int] = []
        self._leases: list[int] = []
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def use_store(self, store: Store) -> None:
        """Another host after a failover: the next batches go to its store."""
        self._store = store

    def add(self, message_id: int, lease: int) -> None:
        if self._pid != os.getpid():
            self._forked()
        with self._lock:
            self._ids.append(message_id)
            self._leases.append(lease)
        self._wake.set()
        if self._thread is None:
            self._start()

    def _forked(self) -> None:
        """In a forked process: the parent's thread is not here, and its locks may have
        been held at the fork (a batch on its way)."""
        self._pid = os.getpid()
        self._lock, self._flushing = threading.Lock(), threading.Lock()
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread = None

    def _start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="pgqueue-acks", daemon=True)
        self._thread.start()

    def flush(self) -> int:
        """Delete every pending ack now; return how many rows were deleted. A flush in
        flight (the batcher's own, taken a moment earlier) is waited for: when this
        returns, every ack added before is in the database."""
        if self._pid != os.getpid():
            self._forked()
        with self._flushing:
            return self._flush()

    def _flush(self) -> int:
        with self._lock:
            if not self._ids:
                return 0
            ids, leases = self._ids, self._leases
            self._ids, self._leases = [], []
        try:
            done = self._store.ack_many(ids, leases)
        except psycopg.OperationalError:
            # a pooled connection the server closed (a restart): drop the dead ones and
            # try once more, so these acks are not lost to a redelivery
            self._store.check_pool()
            done = self._store.ack_many(ids, leases)
        self.report(done, len(ids))
        return done

    def report(self, done: int, sent: int) -> None:
        """``done`` of ``sent`` acks deleted their row: the rest came too late."""
        if done < sent:
            logger.warning(
                "pgqueue: %d of %d acks came after their lease ended; those messages may run again",
                sent - done,
                sent,
            )

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait()
            # a moment for the acks of the tasks finishing alongside to join this batch:
            # fewer, larger DELETEs (the lease keeps an acked message out of claims)
            self._stop.wait(GATHER_SECONDS)
            self._wake.clear()
            try:
                self.flush()
            except Exception as exc:  # database away: the leases will lapse and redeliver
                logger.warning("pgqueue: sending acks failed (%r); they will be redelivered", exc)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        try:
            self.flush()
        except Exception as exc:
            logger.warning("pgqueue: final acks failed (%r); they will be redelivered", exc)
