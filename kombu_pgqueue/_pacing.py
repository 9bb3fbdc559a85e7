"""Pacing: how much a consumer claims from each queue, and from where.

Batching (:func:`batch_limit`): within each channel's prefetch window, but not one slot
at a time. Resuming (:class:`ResumePositions`): while a queue's head is slow to claim
from (acked rows an old snapshot keeps VACUUM from removing), claims start after the
consumer's last message instead. Both run on the consumer's clock (:class:`Clock`), the
one clock of batching, resuming, idleness and the safety poll, which tests move.

Who writes what: the consumer writes each channel's :class:`SinkState` (``claiming``
as claims go out and come back, ``last_claim`` as one goes out) and calls
:meth:`ResumePositions.note` with every claim's result; nothing else writes them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from .records import ClaimResult

#: a batch size for consumers that set no prefetch limit
UNLIMITED_BATCH = 100

#: seconds a consumer that still holds messages waits for three quarters of its window
#: to free (see batch_limit)
CLAIM_BATCH_WAIT = 0.05


class Sink(Protocol):
    """The consuming side of one Kombu channel, as the consumer sees it."""

    def room(self) -> int | None:
        """How many more messages the channel may hold now (None: no limit)."""

    def window(self) -> int:
        """Its prefetch window (0: none)."""

    def forget(self, tag: str) -> None:
        """The consumer settled ``tag`` itself (dead-lettered it): stop counting it."""


class Clock:
    """The consumer's clock: monotonic seconds, which tests move (:meth:`advance`) or
    stop (:meth:`freeze`) instead of waiting."""

    def __init__(self) -> None:
        self._ahead = 0.0
        self._frozen: float | None = None

    def __call__(self) -> float:
        return self._frozen if self._frozen is not None else time.monotonic() + self._ahead

    def advance(self, seconds: float) -> None:
        if self._frozen is not None:
            self._frozen += seconds
        self._ahead += seconds

    def freeze(self) -> None:
        """Stop the clock where it is (until :meth:`thaw`)."""
        self._frozen = self()

    def thaw(self) -> None:
        self._frozen = None


@dataclass(slots=True)
class SinkState:
    """One channel's claims as its consumer sees them."""

    claiming: int = 0  # messages that claims in flight may still bring
    last_claim: float = 0.0


def batch_limit(sink: Sink, state: SinkState, now: float) -> int:
    """How many messages ``sink`` should claim now (0: not yet), at ``now`` by the
    consumer's clock.

    Within the prefetch window, but not one slot at a time: while the channel still
    holds more than a quarter of its window (and more than one message), it waits
    (CLAIM_BATCH_WAIT at most). A quarter, not half: a prefork -c 2 worker (window
    8) then claims 6 at a time, not 4, and its main process spent 269 instead of 318
    us per no-op task (benchmarks/probes/drain_cpu.py).
    """
    room = sink.room()
    if room is None:
        return UNLIMITED_BATCH
    room -= state.claiming
    if room <= 0:
        return 0
    window = sink.window()
    holding = window - room
    recent = now - state.last_claim < CLAIM_BATCH_WAIT
    if holding > max(1, window // 4) and recent:
        return 0
    return room


def has_room(sink: Sink, state: SinkState) -> bool:
    """Whether ``sink`` may take one more message now, claims in flight counted."""
    room = sink.room()
    return room is None or room - state.claiming > 0


#: while resumed, a claim of the higher priorities than the position's (statement
#: claim_above) takes the place of one resumed claim this often, and at once again if it
#: filled its batch: a priority-9 message published meanwhile waits about this long, not
#: the whole period (up to 4 s in a 10-minute dump). It reads only the range above the
#: position, whose acked rows are the few high-priority ones, so it stays quick.
ABOVE_SECONDS = 0.25

#: the highest priority a message is stored with (codec: Kombu's 0-255)
MAX_PRIORITY = 255


class ResumePositions:
    """queue -> (priority, id, until): claims from the queue start after that message
    until then (a time of the consumer's clock); without one, from the head. And when
    each queue's next look above its position is due (see ABOVE_SECONDS).

    A claim from the head that took longer than ``slow`` seconds in the server (it
    stepped over many acked rows that VACUUM may not remove yet, e.g. while an old
    snapshot is held) makes the consumer resume after its last message for ``resume``
    seconds, or 20 times that claim's duration if longer; then it claims from the head
    again, which also picks up requeued messages, lease expiries and higher priorities
    (they wait that long at most, plus a safety poll if nothing else wakes the consumer,
    and only while the head is slow). The server's time, not the client's: an
    asynchronous claim's answer may wait in its socket while the event loop is busy,
    and that says nothing about the head. Both are transport options
    (``slow_claim_seconds``, ``resume_seconds``).
    """

    def __init__(self, slow: float, resume: float) -> None:
        self._slow = slow
        self._resume = resume
        self._at: dict[str, tuple[int, int, float]] = {}
        self._above_at: dict[str, float] = {}

    def get(self, queue: str) -> tuple[int, int, float] | None:
        return self._at.get(queue)

    def after(self, queue: str, now: float) -> tuple[int, int] | None:
        """(priority, id) to claim after now, or None: from the head."""
        at = self._at.get(queue)
        return None if at is None or now >= at[2] else at[:2]

    def above(self, queue: str, now: float) -> bool:
        """Whether the next claim from ``queue`` should read the higher priorities than
        its position's (statement claim_above) instead of resuming."""
        at = self._at.get(queue)
        return (
            at is not None
            and now < at[2]
            and at[0] < MAX_PRIORITY
            and now >= self._above_at.get(queue, 0.0)
        )

    def note(self, result: ClaimResult, now: float) -> None:
        """A claim returned: start or move the queue's position, or drop it."""
        request, rows = result.request, result.rows
        queue = request.queue
        if request.above:
            # the position stays; another look at once if more may wait above it
            full = len(rows) >= request.limit
            self._above_at[queue] = now if full else now + ABOVE_SECONDS
        elif request.after is None:
            if rows and result.took > self._slow:
                # the slower the head, the longer until the next look at it (at most
                # about 5 % of the time goes to claims from the head)
                until = now + max(self._resume, 20 * result.took)
                self._at[queue] = (rows[-1].priority, rows[-1].id, until)
                self._above_at[queue] = now + ABOVE_SECONDS  # the head was read just now
            else:
                self._at.pop(queue, None)
                self._above_at.pop(queue, None)
        elif rows:
            # resumed: the position moves on, the period it ends with stays
            until = self._at[queue][2]
            self._at[queue] = (rows[-1].priority, rows[-1].id, until)
        # A short range means this consumer caught up with the producers; it does not go
        # back to the head for the rest (that would cost a slow head walk per wakeup, as
        # often as messages arrive): requeued and older messages wait for the period.


@dataclass(frozen=True, slots=True)
class Plan:
    """How a claim from a queue goes out now: up to ``limit`` messages, from the head,
    or after ``after`` = (priority, id), or (``above``) the priorities above it."""

    limit: int
    after: tuple[int, int] | None = None
    above: bool = False


class Pacing:
    """Each channel's claims in flight and batch pacing, and where each queue's claims
    start: the consumer's one part that decides how much to claim and from where.

    Who writes what (the consumer's thread, through these methods): a channel's
    :class:`SinkState` is made by :meth:`plan` and dropped by :meth:`drop`; ``claiming``
    grows as :meth:`plan` sends a claim and shrinks in :meth:`answered` (or
    :meth:`reset`); ``last_claim`` is set by :meth:`plan`; the resume positions change
    only in :meth:`note`.
    """

    def __init__(self, clock: Clock, *, slow_claim: float, resume: float) -> None:
        self.clock = clock
        self._sinks: dict[int, SinkState] = {}
        self._resume = ResumePositions(slow_claim, resume)

    def plan(
        self,
        queue: str,
        sink: Sink,
        *,
        limit: int | None = None,
        sent: bool = False,
        above_ok: bool = True,
    ) -> Plan | None:
        """A claim from ``queue`` for ``sink`` goes out now, if its window has room (see
        :func:`batch_limit`; ``limit``: that many, whatever the window): how. ``sent``:
        without waiting for it (its messages count against the window until
        :meth:`answered`). ``above_ok``: it may read the priorities above the position
        instead of the queue's own range (not a ``basic_get``: that wants the next one)."""
        state = self._sinks.setdefault(id(sink), SinkState())
        now = self.clock()
        if limit is None:
            limit = batch_limit(sink, state, now)
            if not limit:
                return None
        state.last_claim = now
        if sent:
            state.claiming += limit
        after = self._resume.after(queue, now)
        return Plan(limit, after, above_ok and self._resume.above(queue, now))

    def limit(self, sink: Sink) -> int:
        """How many messages ``sink`` should claim now (0: not yet), nothing changed."""
        return batch_limit(sink, self._sinks.get(id(sink)) or SinkState(), self.clock())

    def answered(self, sink: Sink | None, limit: int) -> None:
        """A claim sent for ``sink`` came back: its ``limit`` no longer counts."""
        state = None if sink is None else self._sinks.get(id(sink))
        if state is not None:
            state.claiming = max(state.claiming - limit, 0)

    def note(self, result: ClaimResult) -> None:
        """A claim returned: move where the queue resumes (see ResumePositions)."""
        self._resume.note(result, self.clock())

    def has_room(self, sink: Sink) -> bool:
        """Whether ``sink`` may take one more message now, claims in flight counted."""
        return has_room(sink, self._sinks.setdefault(id(sink), SinkState()))

    def full(self, sink: Sink) -> bool:
        """Whether ``sink``'s window is full, claims in flight counted."""
        room = sink.room()
        return room is not None and room - self.claiming(sink) <= 0

    def claiming(self, sink: Sink) -> int:
        """How many messages claims in flight may still bring ``sink``."""
        state = self._sinks.get(id(sink))
        return 0 if state is None else state.claiming

    def position(self, queue: str) -> tuple[int, int, float] | None:
        return self._resume.get(queue)

    def drop(self, sink: Sink) -> None:
        """``sink`` consumes nothing now: its state goes."""
        self._sinks.pop(id(sink), None)

    def reset(self) -> None:
        """No claim is in flight any more (the claimer stopped)."""
        for state in self._sinks.values():
            state.claiming = 0

    def channels(self) -> int:
        return len(self._sinks)
