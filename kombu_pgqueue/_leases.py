"""Lease renewal: a live consumer keeps what it holds.

A background thread, not an event-loop timer, so leases stay renewed while the
main thread is busy (Celery's solo pool runs the task in the consuming thread).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from . import _counters
from ._store import Store

logger = logging.getLogger(__name__)

Held = Callable[[], Sequence[tuple[int, int]]]


class LeaseKeeper:
    def __init__(self, store: Store, held: Held, interval: float) -> None:
        self.store = store
        self.held = held
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.renewals = 0

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="pgqueue-lease-keeper", daemon=True)
        self._thread.start()

    def renew_now(self) -> int:
        """Renew every held lease once; return how many were still ours."""
        held = list(self.held())
        if not held:
            return 0
        ids = [message_id for message_id, _ in held]
        leases = [lease for _, lease in held]
        kept = self.store.renew(ids, leases)
        self.renewals += len(kept)
        lost = len(held) - len(kept)
        _counters.add("renewed", amount=len(kept))
        _counters.add("lost_leases", amount=lost)
        if lost:
            # acked meanwhile, or the lease lapsed and another consumer has it
            logger.debug("pgqueue: %d of %d leases were no longer ours", lost, len(held))
        return len(kept)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.renew_now()
            except Exception as exc:  # the database may be down; try again next round
                logger.warning("pgqueue: lease renewal failed: %r", exc)

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
