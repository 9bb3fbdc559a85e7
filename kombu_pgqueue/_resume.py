"""Where a consumer's claims from each queue resume when the queue's head is slow."""

from __future__ import annotations

from .records import ClaimResult

#: a claim from the head that took longer than this in the server (it stepped over many
#: acked rows that VACUUM may not remove yet, e.g. while an old snapshot is held) makes
#: the consumer resume after its last message for RESUME_SECONDS, or 20 times that
#: claim's duration if longer; then it claims from the head again, which also picks up
#: requeued messages, lease expiries and higher priorities (they wait that long at most,
#: plus a safety poll if nothing else wakes the consumer, and only while the head is
#: slow). The server's time, not the client's: an asynchronous claim's answer may wait
#: in its socket while the event loop is busy, and that says nothing about the head.
SLOW_CLAIM_SECONDS = 0.005
RESUME_SECONDS = 1.0

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
    each queue's next look above its position is due (see ABOVE_SECONDS)."""

    def __init__(self) -> None:
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
            if rows and result.took > SLOW_CLAIM_SECONDS:
                # the slower the head, the longer until the next look at it (at most
                # about 5 % of the time goes to claims from the head)
                until = now + max(RESUME_SECONDS, 20 * result.took)
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
