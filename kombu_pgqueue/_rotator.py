"""The storage's rotation, on a thread of its own while a consumer consumes.

A step of the rotation (:meth:`._store.Store.rotate`) is four statements or more, and
under a ``pg_dump`` each of its lock attempts may wait out its 20 ms ``lock_timeout``;
on the consuming thread it held up the first delivery of every consumer that started
(about 8 ms on this project's machine) and stalled a worker's event loop once every
``rotate_interval`` while a reader held a generation. Here it runs beside them: the
rotation takes an advisory lock, so the threads of several consumers, in one process or
many, take turns and never do the same step twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import psycopg

from ._periodic import Periodic
from ._store import Store
from .exceptions import PgQueueError

logger = logging.getLogger(__name__)


class Rotator:
    """Runs ``store().rotate()`` at once when started, then every ``interval`` seconds,
    until stopped. ``store`` is a callable: after a failover the consumer's store is
    another one (:meth:`._consumer.Consumer.use_store`).

    Who writes what: :meth:`start` and :meth:`stop` (the consuming thread) the thread;
    the rotation thread the kinds of failure logged.
    """

    def __init__(self, store: Callable[[], Store], interval: float) -> None:
        self._store = store
        self._failures: set[str] = set()
        self._thread = Periodic("pgqueue-rotator", interval, self.step, at_once=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._thread.stop()

    def step(self) -> None:
        """One step. It must never stop a worker: a failure (a role without the grant on
        function rotate, a statement timeout, the database away) is logged once per
        kind, with its traceback when it is not the database's, and the next step tries
        again."""
        try:
            self._store().rotate()
        except Exception as exc:  # noqa: BLE001 - the thread must outlive any failure
            kind = type(exc).__name__
            if kind not in self._failures:
                self._failures.add(kind)
                logger.warning(
                    "pgqueue: the storage's rotation failed (%s: %s); messages are safe, "
                    "but a snapshot held meanwhile keeps space until it succeeds. "
                    "docs/operations.md, 'Vacuum and bloat', says what it needs",
                    kind,
                    exc,
                    exc_info=not isinstance(exc, (psycopg.Error, PgQueueError)),
                )
