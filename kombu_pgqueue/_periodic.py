"""A step run every so often on a daemon thread of its own, until stopped: the lease
keeper's renewals (:mod:`._leases`) and the storage's rotation (:mod:`._rotation`), which
must go on while the consuming thread is busy (Celery's solo pool runs a task there).
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class Periodic:
    """Runs ``step`` every ``interval`` seconds on thread ``name`` (``at_once``: first as
    it starts, else first after an interval). ``step`` must not raise: what it raises
    ends the thread.

    Who writes what: :meth:`start` and :meth:`stop`, from the thread that owns it.
    """

    def __init__(
        self, name: str, interval: float, step: Callable[[], None], *, at_once: bool
    ) -> None:
        self.name = name
        self.interval = interval
        self._step = step
        self._at_once = at_once
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def _run(self) -> None:
        if self._at_once:
            self._step()
        while not self._stop.wait(self.interval):
            self._step()
