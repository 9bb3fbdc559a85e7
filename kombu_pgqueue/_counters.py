"""Process-wide event counters, read by monitoring (``celery_pgqueue.metrics``).

Plain integers under a lock: the consuming thread, the ack batcher and the lease
keeper all count here. Counting costs a dict update per batch, never a query.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .records import Delivered

#: The events counted, each by queue ("" where the queue is not known).
EVENTS = (
    "claimed",  # messages handed out by a claim
    "empty_claims",  # claims that found nothing (a wakeup for a message another took)
    "handoffs",  # messages a publish leased to this consumer, delivered without a claim
    "handbacks",  # of those, released at once: the consumer could not take them then
    "redelivered",  # of those, deliveries after the first (attempts > 1)
    "acked",  # acks sent (batched acks count when queued)
    "requeued",  # rejected with requeue=True
    "rejected",  # rejected without requeue: moved to the dead letters
    "renewed",  # lease renewals that kept the lease
    "lost_leases",  # renewals that found the lease gone (acked meanwhile, or lapsed)
    "unroutable",  # a persistent message no binding matched: dropped (lost)
    "unroutable_transient",  # a transient one (Celery's events, no monitor): expected
    "publish_failed",  # unconfirmed publishes (confirm_publish=False) the server refused
    "publish_lost",  # unconfirmed publishes in flight on a connection that broke
)

_lock = threading.Lock()
_counts: Counter[tuple[str, str]] = Counter()


def add(event: str, queue: str = "", amount: int = 1) -> None:
    if amount:
        with _lock:
            _counts[(event, queue)] += amount


def snapshot() -> dict[tuple[str, str], int]:
    """``{(event, queue): count}`` since the process started."""
    with _lock:
        return dict(_counts)


def reset() -> None:
    with _lock:
        _counts.clear()


def claimed(queue: str, rows: Sequence[Delivered]) -> None:
    """What a claim from ``queue`` handed out (an empty claim counts too)."""
    if not rows:
        add("empty_claims", queue)
        return
    with _lock:
        _counts[("claimed", queue)] += len(rows)
        _counts[("redelivered", queue)] += sum(row.attempts > 1 for row in rows)
