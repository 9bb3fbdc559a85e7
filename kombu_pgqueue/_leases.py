"""Lease renewal: a live consumer keeps what it holds.

A background thread, not an event-loop timer, so leases stay renewed while the
main thread is busy (Celery's solo pool runs the task in the consuming thread).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from . import _counters
from ._periodic import Periodic
from ._store import Store

logger = logging.getLogger(__name__)

Held = Callable[[], Sequence[tuple[int, int]]]


class LeaseKeeper:
    """Renews what ``held`` returns every ``interval`` seconds, on a thread of its own.

    Who writes what: ``_store`` by :meth:`use_store` (the consuming thread, on a
    failover); ``renewals`` by whichever thread renews.
    """

    def __init__(self, store: Store, held: Held, interval: float) -> None:
        self._store = store
        self.held = held
        self.renewals = 0
        self._thread = Periodic("pgqueue-lease-keeper", interval, self._round, at_once=False)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._thread.stop()

    def use_store(self, store: Store) -> None:
        """Another host after a failover: the next renewals go to its store."""
        self._store = store

    def renew_now(self) -> int:
        """Renew every held lease once; return how many were still ours."""
        held = list(self.held())
        if not held:
            return 0
        ids = [message_id for message_id, _ in held]
        leases = [lease for _, lease in held]
        kept = self._store.renew(ids, leases)
        self.renewals += len(kept)
        lost = len(held) - len(kept)
        _counters.add("renewed", amount=len(kept))
        _counters.add("lost_leases", amount=lost)
        if lost:
            # acked meanwhile, or the lease lapsed and another consumer has it
            logger.debug("pgqueue: %d of %d leases were no longer ours", lost, len(held))
        return len(kept)

    def _round(self) -> None:
        try:
            self.renew_now()
        except Exception as exc:  # the database may be down; try again next round
            logger.warning("pgqueue: lease renewal failed: %r", exc)
