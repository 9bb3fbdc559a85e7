"""How a consumer is driven: by an event loop (Celery's worker), or by blocking drains.

In an event loop, the LISTEN socket, which the claimer's claims share (one session; a
claimer of its own when LISTEN is off), is a reader of the loop; the loop's tick
callback claims what is pending; timers run the safety poll, wake the
consumer when a delayed message falls due, and retry a claim put off to fill a batch.
Outside one (``Connection.drain_events``), :func:`drain` waits on the LISTEN socket.
"""

from __future__ import annotations

import time
from typing import Any

from ._consumer import Consumer
from ._pacing import CLAIM_BATCH_WAIT


def drain(consumer: Consumer, timeout: float | None) -> None:
    """Deliver at least one message, or raise TimeoutError after ``timeout``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    if consumer.consuming:
        consumer.listen()
    while True:
        if consumer.poll_in <= 0 and consumer.consuming:
            consumer.poll()
        if consumer.deliver_pending(inline=True):
            return
        waits = [consumer.poll_in]
        if deadline is not None:
            if time.monotonic() >= deadline:
                raise TimeoutError()
            waits.append(deadline - time.monotonic())
        due = consumer.due_in
        if due is not None:
            if due <= 0:
                consumer.due_passed()
                consumer.poll_soon()
                continue
            waits.append(due)
        if consumer.has_news:
            waits.append(CLAIM_BATCH_WAIT)
        consumer.wait_news(max(min(waits), 0.0))


def _cancel(timer: Any) -> None:
    if timer is not None:
        try:
            timer.cancel()
        except Exception:  # noqa: S110 - a timer the loop already dropped
            pass


def _remove_reader(loop: Any, fd: int | None) -> None:
    if fd is not None:
        try:
            loop.remove_reader(fd)
        except (KeyError, OSError, ValueError):
            pass


class LoopDriver:
    """Drives one consumer from one event loop (kombu.asynchronous.Hub) until stopped."""

    def __init__(self, consumer: Consumer, loop: Any) -> None:
        self.consumer = consumer
        self.loop = loop
        self._listen_fd: int | None = None
        self._claim_fd: int | None = None
        self._timers: list[Any] = []
        self._due_timer: Any = None
        self._retry_timer: Any = None
        self._retry_armed = False

    def start(self) -> None:
        consumer, loop = self.consumer, self.loop
        self._listen_fd = consumer.listening()
        if self._listen_fd is not None:
            loop.add_reader(self._listen_fd, self._on_notified, self._listen_fd)
        if consumer.claims_apart:
            self._claim_fd = consumer.start_claimer()
            if self._claim_fd == self._listen_fd:  # one session: one reader for both
                loop.add_reader(self._claim_fd, self._on_readable, self._claim_fd)
            else:
                loop.add_reader(self._claim_fd, self._on_claimed, self._claim_fd)
        loop.on_tick.add(self._on_tick)
        self._timers.append(loop.call_repeatedly(consumer.poll_interval, self._poll))
        consumer.poll_soon()

    def stop(self) -> None:
        loop = self.loop
        _remove_reader(loop, self._listen_fd)
        if self._claim_fd != self._listen_fd:
            _remove_reader(loop, self._claim_fd)
        self._listen_fd = self._claim_fd = None
        self.consumer.stop_claimer()
        loop.on_tick.discard(self._on_tick)
        for timer in (*self._timers, self._due_timer, self._retry_timer):
            _cancel(timer)
        self._timers.clear()
        self._due_timer = self._retry_timer = None
        self.consumer.due_passed()
        self._retry_armed = False

    # -- what the loop calls ---------------------------------------------------------------

    def _on_notified(self, fileno: int) -> None:
        self._schedule_due(self.consumer.read_news())
        self._follow_socket()
        self._deliver()

    def _follow_socket(self) -> None:
        """Through the host's relay, news comes on another socket once its hub went:
        watch that one, then let the old one close."""
        fd = self.consumer.news_socket()
        if fd != self._listen_fd and self._claim_fd != self._listen_fd:
            _remove_reader(self.loop, self._listen_fd)
            self._listen_fd = fd
            if fd is not None:
                self.loop.add_reader(fd, self._on_notified, fd)
        self.consumer.release_stale()

    def _on_claimed(self, fileno: int) -> None:
        self.consumer.on_claimed()
        self._arm_retry()

    def _on_readable(self, fileno: int) -> None:
        """The shared session's socket: a claim's answer, notifications, or both. The
        claimer's read is the only read of the socket; the listener then takes the
        notifications it took in (``_listener.Listener.share``)."""
        self._on_claimed(fileno)
        self._on_notified(fileno)

    def _on_tick(self) -> None:
        consumer = self.consumer
        if consumer.claimer is not None and consumer.claimer.answered:
            # answered while the listener's statements waited for it
            self._on_readable(consumer.claimer.fileno())
        due = consumer.take_new_due()  # noted outside a reader or a poll (a watch)
        if due is not None:
            self._schedule_due(due)
        if consumer.poll_asked and consumer.consuming:
            self._poll()
        if consumer.has_news:
            self._deliver(in_tick=True)

    def _on_due(self) -> None:
        self.consumer.due_passed()
        self._poll()
        self._deliver()

    def _on_retry(self) -> None:
        self._retry_armed = False
        if self.consumer.has_news:
            self._deliver()

    # -- helpers -------------------------------------------------------------------------------

    def _poll(self) -> None:
        self._schedule_due(self.consumer.poll())

    def _deliver(self, in_tick: bool = False) -> None:
        self.consumer.deliver_pending(in_tick=in_tick)
        self._arm_retry()

    def _arm_retry(self) -> None:
        if self.consumer.has_news and not self._retry_armed:
            # a claim put off for batching must still happen soon
            self._retry_armed = True
            self._retry_timer = self.loop.call_later(CLAIM_BATCH_WAIT, self._on_retry)

    def _schedule_due(self, due_in: float | None) -> None:
        """Wake the consumer when a delayed message falls due, ``due_in`` seconds from
        now (None: no new due time)."""
        self.consumer.take_new_due()
        if due_in is None:
            return
        delay = max(due_in, 0.0) + 0.001
        _cancel(self._due_timer)
        self._due_timer = self.loop.call_later(delay, self._on_due)
